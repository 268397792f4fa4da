"""Launch overhead of `hvdtrain run` against plain `horovodrun`, on the same tiny 2-rank script (not a test).

For each launcher: seconds from starting the process to the first training step (an allreduce on every rank,
then rank 0 prints STEP), and to the job's end. Runs alternate (hvdtrain, horovodrun, hvdtrain, ...) so that
machine load hits both alike; medians and the ratio are printed. Goal: hvdtrain / horovodrun <= 1.10.

    .venv/bin/python bench/launch_overhead.py [--runs 5] [--controller gloo|mpi]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

BIN = Path(sys.executable).parent
TINY = """
import horovod.torch as hvd
import torch
hvd.init()
hvd.allreduce(torch.ones(4), name="step")  # the first training step: every rank took part
if hvd.rank() == 0:
    print("STEP", flush=True)
"""
TIMEOUT_S = 180


def timed_run(argv: list[str]) -> tuple[float, float]:
    """(seconds to the STEP line, seconds to exit) for one run; the whole process group is killed afterwards."""
    start = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True)
    first_step: list[float] = []
    lines: list[str] = []

    def read() -> None:
        for raw in proc.stdout:  # type: ignore[union-attr]
            line = raw.decode(errors="replace")
            lines.append(line)
            if not first_step and "<stdout>:STEP" in line:
                first_step.append(time.perf_counter() - start)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        code = proc.wait(timeout=TIMEOUT_S)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        reader.join(timeout=10)
    total = time.perf_counter() - start
    if code != 0 or not first_step:
        raise SystemExit(f"run failed (exit {code}): {' '.join(argv)}\n{''.join(lines)}")
    return first_step[0], total


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="runs per launcher (default 5)")
    parser.add_argument("--controller", choices=("gloo", "mpi"), default=None,
                        help="controller for both (default: leave it to hvdtrain's detection; horovodrun gets "
                             "the same flag hvdtrain's plan uses)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="hvdtrain-bench-") as tmp:
        script, job = Path(tmp) / "tiny.py", Path(tmp) / "job.yaml"
        script.write_text(TINY)
        job.write_text("script: tiny.py\nnp: 2\n" + (f"controller: {args.controller}\n" if args.controller else ""))
        hvdtrain = [str(BIN / "hvdtrain"), "run", str(job)]
        dry = subprocess.run([*hvdtrain, "--dry-run"], capture_output=True, text=True, timeout=TIMEOUT_S, check=True)
        controller = "--mpi" if " --mpi " in dry.stdout else "--gloo"  # also warms hvdtrain's controller cache
        horovodrun = [str(BIN / "horovodrun"), "-np", "2", "-H", "localhost:2", controller, sys.executable,
                      str(script)]
        dry_s = []
        for _ in range(args.runs):  # hvdtrain's fixed cost before horovodrun starts: load, validate, plan
            t = time.perf_counter()
            subprocess.run([*hvdtrain, "--dry-run"], capture_output=True, timeout=TIMEOUT_S, check=True)
            dry_s.append(time.perf_counter() - t)
        timed_run(hvdtrain)  # warm-up (page cache), not counted
        results: dict[str, list[tuple[float, float]]] = {"hvdtrain run": [], "horovodrun": []}
        for i in range(args.runs):
            for name, argv in (("hvdtrain run", hvdtrain), ("horovodrun", horovodrun))[:: 1 if i % 2 else -1]:
                results[name].append(timed_run(argv))
                print(f"  run {i + 1} {name:12s} first step {results[name][-1][0]:6.2f} s, "
                      f"exit {results[name][-1][1]:6.2f} s", flush=True)
    med = {name: (statistics.median(r[0] for r in rs), statistics.median(r[1] for r in rs))
           for name, rs in results.items()}
    print(f"\ncontroller {controller[2:]}, np=2, {args.runs} interleaved runs each, medians:")
    for name, (step, total) in med.items():
        print(f"  {name:12s} to first step {step:6.2f} s   to exit {total:6.2f} s")
    print(f"  hvdtrain run --dry-run (fixed cost before horovodrun starts) {statistics.median(dry_s):.2f} s")
    ratio = med["hvdtrain run"][0] / med["horovodrun"][0]
    print(f"  ratio (to first step) {ratio:.3f}x  (goal <= 1.10x)  "
          f"to exit {med['hvdtrain run'][1] / med['horovodrun'][1]:.3f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
