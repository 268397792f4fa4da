"""The one definition of the recipes' settings (hvdtrain/settings/): the parser the recipes use, checked without
exiting (`check_args`) for the launcher, the typed `recipe:` mapping turned into the same argv, and a guard that no
second parser of recipe arguments appears. In-process, no frameworks imported."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from hvdtrain.settings.parse import (
    ArgsError,
    check_args,
    config_parser,
    given_settings,
    option_strings,
    parse_config,
    setting_argv,
    setting_problem,
    token_for,
)
from hvdtrain.settings.recipes import SHIPPED, KerasTrainConfig, PytorchElasticConfig, PytorchTrainConfig
from tests.support.harness import REPO


def test_a_typed_mapping_becomes_the_argv_the_recipe_parses_to_the_same_values():
    settings = {"epochs": 2, "resume": False, "progress": True, "lr_milestones": [3, 5], "threads": None,
                "base_lr": 0.1, "shuffle_block": 2, "synthetic_shape": [1, 8, 8]}
    argv = setting_argv(settings)
    assert argv == ["--epochs", "2", "--no-resume", "--progress", "--lr-milestones", "3,5", "--threads", "none",
                    "--base-lr", "0.1", "--shuffle-block", "2", "--synthetic-shape", "1,8,8"]
    cfg = check_args(PytorchTrainConfig, argv)
    assert (cfg.epochs, cfg.resume, cfg.lr_milestones, cfg.threads, cfg.base_lr, cfg.shuffle_block,
            cfg.synthetic_shape) == (2, False, (3, 5), None, 0.1, "2", (1, 8, 8))
    assert cfg == parse_config(PytorchTrainConfig, argv)  # the recipe's own parse: the same values


@pytest.mark.parametrize(("argv", "message", "flag", "token", "guess"), [
    (["--epcohs", "1"], "unrecognized arguments: --epcohs 1", None, "--epcohs", "--epochs"),
    (["--epochs", "2", "--run_dir", "x"], "unrecognized arguments: --run_dir x", None, "--run_dir", "--run-dir"),
    (["-h"], "unrecognized argument: -h", None, "-h", None),
    (["--b", "64"], "ambiguous option: --b could match --batch-size, --base-lr", None, None, None),
    (["--batch-size", "many"], "--batch-size: expected int, got 'many'", "--batch-size", None, None),
    (["--batch-size", "0"], "--batch-size must be >= 1, got 0", "--batch-size", None, None),
    (["--model", "vit"], "invalid choice: 'vit'", "--model", None, None),
    (["--epochs"], "expected one argument", "--epochs", None, None),
    (["--lr-milestones", "5,3"], "--lr-milestones: milestones must be strictly increasing", "--lr-milestones", None,
     None),
    (["--lr-gamma", "2"], "--lr-gamma: gamma must be a number in (0, 1]", "--lr-gamma", None, None),
    (["--epochs", "3", "3"], "unrecognized argument: 3", None, "3", None),
])
def test_check_args_refuses_what_the_recipe_would_exit_2_on_naming_the_flag(argv, message, flag, token, guess,
                                                                            capsys):
    with pytest.raises(ArgsError) as info:
        check_args(PytorchTrainConfig, argv)
    assert message in str(info.value)
    assert (info.value.flag, info.value.token, info.value.guess) == (flag, token, guess)
    assert capsys.readouterr() == ("", "")  # nothing printed, nothing exited
    with pytest.raises(SystemExit) as exited:  # ... where the recipe itself exits 2
        parse_config(PytorchTrainConfig, argv)
    assert exited.value.code == 2 or argv == ["-h"]


def test_each_recipe_keeps_its_own_rules_and_defaults():
    assert check_args(PytorchTrainConfig, []).run_dir == "runs/pytorch"
    assert check_args(PytorchElasticConfig, []).run_dir == "runs/elastic"
    assert (check_args(KerasTrainConfig, []).run_dir, KerasTrainConfig.accumulates) == ("runs/keras", False)
    with pytest.raises(ArgsError, match="--precision fp16 is not supported by the elastic recipe"):
        check_args(PytorchElasticConfig, ["--precision", "fp16"])
    with pytest.raises(ArgsError, match="unrecognized arguments: --commit-every"):
        check_args(PytorchTrainConfig, ["--commit-every", "5"])
    assert check_args(KerasTrainConfig, ["--verbose", "0"]).verbose == 0


@pytest.mark.parametrize(("name", "value", "problem"), [
    ("epochs", 2, None), ("epochs", "2", "expected an integer"), ("epochs", True, "expected an integer"),
    ("resume", "no", "expected true or false"), ("resume", 1, "expected true or false"), ("base_lr", 1, None),
    ("lr_milestones", [1, 2], None), ("lr_milestones", 5, "expected a list of ints, e.g. [10, 20]"),
    ("threads", None, None), ("epochs", None, "is null; a value is required here"), ("run_dir", 2024, None),
    ("dataset", ["a"], "expected a string"),
])
def test_setting_types_are_checked_as_yaml_gives_them(name, value, problem):
    assert setting_problem(PytorchTrainConfig, name, value) == problem


def test_given_settings_and_token_for_find_what_args_set_and_where():
    args = ["--dataset", "digits", "--run", "a", "--no-resume", "--epochs=3", "--model", "cnn", "--model-w", "8"]
    given = given_settings(PytorchTrainConfig, args)
    assert sorted(given) == ["dataset", "epochs", "model", "model_width", "resume", "run_dir"]
    every = {o for opts in option_strings(PytorchTrainConfig).values() for o in opts}
    assert [token_for(args, given[name], every) for name in ("dataset", "run_dir", "resume", "epochs", "model",
                                                              "model_width")] == [0, 2, 4, 5, 6, 8]
    assert token_for(["--model", "cnn"], given["model_width"], every) is None  # --model is an option of its own
    assert token_for(["--b", "4"], given.get("batch_size", ("--batch-size",)), every) is None  # ambiguous


def test_values_that_look_like_flags_or_yaml_text_numbers_reach_the_recipe():
    argv = setting_argv({"dataset": "-odd-name", "base_lr": "1e-5", "lr_milestones": [2]})
    assert argv == ["--dataset=-odd-name", "--base-lr", "1e-5", "--lr-milestones", "2"]
    cfg = check_args(PytorchTrainConfig, argv)
    assert (cfg.dataset, cfg.base_lr) == ("-odd-name", 1e-5)
    assert setting_problem(PytorchTrainConfig, "base_lr", "1e-5") is None  # YAML 1.1 reads 1e-5 as text
    assert setting_problem(PytorchTrainConfig, "base_lr", "fast") == "expected a number"


# ---- one definition, one parser -------------------------------------------------------------------------------

RECIPE_FLAGS = {o for cls in SHIPPED.values() for a in config_parser(cls)._actions for o in a.option_strings
                if o.startswith("--") and o != "--help"}
PARSER_CALLS = {"ArgumentParser", "parse_args", "parse_known_args", "parse_intermixed_args"}
OWN_CLI = {"hvdtrain/cli.py", "hvdtrain/launch/cmd_run.py", "hvdtrain/render/cmd_render.py",
           "hvdtrain/launch/hvdrun.py"}


def parser_uses(path: Path) -> list[str]:
    """What in `path` parses arguments: argparse calls, or a recipe's flag compared by its exact text (`arg ==
    "--run-dir"`, `"--run-dir" in args`, `args.index("--run-dir")`, `arg.startswith("--run-dir=")`): a hand-rolled
    reader. Flags in messages and in add_argument() are no parser."""
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            name = getattr(node.func, "attr", None) or getattr(node.func, "id", None)
            if name in PARSER_CALLS:
                found.append(f"{name}() on line {node.lineno}")
            operands = node.args if name in ("index", "startswith", "count", "removeprefix") else []
        elif isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
        else:
            continue
        found += [f"{o.value!r} on line {o.lineno}" for o in operands if isinstance(o, ast.Constant)
                  and isinstance(o.value, str) and o.value.split("=", 1)[0] in RECIPE_FLAGS]
    return found


def test_no_second_parser_of_recipe_arguments():
    """The recipes' arguments are parsed by hvdtrain/settings/parse.py alone: on the ranks (parse_config) and on
    the launcher (check_args, via hvdtrain/job/recipe.py). Anything else in the package or the recipes that calls
    argparse, or compares a recipe flag's exact text, is a second parser to be folded into that one (hvdtrain's own
    CLI modules are exempt for argparse, not for recipe flags)."""
    offenders = {}
    for path in sorted([*(REPO / "hvdtrain").rglob("*.py"), *(REPO / "recipes").glob("*.py")]):
        rel = str(path.relative_to(REPO))
        if rel == "hvdtrain/settings/parse.py":
            continue
        uses = [u for u in parser_uses(path) if not (rel in OWN_CLI and "()" in u)]
        if uses:
            offenders[rel] = uses
    assert offenders == {}


def test_the_guard_sees_a_hand_rolled_reader(tmp_path):
    source = tmp_path / "side.py"
    source.write_text('def run_dir(args):\n    return args[args.index("--run-dir") + 1]\n'
                      'import argparse\nargparse.ArgumentParser().add_argument("--dataset")\n'
                      'found = [a for a in ARGS if a.startswith("--epochs=") or a == "--seed"]\n'
                      'print("--run-dir is where checkpoints go")\n')
    assert sorted(parser_uses(source)) == ["'--epochs=' on line 5", "'--run-dir' on line 2", "'--seed' on line 5",
                                           "ArgumentParser() on line 4"]


def test_each_shipped_recipe_takes_its_settings_class():
    for name, cls in SHIPPED.items():
        tree = ast.parse((REPO / "recipes" / name).read_text())
        imported = {(a.name, a.asname) for n in tree.body if isinstance(n, ast.ImportFrom)
                    and n.module == "hvdtrain.settings.recipes" for a in n.names}
        assert (cls.__name__, "Config") in imported, name
        assert not [n.name for n in tree.body if isinstance(n, ast.ClassDef) and dataclasses.is_dataclass(cls)
                    and n.name == "Config"], f"{name} defines its own Config"
