"""Time to the first training step of the quickstart job: `hvdtrain run jobs/quickstart.yaml` vs `torchrun` running
an equivalent torch.distributed DDP script (not a test; issue 35 item 4).

Both sides: 2 ranks on this machine, Gloo, scikit-learn's digits loaded through the same `arrays.digits()`, the
same SmallCNN (recipes/pytorch_models.py), SGD with momentum, batches of 32 per rank. The DDP script is what a
torchrun user would write, kept lean: DistributedSampler + DataLoader (1 worker process, as the recipe's 1
producer), DDP, no TensorBoard, no checkpoint look-up, no run-directory lock; it prints FIRST_STEP after its
first optimizer step and exits. hvdtrain's side is the quickstart job as shipped (1 epoch, a fresh run directory
each run); its rank 0 prints `first step ... s after hvdtrain run started: <parts>` (hvdtrain/train/startup.py).
Seconds are measured here, from starting the launcher to that line. Runs alternate (hvdtrain first, then
torchrun first); medians, the ratio and hvdtrain's median parts are printed. Goal: hvdtrain / torchrun <= 1.0.

    .venv/bin/python bench/first_step.py [--runs 5]
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import tempfile
from pathlib import Path

from _common import REPO, watch_run

BIN = Path(sys.executable).parent
DDP = """
import sys
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler
sys.path.insert(0, {recipes!r})
from pytorch_models import make_model
from hvdtrain.formats import arrays

dist.init_process_group("gloo")
rank, size = dist.get_rank(), dist.get_world_size()
torch.set_num_threads(1)
splits = arrays.digits()
train = TensorDataset(torch.from_numpy(splits.train.x), torch.from_numpy(splits.train.y).long())
sampler = DistributedSampler(train, num_replicas=size, rank=rank, shuffle=True, seed=42)
loader = DataLoader(train, batch_size=32, sampler=sampler, num_workers=1, persistent_workers=True)
torch.manual_seed(42)
model = DistributedDataParallel(make_model("cnn", splits.sample_shape, splits.num_classes))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05 * size, momentum=0.9)
for x, y in loader:
    optimizer.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()
    if rank == 0:
        print("FIRST_STEP", flush=True)
    break
dist.destroy_process_group()
"""
TIMEOUT_S = 240
FIRST = re.compile(r"<stdout>:first step (\d+\.\d+) s after .*?: (.*)$|^FIRST_STEP$")
PART = re.compile(r"([a-z ]+) (\d+\.\d+) s")


def timed(argv: list[str]) -> tuple[float, dict[str, float]]:
    """(seconds from start to the first-step line, hvdtrain's parts or {}); the job then runs to its end."""
    seen: list[tuple[float, dict[str, float]]] = []

    def on_line(line: str, seconds: float) -> None:
        found = FIRST.search(line)
        if found and not seen:
            seen.append((seconds, {m.group(1).strip(): float(m.group(2)) for m in PART.finditer(found.group(2) or "")}))

    code, lines = watch_run(argv, on_line, timeout_s=TIMEOUT_S, cwd=REPO)
    if code != 0 or not seen:
        raise SystemExit(f"run failed (exit {code}): {' '.join(argv)}\n" + "\n".join(lines))
    return seen[0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="runs per side (default 5)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="hvdtrain-bench-") as tmp:
        ddp = Path(tmp) / "ddp_quickstart.py"
        ddp.write_text(DDP.format(recipes=str(REPO / "recipes")))

        def hvdtrain(i: int) -> list[str]:
            return [str(BIN / "hvdtrain"), "run", str(REPO / "jobs" / "quickstart.yaml"), "-o",
                    f"recipe={{dataset: digits, epochs: 1, run_dir: '{tmp}/run{i}'}}"]

        torchrun = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "2", str(ddp)]
        timed(hvdtrain(0))  # warm-up (page cache, hvdtrain's probe cache), not counted
        timed(torchrun)
        results: dict[str, list[tuple[float, dict[str, float]]]] = {"hvdtrain run": [], "torchrun": []}
        for i in range(args.runs):
            sides = [("hvdtrain run", hvdtrain(i + 1)), ("torchrun", torchrun)]
            for name, argv in sides[:: 1 if i % 2 == 0 else -1]:
                results[name].append(timed(argv))
                print(f"  run {i + 1} {name:12s} first step {results[name][-1][0]:6.2f} s", flush=True)
    report(results, args.runs)
    return 0


def report(results: dict[str, list[tuple[float, dict[str, float]]]], runs: int) -> None:
    med = {name: statistics.median(r[0] for r in rs) for name, rs in results.items()}
    print(f"\nquickstart, np=2, Gloo, {runs} alternated runs each, medians:")
    for name, seconds in med.items():
        print(f"  {name:12s} to the first step {seconds:6.2f} s")
    parts = results["hvdtrain run"][0][1]
    print("  hvdtrain's parts (rank 0's clock, medians): " + ", ".join(
        f"{name} {statistics.median(r[1].get(name, 0.0) for r in results['hvdtrain run']):.2f} s" for name in parts))
    print(f"  hvdtrain run / torchrun: {med['hvdtrain run'] / med['torchrun']:.3f}x (goal <= 1.00x)")


if __name__ == "__main__":
    sys.exit(main())
