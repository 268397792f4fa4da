"""Helpers shared by the bench scripts (not a bench itself): output files and the after-run leak check."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "bench" / "out"  # gitignored
sys.path.insert(0, str(REPO))  # run as `python bench/x.py` from anywhere

from hvdtrain.data.shm import creator_pid  # noqa: E402


def write_json(path: Path, data: Any) -> Path:
    """Write `data` as JSON to `path` (normally under bench/out/), creating the folder; returns the path."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, default=float) + "\n")
    return path


def recipe_run(recipe: Any, *, meters: Any, vote: Any, **fields: Any) -> Any:
    """recipes/pytorch_train.py's `Run` for calling its `train_epoch` from a bench: `fields` are what train_epoch
    reads (cfg, epochs, loader, net, optimizer, precision, schedule); the fields it does not read are None."""
    needed = {f.name: None for f in dataclasses.fields(recipe.Run)
              if f.init and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    run = recipe.Run(**{**needed, **fields})
    run.meters, run.vote = meters, vote
    return run


def goal_lines(goals: dict[str, Any] | str) -> list[str]:
    """A GPU bench's judged goals, one line each (met / NOT met), or the one line saying why none were judged."""
    if isinstance(goals, str):
        return [goals]
    return [f"goal {k}: {g['value']:.4g} -> {'met' if g['met'] else 'NOT met'}" for k, g in goals.items()]


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for a server or a rendezvous the caller starts next)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def shm_segments() -> set[str]:
    """hvdtrain shared-memory segments currently in /dev/shm."""
    if not os.path.isdir("/dev/shm"):
        return set()
    return {name for name in os.listdir("/dev/shm") if name.startswith("hvdtrain_")}


def check_clean(before: set[str], grace_s: float = 5.0) -> list[str]:
    """Problems left by this run: live child processes of this process (but for multiprocessing's resource
    tracker, which lives as long as the interpreter), and hvdtrain segments that were not in
    /dev/shm before it, unless their creator (the pid in the name) is another live process: on a shared machine
    those belong to someone else. Waits up to `grace_s` for stragglers to exit. Prints what it finds to stderr;
    returns it (empty: clean)."""
    me = psutil.Process()
    deadline = time.monotonic() + grace_s
    while True:
        children = [c for c in me.children(recursive=True) if _alive(c) and not _interpreter_helper(c)]
        segments = sorted(s for s in shm_segments() - before if not _owned_by_live_stranger(s, me.pid))
        if (not children and not segments) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    problems = [f"child process still running: pid {c.pid} {' '.join(c.cmdline())[:120]}" for c in children]
    problems += [f"segment left in /dev/shm: {name}" for name in segments]
    for p in problems:
        print(f"LEAK: {p}", file=sys.stderr, flush=True)
    return problems


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:  # exited during the scan
        return False


def kill_tree(proc: Any) -> None:
    """SIGKILL a job started with start_new_session=True: its group and every descendant (horovodrun's ranks run
    in sessions of their own; the tree is walked before anything dies and is re-parented)."""
    import contextlib
    import signal

    try:
        descendants = psutil.Process(proc.pid).children(recursive=True)
    except psutil.Error:
        descendants = []
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    for p in descendants:
        with contextlib.suppress(psutil.Error):
            p.kill()


def _interpreter_helper(proc: Any) -> bool:
    """multiprocessing's resource tracker: one per interpreter, started by the first shared-memory segment or
    spawned process; it ends when this interpreter exits (and then unlinks whatever was registered and left)."""
    try:
        return "multiprocessing.resource_tracker" in " ".join(proc.cmdline())
    except psutil.Error:
        return False


def _owned_by_live_stranger(segment: str, my_pid: int) -> bool:
    pid = creator_pid(segment)
    if pid is None or pid == my_pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def watch_run(argv: list[str], on_line: Callable[[str, float], None], *, timeout_s: float,
              cwd: Path | None = None) -> tuple[int, list[str]]:
    """Run `argv` in a new session, calling `on_line(line, seconds since the start)` for each line of its output
    (stdout and stderr); wait up to `timeout_s` for it to exit, then kill its whole process group. Returns (exit
    code, the lines)."""
    start = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True, cwd=cwd)
    lines: list[str] = []

    def read() -> None:
        for raw in proc.stdout:  # type: ignore[union-attr]
            lines.append(raw.decode(errors="replace").rstrip("\n"))
            on_line(lines[-1], time.perf_counter() - start)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        code = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise SystemExit(f"timed out after {timeout_s:g} s: {' '.join(argv)}\n" + "\n".join(lines)) from None
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        reader.join(timeout=10)
    return code, lines
