"""What the console shows (NOTE [console] in hvdtrain/launch/console.py): hvdtrain's summary, not horovodrun's
traceback.

- in-process: the router fed the lines real horovodrun runs printed (Gloo's rank failure, an interrupted start);
  what reaches the console, what reaches launcher.log.
- real jobs (Gloo and MPI): a failing rank, Ctrl-C mid-run, Ctrl-C while horovodrun starts, Ctrl-C before anything
  starts. The console has hvdtrain's account and no Python traceback of the launcher; the log keeps horovodrun's.
"""

from __future__ import annotations

import io
import signal
import time
from pathlib import Path

import psutil
import pytest
import yaml

from hvdtrain.job.model import Logs
from hvdtrain.launch import console
from hvdtrain.launch.console import PARTIAL_LIMIT, OutputRouter
from hvdtrain.launch.failures import RankFailure
from hvdtrain.launch.verdict import exit_code
from tests.support.harness import BIN, REPO, kill_launcher_when, route, run_bounded, wait_gone

HVDTRAIN = str(BIN / "hvdtrain")
FAIL_RANK = str(REPO / "tests" / "scripts" / "fail_rank.py")
FRAMES = [
    "Traceback (most recent call last):",
    '  File "/venv/bin/horovodrun", line 8, in <module>',
    "    sys.exit(run_commandline())",
    "             ^^^^^^^^^^^^^^^^^",
    '  File "/venv/lib/python3.11/site-packages/horovod/runner/gloo_run.py", line 284, in launch_gloo',
    "    raise RuntimeError('Horovod detected that one or more processes exited with non-zero '",
]
GLOO_FAILURE = [  # what horovodrun printed when rank 1 of 2 exited with code 3 (Gloo)
    "Process 1 exit with status code 3.", "Terminating remaining workers after failure of Process 1.",
    "[0]<stderr>:Terminated", "Process 0 exit with status code 143.", *FRAMES,
    "RuntimeError: Horovod detected that one or more processes exited with non-zero status, thus causing the job "
    "to be terminated. The first process to do so was:", "Process name: 1", "Exit code: 3", "",
]
INTERRUPTED_START = [  # horovodrun given SIGINT while it imported its modules
    "Traceback (most recent call last):", '  File "/venv/bin/horovodrun", line 5, in <module>',
    "    from horovod.runner.launch import run_commandline", "KeyboardInterrupt",
]
SPAWNED_AND_INTERRUPTED = [  # CI, 2026-12-02: SIGINT as horovodrun spawned its two middlemen; both printed at once
    'Traceback (most recent call last):',
    '  File "<string>", line 1, in <module>',
    '  File "/root/.pyenv/versions/3.11.7/lib/python3.11/multiprocessing/spawn.py", line 122, in spawn_main',
    '    exitcode = _main(fd, parent_sentinel)',
    ' Traceback (most recent call last):',
    '     File "<string>", line 1, in <module>',
    '       File "/root/.pyenv/versions/3.11.7/lib/python3.11/multiprocessing/spawn.py", line 122, in spawn_main',
    '      ^^^^^^^^^^^^^^^^^^^^^^^^^^',
    '  File "/root/.pyenv/versions/3.11.7/lib/python3.11/multiprocessing/spawn.py", line 132, in _main',
    '    self = reduction.pickle.load(from_parent)',
    '    exitcode = _main(fd, parent_sentinel)',
    '           ^^^^^  ^  ^ ^  ^ ^  ^ ^  ^ ^ ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^',
    '^',
    '  File "/root/.pyenv/versions/3.11.7/lib/python3.11/multiprocessing/spawn.py", line 131, in _main',
    '  File "/root/.pyenv/versions/3.11.7/lib/python3.11/multiprocessing/synchronize.py", line 16, in <module>',
    '    prepare(preparation_data)',
    '  File "/root/.pyenv/versions/3.11.7/lib/python3.11/multiprocessing/spawn.py", line 246, in prepare',
    "    _fixup_main_from_path(data['init_main_from_path'])",
    '  File "/root/.pyenv/versions/3.11.7/lib/python3.11/multiprocessing/spawn.py", line 297, in _fixup_main_from_path',
    '    main_content = runpy.run_path(main_path,',
    '                   ^^^^^^^^^^^^^^^^^^^^^^^^^',
    '  File "<frozen runpy>", line 291, in run_path',
    '  File "<frozen runpy>", line 98, in _run_module_code',
    '  File "<frozen runpy>", line 88, in _run_code',
    '  File "/check/work/main/.venv/bin/hvdtrain-horovodrun", line 5, in <module>',
    '    from hvdtrain.launch.hvdrun import main',
    'KeyboardInterrupt',
    '    import tempfile',
    '  File "/root/.pyenv/versions/3.11.7/lib/python3.11/tempfile.py", line 43, in <module>',
    '    import shutil as _shutil',
    '  File "/root/.pyenv/versions/3.11.7/lib/python3.11/shutil.py", line 29, in <module>',
    '    import lzma',
    '  File "<frozen importlib._bootstrap>", line 1176, in _find_and_load',
    '  File "<frozen importlib._bootstrap>", line 1147, in _find_and_load_unlocked',
    '  File "<frozen importlib._bootstrap>", line 690, in _load_unlocked',
    '  File "<frozen importlib._bootstrap_external>", line 936, in exec_module',
    '  File "<frozen importlib._bootstrap_external>", line 1069, in get_code',
    '  File "<frozen importlib._bootstrap_external>", line 729, in _compile_bytecode',
    'KeyboardInterrupt',
]
STARTED_AND_INTERRUPTED = [  # a local run, 2026-12-02: a middleman's interpreter stopped in its site import
    'Traceback (most recent call last):',
    '  File "<string>", line 1, in <module>',
    '  File "/root/.pyenv/versions/3.11.7/lib/python3.11/multiprocessing/__init__.py", line 16, in <module>',
    'Fatal Python error: init_import_site: Failed to import the site module',
    'Python runtime state: initialized',
    'Traceback (most recent call last):',
    '  File "<frozen importlib._bootstrap>", line 1176, in _find_and_load',
    '  File "<frozen importlib._bootstrap>", line 1147, in _find_and_load_unlocked',
    '  File "<frozen importlib._bootstrap>", line 690, in _load_unlocked',
    '  File "<frozen importlib._bootstrap>", line 980, in exec_module',
    '  File "<frozen site>", line 616, in <module>',
    '  File "<frozen site>", line 599, in main',
    '  File "<frozen site>", line 531, in venv',
    '  File "<frozen site>", line 384, in addsitepackages',
    '  File "<frozen site>", line 226, in addsitedir',
    '  File "<frozen site>", line 186, in addpackage',
    '  File "<string>", line 1, in <module>',
    '  File "/work/main/.venv/lib/python3.11/site-packages/__editable___hvdtrain_0_9_0_finder.py", line 7, '
    'in <module>',
    '        from pathlib import Path',
    'from . import context  File "/root/.pyenv/versions/3.11.7/lib/python3.11/pathlib.py", line 14, in <module>',
    '',
    '  File "<frozen importlib._bootstrap>", line 1176, in _find_and_load',
    '  File "<frozen importlib._bootstrap>", line 1147, in _find_and_load_unlocked',
    '  File "<frozen importlib._bootstrap>", line 701, in _load_unlocked',
]
OTHER_ERROR = [*FRAMES[:3], "RuntimeError: could not find a common interface"]


def test_horovodrun_traceback_for_a_failed_rank_is_kept_off_the_console_and_in_the_log(tmp_path):
    router, out, err = route(GLOO_FAILURE, Logs(dir=str(tmp_path)))
    assert out.splitlines() == ["Process 1 exit with status code 3.",
                                "Terminating remaining workers after failure of Process 1.",
                                "Process 0 exit with status code 143."]
    assert err == ""  # rank 0's `Terminated` (the shell's, the job was ending) is only in its log
    assert (tmp_path / "launcher.log").read_text().splitlines() == [
        line for line in GLOO_FAILURE if not line.startswith("[0]")]
    assert (tmp_path / "rank.0.log").read_text() == "Terminated\n"
    assert router.failures.first == RankFailure(1, code=3)
    assert router.failures.report(None) == ["hvdtrain: rank 1 exited with code 3 (the first rank to fail)"]


def usage(rank: int, prog: str = "train.py") -> list[str]:
    """What argparse prints on a bad argument (wrapped usage lines indented), as rank `rank`'s stderr."""
    return [f"[{rank}]<stderr>:usage: {prog} [-h] [--epochs EPOCHS]", f"[{rank}]<stderr>:{' ' * 16}[--batch-size N]",
            f"[{rank}]<stderr>:{prog}: error: unrecognized arguments: --epcohs 1"]


def test_a_usage_every_rank_prints_is_shown_once_with_every_ranks_error_line(tmp_path):
    """Issue 59 item 4: a recipe given `--epcohs 1` printed its 43-line usage per rank and a verdict quoting 15
    lines of it."""
    lines = [*usage(1), *usage(0), "Process 1 exit with status code 2.", "[2]<stderr>:usage: other.py",
             "[2]<stderr>:not an error line", "[3]<stdout>:usage: at the end"]
    router, out, err = route(lines, Logs(dir=str(tmp_path)))
    assert err.splitlines() == [*usage(1), usage(0)[-1], "[2]<stderr>:usage: other.py",
                                "[2]<stderr>:not an error line"]
    assert out.splitlines() == ["Process 1 exit with status code 2.", "[3]<stdout>:usage: at the end"]
    assert (tmp_path / "rank.0.log").read_text().splitlines() == [line[12:] for line in usage(0)]  # every line
    assert router.failures.report(None) == [
        "hvdtrain: rank 1 exited with code 2 (the first rank to fail)",
        "hvdtrain: its error, parsing its command line (the script's usage is above): train.py: error: "
        "unrecognized arguments: --epcohs 1"]
    assert router.failures.report(str(tmp_path))[1].endswith(
        f"(the script's usage is above; its output: {tmp_path / 'rank.1.log'}): train.py: error: unrecognized "
        "arguments: --epcohs 1")


def test_a_usage_is_shown_by_a_rank_on_the_console_and_a_subcommands_error_line_is_one_too():
    lines = [*usage(1), *usage(0, prog="train.py fit")]
    router, _, err = route(lines, Logs(console_ranks=[0]))  # rank 1's usage never reached the console
    assert err.splitlines() == usage(0, prog="train.py fit")
    assert router.failures.arg_errors == {1: "train.py: error: unrecognized arguments: --epcohs 1",
                                          0: "train.py fit: error: unrecognized arguments: --epcohs 1"}


def test_an_interrupted_horovodrun_is_hidden_only_when_hvdtrain_stopped_it():
    _, out, _ = route(INTERRUPTED_START, Logs(), stopping=True)
    assert out == ""
    _, out, _ = route(INTERRUPTED_START, Logs())  # nobody asked it to stop: the traceback is the only account
    assert out.splitlines() == INTERRUPTED_START
    # CI, 2026-11-25: SIGINT landed as a function was entered; Python 3.11 printed an empty line after that frame
    at_def = [*INTERRUPTED_START[:3], '  File "/usr/lib/python3.11/re/_parser.py", line 113, in __init__',
              "    def __init__(self, state, data=None):", "", "KeyboardInterrupt"]
    _, out, _ = route([*at_def, "still shown"], Logs(), stopping=True)
    assert out.splitlines() == ["still shown"]
    _, out, _ = route(at_def, Logs())
    assert out.splitlines() == at_def


def test_chained_tracebacks_and_exit_reports_of_a_stopped_horovodrun_are_hidden_too():
    chained = [*INTERRUPTED_START, "", "During handling of the above exception, another exception occurred:", "",
               *INTERRUPTED_START]
    ignored = ["Exception ignored in: <module 'threading' from '/usr/lib/python3.11/threading.py'>",
               *INTERRUPTED_START[:2], "KeyboardInterrupt: "]
    _, out, _ = route([*chained, *ignored, "still shown"], Logs(), stopping=True)
    assert out.splitlines() == ["still shown"]


def test_interleaved_tracebacks_of_middlemen_interrupted_as_they_started_are_hidden():
    exits = ["Process 1 exit with status code -2.", "Process 0 exit with status code -2."]
    _, out, _ = route([*SPAWNED_AND_INTERRUPTED, *exits, "still shown"], Logs(), stopping=True)
    assert out.splitlines() == [*exits, "still shown"]
    _, out, _ = route(SPAWNED_AND_INTERRUPTED, Logs())  # not stopped by hvdtrain: every line is shown
    assert out.splitlines() == SPAWNED_AND_INTERRUPTED


def test_a_middleman_stopped_as_its_interpreter_started_shows_nothing_cut_off_by_its_exit_or_the_end():
    exits = ["Process 1 exit with status code 1.", "Process 0 exit with status code -2."]
    _, out, _ = route([*STARTED_AND_INTERRUPTED, *exits, "still shown"], Logs(), stopping=True)
    assert out.splitlines() == [*exits, "still shown"]
    _, out, _ = route(STARTED_AND_INTERRUPTED, Logs(), stopping=True)  # the output ended before any exit line
    assert out.splitlines() == []
    _, out, _ = route([*STARTED_AND_INTERRUPTED, *exits], Logs())  # not stopped by hvdtrain: every line is shown
    assert out.splitlines() == [*exits, *STARTED_AND_INTERRUPTED]  # the fragment once the output said what it was
    _, out, _ = route([*STARTED_AND_INTERRUPTED, *exits, "next"], Logs())
    assert out.splitlines() == [*exits, *STARTED_AND_INTERRUPTED, "next"]


FATAL_SPLIT = [  # CI, 2026-12-02: the other middleman's traceback header landed after `Fatal Python error: `
    'Fatal Python error: Traceback (most recent call last):',
    '  File "<string>", line 1, in <module>',
    'init_import_site: Failed to import the site module',
    'Process 0 exit with status code 1.',
    '    iter_importer_modules.register(',
    '  File "/root/.pyenv/versions/3.11.7/lib/python3.11/functools.py", line 892, in register',
    '    if _is_union_type(cls):',
    '       ^^^^^^^^^^^^^^^^^^^',
    '  File "/root/.pyenv/versions/3.11.7/lib/python3.11/typing.py", line 1859, in __init_subclass__',
    '    super().__init_subclass__(*args, **kwargs)',
    '    ^^^^^^^',
    'Process 1 exit with status code -2.',
]


def test_a_fatal_errors_message_split_off_by_another_middlemans_traceback_is_hidden_with_it():
    exits = [line for line in FATAL_SPLIT if line.startswith("Process ")]
    _, out, _ = route([*FATAL_SPLIT, "still shown"], Logs(), stopping=True)
    assert out.splitlines() == [*exits, "still shown"]
    _, out, _ = route(FATAL_SPLIT, Logs())  # not stopped by hvdtrain: every line is shown
    assert sorted(out.splitlines()) == sorted(FATAL_SPLIT)
    _, out, _ = route(["Traceback (most recent call last):", '  File "x.py", line 1, in <module>',
                       "not_fatal_here: an exception line"], Logs(), stopping=True)  # no fatal error held: shown
    assert out.splitlines()[-1] == "not_fatal_here: an exception line"


def test_a_cut_off_traceback_nobody_stopped_is_shown_and_an_explained_one_split_by_an_exit_is_hidden(monkeypatch):
    monkeypatch.setattr(console, "CUT_WAIT_S", 0.0)
    out, err = io.StringIO(), io.StringIO()
    router = OutputRouter(Logs(), out, err)
    for line in [*STARTED_AND_INTERRUPTED, "Process 0 exit with status code 1."]:
        router.line(line)
    router.tick()  # the supervising loop, once the wait is over: no stop came
    assert out.getvalue().splitlines() == ["Process 0 exit with status code 1.", *STARTED_AND_INTERRUPTED]
    split = [*GLOO_FAILURE[:4], *FRAMES[:3], "Process 0 exit with status code 143.", *FRAMES[3:], *GLOO_FAILURE[-4:]]
    _, out_text, _ = route(split, Logs())  # horovodrun's own traceback, an exit line amid its frames: still hidden
    assert "Traceback" not in out_text and out_text.splitlines()[-1] == "Process 0 exit with status code 143."


def test_fragments_that_reach_the_reader_before_hvdtrains_handler_ran_are_hidden_too():
    """CI, 2026-12-02 (a reverse-order run): Ctrl-C reached the middlemen as it reached hvdtrain; their fragments,
    the second one's rest after the first one's exit line, were read before hvdtrain's handler said it stopped."""
    lines = [*STARTED_AND_INTERRUPTED, "Process 0 exit with status code 1.", "    import pickle",
             '  File "/usr/lib/python3.11/pickle.py", line 37, in <module>', "    import _compat_pickle",
             "Process 1 exit with status code -2."]
    out, err = io.StringIO(), io.StringIO()
    router = OutputRouter(Logs(), out, err)
    for line in lines:
        router.line(line)
    router.launcher.stopping = True  # the handler ran now, before the output ended
    router.close()
    assert out.getvalue().splitlines() == ["Process 0 exit with status code 1.", "Process 1 exit with status code -2."]
    # after a forwarded signal, frames that do reach an exception line other than an interruption are shown (the
    # fragment before them too: interleaved writers cannot be told apart)
    _, out, _ = route([*STARTED_AND_INTERRUPTED, *OTHER_ERROR], Logs(), stopping=True)
    assert out.splitlines() == [*STARTED_AND_INTERRUPTED, *OTHER_ERROR]


def test_horovodruns_hidden_account_is_printed_when_no_rank_failure_explains_the_end():
    elastic = [*FRAMES[:3], "RuntimeError: Job has been shutdown, see above error messages for details."]
    out, err = io.StringIO(), io.StringIO()
    router = OutputRouter(Logs(), out, err)
    for line in elastic:
        router.line(line)
    assert out.getvalue() == "" and router.failures.first is None
    assert exit_code(1, router, None, False, []) == 1
    assert err.getvalue().splitlines() == ["hvdtrain: horovodrun exited with code 1 and no rank reported a failure",
                                           elastic[-1]]


def test_horovodruns_failed_ssh_check_is_said_with_the_check_to_run():
    check = [*FRAMES[:3], "RuntimeError: could not connect to some hosts via ssh"]
    out, err = io.StringIO(), io.StringIO()
    router = OutputRouter(Logs(), out, err)
    for line in ["ssh not successful for host b:", "ssh: Could not resolve hostname b: Name or service not known",
                 *check]:
        router.line(line)
    assert out.getvalue().splitlines() == ["ssh not successful for host b:",
                                           "ssh: Could not resolve hostname b: Name or service not known"]
    assert exit_code(1, router, None, False, ["hvdtrain", "doctor", "--hosts", "a:2,b:2"]) == 1
    assert err.getvalue().splitlines() == [
        "hvdtrain: horovodrun could not reach every host over ssh (`ssh not successful for host ...` above names each, "
        "with ssh's error), so no rank started. Check the hosts with `hvdtrain doctor --hosts a:2,b:2`: horovodrun "
        "needs passwordless ssh from here to each host, by the name given; inside a Slurm allocation, `--launcher "
        "srun` starts the ranks without ssh"]


def test_any_other_launcher_traceback_is_shown_whole_and_a_cut_off_one_too():
    _, out, _ = route([*OTHER_ERROR, "after"], Logs())
    assert out.splitlines() == [*OTHER_ERROR, "after"]
    _, out, _ = route(FRAMES[:3], Logs())  # the output ended inside the traceback
    assert out.splitlines() == FRAMES[:3]
    _, out, err = route(["[1]<stderr>:Terminated"], Logs())  # no failure, no stop: a rank's own line
    assert err == "[1]<stderr>:Terminated\n"


def test_a_rank_line_landing_inside_horovodruns_exit_line_is_split_off():
    # CI, 2026-11-25: horovodrun's print() wrote its text, rank 0's forwarded line, then the newline
    lines = ["[1]<stderr>:Killed",
             "Process 1 exit with status code 137.[0]<stderr>:Traceback (most recent call last):",
             "", "Terminating remaining workers after failure of Process 1.",
             "[0]<stderr>:RuntimeError: Horovod has been shut down.", "Process 0 exit with status code 143."]
    router, out, err = route(lines, Logs())
    assert router.failures.first == RankFailure(1, code=137, signum=9)
    assert out.splitlines() == ["Process 1 exit with status code 137.", "",
                                "Terminating remaining workers after failure of Process 1.",
                                "Process 0 exit with status code 143."]
    assert err.splitlines() == ["[1]<stderr>:Killed", "[0]<stderr>:Traceback (most recent call last):",
                                "[0]<stderr>:RuntimeError: Horovod has been shut down."]
    _, out, _ = route(["[3,1]<stdout>:a line of [0]<stdout>:its own"], Logs())  # only a launcher line is split
    assert out == "[1]<stdout>:a line of [0]<stdout>:its own\n"


def test_two_horovodrun_exit_lines_in_one_are_split():
    # both ranks' threads print() at once: text, text, newline, newline
    lines = ["Process 0 exit with status code 143.Process 1 exit with status code 143.", ""]
    router, out, _ = route(lines, Logs())
    assert out.splitlines() == ["Process 0 exit with status code 143.", "Process 1 exit with status code 143.", ""]
    assert router.failures.first == RankFailure(0, code=143, signum=15)


def test_mpi_chunks_of_two_ranks_in_one_line_go_back_to_their_ranks_whole():
    # CI, 2026-11-25 (ranks unbuffered): rank 1's print() wrote its text; rank 0's line came; then rank 1's newline
    lines = ["[1,1]<stderr>:train.py: error: diverged (loss nan)[1,0]<stderr>:train.py: error: diverged (loss 1.4)",
             "[1,1]<stderr>:",
             "[1,0]<stderr>:RuntimeError[1,1]<stdout>:half [1,0]<stderr>:: [1,0]<stderr>:boom",  # a traceback's parts
             "[1,1]<stdout>:a line", "[1,1]<stderr>:no newline at the end[1,0]<stdout>:last"]
    router, out, err = route(lines, Logs())
    assert err.splitlines() == ["[0]<stderr>:train.py: error: diverged (loss 1.4)",
                                "[1]<stderr>:train.py: error: diverged (loss nan)",
                                "[0]<stderr>:RuntimeError: boom",
                                "[1]<stderr>:no newline at the end"]  # held until the output ended
    assert out.splitlines() == ["[1]<stdout>:half a line", "[0]<stdout>:last"]
    assert router.failures.cause == (0, "RuntimeError: boom")


def test_an_mpi_line_that_never_ends_is_held_only_so_long():
    router = OutputRouter(Logs(), io.StringIO(), err := io.StringIO())
    for _ in range(5000):  # another rank's lines end every physical line; rank 0's never ends: 110,000 characters
        router.line(f"[1,0]<stderr>:{'x' * 22}[1,1]<stdout>:step")
        assert len(router.partial.get((0, "stderr"), "")) < PARTIAL_LIMIT
    router.close()
    assert [len(line) for line in err.getvalue().splitlines()] == [len("[0]<stderr>:") + n for n in (65_538, 44_462)]


def test_srun_labels_are_rank_lines_only_for_the_srun_launcher(tmp_path):
    """srun --label writes `N: text` (N right-aligned among 10+ tasks); srun's own lines are the launcher's."""
    logs = Logs(dir=str(tmp_path))
    router = OutputRouter(logs, out := io.StringIO(), io.StringIO(), srun_labels=True)
    for line in ("0: step 1", "11: step 1", " 3: RuntimeError: boom",
                 "srun: error: vm: task 3: Exited with exit code 3"):
        router.line(line)
    router.close()
    assert out.getvalue().splitlines() == ["[0]<stdout>:step 1", "[11]<stdout>:step 1",
                                           "[3]<stdout>:RuntimeError: boom",
                                           "srun: error: vm: task 3: Exited with exit code 3"]
    assert (tmp_path / "rank.3.log").read_text() == "RuntimeError: boom\n"
    assert "task 3" in (tmp_path / "launcher.log").read_text()
    router = OutputRouter(Logs(), out := io.StringIO(), io.StringIO())  # horovodrun's output: no such labels
    router.line("0: not a rank line")
    router.close()
    assert out.getvalue() == "0: not a rank line\n"


def test_a_progress_bars_update_under_mpi_is_shown_at_once_and_unfinished_lines_before_the_verdict():
    bar = "\r 50%|#####     | 5/10"  # tqdm's update: no newline; other ranks' lines end the physical line
    _, _, err = route([f"[1,0]<stderr>:{bar}[1,1]<stdout>:step"] * 3, Logs())
    assert err.split("\n") == [f"[0]<stderr>:{bar}"] * 3 + [""]  # not splitlines(): it splits at \r too
    router = OutputRouter(Logs(), io.StringIO(), err := io.StringIO())
    router.line("[1,1]<stderr>:RuntimeError[1,1]<stddiag>:a diagnostic[1,0]<stdout>:x")
    router.line("[1,1]<stderr>:: out of memory")  # rank 1's stderr and its diagnostic channel are not mixed
    router.line("[1,0]<stderr>:killed mid-li[1,1]<stdout>:y")
    router.end_of_output()  # the reader thread, when horovodrun's output ends: before the launcher's verdict
    assert router.failures.tails[0][-1] == "killed mid-li"
    assert router.failures.cause == (1, "RuntimeError: out of memory")
    assert err.getvalue().splitlines() == ["[1]<stderr>:RuntimeError: out of memory", "[1]<stderr>:a diagnostic",
                                           "[0]<stderr>:killed mid-li"]


# ---------------------------------------------------------------- real jobs

WAIT = """
import os, sys, time
import horovod.torch as hvd
hvd.init()
open(os.path.join(sys.argv[1], f"ready.{hvd.rank()}"), "w").close()
time.sleep(300)
"""


STOPPING = """
import os, signal, sys, time
import horovod.torch as hvd
from hvdtrain import records
def stop(*_):  # as a recipe does: it checkpoints and exits 75, naming what asked (the launcher's stop file)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # once (mpirun may send SIGINT, then SIGTERM)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    time.sleep(0.5)  # "the checkpoint": the launcher writes its stop file right after it passed the signal on
    print(f"rank {hvd.rank()}: asked to stop ({records.stop_reason(records.directory())})", flush=True)
    sys.exit(75)
signal.signal(signal.SIGTERM, stop)
signal.signal(signal.SIGINT, stop)
hvd.init()
open(os.path.join(sys.argv[1], f"ready.{hvd.rank()}"), "w").close()
time.sleep(300)
"""


def write_job(tmp_path: Path, controller: str, script: str = "job.py", **keys: object) -> Path:
    (tmp_path / "job.py").write_text(WAIT)
    (tmp_path / "stopping.py").write_text(STOPPING)
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({"script": script, "np": 2, "controller": controller, "args": [str(tmp_path)],
                                   "env": {"TF_CPP_MIN_LOG_LEVEL": "2"}, **keys}))
    return job


def launcher_tracebacks(output: str) -> list[str]:
    """Traceback lines that are not a rank's own (rank lines carry `[N]<stderr>:`, hvdtrain's quotes `  | `)."""
    return [line for line in output.splitlines() if line.startswith(("Traceback", "KeyboardInterrupt"))]


@pytest.mark.slow
@pytest.mark.parametrize("controller", ["gloo", "mpi"])
def test_a_failing_rank_shows_hvdtrains_summary_and_no_launcher_traceback(controller, tmp_path):
    job = write_job(tmp_path, controller, script=FAIL_RANK, logs={"dir": "logs"})
    res = run_bounded([HVDTRAIN, "run", str(job)], timeout=180)
    assert res.returncode == 3, res.describe()
    assert "hvdtrain: rank 1 on host localhost exited with code 3 (the first rank to fail)" in res.output
    assert f"hvdtrain: its output: {tmp_path / 'logs' / 'rank.1.log'}" in res.output
    assert launcher_tracebacks(res.output) == [], res.describe()
    if controller == "gloo":  # MPI: horovodrun execs mpirun, which prints no traceback
        assert "Traceback (most recent call last):" in (tmp_path / "logs" / "launcher.log").read_text()


@pytest.mark.slow
@pytest.mark.parametrize("controller", ["gloo", "mpi"])
def test_ctrl_c_mid_run_says_what_hvdtrain_did(controller, tmp_path):
    job = write_job(tmp_path, controller, script="stopping.py")
    ready = lambda: all((tmp_path / f"ready.{r}").exists() for r in range(2))  # noqa: E731
    killed = kill_launcher_when([HVDTRAIN, "run", str(job)], ready, signal.SIGINT, timeout=120)
    took = time.monotonic() - killed.signalled_at
    assert killed.ready, killed.output
    assert killed.returncode == 130, killed.output
    lines = killed.output.splitlines()
    assert "hvdtrain: SIGINT received: stopping every rank (Ctrl-C again to kill them at once)" in lines
    assert lines[-1] == "hvdtrain: the job was stopped by SIGINT; exit code 130", killed.output
    # The ranks got horovodrun's (mpirun's) signal; what they say is what asked. Gloo: horovodrun reports each rank's
    # own exit code, at once (0.28.1 froze a rank's shell whose child had ended: 137, 5 s later).
    for rank in range(2):
        assert f"[{rank}]<stdout>:rank {rank}: asked to stop (SIGINT (Ctrl-C) to hvdtrain run)" in lines, killed.output
    if controller == "gloo":
        assert {f"Process {rank} exit with status code 75." for rank in range(2)} <= set(lines), killed.output
        assert took < 4.5, (took, killed.output)
    assert launcher_tracebacks(killed.output) == [], killed.output
    assert "Traceback" not in killed.output and "Terminated" not in killed.output, killed.output
    assert wait_gone(killed.processes, 20) == []


def _horovodrun_of(tmp_path: Path):
    def started() -> bool:
        for p in psutil.process_iter(["cmdline"]):
            cmd = " ".join(p.info["cmdline"] or [])
            if "horovodrun" in cmd and str(tmp_path) in cmd and "hvdtrain.rank" in cmd:
                return True
        return False
    return started


@pytest.mark.slow
def test_ctrl_c_while_horovodrun_starts_shows_no_traceback(tmp_path):
    job = write_job(tmp_path, "gloo")
    killed = kill_launcher_when([HVDTRAIN, "run", str(job)], _horovodrun_of(tmp_path), signal.SIGINT, timeout=120)
    assert killed.ready and killed.returncode == 130, killed.output
    assert "hvdtrain: the job was stopped by SIGINT; exit code 130" in killed.output
    assert launcher_tracebacks(killed.output) == [] and "Traceback" not in killed.output, killed.output
    assert wait_gone(killed.processes, 20) == []


def test_ctrl_c_before_the_job_starts_is_one_line(tmp_path):
    # The spec's interpreter hangs when hvdtrain probes it, so SIGINT lands in hvdtrain's own checks.
    slow = tmp_path / "slow-python"
    slow.write_text(f"#!/bin/sh\necho $$ > {tmp_path}/probe.pid\nexec sleep 120\n")
    slow.chmod(0o755)
    job = write_job(tmp_path, "gloo", python=str(slow))
    probe = tmp_path / "probe.pid"
    killed = kill_launcher_when([HVDTRAIN, "run", str(job)], probe.exists, signal.SIGINT, timeout=60)
    assert killed.ready and killed.returncode == 130, killed.output
    assert killed.output.splitlines() == ["hvdtrain: interrupted (SIGINT); no job was started"]
    assert wait_gone(killed.processes, 10) == []  # the probe (sleep) was killed with hvdtrain's checks


def test_horovodruns_failure_line_after_a_rank_that_stopped_to_be_resumed_says_so():
    stopped = ["Process 1 exit with status code 75.", "Terminating remaining workers after failure of Process 1.",
               "Process 0 exit with status code 75."]
    _, out, _ = route(stopped, Logs())
    assert out.splitlines() == [stopped[0], "Terminating remaining workers after Process 1 stopped to be resumed "
                                            "(exit 75).", stopped[2]]
    failed = ["Process 1 exit with status code 3.", "Terminating remaining workers after failure of Process 1."]
    _, out, _ = route([*failed, *stopped[2:]], Logs())  # a failure stays one; another process's 75 changes nothing
    assert out.splitlines() == [*failed, *stopped[2:]]
