"""hvdtrain.job.allocation from strings: Slurm's hostlist and tasks-per-node syntax, the allocation a spec runs on, and
`hvdtrain run` refusing to run once per srun task. tests/cluster/test_slurm.py runs the same against real Slurm
daemons."""

from __future__ import annotations

import sys

import pytest

from hvdtrain.cli import main
from hvdtrain.job.allocation import (
    SlurmError,
    allocation_from_env,
    expand_hostlist,
    expand_tasks_per_node,
    srun_task_problem,
)
from hvdtrain.job.hosts import Host
from hvdtrain.job.load import SpecError, load_spec


@pytest.mark.parametrize(("text", "names"), [
    ("node01", ["node01"]),
    ("node[01-03]", ["node01", "node02", "node03"]),
    ("node[8-10]", ["node8", "node9", "node10"]),
    ("node[001-002,7],gpu7", ["node001", "node002", "node7", "gpu7"]),
    ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
    ("a,b[1,3].cluster.local", ["a", "b1.cluster.local", "b3.cluster.local"]),
])
def test_hostlist_expands_as_scontrol_does(text, names):
    assert expand_hostlist(text) == names


@pytest.mark.parametrize(("text", "match"), [
    ("node[01-03", "unbalanced brackets"),
    ("node]1[", "unbalanced brackets"),
    ("node[3-1]", r"the range '3-1' is empty"),
    ("node[a-b]", r"'a-b' in \[a-b\] is not a number"),
    ("a,,b", "an empty entry"),
    ("n[1-99999999]", "too large"),
    ("a[0-9999]b[0-9999]", "more than 65536 nodes"),
    ("a[1-2]b[1-2]c[1-2]", "has 3 bracket groups"),
])
def test_bad_hostlists_name_the_variable_and_value(text, match):
    with pytest.raises(SlurmError, match=match) as info:
        expand_hostlist(text)
    assert f"SLURM_JOB_NODELIST={text!r}" in str(info.value)


@pytest.mark.parametrize(("text", "counts"), [("2", [2]), ("2(x3),1", [2, 2, 2, 1]), ("4(x2)", [4, 4])])
def test_tasks_per_node(text, counts):
    assert expand_tasks_per_node(text) == counts


@pytest.mark.parametrize("text", ["", "0", "2(x0)", "x", "2(3)"])
def test_bad_tasks_per_node(text):
    with pytest.raises(SlurmError, match=r"SLURM_TASKS_PER_NODE=.*is not N or N\(xM\)"):
        expand_tasks_per_node(text or ",")


def alloc_env(nodes: str = "node[01-02]", tasks: str = "2(x2)", **more: str) -> dict[str, str]:
    return {"SLURM_JOB_ID": "77", "SLURM_JOB_NODELIST": nodes, "SLURM_TASKS_PER_NODE": tasks, **more}


def test_allocation_from_env():
    assert allocation_from_env({"PATH": "/bin"}) is None
    alloc = allocation_from_env(alloc_env(tasks="3,1"))
    assert alloc is not None and alloc.hosts == (Host("node01", 3), Host("node02", 1))
    assert alloc.hosts_arg == "node01:3,node02:1"
    assert "Slurm job 77: node01:3,node02:1" in alloc.describe()


@pytest.mark.parametrize(("env", "match"), [
    (alloc_env(tasks="2"), r"names 2 node\(s\) but SLURM_TASKS_PER_NODE='2' gives tasks for 1"),
    ({"SLURM_JOB_ID": "77"}, r"SLURM_JOB_ID=77 is set but SLURM_JOB_NODELIST is not"),
    (alloc_env(nodes="bad_name", tasks="1"), r"'bad_name' is not a valid host name"),
    (alloc_env(SLURM_STEP_ID="0"), r"inside step 77.0 \(srun\), where SLURM_TASKS_PER_NODE describes the step"),
    (alloc_env(SLURM_HET_SIZE="2"), r"Slurm job 77 is heterogeneous"),
])
def test_inconsistent_slurm_env_is_an_error(env, match):
    with pytest.raises(SlurmError, match=match):
        allocation_from_env(env)


def never() -> None:
    raise AssertionError("a spec that names its hosts must not read Slurm's environment")


def test_a_spec_without_hosts_runs_on_the_allocation_and_one_with_hosts_keeps_them():
    alloc = allocation_from_env(alloc_env())
    assert load_spec("script: t.py\nnp: 4\n", "job.yaml", allocation=lambda: alloc).hosts == "node01:2,node02:2"
    assert load_spec("script: t.py\nnp: 3\n", "job.yaml", allocation=lambda: alloc).hosts == "node01:2,node02:2"
    assert load_spec("script: t.py\nnp: 2\nhosts: a:2\n", "job.yaml", allocation=never).hosts == "a:2"
    elastic = load_spec("script: t.py\nnp: 2\nelastic: {discovery_script: d.sh}\n", "job.yaml", allocation=never)
    assert elastic.hosts is None


def test_np_beyond_the_allocation_names_both_and_the_fix():
    with pytest.raises(SpecError) as info:
        load_spec("script: t.py\nnp: 8\n", "job.yaml", allocation=lambda: allocation_from_env(alloc_env()))
    text = str(info.value)
    assert "the Slurm allocation (job 77): np = 8 but the hosts offer only 4 slot(s) (node01:2,node02:2)" in text
    assert "--ntasks=8" in text


def test_srun_task_problem():
    assert srun_task_problem(alloc_env()) is None  # the batch script or salloc shell
    assert srun_task_problem(alloc_env(SLURM_STEP_NUM_TASKS="1", SLURM_STEP_ID="0")) is None  # srun -n1
    problem = srun_task_problem(alloc_env(SLURM_STEP_NUM_TASKS="4", SLURM_STEP_ID="0", SLURM_PROCID="3"))
    assert problem is not None and "task 3 of 4 of Slurm step 77.0" in problem and "once per allocation" in problem


def test_run_refuses_as_one_of_several_srun_tasks_before_reading_the_spec(tmp_path, monkeypatch, capsys):
    for name, value in alloc_env(SLURM_STEP_NUM_TASKS="2", SLURM_STEP_ID="0", SLURM_PROCID="1").items():
        monkeypatch.setenv(name, value)
    assert main(["run", str(tmp_path / "missing.yaml")]) == 2
    err = capsys.readouterr().err
    assert "every task would start the whole job" in err and "missing.yaml" not in err


def test_dry_run_inside_an_allocation_uses_it(tmp_path, monkeypatch, capsys):
    (tmp_path / "t.py").write_text("")
    (tmp_path / "job.yaml").write_text("script: t.py\nnp: 4\ncontroller: gloo\n")
    for name, value in alloc_env().items():
        monkeypatch.setenv(name, value)
    assert main(["run", str(tmp_path / "job.yaml"), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("# hosts from Slurm job 77: node01:2,node02:2 (SLURM_JOB_NODELIST=node[01-02], ")
    assert " -np 4 -H node01:2,node02:2 --gloo " in out
    assert main(["run", str(tmp_path / "job.yaml"), "--dry-run", "-o", "np=5"]) == 2
    assert "np = 5 but the hosts offer only 4 slot(s)" in capsys.readouterr().err


@pytest.mark.parametrize(("spec", "env", "match"), [
    ("script: t.py\nnp: 2\n", {}, "--launcher srun starts the ranks on a Slurm allocation's nodes"),
    ("script: t.py\nnp: 2\nhosts: a:2\n", alloc_env(), "for a spec that sets no hosts or hostfile"),
    ("script: t.py\nnp: 2\nhorovod: {cycle_time_ms: 2}\n", alloc_env(),
     r"cannot apply horovod.cycle_time_ms: they are horovodrun settings"),
    ("script: t.py\nnp: 2\ncontroller: gloo\n", alloc_env(), r"cannot apply controller: gloo"),
])
def test_srun_launcher_errors(tmp_path, monkeypatch, capsys, spec, env, match):
    (tmp_path / "t.py").write_text("")
    (tmp_path / "job.yaml").write_text(spec)
    for name in ("SLURM_JOB_ID", "SLURM_STEP_NUM_TASKS"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert main(["run", str(tmp_path / "job.yaml"), "--launcher", "srun", "--dry-run"]) == 2
    assert match in capsys.readouterr().err


def test_srun_plan_puts_every_rank_under_the_supervisor(tmp_path, monkeypatch, capsys):
    (tmp_path / "t.py").write_text("")
    (tmp_path / "job.yaml").write_text("script: t.py\nnp: 4\nargs: [--x, 'a b']\nenv: {A: '1'}\n")
    for name, value in alloc_env(SLURM_CPUS_PER_TASK="3").items():  # sbatch --cpus-per-task=3: srun does not inherit it
        monkeypatch.setenv(name, value)
    assert main(["run", str(tmp_path / "job.yaml"), "--launcher", "srun", "--srun-mpi", "pmi2", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert (f"srun --label --disable-status --export=ALL --ntasks=4 --mpi=pmi2 --kill-on-bad-exit=1 "
            f"--cpus-per-task=3 {sys.executable} -m hvdtrain.rank ") in out
    assert "\nA=1\nHVDTRAIN_SLURM_SIGNALS=1\n" in out and "--x 'a b'" in out
    (tmp_path / "job.yaml").write_text("script: t.py\nnp: 3\n")  # fewer ranks than tasks: srun would spread them
    assert main(["run", str(tmp_path / "job.yaml"), "--launcher", "srun", "--dry-run"]) == 2
    assert "runs one rank per task of the allocation: np = 3 but it has 4 task(s)" in capsys.readouterr().err


def test_a_large_job_without_hosts_fits_a_large_allocation():
    alloc = allocation_from_env(alloc_env(nodes="n[1-3]", tasks="4096(x3)"))
    assert load_spec("script: t.py\nnp: 12288\n", "job.yaml", allocation=lambda: alloc).hosts == \
        "n1:4096,n2:4096,n3:4096"
    with pytest.raises(SpecError, match="with no hosts or hostfile every rank runs on this machine"):
        load_spec("script: t.py\nnp: 12288\n", "job.yaml")
