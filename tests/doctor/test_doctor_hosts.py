"""`hvdtrain doctor --hosts`: the pure parts from data (interface intersection, version comparison, ssh outcome
classification, the ssh argv, host loading, report assembly) and the probe run locally. The ssh runs against real
hosts are in tests/cluster/test_multihost.py."""

from __future__ import annotations

import json
import platform
import subprocess
import sys
from dataclasses import replace

import pytest

from hvdtrain import cli
from hvdtrain.doctor import remote, ssh
from hvdtrain.doctor.local import format_report
from hvdtrain.doctor.probe import MARKER, Facts
from hvdtrain.doctor.remote import (
    Probe,
    common_interfaces,
    host_checks,
    interpret,
    load_hosts,
    nic_checks,
    version_checks,
)
from hvdtrain.doctor.ssh import is_local, ssh_argv, unreachable_hosts
from hvdtrain.job.hosts import Host, HostError

HERE = Facts(python="3.11.7", executable="/opt/venv/bin/python", horovod="0.28.1", torch="2.13.0+cpu")
PY = "/opt/venv/bin/python"


def by_name(checks):
    return {c.name: c for c in checks}


@pytest.mark.parametrize(("nics", "common"), [
    ({"a": ["eth0", "ib0"], "b": ["ib0", "eth0", "docker0"]}, ["eth0", "ib0"]),
    ({"a": ["eth0"], "b": ["ens5"]}, []),
    ({"a": ["eth0"]}, ["eth0"]),
    ({"a": ["eth0"], "b": []}, []),
    ({}, []),
])
def test_common_interfaces_is_the_intersection_of_every_hosts_names(nics, common):
    assert common_interfaces(nics) == common


def test_nic_checks_report_the_common_name_and_whether_the_launcher_has_it():
    checks = by_name(nic_checks({"a": ["eth0", "ib0"], "b": ["ib0"]}, local_nics=["eth0", "ib0"]))
    assert checks["Common NIC"].ok and checks["Common NIC"].detail.startswith("ib0 (on all 2 reachable host(s)")
    assert "network_interfaces: [ib0]" in checks["Common NIC"].detail
    assert checks["Launcher NIC"].ok
    checks = by_name(nic_checks({"a": ["ib0"], "b": ["ib0"]}, local_nics=["eth0"]))
    assert not checks["Launcher NIC"].ok and not checks["Launcher NIC"].required  # a warning: MPI does not care
    assert "rendezvous" in checks["Launcher NIC"].fix


def test_nic_checks_fail_listing_each_hosts_names_when_none_is_common_or_no_host_answered():
    [check] = nic_checks({"a": ["eth0"], "b": ["ens5", "lo2"]}, local_nics=["eth0"])
    assert (check.name, check.ok, check.required) == ("Common NIC", False, True)
    assert check.detail == "no interface name on every host (a: eth0; b: ens5, lo2)"
    assert "--network-interfaces" in check.fix
    [check] = nic_checks({}, local_nics=["eth0"])
    assert not check.ok and check.detail == "no host answered"


def test_version_checks_same_versions_pass():
    checks = by_name(version_checks(Probe("h1", facts=HERE), HERE))
    assert checks["h1: Python"].ok and checks["h1: Python"].detail == "3.11.7"
    assert checks["h1: Horovod"].ok and checks["h1: Horovod"].detail == "0.28.1"


def test_version_checks_patch_level_warns_minor_and_horovod_fail():
    checks = by_name(version_checks(Probe("h1", facts=replace(HERE, python="3.11.9")), HERE))
    assert (checks["h1: Python"].ok, checks["h1: Python"].required) == (False, False)  # [warn]
    assert checks["h1: Python"].detail == "3.11.9 (here: 3.11.7)"
    checks = by_name(version_checks(Probe("h1", facts=replace(HERE, python="3.12.1", horovod="0.28.0",
                                                                     torch="2.5.0")), HERE))
    assert (checks["h1: Python"].ok, checks["h1: Python"].required) == (False, True)  # [FAIL]
    assert not checks["h1: Horovod"].ok
    assert checks["h1: Horovod"].detail == "0.28.0 (here: 0.28.1); torch 2.5.0 (here: 2.13.0+cpu)"
    assert "scripts/setup.sh on h1" in checks["h1: Horovod"].fix
    checks = by_name(version_checks(Probe("h1", facts=replace(HERE, horovod=None)), HERE))
    assert not checks["h1: Horovod"].ok and checks["h1: Horovod"].detail.startswith("not installed")


@pytest.mark.parametrize(("stderr", "error", "fix"), [
    ("ssh: connect to host h1 port 2222: Connection refused\n",
     "unreachable: ssh: connect to host h1 port 2222: Connection refused", "sshd listens on port 2222"),
    ("ssh: connect to host h1 port 2222: Connection timed out", "Connection timed out", "check that h1 is up"),
    ("root@h1: Permission denied (publickey).", "Permission denied", "authorized_keys"),
    ("@@@ WARNING: REMOTE HOST IDENTIFICATION HAS CHANGED! @@@\n...\nHost key verification failed.",
     "Host key verification failed", "ssh-keygen -R h1"),
    ("ssh: Could not resolve hostname h1: Name or service not known", "Could not resolve", "does not resolve"),
    ("", "ssh failed without a message", "check that h1 is up"),
])
def test_interpret_names_why_ssh_failed_and_how_to_fix_it(stderr, error, fix):
    probe = interpret("h1", 255, "", stderr, PY, port=2222)
    assert error in probe.error and probe.error.startswith("unreachable: ")
    assert fix in probe.fix
    assert probe.facts == Facts()


def test_interpret_reads_the_marked_line_among_other_output():
    facts = {"python": "3.11.7", "horovod": "0.28.1", "nics": ["eth0"]}
    stdout = f"Welcome to h1!\n{MARKER}{json.dumps(facts)}\n"
    assert interpret("h1", 0, stdout, "", PY) == Probe("h1", facts=Facts.from_json(facts))


@pytest.mark.parametrize(("code", "stdout", "stderr", "error"), [
    (127, "", "sh: 1: /opt/venv/bin/python: not found", f"{PY} cannot run there (exit 127)"),
    (126, "", "permission denied", f"{PY} cannot run there (exit 126)"),
    (1, "", "Traceback ...\nImportError: bad", "the probe failed (exit 1): ImportError: bad"),
    (0, "no marker here\n", "", "the probe failed (exit 0): no output"),
    (0, f"{MARKER}{{not json\n", "", "the probe failed (exit 0)"),
])
def test_interpret_reports_a_reachable_host_whose_interpreter_cannot_probe(code, stdout, stderr, error):
    probe = interpret("h1", code, stdout, stderr, PY)
    assert error in probe.error and probe.fix


def test_ssh_argv_never_prompts_bounds_the_connect_and_takes_port_and_key():
    argv = ssh_argv("h1", "python -c x", port=2222, identity_file="/k/id")
    assert argv[0] == "ssh" and argv[-2:] == ["h1", "python -c x"]
    text = " ".join(argv)
    for option in ("BatchMode=yes", "ConnectTimeout=5", "StrictHostKeyChecking=accept-new", "-p 2222", "-i /k/id"):
        assert option in text
    assert "-p" not in ssh_argv("h1", "true")


def test_is_local_matches_what_horovodrun_runs_without_ssh():
    assert is_local("localhost", set()) and is_local("127.0.0.1", set()) and is_local("10.0.0.5", {"10.0.0.5"})
    assert not is_local("10.0.0.6", {"10.0.0.5"}) and not is_local("server1", {"10.0.0.5"})


def test_load_hosts_uses_the_projects_parsers(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# two hosts\nh1 slots=2\n\nh2:1\n")
    assert load_hosts(None, str(hostfile)) == [Host("h1", 2), Host("h2", 1)]
    assert load_hosts("a:1,b:4", None) == [Host("a", 1), Host("b", 4)]
    with pytest.raises(HostError, match="cannot read the hostfile"):
        load_hosts(None, str(tmp_path / "missing"))
    with pytest.raises(HostError, match="no slot count"):
        load_hosts("a:1,b", None)


def test_host_checks_skip_versions_of_unreachable_hosts_and_intersect_nics_of_the_others(monkeypatch):
    answers = {
        "a": Probe("a", facts=replace(HERE, nics=["eth0", "ib0"]), seconds=0.4),
        "b": Probe("b", facts=replace(HERE, python="3.11.9", nics=["ib0"]), seconds=0.5),
        "c": Probe("c", error="unreachable: ssh: connect to host c port 22: No route to host", fix="check c"),
    }
    monkeypatch.setattr(remote, "probe_host", lambda name, *a: answers[name])
    monkeypatch.setattr(remote, "local_facts", lambda python=PY: HERE)
    monkeypatch.setattr(remote, "_local_nic_addrs", lambda: {"ib0": ["10.0.0.1"], "docker0": []})
    checks = host_checks([Host("a", 1), Host("b", 1), Host("c", 1)], port=22)
    assert [c.name for c in checks] == ["a: ssh", "a: Python", "a: Horovod", "b: ssh", "b: Python", "b: Horovod",
                                        "c: ssh", "Common NIC", "Launcher NIC"]
    report = format_report(checks)
    assert "[ok  ] a: ssh        reachable (port 22), 0.4 s" in report
    assert "[warn] b: Python     3.11.9 (here: 3.11.7)" in report
    assert "[FAIL] c: ssh        unreachable: ssh: connect to host c port 22: No route to host" in report
    assert "fix: check c" in report
    assert "[ok  ] Common NIC    ib0 (on all 2 reachable host(s)" in report
    assert report.endswith("doctor: FAILED: c: ssh")


def test_unreachable_hosts_lists_only_hosts_where_ssh_itself_failed(monkeypatch):
    def fake_run(argv, **kwargs):
        host = argv[-2]
        assert kwargs["timeout"] == ssh.CALL_TIMEOUT_S and "BatchMode=yes" in argv
        if host == "slow":
            raise subprocess.TimeoutExpired(argv, kwargs["timeout"])
        code, err = {"up": (0, ""), "down": (255, "ssh: connect to host down port 22: No route to host"),
                     "odd": (1, "true: oops")}[host]
        return subprocess.CompletedProcess(argv, code, "", err)

    monkeypatch.setattr(ssh.subprocess, "run", fake_run)
    assert unreachable_hosts(["up", "down", "odd", "slow"]) == {
        "down": "unreachable: ssh: connect to host down port 22: No route to host",
        "slow": f"no answer within {ssh.CALL_TIMEOUT_S} s"}
    assert unreachable_hosts([]) == {}


def test_the_probe_runs_locally_without_ssh():
    probe = remote.probe_host("localhost", sys.executable, None, None, local=True)
    assert not probe.error, probe
    assert probe.local and probe.facts.python == platform.python_version()
    assert probe.facts.executable == sys.executable
    assert isinstance(probe.facts.nics, list) and "lo" not in probe.facts.nics


def test_cli_rejects_bad_hosts_with_exit_2_before_any_check(capsys):
    assert cli.main(["doctor", "--hosts", "a:1,b"]) == 2
    assert "no slot count for 'b'" in capsys.readouterr().err
    for argv in (["doctor", "--hosts", "a:1", "--hostfile", "f"], ["doctor", "--hosts", "a:1", "--ssh-port", "0"]):
        with pytest.raises(SystemExit) as exc:
            cli.main(argv)
        assert exc.value.code == 2


def test_cli_rejects_ssh_options_without_hosts(capsys):
    assert cli.main(["doctor", "--ssh-port", "2222"]) == 2
    assert "--ssh-port/--ssh-identity-file need --hosts or --hostfile" in capsys.readouterr().err
