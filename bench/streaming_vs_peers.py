"""B6: hvdtrain's streaming loader vs mosaicml-streaming, LitData and WebDataset, side by side in one run.

    bash bench/b6/setup.sh                                  # the peers' venv, .venv-bench (once, ~3 min)
    .venv/bin/python bench/streaming_vs_peers.py            # as root: 4 GiB per variant, both variants (long)
    .venv/bin/python bench/streaming_vs_peers.py --gib 1 --shard-mib 16   # docs/performance.md: B6 (~40 min)
    .venv/bin/python bench/streaming_vs_peers.py --render bench/out/streaming_vs_peers.json   # the tables again

The same synthetic records (`bench/b6/_harness.py`: x incompressible bytes, y its index), ~100 KiB ("100k", like
images) or 8 KiB ("8k", like tokens), are written in each system's native format (hvdtrain reads the MDS shards
mosaicml-streaming writes; LitData's chunks; WebDataset's tars), ~64 MiB shards, and served by one moto S3 server
in a network namespace (bench/b6/netlink.py). Each system reads them with 2 ranks on this node (Gloo joins them),
batch 32 per rank, 2 loader worker processes per rank, its documented settings (each `bench/b6/sys_*.py` says
which), in four runs per variant:
- shaped: the server's link limited to `--rate` (tbf), 1 epoch: cold time to first batch, epoch 1 as a share of
  the link;
- unshaped: 2 epochs through a fresh cache: first batch, MiB/s per epoch, bytes the server sent per epoch, peak
  PSS of each rank's process tree, CPU seconds per GiB (the rank and its workers), resume latency (a fresh loader
  from the state taken halfway through epoch 2, to its first batch), exactly-once per epoch across ranks;
- cache25: as unshaped with the cache bounded to 25% of the dataset: epoch-2 downloads;
- local: the shards read from this disk: epoch 2 vs the unshaped run's epoch 2.
The systems run back to back within each run kind, the first one rotating. Printed as tables (goals from issue
15) and written to bench/out/streaming_vs_peers.json. Needs root (network namespace, tc), ~3.5x --gib of disk
per variant under --work; removes its namespace, server and data when done (--keep keeps the data).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
from _common import OUT, REPO, free_port, write_json

sys.path.insert(0, str(Path(__file__).resolve().parent / "b6"))
from netlink import ShapedS3

B6 = REPO / "bench" / "b6"
SYSTEMS = ("hvdtrain", "mosaic", "litdata", "wds")
FORMAT = {"hvdtrain": "mosaic", "mosaic": "mosaic", "litdata": "litdata", "wds": "wds"}  # whose writer
VARIANTS = {"100k": 102400, "8k": 8192}
BUCKET = "bench"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gib", type=float, default=4.0, help="dataset size per variant in GiB (default 4)")
    p.add_argument("--variants", default="100k,8k", help=f"comma list of {list(VARIANTS)}")
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma list of {list(SYSTEMS)}")
    p.add_argument("--runs", default="shaped,unshaped,cache25,local", help="which run kinds")
    p.add_argument("--rate", default="400mbit", help="the shaped link's rate (tc tbf syntax; default 400mbit)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--workers", type=int, default=2, help="loader worker processes per rank")
    p.add_argument("--shard-mib", type=int, default=64)
    p.add_argument("--peer-python", default=str(REPO / ".venv-bench" / "bin" / "python"))
    p.add_argument("--work", type=Path, default=OUT / "b6-work")
    p.add_argument("--timeout", type=float, default=300, help="seconds one system's run may take (then: an error)")
    p.add_argument("--keep", action="store_true", help="keep the written datasets in --work")
    p.add_argument("--render", type=Path, metavar="JSON", help="print the tables of a saved result; run nothing")
    args = p.parse_args(argv)
    if args.render:
        return args
    args.variants = [v for v in args.variants.split(",") if v]
    args.systems = [s for s in args.systems.split(",") if s]
    args.runs = [r for r in args.runs.split(",") if r]
    for name, got, allowed in (("--variants", args.variants, VARIANTS), ("--systems", args.systems, SYSTEMS),
                               ("--runs", args.runs, ("shaped", "unshaped", "cache25", "local"))):
        bad = [v for v in got if v not in allowed]
        if bad or not got:
            p.error(f"{name}: {bad or 'empty'} not in {list(allowed)}")
    if os.geteuid() != 0:
        p.error("needs root: the server runs in a network namespace with a tc rate limit")
    if not Path(args.peer_python).exists():
        p.error(f"--peer-python {args.peer_python} does not exist: run `bash bench/b6/setup.sh` first")
    return args


def python_for(system: str, args: argparse.Namespace) -> str:
    return sys.executable if system == "hvdtrain" else args.peer_python


def write_formats(args: argparse.Namespace, variant: str, samples: int) -> dict[str, Path]:
    """Each needed format written once under --work (reused while its stamp matches); returns format -> dir."""
    dirs = {}
    for fmt in sorted({FORMAT[s] for s in args.systems}):
        out = args.work / "data" / f"{fmt}-{variant}"
        stamp = f"{samples} {VARIANTS[variant]} {args.shard_mib}"
        if not ((out / ".stamp").exists() and (out / ".stamp").read_text() == stamp):
            shutil.rmtree(out, ignore_errors=True)
            t0 = time.perf_counter()
            subprocess.run([args.peer_python, str(B6 / f"sys_{fmt}.py"), "write", "--out", str(out), "--samples",
                            str(samples), "--record-bytes", str(VARIANTS[variant]), "--shard-bytes",
                            str(args.shard_mib << 20)], check=True, timeout=7200)
            (out / ".stamp").write_text(stamp)
            print(f"  wrote {fmt}-{variant}: {du(out) / 2**30:.2f} GiB in {time.perf_counter() - t0:.0f} s",
                  flush=True)
        dirs[fmt] = out
    return dirs


def du(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file() and p.name != ".stamp")


def upload(server: ShapedS3, root: Path, prefix: str) -> int:
    client = server.client()
    files = [p for p in sorted(root.rglob("*")) if p.is_file() and p.name != ".stamp"]
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda p: client.upload_file(str(p), BUCKET, f"{prefix}/{p.relative_to(root)}"), files))
    return sum(p.stat().st_size for p in files)


def run_ranks(args: argparse.Namespace, system: str, source: str, samples: int, record: int, *, epochs: int,
              limit: int, counter: str, env: dict[str, str], tag: str) -> dict[str, Any]:
    """Two ranks of `system` reading `source`; returns rank 0's JSON (both ranks' results) or {'error': ...}."""
    cache = args.work / "cache" / f"{system}-{tag}"
    shutil.rmtree(cache, ignore_errors=True)
    out = args.work / "results" / f"{system}-{tag}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.unlink(missing_ok=True)
    argv = [python_for(system, args), str(B6 / f"sys_{system}.py"), "read", "--source", source, "--cache-dir",
            str(cache), "--cache-limit", str(limit), "--samples", str(samples), "--record-bytes", str(record),
            "--epochs", str(epochs), "--batch-size", str(args.batch_size), "--workers", str(args.workers),
            "--counter", counter, "--out", str(out)]
    port = free_port()
    procs = []
    log = out.with_suffix(".log")
    os.sync()  # the datasets just written, the last run's cache: no system starts while the disk writes them back
    with open(log, "wb") as logf:
        for r in range(2):
            renv = {**os.environ, **env, "RANK": str(r), "WORLD_SIZE": "2", "LOCAL_RANK": str(r),
                    "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                    "PYTHONUNBUFFERED": "1"}
            procs.append(subprocess.Popen(argv, env=renv, stdout=logf, stderr=subprocess.STDOUT,
                                          start_new_session=True))
        deadline = time.monotonic() + args.timeout
        try:
            codes = [wait_or_kill(p, deadline) for p in procs]
        finally:  # interrupted: no rank outlives the driver
            for p in procs:
                if p.poll() is None:
                    wait_or_kill(p, 0.0)
    shutil.rmtree(cache, ignore_errors=True)
    if codes != [0, 0] or not out.exists():
        tail = log.read_text(errors="replace")[-1500:]
        return {"error": f"exit codes {codes} (see {log})", "log_tail": tail}
    ranks = json.loads(out.read_text())
    return {"ranks": ranks, "once": exactly_once(out, samples, epochs)}


def wait_or_kill(proc: subprocess.Popen[bytes], deadline: float) -> int | str:
    try:
        return proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(proc.pid, sig)
                proc.wait(timeout=20)
                break
            except (ProcessLookupError, subprocess.TimeoutExpired):
                continue
        return "timeout"


def exactly_once(out: Path, samples: int, epochs: int) -> list[dict[str, Any]]:
    found = []
    for e in range(epochs):
        parts = [np.load(out.with_name(f"{out.stem}.rank{r}.epoch{e}.npy")) for r in range(2)]
        counts = np.bincount(np.concatenate(parts), minlength=samples)
        found.append({"dup": int((counts > 1).sum()), "missing": int((counts == 0).sum()),
                      "per_rank": [len(p) for p in parts]})
    return found


def epoch(res: dict[str, Any], e: int) -> dict[str, float]:
    """Both ranks' epoch e: seconds (the slower rank), bytes and samples (sum), first batch (the later)."""
    eps = [r["epochs"][e] for r in res["ranks"]]
    return {"seconds": max(x["seconds"] for x in eps), "bytes": sum(x["bytes"] for x in eps),
            "first": max(x["first_batch_s"] for x in eps), "cpu": sum(x["cpu_s"] for x in eps),
            "server": eps[0]["server_bytes"]}


def rows_for(runs: dict[str, dict[str, Any]], stored: dict[str, int], rate_bps: float) -> dict[str, dict[str, Any]]:
    """Table rows: row name -> system -> value (None where the run failed or the system cannot)."""
    rows: dict[str, dict[str, Any]] = {}

    def put(row: str, system: str, value: Any) -> None:
        rows.setdefault(row, {})[system] = value

    for (kind, system), res in runs.items():
        if "error" in res:
            put(f"{kind}: failed", system, "timeout" if "timeout" in res["error"] else "error")
            continue
        e1 = epoch(res, 0)
        mibs1 = e1["bytes"] / e1["seconds"] / 2**20
        if kind == "shaped":
            put("shaped: first batch cold (s)", system, e1["first"])
            put("shaped: epoch 1 share of link", system, e1["bytes"] / e1["seconds"] / rate_bps)
        if kind == "unshaped":
            e2 = epoch(res, 1)
            put("unshaped: first batch cold (s)", system, e1["first"])
            put("unshaped: epoch 1 MiB/s", system, mibs1)
            put("unshaped: epoch 2 MiB/s", system, e2["bytes"] / e2["seconds"] / 2**20)
            put("downloaded epoch 1 / dataset", system, e1["server"] / stored[system])
            put("downloaded epoch 2 / dataset", system, e2["server"] / stored[system])
            put("peak PSS per rank, tree (MiB)", system, max(r["peak_pss"] for r in res["ranks"]) / 2**20)
            put("  of it beyond torch+Gloo (MiB)", system,
                max(r["peak_pss"] - r["baseline_pss"] for r in res["ranks"]) / 2**20)
            put("CPU s per GiB, epoch 1", system, e1["cpu"] / (e1["bytes"] / 2**30))
            put("CPU s per GiB, epoch 2", system, e2["cpu"] / (e2["bytes"] / 2**30))
            resume = [r["resume_s"] for r in res["ranks"]]
            put("resume to first batch (s)", system, None if None in resume else max(resume))
            once = res["once"]
            put("repeated / missed samples per epoch", system,
                "/".join(str(max(o[k] for o in once)) for k in ("dup", "missing")))
            put("samples per rank, epoch 1", system, "/".join(str(n) for n in once[0]["per_rank"]))
        if kind == "cache25":
            e2 = epoch(res, 1)
            put("cache 25%: epoch 2 downloads / dataset", system, e2["server"] / stored[system])
            put("cache 25%: cache on disk / limit", system,
                max(r["cache_bytes"] for r in res["ranks"]) / (0.25 * stored[system]))
        if kind == "local":
            e2 = epoch(res, 1)
            put("local disk: epoch 2 MiB/s", system, e2["bytes"] / e2["seconds"] / 2**20)
    for system in {s for (_, s) in runs}:
        local, remote = rows.get("local disk: epoch 2 MiB/s", {}), rows.get("unshaped: epoch 2 MiB/s", {})
        if isinstance(local.get(system), float) and isinstance(remote.get(system), float):
            put("epoch 2 (cache) vs local disk", system, remote[system] / local[system])
    return rows


GOALS = {"shaped: first batch cold (s)": "<= 0.5", "shaped: epoch 1 share of link": ">= 0.90",
         "epoch 2 (cache) vs local disk": ">= 0.95", "downloaded epoch 1 / dataset": "<= 1.02",
         "cache 25%: epoch 2 downloads / dataset": "<= 0.8", "  of it beyond torch+Gloo (MiB)": "<= 300"}


def fmt(v: Any) -> str:
    if isinstance(v, bool) or v is None:
        return {True: "yes", False: "NO", None: "n/a"}[v]
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 10 else f"{v:.0f}"
    return str(v)[:40]


def print_table(variant: str, rows: dict[str, dict[str, Any]], systems: list[str]) -> None:
    print(f"\nB6, {variant} records", flush=True)
    head = f"{'':42s}" + "".join(f"{s:>12s}" for s in systems) + f"{'goal':>10s}"
    print(head)
    for row, vals in rows.items():
        print(f"{row:42s}" + "".join(f"{fmt(vals.get(s)):>12s}" for s in systems) + f"{GOALS.get(row, ''):>10s}")


def run_variant(args: argparse.Namespace, server: ShapedS3, variant: str) -> dict[str, Any]:
    record = VARIANTS[variant]
    samples = int(args.gib * 2**30 // record)
    dirs = write_formats(args, variant, samples)
    stored = {}
    for fmt_name, d in dirs.items():
        stored[fmt_name] = upload(server, d, f"{fmt_name}-{variant}")
    sizes = {s: stored[FORMAT[s]] for s in args.systems}
    runs: dict[tuple[str, str], dict[str, Any]] = {}
    for k, kind in enumerate(args.runs):
        server.shape(args.rate if kind == "shaped" else None)
        order = args.systems[k % len(args.systems):] + args.systems[:k % len(args.systems)]
        for system in order:
            fmt_name = FORMAT[system]
            source = str(dirs[fmt_name]) if kind == "local" else f"s3://{BUCKET}/{fmt_name}-{variant}"
            limit = int(0.25 * sizes[system]) if kind == "cache25" else 0
            t0 = time.perf_counter()
            runs[(kind, system)] = run_ranks(args, system, source, samples, record,
                                             epochs=1 if kind == "shaped" else 2, limit=limit,
                                             counter="" if kind == "local" else server.counter,
                                             env=server.env, tag=f"{kind}-{variant}")
            err = runs[(kind, system)].get("error")
            print(f"  {variant} {kind:9s} {system:9s} {time.perf_counter() - t0:6.0f} s"
                  + (f"  ERROR {err}" if err else ""), flush=True)
    server.shape(None)
    for fmt_name in dirs:
        server.empty(BUCKET, f"{fmt_name}-{variant}/")  # moto keeps objects in temporary files: free the disk
    rate_bps = parse_rate(args.rate)
    rows = rows_for(runs, sizes, rate_bps)
    print_table(variant, rows, args.systems)
    return {"samples": samples, "record_bytes": record, "stored_bytes": sizes, "rows": rows,
            "runs": {f"{k}/{s}": v for (k, s), v in runs.items()}}


def parse_rate(rate: str) -> float:
    """tc rate -> bytes per second."""
    units = {"kbit": 1e3 / 8, "mbit": 1e6 / 8, "gbit": 1e9 / 8}
    for unit, mult in units.items():
        if rate.endswith(unit):
            return float(rate[: -len(unit)]) * mult
    raise SystemExit(f"--rate {rate!r}: use a number followed by kbit, mbit or gbit")


def render(path: Path) -> int:
    """Print the tables of a saved result again (`--render bench/out/streaming_vs_peers.json`)."""
    result = json.loads(path.read_text())
    systems = result["args"]["systems"]
    for variant, v in result["variants"].items():
        runs = {tuple(k.split("/")): r for k, r in v["runs"].items()}
        print_table(variant, rows_for(runs, v["stored_bytes"], parse_rate(result["args"]["rate"])), systems)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.render:
        return render(args.render)
    args.work.mkdir(parents=True, exist_ok=True)
    saved = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    result: dict[str, Any] = {"args": saved, "variants": {}}
    server = ShapedS3(args.peer_python, args.work / "moto.log")
    try:
        server.client().create_bucket(Bucket=BUCKET)
        for variant in args.variants:
            result["variants"][variant] = run_variant(args, server, variant)
            if not args.keep:
                shutil.rmtree(args.work / "data", ignore_errors=True)
    finally:
        server.close()
    print(f"\nwritten: {write_json(OUT / 'streaming_vs_peers.json', result)}")
    failed = [k for v in result["variants"].values() for k, r in v["runs"].items() if "error" in r]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
