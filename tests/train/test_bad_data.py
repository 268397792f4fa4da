"""Bad data is an error, not a silent result (issue 14.3).

In-process: hvdtrain.train.recipe_data on shard directories written here — a stray label, labels out of a declared
range, negative or float labels, unreadable shards (truncated/corrupt .npz, bad CRC, object arrays), NaN/Inf
samples — each an error naming the file, the index and what to do. For real, with 2 Horovod ranks: the recipes
refuse such data before training (exit 2, one message per rank, no traceback), and training that goes NaN/Inf
(one rank's sample overflows) stops every rank at the same step with exit 3 and writes no checkpoint, for the
PyTorch (Gloo and MPI), elastic and Keras recipes; `--no-check-finite` trains on regardless.
"""

from __future__ import annotations

import importlib.util
import io
import math
import re
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
import yaml

from hvdtrain import exitcodes
from hvdtrain.formats import arrays, npyshards
from hvdtrain.formats.arrays import DatasetError
from hvdtrain.job.model import Logs
from hvdtrain.train import checkpoint, divergence
from hvdtrain.train.entry import exit_with
from hvdtrain.train.recipe_data import load
from tests.support.harness import REPO, JobResult, horovodrun, route, run_bounded

PYTORCH = REPO / "recipes" / "pytorch_train.py"
KERAS = REPO / "recipes" / "keras_train.py"
ELASTIC = REPO / "recipes" / "pytorch_elastic.py"
HVDTRAIN = str(Path(sys.executable).parent / "hvdtrain")
TIMEOUT = 300  # generous: 2 cores shared with other tests
FAST = ("--epochs", "2", "--batch-size", "8", "--threads", "1", "--no-tensorboard")
RNG = np.random.default_rng(0)

# Each rank runs under this wrapper: it ignores the SIGTERM that horovodrun sends the other ranks once one has
# exited (under Gloo, SIGKILL follows 5 s later). A rank that stopped at the same step as the first prints its own
# error in that time; a rank left waiting in an allreduce would print nothing: the test sees the difference.
RIDE_OUT = r'''
import os, runpy, signal, sys
signal.signal(signal.SIGTERM, lambda *_: None)  # a Python handler: the spawned data producers do not inherit it
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(sys.argv[0]))
runpy.run_path(sys.argv[0], run_name="__main__")
'''



def ride_out(tmp: Path) -> Path:
    wrapper = tmp / "ride_out.py"
    wrapper.write_text(RIDE_OUT)
    return wrapper


def samples(n: int, shape: tuple[int, ...] = (1, 8, 8)) -> np.ndarray:
    return RNG.random((n, *shape), dtype=np.float32)


def labels(n: int, classes: int = 4) -> np.ndarray:
    return np.arange(n) % classes


def rank_lines(result: JobResult) -> list[str]:
    """What the ranks printed, each line whole and given back to its rank as `hvdtrain run`'s console does (MPI
    tags every chunk; two ranks' chunks can share a line: NOTE [console]), as `[1]<stderr>:text`; no launcher lines."""
    _, out, err = route(result.output.splitlines(), Logs())
    return [line for line in (out + err).splitlines() if re.match(r"^\[\d+\]<std(?:out|err)>:", line)]


def job_exit_code(result: JobResult) -> int:
    """The first failing rank's exit code: horovodrun (Gloo) exits 1 and reports it as `Exit code: N`."""
    reported = re.findall(r"^\s*Exit code:\s*(\d+)\s*$", result.output, re.M)
    return int(reported[0]) if reported and result.returncode == 1 else result.returncode


def errors_by_rank(result: JobResult, script: str) -> dict[int, str]:
    found = {}
    for line in rank_lines(result):
        if (m := re.match(r"^\[(\d+)\]<stderr>:(.*)$", line)) and f"{script}: error: " in m.group(2):
            found[int(m.group(1))] = m.group(2).split(f"{script}: error: ", 1)[1]
    return found


# ---- labels --------------------------------------------------------------------------------------------------

def test_a_stray_label_is_named_instead_of_building_a_million_class_model(tmp_path):
    y = labels(40)
    y[7] = 1_000_000
    np.savez(tmp_path / "a.npz", x=samples(40), y=labels(40))
    np.savez(tmp_path / "b.npz", x=samples(40), y=y)
    with pytest.raises(DatasetError) as e:
        load(str(tmp_path))
    assert str(e.value).startswith(f"{tmp_path / 'b.npz'}['y'][7]: label 1000000 would make a 1000001-class "
                                   f"model, but only 5 distinct labels occur in {tmp_path}")
    assert "--num-classes N" in str(e.value)


def test_declared_classes_accept_a_large_label_and_are_the_model_size(tmp_path):
    y = labels(40)
    y[7] = 99
    np.savez(tmp_path / "a.npz", x=samples(40), y=y)
    assert load(str(tmp_path), num_classes=100).num_classes == 100


def test_a_label_outside_the_declared_classes_is_named_in_the_val_split_too(tmp_path):
    for sub in ("train", "val"):
        (tmp_path / sub).mkdir()
    np.save(tmp_path / "train" / "p_x.npy", samples(20))
    np.save(tmp_path / "train" / "p_y.npy", labels(20))
    y = labels(8)
    y[5] = 4
    np.save(tmp_path / "val" / "p_x.npy", samples(8))
    np.save(tmp_path / "val" / "p_y.npy", y)
    with pytest.raises(DatasetError, match=re.escape(
            f"{tmp_path / 'val' / 'p_y.npy'}[5]: label 4 is out of range for --num-classes 4 (labels must be "
            "0..3)")):
        load(str(tmp_path), num_classes=4)
    assert load(str(tmp_path)).num_classes == 5  # inferred: 0..4 all occur


def test_inferred_classes_are_the_largest_label_plus_one(tmp_path):
    np.savez(tmp_path / "a.npz", x=samples(30), y=np.array([0, 2, 1] * 10))
    assert load(str(tmp_path)).num_classes == 3


@pytest.mark.parametrize("y,message", [
    (np.array([0, 1, -1, 2]), r"a_y.npy\[2\]: label -1 is negative; labels are class ids 0..K-1"),
    (np.array([0.0, 1.0, 2.0, 1.0]), r"a_y.npy: labels must be a 1-D integer array of class ids, got dtype "
                                     r"float64 shape \(4,\) \(these floats are whole numbers: save them with "
                                     r"y.astype\(np.int64\)\)"),
    (np.array([0.5, 1.0, 2.0, 1.0]), r"a_y.npy: labels must be a 1-D integer array of class ids, got dtype "
                                     r"float64 shape \(4,\)$"),
])
def test_negative_and_float_labels_are_named(tmp_path, y, message):
    np.save(tmp_path / "a_x.npy", samples(4))
    np.save(tmp_path / "a_y.npy", y)
    with pytest.raises(DatasetError, match=message):
        load(str(tmp_path))


def test_digits_are_checked_against_declared_classes():
    with pytest.raises(DatasetError, match=r"digits labels\[\d+\]: label 9 is out of range for --num-classes 5"):
        load("digits", num_classes=5)
    assert load("digits", num_classes=12).num_classes == 12
    with pytest.raises(DatasetError, match="--num-classes must be >= 2, got 1"):
        load("synthetic", num_classes=1)


# ---- unreadable shards ---------------------------------------------------------------------------------------

def truncated(d: Path) -> None:
    np.savez(d / "a.npz", x=samples(16), y=labels(16))
    data = (d / "a.npz").read_bytes()
    (d / "a.npz").write_bytes(data[: len(data) // 2])


def flipped(d: Path, compressed: bool) -> None:
    """One byte of x's data flipped: stored -> bad CRC-32; deflated -> a corrupt stream (or a bad CRC)."""
    (np.savez_compressed if compressed else np.savez)(d / "a.npz", x=samples(16), y=labels(16))
    with zipfile.ZipFile(d / "a.npz") as z:
        info = z.getinfo("x.npy")
    data = bytearray((d / "a.npz").read_bytes())
    local = info.header_offset  # local file header: 30 bytes, the name, an extra field of the length at 28..29
    start = local + 30 + len(info.filename) + int.from_bytes(data[local + 28:local + 30], "little")
    data[start + info.compress_size // 2] ^= 0xFF  # inside x's (possibly deflated) data
    (d / "a.npz").write_bytes(bytes(data))


@pytest.mark.parametrize("make,name,reason", [
    (truncated, "a.npz", "corrupt or truncated .npz archive (File is not a zip file)"),
    (lambda d: flipped(d, compressed=False), "a.npz['x']", "corrupt or truncated .npz archive (Bad CRC-32"),
    (lambda d: flipped(d, compressed=True), "a.npz['x']", "corrupt or truncated .npz archive ("),
    (lambda d: np.savez(d / "a.npz", x=np.array([np.zeros(3), np.zeros(4)], dtype=object), y=labels(2)),
     "a.npz['x']", "it holds Python objects (dtype=object), which would need pickle; save numeric arrays"),
    (lambda d: (np.save(d / "a_x.npy", np.array([np.zeros(3), None], dtype=object)),
                np.save(d / "a_y.npy", labels(2))),
     "a_x.npy", "it holds Python objects (dtype=object)"),
    (lambda d: (np.save(d / "a_x.npy", samples(4)), np.save(d / "a_y.npy", labels(4)),
                (d / "a_x.npy").write_bytes((d / "a_x.npy").read_bytes()[:100])),
     "a_x.npy", "EOF: reading array header"),
    (lambda d: (d / "a.npz").write_bytes(b""), "a.npz", "cannot read as numpy data: "),
    (lambda d: (np.save(d / "a_y.npy", labels(2)), (d / "a_x.npy").write_bytes(b"<html>Not Found</html>")),
     "a_x.npy", "not a .npy/.npz file (no numpy header: another format, a damaged start, or a pickle)"),
])
def test_every_unreadable_shard_is_one_error_naming_the_file_and_the_reason(tmp_path, make, name, reason):
    make(tmp_path)
    with pytest.raises(DatasetError) as e:
        load(str(tmp_path))
    assert str(e.value).startswith(f"{tmp_path / name}: cannot read as numpy data: ")
    assert reason in str(e.value)


# ---- NaN/Inf samples -----------------------------------------------------------------------------------------

def read_every_sample(splits: arrays.Splits) -> np.ndarray:
    """Every sample of both splits, as the loaders read them (batches through `take`)."""
    return np.concatenate([split.take(np.arange(len(split)))[0] for split in (splits.train, splits.val)])


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_a_nan_or_inf_sample_is_named_with_its_index_and_position(tmp_path, bad):
    np.savez(tmp_path / "a.npz", x=samples(20), y=labels(20))
    x = samples(20)
    x[13, 0, 2, 5] = bad
    np.savez(tmp_path / "b.npz", x=x, y=labels(20))
    splits = load(str(tmp_path))  # samples are checked where their batch is read (tests/formats/test_npy_shards.py)
    with pytest.raises(DatasetError, match=re.escape(
            f"{tmp_path / 'b.npz'}['x'][13]: sample holds {bad} at position (0, 2, 5); fix the data, or pass "
            "--no-check-finite")):
        read_every_sample(splits)
    loaded = load(str(tmp_path), check_finite=False)
    assert (~np.isfinite(read_every_sample(loaded))).sum() == 1


def test_a_float64_sample_beyond_float32_range_is_named_not_trained_as_inf(tmp_path):
    x = RNG.random((10, 3))  # float64, numpy's default
    x[4, 1] = 1e39
    np.savez(tmp_path / "a.npz", x=x, y=labels(10, 2))
    with pytest.raises(DatasetError, match=re.escape(
            f"{tmp_path / 'a.npz'}['x'][4]: sample holds inf at position (1,) (as float32; the file holds float64: "
            "a value beyond float32's range is inf)")):
        read_every_sample(load(str(tmp_path)))


def test_loading_shards_reads_labels_not_samples(tmp_path):
    import tracemalloc

    for i in range(4):  # 4 MB of float32 samples each
        np.savez(tmp_path / f"p{i}.npz", x=samples(1000, (1000,)), y=labels(1000, 10))
    tracemalloc.start()
    try:
        splits = load(str(tmp_path))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    total = (len(splits.train) + len(splits.val)) * 1000 * 4
    # the archives' CRC-32 check reads chunks of READ_CHUNK bytes (zipfile buffers about one more); samples stay put
    assert peak < min(0.2 * total, 3 * npyshards.READ_CHUNK), f"peak {peak / 1e6:.1f} MB for {total / 1e6:.1f} MB"


def test_the_sample_check_scans_in_blocks_and_still_names_the_right_sample(monkeypatch):
    monkeypatch.setattr(arrays, "FINITE_BLOCK_VALUES", 10)  # 2 samples of 5 values per block
    x = np.zeros((9, 5), np.float32)
    arrays.check_samples(x, "x")
    x[7, 3] = np.inf
    with pytest.raises(DatasetError, match=re.escape("x[7]: sample holds inf at position (3,)")):
        arrays.check_samples(x, "x")
    arrays.check_samples(np.zeros((3, 2), np.int64), "ints")  # integers are always finite


# ---- what the recipes do with it -------------------------------------------------------------------------------

def test_exit_with_maps_divergence_to_exit_3_and_bad_data_to_exit_2(capsys):
    def diverged() -> int:
        raise divergence.at_step(0, 4, 10, "the averaged gradients hold NaN/Inf", float("nan"))

    with pytest.raises(SystemExit) as e:
        exit_with(diverged, "/r/recipe.py")
    assert e.value.code == exitcodes.DIVERGED == 3
    assert capsys.readouterr().err.startswith("recipe.py: error: training diverged at epoch 1, step 5/10: the "
                                              "averaged gradients hold NaN/Inf (this rank's loss at that step: nan)")


def test_a_ranks_error_line_is_one_write_so_no_other_ranks_line_lands_inside_it(monkeypatch):
    writes = []

    class Recorder:
        def write(self, text: str) -> int:
            writes.append(text)
            return len(text)

        def flush(self) -> None:
            writes.append("<flush>")

    monkeypatch.setattr(sys, "stderr", Recorder())
    with pytest.raises(SystemExit):
        exit_with(lambda: (_ for _ in ()).throw(divergence.at_step(0, 1, 6, "x", 1.0)), "/r/recipe.py")
    assert len(writes) == 2 and writes[1] == "<flush>", writes
    assert writes[0].startswith("recipe.py: error: training diverged at epoch 1, step 2/6: x (this rank's loss at ")
    assert writes[0].endswith(" to train on regardless\n") and writes[0].count("\n") == 1


def test_a_recipes_printed_lines_are_one_write_each_even_unbuffered(monkeypatch):
    """horovodrun gives Gloo ranks PYTHONUNBUFFERED=1, under which print() writes text and newline apart (mpirun
    then shows another rank's chunk inside the line); exit_with makes each line one write."""
    class Raw(io.RawIOBase):
        def __init__(self) -> None:
            self.chunks: list[bytes] = []

        def writable(self) -> bool:
            return True

        def write(self, data) -> int:
            self.chunks.append(bytes(data))
            return len(data)

    out, err = Raw(), Raw()
    monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(out, write_through=True))  # what python -u sets up
    monkeypatch.setattr(sys, "stderr", io.TextIOWrapper(err, write_through=True))
    print("before")
    assert out.chunks == [b"before", b"\n"]

    def main() -> int:
        print("epoch 1/2  train loss 0.5")
        print("epoch 2/2  train loss 0.25", file=sys.stderr)
        return 0

    with pytest.raises(SystemExit):
        exit_with(main, "/r/recipe.py")
    assert out.chunks[2:] == [b"epoch 1/2  train loss 0.5\n"] and err.chunks == [b"epoch 2/2  train loss 0.25\n"]


def test_a_step_reports_the_worst_of_its_backward_passes_losses():
    assert math.isnan(divergence.worst([0.5, float("nan"), 0.7]))
    assert divergence.worst([0.5, float("inf"), float("nan")]) == float("inf")
    assert divergence.worst([0.5, 0.7]) == 0.7
    assert "at epoch 2, step 7: " in str(divergence.at_step(1, 6, None, "x", 1.0))


def test_the_epoch_check_names_the_non_finite_losses():
    divergence.check_epoch(2, {"train_loss": 0.5, "val_loss": 0.7, "lr": float("nan")})  # only losses count
    with pytest.raises(divergence.TrainingDiverged, match=r"in epoch 3: val loss inf \(averaged over all ranks\)"):
        divergence.check_epoch(2, {"train_loss": 0.5, "val_loss": float("inf")})


def huge_sample_dataset(root: Path) -> Path:
    """train/ and val/ shards of 8x8 images in 4 classes; training sample 37 is ±3e38: finite on disk (the
    load check passes), but it overflows to Inf/NaN in the forward pass of whichever rank draws it."""
    for sub in ("train", "val"):
        (root / sub).mkdir(parents=True)
    x = samples(96)
    x[37], x[37, :, ::2] = 3e38, -3e38
    np.savez(root / "train" / "a.npz", x=x, y=labels(96))
    np.savez(root / "val" / "a.npz", x=samples(16), y=labels(16))
    return root


def assert_stopped_together(result: JobResult, script: str, run_dir: Path) -> None:
    """Exit 3; every rank names the same epoch and step; no checkpoint, no summary; no traceback from a rank."""
    assert job_exit_code(result) == exitcodes.DIVERGED, result.describe()
    errors = errors_by_rank(result, script)
    assert sorted(errors) == [0, 1], result.describe()
    where = {re.match(r"training diverged at epoch (\d+), step \d+(/\d+)?: ", e).group(0) for e in errors.values()}
    assert len(where) == 1, errors
    epoch = int(re.search(r"epoch (\d+)", where.pop()).group(1))
    written = [e for e, _ in checkpoint.list_checkpoints(run_dir / "checkpoints")]
    assert all(e < epoch for e in written), f"a checkpoint of the diverged epoch {epoch}: {written}"
    assert not (run_dir / "summary.json").exists()
    assert not any("Traceback" in line for line in rank_lines(result)), result.describe()


def test_a_sample_that_overflows_on_one_rank_stops_every_rank_at_the_same_step(tmp_path):
    """One controller: the ranks agree through the allreduce, which averages alike under both
    (tests/horovod/test_conformance.py); a failed rank under MPI's teardown is tests/launch/test_records.py's."""
    data = huge_sample_dataset(tmp_path / "data")
    run_dir = tmp_path / "run"
    result = horovodrun(ride_out(tmp_path), str(PYTORCH), "--dataset", str(data), "--run-dir", str(run_dir),
                        "--no-progress", *FAST, controller="gloo", timeout=TIMEOUT)
    assert_stopped_together(result, "pytorch_train.py", run_dir)
    errors = errors_by_rank(result, "pytorch_train.py")
    assert all("the averaged gradients hold NaN/Inf" in e for e in errors.values())
    # the Inf came from one rank's sample: only that rank's own loss is NaN, yet both stopped
    local = sorted(re.search(r"this rank's loss at that step: (\S+)\)", e).group(1) for e in errors.values())
    assert local[1] == "nan" and local[0] != "nan", errors


@pytest.mark.slow
def test_no_check_finite_trains_on_regardless(tmp_path):
    data = huge_sample_dataset(tmp_path / "data")
    run_dir = tmp_path / "run"
    result = horovodrun(PYTORCH, "--dataset", str(data), "--run-dir", str(run_dir), "--no-progress",
                        "--no-check-finite", *FAST, timeout=TIMEOUT)
    assert result.returncode == 0, result.describe()
    assert "train loss nan" in result.output and (run_dir / "summary.json").exists()


@pytest.mark.slow
def test_the_recipe_refuses_a_stray_label_on_every_rank_before_training(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    y = labels(64)
    y[21] = 1_000_000
    np.savez(data / "part0.npz", x=samples(64), y=labels(64))
    np.savez(data / "part1.npz", x=samples(64), y=y)
    run_dir = tmp_path / "run"
    result = horovodrun(ride_out(tmp_path), str(PYTORCH), "--dataset", str(data), "--run-dir", str(run_dir), *FAST,
                        timeout=TIMEOUT)
    assert job_exit_code(result) == 2, result.describe()
    errors = errors_by_rank(result, "pytorch_train.py")
    assert sorted(errors) == [0, 1], result.describe()
    assert all(e.startswith(f"{data / 'part1.npz'}['y'][21]: label 1000000 would make a 1000001-class model")
               for e in errors.values()), errors
    assert not any("Traceback" in line for line in rank_lines(result)), result.describe()
    assert sorted(p.name for p in run_dir.iterdir()) == ["hvdtrain.lock"]  # nothing trained, nothing written


@pytest.mark.slow
def test_a_corrupt_shard_is_exit_2_with_one_line_naming_it(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    np.savez(data / "part0.npz", x=samples(32), y=labels(32))
    flipped(data, compressed=False)  # data/a.npz: bad CRC
    result = run_bounded([sys.executable, str(PYTORCH), "--dataset", str(data), "--run-dir",
                          str(tmp_path / "run")], timeout=TIMEOUT)
    assert result.returncode == 2, result.describe()
    assert result.output.strip().splitlines()[-1] == (
        f"pytorch_train.py: error: {data / 'a.npz'}['x']: cannot read as numpy data: corrupt or truncated .npz "
        "archive (Bad CRC-32 for file 'x.npy')"), result.describe()
    assert "Traceback" not in result.output


@pytest.mark.slow
def test_the_elastic_recipe_stops_every_rank_on_divergence(tmp_path):
    data = huge_sample_dataset(tmp_path / "data")
    run_dir = tmp_path / "run"
    spec = tmp_path / "elastic.yaml"
    spec.write_text(yaml.safe_dump({
        "script": str(ride_out(tmp_path)), "np": 2, "controller": "gloo", "network_interfaces": ["lo"],
        "elastic": {"discovery_script": str(REPO / "jobs" / "discover_hosts.sh"), "min_np": 1, "max_np": 2,
                    "reset_limit": 3, "timeout_s": 60},
        "args": [str(ELASTIC), "--dataset", str(data), "--run-dir", str(run_dir), "--no-progress", *FAST]}))
    result = run_bounded([HVDTRAIN, "run", str(spec)], timeout=TIMEOUT)
    assert_stopped_together(result, "pytorch_elastic.py", run_dir)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("tensorflow") is None, reason="TensorFlow is not installed")
def test_the_keras_recipe_stops_every_rank_at_the_same_step(tmp_path):
    data = huge_sample_dataset(tmp_path / "data")
    run_dir = tmp_path / "run"
    result = horovodrun(ride_out(tmp_path), str(KERAS), "--dataset", str(data), "--run-dir", str(run_dir),
                        "--verbose", "0", *FAST, timeout=TIMEOUT, env={"TF_CPP_MIN_LOG_LEVEL": "2"})
    assert_stopped_together(result, "keras_train.py", run_dir)
    errors = errors_by_rank(result, "keras_train.py")
    assert all("the weights hold NaN/Inf after the update" in e for e in errors.values()), errors
