"""Real 2-host jobs over ssh: `hvdtrain run` and `hvdtrain doctor --hosts` against two test-only hosts.

The hosts are Linux network namespaces with their own sshd, address and hostname (tests/support/netns.py); they share
this machine's filesystem, so the same venv and rank program run there over ssh. The launcher stays in the root
namespace, which horovodrun does not count as either host: it must ssh (Gloo) or start `orted` over ssh (MPI).

- a 2-host job with Gloo and with MPI: each rank writes where it ran (hostname, its namespace's address and
  inode) and what the collectives returned; the test checks rank r ran on host r and the sums are right.
- a host's link cut mid-training (`ip link set <veth> down`): the job fails (non-zero exit) within a bound, and
  afterwards no process of the job is left, in either namespace or on the launcher side.
- `hvdtrain doctor --hostfile/--hosts`: reachable hosts pass; an address nobody has and a wrong ssh port fail,
  naming the host, within a bound.
"""

from __future__ import annotations

import json
import os
import pwd
import re
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import yaml

from hvdtrain.doctor.ssh import unreachable_hosts
from hvdtrain.records import read_records
from tests.support import netns
from tests.support.harness import BIN, REPO, JobResult, expect_ok, kill_launcher_when, run_bounded, wait_gone

pytestmark = pytest.mark.slow

HVDTRAIN = str(BIN / "hvdtrain")
SCRIPT = REPO / "tests" / "scripts" / "multihost_allreduce.py"
JOB_TIMEOUT_S = 240  # a healthy job takes 8-35 s here (2 cores shared with other test runs)
GLOO_TIMEOUT_S = 15  # also bounds rendezvous: the two ranks may start some seconds apart on a busy machine
LOOP_S = 3600  # the cut-link job's training loop: it never ends by itself
# How long after the cut the job may take to fail: Gloo waits GLOO_TIMEOUT_S on the lost peer; mpirun notices the
# lost orted by TCP keepalive (MPI_KEEPALIVE: ~5 s). Plus horovodrun's teardown (5 s grace) and a loaded machine.
DETECT_BOUND_S = {"gloo": GLOO_TIMEOUT_S + 45, "mpi": 60}
# Without these, mpirun and the cut host's orted wait for the kernel's TCP keepalive (2 h): the job hangs.
# OMPI_MCA_* reach mpirun and, as -mca arguments, every orted.
MPI_KEEPALIVE = {"OMPI_MCA_oob_tcp_keepalive_time": "2", "OMPI_MCA_oob_tcp_keepalive_intvl": "1",
                 "OMPI_MCA_oob_tcp_keepalive_probes": "3"}
SETTLE_S = 30  # after the job: how long its processes may take to be gone (a cut host's rank times out itself)


@pytest.fixture
def cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[netns.SshCluster]:
    reason = netns.unavailable_reason()
    if reason:
        pytest.skip(f"no namespace ssh hosts: {reason}")
    keys = tmp_path / "cluster"
    keys.mkdir()
    user_known = Path(pwd.getpwuid(os.getuid()).pw_dir) / ".ssh" / "known_hosts"  # ssh's ~ is passwd's, not $HOME
    before = user_known.read_bytes() if user_known.exists() else None
    with netns.ssh_cluster(keys) as found:
        # Every ssh of this test and of the jobs it starts uses the cluster's private known_hosts and config.
        for name, value in found.client_env().items():
            monkeypatch.setenv(name, value)
        yield found
    after = user_known.read_bytes() if user_known.exists() else None
    assert after == before, f"the test changed {user_known}: see NOTE [ The user's ssh state is never touched ]"


def _needs_mpirun(controller: str) -> None:
    if controller == "mpi" and shutil.which("mpirun") is None:
        pytest.skip("mpirun is not installed (scripts/setup.sh installs openmpi-bin)")


def write_job(tmp_path: Path, cluster: netns.SshCluster, controller: str, out: Path, loop_s: int = 0) -> Path:
    """A job spec naming the two hosts through a hostfile, with the cluster's ssh key and port."""
    (tmp_path / "hosts.txt").write_text("# the namespace hosts\n" + "".join(
        f"{h.address} slots=1\n" for h in cluster.hosts))
    spec = {
        "script": str(SCRIPT),
        "args": [str(out), *([str(loop_s)] if loop_s else [])],
        "np": 2,
        "hostfile": "hosts.txt",
        "controller": controller,
        "network_interfaces": ["eth0"],  # every namespace host has eth0; so does the launcher (Gloo rendezvous)
        "ssh": {"identity_file": str(cluster.identity_file), "port": 22},
        "horovod": {"gloo_timeout_s": GLOO_TIMEOUT_S},
        "env": MPI_KEEPALIVE if controller == "mpi" else {},
    }
    job = tmp_path / f"job.{controller}.yaml"
    job.write_text(yaml.safe_dump(spec))
    out.mkdir(exist_ok=True)
    return job


def check_ranks(out: Path, cluster: netns.SshCluster, result: JobResult) -> None:
    """Rank r ran on host r (its hostname, address and network namespace) and the collectives are right."""
    files = [out / f"result.{r}.json" for r in range(2)]
    missing = [f.name for f in files if not f.exists()]
    assert not missing, f"no {missing}\n{result.describe()}"
    results = [json.loads(f.read_text()) for f in files]
    launcher_netns = os.stat("/proc/self/ns/net").st_ino
    for rank, (got, host) in enumerate(zip(results, cluster.hosts, strict=True)):
        where = f"rank {rank}: {got}"
        assert (got["rank"], got["size"]) == (rank, 2), where
        assert got["hostname"] == host.hostname, where
        assert got["addresses"] == [host.address], where
        assert got["netns_inode"] != launcher_netns, where
        assert (got["local_rank"], got["cross_rank"]) == (0, rank), where  # Horovod itself saw two hosts
        assert got["sum"] == [3.0, 300.0], where  # (1 + 2, 100 + 200)
        assert got["average"] == [1.5, 150.0], where
        assert got["gathered_ranks"] == [0, 1], where
    assert results[0]["netns_inode"] != results[1]["netns_inode"]


def leftovers(cluster: netns.SshCluster, marks: list[str]) -> list[str]:
    """Non-sshd processes in the hosts' namespaces, and processes anywhere whose command line names this test's
    output folder or a host address (ranks, orted, ssh clients, horovodrun, mpirun)."""
    found = [f"{h.namespace} pid {pid}: {cmd}" for h in cluster.hosts
             for pid, cmd in netns.namespace_processes(h.namespace).items() if not cmd.startswith("sshd")]
    for p in psutil.process_iter(["pid", "cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if p.info["pid"] != os.getpid() and any(m in cmd for m in marks) and not cmd.startswith("sshd"):
            found.append(f"pid {p.info['pid']}: {cmd}")
    return found


def wait_until_clean(cluster: netns.SshCluster, marks: list[str]) -> float:
    """Seconds until nothing of the job is left; fails the test (listing them) after SETTLE_S."""
    start = time.monotonic()
    while (left := leftovers(cluster, marks)) and time.monotonic() - start < SETTLE_S:
        time.sleep(0.5)
    assert not left, "processes of the job outlived it:\n  " + "\n  ".join(left)
    return time.monotonic() - start


@pytest.mark.timeout(JOB_TIMEOUT_S + 120)
@pytest.mark.parametrize("controller", ["gloo", "mpi"])
def test_a_two_host_job_runs_one_rank_on_each_host_with_the_right_sums(controller, cluster, tmp_path):
    _needs_mpirun(controller)
    out = tmp_path / "out"
    job = write_job(tmp_path, cluster, controller, out)
    start = time.monotonic()
    result = expect_ok(run_bounded([HVDTRAIN, "run", str(job)], timeout=JOB_TIMEOUT_S))
    print(f"{controller}: 2-host job wall time {time.monotonic() - start:.1f} s")
    check_ranks(out, cluster, result)
    wait_until_clean(cluster, [str(out), *(h.address for h in cluster.hosts)])


def _cut_when_training(out: Path, host: netns.SshHost, state: dict, stop: threading.Event) -> None:
    """Once both ranks are in their training loop, take the host's link down; note when."""
    while not stop.is_set():
        if all((out / f"ready.{r}").exists() for r in range(2)):
            subprocess.run(["ip", "link", "set", host.host_veth, "down"], check=True, capture_output=True,
                           timeout=30)
            state["cut_at"] = time.monotonic()
            return
        stop.wait(0.2)


@pytest.mark.timeout(JOB_TIMEOUT_S + 120)
@pytest.mark.parametrize("controller", ["gloo", "mpi"])
def test_cutting_a_hosts_link_mid_training_fails_the_job_in_bounded_time_leaving_nothing(
        controller, cluster, tmp_path):
    """Near 30 s under Gloo: the lost peer is found by Gloo's timeout (GLOO_TIMEOUT_S), which must outlast a slow
    rendezvous on a busy machine."""
    _needs_mpirun(controller)
    out = tmp_path / "out"
    job = write_job(tmp_path, cluster, controller, out, loop_s=LOOP_S)
    cut = cluster.hosts[1]
    state: dict = {}
    stop = threading.Event()
    cutter = threading.Thread(target=_cut_when_training, args=(out, cut, state, stop), daemon=True)
    cutter.start()
    start = time.monotonic()
    try:
        result = run_bounded([HVDTRAIN, "run", str(job)], timeout=JOB_TIMEOUT_S)
    finally:
        stop.set()
        cutter.join(timeout=30)
    ended = time.monotonic()
    assert "cut_at" in state, f"the ranks never reached their training loop\n{result.describe()}"
    detect = ended - state["cut_at"]
    print(f"{controller}: job failed {detect:.1f} s after the cut (link cut {state['cut_at'] - start:.1f} s "
          f"after start; exit code {result.returncode})")
    assert result.returncode != 0, result.describe()
    assert detect < DETECT_BOUND_S[controller], f"took {detect:.1f} s\n{result.describe()}"
    assert not list(out.glob("finished.*")), result.describe()
    # hvdtrain names the lost host: mpirun says which daemon it lost; with Gloo (whose output names no host: the
    # healthy rank gave up waiting) hvdtrain asks ssh which of the job's hosts is unreachable.
    if controller == "mpi":
        assert f"hvdtrain: lost contact with host {cut.address} (mpirun" in result.output, result.describe()
    else:
        assert "Timed out waiting" in result.output, result.describe()
        assert re.search(rf"hvdtrain: host {re.escape(cut.address)} is unreachable now \(.+\); it is the likely "
                         "cause", result.output), result.describe()
        lost = unreachable_hosts([h.address for h in cluster.hosts], 22, str(cluster.identity_file))
        assert list(lost) == [cut.address], lost  # and only that host
    settle = wait_until_clean(cluster, [str(out), *(h.address for h in cluster.hosts)])
    print(f"{controller}: every process of the job gone {settle:.1f} s after hvdtrain exited")


# ---- hvdtrain doctor --hosts / --hostfile against the same hosts -------------------------------------------

def doctor(*args: str) -> tuple[JobResult, float, dict[str, str]]:
    """Run `hvdtrain doctor ARGS`; return the result, its wall time and {check name: its line}."""
    start = time.monotonic()
    result = run_bounded([HVDTRAIN, "doctor", *args], timeout=180)
    lines = {line.split("]", 1)[1].strip().split("  ")[0]: line for line in result.output.splitlines()
             if line.startswith("[")}
    return result, time.monotonic() - start, lines


@pytest.mark.timeout(300)
def test_doctor_passes_for_reachable_hosts_from_a_hostfile(cluster, tmp_path):
    hostfile = tmp_path / "hosts.txt"
    hostfile.write_text("".join(f"{h.address} slots=1\n" for h in cluster.hosts))
    result, _, lines = doctor("--hostfile", str(hostfile), "--ssh-port", "22",
                              "--ssh-identity-file", str(cluster.identity_file))
    assert result.returncode == 0, result.describe()
    for host in cluster.hosts:
        for check in ("ssh", "Python", "Horovod"):
            assert lines[f"{host.address}: {check}"].startswith("[ok  ]"), result.output
    assert lines["Common NIC"].startswith("[ok  ]") and "eth0" in lines["Common NIC"], result.output


@pytest.mark.timeout(300)
def test_doctor_fails_naming_a_host_nobody_has_and_a_wrong_port_in_bounded_time(cluster):
    """One doctor run, both failures: an address nobody has (ssh's connect timeout is what the doctor bounds) and a
    host whose sshd is not on the port given (refused at once)."""
    good = cluster.hosts[0].address
    nobody = good.rsplit(".", 1)[0] + ".99"  # on the bridge's subnet, but no namespace answers for it
    result, took, lines = doctor("--hosts", f"{good}:1,{nobody}:1", "--ssh-port", "2222",
                                 "--ssh-identity-file", str(cluster.identity_file))
    print(f"doctor with a missing host and a wrong port: {took:.1f} s; {lines.get(f'{nobody}: ssh')}")
    assert result.returncode == 1, result.describe()
    assert lines[f"{good}: ssh"].startswith("[FAIL]") and "Connection refused" in lines[f"{good}: ssh"], result.output
    assert "sshd listens on port 2222" in result.output
    assert lines[f"{nobody}: ssh"].startswith("[FAIL]"), result.output
    assert f"fix: check that {nobody} is up" in result.output
    assert f"doctor: FAILED: {good}: ssh, {nobody}: ssh, Common NIC\n" in result.output, result.output
    assert took < 120, f"took {took:.0f} s"


# ---- the launcher killed mid-training: nothing of the job survives it, on either host -----------------------

KILLED_BOUND_S = 20  # SIGKILL/SIGHUP of hvdtrain -> every process of the job gone (measured: ~1-3 s)


@pytest.mark.timeout(JOB_TIMEOUT_S + 120)
@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGHUP], ids=["SIGKILL", "SIGHUP"])
@pytest.mark.parametrize("controller", ["gloo", "mpi"])
def test_killing_the_launcher_mid_training_ends_every_rank_on_every_host(controller, signum, cluster, tmp_path):
    """Gloo's remote ranks run under `ssh host '...'`: nothing but hvdtrain's rank supervisor ends them when the
    launcher side dies (NOTE [no orphans]); MPI's go down with mpirun's orted."""
    _needs_mpirun(controller)
    out = tmp_path / "out"
    job = write_job(tmp_path, cluster, controller, out, loop_s=LOOP_S)
    killed = kill_launcher_when([HVDTRAIN, "run", str(job)], lambda: all(
        (out / f"ready.{r}").exists() for r in range(2)), signum, timeout=JOB_TIMEOUT_S)
    assert killed.ready, f"the ranks never reached their training loop\n{killed.output}"
    assert killed.returncode == (-signal.SIGKILL if signum == signal.SIGKILL else 128 + signum), killed.output
    gone = wait_gone(killed.processes, KILLED_BOUND_S)  # first: it kills what outlived the bound (no leak)
    wait_until_clean(cluster, [str(out), *(h.address for h in cluster.hosts)])
    settle = time.monotonic() - killed.signalled_at
    print(f"{controller} {signal.Signals(signum).name}: every process of the job gone {settle:.1f} s after it")
    assert settle < KILLED_BOUND_S, f"took {settle:.1f} s\n{killed.output}"
    assert not gone, "launcher-side processes outlived it:\n  " + "\n  ".join(gone)
    assert not list(out.glob("finished.*")), killed.output


@pytest.mark.timeout(JOB_TIMEOUT_S + 120)
@pytest.mark.parametrize("controller", ["gloo", "mpi"])
def test_a_rank_that_raises_on_another_host_is_named_from_its_record(controller, cluster, tmp_path):
    """The rank on the second host raises: its record, written on that host (the namespace hosts share this
    machine's filesystem, as an NFS-mounted logs.dir would), names the exception; Gloo's lines alone could not."""
    _needs_mpirun(controller)
    out = tmp_path / "out"
    job = write_job(tmp_path, cluster, controller, out)
    spec = yaml.safe_load(job.read_text())
    spec.update(script=str(REPO / "tests" / "scripts" / "raise_on_rank.py"), args=["raise"],
                logs={"dir": str(tmp_path / "logs")})
    job.write_text(yaml.safe_dump(spec))
    result = run_bounded([HVDTRAIN, "run", str(job)], timeout=JOB_TIMEOUT_S)
    assert result.returncode == 1, result.describe()
    host = cluster.hosts[1].address
    assert f"hvdtrain: rank 1 on host {host} raised ValueError: bad sample 17 in shard 3" in result.output, \
        result.describe()
    (record,) = [r for r in read_records(tmp_path / "logs" / "records") if r.rank == 1]
    assert record.exception == "ValueError" and record.code == 1
    wait_until_clean(cluster, [str(out), *(h.address for h in cluster.hosts)])
