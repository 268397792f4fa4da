"""The package's layers, checked: no import circles between modules and no import from a lower layer to a higher one.

Imports are read from the source (ast), function-level and `if TYPE_CHECKING:` imports included: a circle hidden in
a function is still a circle. The layers (docs: docs/layout.md, which must name every module):

    both sides:     shared leaves < settings (the recipes' settings and the loader sizes the launcher reads)
    launcher side:  settings < job < doctor < launch;  job < render
    rank side:      settings < data < formats < stream < train
    entry points (cli, rank, rank_main) may import anything; nothing imports them.

A new module must be placed in this table (the test fails for an unplaced one), so the layering is a decision.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[2] / "hvdtrain"

LEAVES = {"hvdtrain", "hvdtrain.atomic", "hvdtrain.exitcodes", "hvdtrain.records", "hvdtrain.rundir",
          "hvdtrain.textfile", "hvdtrain.tfkeras"}
ENTRIES = {"hvdtrain.cli", "hvdtrain.rank", "hvdtrain.rank_main"}
# package -> the packages it may import (besides itself and the shared leaves)
BELOW = {
    "settings": set(),
    "job": {"settings"},
    "doctor": {"job", "settings"},
    "launch": {"job", "doctor", "settings"},
    "render": {"job", "settings"},
    "data": {"settings"},
    "formats": {"data", "settings"},
    "stream": {"data", "formats", "settings"},
    "train": {"data", "formats", "stream", "settings"},
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def imports_of(name: str) -> set[str]:
    """The package's modules that `name` imports anywhere in its source (`from pkg import mod` counts as mod;
    `from pkg import name` as pkg/__init__)."""
    path = MODULES[name]
    pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = pkg.split(".")[: len(pkg.split(".")) - (node.level - 1)]
                base = ".".join(up + ([node.module] if node.module else []))
            found |= {f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names}
    return {m for m in found if m in MODULES and m != name}


GRAPH = {name: imports_of(name) for name in MODULES}


def layer(name: str) -> str:
    """'leaf', 'entry' or the subpackage's name; '?' for a module placed nowhere."""
    if name in LEAVES:
        return "leaf"
    if name in ENTRIES:
        return "entry"
    parts = name.split(".")
    return parts[1] if len(parts) >= 2 and parts[1] in BELOW else "?"


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of two or more modules (Tarjan), iteratively."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    x = stack.pop()
                    on.discard(x)
                    comp.append(x)
                    if x == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def test_every_module_has_a_place_in_the_layers():
    unplaced = sorted(m for m in MODULES if layer(m) == "?")
    assert not unplaced, f"place these modules in LEAVES, ENTRIES or a package of BELOW: {unplaced}"


def test_no_import_circles():
    assert circles(GRAPH) == []


def test_no_import_goes_up_a_layer():
    wrong = []
    for name, targets in GRAPH.items():
        here = layer(name)
        if here == "entry":
            continue
        allowed = {"leaf", here} | BELOW.get(here, set())
        wrong += [f"{name} imports {t}" for t in sorted(targets) if layer(t) not in allowed]
    assert not wrong, "imports against the layers (see this module's docstring):\n" + "\n".join(wrong)


@pytest.mark.parametrize("graph, expected", [
    ({"a": {"b"}, "b": {"a"}, "c": set()}, [["a", "b"]]),
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}, [["a", "b", "c"]]),
    ({"a": {"b"}, "b": set()}, []),
])
def test_the_circle_finder_finds_circles(graph, expected):
    assert circles(graph) == expected


def test_the_import_reader_sees_function_level_and_type_checking_imports():
    assert "hvdtrain.stream.store" in GRAPH["hvdtrain.train.recipe_data"]  # imported inside load()
    assert "hvdtrain.doctor.probe" in GRAPH["hvdtrain.launch.preflight"]  # `from hvdtrain.doctor import probe`


def package_doc_problems(package: Path) -> list[str]:
    """A package's docstring names each of its modules as `name`, and the leading `names` of its "- `name`: ..."
    lines are its modules (a module renamed or deleted leaves no signpost to nowhere)."""
    doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text())) or ""
    modules = {m.stem for m in package.glob("*.py") if m.stem != "__init__"}
    named = set(re.findall(r"`(\w+)`", doc))
    listed = {n for line in doc.splitlines() if line.startswith("- `")
              for n in re.findall(r"`(\w+)`", line.split(":")[0])}
    return ([f"{package.name}: names no `{m}`" for m in sorted(modules - named)]
            + [f"{package.name}: lists `{m}`, which is not one of its modules" for m in sorted(listed - modules)])


def test_every_package_docstring_lists_its_modules():
    problems = [p for package in sorted(PKG.iterdir()) if (package / "__init__.py").is_file()
                for p in package_doc_problems(package)]
    assert not problems, problems


def test_the_package_doc_check_sees_a_missing_and_a_stale_module(tmp_path: Path):
    (tmp_path / "__init__.py").write_text('"""The package.\n\n- `a`: one.\n- `gone`, `b`: two.\n"""\n')
    for name in ("a", "b", "c"):
        (tmp_path / f"{name}.py").write_text("")
    assert package_doc_problems(tmp_path) == [f"{tmp_path.name}: names no `c`",
                                               f"{tmp_path.name}: lists `gone`, which is not one of its modules"]


LAYOUT = PKG.parent / "docs" / "layout.md"


def layout_block() -> dict[str, set[str]]:
    """docs/layout.md's block (the first fenced block after its `# Layout` title): folder -> the .py files its lines
    name."""
    text = LAYOUT.read_text()
    block = text.split("# Layout\n", 1)[1].split("```", 2)[1]
    named: dict[str, set[str]] = {}
    folder = ""
    for line in block.splitlines():
        if line[:1].strip():
            folder = line.split()[0]
        named.setdefault(folder, set()).update(re.findall(r"\b(\w+)\.py\b", line))
    return named


def test_the_layout_page_names_every_module():
    named = layout_block()
    missing = [str(p.relative_to(PKG.parent)) for p in MODULES.values()
               if p.name != "__init__.py" and p.stem not in named.get(str(p.parent.relative_to(PKG.parent)) + "/", ())]
    assert not missing, f"docs/layout.md does not name: {missing}"


def test_the_layout_page_names_no_module_that_is_gone():
    gone = sorted(f"{folder}{stem}.py" for folder, stems in layout_block().items() if folder.startswith("hvdtrain/")
                  for stem in stems if not (PKG.parent / folder / f"{stem}.py").is_file())
    assert not gone, f"docs/layout.md names modules that do not exist: {gone}"


# The code's NOTE blocks: a definition is an unindented line, in a docstring or a comment, that is `NOTE [name]`
# or begins `NOTE [name]:` (`# NOTE [name]: ...` for a comment); anywhere else, `NOTE [name]` refers to one, and
# may break across lines (`NOTE\n[name]`, or a name continued on the next `#` line).
NOTE_DEFINITION = re.compile(r"(?:#\s*)?NOTE \[([^\[\]\n]+)\](?::.*)?")
NOTE_REFERENCE = re.compile(r"NOTE\s+(?:#\s*)?\[([^\[\]]{1,100})\]")
NOTE_ROOTS = [PKG, PKG.parent / "recipes", PKG.parent / "tests", PKG.parent / "bench"]  # *.py
NOTE_DOCS = [PKG.parent / "README.md", *sorted((PKG.parent / "docs").glob("*.md"))]  # they refer to the notes
NOTE_SCRIPTS = sorted((PKG.parent / "docker").glob("*.sh"))  # the image's entrypoint holds one


def note_name(text: str) -> str:
    """A note's name with line breaks, `#` continuations and runs of spaces made one space."""
    return " ".join(re.sub(r"\n\s*#?", " ", text).split())


def note_problems(sources: dict[str, str]) -> list[str]:
    """What is wrong with the NOTE blocks of `sources` (path -> text): a name defined more than once, a reference
    to a name defined nowhere."""
    defined: dict[str, list[str]] = {}
    for path, text in sources.items():
        for n, line in enumerate(text.splitlines(), 1):
            m = None if line[:1].isspace() else NOTE_DEFINITION.fullmatch(line.rstrip())
            if m:
                defined.setdefault(note_name(m.group(1)), []).append(f"{path}:{n}")
    problems = [f"NOTE [{name}] is defined {len(where)} times: {', '.join(where)}"
                for name, where in sorted(defined.items()) if len(where) > 1]
    for path, text in sources.items():
        for m in NOTE_REFERENCE.finditer(text):
            if note_name(m.group(1)) not in defined:
                n = text.count("\n", 0, m.start()) + 1
                problems.append(f"{path}:{n}: NOTE [{note_name(m.group(1))}] names no NOTE block")
    return problems


def test_note_names_are_unique_and_resolve():
    this = Path(__file__).resolve()  # its own examples below name notes that do not exist
    sources = {str(p.relative_to(PKG.parent)): p.read_text() for root in NOTE_ROOTS for p in sorted(root.rglob("*.py"))
               if p.resolve() != this}
    problems = note_problems({**sources, **{str(p.relative_to(PKG.parent)): p.read_text() for p in NOTE_DOCS},
                              **{str(p.relative_to(PKG.parent)): p.read_text() for p in NOTE_SCRIPTS}})
    assert not problems, "NOTE blocks (see the comment above NOTE_DEFINITION):\n" + "\n".join(problems)


def test_the_note_checker_sees_duplicates_and_dangling_references():
    sources = {
        "a.py": '"""Module.\n\nNOTE [one]\nWhy.\n"""\n# NOTE [two words]: how.\nx = 1  # NOTE [one] (a)\n',
        "b.py": "def f():\n    # NOTE [two words]: an indented comment refers, it does not define\n    pass\n",
        "c.py": '"""NOTE\n[one]"""\nx = 1  # across lines, NOTE [two\n    # words]\n',
    }
    assert note_problems(sources) == []
    sources["d.py"] = '"""See NOTE [three].\n\nNOTE [one]: defined a second time.\n"""\n'
    assert note_problems(sources) == ["NOTE [one] is defined 2 times: a.py:3, d.py:3",
                                      "d.py:1: NOTE [three] names no NOTE block"]
