"""hvdtrain on a real two-node Slurm cluster: tests/slurm.py with two slurmd, nodes n1 and n2, on this machine
(real munged, slurmctld and slurmd; `slurmd -N`, a port each). What the one-node tests (tests/test_slurm.py) cannot
show: an allocation that spans nodes.

- `hvdtrain run` in a two-node allocation plans one host per node, from Slurm's compressed lists
  (`SLURM_JOB_NODELIST=n[1-2]`, `SLURM_TASKS_PER_NODE=2(x2)`): `-H n1:2,n2:2`.
- `--launcher srun`: sbatch of the rendered script has Slurm start 2 ranks on each node, and Horovod (MPI, from
  PMIx) averages across all 4; a rank failing on n2 gives the job its exit code, and hvdtrain names it and its node.
- horovodrun (Gloo, or mpirun's orted) reaches the other nodes over ssh; n1 and n2 are names only Slurm knows here,
  so such a job stops at horovodrun's ssh check: the test shows what the user is told.

Found on one machine, not a real cluster's behaviour: Open MPI's shared-memory transport (btl vader) crashes the
ranks of two nodes at hvd.init (SIGSEGV in MPI_Comm_dup): its segments are named after the host, and both nodes are
this machine. The specs here set `OMPI_MCA_btl: self,tcp`; nodes of a real cluster each have their own hostname and
/dev/shm. Not shown here: ssh between real nodes, mpirun starting orted on other nodes, and a rank's record
written on another machine (here every node shares this machine's logs.dir).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from tests.slurm import SlurmCluster, slurm_two_nodes_fixture  # noqa: F401 -- the fixture: pytest finds it here
from tests.test_slurm import JOB_TIMEOUT_S, SALLOC_TIMEOUT_S, granted_job, render, submit

pytestmark = pytest.mark.slow

# Each rank averages its rank with the others' and says where it ran, in one write.
WHERE = """\
import os
import sys

import horovod.torch as hvd
import torch

hvd.init()
mean = hvd.allreduce(torch.tensor([float(hvd.rank())]), op=hvd.Average, name="mean").item()
os.write(1, f"RANK {hvd.rank()} of {hvd.size()}: mean {mean} on node {os.environ['SLURMD_NODENAME']}\\n".encode())
if hvd.rank() == int(sys.argv[1]):
    sys.exit(3)
"""


def write_spec(folder: Path, fails: int = -1, controller: str = "mpi") -> Path:
    """job.yaml: 4 ranks of WHERE (rank `fails` exits 3), no hosts, MPI over TCP only (see the module docstring)."""
    (folder / "rank.py").write_text(WHERE)
    spec = folder / "job.yaml"
    spec.write_text(f"script: {json.dumps(str(folder / 'rank.py'))}\nnp: 4\nargs: [{json.dumps(str(fails))}]\n"
                    f"controller: {controller}\nlogs: {{dir: logs}}\n"
                    "env: {OMPI_MCA_btl: 'self,tcp', TF_CPP_MIN_LOG_LEVEL: '2'}\n")
    return spec


def srun_job(cluster: SlurmCluster, tmp_path: Path, fails: int = -1) -> tuple[int, str, tuple[str, int, int]]:
    """sbatch of `hvdtrain render slurm --launcher srun --slots-per-node 2`: (job id, output, (state, code, signal))."""
    script = render(write_spec(tmp_path, fails), flags=("--launcher", "srun", "--slots-per-node", "2"))
    assert "#SBATCH --nodes=2\n#SBATCH --ntasks-per-node=2\n" in script.read_text()
    job = submit(cluster, script)
    result = cluster.wait(job, JOB_TIMEOUT_S)
    assert result.fields["NodeList"] == "n[1-2]", result.fields
    return job, result.output_text, (result.state, result.exit_code, result.signal)


def ranks_said(out: str) -> list[tuple[str, ...]]:
    return sorted(re.findall(r"^\[(\d)\]<stdout>:RANK (\d) of 4: mean 1\.5 on node (n\d)$", out, re.M))


def test_the_srun_launcher_runs_two_ranks_on_each_node(slurm_two_nodes: SlurmCluster, tmp_path: Path) -> None:
    job, out, ended = srun_job(slurm_two_nodes, tmp_path)
    assert ended == ("COMPLETED", 0, 0), out
    assert f"hvdtrain: hosts from Slurm job {job}: n1:2,n2:2 (SLURM_JOB_NODELIST=n[1-2], " \
        "SLURM_TASKS_PER_NODE=2(x2))\n" in out, out
    assert ranks_said(out) == [("0", "0", "n1"), ("1", "1", "n1"), ("2", "2", "n2"), ("3", "3", "n2")], out


def test_a_rank_failing_on_the_second_node_gives_the_job_its_exit_code(slurm_two_nodes: SlurmCluster,
                                                                        tmp_path: Path) -> None:
    _, out, ended = srun_job(slurm_two_nodes, tmp_path, fails=3)
    assert ended == ("FAILED", 3, 0), out
    assert "hvdtrain: rank 3 on host n2 exited with code 3 (the first rank to fail)\n" in out, out
    records = {r["rank"]: r for r in (json.loads(p.read_text()) for p in (tmp_path / "logs" / "records").glob("*"))}
    # Its record, from the rank itself: the second task on its node (the host in it is this machine's hostname).
    assert (records[3]["local_rank"], records[3]["code"], records[3]["exception"]) == (1, 3, "SystemExit"), records


def test_horovodrun_in_a_two_node_allocation_plans_a_host_per_node(slurm_two_nodes: SlurmCluster,
                                                                   tmp_path: Path) -> None:
    """--dry-run shows the plan; run for real, horovodrun's ssh check stops at names only Slurm knows here."""
    spec = write_spec(tmp_path, controller="gloo")
    cli = [sys.executable, "-m", "hvdtrain.cli", "run", str(spec)]
    dry = slurm_two_nodes.run(["salloc", "-N2", "--ntasks-per-node=2", *cli, "--dry-run"], SALLOC_TIMEOUT_S)
    job = granted_job(dry.output)
    assert dry.returncode == 0, dry.describe()
    assert f"# hosts from Slurm job {job}: n1:2,n2:2 (SLURM_JOB_NODELIST=n[1-2], SLURM_TASKS_PER_NODE=2(x2))\n" \
        in dry.output, dry.output
    assert re.search(r"hvdtrain-horovodrun -np 4 -H n1:2,n2:2 --gloo ", dry.output), dry.output
    real = slurm_two_nodes.run(["salloc", "-N2", "--ntasks-per-node=2", *cli], SALLOC_TIMEOUT_S)
    assert real.returncode == 1, real.describe()
    for node in ("n1", "n2"):
        assert re.search(rf"^ssh not successful for host {node}:\nssh: Could not resolve hostname {node}",
                         real.output, re.M), real.output
    assert "hvdtrain: horovodrun could not reach every host over ssh" in real.output, real.output
    assert "`hvdtrain doctor --hosts n1:2,n2:2`" in real.output and "RuntimeError" not in real.output, real.output
    assert not (tmp_path / "logs" / "records").exists() or not any((tmp_path / "logs" / "records").iterdir())
