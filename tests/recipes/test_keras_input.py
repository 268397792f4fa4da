"""The Keras recipe's input (hvdtrain.train.keraskit, channels_last): training batches from an ShmLoader's producer
processes through tf.data, one loader epoch per Keras epoch, validation batches read in the trainer.

In-process, with real producers: `model.fit(train_input(...), steps_per_epoch, initial_epoch)` consumes exactly
the sampler's shard of each epoch, resumed or not, for each rank; validation reads the rank's share batch by
batch; bad data in a producer ends `fit` as the producer's WorkerError. For real, with 2 Horovod ranks: the
recipe reads an MDS dataset from a local S3 server (moto) through its producers (the rank processes open no
training shard) with each shard fetched once per node.

TensorFlow is imported inside the tests only: the producer processes import this module (the dataset classes
below travel by reference) and must not import TensorFlow.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hvdtrain.data import ShardSampler, ShmLoader, WorkerError
from hvdtrain.formats import arrays, cachedir
from hvdtrain.train.channels_last import channels_last_shape, take_channels_last
from tests.support.harness import REPO, expect_ok, horovodrun

pytestmark = [pytest.mark.timeout(300),
              pytest.mark.skipif(importlib.util.find_spec("tensorflow") is None,
                                 reason="TensorFlow is not installed in this venv")]

SHAPE = (2, 3, 3)  # C×H×W


class Encoded:
    """Only what the Keras path may use of a split (len, take, sample_shape, order): sample i is C×H×W, channel c
    filled with i + c / 10; its label is i % 3."""

    order = None

    def __init__(self, n: int, bad_at: int | None = None) -> None:
        self.n, self.bad_at = n, bad_at

    def __len__(self) -> int:
        return self.n

    @property
    def sample_shape(self) -> tuple[int, ...]:
        return SHAPE

    def take(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        idx = np.asarray(indices, dtype=np.int64)
        if self.bad_at is not None and self.bad_at in idx:
            raise arrays.DatasetError(f"shard.00000.mds sample {self.bad_at}: label 12 is out of range")
        x = idx[:, None, None, None] + np.arange(SHAPE[0])[None, :, None, None] / 10
        return np.broadcast_to(x, (len(idx), *SHAPE)).astype(np.float32), idx % 3


@pytest.fixture
def keraskit() -> Any:
    """hvdtrain.train.keraskit (TensorFlow with it), imported as the recipe's main() imports it (Keras 3 unless this
    process's environment sets TF_USE_LEGACY_KERAS=1)."""
    from hvdtrain.train import keraskit

    return keraskit


def recording_model(tf: Any) -> Any:
    """A tiny model that records, per step, which samples it trained (train) or evaluated (val) on: x[:, 0, 0, 0]
    of an N×H×W×C batch (run eagerly)."""

    class Recording(tf.keras.Model):
        def __init__(self) -> None:
            super().__init__()
            self.dense = tf.keras.layers.Dense(3)
            self.seen: dict[str, list[np.ndarray]] = {"train": [], "val": []}

        def call(self, x: Any) -> Any:
            return self.dense(tf.reshape(x, (-1, int(np.prod(SHAPE)))))

        def record(self, kind: str, x: Any) -> None:
            x = x.numpy()
            assert x.shape[1:] == (3, 3, 2), x.shape  # N×H×W×C
            assert np.allclose(x[..., 1], x[..., 0] + 0.1), "channels not moved intact"
            self.seen[kind].append(np.rint(x[:, 0, 0, 0]).astype(int))

        def train_step(self, data: Any) -> Any:
            self.record("train", data[0])
            return super().train_step(data)

        def test_step(self, data: Any) -> Any:
            self.record("val", data[0])
            return super().test_step(data)

    model = Recording()
    model.compile(optimizer=tf.keras.optimizers.SGD(0.01), run_eagerly=True,
                  loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def epoch_marks(tf: Any, model: Any) -> Any:
    """A callback recording (epoch, train batches seen, val batches seen) at each epoch's end."""

    class Marks(tf.keras.callbacks.Callback):
        def __init__(self) -> None:
            super().__init__()
            self.ends: list[tuple[int, int, int]] = []

        def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
            self.ends.append((epoch, len(model.seen["train"]), len(model.seen["val"])))

    return Marks()


@pytest.mark.parametrize(("rank", "first"), [(0, 0), (1, 0), (0, 2), (1, 2)])
def test_each_keras_epoch_consumes_exactly_one_loader_epoch(keraskit: Any, rank: int, first: int) -> None:
    """11 samples, 2 ranks, batch 2: 6 samples per rank (one padded), 3 steps an epoch; epochs first..3."""
    tf = keraskit.tf
    n, size, batch, epochs, seed = 11, 2, 2, 4, 7
    ds = Encoded(n)
    with ShmLoader(ds, rank=rank, size=size, batch_size=batch, num_workers=2, seed=seed,
                   fetch=take_channels_last) as loader:
        assert len(loader) == 3
        model = recording_model(tf)
        marks = epoch_marks(tf, model)
        shape = channels_last_shape(ds.sample_shape)
        with keraskit.data_errors_reraised():
            model.fit(keraskit.train_input(keraskit.LoaderEpochs(loader, first, epochs), shape), steps_per_epoch=3,
                      epochs=epochs, initial_epoch=first, validation_data=keraskit.val_input(ds, rank, size, 4),
                      callbacks=[marks], verbose=0, shuffle=False)
    assert [e for e, _, _ in marks.ends] == list(range(first, epochs))
    train_ends = [0, *(t for _, t, _ in marks.ends)]
    val_ends = [0, *(v for _, _, v in marks.ends)]
    want_val = ShardSampler(n, rank, size, shuffle=False).indices()
    for k, epoch in enumerate(range(first, epochs)):
        sampler = ShardSampler(n, rank, size, seed=seed, batch_size=batch)
        sampler.set_epoch(epoch)
        steps = model.seen["train"][train_ends[k]:train_ends[k + 1]]
        assert [s.tolist() for s in steps] == [b.tolist() for b in sampler.batches()], f"epoch {epoch}"
        val = model.seen["val"][val_ends[k]:val_ends[k + 1]]
        assert [len(v) for v in val] == [4, 2] and np.concatenate(val).tolist() == want_val.tolist()


def test_bad_data_in_a_producer_ends_fit_as_the_producers_error(keraskit: Any) -> None:
    """TensorFlow wraps a generator's exception in its own error type; the recipe's helper re-raises the
    producer's WorkerError (bad_data=True, the message naming the sample), which exit_with turns into exit 2."""
    tf = keraskit.tf
    ds = Encoded(40, bad_at=33)
    with ShmLoader(ds, rank=0, size=1, batch_size=4, num_workers=1, seed=0, shuffle=True,
                   fetch=take_channels_last) as loader:
        model = recording_model(tf)
        with pytest.raises(WorkerError) as info, keraskit.data_errors_reraised():
            model.fit(keraskit.train_input(keraskit.LoaderEpochs(loader, 0, 2), channels_last_shape(SHAPE)),
                      steps_per_epoch=len(loader), epochs=2, verbose=0, shuffle=False)
    assert info.value.bad_data and info.value.message == "shard.00000.mds sample 33: label 12 is out of range"
    assert len(model.seen["train"]) < 10  # stopped in the first epoch, at the batch holding sample 33


def test_validation_reads_its_share_in_batches_and_names_bad_data(keraskit: Any) -> None:
    share = ShardSampler(9, 1, 2, shuffle=False).indices()  # 5 of 9 (one padded)
    got = [(tuple(x.shape), np.rint(x.numpy()[:, 0, 0, 0]).astype(int).tolist())
           for x, _ in keraskit.val_input(Encoded(9), 1, 2, batch_size=2)]
    assert got == [((2, 3, 3, 2), share[:2].tolist()), ((2, 3, 3, 2), share[2:4].tolist()),
                   ((1, 3, 3, 2), share[4:].tolist())]
    bad = Encoded(9, bad_at=int(share[3]))
    with pytest.raises(arrays.DatasetError, match="label 12"), keraskit.data_errors_reraised():
        for _ in keraskit.val_input(bad, 1, 2, batch_size=2):
            pass


# ---- for real: the recipe streams an MDS dataset from S3 through its producers ------------------------------

OPENS = r'''
import json, os, runpy, sys
log, script = sys.argv[1], sys.argv[2]
rank = int(os.environ.get("HOROVOD_RANK", "-1"))
opened, recording = [], [True]

def hook(event, args):
    if recording[0] and event == "open" and isinstance(args[0], str) and "/shard." in args[0]:
        opened.append(os.path.realpath(args[0]))

sys.addaudithook(hook)  # this process only: the loader's spawned producers do not inherit it
sys.argv = [script, *sys.argv[3:]]
try:
    runpy.run_path(script, run_name="__main__")
finally:
    recording[0] = False
    with open(f"{log}.rank{rank}.json", "w") as f:
        json.dump({"pid": os.getpid(), "opened": opened}, f)
'''


@pytest.mark.slow
def test_recipe_streams_from_s3_through_its_producers_each_shard_fetched_once(tmp_path: Path) -> None:
    from tests.support.datasets import write_digits
    from tests.support.stores import MotoS3

    local = write_digits(tmp_path / "digits")
    server = MotoS3(tmp_path / "requests.log")
    server.start()
    try:
        server.client().create_bucket(Bucket="keras")
        env = {**server.env, cachedir.ENV_DIR: str(tmp_path / "node-cache"), "TF_CPP_MIN_LOG_LEVEL": "2"}
        upload = subprocess.run([str(REPO / ".venv" / "bin" / "hvdtrain"), "data", "upload", str(local),
                                 "s3://keras/digits", "--no-progress"], capture_output=True, text=True, timeout=120,
                                env={**os.environ, **env})
        assert upload.returncode == 0, upload.stderr
        wrapper = tmp_path / "opens.py"
        wrapper.write_text(OPENS)
        run_dir = tmp_path / "run"
        expect_ok(horovodrun(wrapper, str(tmp_path / "opens"), str(REPO / "recipes" / "keras_train.py"),
                             "--dataset", "s3://keras/digits", "--epochs", "2", "--warmup-epochs", "1",
                             "--num-workers", "2", "--verbose", "0", "--no-tensorboard", "--run-dir", str(run_dir),
                             timeout=300, env=env))
        train_keys = sorted(p.name for p in (local / "train").iterdir() if p.name.startswith("shard."))
        val_keys = sorted(p.name for p in (local / "val").iterdir() if p.name.startswith("shard."))
        gets = {key: server.gets(f"/digits/train/{key}") for key in train_keys}
        val_gets = {key: server.gets(f"/digits/val/{key}") for key in val_keys}
    finally:
        server.stop()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["epochs_completed"] == 2 and summary["val_accuracy"] > 0.7, summary["history"]
    assert len(set(summary["weights_sha256_by_rank"])) == 1
    # 2 ranks x 2 producers (each with its fetch-ahead threads) over 2 epochs: every training shard fetched once
    assert len(gets) > 5 and set(gets.values()) == {1}, gets
    assert set(val_gets.values()) == {1}, val_gets  # validation, read by the ranks themselves: once per node too
    opened = {int(p.name.split(".rank")[1].split(".")[0]): json.loads(p.read_text())["opened"]
              for p in tmp_path.glob("opens.rank*.json")}
    assert sorted(opened) == [0, 1], opened
    for rank, paths in opened.items():
        train = [p for p in paths if "/train-" in p]
        assert train == [], f"rank {rank} read training shards itself: {train[:3]}"
        assert any("/val-" in p for p in paths), f"rank {rank} opened no validation shard: {paths[:3]}"
