"""hvdtrain on a real two-node Slurm cluster: tests/support/slurm.py with a slurmd on each test host of
tests/support/netns.py (network namespaces on a bridge, each with its own address, hostname and sshd), real munged,
slurmctld and slurmd. What the one-node tests (tests/cluster/test_slurm.py) cannot show: a job that spans nodes.

- A rendered sbatch script: `hvdtrain run` on the first node plans one host per node from Slurm's compressed lists
  (`SLURM_JOB_NODELIST=hvdt<N>h[1-2]`, `SLURM_TASKS_PER_NODE=2(x2)`), and 2 ranks run on each node, averaging
  across all 4: horovodrun over ssh to both nodes (Gloo), mpirun with its daemon on the other node started through
  Slurm (MPI: Open MPI's plm/slurm, no ssh), and Slurm's own tasks (`--launcher srun`, PMIx).
- A rank failing on the second node gives the job its exit code, named with its node, under horovodrun and srun.
- `hvdtrain run` in an salloc shell (on the submitting machine, not a node) whose ssh cannot resolve the nodes'
  names: the job stops at horovodrun's ssh check, and hvdtrain says which `hvdtrain doctor --hosts` checks them.

The nodes share this machine's disk (the venv, the spec, logs.dir) and /dev/shm, as nodes on a shared filesystem
do, except /dev/shm. Seen while building this: two slurmd in one network namespace under one hostname (`slurmd
-N`) also run a two-node job, but Open MPI's shared-memory transport then crashes the ranks of both nodes at
hvd.init (SIGSEGV in MPI_Comm_dup): its segments are named after the host.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest

from tests.support.slurm import JOB_TIMEOUT_S, SALLOC_TIMEOUT_S, SlurmCluster, granted_job, render, submit

pytestmark = pytest.mark.slow

# Each rank averages its rank with the others' and says where it ran, in one write; rank argv[1] then exits 3.
WHERE = """\
import os
import socket
import sys

import horovod.torch as hvd
import torch

hvd.init()
mean = hvd.allreduce(torch.tensor([float(hvd.rank())]), op=hvd.Average, name="mean").item()
os.write(1, f"RANK {hvd.rank()} of {hvd.size()}: mean {mean} on {socket.gethostname()}\\n".encode())
if hvd.rank() == int(sys.argv[1]):
    sys.exit(3)
"""


def write_spec(folder: Path, controller: str, fails: int = -1, extra: str = "", env: str = "") -> Path:
    """job.yaml: 4 ranks of WHERE (rank `fails` exits 3), no hosts."""
    (folder / "rank.py").write_text(WHERE)
    spec = folder / "job.yaml"
    spec.write_text(f"script: {json.dumps(str(folder / 'rank.py'))}\nnp: 4\nargs: [{json.dumps(str(fails))}]\n"
                    f"controller: {controller}\nlogs: {{dir: logs}}\nenv: {{TF_CPP_MIN_LOG_LEVEL: '2'{env}}}\n"
                    + extra)
    return spec


def two_node_job(cluster: SlurmCluster, tmp_path: Path, launcher: str, fails: int = -1) -> tuple[str, str]:
    """sbatch of `hvdtrain render slurm --slots-per-node 2` (`launcher`: gloo or mpi under horovodrun, or srun):
    (the job's output, "STATE code:signal")."""
    flags = ["--slots-per-node", "2", *(["--launcher", "srun"] if launcher == "srun" else [])]
    # Under MPI, mpirun must start its daemon on the second node through Slurm (plm/slurm): never ssh, which the
    # hosts' private ssh config would let it use.
    env = ", OMPI_MCA_plm: slurm" if launcher == "mpi" else ""
    script = render(write_spec(tmp_path, "gloo" if launcher == "gloo" else "mpi", fails, env=env), flags=flags)
    assert "#SBATCH --nodes=2\n#SBATCH --ntasks-per-node=2\n" in script.read_text()
    job = submit(cluster, script)
    result = cluster.wait(job, JOB_TIMEOUT_S)
    nodes = ",".join(cluster.node_names)
    assert f"hvdtrain: hosts from Slurm job {job}: {nodes.replace(',', ':2,')}:2 (SLURM_JOB_NODELIST=" \
        f"{cluster.node[:-1]}[1-2], SLURM_TASKS_PER_NODE=2(x2))\n" in result.output_text, result.output_text
    return result.output_text, f"{result.state} {result.exit_code}:{result.signal}"


@pytest.mark.parametrize("launcher", ["gloo", "mpi", "srun"])
def test_two_ranks_run_on_each_node(slurm_two_nodes: SlurmCluster, tmp_path: Path, launcher: str) -> None:
    """The nodes know each other's names (NOTE [ Each host's names ] in tests/support/netns.py): without that,
    horovodrun's lookups waited ~30 s on a DNS server the namespaces cannot reach."""
    out, ended = two_node_job(slurm_two_nodes, tmp_path, launcher)
    assert ended == "COMPLETED 0:0", out
    first, second = slurm_two_nodes.node_names
    ranks = sorted(re.findall(r"^\[(\d)\]<stdout>:RANK (\d) of 4: mean 1\.5 on (\S+)$", out, re.M))
    assert ranks == [("0", "0", first), ("1", "1", first), ("2", "2", second), ("3", "3", second)], out


@pytest.mark.parametrize("launcher", ["gloo", "srun"])
def test_a_rank_failing_on_the_second_node_gives_the_job_its_exit_code(slurm_two_nodes: SlurmCluster,
                                                                        tmp_path: Path, launcher: str) -> None:
    out, ended = two_node_job(slurm_two_nodes, tmp_path, launcher, fails=3)
    second = slurm_two_nodes.node_names[1]
    assert ended == "FAILED 3:0", out
    assert f"hvdtrain: rank 3 on host {second} exited with code 3 (the first rank to fail)\n" in out, out
    records = [json.loads(p.read_text()) for p in (tmp_path / "logs" / "records").glob("rank.*.json")]
    assert {(r["rank"], r["host"], r["code"]) for r in records if r["rank"] == 3} == {(3, second, 3)}, records


def test_nodes_ssh_cannot_reach_are_said_with_the_check_to_run(slurm_two_nodes: SlurmCluster, tmp_path: Path) -> None:
    """In an salloc shell on this machine, with an ssh that knows nothing of the nodes' names (not the hosts'
    private config): --dry-run plans a host per node; the run stops at horovodrun's ssh check, before any rank.
    horovodrun skips that check for hosts that passed it in the last hour (its cache, ~/.horovod): as the other
    tests' jobs did here; then the ranks fail to start instead (ssh's exit 255). `--disable-cache` checks anew."""
    spec = write_spec(tmp_path, "gloo", extra="extra_args: [--disable-cache]\n")
    cli = [sys.executable, "-m", "hvdtrain.cli", "run", str(spec)]
    plain = {"PATH": os.environ["PATH"]}  # the system's ssh: no config naming the nodes
    nodes = ",".join(f"{name}:2" for name in slurm_two_nodes.node_names)
    dry = slurm_two_nodes.run(["salloc", "-N2", "--ntasks-per-node=2", *cli, "--dry-run"], SALLOC_TIMEOUT_S, plain)
    assert dry.returncode == 0, dry.describe()
    assert f"# hosts from Slurm job {granted_job(dry.output)}: {nodes} " in dry.output, dry.output
    assert f"hvdtrain-horovodrun -np 4 -H {nodes} --gloo --disable-cache " in dry.output, dry.output
    real = slurm_two_nodes.run(["salloc", "-N2", "--ntasks-per-node=2", *cli], SALLOC_TIMEOUT_S, plain)
    assert real.returncode == 1, real.describe()
    for name in slurm_two_nodes.node_names:
        assert f"ssh not successful for host {name}:\nssh: Could not resolve hostname {name}" in real.output, \
            real.output
    assert f"hvdtrain: horovodrun could not reach every host over ssh (`ssh not successful for host ...` above " \
        f"names each, with ssh's error), so no rank started. Check the hosts with `hvdtrain doctor --hosts " \
        f"{nodes}`" in real.output and "RuntimeError" not in real.output, real.output
    assert not list((tmp_path / "logs" / "records").glob("rank.*.json"))
