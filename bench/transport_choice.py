"""Transport choice for shard reads: obstore vs fsspec (s3fs / HTTPFileSystem), whole-object GETs.

Measures, for each transport, server and concurrency: throughput (MiB/s) and client CPU seconds per GiB
(user+sys of this process via getrusage; servers run as separate subprocesses so their CPU is not counted).
Servers (127.0.0.1 only, started and stopped by this script): moto's S3 server, and nginx (if on PATH,
else Python's ThreadingHTTPServer) serving the same objects as plain files.

Run it in a scratch venv (needs none of hvdtrain)::

    python3 -m venv /tmp/tbench
    /tmp/tbench/bin/pip install numpy obstore==0.12.1 s3fs==2026.9.0 'moto[server]==5.2.5' boto3 aiohttp requests
    apt-get install -y nginx-light   # optional, faster HTTP server than http.server
    /tmp/tbench/bin/python bench/transport_choice.py [--objects 64 --size-mib 4 --reps 3 --threads 4]

Every object is verified by sha256 in the warmup pass; timed passes check length and spot bytes only, so that
hashing does not dominate the CPU figure. "obstore" copies the result into `bytes` (what hvdtrain.stream.store did
at first); "obstore zero-copy" keeps a memoryview of obstore's own buffer (what it does now: on glibc the copy costs
mostly page faults of fresh mmap'd 4 MiB blocks; MALLOC_MMAP_THRESHOLD_=67108864 makes it nearly free). Exit status
is non-zero on any failure.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import importlib.metadata as md
import os
import re
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

Fetch = Callable[[str], bytes | memoryview]
BUCKET, REGION, KEY, SECRET = "shards", "us-east-1", "testing", "testing"
OPS = {"<": "__lt__", "<=": "__le__", ">": "__gt__", ">=": "__ge__", "==": "__eq__", "!=": "__ne__"}
PIP_HINT = "pip install obstore==0.12.1 s3fs==2026.9.0 'moto[server]==5.2.5' boto3 aiohttp requests"


def need(module: str) -> object:
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise SystemExit(f"missing module {module!r} ({exc}); install with: {PIP_HINT}") from exc


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_port(port: int, proc: subprocess.Popen[bytes], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server {proc.args!r} exited with {proc.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"server {proc.args!r} not listening on {port} after {timeout}s")


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def spawn(*cmd: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def start_http(port: int, root: Path, work: Path) -> tuple[subprocess.Popen[bytes], str]:
    nginx = shutil.which("nginx") or shutil.which("nginx", path="/usr/sbin")
    if nginx is None:
        return spawn(sys.executable, "-m", "http.server", "-b", "127.0.0.1", "-d", str(root), str(port)), "http.server"
    temps = "\n".join(f"    {k}_temp_path {work}/{k};" for k in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
    conf = work / "nginx.conf"
    conf.write_text(
        f"daemon off;\nworker_processes 1;\npid {work}/nginx.pid;\nerror_log {work}/error.log;\n"
        f"{'user root;' if os.geteuid() == 0 else ''}\nevents {{ worker_connections 256; }}\n"
        f"http {{\n    access_log off;\n    sendfile on;\n{temps}\n"
        f"    server {{ listen 127.0.0.1:{port}; root {root}; }}\n}}\n"
    )
    return spawn(nginx, "-p", str(work), "-e", str(work / "error.log"), "-c", str(conf)), "nginx"


def upload_s3(endpoint: str, blobs: dict[str, bytes]) -> None:
    boto3 = need("boto3")
    s3 = boto3.client("s3", endpoint_url=endpoint, region_name=REGION,  # type: ignore[attr-defined]
                      aws_access_key_id=KEY, aws_secret_access_key=SECRET)
    s3.create_bucket(Bucket=BUCKET)
    for k, v in blobs.items():
        s3.put_object(Bucket=BUCKET, Key=k, Body=v)


def obstore_fetch(store: object, copy: bool) -> Fetch:
    """`bytes(...)` copies, as hvdtrain.stream.store does; else a zero-copy memoryview of obstore's buffer."""
    get = need("obstore").get  # type: ignore[attr-defined]
    return (lambda k: bytes(get(store, k).bytes())) if copy else (lambda k: memoryview(get(store, k).bytes()))


def obstore_s3(endpoint: str, copy: bool) -> Fetch:
    need("obstore")
    store = importlib.import_module("obstore.store").S3Store(
        BUCKET, endpoint=endpoint, region=REGION, access_key_id=KEY, secret_access_key=SECRET,
        client_options={"allow_http": True})
    return obstore_fetch(store, copy)


def fsspec_s3(endpoint: str) -> Fetch:
    fs = need("s3fs").S3FileSystem(  # type: ignore[attr-defined]
        endpoint_url=endpoint, key=KEY, secret=SECRET, client_kwargs={"region_name": REGION})
    return lambda k: fs.cat_file(f"{BUCKET}/{k}")


def obstore_http(base: str, copy: bool) -> Fetch:
    need("obstore")
    return obstore_fetch(importlib.import_module("obstore.store").HTTPStore(base, client_options={"allow_http": True}),
                         copy)


def fsspec_http(base: str) -> Fetch:
    need("aiohttp")
    fs = need("fsspec").filesystem("http")  # type: ignore[attr-defined]
    return lambda k: fs.cat_file(f"{base}/{k}")


def cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def run_pass(fetch: Fetch, blobs: dict[str, bytes], threads: int, full_check: bool) -> tuple[float, float]:
    def one(k: str) -> None:  # length + spot bytes always; sha256 when full_check (the warmup)
        got, want = fetch(k), blobs[k]
        if len(got) != len(want):
            raise RuntimeError(f"{k}: got {len(got)} bytes, want {len(want)}")
        if full_check and hashlib.sha256(got).digest() != hashlib.sha256(want).digest():
            raise RuntimeError(f"{k}: sha256 mismatch")
        for i in (0, len(want) // 2, len(want) - 8):
            if bytes(got[i:i + 8]) != want[i:i + 8]:
                raise RuntimeError(f"{k}: content mismatch at {i}")

    t0, c0 = time.perf_counter(), cpu_s()
    with ThreadPoolExecutor(threads) as ex:  # concurrency 1 = one worker thread, one request at a time
        list(ex.map(one, blobs))
    return time.perf_counter() - t0, cpu_s() - c0


def dep_weight(top: str) -> tuple[int, float]:
    """Installed distributions in `top`'s runtime closure (markers: extras skipped, python_version checked)."""
    seen: set[str] = set()
    todo, size = [top], 0
    while todo:
        name = re.sub(r"[-_.]+", "-", todo.pop()).lower()
        if name in seen:
            continue
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            continue
        seen.add(name)
        size += sum(f.size or 0 for f in dist.files or [])
        for req in dist.requires or []:
            spec, _, marker = req.partition(";")
            m = re.search(r"python(?:_full)?_version\s*([<>=!]+)\s*['\"]([\d.]+)['\"]", marker)
            ver = tuple(map(int, m[2].split(".")))[:2] if m else ()
            if "extra" in marker or (m and not getattr(sys.version_info[:2], OPS[m[1]])(ver)):
                continue
            todo.append(re.split(r"[\s<>=!~\[(;]", spec.strip(), maxsplit=1)[0])
    return len(seen), size / 2**20


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--objects", type=int, default=64)
    ap.add_argument("--size-mib", type=float, default=4.0)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=4)
    a = ap.parse_args()
    size = int(a.size_mib * 2**20)
    blobs = {f"shard-{i:05d}.bin": os.urandom(size) for i in range(a.objects)}
    procs: list[subprocess.Popen[bytes]] = []
    work = Path(tempfile.mkdtemp(prefix="transport_choice-"))
    try:
        root = work / "www"
        root.mkdir()
        for k, v in blobs.items():
            (root / k).write_bytes(v)
        work.chmod(0o755)
        s3_port, http_port = free_port(), free_port()
        need("moto.server")
        procs.append(spawn(sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(s3_port)))
        wait_port(s3_port, procs[0])
        http_proc, http_name = start_http(http_port, root, work)
        procs.append(http_proc)
        wait_port(http_port, http_proc)
        s3_ep, http_base = f"http://127.0.0.1:{s3_port}", f"http://127.0.0.1:{http_port}"
        upload_s3(s3_ep, blobs)
        makers: list[tuple[str, str, Fetch]] = [
            ("obstore", "moto-s3", obstore_s3(s3_ep, True)), ("obstore zero-copy", "moto-s3", obstore_s3(s3_ep, False)),
            ("fsspec+s3fs", "moto-s3", fsspec_s3(s3_ep)), ("obstore", http_name, obstore_http(http_base, True)),
            ("obstore zero-copy", http_name, obstore_http(http_base, False)),
            ("fsspec-http", http_name, fsspec_http(http_base)),
        ]
        configs = [(t, s, f, c) for t, s, f in makers for c in (1, a.threads)]
        for _, _, f, c in configs:  # warmup + full sha256 verification
            run_pass(f, blobs, c, full_check=True)
        res: dict[tuple[str, str, int], list[tuple[float, float]]] = {}
        for _ in range(a.reps):  # interleave transports within each rep to spread drift evenly
            for t, s, f, c in configs:
                res.setdefault((t, s, c), []).append(run_pass(f, blobs, c, full_check=False))
        mib, gib = len(blobs) * size / 2**20, len(blobs) * size / 2**30
        med = {k: (statistics.median(mib / w for w, _ in v), statistics.median(cpu / gib for _, cpu in v))
               for k, v in res.items()}
        vers = ", ".join(f"{d} {md.version(d)}" for d in ("obstore", "s3fs", "fsspec", "aiobotocore", "boto3", "moto"))
        print(f"\n{a.objects} objects x {a.size_mib:g} MiB, {a.reps} reps (median), {os.cpu_count()} CPUs, "
              f"python {sys.version.split()[0]}; {vers}\n")
        print("| transport | server | concurrency | MiB/s | CPU s/GiB | MiB/s vs fsspec | CPU/GiB vs fsspec |")
        print("|---|---|---|---:|---:|---:|---:|")
        for (t, s, c), (thr, cpg) in med.items():
            other = next(v for (t2, s2, c2), v in med.items() if s2 == s and c2 == c and t2.startswith("fsspec"))
            print(f"| {t} | {s} | {c} | {thr:.0f} | {cpg:.2f} | {thr / other[0]:.2f}x | {cpg / other[1]:.2f}x |")
        print("\n| package (runtime closure) | distributions | installed MiB |\n|---|---:|---:|")
        for top in ("obstore", "s3fs", "fsspec", "aiohttp"):
            n, mb = dep_weight(top)
            print(f"| {top} | {n} | {mb:.1f} |")
        return 0
    except Exception as exc:
        print(f"FAILED: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    finally:
        for p in procs:
            stop(p)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
