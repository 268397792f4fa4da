"""Plain `horovodrun` on this build (the patched 0.28.1), as a user types it: its build probe, an elastic job on one
host, and the elastic timeout's message.

0.28.1 imported TensorFlow (then torch) in a forked process for each build question it asked before a job (seconds
each, and TensorFlow's start-up lines on a PyTorch job's console); the patch asks one extension once, PyTorch's
first, and keeps the answer on disk keyed by the extensions' files (the patch's note "The build probe" in
horovod/common/util.py). Its speed against `hvdtrain run` is P5 in docs/performance.md.
"""

from __future__ import annotations

import json
import os
import shlex
import stat
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.support.harness import BIN, HOROVODRUN, REPO, expect_ok, horovodrun, run_bounded

SCRIPTS = REPO / "tests" / "scripts"
pytestmark = pytest.mark.slow
TENSORFLOW_LINES = ("oneDNN", "cuda_", "cudart", "absl::", "tensorflow")
FLAGS = {"mpi_built": True, "gloo_built": True, "nccl_built": 0, "ddl_built": False, "ccl_built": False}


def ask(question: str, cache: Path, *, no_fork: bool = False) -> str:
    """`horovod.common.util.<question>()` in a fresh interpreter; with no_fork, probing (a forked process) fails."""
    code = ("import multiprocessing, sys\n"
            + ("multiprocessing.get_context = None  # any probe would fail here\n" if no_fork else "")
            + f"from horovod.common import util\nprint('ANSWER', util.{question}())\n")
    job = run_bounded([str(BIN / "python"), "-c", code], timeout=120,
                      env={**os.environ, "HOROVOD_BUILD_CACHE_DIR": str(cache)})
    assert job.returncode == 0, job.describe()
    return job.output.split("ANSWER ", 1)[1].split()[0]


def test_plain_horovodrun_probes_the_build_once_without_tensorflow_and_stays_quiet(tmp_path):
    cache, out = tmp_path / "cache", tmp_path / "out"
    out.mkdir()
    job = expect_ok(horovodrun(SCRIPTS / "allreduce_mean.py", str(out), plain=True,
                               env={"HOROVOD_BUILD_CACHE_DIR": str(cache)}))
    noise = [line for line in job.output.splitlines() if any(word in line for word in TENSORFLOW_LINES)]
    assert not noise, f"TensorFlow's start-up lines on a PyTorch job's console:\n{job.describe()}"
    assert sorted(p.name for p in out.glob("result.*.json")) == ["result.0.json", "result.1.json"], job.describe()
    (answers,) = cache.glob("build-flags-*.json")
    cached = json.loads(answers.read_text())
    assert cached["flags"] == FLAGS and cached["extension"] == "torch", cached  # asked once, PyTorch's extension
    assert {Path(path).parent.name for path, _size, _mtime in cached["files"]} == {"torch", "tensorflow"}
    # The next launch reads that file: no probe (a forked process would fail here).
    assert ask("gloo_built", cache, no_fork=True) == "True"
    # The answer is the file's, for the files it names...
    answers.write_text(json.dumps({**cached, "flags": {**FLAGS, "mpi_built": False}}))
    assert ask("mpi_built", cache, no_fork=True) == "False"
    # ...and a rebuilt Horovod (other extension files) is probed again, not answered from a stale file.
    answers.write_text(json.dumps({"files": [["/elsewhere/mpi_lib.so", 1, 1]], "flags": {**FLAGS, "mpi_built": False}}))
    assert ask("mpi_built", cache) == "True"


def test_an_elastic_job_on_this_host_alone_starts_without_network_interface(tmp_path):
    """0.28.1 waited the whole --elastic-timeout for a second host to resolve interfaces with, then failed
    "Timed out waiting for {activity}"; now this machine's interfaces are used at once, and it says so."""
    discover = tmp_path / "discover.sh"
    discover.write_text("#!/bin/sh\nprintf 'localhost:2\\n'\n")
    discover.chmod(discover.stat().st_mode | stat.S_IXUSR)
    argv = [str(HOROVODRUN), "-np", "2", "--min-np", "2", "--max-np", "2", "--host-discovery-script", str(discover),
            "--elastic-timeout", "60", str(BIN / "python"), str(SCRIPTS / "allreduce_mean.py"), str(tmp_path)]
    job = run_bounded(argv, timeout=120)
    assert job.returncode == 0, job.describe()
    results = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("result.*.json"))]
    assert [r["sum"] for r in results] == [[1.0, 12.0]] * 2, job.describe()
    assert "every host discovered so far (localhost) is this machine: using its interface" \
        in job.output and "--network-interface" in job.output, job.describe()


def test_the_elastic_timeout_names_what_it_waited_for():
    from horovod.runner.common.util.timeout import TimeoutException
    from horovod.runner.elastic.discovery import FixedHosts
    from horovod.runner.elastic.driver import ElasticDriver

    rendezvous = SimpleNamespace(stop=lambda: None)  # not what this is about: the driver only stops it
    driver = ElasticDriver(rendezvous, FixedHosts({"localhost": 1}), min_num_proc=2, max_num_proc=2, timeout=1)
    try:
        with pytest.raises(TimeoutException) as raised:
            driver.wait_for_available_slots(2)
    finally:
        driver.stop()
    assert str(raised.value).startswith("Timed out waiting for minimum number of slots to become available. "
                                        "Please check that you have enough resources to run at least 2 Horovod "
                                        "processes."), raised.value


def test_a_rank_that_ends_on_horovodruns_sigterm_is_reported_with_its_own_exit_code_at_once(tmp_path):
    """horovodrun's teardown of a rank (safe_shell_exec): 0.28.1 froze the rank's shell (SIGSTOP) as soon as the
    shell's child had ended, so a shell still finishing (as hvdtrain's rank supervisor writes its record) could
    not act on the SIGTERM that followed: SIGKILLed 5 s later and reported as `exit with status code 137`, for a
    rank that had checkpointed and exited 75 (a Ctrl-C took 7-10 s). The patch waits for such a shell to end."""
    import threading
    import time

    from horovod.runner.common.util import safe_shell_exec

    ready = tmp_path / "ready"
    rank = shlex.join([str(BIN / "python"), "-c", "import signal, sys, time\n"
                       "signal.signal(signal.SIGTERM, lambda *_: sys.exit(75))\n"
                       f"open({str(ready)!r}, 'w').close()\ntime.sleep(60)"])
    stop, stopped_at = threading.Event(), []

    def stop_once_ready() -> None:  # horovodrun's own stop (its terminate_all_event), once the rank handles SIGTERM
        deadline = time.monotonic() + 60
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        stopped_at.append(time.monotonic())
        stop.set()

    threading.Thread(target=stop_once_ready, daemon=True).start()
    code = safe_shell_exec.execute(f"{rank}; code=$?; sleep 0.3; exit $code", events=[stop])
    took = time.monotonic() - stopped_at[0]
    assert code == 75 and took < 2.5, (code, took)  # 0.28.1: 137 after 5 s more
