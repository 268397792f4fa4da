"""The benches that drive a recipe's own functions (bench/gpu_feed.py, step_overhead.py, recipe_vs_synthetic.py:
`import pytorch_train as recipe`) call them as they are now: every `recipe.NAME` they use exists, and every call
`recipe.NAME(...)` binds to its signature. They run only in the GPU check (scripts/gpu_steps.sh), so a recipe
refactor would otherwise break them unseen. Read from the source (ast); the recipe is imported, nothing runs."""

from __future__ import annotations

import ast
import inspect
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def recipe_uses(source: str) -> list[tuple[str, ast.Call | None]]:
    """(name, the call or None) for every `<alias>.name` of a module imported as `import pytorch_train as alias`."""
    tree = ast.parse(source)
    aliases = {a.asname or a.name for node in ast.walk(tree) if isinstance(node, ast.Import)
               for a in node.names if a.name == "pytorch_train"}
    calls = {id(node.func): node for node in ast.walk(tree) if isinstance(node, ast.Call)}
    return [(node.attr, calls.get(id(node))) for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases]


def binding_problem(obj: object, call: ast.Call) -> str | None:
    """Why `call`'s arguments (counted, not evaluated) do not fit `obj`'s signature; None when they do."""
    if any(isinstance(a, ast.Starred) for a in call.args) or any(k.arg is None for k in call.keywords):
        return None  # *args or **kwargs: not countable here
    try:
        inspect.signature(obj).bind(*[None] * len(call.args), **{k.arg: None for k in call.keywords if k.arg})
    except TypeError as exc:
        return str(exc)
    return None


@pytest.fixture(scope="module")
def recipe_module():
    sys.path.insert(0, str(REPO / "recipes"))
    try:
        import pytorch_train
        yield pytorch_train
    finally:
        sys.path.remove(str(REPO / "recipes"))


def test_the_benches_call_the_recipe_as_it_is(recipe_module):
    problems, seen = [], 0
    for path in sorted((REPO / "bench").glob("*.py")):
        for name, call in recipe_uses(path.read_text()):
            seen += 1
            if not hasattr(recipe_module, name):
                problems.append(f"{path.name}: recipe.{name} does not exist")
            elif call is not None and (why := binding_problem(getattr(recipe_module, name), call)):
                problems.append(f"{path.name}:{call.lineno}: recipe.{name}(...): {why}")
    assert seen > 10, "no bench uses the recipe any more: this test has nothing to check"
    assert not problems, problems


def test_the_check_sees_a_missing_name_and_a_wrong_call():
    def train_epoch(run, epoch, sums, start):  # the recipe's shape
        return None

    uses = recipe_uses("import pytorch_train as recipe\nrecipe.lr_schedule(cfg, 1.0)\n"
                       "recipe.train_epoch(cfg, 0, 9, net, opt, sched, loader, m, p, sums, 0, vote)\n")
    assert [name for name, _ in uses] == ["lr_schedule", "train_epoch"]
    call = uses[1][1]
    assert call is not None and "too many positional arguments" in (binding_problem(train_epoch, call) or "")
    ok = recipe_uses("import pytorch_train as r\nr.train_epoch(run, 0, sums, 0)\n")[0][1]
    assert ok is not None and binding_problem(train_epoch, ok) is None
