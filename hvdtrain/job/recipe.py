"""A shipped recipe's settings in a job spec, read once: its `recipe:` mapping and its `args:` checked with the
recipe's own definition (hvdtrain.settings.recipes, the parser its script uses) before any process starts.

NOTE [one reader of recipe settings]: `settings_of(spec)` is the only parse of a shipped recipe's arguments on the
launcher's side: the run-directory check of `hvdtrain run` (--run-dir), `render k8s` (--run-dir, --sigterm-grace,
--dataset) and the /dev/shm size (--batch-size, --num-workers, ...) read its typed fields, defaults included. A
script is a shipped recipe when its file name is one (`SHIPPED`) and, where the file is on this machine, it has the
same bytes as this checkout's recipes/ copy (decided when the spec loads: `decide`): any other is the user's own, whose
flags hvdtrain cannot know (its args go through unchecked; `recipe:` is refused for it). Nothing here imports a
framework or starts a process.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from hvdtrain.job.model import JobSpec
from hvdtrain.settings.parse import ArgsError, check_args, given_settings, option_strings, setting_problem, token_for
from hvdtrain.settings.recipes import SHIPPED, RecipeConfig

CHECKOUT = Path(__file__).resolve().parents[2]  # this hvdtrain's checkout: what docker/Dockerfile copies


def checkout() -> Path | None:
    """This checkout, where it is one (an installed wheel has no recipes/ beside it)."""
    return CHECKOUT if (CHECKOUT / "recipes").is_dir() and (CHECKOUT / "docker" / "Dockerfile").is_file() else None


def same_as_shipped(local: Path) -> bool:
    """Whether the file `local` is one of this checkout's recipes: the same name and bytes."""
    root = checkout()
    shipped = root / "recipes" / local.name if root is not None else None
    try:
        return shipped is not None and shipped.is_file() and shipped.read_bytes() == local.read_bytes()
    except OSError:
        return False


def recipe_class(script: str, here: Path | None = None) -> type[RecipeConfig] | None:
    """The settings of the shipped recipe `script` is, or None for any other script (NOTE [one reader of recipe
    settings]): by name where its file (`here`: where this machine has it; default the path itself) is not here (a
    path in an image, on another host); by name and bytes where it is (an installed hvdtrain without its checkout
    has nothing to compare with: a file here is then the user's own)."""
    cls = SHIPPED.get(PurePosixPath(script).name)
    local = here if here is not None else Path(script)
    if cls is None or not local.is_file():
        return cls
    return cls if same_as_shipped(local) else None  # without a checkout to compare with: a script of the user's


def decide(spec: JobSpec, here: Path | None = None) -> JobSpec:
    """The spec, knowing which shipped recipe its script is (`recipe_class`, from the file `here` on this machine):
    kept through later copies (a render maps the script to the image's path, where the file is not here)."""
    cls = recipe_class(spec.script, here)
    decided = spec.model_copy()
    decided._shipped_as = cls.script if cls is not None else ""
    return decided


def shipped_settings(spec: JobSpec) -> type[RecipeConfig] | None:
    """The settings class of the shipped recipe the spec's script is (as `decide` found at load), or None."""
    if spec._shipped_as is None:
        return recipe_class(spec.script)
    return SHIPPED.get(spec._shipped_as)


def settings_of(spec: JobSpec) -> RecipeConfig | None:
    """A shipped recipe's settings as its ranks will parse them (`recipe:` then `args:`, defaults for the rest);
    None for another script. Raises ArgsError for a spec `problems` would refuse (a loaded spec never is)."""
    cls = shipped_settings(spec)
    return None if cls is None else check_args(cls, spec.script_args)


@dataclass(frozen=True)
class Refusal:
    """One problem with a spec's recipe settings (hvdtrain.job.load makes it an Issue)."""

    path: tuple[str | int, ...]
    problem: str
    value: Any
    allowed: str = ""
    fix: str = ""


def problems(spec: JobSpec) -> list[Refusal]:
    """What the script would refuse in `recipe:` and `args:` (exit 2 after every rank started), found now."""
    cls = shipped_settings(spec)
    if cls is None:
        return [_not_shipped(spec.script)] if spec.recipe else []
    found = [r for key, value in spec.recipe.items() if (r := _setting_refusal(cls, key, value)) is not None]
    found = found or _set_twice(cls, spec)
    if found:
        return found
    try:
        check_args(cls, spec.script_args)
    except ArgsError as exc:
        return [_locate(cls, spec, exc)]
    return []


def _set_twice(cls: type[RecipeConfig], spec: JobSpec) -> list[Refusal]:
    """A setting in `recipe:` that `args` sets again (where args parse: else check_args says what is wrong)."""
    if not spec.recipe:
        return []
    try:
        given = given_settings(cls, spec.args)
    except (ArgsError, argparse.ArgumentError):
        return []
    every = {o for opts in option_strings(cls).values() for o in opts}
    refusals = []
    for name, options in sorted(given.items()):
        index = token_for(spec.args, options, every)
        if name in spec.recipe and index is not None:
            refusals.append(Refusal(("args", index), f"{options[0]} is set twice: here and by recipe.{name}",
                                    spec.args[index], fix=f"keep one: remove it from args, or remove recipe.{name}"))
    return refusals


def _not_shipped(script: str) -> Refusal:
    name = PurePosixPath(script).name
    why = (f"{script} is not hvdtrain's recipes/{name} (not the same file: your own copy), so hvdtrain cannot know "
           "its flags" if name in SHIPPED else f"{name} is not a shipped recipe ({', '.join(sorted(SHIPPED))})")
    return Refusal(("recipe",), f"recipe: sets a shipped recipe's settings, and {why}", script,
                   fix="give the script's flags in args: as a list of strings, e.g. args: [--epochs, '2']")


def _setting_refusal(cls: type[RecipeConfig], key: str, value: Any) -> Refusal | None:
    names = sorted(f.name for f in dataclasses.fields(cls))
    if key not in names:
        guess = difflib.get_close_matches(key.replace("-", "_"), names, n=1, cutoff=0.6)
        return Refusal(("recipe", key), f"{cls.script} has no setting {key!r}", value,
                       "settings: " + ", ".join(names),
                       f"rename it to {guess[0]!r}" if guess else f"remove {key!r}")
    problem = setting_problem(cls, key, value)
    if problem is None:
        return None
    return Refusal(("recipe", key), f"{problem} (the recipe's --{key.replace('_', '-')})", value,
                   fix="write the value as its type, unquoted: 2, 0.1, true, [10, 20], null")


def _locate(cls: type[RecipeConfig], spec: JobSpec, exc: ArgsError) -> Refusal:
    """The spec entry the recipe's parser refused: the `args` element, or the `recipe` key, it came from (args
    first: they come after the recipe's flags, and argparse keeps the last value)."""
    problem, help_fix = f"{cls.script} refuses it: {exc}", f"`python recipes/{cls.script} --help` lists its flags"
    if exc.token is not None:  # an unknown flag or a stray value: recipe keys were checked already, so it is in args
        index = len(spec.args) - 1 - spec.args[::-1].index(exc.token) if exc.token in spec.args else None
        fix = (f"did you mean {exc.guess}? " if exc.guess else "remove it; ") + help_fix
        return Refusal(("args",) if index is None else ("args", index), problem, exc.token, fix=fix)
    options = option_strings(cls)
    every = {o for opts in options.values() for o in opts}
    dest = next((d for d, opts in options.items() if exc.flag and exc.flag.split("/")[0] in opts), None)
    index = token_for(spec.args, options[dest], every) if dest is not None else _mentioned(spec.args, str(exc))
    if index is not None:
        return Refusal(("args", index), problem, spec.args[index], fix=f"change it; {help_fix}")
    if dest is not None and dest in spec.recipe:
        return Refusal(("recipe", dest), problem, spec.recipe[dest], fix=f"change recipe.{dest}; {help_fix}")
    return Refusal(("args",) if spec.args else ("recipe",), problem, spec.args or spec.recipe, fix=help_fix)


def _mentioned(args: list[str], message: str) -> int | None:
    """The last flag of `args` that the parser's message quotes (an ambiguous abbreviation), or None."""
    quoted = set(re.findall(r"-[\w-]+", message))
    return next((i for i in range(len(args) - 1, -1, -1) if args[i].split("=", 1)[0] in quoted), None)

