"""Stop requests (hvdtrain/train/preempt.py) in one process: real signals to this process, the launcher's stop file,
the SIGTERM deadline (in a child process: it ends the process), the vote's rule, and mid-epoch checkpoint names.
The 2-rank end-to-end runs: tests/recipes/test_pytorch.py (resume to identical weights), tests/cluster/test_slurm.py
(a Slurm warning signal, requeue)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest
import torch

from hvdtrain import records
from hvdtrain.train import checkpoint, preempt
from hvdtrain.train.metrics import MetricSums
from hvdtrain.train.torchkit import rank_state, restore_rank_state
from tests.support.harness import HVDRUN, REPO, STARTED_SESSIONS, kill_group


@pytest.fixture
def request_installed(tmp_path: Path):
    stop = preempt.StopRequest(tmp_path, poll_s=0.0).install()
    yield stop
    stop.uninstall()


def test_sigusr1_is_heard_and_the_previous_handler_comes_back(tmp_path):
    previous = signal.getsignal(signal.SIGUSR1)
    stop = preempt.StopRequest(tmp_path, poll_s=0.0).install()
    try:
        assert signal.getsignal(signal.SIGUSR1) == stop._on_signal and not stop.heard()
        os.kill(os.getpid(), signal.SIGUSR1)
        assert stop.heard() and stop.reason == "SIGUSR1"
        assert not preempt.died_of_sigterm()
    finally:
        stop.uninstall()
    assert signal.getsignal(signal.SIGUSR1) == previous


def test_the_elastic_recipes_request_handles_sigusr1_only_and_leaves_sigterm_alone(tmp_path):
    """The elastic recipe's request (`signals=(SIGUSR1,)`): SIGTERM keeps its meaning there (that rank goes)."""
    previous = signal.getsignal(signal.SIGTERM)
    stop = preempt.StopRequest(tmp_path, poll_s=0.0, signals=(signal.SIGUSR1,)).install()
    try:
        assert signal.getsignal(signal.SIGTERM) == previous and signal.getsignal(signal.SIGUSR1) == stop._on_signal
        os.kill(os.getpid(), signal.SIGUSR1)
        assert stop.heard() and stop.reason == "SIGUSR1"
    finally:
        stop.uninstall()
    with pytest.raises(ValueError, match="signals must be among"):
        preempt.StopRequest(tmp_path, signals=(signal.SIGINT,))


def test_the_launchers_stop_file_is_heard(request_installed, tmp_path):
    assert not request_installed.heard()
    records.request_stop(tmp_path)
    assert request_installed.heard() and request_installed.reason == "SIGUSR1 to hvdtrain run"
    line = preempt.stop_line(request_installed, "c.pt")
    assert line.startswith("asked to stop (SIGUSR1 to hvdtrain run): checkpoint c.pt;"), line


def test_the_stop_line_names_what_stopped_the_launcher_not_the_sigterm_horovodrun_handed_on(tmp_path):
    stop = preempt.StopRequest(tmp_path)
    stop.reason = "SIGTERM"  # what a rank gets from horovodrun when hvdtrain run is stopped
    assert preempt.stop_line(stop, "c.pt").startswith("asked to stop (SIGTERM here): checkpoint c.pt;")  # a pod's
    records.request_stop(tmp_path, "SIGINT (Ctrl-C) to hvdtrain run")
    assert preempt.stop_line(stop, "c.pt").startswith("asked to stop (SIGINT (Ctrl-C) to hvdtrain run): checkpoint")
    stop.reason = None  # rank 0 heard nothing itself
    assert preempt.stop_line(stop, "c.pt").startswith("asked to stop (SIGINT (Ctrl-C) to hvdtrain run): checkpoint")
    stop.reason = "SIGUSR1"  # a rank's own signal is its own account
    assert preempt.stop_line(stop, "c.pt").startswith("asked to stop (SIGUSR1 here): checkpoint")
    assert not list(tmp_path.glob(".stop-requested*"))  # written whole, by a rename


def test_the_stop_file_is_looked_for_at_most_once_per_poll(tmp_path):
    stop = preempt.StopRequest(tmp_path, poll_s=60.0)
    assert not stop.heard()  # looked: nothing
    records.request_stop(tmp_path)
    assert not stop.heard()  # not looked again within the minute
    stop._next_poll = 0.0
    assert stop.heard()


def test_a_bad_grace_is_refused():
    with pytest.raises(ValueError, match="sigterm_grace_s must be >= 0, got -1"):
        preempt.StopRequest(sigterm_grace_s=-1)


SIGTERM_CHILD = textwrap.dedent("""
    import os, signal, sys, time
    from hvdtrain.train import preempt
    stop = preempt.StopRequest(None, sigterm_grace_s=float(sys.argv[1])).install()
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.2)
    print("heard", stop.heard(), stop.reason, preempt.died_of_sigterm(), flush=True)
    if sys.argv[2] == "second":
        os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(float(sys.argv[3]))  # stands for a step that does not reach its boundary in time
    stop.uninstall()  # reached the boundary, checkpointed: the deadline is off
    print("stopped cleanly", flush=True)
    sys.exit(75)
""")


@pytest.mark.parametrize("grace,second,work,code,said", [
    (0.5, "no", 30, -signal.SIGTERM, "heard True SIGTERM True\n"),  # the deadline ends it by SIGTERM
    (30, "second", 30, -signal.SIGTERM, "heard True SIGTERM True\n"),  # a second SIGTERM ends it at once
    (30, "no", 0.1, 75, "heard True SIGTERM True\nstopped cleanly\n"),  # in time: its own exit code
])
def test_sigterm_has_a_deadline_and_a_second_one_ends_the_process(tmp_path, grace, second, work, code, said):
    script = tmp_path / "child.py"
    script.write_text(SIGTERM_CHILD)
    start = time.monotonic()
    done = subprocess.run([sys.executable, str(script), str(grace), second, str(work)], capture_output=True,
                          text=True, timeout=60, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert (done.returncode, done.stdout) == (code, said), done.stderr
    assert time.monotonic() - start < 20


@pytest.mark.slow
def test_a_rank_blocked_in_a_collective_still_dies_by_sigterm_after_the_grace(tmp_path):
    """The main thread waits in Horovod's C++ (an allreduce whose peer is busy for 60 s), where no Python handler
    runs: the watcher thread keeps SIGTERM's deadline all the same (NOTE [stop requests])."""
    pid_file = tmp_path / "pid"
    job = subprocess.Popen([str(HVDRUN), "-np", "2", "-H", "localhost:2", "--gloo", sys.executable,
                            str(REPO / "tests" / "scripts" / "blocked_in_allreduce.py"), str(pid_file), "1.0"],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    STARTED_SESSIONS.add(job.pid)
    try:
        deadline = time.monotonic() + 60
        while not pid_file.exists():
            assert job.poll() is None and time.monotonic() < deadline, job.communicate(timeout=30)[0]
            time.sleep(0.05)
        time.sleep(1.0)  # in the allreduce by now
        rank1 = psutil.Process(int(pid_file.read_text()))
        sent = time.monotonic()
        rank1.send_signal(signal.SIGTERM)
        rank1.wait(timeout=20)
        took = time.monotonic() - sent
        output = job.communicate(timeout=60)[0]
    finally:
        kill_group(job)
    assert 0.9 < took < 10, took
    assert "Process 1 exit with status code 143." in output, output  # by SIGTERM, as with no handler
    assert "returned" not in output


class Collective:
    """Ranks' allreduce (max, elementwise) as one process sees it: each `start` adds a rank's values; the maxima of a
    round are what `finish` returns to every rank. Stands for hvd.allreduce_async/synchronize, which is not what
    these tests are about."""

    def __init__(self) -> None:
        self.rounds: list[list[list[int]]] = []

    def start(self, n: int, values: list[int]) -> int:
        while len(self.rounds) <= n:
            self.rounds.append([])
        self.rounds[n].append(values)
        return n

    def finish(self, n: int) -> list[int]:
        return [max(column) for column in zip(*self.rounds[n], strict=True)]


class Clock:
    """Each rank's own clock, advanced by the test."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def ranks(n: int, every_s: float) -> tuple[list[preempt.StopVote], list[preempt.StopRequest], list[Clock], Collective]:
    net, votes, requests, clocks = Collective(), [], [], []
    for _ in range(n):
        counter = iter(range(10**6))
        requests.append(preempt.StopRequest(None))
        clocks.append(Clock())
        votes.append(preempt.StopVote(requests[-1], lambda values, c=counter: net.start(next(c), values),
                                      net.finish, every_s=every_s, clock=clocks[-1]))
    return votes, requests, clocks, net


def test_every_rank_stops_after_the_same_step_one_after_the_first_that_heard(tmp_path):
    votes, requests, _, _ = ranks(2, every_s=0.0)  # a vote at every step
    stopped_at = {}
    for step in range(1, 20):
        if step == 5:
            requests[1].reason = "SIGUSR1"  # rank 1 alone hears it during step 5
        for rank in range(2):
            if rank not in stopped_at and votes[rank].after_step():
                stopped_at[rank] = step
    assert stopped_at == {0: 6, 1: 6}


def test_ranks_vote_about_every_quarter_second_and_agree_on_the_interval_and_the_stop(tmp_path):
    """10 ms steps (rank 1's clock a little slower): after the first votes the ranks vote every ~25 steps, both at
    the same steps (the interval is the maximum of the proposals), and a request heard by one rank stops both at the
    same step, within two intervals; an epoch's end (drain) makes the next step vote again."""
    votes, requests, clocks, net = ranks(2, every_s=0.25)
    stopped_at: dict[int, int] = {}
    for step in range(1, 400):
        if step == 300:
            requests[0].reason = "SIGTERM"
        for rank in range(2):
            clocks[rank].t += 0.010 if rank == 0 else 0.011
            if rank not in stopped_at and votes[rank].after_step():
                stopped_at[rank] = step
    assert votes[0].interval == votes[1].interval == 25, [v.interval for v in votes]
    assert stopped_at[0] == stopped_at[1] and 300 < stopped_at[0] <= 300 + 2 * 25, stopped_at
    assert len(net.rounds) < 30  # not ~300 votes
    for v in votes:
        v.drain()
    assert [v._countdown for v in votes] == [1, 1]


def test_fast_steps_vote_at_most_every_max_interval_steps(tmp_path):
    """1 ms steps would fit 250 in 0.25 s: the interval stops at MAX_VOTE_INTERVAL, so a pace that slows after it was
    agreed delays a stop by at most two such intervals."""
    votes, _, clocks, _ = ranks(2, every_s=0.25)
    for _ in range(300):
        for rank in range(2):
            clocks[rank].t += 0.001
            votes[rank].after_step()
    assert [v.interval for v in votes] == [preempt.MAX_VOTE_INTERVAL] * 2 == [50, 50]


def test_mid_epoch_checkpoints_sort_between_epochs_and_check_their_step(tmp_path):
    for epoch, step in ((1, 0), (1, 150), (0, 7), (2, 0)):
        checkpoint.save(tmp_path, epoch, {"x": 1}, lambda s, f: torch.save(s, f), keep=10, step=step)
    names = [p.name for _, p in checkpoint.list_checkpoints(tmp_path)]
    assert names == ["ckpt-epoch0000-step000007.pt", "ckpt-epoch0001.pt", "ckpt-epoch0001-step000150.pt",
                     "ckpt-epoch0002.pt"]
    (tmp_path / "ckpt-epoch0002.pt").unlink()
    found = checkpoint.find_latest(tmp_path, lambda f: torch.load(f, weights_only=True))
    assert found is not None and (found.epoch, found.step, found.path.name) == (1, 150, names[2])
    renamed = tmp_path / "ckpt-epoch0001-step000151.pt"  # content says step 150
    found.path.rename(renamed)
    warnings: list[str] = []
    found = checkpoint.find_latest(tmp_path, lambda f: torch.load(f, weights_only=True), warn=warnings.append)
    assert found is not None and found.path.name == "ckpt-epoch0001.pt"
    assert warnings == [f"skipping checkpoint {renamed}: file name says step 151, content says 150"]
    with pytest.raises(ValueError, match="epoch must be an int >= 1"):
        checkpoint.checkpoint_path(tmp_path, 0)


def test_a_ranks_own_state_comes_back_exactly():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    model(torch.randn(8, 3))  # running statistics move
    sums = MetricSums()
    sums.add(torch.tensor(0.25), torch.tensor(3), 8)
    torch.manual_seed(7)
    kept = rank_state(model, sums)
    expected_draw = torch.rand(3)
    running = model[1].running_mean.clone()
    model(torch.randn(8, 3) * 5)
    torch.rand(10)
    restored = restore_rank_state(kept, model)
    assert torch.equal(torch.rand(3), expected_draw)
    assert torch.equal(model[1].running_mean, running)
    assert restored.values().tolist() == [2.0, 3.0, 8.0]
