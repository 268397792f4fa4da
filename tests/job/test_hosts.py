"""Hostfiles and -H strings, fed as text: what parses, and the exact message for each kind of mistake."""

from __future__ import annotations

import pytest

from hvdtrain.job.hosts import Host, HostError, check_np, hosts_arg, parse_hostfile, parse_hosts
from tests.support.harness import REPO


def test_hostfile_with_both_syntaxes_comments_and_blank_lines():
    text = "# cluster\n\nserver1 slots=4   # rack A\n  server2:2\n\n# server3 slots=8\n10.0.0.7 slots=1\n"
    hosts = parse_hostfile(text, "hf")
    assert hosts == [Host("server1", 4), Host("server2", 2), Host("10.0.0.7", 1)]
    assert hosts_arg(hosts) == "server1:4,server2:2,10.0.0.7:1"


def test_hosts_string_and_list():
    assert parse_hosts("a:4,b.example.com:2") == [Host("a", 4), Host("b.example.com", 2)]
    assert parse_hosts(["a:4", "b:2"]) == [Host("a", 4), Host("b", 2)]


@pytest.mark.parametrize(("text", "message"), [
    ("a slots=2\nb slots=x\n",
     "hf:2: b slots=x\n  slot count 'x' is not a whole number; it must be an integer >= 1 "
     "(the number of ranks to run on that host)"),
    ("a slots=0",
     "hf:1: a slots=0\n  slot count 0 is out of range (1..4096); it must be an integer >= 1 "
     "(the number of ranks to run on that host)"),
    ("a:-1", "hf:1: a:-1\n  slot count '-1' is not a whole number; it must be an integer >= 1 "
             "(the number of ranks to run on that host)"),
    ("a slots=2\n# x\nA:1  # again",
     "hf:3: A:1  # again\n  host 'A' is listed twice (first at hf:1); list each host once with its total slots"),
    ("server1", "hf:1: server1\n  no slot count for 'server1'; write 'server1 slots=N' or 'server1:N'"),
    ("a slots=2 max_slots=4", "hf:1: a slots=2 max_slots=4\n  expected 'host slots=N' or 'host:N'"),
    ("a;touch:2", "hf:1: a;touch:2\n  'a;touch' is not a valid host name (letters, digits and '-' in "
                  "dot-separated labels of 1-63 characters) nor an IPv4 address"),
    ("$(id) slots=1", "hf:1: $(id) slots=1\n  '$(id)' is not a valid host name (letters, digits and '-' in "
                      "dot-separated labels of 1-63 characters) nor an IPv4 address"),
    ("-oProxyCommand=x:1", "hf:1: -oProxyCommand=x:1\n  '-oProxyCommand=x' is not a valid host name (letters, "
                           "digits and '-' in dot-separated labels of 1-63 characters) nor an IPv4 address"),
    ("10.0.0.300 slots=2", "hf:1: 10.0.0.300 slots=2\n  '10.0.0.300' looks like an IP address but is not a valid one"),
    ("fe80::1 slots=2", "hf:1: fe80::1 slots=2\n  IPv6 addresses cannot be written as host:slots for horovodrun; "
                        "use a host name"),
    ("# nothing here\n\n", "hf: no hosts found; add lines like 'server1 slots=4'"),
])
def test_hostfile_errors_quote_the_line(text, message):
    with pytest.raises(HostError) as err:
        parse_hostfile(text, "hf")
    assert str(err.value) == message


@pytest.mark.parametrize(("value", "message"), [
    ("a:4,,b:2", "hosts entry 2: ''\n  expected 'host:N' (no spaces, no empty entries), e.g. 'server1:4'"),
    ("a:4,a;touch /tmp/x:1",
     "hosts entry 2: 'a;touch /tmp/x:1'\n  expected 'host:N' (no spaces, no empty entries), e.g. 'server1:4'"),
    ("a:4,b", "hosts entry 2: 'b'\n  no slot count for 'b'; write 'b:N'"),
    ("a:4,a:2", "hosts entry 2: 'a:2'\n  host 'a' is listed twice (first at hosts entry 1); "
                "list each host once with its total slots"),
    (["a:1", "b`id`:2"], "hosts[1]: 'b`id`:2'\n  'b`id`' is not a valid host name (letters, digits and '-' in "
                         "dot-separated labels of 1-63 characters) nor an IPv4 address"),
])
def test_hosts_errors_quote_the_entry(value, message):
    with pytest.raises(HostError) as err:
        parse_hosts(value)
    assert str(err.value) == message


def test_np_must_fit_in_the_slots():
    check_np(parse_hosts("a:1,b:2"), 3, "hosts")
    with pytest.raises(HostError) as err:
        check_np(parse_hosts("a:1,b:2"), 4, "hosts")
    assert str(err.value) == ("hosts: np = 4 but the hosts offer only 3 slot(s) (a:1,b:2); "
                              "lower np to at most 3 or add hosts/slots")


@pytest.mark.parametrize(("name", "expected"), [
    ("one_host.txt", [Host("localhost", 2)]),
    ("two_hosts.txt", [Host("server1", 4), Host("server2", 4)]),
    ("commented.txt", [Host("gpu-node-01.cluster.local", 4), Host("gpu-node-02.cluster.local", 4)]),
])
def test_shipped_hostfiles_parse(name, expected):
    path = REPO / "hostfiles" / name
    assert parse_hostfile(path.read_text(), str(path)) == expected
