"""The venv scripts/setup.sh makes is where users run their own Horovod scripts and test suites, not only ours:
nothing installed for hvdtrain's own tests may change how a user's pytest run behaves."""

from __future__ import annotations

from tests.support.harness import BIN, run_bounded

# pytest plugins the venv may hold: each does nothing unless asked (--timeout / a timeout ini key; --reverse).
INERT_PLUGINS = {"timeout", "reverse"}


def test_only_inert_pytest_plugins_are_installed():
    """Asked of a fresh interpreter, as a user's pytest sees the venv: in this process, an import of setuptools puts
    its _vendor folder (typeguard's plugin) on sys.path, and scripts/test_order.sh's random run adds pytest-randomly's
    folder to PYTHONPATH."""
    code = ("import importlib.metadata as m; "
            "print(' '.join(sorted(ep.name for ep in m.entry_points(group='pytest11'))))")
    job = run_bounded([str(BIN / "python"), "-c", code], timeout=60, env={"PYTHONPATH": ""})
    assert job.returncode == 0, job.describe()
    plugins = set(job.output.split())
    assert "timeout" in plugins, f"pytest-timeout (the dev extra) not seen: the check sees nothing\n{job.describe()}"
    assert "randomly" not in plugins, "pytest-randomly reorders every pytest run in this venv (see pyproject.toml)"
    assert plugins <= INERT_PLUGINS, f"new pytest plugins {sorted(plugins - INERT_PLUGINS)}: are they inert?"


def test_a_users_pytest_run_keeps_its_order(tmp_path):
    """Ranks of a distributed test suite must collect the same order, or their collectives mismatch and hang."""
    (tmp_path / "test_user.py").write_text("".join(f"def test_{n}():\n    pass\n\n" for n in "abcdefgh"))
    job = run_bounded([str(BIN / "python"), "-m", "pytest", "-v", "-p", "no:cacheprovider", "test_user.py"],
                      timeout=120, cwd=tmp_path,  # outside the repository: none of our pytest options apply
                      env={"PYTHONPATH": ""})  # nor test_order.sh's plugin path
    assert job.returncode == 0, job.describe()
    assert "randomly" not in job.output and "rootdir: " + str(tmp_path) in job.output, job.describe()
    ran = [line.split("::")[1].split()[0] for line in job.output.splitlines() if "::test_" in line]
    assert ran == [f"test_{n}" for n in "abcdefgh"], job.describe()
