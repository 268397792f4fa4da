"""One probe of an interpreter's Horovod build and its host: run here (the launcher's default controller, `doctor`)
or on another host over ssh (`doctor --hosts`), read into one `Facts`.

The probe is a script run by the interpreter in question (`python -c SCRIPT MODE`), so a broken build (an
extension that fails to load, a torch ABI mismatch) is reported as data instead of crashing hvdtrain. MODE says how
much it imports: `versions` (package metadata and network interfaces only: fast, for remote hosts), `first`
(Horovod's first framework that loads: enough for the controllers) or `all` (every framework: the doctor).
`horovod_build` caches the `first` answer per interpreter until Horovod's extension changes on disk.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from hvdtrain.atomic import atomic_write

Mode = Literal["versions", "first", "all"]
PROBE_TIMEOUT_S = 120
MARKER = "HVDTRAIN_PROBE "  # the probe's one JSON line (login shells on remote hosts may print more)
FRAMEWORKS = ("torch", "tensorflow")

SCRIPT = r"""
import importlib, json, pathlib, platform, socket, sys
from importlib import metadata
mode = sys.argv[1] if len(sys.argv) > 1 else "first"
out = {"python": platform.python_version(), "executable": sys.executable, "nics": [], "extensions": {},
       "built": {}, "errors": {}}
for pkg, dists in (("horovod", ["horovod"]), ("torch", ["torch"]), ("tensorflow", ["tensorflow", "tensorflow-cpu"])):
    out[pkg] = None
    for dist in dists:
        try:
            out[pkg] = metadata.version(dist)
            break
        except metadata.PackageNotFoundError:
            pass
try:
    import psutil
    up = {n for n, s in psutil.net_if_stats().items() if s.isup}
    out["nics"] = sorted(n for n, addrs in psutil.net_if_addrs().items() if n in up and any(
        a.family == socket.AF_INET and not a.address.startswith("127.") for a in addrs))
except ImportError:
    out["nics"] = sorted(n for _, n in socket.if_nameindex() if n != "lo")
if mode != "versions":
    try:  # importable without its metadata too (e.g. through PYTHONPATH)
        import horovod
        root = pathlib.Path(horovod.__file__).parent
        out["horovod"] = out["horovod"] or getattr(horovod, "__version__", None)
    except Exception as e:  # the probe reports every failure as data
        out["errors"]["horovod"] = f"{type(e).__name__}: {e}"
        root = None
    for fw, pattern in (("torch", "mpi_lib_v2*.so"), ("tensorflow", "mpi_lib*.so")):
        ext = sorted(root.joinpath(fw).glob(pattern)) if root else []
        out["extensions"][fw] = str(ext[0]) if ext else None
        if not ext or (mode == "first" and out["built"]):
            continue
        try:
            hvd = importlib.import_module("horovod." + fw)
            out["built"][fw] = {k: bool(getattr(hvd, k + "_built")()) for k in
                                ("gloo", "mpi", "nccl", "cuda", "rocm", "ccl", "ddl")}
        except Exception as e:
            out["errors"][fw] = f"{type(e).__name__}: {e}"
print("HVDTRAIN_PROBE " + json.dumps(out))
"""


@dataclass(frozen=True)
class Facts:
    """What the probe found: versions (None: not installed), the host's network interfaces (IPv4, up, not
    loopback), Horovod's extension per framework, what each loaded framework was built with, and errors by part
    ('horovod', 'torch', 'tensorflow')."""

    python: str = ""
    executable: str = ""
    horovod: str | None = None
    torch: str | None = None
    tensorflow: str | None = None
    nics: list[str] = field(default_factory=list)
    extensions: dict[str, str | None] = field(default_factory=dict)
    built: dict[str, dict[str, bool]] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Facts:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})

    def controllers(self) -> dict[str, bool]:
        """Built flags (gloo, mpi, nccl, ...) of the first framework that loaded; {} when none did."""
        return next((self.built[fw] for fw in FRAMEWORKS if fw in self.built), {})


def parse(stdout: str) -> Facts | None:
    """The Facts in a probe's output (its last marked line), or None when there is none or it is not JSON."""
    marked = [line[len(MARKER):] for line in stdout.splitlines() if line.startswith(MARKER)]
    try:
        return Facts.from_json(json.loads(marked[-1]))
    except (IndexError, ValueError, TypeError):
        return None


def command(python: str, mode: Mode) -> list[str]:
    return [python, "-c", SCRIPT, mode]


def run(python: str, mode: Mode) -> Facts:
    """Probe `python` on this machine; a probe that cannot run or answer is Facts with errors['horovod'] set."""
    try:
        proc = subprocess.run(command(python, mode), capture_output=True, text=True, timeout=PROBE_TIMEOUT_S,
                              check=False, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return Facts(errors={"horovod": f"the probe took over {PROBE_TIMEOUT_S} s (importing horovod)"})
    except OSError as exc:
        return Facts(errors={"horovod": f"cannot run {python}: {exc.strerror or exc}"})
    facts = parse(proc.stdout)
    if facts is None:
        tail = proc.stderr.strip()[-500:] or "no output"
        return Facts(errors={"horovod": f"the probe failed (exit {proc.returncode}): {tail}"})
    return facts


def cache_dir() -> Path:
    base = os.environ.get("HVDTRAIN_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "hvdtrain")
    return Path(base)


def _stamp(path: str | None) -> list[int] | None:
    try:
        st = os.stat(path or "")
    except OSError:
        return None
    return [st.st_mtime_ns, st.st_size]


def horovod_build(python: str, *, save: bool = True) -> Facts:
    """`python`'s Horovod build (mode `first`), from the cache while its extension is unchanged. A probe with a
    loaded framework is cached (`save=False`: read only, e.g. for a dry run that must write nothing)."""
    cache = cache_dir() / "horovod-build.json"
    try:
        entries = json.loads(cache.read_text())
    except (OSError, ValueError):
        entries = {}
    hit = entries.get(python)
    if isinstance(hit, dict) and hit.get("stamp") and _stamp(hit.get("ext")) == hit["stamp"]:
        return Facts.from_json(hit["facts"])
    facts = run(python, "first")
    ext = next((facts.extensions.get(fw) for fw in FRAMEWORKS if fw in facts.built), None)
    if save and ext and _stamp(ext):
        entries[python] = {"ext": ext, "stamp": _stamp(ext), "facts": dataclasses.asdict(facts)}
        with contextlib.suppress(OSError):  # a cache that cannot be written only costs the next run a probe
            atomic_write(cache, lambda f: f.write(json.dumps(entries, indent=1).encode()))
    return facts
