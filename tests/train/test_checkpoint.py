"""Atomic checkpoint writes, keep-last-K and latest-valid selection (hvdtrain.train.checkpoint)."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch

from hvdtrain.atomic import atomic_write
from hvdtrain.train import checkpoint as ckpt
from hvdtrain.train.metrics import write_summary


def torch_read(f):
    return torch.load(f, weights_only=True)


def state(value: float) -> dict:
    return {"model": {"w": torch.full((4, 4), value)}, "note": "x"}


def save(directory: Path, epoch: int, keep: int = 3, value: float | None = None) -> Path:
    return ckpt.save(directory, epoch, state(float(epoch) if value is None else value), torch.save, keep=keep)


def names(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def test_save_writes_a_loadable_checkpoint_with_its_epoch_and_nothing_else(tmp_path):
    path = save(tmp_path / "ckpt", 3)
    assert path == tmp_path / "ckpt" / "ckpt-epoch0003.pt"
    loaded = ckpt.load(path, torch_read)
    assert loaded["epoch"] == 3
    assert torch.equal(loaded["model"]["w"], torch.full((4, 4), 3.0))
    assert names(tmp_path / "ckpt") == ["ckpt-epoch0003.pt"]  # no temp file left behind


def test_write_goes_to_a_temp_file_in_the_same_dir_then_fsync_then_replace(tmp_path, monkeypatch):
    events: list[tuple] = []
    real_replace, real_fsync = os.replace, os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append(("fsync",)), real_fsync(fd))[1])
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append(("replace", Path(a), Path(b))),
                                                     real_replace(a, b))[1])
    path = save(tmp_path, 1)
    replaces = [e for e in events if e[0] == "replace"]
    assert len(replaces) == 1
    _, src, dst = replaces[0]
    assert dst == path and src.parent == path.parent and src != path
    assert events.index(("fsync",)) < events.index(replaces[0]), "file must be fsync'ed before the rename"
    assert events[-1] == ("fsync",), "directory must be fsync'ed after the rename"


def test_a_failed_write_leaves_the_previous_checkpoint_intact_and_no_temp_file(tmp_path):
    save(tmp_path, 1, value=7.0)
    good = (tmp_path / "ckpt-epoch0001.pt").read_bytes()

    def crash_midway(payload, f):
        f.write(b"PK\x03\x04 half a zip")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_write(tmp_path / "ckpt-epoch0001.pt", lambda f: crash_midway(None, f))
    with pytest.raises(OSError, match="disk full"):
        ckpt.save(tmp_path, 2, state(2.0), crash_midway, keep=3)
    assert names(tmp_path) == ["ckpt-epoch0001.pt"]
    assert (tmp_path / "ckpt-epoch0001.pt").read_bytes() == good


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_an_atomic_file_gets_the_permissions_the_umask_gives_and_leaves_the_umask_alone(tmp_path, umask):
    old = os.umask(umask)
    try:
        path = atomic_write(tmp_path / "summary.json", lambda f: f.write(b"{}"))
        assert os.umask(umask) == umask  # what the process had is what it still has
    finally:
        os.umask(old)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask
    assert names(tmp_path) == ["summary.json"]


def test_a_crash_before_the_rename_never_exposes_a_partial_checkpoint(tmp_path, monkeypatch):
    def killed(a, b):
        raise KeyboardInterrupt  # e.g. SIGINT between fsync and rename

    monkeypatch.setattr(os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        save(tmp_path, 1)
    assert names(tmp_path) == []


def test_keeps_only_the_last_k_and_removes_stale_temp_files(tmp_path):
    (tmp_path / ".ckpt-epoch0002.pt.tmp-abc123").write_bytes(b"left by a crashed write")
    for epoch in range(1, 6):
        save(tmp_path, epoch, keep=2)
    assert names(tmp_path) == ["ckpt-epoch0004.pt", "ckpt-epoch0005.pt"]


def test_find_latest_picks_the_newest_by_epoch_number_not_by_name(tmp_path):
    for epoch in (2, 9999, 10000):
        save(tmp_path, epoch, keep=10)
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    (tmp_path / ".ckpt-epoch10001.pt.tmp-zz").write_bytes(b"temp")
    found = ckpt.find_latest(tmp_path, torch_read)
    assert found is not None
    assert (found.epoch, found.path.name) == (10000, "ckpt-epoch10000.pt")
    assert torch.equal(found.state["model"]["w"], torch.full((4, 4), 10000.0))


@pytest.mark.parametrize("damage", ["truncate", "empty", "garbage", "bitflip"])
def test_a_damaged_newest_checkpoint_is_skipped_with_a_warning_naming_it(tmp_path, damage):
    save(tmp_path, 1)
    newest = save(tmp_path, 2)
    data = newest.read_bytes()
    damaged = {"truncate": data[: len(data) // 2], "empty": b"", "garbage": b"\x00not a zip" * 50,
               "bitflip": data[:-10] + bytes([data[-10] ^ 1]) + data[-9:]}[damage]
    newest.write_bytes(damaged)
    warnings: list[str] = []
    found = ckpt.find_latest(tmp_path, torch_read, required_keys=("model",), warn=warnings.append)
    assert found is not None and found.epoch == 1
    assert len(warnings) == 1 and "ckpt-epoch0002.pt" in warnings[0] and "skipping" in warnings[0]


def test_default_warning_goes_through_the_warnings_module(tmp_path):
    (tmp_path / "ckpt-epoch0001.pt").write_bytes(b"")
    with pytest.warns(UserWarning, match="ckpt-epoch0001.pt"):
        assert ckpt.find_latest(tmp_path, torch_read) is None


def test_content_that_is_not_a_matching_checkpoint_is_skipped(tmp_path):
    save(tmp_path, 1)
    ckpt.write_file(tmp_path / "ckpt-epoch0002.pt", [1, 2, 3], torch.save)  # not a dict
    ckpt.write_file(tmp_path / "ckpt-epoch0003.pt", {"epoch": 3}, torch.save)  # lacks "model"
    ckpt.write_file(tmp_path / "ckpt-epoch0004.pt", {"epoch": 9, "model": {}}, torch.save)  # epochs disagree
    torch.save({"epoch": 5, "model": {}}, tmp_path / "ckpt-epoch0005.pt")  # a plain torch file: no header
    warnings: list[str] = []
    found = ckpt.find_latest(tmp_path, torch_read, required_keys=("model",), warn=warnings.append)
    assert found is not None and found.epoch == 1
    assert [w.split(":")[0].rsplit("/", 1)[-1] for w in warnings] == [
        "ckpt-epoch0005.pt", "ckpt-epoch0004.pt", "ckpt-epoch0003.pt", "ckpt-epoch0002.pt"]
    assert "not an hvdtrain checkpoint" in warnings[0]
    assert "content says 9" in warnings[1] and "missing key(s) model" in warnings[2]
    assert "expected a dict" in warnings[3]


def test_an_intact_file_the_reader_cannot_deserialize_raises_instead_of_restarting(tmp_path):
    save(tmp_path, 1)

    def incompatible(f):
        raise RuntimeError("written by an incompatible version")

    with pytest.raises(RuntimeError, match="incompatible"):
        ckpt.find_latest(tmp_path, incompatible)


def test_no_checkpoint_gives_none(tmp_path):
    assert ckpt.find_latest(tmp_path / "does-not-exist", torch_read) is None
    assert ckpt.find_latest(tmp_path, torch_read) is None
    (tmp_path / "ckpt-epoch0001.pt").write_bytes(b"junk")
    assert ckpt.find_latest(tmp_path, torch_read, warn=lambda m: None) is None


def test_bad_arguments_are_rejected_naming_them(tmp_path):
    with pytest.raises(ValueError, match="epoch must be an int >= 1"):
        ckpt.checkpoint_path(tmp_path, 0)
    with pytest.raises(ValueError, match="keep must be an int >= 1"):
        save(tmp_path, 1, keep=0)


def test_summary_json_is_written_atomically_and_nan_becomes_null(tmp_path, monkeypatch):
    replaced: list[Path] = []
    real_replace = os.replace
    monkeypatch.setattr(os, "replace", lambda a, b: (replaced.append(Path(b)), real_replace(a, b))[1])
    path = write_summary(tmp_path, {"val_accuracy": 0.97, "loss": float("nan"), "nested": {"x": [1.0]}})
    assert replaced == [tmp_path / "summary.json"] == [path]
    assert json.loads(path.read_text()) == {"val_accuracy": 0.97, "loss": None, "nested": {"x": [1.0]}}


def test_a_checkpoint_of_another_model_is_one_error_line_and_exit_2(tmp_path: Path, capsys) -> None:
    """Resuming a run directory written by another --model (or an earlier SmallCNN) said RuntimeError with a
    traceback on rank 0; it is now exit 2 naming the checkpoint and the two ways out."""
    from hvdtrain.train import torchkit
    from hvdtrain.train.entry import exit_with

    old = torch.nn.Sequential(torch.nn.Linear(4, 3))
    opt = torch.optim.SGD(old.parameters(), lr=0.1, momentum=0.9)
    ckpt.save(tmp_path, 1, {"model": old.state_dict(), "optimizer": opt.state_dict(), "history": [{"epoch": 1}]},
              torch.save, keep=1)
    new = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    with pytest.raises(SystemExit) as e:
        exit_with(lambda: torchkit.load_latest(tmp_path, new, torch.optim.SGD(new.parameters(), lr=0.1))[0],
                  "/r/pytorch_train.py")
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"pytorch_train.py: error: {tmp_path}/ckpt-epoch0001.pt does not fit this model or "
                          "optimizer (Error(s) in loading state_dict for Sequential:") and err.count("\n") == 1, err
    assert err.endswith("train in a new --run-dir, or pass --no-resume to start from scratch\n"), err
    assert torchkit.load_latest(tmp_path, old, opt)[0] == 1  # the same model still resumes


def test_a_position_of_other_data_is_one_error_line_and_exit_2(tmp_path: Path, capsys) -> None:
    """A mid-epoch checkpoint resumed on another --dataset or --seed said ValueError with a traceback (exit 1); it is
    now exit 2 naming the run's checkpoints and the ways out. The same data resumes at the step."""
    from hvdtrain.data import ShardSampler
    from hvdtrain.train.entry import exit_with

    saved = ShardSampler(100, 0, 2, seed=1, batch_size=5)
    saved.advance(3)
    state = saved.state_dict()
    with pytest.raises(SystemExit) as e:
        exit_with(lambda: ckpt.resume_loader(ShardSampler(100, 0, 2, seed=2, batch_size=5), state, tmp_path) or 0,
                  "/r/keras_train.py")
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"keras_train.py: error: the newest checkpoint in {tmp_path} was written mid-epoch on "
                          "other data (sampler state has seed=1 but this sampler has seed=2") and err.count("\n") == 1
    assert err.endswith("train in a new --run-dir, or pass --no-resume to start from scratch\n"), err
    with pytest.raises(ckpt.CheckpointMismatch, match="num_samples=100 but this sampler has num_samples=90"):
        ckpt.resume_loader(ShardSampler(90, 0, 2, seed=1, batch_size=5), state, tmp_path)
    same = ShardSampler(100, 0, 2, seed=1, batch_size=5)
    ckpt.resume_loader(same, state, tmp_path)
    assert list(same) == list(saved)
    # A state that is broken rather than of other data stays the sampler's own error.
    with pytest.raises(ValueError, match="sampler state is missing") as broken:
        ckpt.resume_loader(same, {"epoch": 0}, tmp_path)
    assert not isinstance(broken.value, ckpt.CheckpointMismatch)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("tensorflow") is None, reason="TensorFlow is not installed in this venv")
def test_a_keras_checkpoint_of_another_model_is_one_error_line_and_exit_2(tmp_path: Path, capsys, monkeypatch) -> None:
    """The Keras recipe's load_latest into another model said ValueError with a traceback (exit 1); now as the PyTorch
    recipe's: exit 2 naming the checkpoint and the ways out (on the Keras this process's environment selects)."""
    from hvdtrain.train import keraskit
    from hvdtrain.train.entry import exit_with
    from hvdtrain.train.metrics import History

    def built(width: int, adam: bool = False):
        model = keraskit.build_model((4,), 3, width)
        optimizers = keraskit.tf.keras.optimizers
        model.compile(optimizer=optimizers.Adam(0.1) if adam else optimizers.SGD(0.1, momentum=0.9), loss="mse")
        model.optimizer.build(model.trainable_variables)
        return model

    old = built(2)
    keraskit.save_checkpoint(tmp_path, 1, old, History([{"epoch": 1}]), 1)
    with pytest.raises(SystemExit) as e:
        exit_with(lambda: keraskit.load_latest(tmp_path, built(3))[0], "/r/keras_train.py")
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"keras_train.py: error: {tmp_path}/ckpt-epoch0001.pt does not fit this model or optimizer (")
    assert err.endswith("train in a new --run-dir, or pass --no-resume to start from scratch\n") and \
        err.count("\n") == 1, err
    # The same model with another optimizer (Adam: more variables): tf_keras's set_weights would load a part.
    with pytest.raises(ckpt.CheckpointMismatch, match=r"\(the optimizer has \d+ variables, the checkpoint \d+\)"):
        keraskit.load_latest(tmp_path, built(2, adam=True))
    assert keraskit.load_latest(tmp_path, built(2))[0] == 1  # the same model still resumes


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("tensorflow") is None, reason="TensorFlow is not installed in this venv")
def test_a_keras_checkpoint_resumes_across_precision_with_its_optimizer_state(tmp_path: Path) -> None:
    """--precision fp32 <-> fp16 between runs: the optimizer's state (momenta) is the inner optimizer's either way and
    the loss scale a part of its own (Keras 3 lists the scale among a LossScaleOptimizer's variables: a checkpoint
    holding them there did not fit the other precision's optimizer). On the Keras this process's environment selects."""
    import numpy as np

    from hvdtrain.train import keraskit
    from hvdtrain.train.metrics import History

    def built(scaled: bool):
        model = keraskit.build_model((4,), 3, 2)
        sgd = keraskit.tf.keras.optimizers.SGD(0.1, momentum=0.9)
        model.compile(optimizer=keraskit.tf.keras.mixed_precision.LossScaleOptimizer(sgd) if scaled else sgd,
                      loss="mse")
        model.optimizer.build(model.trainable_variables)
        return model

    def momenta(model) -> list:
        return [v.numpy().tolist() for v in keraskit.optimizer_variables(model.optimizer) if len(v.shape)]

    fp32 = built(False)
    for i, v in enumerate(keraskit.optimizer_variables(fp32.optimizer)):
        v.assign(np.full(v.shape, i + 1, v.dtype.name if hasattr(v.dtype, "name") else v.dtype))
    keraskit.save_checkpoint(tmp_path / "a", 1, fp32, History([{"epoch": 1}]), 1)
    fp16 = built(True)
    initial = [float(v.numpy()) for v in keraskit.loss_scale_variables(fp16.optimizer)]
    assert keraskit.load_latest(tmp_path / "a", fp16)[0] == 1
    assert momenta(fp16) == momenta(fp32) and any(momenta(fp32))
    assert [float(v.numpy()) for v in keraskit.loss_scale_variables(fp16.optimizer)] == initial  # the initial scale

    scale, count = keraskit.loss_scale_variables(fp16.optimizer)
    scale.assign(1024.0)
    count.assign(7)
    keraskit.save_checkpoint(tmp_path / "b", 1, fp16, History([{"epoch": 1}]), 1)
    again = built(True)
    assert keraskit.load_latest(tmp_path / "b", again)[0] == 1
    assert [float(v.numpy()) for v in keraskit.loss_scale_variables(again.optimizer)] == [1024.0, 7.0]
    back = built(False)
    assert keraskit.load_latest(tmp_path / "b", back)[0] == 1 and momenta(back) == momenta(fp32)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("tensorflow") is None, reason="TensorFlow is not installed in this venv")
def test_a_keras_checkpoint_of_the_other_keras_is_refused_naming_both(tmp_path: Path) -> None:
    """tf_keras and Keras 3 keep other optimizer variables: a checkpoint records the Keras that wrote it, and the other
    one stops with CheckpointMismatch (exit 2) naming both and how to resume; one without the record (written before
    the recipe ran on Keras 3) is tf_keras's."""
    from hvdtrain.train import keraskit
    from hvdtrain.train.metrics import History

    model = keraskit.build_model((4,), 3, 2)
    model.compile(optimizer=keraskit.tf.keras.optimizers.SGD(0.1, momentum=0.9), loss="mse")
    model.optimizer.build(model.trainable_variables)
    this = f"{keraskit.KERAS.package} {keraskit.KERAS.version}"
    other = "tf_keras 2.21.0" if keraskit.KERAS3 else "keras 3.15.1"
    state = keraskit.checkpoint_state(model, History([{"epoch": 1}]))
    assert state["keras"] == this
    ckpt.save(tmp_path / "other", 1, state | {"keras": other}, keraskit.write_npz, keep=1)
    with pytest.raises(ckpt.CheckpointMismatch) as refused:
        keraskit.load_latest(tmp_path / "other", model)
    assert f"ckpt-epoch0001.pt was written under {other}, this run is on {this}: their optimizer states differ" \
        in str(refused.value)
    assert "TF_USE_LEGACY_KERAS=1 selects tf_keras, unset it for Keras 3" in str(refused.value)
    ckpt.save(tmp_path / "unmarked", 1, {k: v for k, v in state.items() if k != "keras"}, keraskit.write_npz, keep=1)
    if keraskit.KERAS3:
        with pytest.raises(ckpt.CheckpointMismatch, match="was written under tf_keras 2, this run is on keras 3"):
            keraskit.load_latest(tmp_path / "unmarked", model)
    else:
        assert keraskit.load_latest(tmp_path / "unmarked", model)[0] == 1
    ckpt.save(tmp_path / "same", 1, state, keraskit.write_npz, keep=1)
    assert keraskit.load_latest(tmp_path / "same", model)[0] == 1
