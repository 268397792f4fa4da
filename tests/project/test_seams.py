"""Objects meet through public members (issue 57): no Protocol names a private member, no dataclass is a bag of
callbacks into another object (the EpochLink the loader once handed its epoch iterator: 8 callables), and the
loaders' and the streaming dataset's modules (hvdtrain/data, hvdtrain/stream) read no other object's private state
beyond the library internals listed here, each with its reason. Read from the source (ast)."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "hvdtrain"
SEAM_PACKAGES = ("data", "stream")

# `x._name` with x not self/cls, allowed in hvdtrain/data and hvdtrain/stream: (file, expression) -> why
FOREIGN_PRIVATE_ALLOWED = {
    ("data/boot.py", "resource_tracker._resource_tracker"): "the stdlib's tracker, whose fd a producer must keep",
    ("data/boot.py", "tracker._fd"): "the same",
    ("data/forked.py", "resource_tracker._resource_tracker"): "the same, in a forked producer",
    ("data/boot.py", "subprocess._args_from_interpreter_flags"): "the trainer's -X/-W flags for a fresh producer",
    ("data/forked.py", "os._exit"): "a forked child leaves without running the trainer's exit handlers",
    ("data/loader.py", "loader._open"): "the class's own classmethod finishing the instance it made",
    ("data/shm.py", "seg._fd"): "Segment (defined there) on SharedMemory's own state",
    ("data/shm.py", "seg._mmap"): "the same",
}


def private_protocol_members(source: str) -> list[str]:
    """`Class.member` of every Protocol class that declares a member whose name starts with one underscore."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ClassDef) or not any(
                (b.id if isinstance(b, ast.Name) else getattr(b, "attr", "")) == "Protocol" for b in node.bases):
            continue
        for item in node.body:
            name = (item.target.id if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)
                    else item.name if isinstance(item, ast.FunctionDef) else "")
            if name.startswith("_") and not name.startswith("__"):
                found.append(f"{node.name}.{name}")
    return found


def callback_bags(source: str, most: int = 3) -> list[str]:
    """Dataclasses with more than `most` fields annotated as Callable: one object handing another its methods
    (WorkerConfig's three are the user's collate, fetch and generator)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef) and any("dataclass" in ast.unparse(d) for d in node.decorator_list):
            calls = [ast.unparse(i.target) for i in node.body
                     if isinstance(i, ast.AnnAssign) and "Callable" in ast.unparse(i.annotation)]
            if len(calls) > most:
                found.append(f"{node.name} ({', '.join(calls)})")
    return found


def foreign_private_reads(source: str) -> list[str]:
    """Every `x._name` (one underscore) whose x is not `self` or `cls`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))):
            found.append(ast.unparse(node))
    return found


def sources(packages: tuple[str, ...] = ()) -> dict[str, str]:
    roots = [PKG / p for p in packages] if packages else [PKG]
    return {str(p.relative_to(PKG)): p.read_text() for root in roots for p in sorted(root.rglob("*.py"))}


def test_no_protocol_names_a_private_member():
    found = [f"{path}: {m}" for path, text in sources().items() for m in private_protocol_members(text)]
    assert not found, f"a Protocol should list public methods, not another object's internals: {found}"


def test_no_dataclass_is_a_bag_of_callbacks():
    found = [f"{path}: {bag}" for path, text in sources().items() for bag in callback_bags(text)]
    assert not found, (f"an object that needs another's methods should own that state, or be passed the object: "
                       f"{found}")


def test_the_loader_and_stream_modules_read_no_other_objects_private_state():
    reads = {path: foreign_private_reads(text) for path, text in sources(SEAM_PACKAGES).items()}
    found = sorted({f"{path}: {expr}" for path, exprs in reads.items() for expr in exprs
                    if (path, expr) not in FOREIGN_PRIVATE_ALLOWED})
    assert not found, f"use (or add) a public method of that object instead: {found}"
    stale = sorted(key for key in FOREIGN_PRIVATE_ALLOWED if key[1] not in reads.get(key[0], []))
    assert not stale, f"allowed but no longer there: remove from FOREIGN_PRIVATE_ALLOWED: {stale}"


# What the checks were written against: the old seams, in the shape they had before issue 57.
OLD_RANGED = '''
class RangedSource(Protocol):
    index: mds.Index
    _lock: threading.Lock
    _readers: OrderedDict[int, mds.ShardReader]
    def shard_name(self, s: int) -> str: ...
    def _in_place(self, s: int) -> bool: ...
'''
OLD_LINK = '''
@dataclass(frozen=True)
class EpochLink:
    rank: int
    current: Callable[[], bool]
    epoch: Callable[[], int]
    give_back: Callable[..., None]
    fail_dead: Callable[[int, str], NoReturn]
'''
OLD_FETCH = "def _pass(self):\n    self.ds._ranged.wait(self._stop)\n    return self._x, cls._y, obj.__len__\n"


def test_the_checks_catch_the_old_seams():
    assert private_protocol_members(OLD_RANGED) == ["RangedSource._lock", "RangedSource._readers",
                                                    "RangedSource._in_place"]
    assert callback_bags(OLD_LINK) == ["EpochLink (current, epoch, give_back, fail_dead)"]
    assert callback_bags(OLD_LINK, most=4) == []  # the threshold is the only thing that lets a bag through
    assert foreign_private_reads(OLD_FETCH) == ["self.ds._ranged"]
