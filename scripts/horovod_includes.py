"""List the Horovod sources that use a standard-library name without including its header, directly or through the
headers of the source tree (its own and third_party's).

    python scripts/horovod_includes.py SRC          (SRC: an unpacked, patched horovod-0.28.1; exit 1 if any is found)

Why: libstdc++ 13 (GCC 13, Ubuntu 24.04, the GPU images) stopped including <string>, <stdexcept>, <cstdint>,
<system_error> and <cstdio> from its other headers, and Horovod 0.28.1 relied on that: its GPU build failed on
group_table.h (`std::string`) and common.h (`std::logic_error`) on the first GPU machine lent to this project, while
GCC 12 (Debian 12, CI) built it. A standard header is treated as providing only itself, which is what every
libstdc++ guarantees; headers outside the tree (CUDA, MPI, NVTX) provide nothing. scripts/patches/ adds the includes;
tests/project/test_gpu_check.py runs this over the sdist before and after the patch.

Limits (it reads text; it does not preprocess): an include inside an `#if` block counts as made whatever the
condition; only `std::`-qualified names are matched for <string>, <stdexcept> and <system_error> (`using std::x`
then `x` is missed); a `.cc` file #included into another (gpu_context_impl.cc) is checked as part of that file.
"""

from __future__ import annotations

import functools
import re
import sys
from collections.abc import Callable
from pathlib import Path

NEEDS = {  # header -> the names that need it, and the headers that provide them
    "string": (r"std::(string\b|to_string\b|sto(i|l|ul|ll|ull|f|d)\b|getline\b)", {"string"}),
    "stdexcept": (r"std::(logic_error|runtime_error|invalid_argument|out_of_range|domain_error|length_error"
                  r"|overflow_error|range_error)\b", {"stdexcept"}),
    "system_error": (r"std::(system_error|error_code|error_category|generic_category|system_category)\b",
                     {"system_error"}),
    "cstdint": (r"(?<![\w:])(std::)?u?int(8|16|32|64)_t\b", {"cstdint", "stdint.h", "cinttypes", "inttypes.h"}),
    "cstdio": (r"(?<![\w:])(std::)?(printf|fprintf|snprintf|sprintf|fopen|fclose|fflush)\s*\(", {"cstdio", "stdio.h"}),
}
SKIP_DIRS = {"rocm", "mxnet", "ddl"}  # not built by hvdtrain (ROCm, MXNet, IBM DDL)
INCLUDE = re.compile(r'^\s*#\s*include\s*([<"])([^>"]+)[>"]', re.M)
# A string literal (kept: "http://..." is no comment) or a comment (dropped).
LITERAL_OR_COMMENT = re.compile(r'"(?:\\.|[^"\\\n])*"|//[^\n]*|/\*.*?\*/', re.S)


def code_of(path: Path) -> str:
    """The file's text without its comments."""
    text = path.read_text(errors="replace")
    return LITERAL_OR_COMMENT.sub(lambda m: m.group(0) if m.group(0).startswith('"') else " ", text)


def search_path(src: Path) -> list[Path]:
    """The include directories of Horovod's CMake build that lie inside the sdist."""
    tp = src / "third_party"
    return [src, tp / "gloo", tp / "eigen", tp / "flatbuffers" / "include", tp / "lbfgs" / "include",
            tp / "HTTPRequest" / "include", *sorted((tp / "boost").glob("*/include"))]


def headers_seen(path: Path, dirs: list[Path], read: Callable[[Path], str], cache: dict[Path, set[str]],
                 stack: frozenset[Path] = frozenset()) -> set[str]:
    """Every standard header `path` includes, following the includes that resolve inside the tree."""
    if path in cache:
        return cache[path]
    seen: set[str] = set()
    for _, name in INCLUDE.findall(read(path)):
        found = next((d / name for d in (path.parent, *dirs) if (d / name).is_file()), None)
        if found is None:
            seen.add(name)  # a standard (or outside) header: provides itself only
        elif found.resolve() not in stack:
            seen |= headers_seen(found.resolve(), dirs, read, cache, stack | {path})
    cache[path] = seen
    return seen


def missing_includes(src: Path) -> dict[str, list[str]]:
    """{file relative to src: [headers it needs but never sees]} over horovod/'s C++ and CUDA sources."""
    dirs, cache = search_path(src), dict[Path, set[str]]()
    read = functools.cache(code_of)  # each file read once per call
    files = [p for p in sorted((src / "horovod").rglob("*")) if p.is_file() and p.suffix in {".h", ".cc", ".cu"}
             and not SKIP_DIRS & set(p.relative_to(src).parts)]
    included = {p: [p.parent / name for _, name in INCLUDE.findall(read(p)) if name.endswith(".cc")]
                for p in files}
    fragments = {f for fs in included.values() for f in fs}  # .cc files #included into another one
    found: dict[str, list[str]] = {}
    for p in files:
        if p in fragments:
            continue  # checked as part of the file that includes it
        text = read(p) + "".join(read(f) for f in included[p] if f.is_file())
        seen = headers_seen(p.resolve(), dirs, read, cache)
        lacking = [h for h, (names, providers) in NEEDS.items() if re.search(names, text) and not providers & seen]
        if lacking:
            found[str(p.relative_to(src))] = lacking
    return found


def main(argv: list[str]) -> int:
    if len(argv) != 1 or not (Path(argv[0]) / "horovod").is_dir():
        print(f"horovod_includes: expected one argument, the folder of an unpacked horovod sdist (holding horovod/); "
              f"got {argv}. usage: python scripts/horovod_includes.py SRC", file=sys.stderr)
        return 2
    found = missing_includes(Path(argv[0]))
    for name, headers in found.items():
        print(f"{name}: uses names from <{'>, <'.join(headers)}> without including it")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
