"""B6's server side (not a bench itself): moto's S3 server in its own network namespace, reached over a veth pair,
with an optional `tbf` rate limit on the server's side (what the clients download), and a byte counter.

    root namespace: b6h<tok> 10.77.<n>.1/30  <── veth ──>  netns b6s<tok>: b6v<tok> 10.77.<n>.2/30, moto on :9000

Needs root (`ip netns`, `tc`). Only the namespace's address is contacted. `bytes_down()` is what the server sent
(the root end's rx_bytes in sysfs). Everything made here (server, namespace, veth) is removed by `close()`.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
               "AWS_REGION": "us-east-1"}


def sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), check=check, capture_output=True, text=True, timeout=60)


class ShapedS3:
    def __init__(self, python: str, log: Path, port: int = 9000) -> None:
        tok = f"{os.getpid() % 10000}"
        n = os.getpid() % 200 + 20
        self.ns, self.host_if, self.ns_if = f"b6s{tok}", f"b6h{tok}", f"b6v{tok}"
        self.host_ip, self.ip, self.port = f"10.77.{n}.1", f"10.77.{n}.2", port
        self.endpoint = f"http://{self.ip}:{port}"
        self.env = {**CREDENTIALS, "AWS_ENDPOINT_URL": self.endpoint, "S3_ENDPOINT_URL": self.endpoint}
        self.proc: subprocess.Popen[bytes] | None = None
        sh("ip", "netns", "add", self.ns)
        try:
            sh("ip", "link", "add", self.host_if, "type", "veth", "peer", "name", self.ns_if)
            sh("ip", "link", "set", self.ns_if, "netns", self.ns)
            sh("ip", "addr", "add", f"{self.host_ip}/30", "dev", self.host_if)
            sh("ip", "link", "set", self.host_if, "up")
            for cmd in (["addr", "add", f"{self.ip}/30", "dev", self.ns_if], ["link", "set", self.ns_if, "up"],
                        ["link", "set", "lo", "up"]):
                sh("ip", "-n", self.ns, *cmd)
            with open(log, "ab") as out:
                self.proc = subprocess.Popen(
                    ["ip", "netns", "exec", self.ns, python, "-m", "moto.server", "-H", self.ip, "-p", str(port)],
                    stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
            self._wait()
        except BaseException:
            self.close()
            raise

    def _wait(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with socket.socket() as s:
                s.settimeout(1)
                if s.connect_ex((self.ip, self.port)) == 0:
                    return
            time.sleep(0.1)
        raise TimeoutError(f"moto did not listen on {self.endpoint} within {timeout} s")

    def shape(self, rate: str | None) -> None:
        """Limit what the server sends to `rate` (tc syntax, e.g. 400mbit); None removes the limit."""
        sh("ip", "netns", "exec", self.ns, "tc", "qdisc", "del", "dev", self.ns_if, "root", check=False)
        if rate:
            sh("ip", "netns", "exec", self.ns, "tc", "qdisc", "add", "dev", self.ns_if, "root", "tbf", "rate", rate,
               "burst", "256kb", "latency", "50ms")

    @property
    def counter(self) -> str:
        return f"/sys/class/net/{self.host_if}/statistics/rx_bytes"

    def bytes_down(self) -> int:
        return int(Path(self.counter).read_text())

    def client(self):  # type: ignore[no-untyped-def]
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1",
                            aws_access_key_id="testing", aws_secret_access_key="testing")

    def empty(self, bucket: str, prefix: str) -> None:
        client = self.client()
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
            if keys:
                client.delete_objects(Bucket=bucket, Delete={"Objects": keys})

    def close(self) -> None:
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=30)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)
            self.proc = None
        sh("ip", "link", "del", self.host_if, check=False)
        sh("ip", "netns", "del", self.ns, check=False)
