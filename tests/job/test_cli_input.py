"""Bad input through the real CLI: files that are not UTF-8 text in every command that reads one, and `validate`
agreeing with `run --dry-run` (the same verdict, the same message) on specs that are wrong in every way."""

from __future__ import annotations

import pytest

from tests.support.harness import BIN, REPO, run_bounded

HVDTRAIN = str(BIN / "hvdtrain")
RECIPE = REPO / "recipes" / "pytorch_train.py"
NOT_UTF8 = {
    "latin1": f"script: {RECIPE}\nnp: 2\nenv: {{NAME: caf\xe9}}\n".encode("latin-1"),
    "utf16": f"script: {RECIPE}\nnp: 2\n".encode("utf-16"),
    "binary": (BIN / "python").resolve().read_bytes()[:4096],
}
READS_A_SPEC = {
    "validate": ["validate"], "dry-run": ["run", "--dry-run"], "run": ["run"],
    "render-k8s": ["render", "k8s"], "render-slurm": ["render", "slurm"],
}


def _cli(args: list[str], cwd=None):
    return run_bounded([HVDTRAIN, *args], timeout=60, cwd=cwd)


@pytest.mark.parametrize("command", sorted(READS_A_SPEC))
@pytest.mark.parametrize("kind", sorted(NOT_UTF8))
def test_a_spec_that_is_not_utf8_is_exit_2_with_one_message(kind, command, tmp_path):
    job = tmp_path / "job.yaml"
    job.write_bytes(NOT_UTF8[kind])
    sub = READS_A_SPEC[command]
    res = _cli([*sub, str(job)] if sub[0] == "render" else [sub[0], str(job), *sub[1:]])
    assert res.returncode == 2, res.describe()
    assert f"{job}:" in res.output and "cannot read the spec: not UTF-8 text" in res.output, res.describe()
    assert "fix: " in res.output and "Traceback" not in res.output, res.describe()
    assert "hvdtrain: starting" not in res.output


@pytest.mark.parametrize("command", sorted(READS_A_SPEC))
def test_a_hostfile_that_is_not_utf8_is_exit_2_naming_the_spec_line(command, tmp_path):
    (tmp_path / "hosts.txt").write_bytes("localhost slots=2  # caf\xe9\n".encode("latin-1"))
    job = tmp_path / "job.yaml"
    job.write_text(f"script: {RECIPE}\nnp: 2\nhostfile: hosts.txt\n")
    sub = READS_A_SPEC[command]
    res = _cli([*sub, str(job)] if sub[0] == "render" else [sub[0], str(job), *sub[1:]])
    assert res.returncode == 2, res.describe()
    assert f"{job}:3: hostfile: cannot read the hostfile: not UTF-8 text: byte 0xE9 at line 1" in res.output
    assert "Traceback" not in res.output


@pytest.mark.parametrize("kind", sorted(NOT_UTF8))
def test_doctor_hostfile_that_is_not_utf8_is_exit_2(kind, tmp_path):
    hostfile = tmp_path / "hosts.txt"
    hostfile.write_bytes(NOT_UTF8[kind])
    res = _cli(["doctor", "--hostfile", str(hostfile)])
    assert res.returncode == 2, res.describe()
    assert f"{hostfile}: cannot read the hostfile: not UTF-8 text" in res.output
    assert "save it as UTF-8" in res.output or "use a text file" in res.output
    assert "Traceback" not in res.output


# Specs `run --dry-run` refuses, each for a different reason; `validate` must refuse each with the same words.
REFUSED = {
    "np_beyond_one_host": "np: 100000\n",
    "np_beyond_hosts": "np: 5\nhosts: a:2,b:2\n",
    "bad_host": "np: 2\nhosts: 'a b:2'\n",
    "slots_out_of_range": "np: 2\nhosts: a:5000\n",
    "min_np_above_np": "np: 2\nelastic: {discovery_script: d.sh, min_np: 3}\n",
    "unknown_key": "np: 2\nhorovod: {cycle_time: 2}\n",
    "modeled_flag": "np: 2\nextra_args: ['-np', '4']\n",
    "missing_script": "np: 2\nscript: nowhere.py\n",
    "console_rank": "np: 2\nlogs: {console_ranks: [5]}\n",
    "null_env": "np: 2\nenv: {A: ~}\n",
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_validate_refuses_what_dry_run_refuses_with_the_same_message(case, tmp_path):
    body = REFUSED[case]
    job = tmp_path / "job.yaml"
    job.write_text(("" if "script:" in body else f"script: {RECIPE}\n") + "controller: gloo\n" + body)
    validate = _cli(["validate", str(job)])
    dry_run = _cli(["run", str(job), "--dry-run"])
    assert validate.returncode == dry_run.returncode == 2, validate.describe() + dry_run.describe()
    assert validate.output == dry_run.output, validate.describe() + dry_run.describe()
    first = validate.output.splitlines()[1]
    assert first.startswith(f"{job}:"), validate.describe()  # every problem carries file:line
    assert "Traceback" not in validate.output


def test_validate_accepts_what_dry_run_accepts(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text(f"script: {RECIPE}\ncontroller: gloo\nnp: 4096\nargs: [--run-dir, 1:30]\nenv: {{MASK: 0x1F}}\n")
    validate, dry_run = _cli(["validate", str(job)]), _cli(["run", str(job), "--dry-run"])
    assert validate.returncode == dry_run.returncode == 0, validate.describe() + dry_run.describe()
    assert validate.output.startswith(f"{job}: OK — np=4096, hosts=localhost:4096")
    assert dry_run.output.splitlines()[1].endswith(f"{RECIPE} --run-dir 1:30")
    assert "MASK=0x1F" in dry_run.output.splitlines()
