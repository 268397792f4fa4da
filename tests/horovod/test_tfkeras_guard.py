"""hvdtrain.tfkeras's Keras-3 guard and doctor's Keras check: pure decisions in-process, the real thing in
fresh interpreters (TensorFlow reads TF_USE_LEGACY_KERAS once, at import)."""

from __future__ import annotations

import ast
import importlib.util
import os

import pytest

from hvdtrain.doctor.local import keras_check
from hvdtrain.tfkeras import LEGACY_ENV, KerasInfo, keras_verdict, tf_keras_pin
from tests.support.harness import BIN, REPO, run_bounded

GUARD = REPO / "tests" / "scripts" / "keras3_guard.py"
HAS_TF = importlib.util.find_spec("tensorflow") is not None
needs_tf = pytest.mark.skipif(not HAS_TF, reason="TensorFlow is not installed in this venv")
QUIET = {"TF_CPP_MIN_LOG_LEVEL": "2"}


def env_without_legacy(**extra: str) -> dict[str, str]:
    """The test process's environment minus TF_USE_LEGACY_KERAS (run_bounded merges over os.environ)."""
    env = {k: v for k, v in os.environ.items() if k != LEGACY_ENV}
    return {**env, **QUIET, **extra}


# ---- the decision, in-process -------------------------------------------------------------------------------

@pytest.mark.parametrize("info", [KerasInfo("tf_keras", "2.21.0", "2.21.0"), KerasInfo("keras", "2.15.0", "2.15.1"),
                                  KerasInfo("tensorflow", "2.4.0", "2.4.0")])
def test_keras_2_is_accepted(info):
    assert keras_verdict(info, "1") is None
    assert keras_verdict(info, None) is None


def test_keras_3_is_refused_naming_what_was_found_why_and_the_fix():
    msg = keras_verdict(KerasInfo("keras", "3.15.1", "2.21.0"), "0")
    assert msg is not None
    assert "keras 3.15.1" in msg and "TensorFlow 2.21.0" in msg
    assert "hvdtrain's Keras recipe is written for Keras 2 (tf_keras) and not yet for Keras 3" in msg
    assert "TF_USE_LEGACY_KERAS='0' is set" in msg
    assert 'pip install "tf-keras==2.21.*"' in msg and "TF_USE_LEGACY_KERAS=1 before tensorflow is imported" in msg
    assert "is set in the environment" not in keras_verdict(KerasInfo("keras", "3.0.0", "2.16.1"), None)


def test_tf_keras_pin_follows_the_tensorflow_minor_version():
    assert tf_keras_pin("2.21.0") == "tf-keras==2.21.*"
    assert tf_keras_pin("2.18.1") == "tf-keras==2.18.*"


def test_doctor_keras_check_ok_fail_and_missing():
    ok = keras_check({"tensorflow": True, "keras": "tf_keras 2.21.0 (tf.keras of TensorFlow 2.21.0)"}, set())
    assert ok.ok and "tf_keras 2.21.0" in ok.detail
    bad = keras_check({"tensorflow": True, "error": keras_verdict(KerasInfo("keras", "3.15.1", "2.21.0"), None)},
                      set())
    assert not bad.ok and bad.required and "keras 3.15.1" in bad.detail
    assert bad.fix.startswith('pip install "tf-keras==2.21.*"')
    missing = keras_check({"tensorflow": False}, set())
    assert not missing.ok and not missing.required
    assert keras_check({"tensorflow": False}, {"tensorflow"}).required


def environ_writes(path) -> list[str]:
    """`os.environ[...] = `, `os.environ.setdefault/update/pop/...(...)` and `os.putenv(...)` in a module's source."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets = node.targets if isinstance(node, ast.Assign) else []
        for t in targets:
            if isinstance(t, ast.Subscript) and ast.unparse(t.value) == "os.environ":
                found.append(f"{path.name}:{node.lineno}")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner = ast.unparse(node.func.value)
            if (owner == "os.environ" and node.func.attr != "get") or ast.unparse(node.func) == "os.putenv":
                found.append(f"{path.name}:{node.lineno}")
    return found


def test_the_library_checks_the_keras_switch_but_never_sets_it():
    """Selecting Keras 2 is process-wide configuration: the entry point does it (the recipe's main(), doctor's
    probe), visibly; hvdtrain.tfkeras and the training helpers only read the environment."""
    modules = [REPO / "hvdtrain" / "tfkeras.py", *sorted((REPO / "hvdtrain" / "train").glob("*.py"))]
    assert [w for m in modules for w in environ_writes(m)] == []
    recipe = (REPO / "recipes" / "keras_train.py").read_text()
    assert 'os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")' in recipe


# ---- the real guard and doctor, in fresh interpreters -------------------------------------------------------

@needs_tf
@pytest.mark.slow
@pytest.mark.parametrize("mode,code,expected,absent", [
    # the entry point did not select Keras 2: refused, with the pip line that installs tf-keras
    ("no-set", 1, ["KerasVersionError: tf.keras is keras 3.", 'pip install "tf-keras=='], ["OK "]),
    # TensorFlow imported before the variable was set: refused, saying so
    ("import-first", 1, ["TensorFlow was imported before TF_USE_LEGACY_KERAS=1 was set", "tf.keras is keras 3.",
                         "set it before anything imports tensorflow"], ["OK "]),
    # the entry point selected it: accepted
    ("default", 0, ["OK tf_keras 2."], []),
])
def test_the_guard_accepts_only_keras_2_selected_by_the_entry_point(mode, code, expected, absent):
    result = run_bounded([str(BIN / "python"), str(GUARD), mode], timeout=180, env=env_without_legacy(), cwd=REPO)
    assert result.returncode == code, result.describe()
    assert all(e in result.output for e in expected), result.describe()
    assert not any(a in result.output for a in absent), result.describe()


@needs_tf
@pytest.mark.slow
def test_doctor_lists_tensorflow_ops_and_fails_keras_3_with_the_fix():
    result = run_bounded([str(BIN / "hvdtrain"), "doctor"], timeout=240, env=env_without_legacy(**{LEGACY_ENV: "0"}))
    lines = {line.split("]", 1)[1].strip().split("  ")[0]: line for line in result.output.splitlines()
             if line.startswith("[")}
    assert lines["TensorFlow ops"].startswith("[ok  ]"), result.output
    assert lines["PyTorch ops"].startswith("[ok  ]"), result.output
    assert lines["Keras"].startswith("[FAIL]") and "keras 3." in lines["Keras"], result.output
    assert 'fix: pip install "tf-keras==' in result.output
    assert "doctor: FAILED: Keras" in result.output and result.returncode == 1
