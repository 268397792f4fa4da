"""Errors that point the right way (issue 37, items 4 and 7): a missing bucket names the bucket and the endpoint; a
full cache disk names --cache-limit; a dataset without val/ names `--val-fraction`; an interpreter without Horovod
names the spec's `python:` key; a store retry prints one line. Real servers on 127.0.0.1 (moto's S3, an HTTP server
in this process); the full disk is one OSError where the cache writes a shard (the disk is not filled)."""

from __future__ import annotations

import errno
import math
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hvdtrain import cli, exitcodes
from hvdtrain.formats import arrays, cachedir
from hvdtrain.launch.preflight import LaunchError, default_controller
from hvdtrain.stream import StreamError, StreamingDataset, store
from hvdtrain.stream.upload import upload
from hvdtrain.train import recipe_data
from hvdtrain.train.entry import exit_with
from tests.support import harness
from tests.support.stores import MotoS3, moto_bucket, point_at, write_dataset

BUCKET = "hints"
MISSING = "no-such-bucket"


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MotoS3]:
    with moto_bucket(tmp_path_factory.mktemp("moto") / "requests.log", BUCKET) as server:
        yield server


@pytest.fixture
def on_s3(s3: MotoS3, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> MotoS3:
    point_at(s3, tmp_path / "cache", monkeypatch)
    return s3


def bucket_hint(s3: MotoS3) -> str:
    return (f"the bucket '{MISSING}' does not exist at {s3.endpoint} (AWS_ENDPOINT_URL) (404 NoSuchBucket); create "
            f"it (`aws s3 mb s3://{MISSING} --endpoint-url {s3.endpoint}`) or check the bucket name in the URL and "
            "the endpoint (AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL)")


# ---- item 4: a missing bucket ------------------------------------------------------------------------------------

def test_training_on_a_missing_bucket_names_the_bucket_and_the_endpoint(on_s3: MotoS3) -> None:
    with pytest.raises(arrays.DatasetError) as err:
        recipe_data.load(f"s3://{MISSING}/mds")
    assert str(err.value) == (f"cannot read the dataset's index: s3://{MISSING}/mds/train/index.json: "
                              + bucket_hint(on_s3))
    # an object missing from a bucket that exists keeps its message
    with pytest.raises(StreamError) as err:
        store.RemoteStore(f"s3://{BUCKET}/mds/train").get("shard.00003.mds")
    assert str(err.value) == (f"s3://{BUCKET}/mds/train/shard.00003.mds: not found (404): the dataset lists it but "
                              "the store does not have it; was the upload complete?")


def test_uploading_to_a_missing_bucket_names_the_bucket_and_the_endpoint(
        on_s3: MotoS3, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_dataset(tmp_path / "ds" / "train", 10, per_shard=20)
    code = cli.main(["data", "upload", str(tmp_path / "ds"), f"s3://{MISSING}/mds", "--no-progress"])
    err = capsys.readouterr().err
    assert code == exitcodes.INVALID_INPUT, err
    assert err == (f"hvdtrain data upload: error: s3://{MISSING}/mds/train/shard.00000.mds.zstd: "
                   f"{bucket_hint(on_s3)}\n")


# ---- item 4: a dataset without val/ ------------------------------------------------------------------------------

VAL_HINT = "`hvdtrain data convert SRC DST --val-fraction 0.1` (10% of the samples go to val/), and train on DST"


def test_a_dataset_without_val_says_how_to_convert_one(tmp_path: Path) -> None:
    root = tmp_path / "r"
    write_dataset(root / "train", 20)
    run = subprocess.run([sys.executable, str(harness.REPO / "recipes" / "pytorch_train.py"), "--dataset",
                          str(root), "--epochs", "1"], capture_output=True, text=True, timeout=120,
                         stdin=subprocess.DEVNULL)
    assert run.returncode == exitcodes.INVALID_INPUT, run.stderr
    assert run.stderr.strip().splitlines()[-1] == (
        f"pytorch_train.py: error: {root} has no val/ split ({root}/val/index.json does not exist), and training "
        f"validates on it: convert the source again holding out samples for validation, e.g. {VAL_HINT}")


def test_a_dataset_without_val_on_s3_says_how_to_convert_one(on_s3: MotoS3, tmp_path: Path) -> None:
    write_dataset(tmp_path / "ds" / "train", 10, per_shard=20)
    url = f"s3://{BUCKET}/train-only"
    upload(tmp_path / "ds", url, progress=False)
    with pytest.raises(arrays.DatasetError) as err:
        recipe_data.load(url)
    assert str(err.value) == (f"{url} has no val/ split ({url}/val/index.json does not exist), and training "
                              f"validates on it: convert the source again holding out samples for validation, e.g. "
                              f"{VAL_HINT}")
    with pytest.raises(arrays.DatasetError, match=r"has no train/ split .*`hvdtrain data upload DST s3://"):
        recipe_data.load(f"s3://{BUCKET}/nothing-here")


# ---- item 4: a full cache disk -----------------------------------------------------------------------------------

def full_disk(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Make the cache's shard writes fail as a full disk does (ENOSPC from write); returns the files tried."""
    tried: list[str] = []

    class FullFile:
        def __init__(self, f: Any) -> None:
            self.f = f

        def __enter__(self) -> FullFile:
            return self

        def __exit__(self, *exc: object) -> None:
            self.f.close()

        def write(self, data: bytes) -> int:
            raise OSError(errno.ENOSPC, "No space left on device")

        def __getattr__(self, name: str) -> Any:
            return getattr(self.f, name)

    def opener(path: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        f = open(path, mode, *args, **kwargs)  # noqa: SIM115 (closed by FullFile)
        if "w" not in mode:
            return f
        tried.append(str(path))
        return FullFile(f)

    monkeypatch.setattr(cachedir, "open", opener, raising=False)  # the module's `open`: only the cache's writes
    return tried


@pytest.mark.parametrize("limit", [None, 3000])
def test_a_full_cache_disk_names_the_cache_limit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str], limit: int | None) -> None:
    write_dataset(tmp_path / "ds", 40, per_shard=10)  # zstd: each shard is decompressed into the node cache
    ds = StreamingDataset(tmp_path / "ds", cache_dir=tmp_path / "cache", fetch_threads=0, cache_limit=limit)
    tried = full_disk(monkeypatch)

    def main() -> int:
        ds.take(np.array([0]))
        return 0

    with pytest.raises(SystemExit) as done:
        exit_with(main, "train.py")
    assert done.value.code == exitcodes.INVALID_INPUT
    assert tried and not list(ds.cache_dir.glob(".*.part.*"))
    err = capsys.readouterr().err
    now = "no limit" if limit is None else "--cache-limit 2.9KiB"
    pattern = (rf"train\.py: error: the cache directory {re.escape(str(ds.cache_dir))} is full \(\d+\.\d \w+ free "
               rf"on its disk, 0 B of shards in it\) while fetching {re.escape(str(tmp_path / 'ds'))}/shard\.\d{{5}}"
               rf"\.mds\.zstd, with {now}: pass --cache-limit below what the disk can give the shards \(e\.g\. "
               r"--cache-limit \d+\.\d\w+; it must still hold \d+\.\d KiB, the shards the readers need at once\), free "
               r"space on that disk, or set HVDTRAIN_DATA_CACHE to a directory on a bigger disk\n")
    assert re.fullmatch(pattern, err), err


def test_a_disk_too_full_for_any_limit_is_not_told_to_set_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No --cache-limit that fits the disk would hold the shards the readers need at once: only the two real fixes."""
    write_dataset(tmp_path / "ds", 40, per_shard=10)
    ds = StreamingDataset(tmp_path / "ds", cache_dir=tmp_path / "cache", fetch_threads=0)
    full_disk(monkeypatch)
    monkeypatch.setattr(cachedir, "free_bytes", lambda directory: 100)
    with pytest.raises(cachedir.CacheFull) as err:
        ds.take(np.array([0]))
    assert re.search(r"is full \(100 B free on its disk, 0 B of shards in it\) while fetching .*, with no limit: "
                     r"the readers need \d+\.\d KiB at once: free space on that disk, or set HVDTRAIN_DATA_CACHE to a "
                     r"directory on a bigger disk$", str(err.value)), err.value
    assert "pass --cache-limit" not in str(err.value)


# ---- item 4: an interpreter without Horovod ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def bare_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A venv of the base interpreter without any package: no Horovod."""
    bare = tmp_path_factory.mktemp("bare") / "venv"
    subprocess.run([sys.base_prefix + "/bin/python3", "-m", "venv", "--without-pip", str(bare)], check=True,
                   timeout=120)
    return bare / "bin" / "python"


def test_an_interpreter_without_horovod_names_itself_and_the_python_key(bare_python: Path, tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch,
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("HVDTRAIN_CACHE_DIR", str(tmp_path / "probe-cache"))
    with pytest.raises(LaunchError) as err:
        default_controller(str(bare_python), save=False)
    venv = bare_python.parent.parent
    assert str(err.value) == (
        f"the job's interpreter {bare_python} cannot import Horovod (horovod: ModuleNotFoundError: No module named "
        "'horovod'); it is the spec's `python:` key (default: the Python running hvdtrain): set `python:` to an "
        f"interpreter that has Horovod (e.g. {sys.executable}, the one running hvdtrain, if it has Horovod); or, "
        f"from the hvdtrain checkout, `HVDTRAIN_VENV={venv} bash scripts/setup.sh` installs Horovod into that venv")
    # the same through `hvdtrain run` (a dry run: nothing is started, nothing written)
    job = tmp_path / "job.yaml"
    job.write_text(f"script: t.py\nnp: 2\npython: {bare_python}\n")
    (tmp_path / "t.py").write_text("print('never')\n")
    code = cli.main(["run", "--dry-run", str(job)])
    out = capsys.readouterr()
    assert code == exitcodes.INVALID_INPUT
    assert f"the job's interpreter {bare_python} cannot import Horovod" in out.err
    assert "controller:" not in out.err and "it is the spec's `python:` key" in out.err


# ---- item 7: store retries print one line each -------------------------------------------------------------------

@pytest.fixture
def flaky_http() -> Iterator[tuple[str, list[str]]]:
    """An HTTP server on 127.0.0.1 answering 503 to its first 4 GETs, then b"hello"; (its URL, the paths asked)."""
    asked: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            asked.append(self.path)
            body = b"hello" if len(asked) > 4 else b""
            self.send_response(200 if body else 503)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/ds", asked
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


def test_a_store_retry_prints_one_line(flaky_http: tuple[str, list[str]], capsys: pytest.CaptureFixture[str],
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    url, asked = flaky_http
    monkeypatch.setattr(store, "_last_retry_line", -math.inf)  # no line printed lately by this process
    got = store.RemoteStore(url, retry_s=30).get("index.json")
    assert bytes(got) == b"hello" and len(asked) == 5
    # The first retry is said; the next, within RETRY_LINE_EVERY_S, is not (every thread of a node would repeat it).
    assert capsys.readouterr().err.splitlines() == [
        f"hvdtrain: retrying {url}/index.json (try 2; 0 of 30 s spent) after HTTP 503 Service Unavailable"]


def test_a_relative_dataset_path_that_is_not_there_names_where_it_looked(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(arrays.DatasetError) as err:
        recipe_data.load("mds")
    assert str(err.value).endswith(f"got 'mds', which is not a directory (looked for {tmp_path}/mds: a relative "
                                   "path is relative to the working directory, which a job spec sets with `workdir:`)")
    with pytest.raises(arrays.DatasetError) as err:
        recipe_data.load(str(tmp_path / "mds"))
    assert str(err.value).endswith("which is not a directory")
