"""recipes/pytorch_train.py run for real with 2 Horovod ranks (tiny epochs), plus its input checks in-process.

Each rank runs under a small wrapper (written to tmp_path) that records, with a Python audit hook, every file
it opens for writing or renames into the run directory: "only rank 0 writes" is checked from what the ranks
did, not from what the recipe says. Final weights are compared through a digest the test recomputes from the
checkpoint on disk.
"""

from __future__ import annotations

import io
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from hvdtrain.formats.arrays import ArrayDataset, DatasetError
from hvdtrain.settings.parse import parse_config
from hvdtrain.settings.recipes import MODEL_CHOICES
from hvdtrain.train import torchkit
from hvdtrain.train.metrics import History, MetricSums, build_summary, combine_stall
from hvdtrain.train.progress import LogLines
from hvdtrain.train.recipe_data import load, load_splits
from tests.support import recipes
from tests.support.harness import horovodrun, run_bounded
from tests.support.recipes import Run, checkpoint_state, epoch_lines, file_digest, history_without_timing

RECIPE = recipes.PYTORCH
# Small and fast, with weight decay so that a wrong broadcast order on resume would show (see broadcast_state).
DIGITS_ARGS = ("--epochs", "3", "--warmup-epochs", "1", "--weight-decay", "1e-3", "--keep-checkpoints", "2",
               "--no-tensorboard", "--lr-milestones", "2")



def run_recipe(tmp: Path, run_dir: Path, *args: str, **kw) -> Run:
    return recipes.run_recipe(RECIPE, tmp, run_dir, *args, **kw)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Run:
    """Under plain horovodrun, as users call it on the recipe."""
    tmp = tmp_path_factory.mktemp("uninterrupted")
    return run_recipe(tmp, tmp / "run", *DIGITS_ARGS, plain=True)


# ---- real 2-rank runs -----------------------------------------------------------------------------------------

@pytest.mark.slow
def test_training_learns_and_ranks_end_with_identical_weights(uninterrupted):
    summary = uninterrupted.summary()
    digests = summary["weights_sha256_by_rank"]
    assert len(digests) == 2 and digests[0] == digests[1], "ranks ended with different weights"
    assert digests[0] == file_digest(checkpoint_state(uninterrupted, 3)["model"]), \
        "the final checkpoint does not hold the weights the ranks ended with"
    assert summary["epochs_completed"] == 3 and summary["world_size"] == 2
    assert summary["val_accuracy"] > 0.85, summary
    assert summary["final_train_loss"] < 1.0 and summary["samples_per_sec"] > 0
    assert summary["resumed_from_epoch"] == 0
    # warmup over epoch 1, then 0.05 × 2 ranks, × 0.1 from milestone 2 (0-based epoch 2) on: as the Keras recipe
    assert [row["lr"] for row in summary["history"]] == pytest.approx([0.1, 0.1, 0.01])
    # the epoch line: the first step's LR → the last's during the warmup (23 steps of 2 × 32 samples), then one value
    assert [row["lr_first"] for row in summary["history"]] == pytest.approx([0.05 + 0.05 / 23, 0.1, 0.01])
    assert re.findall(r"epoch \d+/3  .*  (lr \S+)  ", uninterrupted.output) == ["lr 0.05217→0.1", "lr 0.1", "lr 0.01"]
    assert epoch_lines(uninterrupted.output) == [1, 2, 3]
    config = summary["config"]  # what the run was
    assert config["dataset"] == {"source": "digits", "kind": "digits", "train_samples": 1438, "val_samples": 359,
                                 "sample_shape": [1, 8, 8], "num_classes": 10}
    assert config["model"]["name"] == "cnn" and config["model"]["class"] == "SmallCNN"
    assert config["model"]["parameters"] > 0 and config["model"]["width"] is None
    assert config["batch_size"] == {"per_rank": 32, "backward_passes_per_step": 1, "global": 64}
    assert config["lr"] == {"base": 0.05, "peak": 0.1, "warmup_epochs": 1.0, "milestones": [2], "gamma": 0.1,
                            "momentum": 0.9, "weight_decay": 1e-3}
    assert (config["epochs"], config["precision"], config["seed"]) == (3, "fp32", 42)
    assert config["world"] == {"size": 2, "local_size": 2, "hosts": 1}
    assert set(config["versions"]) == {"hvdtrain", "horovod", "torch", "python"}
    assert config["flags"]["keep_checkpoints"] == 2 and config["flags"]["tensorboard"] is False
    assert f"summary:    {uninterrupted.run_dir / 'summary.json'}" in uninterrupted.output


@pytest.mark.slow
def test_only_rank_0_writes_checkpoints_and_summary_keeping_the_last_k(uninterrupted):
    audit = uninterrupted.audit
    assert sorted(audit) == [0, 1], f"expected an audit log from each rank: {audit}"
    assert audit[1] == [], f"rank 1 wrote into the run directory: {audit[1]}"
    renamed = [Path(p).name for kind, p in audit[0] if kind == "rename"]
    assert renamed == ["ckpt-epoch0001.pt", "ckpt-epoch0002.pt", "ckpt-epoch0003.pt", "summary.json"]
    opened = {Path(p).name.split(".tmp-")[0] for kind, p in audit[0] if kind == "open"}
    # Data only through temp files; besides, rank 0 holds the run directory's lock (its name, pid and start time).
    assert opened == {".ckpt-epoch0001.pt", ".ckpt-epoch0002.pt", ".ckpt-epoch0003.pt", ".summary.json",
                      "hvdtrain.lock"}, "rank 0 wrote something other than through a temp file"
    assert uninterrupted.checkpoints() == ["ckpt-epoch0002.pt", "ckpt-epoch0003.pt"]  # --keep-checkpoints 2


@pytest.mark.slow
def test_stopped_runs_resume_from_the_last_intact_checkpoint_and_match_an_uninterrupted_run(uninterrupted, tmp_path):
    """Over 30 s: three 2-rank runs (stopped after epoch 1, after epoch 2, then resumed past a truncated checkpoint)."""
    run_dir, ckpts = tmp_path / "run", tmp_path / "run" / "checkpoints"
    first = run_recipe(tmp_path, run_dir, *DIGITS_ARGS, "--stop-after-epoch", "1")
    assert "stopping after epoch 1" in first.output
    assert first.checkpoints() == ["ckpt-epoch0001.pt"] and epoch_lines(first.output) == [1]

    # Resume (from epoch 1, not from zero) and stop again after epoch 2.
    second = run_recipe(tmp_path, run_dir, *DIGITS_ARGS, "--stop-after-epoch", "2")
    assert f"resuming from {ckpts / 'ckpt-epoch0001.pt'} (epoch 1 done)" in second.output
    assert epoch_lines(second.output) == [2], "the resumed run did not continue from epoch 2"
    assert second.checkpoints() == ["ckpt-epoch0001.pt", "ckpt-epoch0002.pt"]

    # The newest checkpoint is cut in half (a partial copy): skipped with a warning, epoch 1's is used.
    newest = ckpts / "ckpt-epoch0002.pt"
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])
    third = run_recipe(tmp_path, run_dir, *DIGITS_ARGS)
    assert re.search(rf"WARNING: skipping checkpoint {re.escape(str(newest))}: .*truncated", third.output)
    assert f"resuming from {ckpts / 'ckpt-epoch0001.pt'} (epoch 1 done)" in third.output
    assert epoch_lines(third.output) == [2, 3]

    summary, reference = third.summary(), uninterrupted.summary()
    assert summary["resumed_from_epoch"] == 1 and summary["epochs_completed"] == 3
    assert history_without_timing(summary) == history_without_timing(reference)
    assert summary["weights_sha256_by_rank"] == reference["weights_sha256_by_rank"], \
        "resumed training ended with different weights than the uninterrupted run"


@pytest.mark.slow
def test_a_stop_request_mid_epoch_checkpoints_there_and_resumes_to_the_same_weights(uninterrupted, tmp_path):
    """SIGTERM to rank 1 alone after its 30th step (the 7th of epoch 2, 23 steps an epoch): both ranks stop after
    the same step (the vote rides one step behind), rank 0 checkpoints there with each rank's own state, every rank
    exits 75; the run again resumes at that step and ends exactly as the uninterrupted run."""
    run_dir, ckpts = tmp_path / "run", tmp_path / "run" / "checkpoints"
    first = run_recipe(tmp_path, run_dir, *DIGITS_ARGS, "--sigterm-grace", "60", exit_code=1,  # horovodrun's 1
                       env={"HVDTRAIN_TEST_SIGNAL": "1:30:SIGTERM"})
    # The first rank to exit 75 makes horovodrun SIGTERM the other, which may still be on its way out (143).
    codes = re.findall(r"Process \d exit with status code (\d+)", first.output)
    assert "75" in codes and set(codes) <= {"75", "143"}, first.output
    names = first.checkpoints()
    assert names[0] == "ckpt-epoch0001.pt" and re.fullmatch(r"ckpt-epoch0001-step00000[78]\.pt", names[1]), names
    assert epoch_lines(first.output) == [1]
    assert f"asked to stop (on another rank): checkpoint {ckpts / names[1]}; run the same command again" \
        in first.output, first.output
    assert not (run_dir / "summary.json").exists()
    step = int(names[1][-9:-3])

    second = run_recipe(tmp_path, run_dir, *DIGITS_ARGS)
    assert f"resuming from {ckpts / names[1]} (epoch 1 done, then {step} steps of epoch 2)" in second.output
    assert epoch_lines(second.output) == [2, 3]
    summary, reference = second.summary(), uninterrupted.summary()
    assert history_without_timing(summary) == history_without_timing(reference)
    assert summary["weights_sha256_by_rank"] == reference["weights_sha256_by_rank"], \
        "training resumed mid-epoch ended with different weights than the uninterrupted run"


@pytest.mark.slow
def test_mpi_resnet_on_npz_shards_with_fp16_allreduce_and_accumulation(tmp_path):
    rng = np.random.default_rng(0)
    shards = tmp_path / "shards"
    shards.mkdir()
    for i in range(2):
        np.savez(shards / f"part{i}.npz", x=rng.standard_normal((96, 3, 8, 8)).astype(np.float32),
                 y=rng.integers(0, 4, 96))
    run = run_recipe(tmp_path, tmp_path / "run", "--dataset", str(shards), "--model", "resnet",
                     "--model-width", "8", "--epochs", "2", "--batch-size", "8", "--backward-passes-per-step",
                     "2", "--fp16-allreduce", "--no-tensorboard", "--stall-plot", controller="mpi")
    summary = run.summary()
    assert summary["epochs_completed"] == 2
    plot = run.run_dir / "stall.png"
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"stall plot: {plot}" in run.output
    digests = summary["weights_sha256_by_rank"]
    assert digests[0] == digests[1] == file_digest(checkpoint_state(run, 2)["model"])
    assert run.audit[1] == [] and run.audit[0], run.audit
    assert "ResNet" in run.output and "peak lr 0.2" in run.output  # 0.05 × 2 ranks × 2 backward passes


def test_a_bad_shard_fails_with_a_message_naming_the_file(tmp_path):
    shards = tmp_path / "shards"
    shards.mkdir()
    np.savez(shards / "part0.npz", x=np.zeros((8, 3, 8, 8), np.float32), y=np.zeros(8, np.int64))
    np.savez(shards / "part1.npz", images=np.zeros((8, 3, 8, 8), np.float32), y=np.zeros(8, np.int64))
    # One process without horovodrun (hvd.init() gives size 1): the check runs before any training.
    result = run_bounded([sys.executable, str(RECIPE), "--dataset", str(shards), "--run-dir", str(tmp_path / "r")],
                         timeout=recipes.TIMEOUT_S)
    assert result.returncode == 2, result.describe()
    assert f"pytorch_train.py: error: {shards / 'part1.npz'}: missing array(s) x" in result.output
    assert "Traceback" not in result.output


# ---- in-process: datasets, config, metrics ----------------------------------------------------------------

def test_digits_split_is_fixed_and_disjoint():
    a, b = load("digits"), load("digits")
    assert (len(a.train), len(a.val)) == (1438, 359) and a.sample_shape == (1, 8, 8)
    assert np.array_equal(a.val.y, b.val.y) and np.array_equal(a.train.x, b.train.x)
    assert a.train.x.dtype == np.float32 and a.train.x.min() >= 0.0 and a.train.x.max() <= 1.0
    train_rows = {r.tobytes() for r in a.train.x}
    assert sum(r.tobytes() in train_rows for r in a.val.x) < 20  # digits has a few exact duplicates


def test_synthetic_has_the_requested_shape():
    s = load("synthetic", synthetic_shape=(3, 4, 5), synthetic_samples=40, num_classes=3)
    assert s.train.x.shape == (40, 3, 4, 5) and s.train.y.max() < 3 and len(s.val) == 5


def save_pair(directory: Path, name: str, x: np.ndarray, y: np.ndarray) -> None:
    np.save(directory / f"{name}_x.npy", x)
    np.save(directory / f"{name}_y.npy", y)


def test_npy_pairs_and_train_val_subdirectories(tmp_path):
    for sub, n in (("train", 10), ("val", 4)):
        (tmp_path / sub).mkdir()
        save_pair(tmp_path / sub, "a", np.ones((n, 5), np.float64), np.arange(n) % 3)
    s = load(str(tmp_path))
    assert (len(s.train), len(s.val), s.num_classes, s.sample_shape) == (10, 4, 3, (5,))
    x, y = s.train.take(np.arange(10))
    assert x.dtype == np.float32 and np.array_equal(x, np.ones((10, 5))) and np.array_equal(y, np.arange(10) % 3)


@pytest.mark.parametrize("make,message", [
    (lambda d: save_pair(d, "a", np.ones((4, 2)), np.ones(4)), r"a_y.npy: labels must be a 1-D integer"),
    (lambda d: save_pair(d, "a", np.ones((4, 2)), np.ones(5, int)), r"a_x.npy has 4 samples but .*a_y.npy has 5"),
    (lambda d: (save_pair(d, "a", np.ones((4, 2)), np.ones(4, int)),
                save_pair(d, "b", np.ones((4, 3)), np.ones(4, int))), r"b_x.npy: samples have shape \(3,\)"),
    (lambda d: np.save(d / "data.npy", np.ones(3)), r"data.npy: .npy shards must be named NAME_x.npy"),
    (lambda d: np.save(d / "a_x.npy", np.ones((3, 2))), r"a_x.npy: missing its labels file a_y.npy"),
    (lambda d: np.savez(d / "p.npz", x=np.ones(4), y=np.ones(4, int)), r"p.npz\['x'\]: samples must be"),
    (lambda d: (d / "p.npz").write_bytes(b"not a zip"), r"p.npz: cannot read"),
    (lambda d: None, r"no .npz or NAME_x.npy/NAME_y.npy shards found"),
])
def test_bad_shards_are_reported_naming_the_file(tmp_path, make, message):
    make(tmp_path)
    with pytest.raises(DatasetError, match=message):
        load(str(tmp_path))


def test_an_unknown_dataset_name_says_what_is_allowed(tmp_path):
    with pytest.raises(DatasetError, match=r"'digits', 'synthetic', an MDS dataset root \(a directory or an "
                                           r"s3://.*\) or a directory.*'mnist'"):
        load("mnist")


@pytest.fixture(scope="module")
def recipe_module():
    sys.path.insert(0, str(RECIPE.parent))
    try:
        import pytorch_train
        yield pytorch_train
    finally:
        sys.path.remove(str(RECIPE.parent))


def test_recipe_config_parses_typed_flags(recipe_module):
    cfg = parse_config(recipe_module.Config, ["--epochs", "4", "--lr-milestones", "2,3", "--no-resume",
                                              "--stop-after-epoch", "2", "--synthetic-shape", "1,28,28"])
    assert (cfg.epochs, cfg.lr_milestones, cfg.resume, cfg.stop_after_epoch) == (4, (2, 3), False, 2)
    assert cfg.synthetic_shape == (1, 28, 28) and cfg.threads is None


@pytest.mark.parametrize("argv,message", [
    (["--epochs", "0"], "--epochs must be >= 1, got 0"),
    (["--threads", "0"], "--threads must be >= 1"),
    (["--lr-milestones", "5,3"], "--lr-milestones: milestones must be strictly increasing"),
    (["--base-lr", "-1"], "--base-lr must be a finite number > 0, got -1.0"),
    (["--val-fraction", "1"], "--val-fraction must be in (0, 1), got 1.0"),
])
def test_recipe_config_rejects_bad_values_naming_the_flag(recipe_module, argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_config(recipe_module.Config, argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_recipe_config_rejects_unparsable_values(recipe_module, capsys):
    with pytest.raises(SystemExit):
        parse_config(recipe_module.Config, ["--lr-milestones", "2,x"])
    assert "--lr-milestones: expected comma-separated ints, got '2,x'" in capsys.readouterr().err


@pytest.mark.parametrize("n,size", [(359, 2), (10, 3), (2, 4), (256, 2)])
def test_validation_shards_cover_every_sample_exactly_once(n, size):
    ds = ArrayDataset(np.arange(n, dtype=np.float32)[:, None], np.arange(n))
    seen = [int(y) for rank in range(size)
            for _, ys in torchkit.val_batches(ds, rank, size, 4, torch.device("cpu")) for y in ys]
    assert sorted(seen) == list(range(n))


def test_progress_lines_for_logs_turn_redraws_into_lines():
    out = io.StringIO()
    stream = LogLines(out)
    for text in ("\repoch 1/3:  50%|#####     | 5/10", "\r", "\repoch 1/3: 100%|##########| 10/10\n"):
        stream.write(text)
    assert out.getvalue() == "epoch 1/3:  50%|#####     | 5/10\nepoch 1/3: 100%|##########| 10/10\n"


def test_metrics_are_weighted_by_samples_across_ranks():
    ranks = [MetricSums(), MetricSums()]
    ranks[0].add(mean_loss=1.0, correct=3, count=4)
    ranks[1].add(mean_loss=4.0, correct=0, count=1)  # a short last batch must not count as much
    locals_ = [np.array([m.loss_sum, m.correct, m.count], dtype=np.float64) for m in ranks]
    result = ranks[0].reduce(lambda v: locals_[0] + locals_[1])
    assert result == {"loss": pytest.approx(8.0 / 5), "accuracy": pytest.approx(3 / 5), "samples": 5}


def test_summary_reports_the_data_wait_share():
    h = History()
    h.record(1, train_loss=0.5, val_accuracy=0.9)
    s = build_summary(epochs_completed=1, epochs_total=2, history=h, samples_per_sec=100.0,
                      stall={"mean_wait_s": 0.01, "mean_step_s": 0.04, "wait_share": 0.25})
    assert s["final_train_loss"] == 0.5 and s["val_accuracy"] == 0.9
    assert (s["mean_data_wait_s"], s["mean_step_s"], s["data_wait_share"]) == (0.01, 0.04, 0.25)


def test_stall_statistics_are_averaged_over_ranks():
    per_rank = [{"mean_wait_s": 0.01, "mean_step_s": 0.1, "wait_share": 0.1},
                {"mean_wait_s": 0.03, "mean_step_s": 0.1, "wait_share": 0.3}]
    combined = combine_stall(per_rank)
    assert combined["mean_wait_s"] == pytest.approx(0.02) and combined["wait_share"] == pytest.approx(0.2)
    assert combined["by_rank"] == per_rank
    assert combine_stall([{"mean_wait_s": None}])["wait_share"] is None


def test_exit_with_turns_a_dataset_error_into_exit_2_and_passes_other_codes(capsys):
    from hvdtrain.train.entry import exit_with

    def bad() -> int:
        raise DatasetError("/data/x.npz: missing array(s) x")

    with pytest.raises(SystemExit) as exc:
        exit_with(bad, "/r/recipe.py")
    assert exc.value.code == 2
    assert capsys.readouterr().err == "recipe.py: error: /data/x.npz: missing array(s) x\n"
    with pytest.raises(SystemExit) as exc:
        exit_with(lambda: 0, "/r/recipe.py")
    assert exc.value.code == 0


def test_the_shared_configs_model_choices_are_the_recipes_models(recipe_module):
    from pytorch_models import MODELS

    assert ("auto", *MODELS) == MODEL_CHOICES


@pytest.mark.slow
def test_a_mid_epoch_checkpoint_of_the_elastic_recipe_is_refused_naming_it(recipe_module, tmp_path):
    """The elastic recipe's stop checkpoint holds the epoch's global metric sums, not each rank's own state: this
    recipe stops with exit 2 before training, saying which recipe resumes it."""
    from pytorch_models import make_model

    cfg = parse_config(recipe_module.Config, ["--dataset", "digits"])
    splits = load_splits(cfg)
    model = make_model(torchkit.model_name(cfg, splits), splits.sample_shape, splits.num_classes, cfg.model_width)
    position = {"epoch": 1, "step": 15, "loader": {"epoch": 1, "batches_consumed": 15}, "sums": [1.0, 2.0, 3.0]}
    torchkit.save_checkpoint(cfg, tmp_path / "run" / "checkpoints", 1, model, torchkit.sgd(cfg, model, 0.1),
                             History(), position=position)
    result = horovodrun(RECIPE, "--dataset", "digits", "--run-dir", str(tmp_path / "run"), timeout=recipes.TIMEOUT_S)
    assert result.returncode != 0 and "was written mid-epoch by recipes/pytorch_elastic.py when it was asked to " \
        "stop: resume it with that recipe" in result.output, result.output
    # Every rank meets it after the same broadcast; the first to exit 2 may see horovodrun SIGTERM the other (143).
    codes = re.findall(r"Process \d exit with status code (\d+)", result.output)
    assert "2" in codes and set(codes) <= {"2", "143"}, result.output
