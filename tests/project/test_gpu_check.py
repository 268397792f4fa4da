"""The parts of the GPU path that need no GPU: scripts/gpu_vendor.sh (the real sdist and wheels, fetched), the argument
handling, vendor-folder checks and build flags of scripts/gpu_check.sh, its report, and setup.sh's --gpu option.
(The GPU steps themselves run only on a GPU machine: `bash scripts/gpu_check.sh --out DIR`.)"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tarfile
import tomllib
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet

ROOT = Path(__file__).resolve().parents[2]
CHECK = ROOT / "scripts" / "gpu_check.sh"
HOROVOD_SHA256 = "92a43f5a94c43907a56805bad15f19700c62ffc83b7ca483f9e104e229f67ef0"


def sh(*args: str | Path, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", *map(str, args)], capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env={**os.environ, **(env or {})}, stdin=subprocess.DEVNULL)


@pytest.fixture(scope="module")
def vendor(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A vendor folder made by the real command (the sdist from .build/ or PyPI, the wheels from PyPI)."""
    d = tmp_path_factory.mktemp("vendor")
    r = sh(ROOT / "scripts" / "gpu_vendor.sh", d, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    return d


@pytest.mark.slow
def test_vendor_folder_holds_the_checked_sdist_and_python_312_wheels(vendor: Path) -> None:
    sdist = vendor / "horovod-0.28.1.tar.gz"
    assert hashlib.sha256(sdist.read_bytes()).hexdigest() == HOROVOD_SHA256
    wheels = sorted(p.name for p in (vendor / "wheels").glob("*.whl"))
    names = {w.split("-")[0].lower() for w in wheels}
    assert {"pydantic", "pydantic_core", "zstandard", "obstore", "cffi"} <= names, wheels  # cffi: Horovod's build
    assert all("cp312" in w or "abi3" in w or "py3-none" in w for w in wheels), wheels
    listed = {line.split()[1] for line in (vendor / "MANIFEST").read_text().splitlines()}
    assert listed == {"horovod-0.28.1.tar.gz", *(f"wheels/{w}" for w in wheels)}


def test_the_project_patch_applies_to_the_vendored_sdist(vendor: Path, tmp_path: Path) -> None:
    with tarfile.open(vendor / "horovod-0.28.1.tar.gz") as tar:
        tar.extractall(tmp_path, filter="data")
    patch = ROOT / "scripts" / "patches" / "horovod-0.28.1.patch"
    r = subprocess.run(["patch", "--dry-run", "-p1", "-d", str(tmp_path / "horovod-0.28.1"), "-i", str(patch)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "FAILED" not in r.stdout, r.stdout + r.stderr


def test_the_patched_sources_include_every_header_gcc_13_no_longer_brings_in(vendor: Path, tmp_path: Path) -> None:
    """The first GPU machine (GCC 13, CUDA 13) failed to build the unpatched group_table.h and common.h, which GCC 12
    builds: the patch must add what libstdc++ 13 stopped including for them (scripts/horovod_includes.py)."""
    with tarfile.open(vendor / "horovod-0.28.1.tar.gz") as tar:
        tar.extractall(tmp_path, filter="data")
    src = tmp_path / "horovod-0.28.1"
    check = [sys.executable, str(ROOT / "scripts" / "horovod_includes.py"), str(src)]
    before = subprocess.run(check, capture_output=True, text=True, timeout=60)
    assert before.returncode == 1, before.stdout + before.stderr
    assert "horovod/common/group_table.h: uses names from <string>" in before.stdout, before.stdout
    assert "horovod/common/common.h: uses names from <stdexcept>" in before.stdout, before.stdout
    subprocess.run(["patch", "-p1", "--quiet", "-d", str(src), "-i",
                    str(ROOT / "scripts" / "patches" / "horovod-0.28.1.patch")], check=True, timeout=60)
    after = subprocess.run(check, capture_output=True, text=True, timeout=60)
    assert after.returncode == 0 and after.stdout == "", after.stdout + after.stderr


def test_dry_run_prints_the_nccl_build_flags(vendor: Path) -> None:
    r = sh(CHECK, "--dry-run", "--vendor", vendor, "--skip", "racecheck,keras",
           env={"HOROVOD_BUILD_CUDA_CC_LIST": "90"})
    assert r.returncode == 0, r.stderr
    build = next(line for line in r.stdout.splitlines() if line.startswith("build:")).split()
    for flag in ("HOROVOD_GPU_OPERATIONS=NCCL", "HOROVOD_NCCL_LINK=SHARED", "HOROVOD_WITH_PYTORCH=1",
                 "HOROVOD_WITHOUT_TENSORFLOW=1", "HOROVOD_WITH_GLOO=1", "HOROVOD_BUILD_CUDA_CC_LIST=90",
                 "CMAKE_POLICY_VERSION_MINIMUM=3.5"):
        assert flag in build, (flag, build)
    steps = next(line for line in r.stdout.splitlines() if line.startswith("steps:")).split()[1:]
    assert steps == ["env", "venv", "build", "collectives", "recipe", "feed", "decode", "jpeg", "prefetch", "h2d"]


def test_a_tampered_vendor_folder_is_refused_naming_the_file(vendor: Path, tmp_path: Path) -> None:
    copy = tmp_path / "vendor"
    subprocess.run(["cp", "-r", str(vendor), str(copy)], check=True)
    wheel = next((copy / "wheels").glob("pydantic-*.whl"))
    wheel.write_bytes(wheel.read_bytes()[:-10])
    r = sh(CHECK, "--dry-run", "--vendor", copy)
    assert r.returncode == 2 and wheel.name in r.stderr and "gpu_vendor.sh" in r.stderr, r.stderr
    (copy / "MANIFEST").unlink()
    r = sh(CHECK, "--dry-run", "--vendor", copy)
    assert r.returncode == 2 and "MANIFEST" in r.stderr and "gpu_vendor.sh" in r.stderr, r.stderr


@pytest.mark.parametrize(("args", "named"), [
    (["--bogus"], "'--bogus'"),
    (["--out"], "--out needs a value"),
    (["--skip", "build,nope"], "'nope'"),
    (["--only", "Build"], "'Build'"),
    (["--python", "/no/such/python3"], "/no/such/python3"),
])
def test_bad_arguments_exit_2_naming_them(args: list[str], named: str) -> None:
    r = sh(CHECK, *args)
    assert r.returncode == 2 and named in r.stderr and r.stdout == "", (r.stdout, r.stderr)


def test_without_a_gpu_nothing_is_built_and_the_exit_code_says_so(vendor: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    r = sh(CHECK, "--vendor", vendor, "--out", out)
    assert r.returncode == 3 and "no NVIDIA GPU" in r.stderr and "--build-only" in r.stderr, r.stderr
    assert not out.exists()


def test_help_lists_every_step() -> None:
    r = sh(CHECK, "--help")
    assert r.returncode == 0
    for step in ("env", "venv", "build", "collectives", "recipe", "feed", "prefetch", "h2d", "racecheck", "keras"):
        assert f"\n  {step} " in r.stdout, step


def test_report_fails_on_a_failed_or_timed_out_step_and_passes_on_skips(tmp_path: Path) -> None:
    work, out = tmp_path / "work", tmp_path / "out"
    work.mkdir(), out.mkdir()
    tsv = work / "steps.tsv"
    report = [sys.executable, str(ROOT / "scripts" / "gpu_report.py"), str(tsv), str(out)]
    tsv.write_text("env\tpass\t1200\t0\tH100\nkeras\tskipped\t50\t77\tno TensorFlow\n")
    r = subprocess.run(report, capture_output=True, text=True, timeout=30)
    assert r.returncode == 0 and "ALL PASSED" in r.stdout and "no TensorFlow" in r.stdout, r.stdout + r.stderr
    tsv.write_text(tsv.read_text() + "h2d\ttimeout\t240000\t124\t\n")
    r = subprocess.run(report, capture_output=True, text=True, timeout=30)
    assert r.returncode == 1 and "FAILED" in r.stdout
    assert (out / "gpu_check.json").read_text().count('"status": "timeout"') == 1


def test_setup_gpu_option_is_documented_and_unknown_options_are_refused() -> None:
    setup = ROOT / "scripts" / "setup.sh"
    r = sh(setup, "--help")
    assert r.returncode == 0 and "--gpu" in r.stdout and "HOROVOD_GPU_OPERATIONS=NCCL" in r.stdout
    r = sh(setup, "--cuda")
    assert r.returncode == 2 and "'--cuda'" in r.stderr and "--gpu" in r.stderr


def test_python_312_is_admitted_and_311_stays() -> None:
    spec = SpecifierSet(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"])
    assert "3.11.7" in spec and "3.12.3" in spec and "3.10.12" not in spec


def test_step_notes_carry_the_h200_runs_headline_numbers_and_survive_a_missing_file(tmp_path: Path) -> None:
    """The h2d and recipe notes of summary.txt, made from the JSON the 2026-11-26 H200 run wrote (bench/results/)."""
    results = ROOT / "bench" / "results" / "gpu-h200-2026-11-26"

    def numbers(kind: str, path: Path) -> str:
        r = sh("-c", f'source scripts/gpu_steps.sh; numbers {kind} "$1"', "numbers", path, env={"VPY": sys.executable})
        assert r.returncode == 0, r.stderr
        return r.stdout.strip()

    h2d = numbers("h2d", results / "h2d_overlap.json")
    assert h2d.startswith("large 1.006x resident (goal <= 1.02 met), host wait in next() 22.9% of step "
                          "(goal <= 1% NOT met); imagenet 1.004x resident"), h2d
    assert numbers("recipe", results / "recipe_summary.json") == "15273 samples/s, data wait 18.0% of step"
    (tmp_path / "odd.json").write_text("{}")
    assert numbers("recipe", tmp_path / "odd.json") == "no numbers"
    assert numbers("h2d", tmp_path / "missing.json") == "no numbers"
    (tmp_path / "empty.json").write_text('{"workloads": {}}')
    assert numbers("h2d", tmp_path / "empty.json") == "no numbers"
