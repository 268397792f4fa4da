"""Issue 37, item 7 (recipes): `--help` shows every flag's default, summary.json records what the run was (its
"config"), and the epoch line shows the LR the epoch trained with (first step's → last step's during the warmup).

In-process and fast: the recipes' parsers, the report helpers, one process. The recipe tests
(tests/recipes/test_pytorch.py, tests/recipes/test_keras.py) check the same on real 2-rank runs.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

from hvdtrain.settings.parse import config_parser, default_text, parse_config, with_default
from hvdtrain.train import recipe_data, report
from hvdtrain.train.lr import LRSchedule
from hvdtrain.train.metrics import History, build_summary, write_summary
from tests.support.harness import REPO

RECIPES = REPO / "recipes"


def load_recipe(name: str) -> ModuleType:
    """recipes/<name>.py as a module (its sibling imports, e.g. pytorch_models, from recipes/)."""
    sys.path.insert(0, str(RECIPES))
    try:
        spec = importlib.util.spec_from_file_location(f"friction_{name}", RECIPES / f"{name}.py")
        module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # dataclasses look it up there
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(RECIPES))
    return module


@pytest.fixture(scope="module")
def recipes() -> dict[str, ModuleType]:
    return {name: load_recipe(name) for name in ("pytorch_train", "keras_train", "pytorch_elastic")}


def help_entries(parser: argparse.ArgumentParser) -> dict[str, str]:
    """Each option's entry in `--help` (its first option string -> the entry's text, whitespace collapsed)."""
    entries: dict[str, list[str]] = {}
    section = None
    for line in parser.format_help().splitlines():
        if line.startswith("  -"):
            section = line.split()[0].rstrip(",")
            entries[section] = [line]
        elif line.startswith("    ") and section is not None:
            entries[section].append(line)
        else:
            section = None
    return {k: " ".join(" ".join(v).split()) for k, v in entries.items()}


# ---- --help: every default ------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["pytorch_train", "keras_train", "pytorch_elastic"])
def test_help_shows_every_flags_default_once_as_typed(recipes, name):
    parser = config_parser(recipes[name].Config)
    entries = help_entries(parser)
    checked = 0
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        entry = entries[action.option_strings[0]]
        assert entry.count("(default: ") == 1, entry  # shown once: no formatter adds a second one
        if action.default is not None and action.default is not False:
            assert f"(default: {default_text(action.default)})" in entry, entry
            checked += 1
        assert not re.search(r"\(default: (None|True|False|\(.*\))\)", entry), f"a Python repr: {entry}"
    assert checked >= 20  # the recipes have that many flags with a default


def test_pytorch_help_reads_as_the_command_line_is_typed(recipes):
    entries = help_entries(config_parser(recipes["pytorch_train"].Config))
    assert entries["--momentum"] == "--momentum MOMENTUM SGD momentum (default: 0.9)"
    assert entries["--seed"].endswith("(default: 42)") and entries["--lr-gamma"].endswith("(default: 0.1)")
    assert entries["--synthetic-shape"].endswith("(default: 3,32,32)")  # as --synthetic-shape takes it
    assert entries["--lr-milestones"].endswith("(default: none)")
    assert entries["--resume"].endswith("(default: on)") and entries["--compile"].endswith("(default: off)")
    assert entries["--threads"].endswith("(none: the cores // local ranks) (default: none)")
    assert entries["--run-dir"].endswith("(default: runs/pytorch)")


def test_default_text_and_a_help_that_places_its_default_itself():
    assert [default_text(v) for v in (None, True, False, (), (3, 8), 0.05, "auto")] == \
        ["none", "on", "off", "none", "3,8", "0.05", "auto"]
    assert with_default("keep %(default)s of them", 3) == "keep %(default)s of them"
    assert with_default("", 7) == "(default: 7)"
    parser = argparse.ArgumentParser()
    parser.add_argument("--share", default="5%", help=with_default("a share", "5%"))
    assert "a share (default: 5%)" in parser.format_help()  # '%' escaped for argparse's formatting


# ---- the epoch line's LR --------------------------------------------------------------------------------------

def test_lr_text_shows_a_change_within_the_epoch_and_one_value_otherwise():
    assert report.lr_text(0.0125, 0.1) == "lr 0.0125→0.1"
    assert report.lr_text(0.1, 0.1) == "lr 0.1"
    assert report.lr_text(0.1, 0.1 * (1 + 1e-9)) == "lr 0.1"  # the same at the precision shown


def test_the_pytorch_epoch_line_shows_the_warmup_then_one_value(capsys):
    from hvdtrain.train import torchkit

    schedule, steps = LRSchedule(peak_lr=0.05 * 2, start_lr=0.05, warmup_epochs=1, milestones=(2,)), 23
    for epoch in range(3):
        row = {"epoch": epoch + 1, "train_loss": 1.0, "train_accuracy": 0.5, "val_loss": 1.0, "val_accuracy": 0.5,
               "lr_first": schedule.lr_for_step(epoch, 0, steps), "lr": schedule.lr_for_step(epoch, steps - 1, steps),
               "samples_per_sec": 100.0, "data_wait_share": 0.0}
        torchkit.report_epoch(row, 3)
    lines = capsys.readouterr().out.splitlines()
    assert "  lr 0.05217→0.1  " in lines[0]  # 0.05 + 0.05 / 23 after the first step, 0.05 × 2 ranks at the end
    assert "  lr 0.1  " in lines[1] and "  lr 0.01  " in lines[2]
    del row["lr_first"]  # a row without it (the elastic recipe's): its LR alone
    torchkit.report_epoch(row, 3)
    assert "  lr 0.01  " in capsys.readouterr().out


# ---- summary.json's config ------------------------------------------------------------------------------------

def test_the_summary_records_the_runs_config(recipes, tmp_path):
    cfg = parse_config(recipes["pytorch_train"].Config,
                       ["--batch-size", "16", "--backward-passes-per-step", "2", "--lr-milestones", "3,5",
                        "--seed", "7", "--precision", "bf16"])
    splits = recipe_data.load("digits")
    config = report.run_config(cfg, splits, model={"name": "cnn", "class": "SmallCNN", "width": None,
                                                   "parameters": 1234},
                               epochs=15, peak_lr=0.4, world={"size": 4, "local_size": 2, "hosts": 2},
                               versions=report.versions(torch="2.x"))
    assert config["dataset"] == {"source": "digits", "kind": "digits", "train_samples": 1438, "val_samples": 359,
                                 "sample_shape": [1, 8, 8], "num_classes": 10}
    assert config["batch_size"] == {"per_rank": 16, "backward_passes_per_step": 2, "global": 128}
    assert config["lr"] == {"base": 0.05, "peak": 0.4, "warmup_epochs": 2.0, "milestones": [3, 5], "gamma": 0.1,
                            "momentum": 0.9, "weight_decay": 0.0}
    assert (config["epochs"], config["precision"], config["seed"]) == (15, "bf16", 7)
    assert config["world"] == {"size": 4, "local_size": 2, "hosts": 2}
    assert list(config["versions"]) == ["hvdtrain", "horovod", "torch", "python"]
    assert config["flags"]["lr_milestones"] == [3, 5] and config["flags"]["run_dir"] == "runs/pytorch"

    summary = build_summary(epochs_completed=1, epochs_total=15, history=History(), samples_per_sec=1.0, stall=None,
                            config=config, extra={"world_size": 4})
    assert list(summary).index("config") < list(summary).index("history")
    assert json.loads(write_summary(tmp_path, summary).read_text())["config"] == config


def test_the_keras_config_has_the_values_it_trains_with(recipes):
    cfg = parse_config(recipes["keras_train"].Config, ["--batch-size", "8"])
    config = report.run_config(cfg, recipe_data.load("digits"), model={}, epochs=10, peak_lr=0.1,
                               world={"size": 2, "local_size": 2, "hosts": 1}, versions={})
    assert config["batch_size"] == {"per_rank": 8, "backward_passes_per_step": 1, "global": 16}
    assert config["precision"] == "fp32" and config["lr"]["weight_decay"] == 0.0
    assert config["flags"]["width"] == 32


def test_the_dataset_kind_and_a_local_source_made_absolute(tmp_path, monkeypatch):
    shards, mds = tmp_path / "shards", tmp_path / "mds"
    shards.mkdir()
    np.savez(shards / "a.npz", x=np.zeros((4, 2), np.float32), y=np.arange(4) % 2)
    (mds / "train").mkdir(parents=True)
    (mds / "train" / "index.json").write_text("{}")
    assert [report.dataset_kind(s) for s in ("digits", "synthetic", str(shards), str(mds), "s3://bucket/data")] == \
        ["digits", "synthetic", "shards", "mds", "mds"]
    monkeypatch.chdir(tmp_path)
    info = report.dataset_info("shards", recipe_data.load("shards", val_fraction=0.5))
    assert info["source"] == str(shards) and info["kind"] == "shards" and info["train_samples"] == 2
    assert Path(info["source"]).is_absolute()
