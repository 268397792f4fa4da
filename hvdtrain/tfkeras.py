"""Import TensorFlow and check that tf.keras is a Keras hvdtrain's Keras recipe runs on: Keras 3 computing with
TensorFlow (TF >= 2.16's default `tf.keras`), or Keras 2 (the `tf-keras` package, under TF_USE_LEGACY_KERAS=1);
refuse anything else with a clear error.

Which Keras `tf.keras` is, TensorFlow decides once, at import: Keras 3 unless `TF_USE_LEGACY_KERAS=1` is set
*before tensorflow is imported* and `tf-keras` (same minor version as TF) is installed. Horovod 0.28.1 did not
average under Keras 3 (Keras 3's `train_step` bypasses every hook DistributedOptimizer overrides, Horovod issue
#4290); the Horovod that scripts/setup.sh builds does (its patch: horovod/_keras/keras3.py), so the recipe and
users' own Horovod scripts run on Keras 3 (docs/recipes.md). The choice is the user's:

- hvdtrain sets nothing: TF_USE_LEGACY_KERAS is process-wide configuration, read by TensorFlow from the
  environment the job was started with (`env:` in a job spec, or the shell's).
- `import_tensorflow()` imports TF and checks which Keras `tf.keras` is: Keras 3 on another backend
  (KERAS_BACKEND=jax or torch: Horovod's Keras integration runs TensorFlow ops), TF_USE_LEGACY_KERAS=1 set after
  TensorFlow was imported (asked for tf_keras, got Keras 3), tf_keras asked for but not installed, and any other
  major version raise `KerasVersionError` naming the fix.

The Horovod that scripts/setup.sh builds binds tf.keras's own backend in its modules (0.28.1 bound `from keras import
backend`, Keras 3's even in legacy mode, which lacks `get_value`, so `LearningRateWarmupCallback` failed), and
refuses Keras 3 only on a backend other than TensorFlow (`UnsupportedKerasError`). tests/horovod/test_keras.py.

`keras_verdict()` is the pure decision (no TensorFlow needed), shared with `hvdtrain doctor`.
`startup_lines_filtered()` keeps TensorFlow's start-up lines off the console:

NOTE [TensorFlow start-up lines]
TensorFlow (2.21) logs through absl before anything calls absl::InitializeLog(), and until then absl writes every
message to file descriptor 2 whatever TF_CPP_MIN_LOG_LEVEL says (only TensorFlow's own logging reads it): the
banner "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR", then, twice per
import, "I... port.cc] oneDNN custom operations are on ..." and "I... cudart_stub.cc] Could not find cuda
drivers ...", and, at the first device query on a machine without NVIDIA's driver, the ERROR "E...
cuda_platform.cc] failed call to cuInit". No setting turns them off (absl's --minloglevel is a flag of C++
programs). So while TensorFlow is imported and first lists its devices, fd 2 is a pipe into a small filter
process (`filter_main`) that copies each line to the real stderr unless TF_CPP_MIN_LOG_LEVEL (read then) says
TensorFlow would not print it:
- level 0 (TensorFlow's default): every line passes (and no filter runs);
- level >= 1: the banner and absl INFO lines are dropped, and the cuInit error where no NVIDIA device node exists
  (/dev/nvidiactl: there it only says that there is no GPU); level >= 2 drops absl warnings, >= 3 errors; FATAL
  lines always pass.
Everything else (TensorFlow's warnings, Python's own output, a traceback) passes, in order. A process, not a
thread: TensorFlow's C++ start-up writes while holding the GIL, so a thread could not copy anything until it
returned — a write larger than the pipe would block for ever, and a FATAL line followed by abort() would be lost.
The filter runs in a process group of its own (a Ctrl-C or a signal to the job's group misses it; it also ignores
them) and ends when every writer has closed the pipe: after a crash it still passes on the last lines. fd 2 is
restored when the block ends, however it ends, and the caller waits up to FILTER_WAIT_S for the filter to copy
what is left; a process started inside the block that still holds the pipe makes the caller wait that long, then
the filter ends with that process. Without a stderr (closed, None) nothing is filtered.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import Any

LEGACY_ENV = "TF_USE_LEGACY_KERAS"
LEGACY_VALUES = ("1", "true", "True")  # what TensorFlow reads as "use tf_keras"


class KerasVersionError(RuntimeError):
    """tf.keras is not a Keras hvdtrain's recipe runs on; the message says how to fix it."""


@dataclass(frozen=True)
class KerasInfo:
    """Which Keras `tf.keras` resolved to: the implementing package, its version, TF's version, and (Keras 3) the
    backend it computes with."""

    package: str  # "keras" (Keras 3, TF >= 2.16's default), "tf_keras", or "tensorflow" (TF < 2.6 bundled it)
    version: str
    tf_version: str
    backend: str = "tensorflow"  # Keras 3's KERAS_BACKEND; Keras 2 has only TensorFlow

    @property
    def major(self) -> int:
        return major_version(self.version)

    def describe(self) -> str:
        backend = f", {self.backend} backend" if self.backend != "tensorflow" else ""
        return f"{self.package} {self.version} (tf.keras of TensorFlow {self.tf_version}{backend})"


def major_version(version: str) -> int:
    head = version.split(".", 1)[0]
    return int(head) if head.isdigit() else -1


def tf_keras_pin(tf_version: str) -> str:
    """The tf-keras requirement that matches a TensorFlow version: 2.21.0 -> 'tf-keras==2.21.*'."""
    parts = tf_version.split(".")
    minor = ".".join(parts[:2]) if len(parts) >= 2 else tf_version
    return f"tf-keras=={minor}.*"


def fix_text(tf_version: str) -> str:
    """How to get tf_keras (Keras 2) as tf.keras."""
    return (f'pip install "{tf_keras_pin(tf_version)}" and set {LEGACY_ENV}=1 before tensorflow is imported, or '
            f"unset {LEGACY_ENV} to train on Keras 3")


def keras_verdict(info: KerasInfo, env_value: str | None) -> str | None:
    """None if the Keras recipe can run on this Keras (Keras 3 on TensorFlow, TF >= 2.16's default; or Keras 2,
    tf_keras, under TF_USE_LEGACY_KERAS=1); else the error message (what was found, why it matters, the fix)."""
    found = f"tf.keras is {info.describe()}"
    if info.major == 2:
        return None
    if info.major == 3 and env_value in LEGACY_VALUES:  # TensorFlow reads the variable once, at import
        return (f"{LEGACY_ENV}={env_value} asks for tf_keras (Keras 2), but {found}: TensorFlow was imported before "
                f"it was set (TensorFlow reads it once, at import). Fix: set {LEGACY_ENV}=1 before anything imports "
                f"tensorflow, or unset it to train on Keras 3")
    if info.major == 3 and info.backend != "tensorflow":
        return (f"{found}: Horovod's Keras integration (and hvdtrain's Keras recipe) runs TensorFlow ops, so Keras 3 "
                f"must compute with TensorFlow. Fix: unset KERAS_BACKEND (or set KERAS_BACKEND=tensorflow); for "
                f"{info.backend}, train with the PyTorch recipe or your own script")
    if info.major == 3:
        return None
    return (f"{found}, but hvdtrain's Keras recipe runs on Keras 3 (tf.keras of TensorFlow >= 2.16) or Keras 2 "
            f"(tf_keras). Fix: pip install \"tensorflow>=2.16\" (its tf.keras is Keras 3), or "
            f"{fix_text(info.tf_version)}")


def keras_info(tf: ModuleType) -> KerasInfo:
    """Inspect an imported TensorFlow: which package implements `tf.keras`, its version, and its backend."""
    try:
        module = tf.keras.Model.__module__
    except (ImportError, AttributeError) as exc:  # no tf_keras under TF_USE_LEGACY_KERAS=1, or a backend TF refuses
        found = f"tf.keras cannot be imported ({type(exc).__name__}: {exc})"
        backend = os.environ.get("KERAS_BACKEND", "tensorflow")
        if backend != "tensorflow" and os.environ.get(LEGACY_ENV) not in LEGACY_VALUES:
            raise KerasVersionError(f"{found}: KERAS_BACKEND={backend!r} is set, and TensorFlow's tf.keras is Keras 3 "
                                    "computing with TensorFlow. Fix: unset KERAS_BACKEND (or set "
                                    "KERAS_BACKEND=tensorflow)") from None
        raise KerasVersionError(f"{found}; fix: {fix_text(tf.__version__)}") from None
    package = module.split(".", 1)[0]
    if package == "tensorflow":
        return KerasInfo(package, tf.__version__, tf.__version__)
    imported = sys.modules.get(package)
    version = getattr(imported, "__version__", None) or _dist_version(package)
    backend = "tensorflow"
    if package == "keras" and major_version(version) >= 3 and imported is not None:
        backend = imported.backend.backend()
    return KerasInfo(package, version, tf.__version__, backend)


def _dist_version(package: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package.replace("_", "-"))
    except PackageNotFoundError:
        return "unknown"


def import_tensorflow() -> Any:
    """`import tensorflow`, checked: tf.keras must be Keras 3 computing with TensorFlow, or Keras 2 (tf_keras), else
    KerasVersionError with the fix. Which of the two is the process's TF_USE_LEGACY_KERAS, read by TensorFlow at
    import (the user's choice: hvdtrain sets nothing), as is TF_CPP_MIN_LOG_LEVEL: its start-up lines are filtered
    by that level (`startup_lines_filtered`)."""
    if importlib.util.find_spec("tensorflow") is None:
        raise KerasVersionError("TensorFlow is not installed; fix: pip install tensorflow-cpu (or tensorflow), "
                                "then rebuild Horovod with scripts/setup.sh")
    imported_before = "tensorflow" in sys.modules
    with contextlib.nullcontext() if imported_before else startup_lines_filtered():  # NOTE [TensorFlow start-up lines]
        import tensorflow as tf

        tf.config.list_physical_devices("GPU")  # where a machine without NVIDIA's driver logs its cuInit error

    verdict = keras_verdict(keras_info(tf), os.environ.get(LEGACY_ENV))
    if verdict:
        raise KerasVersionError(verdict)
    return tf


LEVEL_ENV = "TF_CPP_MIN_LOG_LEVEL"
BANNER = "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR"
ABSL_LINE = re.compile(r"([IWEF])\d{4} \d\d:\d\d:\d+\.\d+ +\d+ \S+:\d+\] ")  # absl's prefix: severity, date, ...
NO_GPU_ERRORS = ("failed call to cuInit",)  # what a machine without NVIDIA's driver logs as an error
DRIVER_NODE = "/dev/nvidiactl"
FILTER_WAIT_S = 2.0  # at the block's end, how long to wait for the filter to copy what is left
_LINGERING: list[subprocess.Popen[bytes]] = []  # filters that outlived their block (NOTE [TensorFlow start-up lines])
SEVERITY = {"I": 0, "W": 1, "E": 2, "F": 3}  # TF_CPP_MIN_LOG_LEVEL's scale
FILTER_MAIN = ("import sys; sys.path.append(sys.argv[1]); from hvdtrain import tfkeras; "
               "tfkeras.filter_main(sys.argv[2:])")


def log_level(env: Mapping[str, str]) -> int:
    """TF_CPP_MIN_LOG_LEVEL as TensorFlow reads it: 0 when unset or not a number."""
    try:
        return int(env.get(LEVEL_ENV, "0"))
    except ValueError:
        return 0


def keeps(line: str, level: int, gpu_driver: bool) -> bool:
    """Whether a start-up line reaches the console at this log level (see NOTE [TensorFlow start-up lines])."""
    if level < 1:
        return True
    if line.startswith(BANNER):
        return False
    absl = ABSL_LINE.match(line)
    if absl is None:
        return True
    severity = SEVERITY[absl.group(1)]
    if severity == 2 and not gpu_driver and any(text in line for text in NO_GPU_ERRORS):
        return False
    return severity >= level or severity == 3


def filter_main(argv: list[str]) -> None:
    """The filter process (`python -c FILTER_MAIN ROOT LEVEL GPU_DRIVER`): its stdin's lines that `keeps` accepts
    to its stdout, until every writer has closed the pipe. Signals that stop the job are ignored: it ends at the
    pipe's end, so that it outlives a crashing writer long enough to pass on its last words."""
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, signal.SIG_IGN)
    level, gpu_driver = int(argv[0]), argv[1] == "1"
    pending = b""
    while chunk := os.read(0, 65536):
        *lines, pending = (pending + chunk).split(b"\n")
        _write(b"".join(line + b"\n" for line in lines if keeps(line.decode(errors="replace"), level, gpu_driver)))
    if pending and keeps(pending.decode(errors="replace"), level, gpu_driver):
        _write(pending)


def _write(data: bytes) -> None:
    """All of `data` to stdout; nothing when stdout is gone (the reading goes on: a writer never blocks)."""
    with contextlib.suppress(OSError):
        while data:
            data = data[os.write(1, data):]


@contextlib.contextmanager
def startup_lines_filtered(env: Mapping[str, str] = os.environ) -> Iterator[None]:
    """Run the block with fd 2 going through the filter process (NOTE [TensorFlow start-up lines]); at level 0, or
    without a stderr to filter, the block runs as it is."""
    started = _filter_stderr(log_level(env)) if sys.stderr is not None else None
    if started is None:
        yield
        return
    saved, filtered = started
    try:
        yield
    finally:
        with contextlib.suppress(OSError, ValueError):
            sys.stderr.flush()
        os.dup2(saved, 2)  # the pipe's last write end here closes: the filter copies the rest, then ends
        os.close(saved)
        try:
            filtered.wait(timeout=FILTER_WAIT_S)
        except subprocess.TimeoutExpired:  # a process started inside the block still holds the pipe
            _LINGERING.append(filtered)  # it ends with that process; kept here so that it is reaped, not warned of


def _filter_stderr(level: int) -> tuple[int, subprocess.Popen[bytes]] | None:
    """(a copy of the real fd 2, the filter process), fd 2 now the filter's pipe; None when nothing is to be
    filtered (level 0) or cannot be (fd 2 closed, no process can be started): the lines then pass as they would."""
    if level < 1:
        return None
    try:
        saved = os.dup(2)
    except OSError:
        return None
    try:
        sys.stderr.flush()
        return saved, _start_filter(saved, level)
    except (OSError, ValueError):
        os.close(saved)
        return None


def _start_filter(out_fd: int, level: int) -> subprocess.Popen[bytes]:
    """The filter process reading a new pipe and writing to `out_fd`; fd 2 is that pipe's write end from now on."""
    read_fd, write_fd = os.pipe()
    try:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        proc = subprocess.Popen([sys.executable, "-c", FILTER_MAIN, root, str(level),
                                 "1" if os.path.exists(DRIVER_NODE) else "0"],
                                stdin=read_fd, stdout=out_fd, stderr=out_fd, process_group=0)
        os.dup2(write_fd, 2)
    finally:
        os.close(read_fd)
        os.close(write_fd)
    return proc
