"""Elastic training for real: recipes/pytorch_elastic.py under `hvdtrain run` (horovodrun's elastic Gloo mode).

Three ranks on three names of this machine (Horovod treats each name as a host, blacklists a failed host by name,
and starts ranks on names that resolve to a local address without ssh). The discovery script is the shipped
jobs/discover_hosts.sh reading a hosts file this test rewrites while the job runs. A "chaos" thread follows the
job through the files the recipe writes (<run-dir>/elastic.jsonl from rank 0, <run-dir>/workers/<host>.<slot>.json
from every process), SIGKILLs the rank on one host mid-training and drops that host from discovery; once the two
survivors train again it lists the host again, and the world must grow back to three.

Also here, in-process: the Horovod blacklist behaviour this relies on (re-admission only after a cooldown).
"""

from __future__ import annotations

import ast
import contextlib
import hashlib
import json
import os
import shlex
import signal
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import psutil
import pytest
import yaml

from hvdtrain import exitcodes
from hvdtrain.job.load import load_spec
from hvdtrain.job.plan import build_plan
from hvdtrain.train import checkpoint
from tests.support.harness import REPO, SHM_DIR, SHM_PREFIX, expect_ok, run_bounded

HVDTRAIN = str(Path(sys.executable).parent / "hvdtrain")
HOSTS = ("localhost", "127.0.0.1", "127.1")  # three names, one address: three hosts, all local
VICTIM = "127.1"
EPOCHS = 10  # the survivors train ~8 epochs on 2 ranks: several seconds, longer than re-admission takes (see below)
RECIPE_ARGS = ["--dataset", "digits", "--epochs", str(EPOCHS), "--warmup-epochs", "1", "--batch-size", "16",
               "--commit-every", "5", "--weight-decay", "1e-3", "--threads", "1", "--keep-checkpoints", "2",
               "--no-tensorboard", "--no-progress"]
JOB_TIMEOUT_S = 300  # generous: 2 cores shared with other engineers' tests; a run takes ~60-90 s
STEP_TIMEOUT_S = 150  # for each thing the chaos thread waits for
# How long a survivor blocked in a Gloo recv on the killed rank waits before it reports (Horovod's default: 30 s)
# and how far apart the ranks may reach a rendezvous: the joining rank imports torch while the others wait.
GLOO_TIMEOUT_S = 15


def write_hosts(path: Path, hosts: tuple[str, ...]) -> None:
    """Replace the hosts file atomically: the discovery script never reads a half-written file."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(f"{h}:1\n" for h in hosts))
    os.replace(tmp, path)


def read_events(run_dir: Path) -> list[dict[str, Any]]:
    try:
        lines = (run_dir / "elastic.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in lines if line.endswith("}")]  # the last line may be half-written


class Chaos(threading.Thread):
    """Kills the victim's rank mid-training, drops and re-lists its host; remembers every process it saw."""

    def __init__(self, run_dir: Path, hosts_file: Path) -> None:
        super().__init__(daemon=True)
        self.run_dir, self.hosts_file = run_dir, hosts_file
        self.stop = threading.Event()
        self.times: dict[str, float] = {}
        self.victim: dict[str, Any] = {}
        self.seen: dict[int, psutil.Process] = {}  # every rank and data producer process
        self.error: str | None = None
        self.children_after_growth: dict[int, int] = {}

    def run(self) -> None:
        try:
            self.script()
        except Exception as e:  # reported by the test, next to the job's output
            self.error = f"{type(e).__name__}: {e}"

    def script(self) -> None:
        self.wait_for("3 ranks training in epoch 2", lambda e: e["event"] == "commit" and e["size"] == 3
                      and e["epoch"] >= 1 and e["batch"] >= 10)
        self.victim = json.loads((self.run_dir / "workers" / f"{VICTIM}.0.json").read_text())
        self.snapshot()
        self.times["before_kill"] = time.time()
        os.kill(self.victim["pid"], signal.SIGKILL)  # the host's rank dies mid-epoch...
        self.times["kill"] = time.time()
        write_hosts(self.hosts_file, tuple(h for h in HOSTS if h != VICTIM))  # ...and the host leaves discovery
        resumed = self.wait_for("2 ranks training", lambda e: e["event"] == "commit" and e["size"] == 2)
        # Horovod blacklists the host when every survivor has reported back, which is when the reset ends: a
        # survivor blocked in a Gloo recv reports only at its timeout (GLOO_TIMEOUT_S), so the cooldown (1 s here)
        # may start just before this commit. The host listed now rejoins within cooldown + a discovery poll (1 s) +
        # a commit.
        self.times["resumed_commit"] = resumed["time"]
        write_hosts(self.hosts_file, HOSTS)  # the host is back
        self.times["relisted"] = time.time()
        grown = self.wait_for("3 ranks again", lambda e: e["event"] == "start" and e["size"] == 3
                              and e["time"] > self.times["relisted"])
        self.times["grown"] = grown["time"]
        # The joining rank writes its worker file as it starts, with no collective before rank 0's start event.
        deadline = time.monotonic() + STEP_TIMEOUT_S
        while len(counts := self.children_of_ranks()) < 3 and time.monotonic() < deadline and not self.stop.is_set():
            self.snapshot()
            time.sleep(0.2)
        self.children_after_growth = counts
        while not self.stop.wait(0.5):  # keep recording processes until the job ends
            self.snapshot()

    def wait_for(self, what: str, match: Any) -> dict[str, Any]:
        deadline = time.monotonic() + STEP_TIMEOUT_S
        while time.monotonic() < deadline and not self.stop.is_set():
            self.snapshot()
            found = [e for e in read_events(self.run_dir) if match(e)]
            if found:
                return found[0]
            time.sleep(0.2)
        raise TimeoutError(f"waited {STEP_TIMEOUT_S} s for {what}; events: {read_events(self.run_dir)[-5:]}")

    def snapshot(self) -> None:
        for f in (self.run_dir / "workers").glob("*.json"):
            with contextlib.suppress(OSError, ValueError, psutil.Error):
                proc = psutil.Process(json.loads(f.read_text())["pid"])
                for p in (proc, *proc.children(recursive=True)):
                    self.seen.setdefault(p.pid, p)

    def children_of_ranks(self) -> dict[int, int]:
        """Live child processes of each live rank (its data producers and multiprocessing's resource tracker)."""
        counts = {}
        for f in (self.run_dir / "workers").glob("*.json"):
            with contextlib.suppress(OSError, ValueError, psutil.Error):
                proc = psutil.Process(json.loads(f.read_text())["pid"])
                counts[proc.pid] = sum(c.status() != psutil.STATUS_ZOMBIE for c in proc.children())
        return counts

    def alive(self) -> list[str]:
        found = []
        for p in self.seen.values():
            with contextlib.suppress(psutil.Error):
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    found.append(f"{p.pid}: {' '.join(p.cmdline())}")
        return found

    def kill_leftovers(self) -> None:
        for p in self.seen.values():
            with contextlib.suppress(psutil.Error):
                p.kill()


def write_job(tmp_path: Path, run_dir: Path) -> Path:
    job = tmp_path / "elastic.yaml"
    job.write_text(yaml.safe_dump({
        "script": str(REPO / "recipes" / "pytorch_elastic.py"), "np": 3, "controller": "gloo",
        "network_interfaces": ["lo"], "horovod": {"gloo_timeout_s": GLOO_TIMEOUT_S},
        "elastic": {"discovery_script": str(REPO / "jobs" / "discover_hosts.sh"), "min_np": 2, "max_np": 3,
                    "reset_limit": 5, "timeout_s": 120, "blacklist_cooldown_s": [1, 1]},
        "args": [*RECIPE_ARGS, "--run-dir", str(run_dir)]}))
    return job


def digest_of_checkpoint(path: Path) -> str:
    """The recipe's weights_digest, recomputed from the checkpoint on disk."""
    import torch

    state = checkpoint.load(path, lambda f: torch.load(f, map_location="cpu", weights_only=True))
    h = hashlib.sha256()
    for name, t in state["model"].items():
        h.update(name.encode())
        h.update(t.contiguous().numpy().tobytes())
    return h.hexdigest()


@pytest.mark.slow
@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
def test_a_killed_rank_is_dropped_training_goes_on_and_its_host_is_readmitted(tmp_path: Path) -> None:
    """Over 30 s, and cannot be less: a whole elastic cycle of 3 ranks (a rank killed, the reset to 2, the host's
    cool-down and rediscovery, the reset back to 3) and every epoch to the end, for the exactly-once data check."""
    run_dir, hosts_file = tmp_path / "run", tmp_path / "hosts.txt"
    write_hosts(hosts_file, HOSTS)
    chaos = Chaos(run_dir, hosts_file)
    chaos.start()
    started = time.time()
    try:
        res = run_bounded([HVDTRAIN, "run", str(write_job(tmp_path, run_dir))], timeout=JOB_TIMEOUT_S,
                          env={"HVDTRAIN_HOSTS_FILE": str(hosts_file)})
    finally:
        chaos.stop.set()
        chaos.join(timeout=10)
        deadline = time.monotonic() + 15  # the killed rank's producers notice its death within a poll
        while chaos.alive() and time.monotonic() < deadline:
            time.sleep(0.2)
        leftovers = chaos.alive()
        chaos.kill_leftovers()
    wall = time.time() - started
    assert chaos.error is None, f"{chaos.error}\n{res.describe()}"
    expect_ok(res)
    events, summary = read_events(run_dir), json.loads((run_dir / "summary.json").read_text())
    t = chaos.times

    # the job finished every epoch, on 3 ranks, then 2, then 3 again; two resets
    assert summary["epochs_completed"] == EPOCHS and summary["world_sizes"] == [3, 2, 3], summary
    assert summary["resets"] == 2 and summary["world_size"] == 3
    assert [row["epoch"] for row in summary["history"]] == list(range(1, EPOCHS + 1))
    assert summary["val_accuracy"] > 0.8, summary["history"]

    # after the kill the survivors restarted from a commit made before it, then trained on
    restart = next(e for e in events if e["event"] == "start" and e["time"] > t["kill"])
    assert restart["size"] == 2
    before = [e for e in events if e["event"] == "commit" and e["time"] < t["before_kill"]]
    during = [e for e in events if e["event"] == "commit" and t["before_kill"] <= e["time"] < t["kill"]]
    assert (restart["epoch"], restart["samples"]) in {(e["epoch"], e["samples"]) for e in [before[-1], *during]}
    assert any(e["event"] == "commit" and e["size"] == 2 and e["samples"] > restart["samples"] for e in events)

    # the victim is dead, its host came back with a new process
    back = json.loads((run_dir / "workers" / f"{VICTIM}.0.json").read_text())
    assert back["pid"] != chaos.victim["pid"] and not psutil.pid_exists(chaos.victim["pid"])

    # all ranks ended with identical weights: those of the last checkpoint
    digests = summary["weights_sha256_by_rank"]
    assert len(digests) == 3 and len(set(digests)) == 1
    last = checkpoint.list_checkpoints(run_dir / "checkpoints")[-1]
    assert last[0] == EPOCHS and digest_of_checkpoint(last[1]) == digests[0]

    # each reset closed the old loader: after two re-shards every rank has one producer (+ the resource tracker)
    assert len(chaos.children_after_growth) == 3 and max(chaos.children_after_growth.values()) <= 2, \
        chaos.children_after_growth
    # nothing leaked: no rank or producer process, no shared-memory segment of theirs
    assert leftovers == [], "processes outlived the job:\n" + "\n".join(leftovers)
    assert len(chaos.seen) >= 6  # 3 ranks + their producers at least
    segments = [p.name for p in SHM_DIR.glob(SHM_PREFIX + "*") if int(p.name.split("_")[1]) in chaos.seen]
    assert segments == []

    print(f"\nelastic timings: kill -> survivors restarted {restart['time'] - t['kill']:.1f} s, -> first commit "
          f"on 2 ranks {t['resumed_commit'] - t['kill']:.1f} s; host re-listed -> 3 ranks training "
          f"{t['grown'] - t['relisted']:.1f} s; total wall {wall:.1f} s; children per rank after the re-shards "
          f"{sorted(chaos.children_after_growth.values())}")


# ---------------------------------------------------------------- Horovod's blacklist, in-process

@pytest.mark.parametrize("cooldown", [None, (1, 2)])
def test_horovod_readmits_a_failed_host_only_after_a_cooldown(cooldown: tuple[int, int] | None, monkeypatch) -> None:
    from horovod.runner.elastic import discovery

    clock = SimpleNamespace(now=1000.0)
    monkeypatch.setattr(discovery, "time", SimpleNamespace(time=lambda: clock.now))
    monkeypatch.setattr(discovery.random, "uniform", lambda a, b: 0.5)
    hosts = discovery.FixedHosts({"a": 1, "b": 1})
    manager = discovery.HostManager(hosts, cooldown_range=cooldown)
    manager.update_available_hosts()
    manager.blacklist("b")  # what the elastic driver does when a rank on b fails
    hosts.set({"a": 1})  # b leaves discovery...
    manager.update_available_hosts()
    clock.now += 1.0
    hosts.set({"a": 1, "b": 1})  # ...and comes back before its cooldown (1 × 2 + 0.5 = 2.5 s) is over
    manager.update_available_hosts()
    assert manager.current_hosts.available_hosts == {"a"}
    clock.now += 3600.0
    manager.update_available_hosts()
    assert manager.current_hosts.available_hosts == ({"a", "b"} if cooldown else {"a"})
    assert manager.is_blacklisted("b") == (cooldown is None)


def test_the_recipe_docstring_shows_the_exact_command_of_the_shipped_job() -> None:
    job = REPO / "jobs" / "elastic.yaml"
    spec = load_spec(job.read_text(), str(job))
    argv = build_plan(spec, controller="gloo").argv
    expected = [".venv/bin/python" if a == spec.python else a.removeprefix(f"{REPO}/") for a in argv]
    at = expected.index("-m")  # `hvdtrain run` adds the rank supervisor; the direct command runs the script itself
    assert expected[at:at + 2] == ["-m", "hvdtrain.rank"]
    del expected[at:at + 2]
    doc = ast.get_docstring(ast.parse((REPO / "recipes" / "pytorch_elastic.py").read_text())) or ""
    shown = doc.split("    horovodrun ", 1)[1].split("\n\n", 1)[0].replace("\\\n", " ")
    assert ["horovodrun", *shlex.split(shown)] == expected


# ---------------------------------------------------------------- asked to stop: a checkpoint at a commit, exit 75

STOP_ARGS = ["--dataset", "digits", "--epochs", "3", "--warmup-epochs", "1", "--lr-milestones", "2", "--batch-size",
             "16", "--commit-every", "5", "--weight-decay", "1e-3", "--threads", "1", "--keep-checkpoints", "3",
             "--no-tensorboard", "--no-progress"]


# Runs the recipe; rank 1 sends itself SIGUSR1 at its AT-th state.commit() (counted over epochs; 0: never), so
# that the request lands at a known commit (the launcher's stop file is looked for every 0.5 s, longer than what is
# left of a digits epoch: tests/launch/test_run_preempt.py tests that path).
STOP_WRAPPER = r"""
import os, runpy, signal, sys
if __name__ == "__main__":  # not in the recipe's data producer processes, which re-import the main module
    script, at = sys.argv[1], int(sys.argv[2])
    sys.argv = [script, *sys.argv[3:]]
    sys.path.insert(0, os.path.dirname(script))
    import horovod.torch as hvd
    original, count = hvd.elastic.TorchState.commit, [0]

    def commit(self):
        count[0] += 1
        if count[0] == at and hvd.rank() == 1:
            os.kill(os.getpid(), signal.SIGUSR1)
        return original(self)
    hvd.elastic.TorchState.commit = commit
    runpy.run_path(script, run_name="__main__")
"""


def write_stop_job(tmp_path: Path, run_dir: Path, at: int) -> Path:
    """Two ranks on two names of this machine (the shipped discovery script's default), no changes while it runs;
    rank 1 asks to stop at its `at`-th commit."""
    wrapper, job = tmp_path / "stop_at_commit.py", tmp_path / f"stop-{run_dir.name}.yaml"
    wrapper.write_text(STOP_WRAPPER)
    job.write_text(yaml.safe_dump({
        "script": str(wrapper), "np": 2, "controller": "gloo", "network_interfaces": ["lo"],
        "elastic": {"discovery_script": str(REPO / "jobs" / "discover_hosts.sh"), "min_np": 2, "max_np": 2,
                    "reset_limit": 1, "timeout_s": 60},
        "args": [str(REPO / "recipes" / "pytorch_elastic.py"), str(at), *STOP_ARGS, "--run-dir", str(run_dir)]}))
    return job


def without_timing(summary: dict[str, Any]) -> list[dict[str, Any]]:
    return [{k: v for k, v in row.items() if k not in ("samples_per_sec", "data_wait_share")}
            for row in summary["history"]]


@pytest.mark.slow
@pytest.mark.timeout(3 * JOB_TIMEOUT_S)
def test_sigusr1_stops_every_rank_at_the_next_commit_and_resumes_as_if_never_stopped(tmp_path: Path) -> None:
    """SIGUSR1 to one rank mid-epoch (as `scancel --signal=USR1`, or hvdtrain's stop file, asks): the elastic ranks
    stop at the next commit, rank 0 checkpoints its position mid-epoch (each rank's BatchNorm statistics with it),
    every rank exits 75 and so does `hvdtrain run` (Horovod's elastic driver
    ends a job whose every rank failed: nothing is restarted); the same command again resumes there and ends with
    the weights and history of a run never stopped."""
    reference, run_dir = tmp_path / "reference", tmp_path / "run"
    expect_ok(run_bounded([HVDTRAIN, "run", str(write_stop_job(tmp_path, reference, 0))], timeout=JOB_TIMEOUT_S))
    # 11 commits an epoch (9 every 5 of its 45 steps, its end, after its checkpoint): the 13th is at epoch 2's 10th
    # step, and the ranks stop at the next one.
    stopped = run_bounded([HVDTRAIN, "run", str(write_stop_job(tmp_path, run_dir, 13))], timeout=JOB_TIMEOUT_S)
    assert stopped.returncode == exitcodes.PREEMPTED, stopped.describe()
    names = [p.name for _, p in checkpoint.list_checkpoints(run_dir / "checkpoints")]
    assert names == ["ckpt-epoch0001.pt", "ckpt-epoch0001-step000015.pt"], f"{names}\n{stopped.output}"
    assert f"asked to stop (on another rank): checkpoint {run_dir / 'checkpoints' / names[1]}" in stopped.output, \
        stopped.output
    assert not (run_dir / "summary.json").exists()

    again = expect_ok(run_bounded([HVDTRAIN, "run", str(write_stop_job(tmp_path, run_dir, 0))], timeout=JOB_TIMEOUT_S))
    assert "(epoch 1 done, then 15 steps of epoch 2)" in again.output, again.output
    summary, uninterrupted = (json.loads((d / "summary.json").read_text()) for d in (run_dir, reference))
    assert without_timing(summary) == without_timing(uninterrupted)
    assert summary["weights_sha256_by_rank"] == uninterrupted["weights_sha256_by_rank"], \
        "resumed mid-epoch, the elastic run ended with other weights than one never stopped"


@pytest.mark.slow
@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
def test_a_mid_epoch_checkpoint_of_the_pytorch_recipe_stops_every_elastic_rank_with_exit_2(tmp_path: Path) -> None:
    """recipes/pytorch_train.py's stop checkpoint (each rank's own state) is not one this recipe resumes: rank 0
    finds it, and every rank stops after the state's sync with exit 2 naming it (were rank 0 alone to stop, the
    other would train from scratch once the Gloo timeout dropped it)."""
    sys.path.insert(0, str(REPO / "recipes"))
    try:
        import pytorch_elastic
        from pytorch_models import make_model
    finally:
        sys.path.remove(str(REPO / "recipes"))
    from hvdtrain.settings.parse import parse_config
    from hvdtrain.train import torchkit
    from hvdtrain.train.metrics import History
    from hvdtrain.train.recipe_data import load_splits

    cfg = parse_config(pytorch_elastic.Config, STOP_ARGS)
    splits = load_splits(cfg)
    model = make_model(torchkit.model_name(cfg, splits), splits.sample_shape, splits.num_classes, cfg.model_width)
    run_dir = tmp_path / "run"
    position = {"epoch": 1, "step": 5, "loader": {"epoch": 1, "batches_consumed": 5}, "ranks": [{}, {}]}
    torchkit.save_checkpoint(cfg, run_dir / "checkpoints", 1, model, torchkit.sgd(cfg, model, 0.1), History(),
                             position=position)
    result = run_bounded([HVDTRAIN, "run", str(write_stop_job(tmp_path, run_dir, 0))], timeout=JOB_TIMEOUT_S)
    assert result.returncode == 2, result.describe()
    assert "was written mid-epoch by recipes/pytorch_train.py when it was asked to stop" in result.output
    assert not (run_dir / "summary.json").exists() and len(checkpoint.list_checkpoints(run_dir / "checkpoints")) == 1
