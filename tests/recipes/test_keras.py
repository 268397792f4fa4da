"""recipes/keras_train.py run for real with 2 Horovod ranks: Gloo for a fresh run, MPI for the resume, which ends
bit-identical to an uninterrupted run (Gloo) of as many epochs.

Each rank runs under a small wrapper that records, with a Python audit hook, every file it opens for writing or
renames into the run directory, so "only rank 0 writes" is checked from what the ranks did. Final weights are
compared through a digest the test recomputes from the checkpoint on disk.
"""

from __future__ import annotations

import hashlib
import importlib.util
import io
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from hvdtrain.train import checkpoint
from tests.support import recipes
from tests.support.recipes import Run, epoch_lines

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("tensorflow") is None,
                                 reason="TensorFlow is not installed in this venv")]

RECIPE = recipes.KERAS
ARGS = ("--epochs", "2", "--warmup-epochs", "1", "--keep-checkpoints", "2", "--verbose", "0", "--lr-milestones", "2")



def run_recipe(tmp: Path, run_dir: Path, *args: str, controller: str, **kw) -> Run:
    return recipes.run_recipe(RECIPE, tmp, run_dir, *args, controller=controller, **kw)


def checkpoint_digest(run: Run, epoch: int) -> str:
    """The recipe's weights digest, recomputed independently from rank 0's checkpoint file."""
    path = run.run_dir / "checkpoints" / f"ckpt-epoch{epoch:04d}.pt"
    with np.load(io.BytesIO(checkpoint.verified_payload(path)), allow_pickle=False) as z:
        h = hashlib.sha256()
        for name in sorted(n for n in z.files if n.startswith("model/")):
            h.update(str(z[name].shape).encode())
            h.update(np.ascontiguousarray(z[name]).tobytes())
    return h.hexdigest()


@pytest.fixture(scope="module")
def fresh(tmp_path_factory) -> Run:
    """3 epochs (Gloo) without interruption, under plain horovodrun: what the resumed runs below must end as."""
    tmp = tmp_path_factory.mktemp("keras-fresh")
    return run_recipe(tmp, tmp / "run", *ARGS[:1], "3", *ARGS[2:], controller="gloo", plain=True)


@pytest.fixture(scope="module")
def resumed(fresh, tmp_path_factory) -> Run:
    """The fresh run's directory as it was after epoch 2 (its epoch-3 checkpoint and summary removed), resumed (MPI)."""
    tmp = tmp_path_factory.mktemp("keras-resumed")
    shutil.copytree(fresh.run_dir, tmp / "run")
    (tmp / "run" / "checkpoints" / "ckpt-epoch0003.pt").unlink()
    (tmp / "run" / "summary.json").unlink()
    return run_recipe(tmp, tmp / "run", *ARGS[:1], "3", *ARGS[2:], controller="mpi")


def test_gloo_two_ranks_learn_and_end_with_identical_weights(fresh):
    summary = fresh.summary()
    digests = summary["weights_sha256_by_rank"]
    assert len(digests) == 2 and digests[0] == digests[1], f"ranks ended with different weights: {digests}"
    assert digests[0] == checkpoint_digest(fresh, 3), "the last checkpoint does not hold the ranks' final weights"
    assert summary["epochs_completed"] == 3 and summary["world_size"] == 2 and summary["resumed_from_epoch"] == 0
    assert summary["val_accuracy"] > 0.5 and summary["samples_per_sec"] > 0, summary
    assert summary["keras"].startswith("keras 3."), summary["keras"]
    assert epoch_lines(fresh.output) == [1, 2, 3]
    # the epoch line: the first step's LR → the last's during the warmup (23 steps of 2 × 32 samples), then one value
    assert [row["lr_first"] for row in summary["history"]] == pytest.approx([0.05 + 0.05 / 23, 0.1, 0.01])
    assert re.findall(r"epoch \d+/3  .*  (lr \S+)  ", fresh.output) == ["lr 0.05217→0.1", "lr 0.1", "lr 0.01"]
    config = summary["config"]  # what the run was
    assert config["dataset"]["kind"] == "digits" and config["dataset"]["train_samples"] == 1438
    assert config["model"]["name"] == "cnn" and config["model"]["width"] == 32 and config["model"]["parameters"] > 0
    assert config["batch_size"] == {"per_rank": 32, "backward_passes_per_step": 1, "global": 64}
    assert config["lr"]["peak"] == pytest.approx(0.1) and config["lr"]["milestones"] == [2]
    assert (config["epochs"], config["precision"], config["seed"]) == (3, "fp32", 42)
    assert config["world"] == {"size": 2, "local_size": 2, "hosts": 1}
    assert set(config["versions"]) == {"hvdtrain", "horovod", "tensorflow", "keras", "python"}
    assert "weights identical on all 2 ranks" in fresh.output


def test_no_rank_prints_tensorflows_startup_lines(fresh):
    """absl's banner, oneDNN and cudart INFO lines, the cuInit error of a machine without a GPU (NOTE [TensorFlow
    start-up lines] in hvdtrain/tfkeras.py); plain horovodrun's build probe (not a rank) still prints them."""
    ranks = [line for line in fresh.output.splitlines() if re.match(r"\[\d+\]<std(out|err)>:", line)]
    noise = [line for line in ranks
             if re.search(r"absl::InitializeLog|oneDNN|cudart|cpu_feature_guard|^\S+:I\d{4} ", line)]
    assert ranks and not noise, noise
    if not Path("/dev/nvidiactl").exists():
        assert not [line for line in ranks if "cuInit" in line]


def test_only_rank_0_writes_checkpoints_tensorboard_and_summary(fresh):
    assert sorted(fresh.audit) == [0, 1], f"expected an audit log from each rank: {fresh.audit}"
    assert fresh.audit[1] == [], f"rank 1 wrote into the run directory: {fresh.audit[1]}"
    renamed = [Path(p).name for kind, p in fresh.audit[0] if kind == "rename"]
    assert renamed == ["ckpt-epoch0001.pt", "ckpt-epoch0002.pt", "ckpt-epoch0003.pt", "summary.json"], renamed
    # TensorBoard writes through TensorFlow's C++ file system, which the audit hook does not see; its event file
    # names end in .<host>.<pid>.<n>.v2, so check whose they are.
    events = list((fresh.run_dir / "tensorboard").rglob("events.out.tfevents.*"))
    assert events, "rank 0 wrote no TensorBoard logs"
    assert {int(p.name.split(".")[-3]) for p in events} == {fresh.pids[0]}, [p.name for p in events]
    assert fresh.checkpoints() == ["ckpt-epoch0002.pt", "ckpt-epoch0003.pt"]  # --keep-checkpoints 2
    assert not list((fresh.run_dir / "checkpoints").glob(".*tmp-*")), "temp files left behind"


def test_mpi_resume_continues_from_the_next_epoch(resumed):
    assert re.search(r"resuming from \S+ckpt-epoch0002\.pt \(epoch 2 done\)", resumed.output), resumed.output
    assert epoch_lines(resumed.output) == [3], "the resumed run must train epoch 3 only"
    summary = resumed.summary()
    assert summary["resumed_from_epoch"] == 2 and summary["epochs_completed"] == 3
    assert [row["epoch"] for row in summary["history"]] == [1, 2, 3], "history lost across the resume"
    digests = summary["weights_sha256_by_rank"]
    assert digests[0] == digests[1] == checkpoint_digest(resumed, 3)
    assert resumed.audit[1] == [], f"rank 1 wrote into the run directory: {resumed.audit[1]}"
    assert resumed.checkpoints() == ["ckpt-epoch0002.pt", "ckpt-epoch0003.pt"]  # keep 2


def test_a_resumed_run_trains_on_the_samples_of_an_uninterrupted_one(resumed, fresh):
    """Each Keras epoch is one epoch of the rank's ShmLoader (set_epoch: the same shuffle on every rank): resumed at
    epoch 3, the ranks train on epoch 3's batches, so 2 epochs + a resume (MPI) end bit-identical to 3 epochs in one
    run (Gloo), every epoch's metrics included."""
    assert epoch_lines(fresh.output) == [1, 2, 3]
    assert resumed.summary()["weights_sha256_by_rank"] == fresh.summary()["weights_sha256_by_rank"]
    keys = ("epoch", "train_loss", "train_accuracy", "val_loss", "val_accuracy", "lr")
    assert [{k: row[k] for k in keys} for row in resumed.summary()["history"]] == \
        [{k: row[k] for k in keys} for row in fresh.summary()["history"]]


def test_a_stop_request_mid_epoch_checkpoints_there_and_resumes_to_the_same_weights(fresh, tmp_path):
    """SIGTERM to rank 1 alone after its 30th step (the 7th of epoch 2, 23 steps an epoch): both ranks stop after
    the same step (the vote rides one step behind), rank 0 checkpoints there with each rank's metric sums, epoch 2
    is neither validated nor checkpointed as done, every rank exits 75; the same command again (MPI) resumes at that
    step, the rest of epoch 2 a fit of its own, and ends as the uninterrupted run: weights, and every epoch's
    metrics and LRs (NOTE [Keras stops mid-epoch] in hvdtrain/train/kerasstop.py). Over 30 s: two 2-rank Keras runs (the
    stop, the resume); TensorFlow's import alone takes 6-7 s a rank."""
    run_dir, ckpts, args = tmp_path / "run", tmp_path / "run" / "checkpoints", (*ARGS[:1], "3", *ARGS[2:])
    first = run_recipe(tmp_path, run_dir, *args, "--sigterm-grace", "60", controller="gloo", exit_code=1,
                       env={"HVDTRAIN_TEST_SIGNAL": "1:30:SIGTERM"})  # horovodrun's 1: a rank exited non-zero
    # The first rank to exit 75 makes horovodrun SIGTERM the other, which may still be on its way out (143).
    codes = re.findall(r"Process \d exit with status code (\d+)", first.output)
    assert "75" in codes and set(codes) <= {"75", "143"}, first.output
    names = first.checkpoints()
    assert names[0] == "ckpt-epoch0001.pt" and re.fullmatch(r"ckpt-epoch0001-step00000[78]\.pt", names[1]), names
    assert epoch_lines(first.output) == [1], "epoch 2 must not be recorded as done"
    assert f"asked to stop (on another rank): checkpoint {ckpts / names[1]}; run the same command again" \
        in first.output, first.output
    assert not (run_dir / "summary.json").exists() and first.audit[1] == []
    step = int(names[1][-9:-3])

    second = run_recipe(tmp_path, run_dir, *args, controller="mpi")
    assert f"resuming from {ckpts / names[1]} (epoch 1 done, then {step} steps of epoch 2)" in second.output
    assert epoch_lines(second.output) == [2, 3]
    keys = ("epoch", "train_loss", "train_accuracy", "val_loss", "val_accuracy", "lr_first", "lr")
    summary, reference = second.summary(), fresh.summary()
    assert [{k: row[k] for k in keys} for row in summary["history"]] == \
        [{k: row[k] for k in keys} for row in reference["history"]]
    assert summary["weights_sha256_by_rank"] == reference["weights_sha256_by_rank"], \
        "training resumed mid-epoch ended with different weights than the uninterrupted run"
    assert second.checkpoints() == ["ckpt-epoch0002.pt", "ckpt-epoch0003.pt"]  # keep 2


def test_the_lr_schedule_is_the_pytorch_recipes_epoch_by_epoch(fresh):
    """Warmup over epoch 1, milestone 2: LR × 0.1 for every step of epoch 3 (0-based 2), as the PyTorch recipe
    (tests/recipes/test_pytorch.py checks the same flags there); Horovod's callbacks used to compound a constant
    multiplier and start it an epoch late. Each epoch's LR is its last step's, 0.05 × 2 ranks at the peak."""
    from hvdtrain.train.lr import LRSchedule

    schedule = LRSchedule(peak_lr=0.05 * 2, start_lr=0.05, warmup_epochs=1, milestones=(2,))  # as the recipe: 2 ranks
    history = fresh.summary()["history"]
    assert [row["lr"] for row in history] == pytest.approx([schedule.lr_for_step(e, 0, 1) for e in range(3)])
    assert [row["lr"] for row in history] == pytest.approx([0.1, 0.1, 0.01])


def checkpoint_parts(run: Run, epoch: int) -> dict[str, list]:
    """A checkpoint's array parts (model, optimizer, loss_scale) from the file on disk: dtypes and values."""
    path = run.run_dir / "checkpoints" / f"ckpt-epoch{epoch:04d}.pt"
    with np.load(io.BytesIO(checkpoint.verified_payload(path)), allow_pickle=False) as z:
        parts: dict[str, list] = {}
        for name in sorted(n for n in z.files if n != "meta"):
            parts.setdefault(name.split("/")[0], []).append(z[name])
    return parts


@pytest.fixture(scope="module")
def bf16(tmp_path_factory) -> Run:
    tmp = tmp_path_factory.mktemp("keras-bf16")
    return run_recipe(tmp, tmp / "run", *ARGS, "--precision", "bf16", controller="gloo")


def test_bf16_learns_on_cpu_with_identical_fp32_weights(bf16):
    """mixed_bfloat16 on 2 CPU ranks: it learns, the ranks end identical, and the checkpoints hold the float32
    weights (the variables; the layers compute in bf16) that the ranks ended with."""
    summary = bf16.summary()
    assert summary["config"]["precision"] == "bf16" and summary["config"]["flags"]["precision"] == "bf16"
    assert "peak lr 0.1  bf16" in bf16.output
    digests = summary["weights_sha256_by_rank"]
    assert digests[0] == digests[1] == checkpoint_digest(bf16, 2), digests
    assert summary["epochs_completed"] == 2 and summary["val_accuracy"] > 0.7, summary
    parts = checkpoint_parts(bf16, 2)
    assert {w.dtype.name for w in parts["model"]} == {"float32"} and "loss_scale" not in parts


def test_fp16_checkpoints_its_loss_scale_and_resumes_with_it(tmp_path):
    """fp16 runs on CPU (TensorFlow's float16 kernels, slow without AVX-512); the dynamic loss scale and its count
    of finite steps are part of each checkpoint and continue on resume (23 steps an epoch, no overflow here: the
    count goes on from 23 to 46 rather than restarting at 0). Over 30 s: two 2-rank Keras runs of an epoch each, in
    float16 on a CPU without AVX-512."""
    run_dir = tmp_path / "run"
    first = run_recipe(tmp_path, run_dir, *ARGS, "--precision", "fp16", "--stop-after-epoch", "1", controller="gloo")
    assert epoch_lines(first.output) == [1]
    assert [float(v) for v in checkpoint_parts(first, 1)["loss_scale"]] == [2.0 ** 15, 23]
    second = run_recipe(tmp_path, run_dir, *ARGS, "--precision", "fp16", controller="gloo")
    assert re.search(r"resuming from \S+ckpt-epoch0001\.pt \(epoch 1 done\)", second.output), second.output
    assert epoch_lines(second.output) == [2]
    assert [float(v) for v in checkpoint_parts(second, 2)["loss_scale"]] == [2.0 ** 15, 46]
    summary = second.summary()
    assert summary["config"]["precision"] == "fp16" and summary["epochs_completed"] == 2
    assert summary["weights_sha256_by_rank"][0] == summary["weights_sha256_by_rank"][1] == checkpoint_digest(second, 2)
    assert summary["val_accuracy"] > 0.7, summary


def test_tf_keras_behind_the_legacy_switch_stops_mid_epoch_in_fp16_and_resumes(tmp_path):
    """TF_USE_LEGACY_KERAS=1 in the job's environment: the same recipe on tf_keras (Keras 2), fp16 (its loss scale
    outside the optimizer's variables, its metrics built otherwise than Keras 3's): SIGTERM to rank 1 after its 10th
    step, a checkpoint there, resumed to the end with both ranks identical and the loss scale's count going on (a
    checkpoint of the other Keras is refused: tests/train/test_checkpoint.py). Two 2-rank runs in float16 on CPU."""
    run_dir, ckpts, legacy = tmp_path / "run", tmp_path / "run" / "checkpoints", {"TF_USE_LEGACY_KERAS": "1"}
    first = run_recipe(tmp_path, run_dir, *ARGS, "--precision", "fp16", "--sigterm-grace", "60", controller="gloo",
                       exit_code=1, env={**legacy, "HVDTRAIN_TEST_SIGNAL": "1:10:SIGTERM"})
    names = first.checkpoints()
    assert len(names) == 1 and re.fullmatch(r"ckpt-epoch0000-step0000(09|10|11)\.pt", names[0]), first.output
    assert "tf_keras 2." in first.output and epoch_lines(first.output) == []
    second = run_recipe(tmp_path, run_dir, *ARGS, "--precision", "fp16", controller="gloo", env=legacy)
    step = int(names[0][-9:-3])
    assert f"resuming from {ckpts / names[0]} (epoch 0 done, then {step} steps of epoch 1)" in second.output
    summary = second.summary()
    assert summary["keras"].startswith("tf_keras 2.") and set(summary["config"]["versions"]) >= {"tf_keras"}
    assert summary["weights_sha256_by_rank"][0] == summary["weights_sha256_by_rank"][1] == checkpoint_digest(second, 2)
    assert [float(v) for v in checkpoint_parts(second, 2)["loss_scale"]] == [2.0 ** 15, 46]  # 23 steps an epoch
    assert summary["epochs_completed"] == 2 and summary["val_accuracy"] > 0.7, summary


def test_importing_the_recipe_or_asking_for_help_imports_no_tensorflow():
    """The recipe imports TensorFlow inside main(), not at import, and sets no TF_USE_LEGACY_KERAS (the user's)."""
    probe = (f"import os, sys; sys.path.insert(0, {str(RECIPE.parent)!r}); import keras_train; "
             "print('tensorflow' in sys.modules, os.environ.get('TF_USE_LEGACY_KERAS'))")
    env = {k: v for k, v in os.environ.items() if k != "TF_USE_LEGACY_KERAS"}
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, env=env,
                         check=True).stdout.split()
    assert out == ["False", "None"]
    help_text = subprocess.run([sys.executable, str(RECIPE), "--help"], capture_output=True, text=True,
                               timeout=120, env=env, check=True).stdout
    assert "--run-dir" in help_text and "--precision {fp32,bf16,fp16}" in help_text


def test_a_stop_request_at_an_epochs_last_steps_stops_after_its_checkpoint(tmp_path):
    """SIGUSR1 to rank 0 after its 22nd step of 23: the ranks agree at the epoch's last step, which is no place for
    a mid-epoch checkpoint; epoch 1 is validated and checkpointed, then the ranks stop there (exit 75) and name that
    checkpoint to resume from."""
    run_dir = tmp_path / "run"
    first = run_recipe(tmp_path, run_dir, *ARGS, controller="gloo", exit_code=1,
                       env={"HVDTRAIN_TEST_SIGNAL": "0:22:SIGUSR1"})
    codes = re.findall(r"Process \d exit with status code (\d+)", first.output)
    assert "75" in codes and set(codes) <= {"75", "143"}, first.output
    assert first.checkpoints() == ["ckpt-epoch0001.pt"] and epoch_lines(first.output) == [1]
    assert f"asked to stop (SIGUSR1 here): checkpoint {run_dir / 'checkpoints' / 'ckpt-epoch0001.pt'}; run the " \
        "same command again" in first.output, first.output
    assert not (run_dir / "summary.json").exists()
