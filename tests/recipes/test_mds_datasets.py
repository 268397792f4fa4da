"""The recipes on an MDS dataset root (train/ and val/ of zstd shards) with real Horovod ranks: the PyTorch recipe
learns with identical weights on both ranks, the elastic recipe and the Keras recipe train on it, and a bad label
deep inside a shard stops the job with exit 2 naming the shard file and sample."""

from __future__ import annotations

import importlib.util
import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
import yaml

from hvdtrain.formats import cachedir
from hvdtrain.stream import StreamingDataset
from hvdtrain.train import recipe_data
from tests.support.datasets import write_digits
from tests.support.harness import REPO, expect_ok, horovodrun, run_bounded

TIMEOUT = 300


@pytest.fixture(scope="module")
def digits_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The digits as .npz train/val shards, converted by `hvdtrain data convert` (zstd, ~28 KB shards)."""
    base = tmp_path_factory.mktemp("mds")
    splits = recipe_data.load("digits")
    for name, split in (("train", splits.train), ("val", splits.val)):
        (base / "npz" / name).mkdir(parents=True)
        for i, part in enumerate(np.array_split(np.arange(len(split)), 3)):
            np.savez(base / "npz" / name / f"part{i}.npz", x=split.x[part], y=split.y[part])
    expect_ok(run_bounded([str(REPO / ".venv" / "bin" / "hvdtrain"), "data", "convert", str(base / "npz"),
                           str(base / "digits"), "--compression", "zstd", "--shard-size", "28KB", "--no-progress"],
                          timeout=TIMEOUT))
    return base / "digits"


def env_for(tmp_path: Path) -> dict[str, str]:
    return {cachedir.ENV_DIR: str(tmp_path / "node-cache"), "TF_CPP_MIN_LOG_LEVEL": "2"}


@pytest.mark.slow
def test_pytorch_recipe_learns_from_streamed_shards(digits_root: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    expect_ok(horovodrun(REPO / "recipes" / "pytorch_train.py", "--dataset", str(digits_root), "--epochs", "4",
                         "--warmup-epochs", "1", "--run-dir", str(run_dir), "--no-tensorboard", timeout=TIMEOUT,
                         env=env_for(tmp_path)))
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["epochs_completed"] == 4 and summary["val_accuracy"] > 0.8, summary["history"]
    assert summary["config"]["dataset"] == {"source": str(digits_root), "kind": "mds", "train_samples": 1438,
                                            "val_samples": 359, "sample_shape": [1, 8, 8], "num_classes": 10}
    digests = summary["weights_sha256_by_rank"]
    assert len(digests) == 2 and digests[0] == digests[1]
    shards = json.loads((digits_root / "train" / "index.json").read_text())["shards"]
    cached = sorted(p.name for p in (tmp_path / "node-cache").rglob("shard.*.mds.*"))
    assert len(shards) > 5 and len(cached) == len(shards) + len(  # train and val, each decompressed once
        json.loads((digits_root / "val" / "index.json").read_text())["shards"])


@pytest.mark.slow
def test_bad_label_inside_a_shard_stops_the_job_with_exit_2_naming_it(tmp_path: Path) -> None:
    """Only the rank whose shard holds the sample meets it: it exits 2 with the message; Horovod then stops the
    other rank (its allreduce fails), and `hvdtrain run` names the first rank's error as the cause, exit 2."""
    root = write_digits(tmp_path / "digits", bad_label_at=700)
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({"script": str(REPO / "recipes" / "pytorch_train.py"), "np": 2,
                                   "env": env_for(tmp_path), "args": ["--dataset", str(root), "--epochs", "1",
                                                                      "--run-dir", str(tmp_path / "r"),
                                                                      "--no-tensorboard"]}))
    result = run_bounded([str(REPO / ".venv" / "bin" / "hvdtrain"), "run", str(job)], timeout=TIMEOUT)
    assert result.returncode == 2, result.describe()
    shard, row = StreamingDataset(root / "train").locate(np.array([700]))
    assert int(shard[0]) > 0 and int(row[0]) > 0  # deep inside the dataset
    message = (f"{root / 'train'}/shard.{int(shard[0]):05}.mds.zstd sample {int(row[0])} (index 700) field 'y': "
               "label 12 is out of range for --num-classes 10 (labels must be 0..9)")
    lines = result.output.splitlines()
    cause = next(i for i, line in enumerate(lines) if line.startswith("hvdtrain: rank "))
    # "(the cause)" or "(the first rank to fail)", as the other rank's exit was seen before or after it
    assert f"raised StreamError: {message} and exited with code 2 (the " in lines[cause], result.output
    assert f"pytorch_train.py: error: {message}" in result.output  # the rank's own line, no traceback of its own
    assert not any("Traceback" in line and "[0]" in line for line in lines), result.output


@pytest.mark.slow
def test_elastic_recipe_trains_on_streamed_shards(digits_root: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    job = tmp_path / "elastic.yaml"
    job.write_text(yaml.safe_dump({
        "script": str(REPO / "recipes" / "pytorch_elastic.py"), "np": 2, "controller": "gloo",
        "network_interfaces": ["lo"], "env": env_for(tmp_path),
        "elastic": {"discovery_script": str(REPO / "jobs" / "discover_hosts.sh"), "min_np": 2, "max_np": 2,
                    "timeout_s": 120},
        "args": ["--dataset", str(digits_root), "--epochs", "3", "--warmup-epochs", "1", "--threads", "1",
                 "--run-dir", str(run_dir)]}))
    expect_ok(run_bounded([str(REPO / ".venv" / "bin" / "hvdtrain"), "run", str(job)], timeout=TIMEOUT))
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["epochs_completed"] == 3 and summary["val_accuracy"] > 0.7, summary["history"]
    assert len(set(summary["weights_sha256_by_rank"])) == 1


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("tensorflow") is None, reason="TensorFlow is not installed")
def test_keras_recipe_trains_on_streamed_shards(digits_root: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    expect_ok(horovodrun(REPO / "recipes" / "keras_train.py", "--dataset", str(digits_root), "--epochs", "3",
                         "--warmup-epochs", "1", "--verbose", "0", "--run-dir", str(run_dir), timeout=TIMEOUT,
                         env=env_for(tmp_path)))
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["epochs_completed"] == 3 and summary["val_accuracy"] > 0.7, summary["history"]
    assert np.all(np.isfinite([row["train_loss"] for row in summary["history"]]))


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("tensorflow") is None, reason="TensorFlow is not installed")
def test_keras_recipe_names_a_bad_label_in_a_shard_with_exit_2(tmp_path: Path) -> None:
    """The sample is read in a producer process and reaches the trainer inside tf.data (from_generator), which
    re-raises errors as TensorFlow's own: the recipe still ends with the data error's message and exit 2, not a
    TensorFlow traceback."""
    root = write_digits(tmp_path / "digits", bad_label_at=5)
    result = run_bounded([str(REPO / ".venv" / "bin" / "python"), str(REPO / "recipes" / "keras_train.py"),
                          "--dataset", str(root), "--epochs", "1", "--verbose", "0", "--run-dir",
                          str(tmp_path / "r")], timeout=TIMEOUT, env=env_for(tmp_path))
    assert result.returncode == 2, result.describe()
    assert "keras_train.py: error: " in result.output and "(index 5) field 'y': label 12 is out of range" \
        in result.output, result.output
    assert "Traceback" not in result.output


@pytest.mark.slow
def test_shipped_s3_job_trains_the_digits_streamed_from_a_local_s3_server(tmp_path: Path) -> None:
    """jobs/digits-s3.yaml as docs/streaming.md runs it: scripts/local_s3.py (moto's S3 server, the digits uploaded with
    `hvdtrain data upload`), then `hvdtrain run` on the job: 2 ranks read the shards through a node cache smaller
    than the training split."""
    from tests.support.stores import free_port

    port = free_port()
    server = subprocess.Popen([str(REPO / ".venv" / "bin" / "python"), str(REPO / "scripts" / "local_s3.py"),
                               "--port", str(port)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                              start_new_session=True)
    try:
        ready = server.stdout.readline()  # type: ignore[union-attr]
        while ready and not ready.startswith("ready: "):
            ready = server.stdout.readline()  # type: ignore[union-attr]
        assert ready.startswith("ready: s3://hvdtrain-demo/digits"), ready
        result = run_bounded([str(REPO / ".venv" / "bin" / "hvdtrain"), "run", str(REPO / "jobs" / "digits-s3.yaml"),
                              "-o", f"env.AWS_ENDPOINT_URL=http://127.0.0.1:{port}",
                              "-o", f"env.{cachedir.ENV_DIR}={tmp_path / 'node-cache'}"], timeout=TIMEOUT, cwd=tmp_path)
        expect_ok(result)
    finally:
        server.terminate()
        server.wait(timeout=30)
    summary = json.loads((tmp_path / "runs" / "digits-s3" / "summary.json").read_text())
    assert summary["epochs_completed"] == 6 and summary["val_accuracy"] > 0.9, summary["history"]
    dataset = summary["config"]["dataset"]
    assert (dataset["source"], dataset["kind"]) == ("s3://hvdtrain-demo/digits", "mds"), dataset
    cached = sum(p.stat().st_size for p in (tmp_path / "node-cache").glob("train-*/shard.*"))
    assert 0 < cached <= 256 * 1024  # the job's --cache-limit held
