"""B6's per-system plumbing (not a bench itself): the `write` and `read` commands every `bench/b6/sys_*.py` exposes.

A system module supplies two functions and calls `main(write, build)`:
- `write(args)`: write `args.samples` records into `args.out` in the system's native format, shards of about
  `args.shard_bytes`. Record i is `x`: `args.record_bytes` bytes of `record(i, args.record_bytes)` (incompressible,
  the first 8 bytes are i) and `y`: i (int64). Every system writes the same records.
- `build(args, state) -> Reader`: the system's loader for rank `args.rank` of `args.world`, reading `args.source` (a
  local directory or a `s3://` URL; the endpoint is in AWS_ENDPOINT_URL) through its cache `args.cache_dir`
  (bounded by `args.cache_limit` bytes when > 0), with the system's documented settings, `args.workers` loader
  worker processes and `args.batch_size`. `state`: a state from `Reader.state_dict()` to resume from (mid-epoch).

`read` runs one rank: torch.distributed (Gloo, env://) joins the ranks, only for barriers and to gather results; for
each epoch a barrier, then every batch (`Reader.batches(epoch)` yields each batch's sample indices, taken from `y`,
and the bytes of its `x`); rank 0 reads the server's byte counter (`--counter`, a sysfs file) after every epoch.
Halfway through the last epoch it takes `state_dict()`; after the epochs, it times a fresh `build(args, state)` to
its first batch (resume latency). CPU time (the rank and its worker processes) and PSS (the same tree) are sampled
by a thread (`baseline_pss`: before the loader is built, torch and Gloo loaded). Rank 0 writes the JSON the driver
(bench/streaming_vs_peers.py) reads; each rank writes the indices it read, per epoch.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import psutil

_BASE = np.random.default_rng(20261124).integers(0, 256, size=1 << 20, dtype=np.uint8)


def record(i: int, nbytes: int) -> bytes:
    """Record i's payload: `nbytes` pseudo-random bytes (a window of a fixed random block), i in the first 8."""
    start = (i * 4099) % (len(_BASE) - nbytes) if nbytes < len(_BASE) else 0
    body = np.resize(_BASE[start:start + nbytes], nbytes)
    return int(i).to_bytes(8, "little") + body[8:].tobytes()


class Reader(Protocol):
    def batches(self, epoch: int) -> Iterator[tuple[np.ndarray, int]]: ...
    def state_dict(self) -> Any | None: ...  # None: the system cannot resume mid-epoch
    def close(self) -> None: ...


Write = Callable[[argparse.Namespace], None]
Build = Callable[[argparse.Namespace, Any], Reader]


@dataclass
class Meter:
    """CPU seconds and peak PSS of this process and its descendants, sampled every `every` seconds."""

    every: float = 0.5
    cpu: dict[int, float] = field(default_factory=dict)
    peak_pss: int = 0
    peak_self_rss: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)

    def sample(self) -> None:
        me = psutil.Process()
        pss = 0
        for p in [me, *me.children(recursive=True)]:
            try:
                t = p.cpu_times()
                self.cpu[p.pid] = t.user + t.system
                pss += p.memory_full_info().pss  # proportional: forked workers' shared pages count once
            except psutil.Error:
                continue
        self.peak_pss = max(self.peak_pss, pss)
        self.peak_self_rss = max(self.peak_self_rss, me.memory_info().rss)

    def cpu_s(self) -> float:
        self.sample()
        return sum(self.cpu.values())

    def start(self) -> None:
        def loop() -> None:
            while not self._stop.wait(self.every):
                self.sample()
        threading.Thread(target=loop, daemon=True).start()

    def stop(self) -> None:
        self._stop.set()


def du(root: Path) -> int:
    """Bytes of the files under `root` (the cache directory after the epochs)."""
    total = 0
    for dirpath, _, files in os.walk(root):
        for name in files:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except OSError:
                continue
    return total


def counter(path: str) -> int:
    return int(Path(path).read_text()) if path else 0


def run_epoch(reader: Reader, epoch: int, seen: list[np.ndarray], snapshot_at: int | None,
              box: dict[str, Any]) -> tuple[int, int, float]:
    """Read one epoch; returns (samples, bytes, first batch seconds). Takes the state after `snapshot_at` batches."""
    t0 = time.perf_counter()
    first = -1.0
    samples = nbytes = 0
    for n, (idx, xb) in enumerate(reader.batches(epoch)):
        if first < 0:
            first = time.perf_counter() - t0
        seen.append(np.asarray(idx, dtype=np.int64).copy())
        samples += len(idx)
        nbytes += xb
        if snapshot_at is not None and n + 1 == snapshot_at:
            box["state"] = reader.state_dict()
            box["resume_from"] = samples
    return samples, nbytes, first


def read(args: argparse.Namespace, build: Build) -> int:
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=args.rank, world_size=args.world)
    meter = Meter()
    meter.sample()
    meter.start()
    out: dict[str, Any] = {"rank": args.rank, "epochs": [], "baseline_pss": meter.peak_pss}
    gc.collect()  # the imports' garbage (torch's: 0.1-0.4 s under load) is not the loader's first batch
    t_build = time.perf_counter()
    reader = build(args, None)
    box: dict[str, Any] = {}
    per_rank_batches = -(-args.samples // args.world // args.batch_size)
    for epoch in range(args.epochs):
        dist.barrier()
        c0, cpu0, t0 = counter(args.counter), meter.cpu_s(), time.perf_counter()
        seen: list[np.ndarray] = []
        last = epoch == args.epochs - 1
        samples, nbytes, first = run_epoch(reader, epoch, seen, per_rank_batches // 2 if last else None, box)
        secs = time.perf_counter() - t0
        if epoch == 0:
            first = t0 - t_build + first  # cold: from the loader's construction
        cpu = meter.cpu_s() - cpu0
        dist.barrier()
        out["epochs"].append({"samples": samples, "bytes": nbytes, "seconds": secs, "first_batch_s": first,
                              "cpu_s": cpu, "server_bytes": counter(args.counter) - c0})
        np.save(Path(args.out).with_name(f"{Path(args.out).stem}.rank{args.rank}.epoch{epoch}.npy"),
                np.concatenate(seen) if seen else np.zeros(0, np.int64))
    reader.close()
    out["resume_s"] = None
    if box.get("state") is not None:
        t0 = time.perf_counter()
        again = build(args, box["state"])
        it = iter(again.batches(args.epochs - 1))
        next(it)
        out["resume_s"] = time.perf_counter() - t0
        out["resume_from"] = box["resume_from"]
        del it
        again.close()
    meter.stop()
    out["peak_pss"], out["peak_self_rss"] = meter.peak_pss, meter.peak_self_rss
    out["cache_bytes"] = du(Path(args.cache_dir))
    gathered: list[Any] = [None] * args.world
    dist.all_gather_object(gathered, out)
    if args.rank == 0:
        Path(args.out).write_text(json.dumps(gathered, indent=1) + "\n")
    dist.barrier()
    dist.destroy_process_group()
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("write")
    w.add_argument("--out", required=True)
    w.add_argument("--samples", type=int, required=True)
    w.add_argument("--record-bytes", type=int, required=True)
    w.add_argument("--shard-bytes", type=int, default=64 << 20)
    r = sub.add_parser("read")
    r.add_argument("--source", required=True)
    r.add_argument("--cache-dir", required=True)
    r.add_argument("--cache-limit", type=int, default=0)
    r.add_argument("--samples", type=int, required=True, help="records in the dataset")
    r.add_argument("--record-bytes", type=int, required=True)
    r.add_argument("--epochs", type=int, default=2)
    r.add_argument("--batch-size", type=int, default=32)
    r.add_argument("--workers", type=int, default=2)
    r.add_argument("--seed", type=int, default=17)
    r.add_argument("--counter", default="", help="sysfs byte counter of the server's link ('' for none)")
    r.add_argument("--out", required=True, help="JSON written by rank 0")
    return p


def main(write: Write, build: Build) -> int:
    args = parser().parse_args()
    if args.cmd == "write":
        Path(args.out).mkdir(parents=True, exist_ok=True)
        write(args)
        return 0
    args.rank, args.world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return read(args, build)
