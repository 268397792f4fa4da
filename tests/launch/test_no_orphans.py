"""A job never outlives its launcher (NOTE [no orphans] in hvdtrain/rank.py), with real processes throughout.

- the pieces: lifeline.output_gone on real pipes and sockets; the rank supervisor (`python -m hvdtrain.rank`)
  passing exit codes and signals through, ending its rank when its output's reader goes away (what happens to a
  Gloo rank on another host when its ssh connection ends) and taking the rank down when it is SIGKILLed itself;
  the guard (`python -m hvdtrain.launch.lifeline PGID`) stopping a process group when the launcher's pipe closes.
- whole jobs: `hvdtrain run` of the PyTorch recipe, SIGKILLed or its terminal closed mid-epoch, with Gloo and MPI:
  every process of the job (horovodrun, mpirun, middlemen, supervisors, ranks, loader producers, the guard) is gone
  within seconds. The same on two ssh hosts: tests/cluster/test_multihost.py.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from hvdtrain.launch.lifeline import DONE, output_gone, watchable
from tests.support.harness import BIN, REPO, STARTED_SESSIONS, kill_launcher_when, wait_gone

PY = sys.executable
HVDTRAIN = str(BIN / "hvdtrain")
SLEEPER = str(REPO / "tests" / "scripts" / "sleeper.py")
RECIPE = str(REPO / "recipes" / "pytorch_train.py")
BOUND_S = 20  # launcher killed -> every process of the job gone (measured: 0.5-2 s)


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)


def pid_from(path: Path, timeout: float = 30) -> int:
    wait_for(path.exists, timeout, f"{path.name}")
    return int(path.read_text())


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def supervised(tmp_path: Path, *args: str, **popen) -> tuple[subprocess.Popen, int]:
    """`python -m hvdtrain.rank sleeper.py PID_FILE ARGS`, in a session of its own; (supervisor, rank pid)."""
    pid_file = tmp_path / "rank.pid"
    proc = subprocess.Popen([PY, "-m", "hvdtrain.rank", SLEEPER, str(pid_file), *args], start_new_session=True,
                            **popen)
    STARTED_SESSIONS.add(proc.pid)
    return proc, pid_from(pid_file)


# ---- the pieces ----------------------------------------------------------------------------------------------

def test_output_gone_sees_a_pipe_or_socket_whose_reader_closed(tmp_path):
    r, w = os.pipe()
    a, b = socket.socketpair()
    with open(tmp_path / "f", "w") as f:
        assert watchable((w, a.fileno(), f.fileno())) == (w, a.fileno())  # a file's reader never "goes away"
    assert not output_gone((w, a.fileno()))
    os.close(r)
    assert output_gone((w,))
    assert not output_gone((a.fileno(),))
    b.close()
    assert output_gone((a.fileno(),))
    os.close(w)
    a.close()


def test_the_supervisor_exits_with_the_ranks_code_and_forwards_signals(tmp_path):
    proc = subprocess.run([PY, "-m", "hvdtrain.rank", SLEEPER, str(tmp_path / "a.pid"), "0.1", "7"], timeout=60)
    assert proc.returncode == 7
    proc, rank = supervised(tmp_path)
    proc.send_signal(signal.SIGUSR1)
    wait_for((tmp_path / "rank.pid.usr1").exists, 10, "SIGUSR1 forwarded to the rank")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=10) == -signal.SIGTERM  # the rank died of SIGTERM: so does its supervisor
    assert not alive(rank)


def test_the_rank_ends_when_the_reader_of_its_output_goes_away(tmp_path):
    """What a Gloo rank on another host sees when its ssh connection ends: sshd closes the command's pipes."""
    proc, rank = supervised(tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    time.sleep(1)
    assert alive(rank) and proc.poll() is None  # nothing ends a healthy rank
    start = time.monotonic()
    proc.stdout.close()
    proc.stderr.close()
    wait_for(lambda: not alive(rank), 5, "the rank to end after its output's reader closed")
    assert proc.wait(timeout=5) == -signal.SIGTERM
    print(f"rank gone {time.monotonic() - start:.2f} s after its output's reader closed")


@pytest.mark.slow
def test_a_rank_that_ignores_sigterm_is_killed_after_the_grace(tmp_path):
    from hvdtrain.rank import GRACE_S

    proc, rank = supervised(tmp_path, "--ignore-term", stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    start = time.monotonic()
    proc.stdout.close()
    wait_for(lambda: not alive(rank), GRACE_S + 5, "SIGKILL after the grace")
    assert time.monotonic() - start >= GRACE_S - 0.5
    assert proc.wait(timeout=5) == -signal.SIGKILL


def test_the_rank_dies_with_a_sigkilled_supervisor(tmp_path):
    proc, rank = supervised(tmp_path, "--ignore-term")
    proc.kill()
    proc.wait(timeout=10)
    wait_for(lambda: not alive(rank), 5, "the rank to die with its supervisor (PR_SET_PDEATHSIG)")


def sleeper_group(tmp_path: Path) -> tuple[subprocess.Popen, list[int]]:
    """A shell leading a new process group, with two sleepers in it; the shell, and [shell, sleeper, sleeper] pids."""
    shell = subprocess.Popen(["sh", "-c", 'for i in 0 1; do "$0" "$1" "$2/g$i.pid" & done; wait', PY, SLEEPER,
                              str(tmp_path)], start_new_session=True)
    STARTED_SESSIONS.add(shell.pid)
    return shell, [shell.pid, pid_from(tmp_path / "g0.pid"), pid_from(tmp_path / "g1.pid")]


@pytest.mark.parametrize("launcher_says_done", [False, True], ids=["launcher-died", "job-ended-normally"])
def test_the_guard_stops_the_group_only_when_the_launcher_died(launcher_says_done, tmp_path):
    shell, group = sleeper_group(tmp_path)
    guard = subprocess.Popen([PY, "-m", "hvdtrain.launch.lifeline", str(shell.pid)], stdin=subprocess.PIPE)
    time.sleep(1.5)  # the guard is up and watching
    if launcher_says_done:
        guard.stdin.write(DONE)
    guard.stdin.close()  # the launcher's end of the pipe closes: it exited or was killed
    assert guard.wait(timeout=30) == 0
    if launcher_says_done:
        assert all(alive(p) for p in group)
        os.killpg(shell.pid, signal.SIGKILL)
    else:
        wait_for(lambda: not any(alive(p) for p in group), 5, "the group to be stopped")
    shell.wait(timeout=10)


# ---- whole jobs ----------------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("how", ["SIGKILL", "terminal-closed"])
@pytest.mark.parametrize("controller", ["gloo", "mpi"])
def test_killing_hvdtrain_mid_epoch_ends_every_process_of_the_job(controller, how, tmp_path):
    run_dir = tmp_path / "run"
    job = tmp_path / "job.yaml"
    job.write_text(f"script: {RECIPE}\nnp: 2\ncontroller: {controller}\nenv: {{TF_CPP_MIN_LOG_LEVEL: '2'}}\n"
                   f"args: [--dataset, digits, --epochs, '1000', --no-progress, --no-tensorboard, "
                   f"--run-dir, {run_dir}]\n")
    first_checkpoint = run_dir / "checkpoints" / "ckpt-epoch0001.pt"
    signum = signal.SIGKILL if how == "SIGKILL" else signal.SIGHUP
    killed = kill_launcher_when([HVDTRAIN, "run", str(job)], first_checkpoint.exists, signum, timeout=180,
                                via_terminal=how == "terminal-closed")
    assert killed.ready, f"epoch 1 never ended\n{killed.output}"
    left = wait_gone(killed.processes, BOUND_S)
    assert not left, f"{len(left)} processes outlived `hvdtrain run` by {BOUND_S} s:\n  " + "\n  ".join(left)
    took = time.monotonic() - killed.signalled_at
    argv0s = [n.split()[1:3] for n in killed.cmdlines]  # what was running when the signal came:
    ranks = [n for n in killed.cmdlines if n.split()[1:4] == ["-m", "hvdtrain.rank_main", RECIPE]]
    assert len(ranks) == 2, killed.cmdlines  # the ranks (the recipe run by hvdtrain.rank_main),
    assert sum("hvdtrain-data-r" in n for n in killed.cmdlines) >= 2, killed.cmdlines  # loader producers (and more),
    assert argv0s.count(["-m", "hvdtrain.rank"]) == 2, killed.cmdlines  # the ranks' supervisors
    print(f"{controller} {how}: {len(killed.processes)} processes gone {took:.1f} s after the signal")
    assert killed.returncode == (-signal.SIGKILL if how == "SIGKILL" else 128 + signal.SIGHUP), killed.output
