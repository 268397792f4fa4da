"""scripts/fresh_state.sh removes what earlier runs left (hvdtrain's cache, horovodrun's build-probe answers, an
empty privsep dir, the test hosts' known_hosts lines, segments of dead processes, a killed test run's namespaces and
bridge, a killed test run's Slurm cluster) and nothing else: not a live test run's. Run with HOME and every path
pointed at tmp_path (TMPDIR, where the Slurm clusters are, included); only the namespace test lets it touch the
machine's namespaces."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.support import netns, slurm
from tests.support.harness import REPO

SCRIPT = REPO / "scripts" / "fresh_state.sh"
KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsabgH5C9okWi0dh2l9GKJl"


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(timeout=30)
    return proc.pid


def run(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items()
            if k not in ("HVDTRAIN_CACHE_DIR", "HVDTRAIN_DATA_CACHE", "XDG_CACHE_HOME", "HOROVOD_BUILD_CACHE_DIR")}
    full = {**base, "HOME": str(tmp_path / "home"), "TMPDIR": str(tmp_path / "tmp"),
            "HVDTRAIN_PRIVSEP_DIR": str(tmp_path / "sshd"),
            "HVDTRAIN_SHM_DIR": str(tmp_path / "shm"), "HVDTRAIN_SKIP_NETNS": "1", **env}
    return subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=120, env=full,
                          stdin=subprocess.DEVNULL, check=False)


@pytest.mark.skipif(shutil.which("ssh-keygen") is None, reason="ssh-keygen not installed")
def test_removes_what_earlier_runs_left_and_nothing_else(tmp_path):
    home = tmp_path / "home"
    (home / ".cache" / "hvdtrain").mkdir(parents=True)
    (home / ".cache" / "hvdtrain" / "controllers.json").write_text("{}")
    (home / ".cache" / "other").mkdir()
    (home / ".horovod").mkdir()
    for name in ("build-flags-0123456789abcdef.json", "cache.bin"):  # the probe's answers; horovodrun's own cache
        (home / ".horovod" / name).write_text("{}")
    (home / ".ssh").mkdir()
    known = home / ".ssh" / "known_hosts"
    known.write_text(f"10.213.57.11 {KEY}\nserver1 {KEY}\n10.213.57.12 {KEY}\n10.0.0.7 {KEY}\n")
    (tmp_path / "sshd").mkdir()
    shm = tmp_path / "shm"
    shm.mkdir()
    stale, live = f"hvdtrain_{dead_pid()}_a1", f"hvdtrain_{os.getpid()}_b2"
    for name in (stale, live, "other_segment"):
        (shm / name).write_bytes(b"x")

    proc = run(tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert not (home / ".cache" / "hvdtrain").exists(), proc.stdout
    assert (home / ".cache" / "other").is_dir()
    assert [p.name for p in (home / ".horovod").iterdir()] == ["cache.bin"], proc.stdout
    kept = [line.split()[0] for line in known.read_text().splitlines()]
    assert kept == ["server1", "10.0.0.7"], proc.stdout
    assert not (home / ".ssh" / "known_hosts.old").exists()
    assert sorted(p.name for p in shm.iterdir()) == sorted([live, "other_segment"]), proc.stdout
    if subprocess.run(["pgrep", "-x", "sshd"], capture_output=True, timeout=10).returncode != 0:
        assert not (tmp_path / "sshd").exists(), proc.stdout
    assert "removed 2 test host(s)" in proc.stdout and f"removing stale shared-memory segment {shm / stale}" \
        in proc.stdout


def test_leaves_a_non_empty_privsep_dir_and_runs_on_an_empty_machine(tmp_path):
    (tmp_path / "sshd").mkdir()
    (tmp_path / "sshd" / "keep").write_text("not ours")
    proc = run(tmp_path)  # no home, no cache, no shm directory at all
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (tmp_path / "sshd" / "keep").exists()
    assert proc.stdout == "", proc.stdout


def test_honours_hvdtrain_cache_dir(tmp_path):
    cache = tmp_path / "elsewhere"
    cache.mkdir()
    (tmp_path / "home" / ".cache" / "hvdtrain").mkdir(parents=True)
    proc = run(tmp_path, HVDTRAIN_CACHE_DIR=str(cache))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert not cache.exists()
    assert (tmp_path / "home" / ".cache" / "hvdtrain").is_dir()


def test_removes_the_dataset_cache_default_or_named(tmp_path):
    default = tmp_path / "tmp" / f"hvdtrain-data-{os.getuid()}"
    (default / "digits-0123").mkdir(parents=True)
    (default / "digits-0123" / "shard.00000.mds").write_bytes(b"x")
    (tmp_path / "tmp" / "other").mkdir()
    proc = run(tmp_path)
    assert proc.returncode == 0 and not default.exists() and (tmp_path / "tmp" / "other").is_dir(), proc.stdout
    named = tmp_path / "fast-disk" / "cache"
    named.mkdir(parents=True)
    proc = run(tmp_path, HVDTRAIN_DATA_CACHE=str(named))
    assert proc.returncode == 0 and not named.exists() and f"removing the dataset cache {named}" in proc.stdout


def test_removes_a_killed_runs_test_hosts_but_not_a_live_one(tmp_path):
    reason = netns.unavailable_reason()
    if reason:
        pytest.skip(f"no network namespaces: {reason}")
    tok = str(900000 + os.getpid() % 100000)  # never a live session's token (those are pid % 100000)
    stale, live, bridge = f"hvdt{tok}h1", f"hvdt{tok}h2", f"hb{tok}"
    sh = ["ip", "netns", "exec", live, "sleep", "120"]
    sleeper = None
    try:
        for argv in (["ip", "netns", "add", stale], ["ip", "netns", "add", live],
                     ["ip", "link", "add", bridge, "type", "bridge"]):
            subprocess.run(argv, check=True, capture_output=True, timeout=30)
        sleeper = subprocess.Popen(sh)
        deadline = time.monotonic() + 20
        while not netns.namespace_processes(live) and time.monotonic() < deadline:
            time.sleep(0.1)
        proc = run(tmp_path, HVDTRAIN_SKIP_NETNS="0")
        assert proc.returncode == 0, proc.stdout + proc.stderr
        names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
        assert stale not in names and live in names, proc.stdout
        assert f"removing the test host namespace {stale}" in proc.stdout
        links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, timeout=30).stdout
        assert f" {bridge}:" in links, "the bridge of a namespace still in use must stay"

        sleeper.kill()
        sleeper.wait(timeout=30)
        proc = run(tmp_path, HVDTRAIN_SKIP_NETNS="0")
        names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
        links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, timeout=30).stdout
        assert live not in names and f" {bridge}:" not in links, proc.stdout
    finally:
        if sleeper is not None and sleeper.poll() is None:
            sleeper.kill()
            sleeper.wait(timeout=30)
        for argv in (["ip", "netns", "del", stale], ["ip", "netns", "del", live], ["ip", "link", "del", bridge]):
            subprocess.run(argv, capture_output=True, timeout=30, check=False)


def sleeper(argv: list[str], **env: str) -> subprocess.Popen:
    """A stand-in for a process of a test Slurm cluster: `argv` (sleeping), with `env` added to its environment."""
    return subprocess.Popen(argv, env={**os.environ, **env}, stdin=subprocess.DEVNULL)


def test_removes_a_killed_runs_slurm_cluster_but_not_a_live_one(tmp_path):
    """Fake clusters (no daemons): a directory whose owner runs is kept with its processes; one whose owner is gone,
    or whose owner's pid now names another process (another start time), or that has no owner and is old, is
    removed and its processes are killed, whether found by SLURM_CONF or by a daemon's command line."""
    tmp = tmp_path / "tmp"
    clusters = {name: tmp / f"{slurm.PREFIX}{name}" for name in ("live", "dead", "reused", "old", "new")}
    for root in clusters.values():
        (root / "etc").mkdir(parents=True)
    slurm.write_owner(clusters["live"])  # this test process: alive
    (clusters["dead"] / "owner").write_text(f"{dead_pid()} 12345\n")
    (clusters["reused"] / "owner").write_text(f"{os.getpid()} {slurm.start_time(os.getpid()) + 1}\n")
    two_minutes_ago = time.time() - 120
    os.utime(clusters["old"], (two_minutes_ago, two_minutes_ago))
    # A daemon found by its command line (no SLURM_CONF): python under the name slurmd, `-f T/etc/slurm.conf`.
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "slurmd").symlink_to(sys.executable)
    nap = "import time; time.sleep(120)"
    procs = {name: sleeper(["sleep", "120"], SLURM_CONF=str(root / "etc" / "slurm.conf"))
             for name, root in clusters.items()}
    procs["gone"] = sleeper(["sleep", "120"], SLURM_CONF=str(tmp / f"{slurm.PREFIX}gone" / "etc" / "slurm.conf"))
    for name in ("live", "dead"):
        procs[f"{name} slurmd"] = sleeper([str(tmp_path / "bin" / "slurmd"), "-c", nap, "-f",
                                           str(clusters[name] / "etc" / "slurm.conf")])
    try:
        proc = run(tmp_path)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        kept = sorted(p.name.removeprefix(slurm.PREFIX) for p in tmp.iterdir())
        assert kept == ["live", "new"], proc.stdout
        doomed = ["dead", "dead slurmd", "gone", "old", "reused"]
        for name in doomed:  # the script waited until they were gone: this only reaps them
            with contextlib.suppress(subprocess.TimeoutExpired):
                procs[name].wait(timeout=10)
        assert {name: p.poll() for name, p in procs.items()} == {
            **dict.fromkeys(doomed, -signal.SIGKILL), **dict.fromkeys(["live", "live slurmd", "new"])}, proc.stdout
        assert f"keeping the test Slurm cluster {clusters['live']}: its test run (pid {os.getpid()}) is alive" \
            in proc.stdout
        assert f"removing the test Slurm cluster's directory {clusters['dead']} (its test run is gone)" in proc.stdout
    finally:
        for p in procs.values():
            p.kill()
            p.wait(timeout=30)


@pytest.mark.slow
def test_keeps_a_live_test_runs_slurm_cluster_and_removes_a_dead_ones(tmp_path):
    """A real cluster of tests/support/slurm.py (munged, slurmctld, slurmd): kept whole while the test process that
    started it runs; once its owner file names a process that is gone, killed and removed."""
    reason = slurm.unavailable_reason()
    if reason:
        pytest.skip(f"no Slurm cluster: {reason}")
    if slurm.missing_binaries():
        pytest.skip(f"Slurm is not installed here (missing: {', '.join(slurm.missing_binaries())})")
    parent = Path(tempfile.mkdtemp(prefix="hvdtrain-fresh-state-"))  # not tmp_path: munged must traverse it
    parent.chmod(0o755)
    try:
        with slurm.slurm_cluster_running(parent) as cluster:
            proc = run(tmp_path, TMPDIR=str(parent))
            assert proc.returncode == 0, proc.stdout + proc.stderr
            assert f"keeping the test Slurm cluster {cluster.root}: its test run (pid {os.getpid()}) is alive" \
                in proc.stdout
            assert "killing" not in proc.stdout and cluster.conf.is_file(), proc.stdout
            assert {name: p.poll() for name, p in cluster.procs.items()} == dict.fromkeys(slurm.DAEMONS), proc.stdout
            assert cluster.run(["scontrol", "ping"], timeout_s=10).returncode == 0

            (cluster.root / "owner").write_text(f"{dead_pid()} 1\n")  # the test run is gone
            proc = run(tmp_path, TMPDIR=str(parent))
            assert proc.returncode == 0, proc.stdout + proc.stderr
            assert not cluster.root.exists(), proc.stdout
            for name, p in cluster.procs.items():
                assert p.wait(timeout=10) == -signal.SIGKILL, (name, proc.stdout)
            assert slurm.cluster_processes(cluster.conf) == {}, proc.stdout
    finally:
        shutil.rmtree(parent, ignore_errors=True)
