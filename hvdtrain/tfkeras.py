"""Import TensorFlow and check that tf.keras is a Keras 2 (tf_keras) Horovod can use; refuse Keras 3 with a clear
error.

Why: `horovod.tensorflow.keras` (0.28.1) was written for Keras 2. From TF 2.16 `tf.keras` is Keras 3 unless
`TF_USE_LEGACY_KERAS=1` is set *before tensorflow is imported* and the `tf-keras` package (same minor version as
TF) is installed. Under Keras 3, `BroadcastGlobalVariablesCallback` crashes (Horovod issue #4290) and, worse,
`hvd.DistributedOptimizer` wraps without error but does not average gradients: Keras 3's `train_step` bypasses
the hooks it overrides, so the ranks silently drift apart. hvdtrain never lets a run reach that path:

- The process's entry point selects Keras 2 itself, visibly, before anything imports TensorFlow:
  `os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")` (recipes/keras_train.py's main(), doctor's probe). This
  module never sets it: it is process-wide configuration, the entry point's to make.
- `import_tensorflow()` imports TF and checks which Keras `tf.keras` is; Keras 3 raises `KerasVersionError` naming
  the fix (also when TensorFlow was imported before the variable was set: TF reads it once, at import).

The Horovod that scripts/setup.sh builds guards itself too, for scripts that never import hvdtrain (its patch):
every entry point of its Keras integration raises `UnsupportedKerasError` on a Keras 3 object, and its modules bind
tf.keras's own backend (0.28.1 bound `from keras import backend`, Keras 3's even in legacy mode, which lacks
`get_value`, so `LearningRateWarmupCallback` failed). tests/test_horovod_keras.py runs both paths.

`keras_verdict()` is the pure decision (no TensorFlow needed), shared with `hvdtrain doctor`.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from dataclasses import dataclass
from types import ModuleType
from typing import Any

LEGACY_ENV = "TF_USE_LEGACY_KERAS"
LEGACY_VALUES = ("1", "true", "True")  # what TensorFlow reads as "use tf_keras"


class KerasVersionError(RuntimeError):
    """tf.keras is not a Keras 2 that Horovod supports; the message says how to fix it."""


@dataclass(frozen=True)
class KerasInfo:
    """Which Keras `tf.keras` resolved to: the implementing package, its version, and TF's version."""

    package: str  # "tf_keras", "keras" or "tensorflow" (TF < 2.6 bundled it)
    version: str
    tf_version: str

    @property
    def major(self) -> int:
        return _major(self.version)

    def describe(self) -> str:
        return f"{self.package} {self.version} (tf.keras of TensorFlow {self.tf_version})"


def _major(version: str) -> int:
    head = version.split(".", 1)[0]
    return int(head) if head.isdigit() else -1


def tf_keras_pin(tf_version: str) -> str:
    """The tf-keras requirement that matches a TensorFlow version: 2.21.0 -> 'tf-keras==2.21.*'."""
    parts = tf_version.split(".")
    minor = ".".join(parts[:2]) if len(parts) >= 2 else tf_version
    return f"tf-keras=={minor}.*"


def fix_text(tf_version: str) -> str:
    return (f'pip install "{tf_keras_pin(tf_version)}" and set {LEGACY_ENV}=1 before tensorflow is imported '
            f"(hvdtrain's recipe sets it itself; do not set {LEGACY_ENV}=0)")


def keras_verdict(info: KerasInfo, env_value: str | None) -> str | None:
    """None if Horovod can use this Keras; else the error message (what was found, why it matters, the fix)."""
    if info.major == 2:
        return None
    why = (f"tf.keras is {info.describe()}, but horovod.tensorflow.keras needs Keras 2: under Keras 3 "
           "hvd.DistributedOptimizer silently does not average gradients (the ranks drift apart) and "
           "BroadcastGlobalVariablesCallback fails (Horovod issue #4290)")
    if env_value is not None and env_value not in LEGACY_VALUES:
        why += f"; {LEGACY_ENV}={env_value!r} is set in the environment, which selects Keras 3"
    return f"{why}. Fix: {fix_text(info.tf_version)}"


def keras_info(tf: ModuleType) -> KerasInfo:
    """Inspect an imported TensorFlow: which package implements `tf.keras`, and its version."""
    try:
        module = tf.keras.Model.__module__
    except (ImportError, AttributeError) as exc:  # TF >= 2.16 with TF_USE_LEGACY_KERAS=1 but no tf_keras
        raise KerasVersionError(f"tf.keras cannot be imported ({type(exc).__name__}: {exc}); "
                                f"fix: {fix_text(tf.__version__)}") from None
    package = module.split(".", 1)[0]
    if package == "tensorflow":
        return KerasInfo(package, tf.__version__, tf.__version__)
    version = getattr(sys.modules.get(package), "__version__", None) or _dist_version(package)
    return KerasInfo(package, version, tf.__version__)


def _dist_version(package: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package.replace("_", "-"))
    except PackageNotFoundError:
        return "unknown"


def import_tensorflow() -> Any:
    """`import tensorflow`, checked: tf.keras must be Keras 2, else KerasVersionError with the fix. Selecting
    Keras 2 (TF_USE_LEGACY_KERAS=1 before TensorFlow is imported) is the caller's entry point's job."""
    if importlib.util.find_spec("tensorflow") is None:
        raise KerasVersionError("TensorFlow is not installed; fix: pip install tensorflow-cpu (or tensorflow) "
                                "and the matching tf-keras, then rebuild Horovod with scripts/setup.sh")
    imported_before = "tensorflow" in sys.modules
    import tensorflow as tf

    value = os.environ.get(LEGACY_ENV)
    verdict = keras_verdict(keras_info(tf), value)
    if verdict and imported_before and value in LEGACY_VALUES:
        raise KerasVersionError(f"TensorFlow was imported before {LEGACY_ENV}=1 was set (TensorFlow reads it once, "
                                f"at import): {verdict} — set it before anything imports tensorflow")
    if verdict:
        raise KerasVersionError(verdict)
    return tf
