"""A shipped recipe's settings in a job spec (hvdtrain/job/recipe.py): `recipe:` typed, `args:` read by the
recipe's own parser, both refused before any process starts with the spec's line, the entry and the fix; read once
(`settings_of`) by the run-directory check, the render and the plan."""

from __future__ import annotations

import shutil

import pytest
import yaml

from hvdtrain.job.load import SpecError, load_spec
from hvdtrain.job.plan import build_plan
from hvdtrain.job.recipe import recipe_class, settings_of
from hvdtrain.settings.recipes import SHIPPED, PytorchTrainConfig
from tests.support.harness import BIN, REPO, run_bounded

RECIPE = REPO / "recipes" / "pytorch_train.py"


def load(body: str, script=RECIPE, **kwargs):
    return load_spec(f"script: {script}\nnp: 2\n{body}", "job.yaml", base_dir=str(REPO / "jobs"), **kwargs)


def refusal(body: str, script=RECIPE, **kwargs) -> list[str]:
    with pytest.raises(SpecError) as info:
        load(body, script, **kwargs)
    return str(info.value).splitlines()[1:]


def test_a_typo_in_args_is_refused_with_the_line_the_entry_and_did_you_mean():
    assert refusal("args: [--dataset, digits,\n       --epcohs, '1']\n") == [
        "job.yaml:4: args[2]: pytorch_train.py refuses it: unrecognized arguments: --epcohs 1",
        "  got: '--epcohs'",
        "  fix: did you mean --epochs? `python recipes/pytorch_train.py --help` lists its flags"]
    assert refusal("args: [--batch-size, '0']\n")[0] == (
        "job.yaml:3: args[0]: pytorch_train.py refuses it: --batch-size must be >= 1, got 0")


def test_recipe_settings_are_typed_and_unknown_ones_refused_with_the_list():
    lines = refusal("recipe:\n  epcohs: 2\n  resume: 'no'\n")
    assert lines[0] == "job.yaml:4: recipe.epcohs: pytorch_train.py has no setting 'epcohs'"
    assert lines[2].startswith("  allowed: settings: augment, backward_passes_per_step, base_lr, batch_size")
    assert lines[3] == "  fix: rename it to 'epochs'"
    assert lines[4:6] == ["job.yaml:5: recipe.resume: expected true or false (the recipe's --resume)", "  got: 'no'"]
    assert refusal("recipe: {epochs: 0}\n")[0] == (
        "job.yaml:3: recipe.epochs: pytorch_train.py refuses it: --epochs must be >= 1, got 0")
    assert refusal("recipe: {model: vit}\n")[0].startswith(
        "job.yaml:3: recipe.model: pytorch_train.py refuses it: argument --model: invalid choice: 'vit'")
    assert refusal("recipe: {epochs: 2}\nargs: [--dataset, digits, --epochs, '3']\n")[:3] == [
        "job.yaml:4: args[2]: --epochs is set twice: here and by recipe.epochs", "  got: '--epochs'",
        "  fix: keep one: remove it from args, or remove recipe.epochs"]
    # args come after the recipe's flags: a flag in both is refused, before any value is judged.
    assert refusal("recipe: {epochs: 8}\nargs: [--epochs, '0']\n")[0] == (
        "job.yaml:4: args[0]: --epochs is set twice: here and by recipe.epochs")
    assert refusal("recipe: {model_width: 8}\nargs: [--model-width, '16', --model, cnn]\n")[0] == (
        "job.yaml:4: args[0]: --model-width is set twice: here and by recipe.model_width")  # not --model's entry
    assert refusal("args: [--epochs, '3', '3']\n")[0] == (
        "job.yaml:3: args[2]: pytorch_train.py refuses it: unrecognized argument: 3")
    assert refusal("args: []\n", overrides=["recipe.epochs=two"])[0] == (
        "override -o recipe.epochs=two: recipe.epochs: expected an integer (the recipe's --epochs)")


def test_the_plan_passes_recipe_settings_as_flags_before_args_and_settings_of_reads_them():
    spec = load("recipe: {epochs: 2, resume: false, lr_milestones: [1]}\nargs: [--run, my-run]\n")
    assert build_plan(spec, controller="gloo").argv[-7:] == [
        "--epochs", "2", "--no-resume", "--lr-milestones", "1", "--run", "my-run"]
    settings = settings_of(spec)
    assert isinstance(settings, PytorchTrainConfig)
    assert (settings.epochs, settings.resume, settings.run_dir, settings.batch_size) == (2, False, "my-run", 32)
    assert settings_of(load("args: [--run-dir, a, --run-dir=c]\n")).run_dir == "c"  # the last one, as argparse
    assert settings_of(load("")).run_dir == "runs/pytorch"  # the recipe's default is read too


def test_other_scripts_keep_free_args_and_cannot_take_recipe(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("")
    assert load("args: [--anything, goes]\n", script).script_args == ["--anything", "goes"]
    assert settings_of(load("", script)) is None
    assert refusal("recipe: {epochs: 2}\n", script)[0] == (
        "job.yaml:3: recipe: recipe: sets a shipped recipe's settings, and train.py is not a shipped recipe "
        "(keras_train.py, pytorch_elastic.py, pytorch_train.py)")
    # A changed copy of a shipped recipe is the user's own script: its flags are its own.
    mine = tmp_path / "pytorch_train.py"
    mine.write_text(RECIPE.read_text() + "# mine\n")
    assert recipe_class(str(mine)) is None and load("args: [--my-flag, '1']\n", mine).args == ["--my-flag", "1"]
    assert "(not the same file: your own copy)" in refusal("recipe: {epochs: 2}\n", mine)[0]
    same = tmp_path / "copy" / "pytorch_train.py"
    same.parent.mkdir()
    shutil.copy(RECIPE, same)
    assert recipe_class(str(same)) is PytorchTrainConfig  # the same bytes: checked
    assert recipe_class("/opt/hvdtrain/recipes/pytorch_train.py") is PytorchTrainConfig  # not here: by name


def test_without_a_checkout_a_local_file_of_a_recipes_name_is_the_users(tmp_path, monkeypatch):
    """An installed hvdtrain has no recipes/ to compare with: a file here named like a recipe may be anything, so
    its args are its own (a path that is not here, such as the image's, is still taken by name)."""
    monkeypatch.setattr("hvdtrain.job.recipe.checkout", lambda: None)
    same = tmp_path / "pytorch_train.py"
    shutil.copy(RECIPE, same)
    assert recipe_class(str(same)) is None and recipe_class("/opt/hvdtrain/recipes/pytorch_train.py") is not None
    assert load("args: [--anything]\n", same).args == ["--anything"]


def test_the_shipped_jobs_set_their_recipes_settings_with_recipe():
    for path in sorted((REPO / "jobs").glob("*.yaml")):
        data = yaml.safe_load(path.read_text())
        if (REPO / "jobs" / data["script"]).name in SHIPPED:
            assert data.get("recipe") and not data.get("args"), path.name


def test_validate_refuses_a_typo_in_a_recipe_argument_with_exit_2(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text(f"script: {RECIPE}\nnp: 2\nargs: [--epcohs, '1']\n")
    res = run_bounded([str(BIN / "hvdtrain"), "validate", str(job)], timeout=60)
    assert res.returncode == 2, res.describe()
    assert f"{job}:3: args[0]: pytorch_train.py refuses it: unrecognized arguments: --epcohs 1" in res.output
    assert "did you mean --epochs?" in res.output and "Traceback" not in res.output
