"""A job starts without what it does not need (issue 35 items 1 and 2).

- No process of a PyTorch job imports TensorFlow, though it is installed: a real `hvdtrain run` of the PyTorch
  recipe (with TensorBoard on rank 0) with a `tensorflow` package first on PYTHONPATH that records every process
  importing it (launcher, horovodrun, supervisors, ranks, producers all inherit PYTHONPATH).
- hvdtrain-horovodrun (hvdtrain.launch.hvdrun) answers horovodrun's build checks from hvdtrain's probe: checked
  through horovodrun's own `run_controller`, the code path that asks them.
- TensorFlow's start-up lines are filtered by TF_CPP_MIN_LOG_LEVEL (hvdtrain.tfkeras), on the lines TensorFlow 2.21
  prints, and through a real file-descriptor 2 in a child process.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from horovod.runner import launch

from hvdtrain import tfkeras
from hvdtrain.launch import hvdrun
from tests.support.harness import BIN, REPO, expect_ok, run_bounded

FAKE_TF = '''
import os, sys
with open(os.path.join(os.environ["TF_IMPORT_MARKS"], f"import.{os.getpid()}"), "w") as f:
    f.write(" ".join(sys.argv))
raise ImportError("this test's tensorflow records who imports it")
'''
TF_NOISE = ("absl::InitializeLog", "oneDNN", "cudart", "cpu_feature_guard", "cuInit", "tensorflow")


@pytest.mark.slow
def test_a_pytorch_job_imports_tensorflow_in_no_process(tmp_path: Path) -> None:
    (tmp_path / "site" / "tensorflow").mkdir(parents=True)
    (tmp_path / "site" / "tensorflow" / "__init__.py").write_text(FAKE_TF)
    marks, run_dir = tmp_path / "marks", tmp_path / "run"
    marks.mkdir()
    job = tmp_path / "job.yaml"
    job.write_text(f"script: {REPO / 'recipes' / 'pytorch_train.py'}\nnp: 2\n"
                   f"args: [--dataset, digits, --epochs, '1', --run-dir, '{run_dir}']\n")
    res = expect_ok(run_bounded([str(BIN / "hvdtrain"), "run", str(job)], timeout=240,
                                env={"PYTHONPATH": str(tmp_path / "site"), "TF_IMPORT_MARKS": str(marks),
                                     "HVDTRAIN_CACHE_DIR": str(tmp_path / "cache")}))
    assert "hvdtrain-horovodrun -np 2" in res.output.splitlines()[0], res.describe()
    assert "done: 1/1 epochs" in res.output, res.describe()
    imported = {p.name: p.read_text() for p in marks.iterdir()}
    assert imported == {}, f"processes that imported tensorflow: {imported}"
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*")), "rank 0 wrote no TensorBoard events"
    assert not [line for line in res.output.splitlines() if any(word in line for word in TF_NOISE)], res.describe()
    # rank 0 says how long the first step took to come, from `hvdtrain run`'s start (hvdtrain/train/startup.py)
    said = [line for line in res.output.splitlines() if line.startswith("[0]<stdout>:first step ")]
    assert len(said) == 1 and " s after `hvdtrain run` started: launcher " in said[0], res.describe()
    startup = json.loads((run_dir / "summary.json").read_text())["startup"]
    assert startup["from"] == "launched" and list(startup["parts_s"]) == [
        "launcher", "imports", "rendezvous", "setup", "data", "model", "logging", "first batch", "first step"]
    assert all(s >= 0 for s in startup["parts_s"].values())
    assert startup["total_s"] == pytest.approx(sum(startup["parts_s"].values()), abs=0.01)


@pytest.mark.parametrize("built", [{"gloo": True, "mpi": False}, {"gloo": False, "mpi": True}])
def test_horovodruns_build_checks_take_the_probes_answer(monkeypatch, built: dict[str, bool]) -> None:
    for name in hvdrun.CHECKS:  # restored after the test: the module is shared with the rest of the session
        monkeypatch.setattr(launch, f"{name}_built", getattr(launch, f"{name}_built"))
    assert hvdrun.install_build_answers(launch, {**built, "nccl": False})
    ran: list[str] = []
    for controller in ("gloo", "mpi"):
        use = {"use_gloo": controller == "gloo", "use_mpi": controller == "mpi"}
        if built[controller]:
            launch.run_controller(use["use_gloo"], lambda: ran.append("gloo"), use["use_mpi"],
                                  lambda: ran.append("mpi"), False, lambda: None, 0)
        else:
            with pytest.raises(ValueError, match=f"{controller.upper() if controller == 'mpi' else 'Gloo'} "
                                                 "support has not been built"):
                launch.run_controller(use["use_gloo"], lambda: ran.append("gloo"), use["use_mpi"],
                                      lambda: ran.append("mpi"), False, lambda: None, 0)
    assert ran == [name for name in ("gloo", "mpi") if built[name]]


def test_without_the_probes_answer_horovodruns_own_checks_stay() -> None:
    class Launch:
        gloo_built = mpi_built = staticmethod(lambda verbose=False: "horovod's own")

    assert not hvdrun.install_build_answers(Launch, {})  # the probe found no framework that loads
    assert Launch.gloo_built() == Launch.mpi_built() == "horovod's own"


# TensorFlow 2.21's lines on a CPU machine, as `import tensorflow` and its first device query print them.
BANNER = "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR"
ONEDNN = ("I0000 00:00:1795815185.703504   18107 port.cc:153] oneDNN custom operations are on. You may see slightly "
          "different numerical results due to floating-point round-off errors from different computation orders.")
CUDART = ("I0000 00:00:1795815185.703875   18107 cudart_stub.cc:31] Could not find cuda drivers on your machine, GPU "
          "will not be used.")
CUINIT = ("E0000 00:00:1795815217.175992   18125 cuda_platform.cc:52] failed call to cuInit: INTERNAL: CUDA error: "
          "Failed call to cuInit: UNKNOWN ERROR (303)")
WARN = "W0000 00:00:1795815217.175992   18125 some_op.cc:12] a real warning"
OTHER_ERROR = "E1127 21:30:05.326000   18125 gpu_device.cc:2342] Cannot dlopen some GPU libraries."
PYTHON_LINE = "WARNING:tensorflow:Callback method `on_train_batch_end` is slow compared to the batch time"


@pytest.mark.parametrize("level, gpu_driver, kept", [
    (0, False, [BANNER, ONEDNN, CUDART, CUINIT, WARN, OTHER_ERROR, PYTHON_LINE]),  # TensorFlow's default: all
    (1, False, [WARN, OTHER_ERROR, PYTHON_LINE]),
    (1, True, [CUINIT, WARN, OTHER_ERROR, PYTHON_LINE]),  # a GPU machine whose CUDA fails: that error matters
    (2, False, [OTHER_ERROR, PYTHON_LINE]),
    (3, True, [PYTHON_LINE]),
])
def test_startup_lines_kept_at_each_log_level(level: int, gpu_driver: bool, kept: list[str]) -> None:
    lines = [BANNER, ONEDNN, CUDART, CUINIT, WARN, OTHER_ERROR, PYTHON_LINE]
    assert [line for line in lines if tfkeras.keeps(line, level, gpu_driver)] == kept


FILTERED_CHILD = textwrap.dedent('''
    import os, sys
    from hvdtrain import tfkeras
    print("before", file=sys.stderr, flush=True)
    with tfkeras.startup_lines_filtered({"TF_CPP_MIN_LOG_LEVEL": sys.argv[1]}):
        os.write(2, (sys.argv[2] + "\\n" + sys.argv[3] + "\\n").encode())  # as C++ code writes: fd 2 itself
        print("python inside", file=sys.stderr)
        os.write(2, b"no newline at the end")
    print("", file=sys.stderr)
    os.write(2, (sys.argv[2] + "\\n").encode())  # after the block: nothing is filtered
''')


@pytest.mark.parametrize("level", ["1", "0"])
def test_filtering_happens_on_file_descriptor_2_and_only_inside_the_block(level: str) -> None:
    proc = subprocess.run([sys.executable, "-c", FILTERED_CHILD, level, ONEDNN, WARN], capture_output=True,
                          text=True, timeout=60, check=True)
    inside = [ONEDNN, WARN] if level == "0" else [WARN]
    assert proc.stderr.splitlines() == ["before", *inside, "python inside", "no newline at the end", ONEDNN]


C_WRITES = textwrap.dedent('''
    import ctypes, os, sys
    from hvdtrain import tfkeras
    libc = ctypes.PyDLL(None)  # PyDLL: the GIL stays held during the call, as in TensorFlow's C++ start-up
    big = (sys.argv[1] + "\\n").encode() * 2000  # ~230 KB: more than a pipe holds
    fatal = b"F0000 00:00:1795815217.175992   18125 port.cc:12] the CPU lacks AVX\\n"
    with tfkeras.startup_lines_filtered({"TF_CPP_MIN_LOG_LEVEL": "1"}):
        libc.write(2, big, len(big))
        libc.write(2, fatal, len(fatal))
        if sys.argv[2] == "abort":
            libc.abort()
    print("after the block", file=sys.stderr)
''')


@pytest.mark.parametrize("ending", ["abort", "return"])
def test_c_code_holding_the_gil_never_blocks_and_a_fatal_line_survives_an_abort(ending: str) -> None:
    proc = subprocess.run([sys.executable, "-c", C_WRITES, ONEDNN, ending], capture_output=True, text=True,
                          timeout=60)
    lines = proc.stderr.splitlines()
    assert ONEDNN not in lines and "F0000 00:00:1795815217.175992   18125 port.cc:12] the CPU lacks AVX" in lines
    if ending == "abort":
        assert proc.returncode == -6 and "after the block" not in lines
    else:
        assert proc.returncode == 0 and lines[-1] == "after the block"


@pytest.mark.parametrize("gone", ["sys.stderr = None", "os.close(2)"])
def test_without_a_stderr_the_block_just_runs(gone: str) -> None:
    code = (f"import os, sys\nfrom hvdtrain import tfkeras\n{gone}\n"
            "with tfkeras.startup_lines_filtered({'TF_CPP_MIN_LOG_LEVEL': '1'}):\n    print('ran', flush=True)\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert (run.returncode, run.stdout) == (0, "ran\n"), run.stderr
