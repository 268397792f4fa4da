"""A local S3-compatible server holding the digits as MDS shards, for jobs/digits-s3.yaml (and trying streaming).

    .venv/bin/python scripts/local_s3.py [--port 9000]      # then, in another shell:
    .venv/bin/hvdtrain run jobs/digits-s3.yaml

Starts moto's S3 server (moto[server], in hvdtrain's dev extra) on 127.0.0.1:PORT, creates the bucket
`hvdtrain-demo`, writes scikit-learn's bundled digits as zstd MDS shards (train/ and val/, ~28 KB shards, as
`hvdtrain data convert` writes them) and puts them at s3://hvdtrain-demo/digits with `hvdtrain data upload`, prints
`ready: s3://hvdtrain-demo/digits` and serves until interrupted (Ctrl-C or SIGTERM). Its data lives in memory: a
restarted server is empty until this script uploads again. Nothing leaves the machine.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import numpy as np

BUCKET = "hvdtrain-demo"
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


def write_digits(out: Path) -> None:
    """The digits as .npz train/val parts, converted with `hvdtrain data convert` (zstd, ~28 KB shards)."""
    from hvdtrain.train import recipe_data

    splits = recipe_data.load("digits")
    for name, split in (("train", splits.train), ("val", splits.val)):
        (out / "npz" / name).mkdir(parents=True)
        for i, part in enumerate(np.array_split(np.arange(len(split)), 3)):
            np.savez(out / "npz" / name / f"part{i}.npz", x=split.x[part], y=split.y[part])
    hvdtrain = Path(sys.executable).parent / "hvdtrain"
    subprocess.run([str(hvdtrain), "data", "convert", str(out / "npz"), str(out / "mds"), "--compression", "zstd",
                    "--shard-size", "28KB", "--no-progress"], check=True, timeout=300)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=9000, help="port on 127.0.0.1 (default 9000)")
    args = parser.parse_args()
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=args.port, verbose=False)
    server.start()
    try:
        endpoint = f"http://127.0.0.1:{args.port}"
        env = {**os.environ, **CREDENTIALS, "AWS_ENDPOINT_URL": endpoint}
        import boto3

        boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="testing",
                     aws_secret_access_key="testing").create_bucket(Bucket=BUCKET)
        with tempfile.TemporaryDirectory() as tmp:
            write_digits(Path(tmp))
            hvdtrain = Path(sys.executable).parent / "hvdtrain"
            subprocess.run([str(hvdtrain), "data", "upload", str(Path(tmp) / "mds"), f"s3://{BUCKET}/digits",
                            "--no-progress"], check=True, env=env, timeout=300)
        print(f"ready: s3://{BUCKET}/digits at {endpoint} (AWS_ENDPOINT_URL={endpoint}, credentials 'testing')",
              flush=True)
        done = threading.Event()
        signal.signal(signal.SIGTERM, lambda *_: done.set())
        try:
            while not done.wait(3600):
                pass
        except KeyboardInterrupt:
            pass
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
