"""The suite's shape (issue 55): tests/ mirrors the package, a test module never imports another (shared helpers
live in tests/support/ and conftest fixtures), and every test file is collected from a package folder."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
PKG = TESTS.parent / "hvdtrain"


def imported_modules(path: Path) -> set[str]:
    """Every module `path` imports, function-level imports included (`from a import b` counts a and a.b)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def collected_modules() -> list[Path]:
    return sorted(p for p in TESTS.rglob("test_*.py") if "scripts" not in p.relative_to(TESTS).parts)


def test_no_test_module_imports_another() -> None:
    offenders = []
    for path in [*collected_modules(), *TESTS.rglob("conftest.py"), *(TESTS / "support").glob("*.py")]:
        for name in imported_modules(path):
            if name.startswith("tests.") and name.rsplit(".", 1)[-1].startswith("test_"):
                offenders.append(f"{path.relative_to(TESTS.parent)} imports {name}")
    assert not offenders, "move what they share into tests/support/ or a conftest fixture:\n  " + "\n  ".join(offenders)


def test_the_check_above_sees_a_function_level_import(tmp_path: Path) -> None:
    module = tmp_path / "test_x.py"
    module.write_text("def test_y():\n    from tests.job.test_spec import write_spec\n")
    assert "tests.job.test_spec.write_spec" in imported_modules(module)


def test_every_test_module_sits_in_a_folder_that_is_a_package() -> None:
    at_root = [p.name for p in TESTS.glob("test_*.py")]
    assert not at_root, f"test modules at tests/'s top: {at_root}; put each in the folder of what it tests"
    no_init = sorted({str(p.parent.relative_to(TESTS)) for p in collected_modules()
               if not (p.parent / "__init__.py").exists()})
    assert not no_init, f"folders without __init__.py (two test files of one name would collide): {no_init}"


def test_every_subpackage_of_hvdtrain_has_its_test_folder() -> None:
    packages = sorted(p.parent.name for p in PKG.glob("*/__init__.py"))
    missing = [name for name in packages if not list((TESTS / name).glob("test_*.py"))]
    assert not missing, f"hvdtrain packages without a tests/<package>/ folder of tests: {missing}"
