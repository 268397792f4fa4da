"""B3: the PyTorch recipe training from shards on disk (MDS, streamed) vs from synthetic in-memory data, side by side.

    .venv/bin/python bench/recipe_shards_vs_synthetic.py        # np=2, Gloo, about 1.5-2 minutes on 2 CPU cores
    .venv/bin/python bench/recipe_shards_vs_synthetic.py --num-iters 2 --num-batches-per-iter 4 \
        --num-warmup-batches 4                                  # a quick check that it runs (~1 minute)

What it measures: samples/s per worker of the recipe's own training loop (`recipes/pytorch_train.py`: `setup()`
and `train_epoch()`, timed exactly as the recipe times an epoch; the machinery is recipe_vs_synthetic.py's) on
two datasets in one horovodrun job:
- synthetic: `--dataset synthetic`, random samples generated in memory at setup (the throughput ceiling);
- shards: `--dataset DIR`, a temporary dataset root with `train/` and `val/`, written by this script before the job
  starts and removed after: `--format mds` (default) MDS shards (`--shard-files` of them), which the recipe
  streams: the loader's producers read memory-mapped shards batch by batch, shuffle block by shuffle block; `npy`:
  `NAME_x.npy` + `NAME_y.npy` pairs, `npz`: `NAME.npz` files with arrays x and y, both memory-mapped and read batch
  by batch in the producers too (hvdtrain/formats/npyshards.py; an `.npz` is CRC-checked once at load).
The shards hold exactly the samples and labels that the synthetic side generates (same shape, seed, count), so
the model, batches and work per step are identical; the job checks that the two training sets are equal. Each
side trains one warmup epoch, then `--num-iters` (16) epochs of `--num-batches-per-iter` (20) steps per rank (more
than recipe_vs_synthetic.py's Horovod defaults of 10 x 10: the goal is a 5% threshold), alternating
which side goes first, so machine load drifts hit both alike. "load s" is the median time of the `recipe_data.load()`
call setup() makes, timed on rank 0 (npy: headers and labels; npz: also the CRC check of each archive; mds: the
index only; the samples are read while training; synthetic: generating the data).

Ratio = shards / synthetic samples/s per worker; goal >= 0.95x. Printed, and written to
bench/out/recipe_shards_vs_synthetic.json. Also reported: each side's data wait share of step time (StallMeter).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from _common import check_clean, shm_segments, write_json
from recipe_vs_synthetic import (
    OUT,
    build_parser,
    check_args,
    compare,
    forwarded,
    interleave,
    recipe_side,
    run_bench_job,
    stats,
)

SEED = 42  # the recipe's Config.seed default: its synthetic data come from it (checked in the job)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = build_parser(__doc__.split("\n\n")[0])
    # Longer and more epochs than Horovod's benchmark defaults: the goal is a 5% threshold.
    p.set_defaults(num_iters=16, num_batches_per_iter=20, num_warmup_batches=20)
    p.add_argument("--format", choices=("mds", "npy", "npz"), default="mds", help="shard file format")
    p.add_argument("--shard-files", type=int, default=4, help="training shard files (val: one)")
    p.add_argument("--store", choices=("disk", "s3"), default="disk",
                   help="mds: read the shards from local disk, or from a local S3 server (moto, 127.0.0.1) through "
                        "the node cache: the warmup epoch fetches them, the timed epochs read the cache (epoch 2)")
    p.add_argument("--shards", help=argparse.SUPPRESS)  # inside horovodrun: the directory the driver wrote
    args = check_args(p, p.parse_args(argv))
    if args.store == "s3" and args.format != "mds":
        p.error("--store s3 streams MDS shards: use it with --format mds")
    if not 1 <= args.shard_files <= args.batch_size * args.num_batches_per_iter * args.np:
        p.error(f"--shard-files must be between 1 and the number of training samples, got {args.shard_files}")
    return args


# ---- driver: write the shards ---------------------------------------------------------------------------------

def write_shards(args: argparse.Namespace, directory: Path) -> dict[str, Any]:
    """train/ and val/ shards holding the recipe's synthetic data for this configuration; returns what was written."""
    from hvdtrain.formats import arrays

    n = args.batch_size * args.num_batches_per_iter * args.np  # as recipe_side sizes the synthetic side
    splits = arrays.synthetic(args.shape, n, num_classes=args.num_classes, seed=SEED)
    for split in (splits.train, splits.val):
        if int(split.y.max()) + 1 != args.num_classes:  # the recipe infers the classes from the labels
            raise SystemExit(f"the random labels do not reach class {args.num_classes - 1}: use more samples "
                             "(--num-batches-per-iter) or fewer --num-classes")
    if args.format == "mds":
        return write_mds(args, directory, splits)
    files, nbytes = 0, 0
    for name, split, parts in (("train", splits.train, args.shard_files), ("val", splits.val, 1)):
        (directory / name).mkdir(parents=True)
        for i, (x, y) in enumerate(zip(np.array_split(split.x, parts), np.array_split(split.y, parts),
                                       strict=True)):
            stem = directory / name / f"part{i:03d}"
            if args.format == "npz":
                np.savez(stem.with_suffix(".npz"), x=x, y=y)
                files += 1
            else:
                np.save(f"{stem}_x.npy", x)
                np.save(f"{stem}_y.npy", y)
                files += 2
            nbytes += x.nbytes + y.nbytes
    return {"train_samples": len(splits.train), "val_samples": len(splits.val), "files": files, "bytes": nbytes}


def write_mds(args: argparse.Namespace, directory: Path, splits: Any) -> dict[str, Any]:
    from hvdtrain.stream import MDSWriter
    from hvdtrain.stream.encodings import ndarray_encoding

    columns = {"x": ndarray_encoding(splits.train.x[0]), "y": "int64"}
    files, nbytes = 0, 0
    for name, split, parts in (("train", splits.train, args.shard_files), ("val", splits.val, 1)):
        per_shard = -(-len(split) // parts)
        record = split.x[0].nbytes + 8 + 4
        with MDSWriter(directory / name, columns, size_limit=per_shard * record + 4096,
                       meta={"num_classes": args.num_classes}) as w:
            for x, y in zip(split.x, split.y, strict=True):
                w.write({"x": x, "y": int(y)})
        files += len(w.shards) + 1
        nbytes += sum(s["raw_data"]["bytes"] for s in w.shards)
    return {"train_samples": len(splits.train), "val_samples": len(splits.val), "files": files, "bytes": nbytes}


def training_set(split: Any) -> tuple[np.ndarray, np.ndarray]:
    """All of a split's samples and labels (a streamed split is read here, once, for the equality check)."""
    return (split.x, split.y) if hasattr(split, "x") else split.take(np.arange(len(split)))


# ---- inside horovodrun ----------------------------------------------------------------------------------------

def load_seconds(cfg: Any, repeats: int = 3) -> float:
    """Median seconds of the `recipe_data.load()` call the recipe's setup() makes for this config (reading the shards,
    or generating the synthetic data)."""
    from hvdtrain.train import recipe_data

    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        recipe_data.load(cfg.dataset, val_fraction=cfg.val_fraction, split_seed=0, synthetic_shape=cfg.synthetic_shape,
                      synthetic_samples=cfg.synthetic_samples, num_classes=cfg.num_classes, seed=cfg.seed)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def worker(args: argparse.Namespace) -> None:
    import horovod.torch as hvd

    from hvdtrain.train.metrics import combine_stall

    hvd.init()
    with contextlib.ExitStack() as stack:
        sides = {}
        for name, dataset in (("synthetic", "synthetic"), ("shards", args.shards)):
            sides[name] = recipe_side(args, dataset, OUT / f"recipe-run-{name}")
            stack.callback(sides[name][0].train_loader.close)
        (syn, syn_epoch), (shd, shd_epoch) = sides["synthetic"], sides["shards"]
        (ax, ay), (bx, by) = (training_set(t.train_loader.loader.dataset) for t in (syn, shd))
        same_data = (syn.cfg.seed == SEED and np.array_equal(ax, bx) and np.array_equal(ay, by)
                     and ax.dtype == bx.dtype)
        syn_epoch(0)  # one warmup epoch each: worker start-up, first touch of the slots, allocator
        shd_epoch(0)
        synthetic, shards = interleave(syn_epoch, shd_epoch, args.num_iters)
    stall = {name: combine_stall(hvd.allgather_object(t.meter.summary(), name=f"bench.stall.{name}"))
             for name, (t, _) in sides.items()}
    if hvd.rank() == 0:
        load_s = {name: load_seconds(t.cfg) for name, (t, _) in sides.items()}
        print("BENCH_RESULT " + json.dumps({"synthetic": synthetic, "shards": shards, "stall": stall,
                                            "load_s": load_s, "same_data": bool(same_data)}), flush=True)


# ---- driver ---------------------------------------------------------------------------------------------------

def report(args: argparse.Namespace, raw: dict[str, Any], written: dict[str, Any], wall_s: float,
           leaks: list[str]) -> dict[str, Any]:
    s, h, ratios = stats(raw["synthetic"]), stats(raw["shards"]), compare(raw["synthetic"], raw["shards"])
    result = {"config": {k: v for k, v in vars(args).items() if k not in ("worker", "shards")}, "shards": written,
              "synthetic_samples_per_sec_per_worker": s, "shards_samples_per_sec_per_worker": h,
              **{f"{k}_shards_over_synthetic": v for k, v in ratios.items()}, "goal": ">= 0.95",
              "meets_goal": ratios["paired_ratio_median"] >= 0.95, "dataset_load_s": raw["load_s"],
              "data_wait_share": {k: v["wait_share"] for k, v in raw["stall"].items()},
              "mean_data_wait_s": {k: v["mean_wait_s"] for k, v in raw["stall"].items()},
              "same_data": raw["same_data"], "per_iteration": {k: raw[k] for k in ("synthetic", "shards")},
              "wall_s": wall_s, "leaks": leaks}
    where = " from S3" if args.store == "s3" else ""
    print(f"B3: recipe on {written['files']} {args.format} files{where} ({written['bytes'] / 1e6:.1f} MB, "
          f"{written['train_samples']} train samples) vs synthetic in memory; ResNet(width {args.width}) on "
          f"{args.shape}, batch {args.batch_size}/rank, np={args.np} ({args.controller}), {args.num_workers} data "
          f"worker(s)/rank; {args.num_iters}×{args.num_batches_per_iter} timed steps each, interleaved")
    print(f"  {'side':<12}{'samples/s/worker':>18}{'± 95%':>9}{'median':>9}{'data wait':>11}{'load s':>9}")
    for name, x in (("synthetic", s), ("shards", h)):
        share = result["data_wait_share"][name]
        print(f"  {name:<12}{x['mean']:>18.1f}{x['conf95']:>9.1f}{x['median']:>9.1f}"
              f"{'n/a' if share is None else format(share, '.1%'):>11}{raw['load_s'][name]:>9.3f}")
    print(f"  ratio shards/synthetic: {ratios['ratio_of_means']:.3f}x of means, {ratios['ratio_of_medians']:.3f}x "
          f"of medians, {ratios['paired_ratio_median']:.3f}x median of paired ratios (goal >= 0.95x: "
          f"{'met' if result['meets_goal'] else 'NOT met'})")
    if not raw["same_data"]:
        print("  WARNING: the two training sets differ (the recipe's seed or synthetic data changed?)")
    return result


@contextlib.contextmanager
def s3_copy(local: Path, cache: Path) -> Any:
    """`local` uploaded to a moto S3 server on 127.0.0.1 (this process), the job's environment pointed at it and at an
    empty node cache; yields the dataset URL."""
    import os

    import boto3
    from moto.server import ThreadedMotoServer

    from hvdtrain.stream.upload import upload

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        env = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1",
               "AWS_ENDPOINT_URL": f"http://{host}:{port}", "HVDTRAIN_DATA_CACHE": str(cache)}
        os.environ.update(env)
        boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], region_name="us-east-1").create_bucket(Bucket="bench")
        upload(local, "s3://bench/shards", progress=False)
        yield "s3://bench/shards"
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    start, before = time.perf_counter(), shm_segments()
    with tempfile.TemporaryDirectory(prefix="hvdtrain-bench-shards-") as tmp, contextlib.ExitStack() as stack:
        written = write_shards(args, Path(tmp) / "data")
        source = str(Path(tmp) / "data")
        if args.store == "s3":
            source = stack.enter_context(s3_copy(Path(source), Path(tmp) / "node-cache"))
        raw = run_bench_job(args, Path(__file__), [*forwarded(args), "--shards", source])
    result = report(args, raw, written, time.perf_counter() - start, check_clean(before))
    path = write_json(OUT / "recipe_shards_vs_synthetic.json", result)
    print(f"  wall {result['wall_s']:.0f} s; written to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
