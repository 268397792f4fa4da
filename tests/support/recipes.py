"""Run a shipped recipe for real with 2 Horovod ranks, each under an audit wrapper: the one recipe-running helper of
the tests (PyTorch, Keras and precision tests alike).

The wrapper records, with a Python audit hook, every file a rank opens for writing, renames or makes (mkdir) inside
the run directory, so "only rank 0 writes" is checked from what the ranks did, not from what the recipe says; and,
through SIGNAL_AT, can make a stop request land at a known step.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from hvdtrain.train import checkpoint
from tests.support.harness import REPO, SIGNAL_AT, JobResult, expect_ok, horovodrun

PYTORCH = REPO / "recipes" / "pytorch_train.py"
KERAS = REPO / "recipes" / "keras_train.py"
TIMEOUT_S = 300  # a bound, not an expectation: a 3-epoch digits run takes 15-40 s on 2 busy cores

WRAPPER = r'''
import json, os, runpy, sys
recording, log_fd, main_pid = [True], [-1], os.getpid()
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC

def under_watch(path):
    if isinstance(path, bytes):
        path = path.decode()
    return isinstance(path, str) and os.path.realpath(path).startswith(watch + os.sep)

def record(entry):
    # One line per write, as it happens: a rank that horovodrun kills on its way out (143) leaves its record whole.
    os.write(log_fd[0], (json.dumps(entry) + "\n").encode())

def hook(event, args):
    if not recording[0] or os.getpid() != main_pid:  # not in forked data producers
        return
    if event == "open" and under_watch(args[0]):
        mode, flags = args[1], args[2]
        if (isinstance(mode, str) and set(mode) & set("wax+")) or (isinstance(flags, int) and flags & WRITE_FLAGS):
            record(["open", os.path.realpath(args[0])])
    elif event == "os.rename" and under_watch(args[1]):
        record(["rename", os.path.realpath(args[1])])
    elif event == "os.mkdir" and under_watch(args[0]):
        record(["mkdir", os.path.realpath(args[0])])

''' + SIGNAL_AT + r'''
if __name__ == "__main__":  # not in the recipe's data producer processes, which may re-import the main module
    log_path, script, watch = sys.argv[1], sys.argv[2], os.path.realpath(sys.argv[3])
    rank = int(os.environ.get("HOROVOD_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "-1")))
    signal_at(rank)
    log_fd[0] = os.open(f"{log_path}.rank{rank}.jsonl", os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o644)
    record({"pid": main_pid})
    sys.addaudithook(hook)
    sys.argv = [script, *sys.argv[4:]]
    sys.path.insert(0, os.path.dirname(script))
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        recording[0] = False
'''


@dataclass
class Run:
    result: JobResult
    run_dir: Path
    audit: dict[int, list[list[str]]]  # rank -> its Python-level writes into the run directory
    pids: dict[int, int] = field(default_factory=dict)

    @property
    def output(self) -> str:
        return self.result.output

    def summary(self) -> dict:
        return json.loads((self.run_dir / "summary.json").read_text())

    def checkpoints(self) -> list[str]:
        return [p.name for _, p in checkpoint.list_checkpoints(self.run_dir / "checkpoints")]


def run_recipe(recipe: Path, tmp: Path, run_dir: Path, *args: str, controller: str = "gloo", exit_code: int = 0,
               env: dict[str, str] | None = None, timeout: float = TIMEOUT_S, plain: bool = False) -> Run:
    """`horovodrun -np 2` of `recipe --run-dir run_dir *args` (harness.horovodrun: plain horovodrun if `plain`),
    each rank under the audit wrapper; fails the test (with every rank's output) unless it exits with `exit_code`."""
    wrapper = tmp / "audit_wrapper.py"
    wrapper.write_text(WRAPPER)
    log = tmp / f"audit-{len(list(tmp.glob('audit-*')))}"
    result = horovodrun(wrapper, str(log), str(recipe), str(run_dir), "--run-dir", str(run_dir), *args,
                        controller=controller, timeout=timeout, env=env, plain=plain)
    if exit_code == 0:
        expect_ok(result)
    elif result.returncode != exit_code:
        pytest.fail(f"expected exit code {exit_code}\n{result.describe()}", pytrace=False)
    logs = {int(p.name.rsplit(".rank", 1)[1].split(".")[0]): [json.loads(line) for line in p.read_text().splitlines()]
            for p in tmp.glob(f"{log.name}.rank*.jsonl")}  # {"pid": ...}, then one [event, path] per write
    return Run(result, run_dir, {r: v[1:] for r, v in logs.items()}, {r: v[0]["pid"] for r, v in logs.items()})


def epoch_lines(output: str) -> list[int]:
    """The epochs a run's output reports as trained, in order."""
    return [int(m.group(1)) for m in re.finditer(r"epoch (\d+)/\d+  train loss", output)]


def history_without_timing(summary: dict) -> list[dict]:
    return [{k: v for k, v in row.items() if k not in ("samples_per_sec", "data_wait_share")}
            for row in summary["history"]]


def file_digest(state: dict[str, Any]) -> str:
    """The PyTorch recipe's weights digest, recomputed independently from a state dict of tensors."""
    h = hashlib.sha256()
    for name, t in state.items():
        h.update(name.encode())
        h.update(t.contiguous().numpy().tobytes())
    return h.hexdigest()


def checkpoint_state(run: Run, epoch: int) -> dict:
    """Rank 0's PyTorch checkpoint of `epoch`, loaded (weights only)."""
    import torch

    path = run.run_dir / "checkpoints" / f"ckpt-epoch{epoch:04d}.pt"
    return checkpoint.load(path, lambda f: torch.load(f, weights_only=True))
