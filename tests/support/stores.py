"""Real object-store servers for the tests, on 127.0.0.1 in their own processes: moto's S3 server and a static HTTP
server (tests/scripts/http_store.py). Both log every request, so tests count the GETs a server answered; both can
be stopped and started again on the same port (a store that goes away mid-epoch). Also the datasets they serve
(`write_dataset`) and the environment that points hvdtrain at them (`point_at`)."""

from __future__ import annotations

import contextlib
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from hvdtrain.formats import cachedir
from hvdtrain.stream import MDSWriter, store
from tests.support import harness

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
               "AWS_REGION": "us-east-1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise TimeoutError(f"nothing listens on 127.0.0.1:{port} after {timeout} s")


class Server:
    """A server process whose output (one line per request) goes to `log`."""

    def __init__(self, log: Path) -> None:
        self.log = log
        self.proc: subprocess.Popen | None = None

    def argv(self) -> list[str]:
        raise NotImplementedError

    def start(self) -> None:
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(self.argv(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                         env={**os.environ, "PYTHONUNBUFFERED": "1"})

    def stop(self) -> None:
        if self.proc is not None:
            harness.kill_group(self.proc)
            self.proc.wait(timeout=30)
            self.proc = None

    def gets(self, pattern: str) -> int:
        """GET requests answered 200 whose path matches `pattern`."""
        return len(re.findall(rf'"?GET (\S*{pattern}\S*) HTTP/1.1"? 200|GET (\S*{pattern}\S*) 200',
                              self.log.read_text(errors="replace")))


class MotoS3(Server):
    """moto's S3 server; `env` points boto3 and obstore (hvdtrain's transport) at it."""

    def __init__(self, log: Path) -> None:
        super().__init__(log)
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.env = {**CREDENTIALS, "AWS_ENDPOINT_URL": self.endpoint}

    def argv(self) -> list[str]:
        return [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)]

    def start(self) -> None:
        super().start()
        wait_port(self.port)

    def client(self):  # type: ignore[no-untyped-def]
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1",
                            aws_access_key_id="testing", aws_secret_access_key="testing")


class HttpStore(Server):
    """tests/scripts/http_store.py serving `root` (started again, it listens on the same port)."""

    def __init__(self, root: Path, log: Path, delay_per_mib: float = 0.0, ranges: bool = True,
                 range_delay: float = 0.0) -> None:
        super().__init__(log)
        self.root, self.delay, self.ranges, self.range_delay = root, delay_per_mib, ranges, range_delay
        self.port_file = log.with_suffix(".port")
        self.port = 0

    def argv(self) -> list[str]:
        return [sys.executable, str(harness.REPO / "tests" / "scripts" / "http_store.py"), str(self.root),
                str(self.port_file), "--delay-per-mib", str(self.delay), "--port", str(self.port),
                "--range-delay", str(self.range_delay), *([] if self.ranges else ["--no-ranges"])]

    def start(self) -> None:
        self.port_file.unlink(missing_ok=True)
        super().start()
        deadline = time.monotonic() + 30
        while not self.port_file.exists():
            if time.monotonic() > deadline:
                raise TimeoutError("the HTTP store did not start")
            time.sleep(0.05)
        self.port = int(self.port_file.read_text())
        wait_port(self.port)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


SAMPLE_BYTES = 3 * 4 + 8 + 4  # write_dataset's x float32[3], y int64, and MDS's 4-byte offset


def write_dataset(out: Path, n: int, *, per_shard: int = 10, compression: str | None = "zstd",
                  hashes: tuple[str, ...] = ()) -> Path:
    """An MDS dataset of `n` samples whose x encodes their own index (x[0] == i), ~`per_shard` per shard."""
    with MDSWriter(out, {"x": "ndarray:float32:3", "y": "int64"}, compression=compression, hashes=list(hashes),
                   size_limit=per_shard * SAMPLE_BYTES + 200, meta={"num_classes": 5}) as w:
        for i in range(n):
            w.write({"x": np.array([i, i + 0.5, -i], np.float32), "y": i % 5})
    return out


@contextlib.contextmanager
def moto_bucket(log: Path, bucket: str) -> Iterator[MotoS3]:
    """A started moto server with `bucket` created; stopped after."""
    server = MotoS3(log)
    server.start()
    try:
        server.client().create_bucket(Bucket=bucket)
        yield server
    finally:
        server.stop()


def point_at(s3: MotoS3, cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """hvdtrain's S3 client at `s3`, its node cache in `cache_dir`, 20 s of retries."""
    for key, value in s3.env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv(cachedir.ENV_DIR, str(cache_dir))
    monkeypatch.setenv(store.ENV_RETRY, "20")
