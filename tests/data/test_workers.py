"""ShmLoader with real producer processes: order, sharding, seeding, back-pressure, errors, death, shutdown."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from hvdtrain.data import (
    LoaderError,
    LoaderTimeoutError,
    ShardSampler,
    ShmLoader,
    WorkerDiedError,
    WorkerError,
    boot,
    derive_seed,
    shm,
    sweep_stale_segments,
)
from tests.support import harness
from tests.support import loaders as fx

pytestmark = pytest.mark.timeout(120)


def my_segments() -> list[str]:
    return sorted(p.name for p in Path("/dev/shm").glob(f"hvdtrain_{os.getpid()}_*"))


def unattached_segments(within_s: float = 5.0) -> list[str]:
    """Segment names still in /dev/shm after `within_s`: a name lives only until its worker reads the socket (a slot
    grown on request is sent while the worker may be between two reads), so a live loader is given a moment."""
    deadline = time.monotonic() + within_s
    while (names := my_segments()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return names


def labels(loader: ShmLoader) -> list[list[int]]:
    return [y.tolist() for _, y in loader]


def test_dataset_mode_follows_the_sampler_on_every_rank_across_epochs() -> None:
    n, size, bs = 37, 2, 4
    loaders = [ShmLoader(fx.IndexDataset(n), rank=r, size=size, batch_size=bs, num_workers=2, seed=5)
               for r in range(size)]
    try:
        pids = [ld.worker_pids for ld in loaders]
        for epoch in range(2):
            seen = []
            for r, ld in enumerate(loaders):
                ld.set_epoch(epoch)
                assert len(ld) == 5
                batches = list(ld)  # held batches stay valid (NOTE [batch lifetime])
                sampler = ShardSampler(n, r, size, seed=5, batch_size=bs)
                sampler.set_epoch(epoch)
                assert [y.tolist() for _, y in batches] == [b.tolist() for b in sampler.batches()]
                assert all(x.dtype == np.float32 and x.shape == (len(y), 3) for x, y in batches)
                assert all(np.array_equal(x[:, 0], y) for x, y in batches)  # rows belong to their labels
                seen += [i for _, y in batches for i in y.tolist()]
            assert set(seen) == set(range(n)) and len(seen) == 38  # one padded sample
            assert unattached_segments() == []  # every segment was unlinked eagerly once its worker attached it
        assert [ld.worker_pids for ld in loaders] == pids  # the same processes served both epochs
        assert all(ld._res.procs[0].is_alive() for ld in loaders)
    finally:
        for ld in loaders:
            ld.close()
    assert my_segments() == []
    assert not any(p.is_alive() for ld in loaders for p in ld._res.procs)


def test_generator_mode_order_seeds_and_structure() -> None:
    with ShmLoader.from_generator(fx.tagged_batches, rank=1, size=2, num_workers=2, seed=3) as ld:
        epochs = []
        for epoch in (0, 1):
            ld.set_epoch(epoch)
            epochs.append([{k: v.copy() for k, v in b.items()} for b in ld])
    for epoch, batches in enumerate(epochs):
        tags = [b["tag"].tolist() for b in batches]
        # round robin over the workers; global worker ids are rank * num_workers + local id of size * num_workers
        assert [(t[0], t[1], t[2], t[4]) for t in tags] == [(w, 4, epoch, j) for j in range(3) for w in (2, 3)]
        assert [b["local"][0] for b in batches] == [0, 1] * 3
        assert {t[3] for t in tags if t[0] == 2} == {derive_seed(3, 1, 0, epoch)}
    draws = {(e, b["tag"][0]): b["draw"].tobytes() for e, bs in enumerate(epochs) for b in bs if b["tag"][4] == 0}
    assert len(set(draws.values())) == 4  # numpy was seeded per (rank, worker, epoch): no repeats


def test_unordered_generator_mode_yields_everything_as_it_arrives() -> None:
    with ShmLoader.from_generator(fx.tagged_batches, rank=0, size=1, num_workers=3, ordered=False) as ld:
        tags = [tuple(b["tag"][[0, 4]].tolist()) for b in ld]
    assert sorted(tags) == [(w, j) for w in range(3) for j in range(3)]
    for w in range(3):  # each producer's own batches stay in its order
        assert [j for v, j in tags if v == w] == [0, 1, 2]
    with pytest.raises(TypeError, match="ordered"):  # a dataset's batches follow its sampler: no such argument
        ShmLoader(fx.IndexDataset(4), rank=0, size=1, batch_size=2, ordered=False)


@pytest.mark.parametrize("method", ["spawn", "fork"])
def test_producers_start_with_single_threaded_math_unless_the_user_chose(method: str,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A producer's numpy need not start an OpenBLAS thread per core (half its start-up CPU): its environment says
    1 thread unless the user set a number, and the trainer's own environment is left as it was."""
    monkeypatch.delenv("OPENBLAS_NUM_THREADS", raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    with ShmLoader.from_generator(fx.math_threads, rank=0, size=1, num_workers=1, start_method=method) as ld:
        assert [b.tolist() for b in ld] == [[1, 3]]
    assert "OPENBLAS_NUM_THREADS" not in os.environ and os.environ["OMP_NUM_THREADS"] == "3"


def test_a_producer_that_never_reads_its_start_up_data_is_stopped_at_the_timeout(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The trainer writes a producer's start-up data (the pickled dataset: possibly large) to its stdin; a child that
    never reads it (here: a program that only sleeps) makes the write time out instead of blocking for ever, and
    the child is stopped and reaped."""
    import psutil

    monkeypatch.setattr(boot, "BOOTSTRAP", "import time; time.sleep(60)")
    mine, theirs = socket.socketpair()
    t0 = time.monotonic()
    with mine, theirs, pytest.raises(LoaderTimeoutError, match=r"read none of its start-up data.*0.5 s") as err:
        boot.start_producer("hvdtrain-test-stuck", b"x" * (8 << 20), theirs, None, None, import_main=False,
                            timeout=0.5)
    assert time.monotonic() - t0 < 5
    pid = int(str(err.value).split("pid ")[1].split()[0])
    assert pid not in {p.pid for p in psutil.Process().children()} and not psutil.pid_exists(pid)  # reaped


def test_starting_producers_changes_nothing_in_the_trainer_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """The producers configure themselves (NOTE [producer start] in boot.py): while a loader starts its workers,
    another thread of the trainer never sees its environment or its `__main__` module change, and multiprocessing's
    default start method is left unchosen."""
    monkeypatch.delenv("OPENBLAS_NUM_THREADS", raising=False)
    main, env, changes = sys.modules["__main__"], dict(os.environ), []
    start_method = multiprocessing.get_start_method(allow_none=True)  # None on a fresh interpreter
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            if sys.modules.get("__main__") is not main or os.environ != env:
                changes.append((sys.modules.get("__main__"), dict(os.environ)))

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        with ShmLoader.from_generator(fx.math_threads, rank=0, size=1, num_workers=3) as ld:
            assert [b.tolist()[0] for b in ld] == [1, 1, 1]
    finally:
        done.set()
        watcher.join(timeout=10)
    assert changes == []
    assert multiprocessing.get_start_method(allow_none=True) == start_method  # multiprocessing's default not fixed


def test_per_worker_seeding_differs_and_reproduces() -> None:
    def draws(rank: int) -> np.ndarray:
        with ShmLoader(fx.RandomDataset(), rank=rank, size=2, batch_size=2, num_workers=2, shuffle=False) as ld:
            return np.concatenate([b.copy() for b in ld])

    a, b, c = draws(0), draws(0), draws(1)
    assert np.array_equal(a[:, :3], b[:, :3])  # reproducible (column 3 is the producer's pid)
    assert len(set(a[:, 3])) == 2  # two producer processes
    for col in (1, 2):  # numpy and python RNGs: different across workers and ranks
        assert len(set(a[:, col]) | set(c[:, col])) == 16


def test_back_pressure_bounds_how_far_producers_run_ahead(tmp_path: Path, monkeypatch) -> None:
    count = tmp_path / "count"
    monkeypatch.setenv("HVDTRAIN_TEST_COUNT_FILE", str(count))
    with ShmLoader.from_generator(fx.counted, rank=0, size=1, num_workers=1, prefetch=2) as ld:
        it = iter(ld)
        first = next(it)
        time.sleep(1.5)  # a slow step: an unbounded producer would have made all 50 batches by now
        assert int(count.read_text()) <= 4  # the lent slot + 2 prefetched + one batch waiting for a slot
        assert first[0] == 0
        rest = [int(b[0]) for b in it]
        assert rest == list(range(1, 50))


def test_slots_grow_for_bigger_batches_and_data_stays_right() -> None:
    with ShmLoader.from_generator(fx.growing_batches, rank=0, size=1, num_workers=2, prefetch=1) as ld:
        for _ in range(2):
            got = [b.copy() for b in ld]
            sizes = (0, 10, 1000, 300_000, 50, 600_000, 3)  # the two big ones outgrow a slot's first 1 MiB
            expect = [np.arange(n, dtype=np.float64) + w for n in sizes for w in (0, 1)]
            assert len(got) == len(expect) and all(np.array_equal(g, e) for g, e in zip(got, expect, strict=True))
            assert unattached_segments() == []


def test_batches_per_epoch_cuts_an_endless_generator_and_resume_skips() -> None:
    with ShmLoader.from_generator(fx.endless, rank=0, size=1, num_workers=2, batches_per_epoch=5) as ld:
        assert len(ld) == 5
        first = [(int(x[0, 0]), int(y[1])) for x, y in ld]
        assert first == [(0, 0), (1, 0), (0, 1), (1, 1), (0, 2)]
        ld.set_epoch(1)
        it = iter(ld)
        next(it), next(it)
        state = ld.state_dict()
        assert state == {"epoch": 1, "batches_consumed": 2}
        assert ld.state_dict(unconsumed=2) == {"epoch": 1, "batches_consumed": 0}
        with pytest.raises(ValueError, match="unconsumed"):
            ld.state_dict(unconsumed=3)
        ld.load_state_dict(state)
        assert len(ld) == 3
        assert [(int(x[0, 0]), *y.tolist()) for x, y in ld] == [(0, 1, 1), (1, 1, 1), (0, 1, 2)]


@pytest.mark.filterwarnings("ignore:ShmLoader. iterating epoch 2 again")
def test_resume_mid_epoch_and_break_then_iterate_again() -> None:
    with ShmLoader(fx.IndexDataset(40), rank=0, size=1, batch_size=4, num_workers=2, seed=1) as ld:
        ld.set_epoch(2)
        full = labels(ld)
        it = iter(ld)
        assert [next(it)[1].tolist() for _ in range(3)] == full[:3]
        state = ld.state_dict()
        assert state["batches_consumed"] == 3 and state["epoch"] == 2
        # break out and iterate again without loading state: the epoch starts over (stale batches are dropped)
        assert labels(ld) == full
        with pytest.raises(LoaderError, match="stale"):
            next(it)
        ld.load_state_dict(state)
        assert len(ld) == 7
        assert labels(ld) == full[3:]
        assert labels(ld) == full  # resume applies once
        ld.load_state_dict(state)
        iter(ld)  # resuming is not a repeat: no warning (see test_repeating_a_shuffled_epoch_warns)


def test_an_interrupted_wait_leaves_the_iteration_going_and_a_lost_hand_off_ends_it(monkeypatch) -> None:
    """Ctrl-C while the trainer waits for a batch (nothing received yet): the same iterator goes on with the epoch,
    nothing skipped. Interrupted mid-hand-off (a batch received, its slot given back): the iteration ends for good
    (NOTE [one receiver]), and the next one starts the epoch over with every slot."""
    from hvdtrain.data.receiver import Receiver

    with ShmLoader(fx.IndexDataset(24), rank=0, size=1, batch_size=4, num_workers=2, shuffle=False) as ld:
        full = labels(ld)
        wait, reader = Receiver._receive_due, Receiver._reader
        interrupts = {"wait": 0, "reader": 0}

        def interrupted(name: str, real):
            def call(self, *args):
                if interrupts[name]:
                    interrupts[name] -= 1
                    raise KeyboardInterrupt
                return real(self, *args)
            return call

        monkeypatch.setattr(Receiver, "_receive_due", interrupted("wait", wait))
        monkeypatch.setattr(Receiver, "_reader", interrupted("reader", reader))
        it = iter(ld)
        got = [next(it)[1].tolist()]
        interrupts["wait"] = 1
        with pytest.raises(KeyboardInterrupt):
            next(it)
        got += [y.tolist() for _, y in it]
        assert got == full  # the interrupted wait lost nothing
        interrupts["reader"] = 1
        it = iter(ld)
        with pytest.raises(KeyboardInterrupt):
            next(it)
        assert list(it) == []  # that batch's place is gone: the iteration ends, it does not skip it silently
        assert labels(ld) == full and not ld._rx.lender.held_slots()


def test_repeating_a_shuffled_epoch_warns() -> None:
    with ShmLoader(fx.IndexDataset(4), rank=0, size=1, batch_size=4, num_workers=1) as ld:
        list(ld)
        with pytest.warns(UserWarning, match="set_epoch"):
            iter(ld)
        ld.set_epoch(1)
        iter(ld)


def test_empty_dataset_and_dict_list_batches() -> None:
    with ShmLoader(fx.IndexDataset(0), rank=0, size=2, batch_size=4, num_workers=1) as ld:
        assert len(ld) == 0 and list(ld) == []
    collate = lambda samples: {"x": np.stack([s[0] for s in samples]), "y": [s[1] for s in samples]}  # noqa: E731
    with ShmLoader(fx.IndexDataset(6), rank=0, size=1, batch_size=3, num_workers=1, collate=collate,
                   shuffle=False) as ld:
        batches = [{k: v.copy() for k, v in b.items()} for b in ld]
        assert [sorted(b) for b in batches] == [["x", "y"]] * 2
        assert batches[1]["y"].tolist() == [3, 4, 5] and batches[1]["x"].shape == (3, 3)
    fetch = lambda ds, idx: [np.asarray(idx) * 10]  # noqa: E731
    with ShmLoader(fx.IndexDataset(4), rank=0, size=1, batch_size=2, num_workers=1, fetch=fetch,
                   shuffle=False) as ld:
        assert [b[0].tolist() for b in ld] == [[0, 10], [20, 30]]


def test_worker_exception_is_reraised_with_its_traceback_and_the_loader_goes_on() -> None:
    with ShmLoader(fx.FailingDataset(16), rank=0, size=1, batch_size=2, num_workers=2, shuffle=False) as ld:
        with pytest.raises(WorkerError) as err:
            list(ld)
        text = str(err.value)
        assert "data worker 1 of rank 0" in text and "KeyError" in text and "sample 7 is corrupt" in text
        assert "tests/support/loaders.py" in text and "in __getitem__" in text  # the producer's own traceback
        ld.set_epoch(1)
        with pytest.raises(WorkerError):
            list(ld)  # the workers are still alive and serve the next epoch (which hits sample 7 again)
    with ShmLoader.from_generator(fx.bad_type, rank=0, size=1, num_workers=1) as ld, \
            pytest.raises(WorkerError, match=r"dtype object|must hold numeric"):
        list(ld)


def test_a_killed_worker_is_reported_not_waited_for() -> None:
    ld = ShmLoader.from_generator(fx.endless, rank=0, size=1, num_workers=2, batches_per_epoch=10_000)
    it = iter(ld)
    next(it)
    victim = ld.worker_pids[1]
    os.kill(victim, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(WorkerDiedError) as err:
        for _ in it:
            pass
    assert time.monotonic() - start < 10
    assert f"pid {victim}" in str(err.value) and "SIGKILL" in str(err.value)
    assert my_segments() == [] and not any(p.is_alive() for p in ld._res.procs)  # closed itself
    with pytest.raises(LoaderError, match="closed"):
        iter(ld)
    ld.close()  # idempotent


def test_a_silent_worker_times_out() -> None:
    with ShmLoader.from_generator(fx.slow, rank=0, size=1, num_workers=1, timeout=0.5) as ld:
        start = time.monotonic()
        with pytest.raises(LoaderTimeoutError, match=r"within 0\.5 s .*alive"):
            next(iter(ld))
        assert time.monotonic() - start < 5
        t0 = time.monotonic()
    assert time.monotonic() - t0 < 10  # close() does not wait 30 s for the sleeping producer


@pytest.mark.parametrize("kwargs,words", [
    ({"batch_size": 0}, ["batch_size", "0"]),
    ({"batch_size": 2, "rank": 3}, ["rank", "3"]),
    ({"batch_size": 2, "num_workers": 0}, ["num_workers", "0"]),
    ({"batch_size": 2, "prefetch": -1}, ["prefetch", "-1"]),
    ({"batch_size": 2, "timeout": 0}, ["timeout", "0"]),
    ({"batch_size": 2, "start_method": "forkserver"}, ["start_method", "'fork'", "'spawn'", "re-run the training"]),
    ({"batch_size": 2, "start_method": "fork", "import_main": True}, ["import_main", "start_method='spawn'"]),
])
def test_bad_arguments_are_named_and_start_nothing(kwargs: dict, words: list[str]) -> None:
    args = {"rank": 0, "size": 2, **kwargs}
    with pytest.raises(ValueError) as err:
        ShmLoader(fx.IndexDataset(4), **args)
    assert all(w in str(err.value) for w in words), str(err.value)


@pytest.mark.parametrize("kwargs,words", [
    ({"batches_per_epoch": 0}, ["batches_per_epoch", "0"]),
    ({"generator": None}, ["generator", "callable", "NoneType"]),
    ({"num_workers": 0}, ["num_workers", "0"]),
    ({"epochs": 0}, ["epochs", "0"]),
    ({"size": 0}, ["size", "0"]),
])
def test_bad_generator_arguments_are_named_and_start_nothing(kwargs: dict, words: list[str]) -> None:
    args = {"generator": fx.endless, "rank": 0, "size": 1, **kwargs}
    with pytest.raises(ValueError) as err:
        ShmLoader.from_generator(args.pop("generator"), **args)
    assert all(w in str(err.value) for w in words), str(err.value)


def test_each_source_has_its_own_constructor() -> None:
    """A dataset goes to ShmLoader(...), a generator to ShmLoader.from_generator(...): the other mode's arguments
    are not accepted, and a None dataset points at from_generator."""
    with pytest.raises(ValueError, match="from_generator"):
        ShmLoader(None, rank=0, size=1, batch_size=2)
    with pytest.raises(TypeError, match="batch_size"):
        ShmLoader(fx.IndexDataset(4), rank=0, size=1)
    with pytest.raises(TypeError, match="generator"):
        ShmLoader(fx.IndexDataset(4), rank=0, size=1, batch_size=2, generator=fx.endless)
    with pytest.raises(TypeError, match="batch_size"):
        ShmLoader.from_generator(fx.endless, rank=0, size=1, batch_size=2)


@pytest.mark.parametrize("first_s", [0.3, 3.0])
def test_the_producer_of_the_first_batch_starts_before_the_others(first_s: float,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """NOTE [first producer first]: producer 1 starts once producer 0 has sent its first batch (0.3 s to make),
    but waits boot.WAIT_S (1 s) at most (3 s to make)."""
    monkeypatch.setenv("HVDTRAIN_TEST_FIRST_S", str(first_s))
    with ShmLoader.from_generator(fx.timed_start, rank=0, size=1, num_workers=2, batches_per_epoch=4) as ld:
        rows = [np.array(b) for b in ld]
    first_made = next(r[2] for r in rows if r[0] == 0)
    second_started = next(r[1] for r in rows if r[0] == 1)
    assert sorted(r[0] for r in rows) == [0, 0, 1, 1]
    if first_s < boot.WAIT_S:
        assert second_started >= first_made, rows
    else:
        assert second_started < first_made - 1.0, rows


TRAINER = r"""
import os, sys, time
from hvdtrain.data import ShmLoader
from tests.support import loaders as fx
if __name__ == "__main__":
    ld = ShmLoader.from_generator(fx.growing_batches, rank=0, size=1, num_workers=2, prefetch=2,
                                  start_method=sys.argv[2])
    it = iter(ld)
    next(it); next(it)
    print("PIDS", os.getpid(), *ld.worker_pids, flush=True)
    if sys.argv[1] == "kill":
        os.kill(os.getpid(), 9)
    # "exit": leave without close(): the atexit hook must clean up
"""

# A producer that has exited but is not reaped yet is a zombie, and its /proc entry stays: the trainer's death makes
# it an orphan of the nearest subreaper (pytest's, tests/support/harness.py OrphanReaper), which reaps it on its own
# schedule. Exited is what the test asks for, so a zombie counts as gone.
WATCHER = r"""
import os, subprocess, sys, time
out = subprocess.run([sys.executable, "-c", *sys.argv[1:]], capture_output=True, text=True, timeout=60)
pids = [int(p) for line in out.stdout.splitlines() if line.startswith("PIDS") for p in line.split()[1:]]

def state(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None

def running(pid):
    return state(pid) not in (None, "Z", "X")

deadline = time.time() + 10
while time.time() < deadline and any(running(p) for p in pids[1:]):
    time.sleep(0.1)
alive = [(p, state(p)) for p in pids[1:] if running(p)]
left = [n for n in os.listdir("/dev/shm") if pids and n.startswith(f"hvdtrain_{pids[0]}_")]
print("RC", out.returncode, "ALIVE", alive, "LEFT", left, "PIDS", pids)
print(out.stderr[-2000:])
"""


@pytest.mark.parametrize("how,method", [("kill", "fork"), ("exit", "fork"), ("kill", "spawn")])
def test_trainer_death_or_exit_leaves_no_process_and_no_segment(how: str, method: str) -> None:
    """A forked producer holds no end of the trainer's channels (NOTE [forked producers] (a)), so the trainer's
    SIGKILL ends it as it ends a spawned one."""
    result = harness.run_bounded([sys.executable, "-c", WATCHER, TRAINER, how, method], timeout=90,
                                 cwd=harness.REPO)
    line = next((ln for ln in result.output.splitlines() if ln.startswith("RC")), "")
    assert "ALIVE [] LEFT []" in line, result.describe()
    assert line.startswith("RC -9" if how == "kill" else "RC 0"), result.describe()
    assert "Traceback" not in result.output and "leaked" not in result.output, result.describe()


MAIN_SCRIPT = r"""
import sys
import numpy as np
from hvdtrain.data import ShmLoader
print("MAIN-MODULE-RUN", flush=True)  # outside the guard on purpose: counts how often this module is executed

class Squares:  # defined in __main__: reaches the workers by value (cloudpickle)
    def __len__(self):
        return 6
    def __getitem__(self, i):
        return np.array([i * i])

if __name__ == "__main__":
    with ShmLoader(Squares(), rank=0, size=1, batch_size=3, num_workers=2, shuffle=False, start_method="spawn",
                   import_main=sys.argv[1] == "yes") as ld:
        print("BATCHES", [b.ravel().tolist() for b in ld], flush=True)
"""


@pytest.mark.parametrize("import_main,runs", [("no", 1), ("yes", 3)])
def test_workers_do_not_rerun_the_training_script(tmp_path: Path, import_main: str, runs: int) -> None:
    script = tmp_path / "train_script.py"
    script.write_text(MAIN_SCRIPT)
    result = harness.run_bounded([sys.executable, str(script), import_main], timeout=90, cwd=harness.REPO,
                                 env={"PYTHONPATH": str(harness.REPO)})
    assert result.returncode == 0, result.describe()
    assert "BATCHES [[0, 1, 4], [9, 16, 25]]" in result.output, result.describe()
    assert result.output.count("MAIN-MODULE-RUN") == runs, result.describe()


UNGUARDED_SCRIPT = r"""
import numpy as np
from hvdtrain.data import ShmLoader
print("MAIN-MODULE-RUN", flush=True)

def gen(w, n, e, s):
    yield np.zeros(1)

with ShmLoader.from_generator(gen, rank=0, size=1, num_workers=2, import_main=True) as ld:  # no __main__ guard
    print("BATCHES", len(list(ld)), flush=True)
"""


def test_a_loader_started_outside_the_main_guard_is_refused_in_the_producers_run_of_the_script(tmp_path: Path) -> None:
    """With import_main=True each producer runs the training script; one that starts a loader at module level
    would start producers of its own (NOTE [producer start] (b) in boot.py): they stop with a clear error instead,
    and the trainer reports their exit."""
    script = tmp_path / "unguarded.py"
    script.write_text(UNGUARDED_SCRIPT)
    result = harness.run_bounded([sys.executable, str(script)], timeout=90, cwd=tmp_path,
                                 env={"PYTHONPATH": str(harness.REPO)})
    assert result.returncode != 0 and "WorkerDiedError" in result.output, result.describe()
    assert "ImportingMainError" in result.output and 'if __name__ == "__main__":' in result.output, result.describe()
    assert result.output.count("MAIN-MODULE-RUN") <= 3, result.describe()  # the trainer and its 2 producers at most


def test_producers_import_what_the_trainer_imports_from_its_sys_path(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A generator from a module found through a path the trainer added at run time (cloudpickle sends it by
    name): spawned producers import it, as the trainer did (NOTE [producer start] (a))."""
    (tmp_path / "extra_batches.py").write_text("import numpy as np\n\n\ndef gen(w, n, e, s):\n"
                                               "    yield np.array([7, w])\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import extra_batches  # type: ignore[import-not-found]

    try:
        with ShmLoader.from_generator(extra_batches.gen, rank=0, size=1, num_workers=2, start_method="spawn") as ld:
            assert [b.tolist() for b in ld] == [[7, 0], [7, 1]]
    finally:
        sys.modules.pop("extra_batches", None)


def test_a_loader_leaves_stale_segments_alone_and_the_explicit_sweep_removes_them() -> None:
    """No hidden side effect: constructing (and using) a loader never deletes other processes' /dev/shm files,
    not even a stale hvdtrain segment; sweep_stale_segments() removes it."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(timeout=60)
    stale = Path(f"/dev/shm/hvdtrain_{dead.pid}_{os.urandom(6).hex()}")
    try:
        stale.write_bytes(b"\0" * 64)
        os.utime(stale, (time.time() - 3600, time.time() - 3600))  # dead creator, an hour old: what a crash leaves
        with ShmLoader.from_generator(fx.endless, rank=0, size=1, num_workers=1, batches_per_epoch=2) as ld:
            assert len(list(ld)) == 2
        assert stale.exists(), "constructing a loader removed a file it did not create"
        assert stale.name in sweep_stale_segments()
        assert not stale.exists()
    finally:
        stale.unlink(missing_ok=True)


def test_sweep_removes_only_old_segments_of_dead_creators(tmp_path) -> None:
    from multiprocessing import shared_memory


    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(timeout=60)
    names = {f"hvdtrain_{dead.pid}_old", f"hvdtrain_{dead.pid}_new", f"hvdtrain_{os.getpid()}_mine"}
    segs = [shared_memory.SharedMemory(name=n, create=True, size=64) for n in sorted(names)]
    try:
        old = f"/dev/shm/hvdtrain_{dead.pid}_old"
        os.utime(old, (time.time() - 3600, time.time() - 3600))
        assert shm.sweep_stale() == [f"hvdtrain_{dead.pid}_old"]  # a fresh name may be another namespace's, live
        assert {p.name for p in Path("/dev/shm").glob("hvdtrain_*")} >= names - {f"hvdtrain_{dead.pid}_old"}
    finally:
        for seg in segs:
            seg.close()
            with contextlib.suppress(FileNotFoundError):
                seg.unlink()
