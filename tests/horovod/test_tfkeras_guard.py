"""hvdtrain.tfkeras's Keras check (the Keras recipe runs on Keras 3 on TensorFlow, or on tf_keras under
TF_USE_LEGACY_KERAS=1) and doctor's Keras check: pure decisions in-process, the real thing in fresh interpreters
(TensorFlow reads TF_USE_LEGACY_KERAS once, at import)."""

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
KERAS3 = KerasInfo("keras", "3.15.1", "2.21.0")


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


@pytest.mark.parametrize("value", [None, "0", "false"])
def test_keras_3_on_tensorflow_is_accepted_unless_tf_keras_was_asked_for(value):
    assert keras_verdict(KERAS3, value) is None


def test_keras_3_where_tf_keras_was_asked_for_says_tensorflow_was_imported_first():
    msg = keras_verdict(KERAS3, "1")
    assert msg is not None and "TF_USE_LEGACY_KERAS=1 asks for tf_keras (Keras 2), but tf.keras is keras 3.15.1" in msg
    assert "TensorFlow was imported before it was set" in msg
    assert "Fix: set TF_USE_LEGACY_KERAS=1 before anything imports tensorflow, or unset it" in msg


def test_keras_3_on_another_backend_and_other_majors_are_refused_naming_them_and_the_fix():
    msg = keras_verdict(KerasInfo("keras", "3.15.1", "2.21.0", backend="jax"), None)
    assert msg is not None and "keras 3.15.1 (tf.keras of TensorFlow 2.21.0, jax backend)" in msg
    assert "runs TensorFlow ops" in msg and "unset KERAS_BACKEND (or set KERAS_BACKEND=tensorflow)" in msg
    old = keras_verdict(KerasInfo("keras", "1.2.0", "1.15.0"), None)
    assert old is not None and "runs on Keras 3 (tf.keras of TensorFlow >= 2.16) or Keras 2 (tf_keras)" in old
    assert 'pip install "tensorflow>=2.16"' in old and 'pip install "tf-keras==1.15.*"' in old


def test_tf_keras_pin_follows_the_tensorflow_minor_version():
    assert tf_keras_pin("2.21.0") == "tf-keras==2.21.*"
    assert tf_keras_pin("2.18.1") == "tf-keras==2.18.*"


def test_doctor_keras_check_ok_fail_and_missing():
    ok = keras_check({"tensorflow": True, "keras": "keras 3.15.1 (tf.keras of TensorFlow 2.21.0)"}, set())
    assert ok.ok and ok.detail == "keras 3.15.1 (tf.keras of TensorFlow 2.21.0)"
    legacy = keras_check({"tensorflow": True, "keras": "tf_keras 2.21.0 (tf.keras of TensorFlow 2.21.0)",
                          "legacy": "1"}, set())
    assert legacy.ok and legacy.detail.endswith(", selected by TF_USE_LEGACY_KERAS=1")
    jax = KerasInfo("keras", "3.15.1", "2.21.0", backend="jax")
    bad = keras_check({"tensorflow": True, "error": keras_verdict(jax, None)}, set())
    assert not bad.ok and bad.required and "jax backend" in bad.detail
    assert bad.fix.startswith("unset KERAS_BACKEND")
    missing = keras_check({"tensorflow": False}, set())
    assert not missing.ok and not missing.required
    assert keras_check({"tensorflow": False}, {"tensorflow"}).required


def environ_writes(source: str, name: str) -> list[str]:
    """`os.environ[...] = `, `os.environ.setdefault/update/pop/...(...)` and `os.putenv(...)` in Python source, as
    "name:line: the statement's code"."""
    found = []
    for node in ast.walk(ast.parse(source, name)):
        targets = node.targets if isinstance(node, ast.Assign) else []
        writes = [t for t in targets if isinstance(t, ast.Subscript) and ast.unparse(t.value) == "os.environ"]
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner = ast.unparse(node.func.value)
            if (owner == "os.environ" and node.func.attr != "get") or ast.unparse(node.func) == "os.putenv":
                writes.append(node)
        found += [f"{name}:{node.lineno}: {ast.unparse(node)}" for _ in writes[:1]]
    return found


def test_the_library_checks_the_keras_switch_but_never_sets_it():
    """Which Keras tf.keras is, is process-wide configuration: the job's environment says it (TF_USE_LEGACY_KERAS=1
    for tf_keras); hvdtrain.tfkeras and the training helpers write no environment variable, and the recipe and
    doctor's probe (the code it runs in a child interpreter included) write any but that one."""
    from hvdtrain.doctor import local

    modules = [REPO / "hvdtrain" / "tfkeras.py", *sorted((REPO / "hvdtrain" / "train").glob("*.py"))]
    assert [w for m in modules for w in environ_writes(m.read_text(), m.name)] == []
    entry_points = [((REPO / "recipes" / "keras_train.py").read_text(), "keras_train.py"),
                    ((REPO / "hvdtrain" / "doctor" / "local.py").read_text(), "local.py"),
                    (local._KERAS_PROBE, "_KERAS_PROBE")]
    writes = [w for source, name in entry_points for w in environ_writes(source, name)]
    assert any("TF_CPP_MIN_LOG_LEVEL" in w for w in writes), writes  # the check sees the recipe's one write
    assert [w for w in writes if "LEGACY" in w] == []


# ---- the real guard and doctor, in fresh interpreters -------------------------------------------------------

@needs_tf
@pytest.mark.slow
@pytest.mark.parametrize("mode,code,expected,absent", [
    # nothing set: Keras 3, the recipe's default
    ("default", 0, ["OK keras 3."], []),
    # TensorFlow imported before TF_USE_LEGACY_KERAS=1 was set: asked for tf_keras, got Keras 3: refused, saying so
    ("import-first", 1, ["KerasVersionError: TF_USE_LEGACY_KERAS=1 asks for tf_keras (Keras 2), but tf.keras is "
                         "keras 3.", "set TF_USE_LEGACY_KERAS=1 before anything imports tensorflow"], ["OK "]),
    # set before the import: tf_keras
    ("legacy", 0, ["OK tf_keras 2."], []),
])
def test_the_guard_accepts_keras_3_and_tf_keras_asked_for_in_time(mode, code, expected, absent):
    result = run_bounded([str(BIN / "python"), str(GUARD), mode], timeout=180, env=env_without_legacy(), cwd=REPO)
    assert result.returncode == code, result.describe()
    assert all(e in result.output for e in expected), result.describe()
    assert not any(a in result.output for a in absent), result.describe()


@needs_tf
@pytest.mark.slow
def test_doctor_lists_tensorflow_ops_and_fails_keras_3_on_the_torch_backend_with_the_fix():
    result = run_bounded([str(BIN / "hvdtrain"), "doctor"], timeout=240,
                         env=env_without_legacy(KERAS_BACKEND="torch"))
    lines = {line.split("]", 1)[1].strip().split("  ")[0]: line for line in result.output.splitlines()
             if line.startswith("[")}
    assert lines["TensorFlow ops"].startswith("[ok  ]"), result.output
    assert lines["PyTorch ops"].startswith("[ok  ]"), result.output
    assert lines["Keras"].startswith("[FAIL]") and "keras 3." in lines["Keras"], result.output
    assert "torch backend" in lines["Keras"] and "fix: unset KERAS_BACKEND" in result.output
    assert "doctor: FAILED: Keras" in result.output and result.returncode == 1


class _NoKeras:
    """A TensorFlow whose tf.keras cannot be imported (what TensorFlow 2.21 does under KERAS_BACKEND=numpy, or under
    TF_USE_LEGACY_KERAS=1 without tf_keras)."""

    __version__ = "2.21.0"

    @property
    def keras(self):
        raise ImportError("Keras cannot be imported. Check that it is installed.")


@pytest.mark.parametrize("env,says", [
    ({"KERAS_BACKEND": "numpy"}, "KERAS_BACKEND='numpy' is set, and TensorFlow's tf.keras is Keras 3 computing with "
                                 "TensorFlow. Fix: unset KERAS_BACKEND"),
    ({LEGACY_ENV: "1"}, 'fix: pip install "tf-keras==2.21.*" and set TF_USE_LEGACY_KERAS=1'),
])
def test_a_tf_keras_that_cannot_be_imported_names_the_cause(monkeypatch, env, says):
    from hvdtrain.tfkeras import KerasVersionError, keras_info

    for name in ("KERAS_BACKEND", LEGACY_ENV):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(KerasVersionError) as refused:
        keras_info(_NoKeras())  # type: ignore[arg-type]
    assert str(refused.value).startswith("tf.keras cannot be imported (ImportError: Keras cannot be imported.")
    assert says in str(refused.value)
