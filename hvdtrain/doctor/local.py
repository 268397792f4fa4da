"""`hvdtrain doctor`: what this machine can run, and how to fix what it cannot.

Each check is a plain function returning a `Check`; `run_checks` collects them and `format_report` renders them.
Horovod is probed in a subprocess (hvdtrain.doctor.probe) so that a broken build (an extension that fails to load, a
torch ABI mismatch) is reported as a failed check instead of crashing the doctor.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Callable, Set
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from hvdtrain.doctor import probe
from hvdtrain.doctor.probe import Facts

SUPPORTED_PYTHONS = ((3, 11), (3, 12))  # pyproject.toml's requires-python
SETUP_FIX = "run scripts/setup.sh from the hvdtrain checkout (it rebuilds Horovod when torch or TF changed)"
TF_FIX = ("install TensorFlow into the venv (.venv/bin/pip install -c scripts/constraints.txt tensorflow-cpu "
          "tf-keras), then run scripts/setup.sh: it rebuilds Horovod with TensorFlow ops")

@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str
    fix: str = ""
    required: bool = True


def _first_line(argv: list[str]) -> str | None:
    if shutil.which(argv[0]) is None:
        return None
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
    except subprocess.TimeoutExpired:
        return None
    text = (proc.stdout or proc.stderr).strip()
    return text.splitlines()[0] if text else None


def framework_checks(build: Facts, require: Set[str]) -> list[Check]:
    checks = []
    for fw, label in (("torch", "PyTorch ops"), ("tensorflow", "TensorFlow ops")):
        err = build.errors.get(fw)
        ok = fw in build.built
        if ok:
            detail = "built and importable"
        elif err:
            detail = f"extension present but import failed: {err}"
        else:
            detail = "not built" if build.extensions.get(fw) is None else "unknown"
        fix = SETUP_FIX if fw == "torch" or err else TF_FIX
        checks.append(Check(label, ok, detail, fix, required=(fw == "torch" or fw in require)))
    return checks


def controller_checks(build: Facts, require: Set[str]) -> list[Check]:
    flags = build.controllers()
    gloo, mpi, nccl = flags.get("gloo", False), flags.get("mpi", False), flags.get("nccl", False)
    mpirun = _first_line(["mpirun", "--version"])
    checks = [
        Check("Gloo controller", gloo, "built" if gloo else "not built", SETUP_FIX),
        Check("MPI controller", mpi, "built" if mpi else "not built", SETUP_FIX, required="mpi" in require),
        Check("MPI runtime", mpirun is not None, mpirun or "mpirun not on PATH",
              "apt-get install -y openmpi-bin libopenmpi-dev, then scripts/setup.sh", required="mpi" in require),
        Check("NCCL ops", nccl, "built (HOROVOD_GPU_OPERATIONS=NCCL)" if nccl else "not built (CPU build)",
              "rebuild with HOROVOD_GPU_OPERATIONS=NCCL on a machine with CUDA (see docker/)",
              required="nccl" in require),
    ]
    return checks


def torch_checks() -> list[Check]:
    try:
        import torch
    except ImportError as e:
        return [Check("torch", False, f"not importable: {e}", SETUP_FIX)]
    checks = [Check("torch", True, torch.__version__)]
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n:
        names = ", ".join(torch.cuda.get_device_name(i) for i in range(n))
        nccl = ".".join(map(str, torch.cuda.nccl.version())) if hasattr(torch.cuda, "nccl") else "unknown"
        checks.append(Check("GPUs", True, f"{n}: {names}; NCCL {nccl}", required=False))
    else:
        checks.append(Check("GPUs", True, "none visible (CPU training; Gloo/MPI allreduce)", required=False))
    return checks


# Runs in a child interpreter the way the Keras recipe imports TensorFlow, in the environment doctor was started
# with (TF_USE_LEGACY_KERAS=1 there selects tf_keras, as in a job's; unset: Keras 3): it prints which Keras tf.keras
# is and hvdtrain's verdict on it.
_KERAS_PROBE = r"""
import importlib.util, json, os
out = {"tensorflow": importlib.util.find_spec("tensorflow") is not None}
if out["tensorflow"]:
    from hvdtrain import tfkeras
    out["legacy"] = os.environ.get(tfkeras.LEGACY_ENV)
    try:
        tf = tfkeras.import_tensorflow()
        out["keras"] = tfkeras.keras_info(tf).describe()
    except tfkeras.KerasVersionError as e:
        out["error"] = str(e)
print(json.dumps(out))
"""


def keras_check(probe: dict[str, Any], require: Set[str]) -> Check:
    """Keras as the Keras recipe needs it: Keras 3 on TensorFlow, or tf_keras under TF_USE_LEGACY_KERAS=1; anything
    else fails with the fix."""
    if not probe.get("tensorflow"):
        return Check("Keras", False, "TensorFlow not installed", TF_FIX, required="tensorflow" in require)
    if "keras" in probe:
        chosen = f", selected by TF_USE_LEGACY_KERAS={probe['legacy']}" if probe.get("legacy") else ""
        return Check("Keras", True, f"{probe['keras']}{chosen}")
    error = probe.get("error", "probe failed")
    detail, _, fix = error.partition(" Fix: ")
    return Check("Keras", False, detail, fix or TF_FIX)


def probe_keras(python: str = sys.executable) -> dict[str, Any]:
    try:
        proc = subprocess.run([python, "-c", _KERAS_PROBE], capture_output=True, text=True,
                              timeout=probe.PROBE_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        return {"tensorflow": True, "error": f"importing tensorflow took over {probe.PROBE_TIMEOUT_S} s"}
    try:
        facts: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])  # _KERAS_PROBE prints a dict
        return facts
    except (IndexError, json.JSONDecodeError):
        return {"tensorflow": True, "error": f"probe failed (exit {proc.returncode}): {proc.stderr.strip()[-500:]}"}


def run_checks(require: Set[str] = frozenset()) -> list[Check]:
    """All checks for this machine. `require` adds 'mpi', 'nccl' or 'tensorflow' to what must pass."""
    build = probe.run(sys.executable, "all")
    hvd_err = build.errors.get("horovod")
    checks = [
        Check("Python", sys.version_info[:2] in SUPPORTED_PYTHONS, sys.version.split()[0],
              "use Python 3.11 (the tested default) or 3.12"),
        Check("Horovod", hvd_err is None and build.horovod is not None,
              build.horovod or "not installed" if hvd_err is None else f"not usable: {hvd_err}", SETUP_FIX),
        Check("horovodrun", shutil.which("horovodrun") is not None or (Path(sys.executable).parent /
              "horovodrun").exists(), "on PATH" if shutil.which("horovodrun") else "next to python",
              "activate the venv: source .venv/bin/activate"),
    ]
    if hvd_err is None:
        checks += framework_checks(build, require)
        checks += controller_checks(build, require)
        if build.extensions.get("tensorflow") or "tensorflow" in require:
            checks.append(keras_check(probe_keras(), require))
    return checks + torch_checks()


def format_report(checks: list[Check]) -> str:
    width = max(len(c.name) for c in checks)
    lines = []
    for c in checks:
        mark = "ok  " if c.ok else ("FAIL" if c.required else "warn")
        lines.append(f"[{mark}] {c.name:<{width}}  {c.detail}")
        if not c.ok and c.fix:
            lines.append(f"       {'':<{width}}  fix: {c.fix}")
    failed = [c.name for c in checks if c.required and not c.ok]
    lines.append("doctor: all required checks passed" if not failed else f"doctor: FAILED: {', '.join(failed)}")
    return "\n".join(lines)


def doctor(require: Set[str], as_json: bool = False, more: Callable[[], list[Check]] | None = None) -> int:
    """Print the report; exit status 0 when every required check passed, 1 otherwise. `more` adds checks
    (`--hosts`: hvdtrain.doctor.remote)."""
    checks = run_checks(require) + (more() if more else [])
    if as_json:
        print(json.dumps([asdict(c) for c in checks], indent=2))
    else:
        print(format_report(checks))
    return 0 if all(c.ok for c in checks if c.required) else 1
