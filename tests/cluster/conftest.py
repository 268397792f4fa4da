"""The clusters of tests/cluster/: built once for the folder's tests that use them and shared (package scope),
since each takes seconds to start and its jobs leave nothing behind in it (every test checks that its own
processes are gone)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support import netns
from tests.support.slurm import SlurmCluster, check_slurm, cluster_for_tests


@pytest.fixture(scope="package")
def slurm_cluster() -> Iterator[SlurmCluster]:
    """One single-node Slurm cluster (this machine) for the folder. Skipped when not root; fails, saying how to
    install them, when the Slurm binaries are missing."""
    yield from cluster_for_tests()


@pytest.fixture(scope="package")
def slurm_two_nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    """A two-node cluster, its nodes the two test hosts of tests/support/netns.py. Skipped where those hosts cannot
    be made, as tests/cluster/test_multihost.py is."""
    check_slurm()
    reason = netns.unavailable_reason()
    if reason:
        pytest.skip(f"no namespace hosts for the nodes: {reason}")
    with netns.ssh_cluster(tmp_path_factory.mktemp("slurm-hosts")) as hosts:
        yield from cluster_for_tests(hosts)
