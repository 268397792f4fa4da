"""FailureTracker from launcher and rank lines as strings: who failed first, where, how, and what hvdtrain says."""

from __future__ import annotations

import pytest

from hvdtrain.job.hosts import parse_hosts, rank_hosts
from hvdtrain.launch.failures import FailureTracker, RankFailure
from hvdtrain.records import RankRecord

GLOO_RAISE = ["Process 1 exit with status code 1.", "Terminating remaining workers after failure of Process 1.",
              "Process 0 exit with status code 143.", "Process name: 1", "Exit code: 1"]
MPI_EXIT = ["Primary job  terminated normally, but 1 process returned", "  Process name: [[19107,1],0]",
            "  Exit code:    1"]
MPI_KILLED = ["mpirun noticed that process rank 1 with PID 0 on node vm exited on signal 9 (Killed)."]


def track(lines: list[str], hosts: tuple[str, ...] = ("a", "b")) -> FailureTracker:
    t = FailureTracker(hosts)
    for line in lines:
        t.feed(line)
    return t


@pytest.mark.parametrize(("lines", "first"), [
    (GLOO_RAISE, RankFailure(1, code=1, host="b")),
    (["Process 1 exit with status code 137."], RankFailure(1, code=137, signum=9, host="b")),
    (["Process 0 exit with status code -15."], RankFailure(0, signum=15, host="a")),
    (MPI_EXIT, RankFailure(0, code=1, host="a")),
    (MPI_KILLED, RankFailure(1, signum=9, host="vm")),  # mpirun names the node itself
    (["Exit code: 4"], RankFailure(None, code=4)),
    (["all good", "[0]<stdout>:Exit code: 3"], None),
])
def test_the_first_failure_reported_by_horovodrun_or_mpirun(lines, first):
    assert track(lines).first == first


def test_report_names_rank_host_how_and_the_log():
    t = track(GLOO_RAISE)
    assert t.report("/logs")[1] == "hvdtrain: it printed nothing"  # no rank.1.log was made: no log to point at
    t.rank_line(1, "RuntimeError: boom")
    assert t.report("/logs") == [
        "hvdtrain: rank 1 on host b exited with code 1 (the first rank to fail)",
        "hvdtrain: its output: /logs/rank.1.log"]
    assert track(MPI_KILLED).report(None) == [
        "hvdtrain: rank 1 on host vm was killed by SIGKILL (the first rank to fail)"]


def test_without_a_log_dir_the_failing_ranks_last_lines_are_shown():
    t = FailureTracker(("a", "b"))
    for i in range(20):
        t.rank_line(1, f"line {i}")
    t.rank_line(0, "other rank")
    t.feed("Process 1 exit with status code 2.")
    report = t.report(None)
    assert report[1] == ("hvdtrain: its last 15 line(s) (set logs.dir in the spec to keep every rank's output and "
                         "the launcher's):")
    assert report[2:] == [f"  | line {i}" for i in range(5, 20)]


def test_the_rank_that_raised_is_named_as_the_cause_when_a_victim_exits_first():
    t = FailureTracker(("a", "b"))
    t.rank_line(0, "horovod.common.exceptions.HorovodInternalError: Horovod has been shut down. ...")
    t.rank_line(1, "Traceback (most recent call last):")
    t.rank_line(1, "RuntimeError: disk full")
    for line in MPI_EXIT:  # mpirun saw rank 0 exit first
        t.feed(line)
    assert t.report("/logs") == [
        "hvdtrain: rank 1 on host b raised RuntimeError: disk full (the cause); rank 0 exited with code 1 first, "
        "after Horovod shut down",
        "hvdtrain: its output: /logs/rank.1.log"]


def test_a_killed_rank_stays_the_cause_even_if_another_rank_printed_an_error():
    t = FailureTracker(("a", "b"))
    t.rank_line(0, "RuntimeError: Gloo connection reset")
    t.feed("Process 1 exit with status code 137.")
    assert t.report(None)[0] == "hvdtrain: rank 1 on host b was killed by SIGKILL (the first rank to fail)"


@pytest.mark.parametrize(("hosts", "np", "placed"), [
    ("a:2,b:2", 4, ["a", "a", "b", "b"]),
    ("a:2,b:2", 3, ["a", "a", "b"]),
    ("localhost:4", 2, ["localhost", "localhost"]),
])
def test_ranks_fill_each_hosts_slots_in_order(hosts, np, placed):
    assert rank_hosts(parse_hosts(hosts), np) == placed


def test_a_host_mpirun_lost_is_named_first():
    t = track(["ORTE has lost communication with a remote daemon.", "  HNP daemon   : [[21958,0],0] on node vm",
               "  Remote daemon: [[21958,0],2] on node 10.213.86.12"], hosts=("10.213.86.11", "10.213.86.12"))
    assert t.first is None and t.lost_host == "10.213.86.12"
    assert t.report(None) == ["hvdtrain: lost contact with host 10.213.86.12 (mpirun: its daemon stopped answering); "
                              "check that host and the network to it (hvdtrain doctor --hosts ...)"]


def test_after_a_gloo_peer_timeout_the_unreachable_host_is_named_before_the_first_rank():
    t = FailureTracker(("h1", "h2"))
    t.rank_line(0, "[E operations.cc:697] Timed out waiting 15000ms for recv operation to complete")
    t.feed("Process 0 exit with status code 1.")
    assert t.peer_timed_out
    t.unreachable = {"h2": "No route to host"}
    assert t.report(None)[:2] == [
        "hvdtrain: host h2 is unreachable now (No route to host); it is the likely cause (a rank timed out waiting "
        "for a peer)", "hvdtrain: rank 0 on host h1 exited with code 1 (the first rank to fail)"]


def test_elastic_jobs_ignore_the_exits_of_ranks_that_were_replaced():
    t = FailureTracker((), elastic=True)
    for line in ["Process 2 exit with status code 137.", "Process name: localhost[1]", "Exit code: 1"]:
        t.feed(line)
    assert t.first == RankFailure(None, code=1)
    # elastic names the failed worker by host and local rank (ranks are renumbered on every reset)
    assert t.report(None) == ["hvdtrain: a rank (worker localhost[1]: host[local rank]) exited with code 1"]


def test_gloo_process_name_without_the_exit_line_still_names_the_rank():
    assert track(["Process name: 1", "Exit code: 3"]).first == RankFailure(1, code=3, host="b")


def test_a_rank_that_timed_out_waiting_for_a_peer_is_not_named_as_the_cause():
    t = FailureTracker(("h1", "h2"))
    t.rank_line(0, "RuntimeError: [unbound_buffer.cc:81] Timed out waiting 15000ms for recv operation to complete")
    t.feed("Process 0 exit with status code 1.")
    assert t.cause is None and t.peer_timed_out
    assert t.report(None)[0] == "hvdtrain: rank 0 on host h1 exited with code 1 (the first rank to fail)"


# ---- from the ranks' records (hvdtrain.records) -----------------------------------------------------------------

def record(rank, *, code=None, signum=None, exception=None, message=None, at=0.0, host="h"):
    return RankRecord(rank, rank, host, 100 + rank, code=code, signum=signum, exception=exception, message=message,
                      time=at)


VICTIM_RECORD = record(0, code=1, exception="HorovodInternalError", message="Horovod has been shut down. ...", at=1)


def test_the_record_of_the_rank_that_raised_names_its_exception_and_message():
    t = track(GLOO_RAISE)
    t.records = [record(1, code=1, exception="ValueError", message="bad sample 17", at=0.5, host="b"), VICTIM_RECORD]
    assert t.report(None) == ["hvdtrain: rank 1 on host b raised ValueError: bad sample 17 and exited with code 1 "
                              "(the first rank to fail)"]
    assert t.exit_failure() == RankFailure(1, code=1, host="b")


def test_a_victims_record_is_passed_over_for_the_cause_even_when_horovodrun_saw_the_victim_first():
    t = track(["Process 0 exit with status code 1."])
    t.rank_line(1, "KeyError: 'x'")
    t.records = [VICTIM_RECORD, record(1, code=1, exception="KeyError", message="'x'", at=2, host="b")]
    assert t.report("/logs") == [
        "hvdtrain: rank 1 on host b raised KeyError: 'x' and exited with code 1 (the cause); rank 0 exited with "
        "code 1 first, after Horovod shut down", "hvdtrain: its output: /logs/rank.1.log"]


def test_records_of_an_exit_code_and_a_signal_say_so_without_an_exception():
    t = FailureTracker(("a", "b"))
    t.records = [record(0, code=0), record(1, code=3, exception="SystemExit", message="3", host="b")]
    assert t.report(None) == ["hvdtrain: rank 1 on host b exited with code 3 (the first rank to fail)"]
    t.records = [record(1, signum=9, host="b")]
    assert t.report(None) == ["hvdtrain: rank 1 on host b was killed by SIGKILL (the first rank to fail)"]
    assert t.exit_failure() == RankFailure(1, signum=9, host="b")


def test_a_user_line_about_a_timeout_is_not_a_peer_timeout_but_gloos_own_message_is():
    t = FailureTracker(("a", "b"))
    t.rank_line(1, "Timed out waiting for the user's own thing")
    t.rank_line(1, "RuntimeError: Timed out waiting 3 s for the coffee machine")
    assert not t.peer_timed_out
    t.rank_line(0, "[2026-11-23 18:27:23: E /src/horovod/common/operations.cc:697] [0]: Horovod background loop "
                   "uncaught exception: [/src/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out "
                   "waiting 15000ms for recv operation to complete")
    assert t.peer_timed_out


def test_when_only_victims_left_records_the_launchers_lines_name_the_rank():
    t = track(["Process 0 exit with status code 1.", "Process 1 exit with status code 255."])
    t.records = [VICTIM_RECORD, record(1, code=1, exception="HorovodInternalError", message="shut down", host="b")]
    assert t.cause_record() is None
    assert t.report(None) == ["hvdtrain: rank 0 on host a exited with code 1 (the first rank to fail)"]


def test_elastic_records_name_the_worker_horovodrun_named_and_a_recovered_failure_is_not_the_cause():
    t = FailureTracker((), elastic=True)
    recovered = record(3, code=1, exception="RuntimeError", message="boom", host="h2", at=1)
    diverged = [record(r, code=3, exception="TrainingDiverged", message="at epoch 9", host="h1", at=9 + r)
                for r in (0, 1)]
    t.records = [recovered, *diverged]
    assert t.report(None) == ["hvdtrain: worker h1[1] raised TrainingDiverged: at epoch 9 and exited with code 3 "
                              "(the first rank to fail)"]
    assert t.exit_failure().code == 3
    t.feed("Process name: h1[0]")
    assert t.cause_record() is diverged[0]


def test_when_only_victims_left_records_the_rank_without_one_is_named_from_horovodruns_lines():
    t = track(["Process 1 exit with status code 137.", "Process 0 exit with status code 143."])
    t.records = [record(0, signum=15), VICTIM_RECORD]  # rank 1's supervisor was SIGKILLed: no record
    assert t.cause_record() is None
    assert t.report(None) == ["hvdtrain: rank 1 on host b was killed by SIGKILL (the first rank to fail)"]
    t.records = [record(0, signum=15), record(1, signum=9, host="b", at=-1)]
    assert t.cause_record().rank == 1
