"""Job specs fed as strings: what loads, what each mistake reports (pinned), overrides, and the JSON Schema."""

from __future__ import annotations

import json
import os
import sys

import pytest

from hvdtrain.job.load import SpecError, load_spec, load_spec_file
from hvdtrain.job.model import JobSpec
from hvdtrain.textfile import NotText, decode

MINIMAL = "script: train.py\nnp: 2\n"


def spec_error(text: str, overrides: tuple[str, ...] = (), **kwargs) -> str:
    with pytest.raises(SpecError) as err:
        load_spec(text, "job.yaml", base_dir="/jobs", overrides=overrides, **kwargs)
    return str(err.value)


def test_minimal_spec_gets_its_defaults_and_resolves_paths_against_the_spec_folder():
    spec = load_spec(MINIMAL, "jobs/job.yaml", base_dir="/work/jobs")
    assert spec.script == "/work/jobs/train.py"
    assert spec.python == sys.executable
    assert spec.hosts == "localhost:2"
    assert spec.controller is None and spec.elastic is None
    assert spec.args == [] and spec.env == {} and spec.extra_args == []


def test_full_spec_loads():
    text = """
script: ../recipes/train.py
args: [--epochs, 3, --lr, 0.05, "$(id)"]
python: ../.venv/bin/python
np: 4
hosts: [a:2, b.example.com:2]
controller: mpi
env: {OMP_NUM_THREADS: 2, TAG: "x y"}
ssh: {port: 2222, identity_file: ~/.ssh/id_ed25519}
network_interfaces: [eth0, ib0]
horovod: {fusion_threshold_mb: 32, cycle_time_ms: 2.5, autotune: true, autotune_log_file: at.csv}
logs: {dir: logs, timestamp: true, console_ranks: [0]}
extra_args: [--disable-cache]
"""
    spec = load_spec(text, "/work/jobs/job.yaml")
    assert spec.args == ["--epochs", "3", "--lr", "0.05", "$(id)"]  # numbers as written, $(id) stays literal
    assert spec.python == "/work/.venv/bin/python"
    assert spec.hosts == "a:2,b.example.com:2"
    assert spec.env == {"OMP_NUM_THREADS": "2", "TAG": "x y"}
    assert spec.ssh.identity_file == os.path.expanduser("~/.ssh/id_ed25519")
    assert spec.horovod.autotune_log_file == "/work/jobs/at.csv"
    assert spec.logs.dir == "/work/jobs/logs"


def test_hostfile_is_read_parsed_and_becomes_the_hosts():
    files = {"/jobs/hf.txt": "# two hosts\nserver1 slots=2\n\nserver2:2  # b\n"}
    spec = load_spec(MINIMAL + "hostfile: hf.txt\n", "job.yaml", base_dir="/jobs", read_text=files.__getitem__)
    assert spec.hosts == "server1:2,server2:2"
    assert spec.hostfile == "/jobs/hf.txt"


@pytest.mark.parametrize(("hostfile", "expected"), [
    ("server1 slots=2\nbad;host slots=2\n", [
        "job.yaml:3: hostfile: /jobs/hf.txt:2: bad;host slots=2",
        "'bad;host' is not a valid host name (letters, digits and '-' in dot-separated labels of 1-63 characters)"
        " nor an IPv4 address",
        "fix: edit /jobs/hf.txt as the message says",
    ]),
    ("server1 slots=1\n", [
        "job.yaml:3: hostfile: /jobs/hf.txt: np = 2 but the hosts offer only 1 slot(s) (server1:1); lower np to "
        "at most 1 or add hosts/slots",
        "fix: edit /jobs/hf.txt as the message says",
    ]),
    (None, [
        "job.yaml:3: hostfile: cannot read the hostfile: No such file or directory",
        "got: '/jobs/hf.txt'",
        "fix: fix the path (relative to the spec file)",
    ]),
])
def test_hostfile_errors_point_at_the_spec_and_quote_the_hostfile_line(hostfile, expected):
    def read(path: str) -> str:
        if hostfile is None:
            raise FileNotFoundError(2, "No such file or directory", path)
        return hostfile
    message = spec_error(MINIMAL + "hostfile: hf.txt\n", read_text=read)
    assert [line.strip() for line in message.splitlines()[1:]] == expected


@pytest.mark.parametrize(("text", "overrides", "expected"), [
    pytest.param('script: t.py\nnp: 2\nhostz: a:2\n', (), [
        'job.yaml:3: hostz: unknown key',
        "got: 'a:2'",
        'allowed: keys here: args, controller, elastic, env, extra_args, gpus_per_rank, horovod, hostfile, hosts,'
         ' kubernetes, logs, network_interfaces, np, python, recipe, script, ssh, workdir',
        "fix: remove 'hostz' or rename it to 'hosts'",
    ], id='unknown_top'),
    pytest.param('script: t.py\nnp: 2\nhorovod:\n  fusion_treshold_mb: 3\n', (), [
        'job.yaml:4: horovod.fusion_treshold_mb: unknown key',
        'got: 3',
        'allowed: keys here: autotune, autotune_log_file, cache_capacity, cycle_time_ms,'
         ' fusion_threshold_mb, gloo_timeout_s, hierarchical_allgather, hierarchical_allreduce, log_level,'
         ' num_nccl_streams, stall_check, stall_check_shutdown_s, stall_check_warning_s, start_timeout_s,'
         ' tcp_only, timeline_file, timeline_mark_cycles, verbose',
        "fix: remove 'fusion_treshold_mb' or rename it to 'fusion_threshold_mb'",
    ], id='unknown_nested'),
    pytest.param('script: t.py\nnp: 0\n', (), [
        'job.yaml:2: np: Input should be greater than or equal to 1',
        'got: 0',
        'allowed: Number of ranks (processes) to start, an integer >= 1.',
        'fix: change np to an allowed value',
    ], id='np_zero'),
    pytest.param("script: t.py\nnp: '2'\n", (), [
        'job.yaml:2: np: Input should be a valid integer',
        "got: '2'",
        'allowed: Number of ranks (processes) to start, an integer >= 1.',
        'fix: remove the quotes: write np: 2',
    ], id='np_string'),
    pytest.param('script: t.py\nnp: 2\ncontroller: tcp\n', (), [
        "job.yaml:3: controller: Input should be 'gloo' or 'mpi'",
        "got: 'tcp'",
        "allowed: 'gloo' or 'mpi' (default: what Horovod was built with, Gloo preferred).",
        'fix: change controller to an allowed value',
    ], id='controller'),
    pytest.param('args: []\n', (), [
        'job.yaml: script: required key is missing',
        'allowed: Training script to run on every rank (a path, relative to the spec file).',
        "fix: add 'script:' to the spec",
        'job.yaml: np: required key is missing',
        'allowed: Number of ranks (processes) to start, an integer >= 1.',
        "fix: add 'np:' to the spec",
    ], id='missing'),
    pytest.param('script: t.py\nnp: 2\nhosts: a:2\nhostfile: hf.txt\n', (), [
        'job.yaml:4: hostfile: hosts and hostfile are both set',
        "got: '/jobs/hf.txt'",
        'fix: keep one of them: hosts for a short list, hostfile for a file (with -o hosts=..., also pass'
         ' -o hostfile=null)',
    ], id='both_hosts'),
    pytest.param('script: t.py\nnp: 2\ncontroller: mpi\nelastic:\n  discovery_script: d.sh\n', (), [
        'job.yaml:3: controller: elastic training runs only with the Gloo controller',
        "got: 'mpi'",
        'allowed: gloo (or leave controller unset)',
        "fix: remove 'controller: mpi' or the elastic section",
    ], id='elastic_mpi'),
    pytest.param('script: t.py\nnp: 2\nhosts: a:2\nelastic:\n  discovery_script: d.sh\n'
                 '  min_np: 3\n  max_np: 1\n', (), [
        'job.yaml:3: hosts: elastic jobs get their hosts from elastic.discovery_script',
        "got: 'a:2'",
        'fix: remove hosts (or remove the elastic section)',
        'job.yaml:6: elastic.min_np: min_np is above np (2)',
        'got: 3',
        'allowed: 1..2',
        'fix: lower elastic.min_np to at most 2, or raise np',
        'job.yaml:7: elastic.max_np: max_np is below np (2)',
        'got: 1',
        'allowed: >= 2',
        'fix: raise elastic.max_np to at least 2, or lower np',
    ], id='elastic_hosts'),
    pytest.param('script: t.py\nnp: 2\nelastic:\n  discovery_script: d.sh\n  blacklist_cooldown_s: [300, 10]\n', (), [
        'job.yaml:5: elastic.blacklist_cooldown_s: expected [MIN, MAX] seconds with MIN <= MAX, e.g. [10, 300]',
        'got: [300, 10]',
        'allowed: --blacklist-cooldown-range: [MIN, MAX] seconds, 1 <= MIN <= MAX <= 3600: a host blacklisted for'
         ' a failed rank may rejoin after ~MIN × 2^failures s (at most MAX) if discovery lists it; unset: it never'
         ' rejoins.',
        'fix: change elastic.blacklist_cooldown_s to an allowed value',
    ], id='elastic_cooldown'),
    pytest.param('script: t.py\nnp: 5\nhosts: [a:2, b:2]\n', (), [
        'job.yaml:2: np: hosts: np = 5 but the hosts offer only 4 slot(s) (a:2,b:2); lower np to at most 4'
         ' or add hosts/slots',
        'got: 5',
        'fix: lower np or add slots to hosts',
    ], id='np_slots'),
    pytest.param("script: t.py\nnp: 2\nhosts: 'a;touch /tmp/x:2'\n", (), [
        "job.yaml:3: hosts: hosts entry 1: 'a;touch /tmp/x:2'",
        "expected 'host:N' (no spaces, no empty entries), e.g. 'server1:4'",
        "got: 'a;touch /tmp/x:2'",
        "allowed: Hosts and slots: 'a:4,b:4' or a list of 'host:slots' (default: localhost:<np>); not"
         ' together with hostfile.',
        'fix: change hosts to an allowed value',
    ], id='bad_host'),
    pytest.param('script: t.py\nnp: 2\n  args: [\n', (), [
        'job.yaml:3: (top level): YAML syntax error: mapping values are not allowed here',
        "got: 'args: ['",
        "fix: fix the YAML syntax on that line (indentation, ':' after keys, quotes)",
    ], id='syntax'),
    pytest.param('script: t.py\nnp: 2\nnp: 3\n', (), [
        'job.yaml:3: np: key repeated (first on line 2); YAML would silently keep only the last one',
        'fix: remove one of the two np keys',
    ], id='dup'),
    pytest.param('- script: t.py\n', (), [
        'job.yaml: (top level): the spec must be a mapping of keys (script, np, ...)',
        "got: [{'script': 't.py'}]",
        'fix: start from jobs/quickstart.yaml; `hvdtrain schema` lists every key',
    ], id='list'),
    pytest.param('script: t.py\nnp: 2\nenv:\n  EMPTY:\n', (), [
        'job.yaml:4: env.EMPTY: the value is empty (YAML reads nothing after the colon or dash, `~` and `null` as'
         ' no value); write "" for an empty string, or remove it',
        'got: None',
        'allowed: Environment variables (NAME: value) set for every rank; unquoted values are taken as written,'
         ' like args.',
        'fix: change env.EMPTY to an allowed value',
    ], id='env_null'),
    pytest.param('script: t.py\nnp: 100000\n', (), [
        'job.yaml:2: np: with no hosts or hostfile every rank runs on this machine, and a host has at most 4096'
         ' slots',
        'got: 100000',
        'allowed: 1..4096 on one host',
        'fix: lower np, or set hosts (or a hostfile) to spread the ranks over several machines',
    ], id='np_one_host'),
    pytest.param('script: t.py\nnp: 2\nenv:\n  OK: 1\n  BAD-NAME: x\n', (), [
        'job.yaml:5: env.BAD-NAME: invalid variable name: use letters, digits and _, not starting with a'
         ' digit',
        "got: 'BAD-NAME'",
        'allowed: Environment variables (NAME: value) set for every rank; unquoted values are taken as written,'
         ' like args.',
        'fix: change env.BAD-NAME to an allowed value',
    ], id='env_name'),
    pytest.param("script: t.py\nnp: 2\nextra_args: [--disable-cache, '--hosts=a:2']\n", (), [
        'job.yaml:3: extra_args[1]: --hosts is what the spec key hosts sets',
        "got: '--hosts=a:2'",
        'fix: remove it from extra_args and set hosts instead',
    ], id='extra'),
    pytest.param('script: t.py\nnp: 2\nhorovod: {autotune_log_file: at.csv}\n', (), [
        'job.yaml:3: horovod.autotune_log_file: Horovod writes the autotune log only when autotuning',
        "got: '/jobs/at.csv'",
        'fix: also set horovod.autotune: true',
    ], id='autotune_log'),
    pytest.param("script: t.py\nnp: 2\nssh: {identity_file: 'my key'}\n", (), [
        'job.yaml:3: ssh.identity_file: horovodrun passes this path to a shell unquoted; it may only'
         ' contain letters, digits and _ . / + @ % = : , ~ - (no spaces or shell characters)',
        "got: 'my key'",
        'allowed: --ssh-identity-file: Private key file for ssh (relative to the spec file); letters, digits'
         ' and _ . / + @ % = : , ~ - (no spaces or shell characters).',
        'fix: change ssh.identity_file to an allowed value',
    ], id='unsafe_path'),
    pytest.param('script: t.py\nnp: 2\nlogs: {console_ranks: [0, 2]}\n', (), [
        'job.yaml:3: logs.console_ranks[1]: there is no rank 2 with np = 2',
        'got: 2',
        'allowed: 0..1',
        'fix: remove it or raise np',
    ], id='console'),
    pytest.param('script: t.py\nnp: 2\n', ('np=-1', 'horovod.cycle_time_ms=fast'), [
        'override -o horovod.cycle_time_ms=fast: horovod.cycle_time_ms: Input should be a valid number',
        "got: 'fast'",
        'allowed: --cycle-time-ms: delay between fusion cycles in ms, a number > 0.',
        'fix: change horovod.cycle_time_ms to an allowed value',
        'override -o np=-1: np: Input should be greater than or equal to 1',
        'got: -1',
        'allowed: Number of ranks (processes) to start, an integer >= 1.',
        'fix: change np to an allowed value',
    ], id='override_bad'),
    pytest.param('script: t.py\nnp: 2\n', ('horovod.cycle=1',), [
        'override -o horovod.cycle=1: horovod.cycle: unknown key',
        'got: 1',
        'allowed: keys here: autotune, autotune_log_file, cache_capacity, cycle_time_ms,'
         ' fusion_threshold_mb, gloo_timeout_s, hierarchical_allgather, hierarchical_allreduce, log_level,'
         ' num_nccl_streams, stall_check, stall_check_shutdown_s, stall_check_warning_s, start_timeout_s,'
         ' tcp_only, timeline_file, timeline_mark_cycles, verbose',
        "fix: remove 'cycle' or rename it to 'cycle_time_ms'",
    ], id='override_unknown'),
    pytest.param('script: t.py\nnp: 2\n', ('np',), [
        '-o np: (top level): expected key.path=value',
        "got: 'np'",
        'fix: write e.g. -o np=4 or -o horovod.cycle_time_ms=2.5',
    ], id='override_syntax'),
    pytest.param("script: t.py\nnp: 2\nnetwork_interfaces: ['eth0;id']\n", (), [
        "job.yaml:3: network_interfaces: invalid interface name(s) 'eth0;id': letters, digits, _ . : @ -",
        "got: ['eth0;id']",
        'allowed: --network-interfaces: NIC names to use, e.g. [eth0, ib0].',
        'fix: change network_interfaces to an allowed value',
    ], id='nic'),
])
def test_each_error_names_place_key_value_allowed_and_fix(text, overrides, expected):
    message = spec_error(text, overrides)
    header, *lines = message.splitlines()
    problems = sum(not line.startswith(" ") for line in lines)
    assert header.endswith(f": invalid job spec ({problems} problem{'s' if problems > 1 else ''})")
    assert [line.strip() for line in lines] == expected


def test_overrides_set_nested_keys_and_are_validated_like_the_file():
    spec = load_spec(MINIMAL, "job.yaml", base_dir="/jobs",
                     overrides=["np=4", "horovod.cycle_time_ms=2.5", "env.A=1", "args=[--x, 1]", "controller=mpi"])
    assert (spec.np, spec.horovod.cycle_time_ms, spec.env, spec.args, spec.controller) == (
        4, 2.5, {"A": "1"}, ["--x", "1"], "mpi")
    spec = load_spec(MINIMAL + "hosts: a:2\n", "job.yaml", overrides=["hosts=null", "np=1"])
    assert spec.hosts == "localhost:1"


AS_WRITTEN = ["1:30", "0x1F", "0o17", "0.10", "1_000", "yes", "off", "2024-01-01", ".inf", "-.5", "1e3", "+12"]


def test_args_env_and_extra_args_take_unquoted_values_as_written():
    # YAML 1.1 would read these as 90, 31, 15, 0.1, 1000, True, False, a date, inf, -0.5, '1e3' and 12.
    flow = ", ".join(AS_WRITTEN)
    env = "".join(f"\n  V{i}: {v}" for i, v in enumerate(AS_WRITTEN))
    text = f"script: t.py\nnp: 2\nargs: [{flow}, '0x1F']\nextra_args: [{flow}]\nenv:{env}\n"
    spec = load_spec(text, "job.yaml", base_dir="/jobs")
    assert spec.args == [*AS_WRITTEN, "0x1F"]
    assert spec.extra_args == AS_WRITTEN
    assert spec.env == {f"V{i}": v for i, v in enumerate(AS_WRITTEN)}
    assert spec.np == 2  # other keys keep their types


def test_values_merged_into_env_are_taken_as_written_and_the_written_keys_win():
    text = """script: t.py
np: 2
env:
  <<: [{MASK: 0x1F, T: 1:30, Q: "x", W: 0o7}, {MASK: 5, Z: 0x2}]
  B: 0x1F
  W: "quoted"
"""
    spec = load_spec(text, "job.yaml", base_dir="/jobs")  # YAML alone: MASK 31, T 90, Z 2, B 31
    assert spec.env == {"MASK": "0x1F", "T": "1:30", "Q": "x", "W": "quoted", "Z": "0x2", "B": "0x1F"}


def test_overrides_take_args_and_env_values_as_written():
    spec = load_spec(MINIMAL, "job.yaml", base_dir="/jobs",
                     overrides=["args=[--at, 1:30, 0x1F]", "env.MASK=0o17", "env.FLAG=yes", "args.2=0.10"])
    assert spec.args == ["--at", "1:30", "0.10"]
    assert spec.env == {"MASK": "0o17", "FLAG": "yes"}


@pytest.mark.parametrize(("data", "expected"), [
    ("caf\xe9: 1\n".encode("latin-1"), "not UTF-8 text: byte 0xE9 at line 1, column 4 is not UTF-8"),
    ("np: 2\nscript: t.py\n".encode("utf-16"), "not UTF-8 text: it is UTF-16 text (it starts with a UTF-16"),
    ("np: 2\n".encode("utf-32"), "not UTF-8 text: it is UTF-32 text"),
    ("np: 2\nx: 3\n".encode("utf-16-le"), "not UTF-8 text: a NUL byte at line 1, column 2"),
    (b"np: 2\n\x7fELF\x02\x01\x01\x00", "not UTF-8 text: a NUL byte at line 2, column 8"),
])
def test_decode_names_the_encoding_problem_and_its_line(data, expected):
    with pytest.raises(NotText) as err:
        decode(data)
    assert str(err.value.strerror).startswith(expected)
    assert err.value.fix.startswith("save it as UTF-8") or err.value.fix.startswith("use a text file")


def test_decode_accepts_utf8_with_or_without_a_byte_order_mark():
    assert decode("np: 2 # café\n".encode()) == decode("\ufeffnp: 2 # café\n".encode()) == "np: 2 # café\n"


def test_a_spec_or_hostfile_that_is_not_utf8_is_one_error_with_its_line(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_bytes("script: t.py\nnp: 2\nenv: {NAME: caf\xe9}\n".encode("latin-1"))
    with pytest.raises(SpecError) as err:
        load_spec_file(job, check_files=False)
    assert str(err.value).splitlines()[1:] == [
        f"{job}:3: (top level): cannot read the spec: not UTF-8 text: byte 0xE9 at line 3, column 16 is not UTF-8"
        " (Latin-1 or another encoding, or a binary file?)",
        f"  fix: save it as UTF-8, e.g. iconv -f LATIN1 -t UTF-8 {job} > {job}.utf8 if it is Latin-1"]
    (tmp_path / "hosts.txt").write_text("localhost slots=2\n", encoding="utf-16")
    job.write_text("script: t.py\nnp: 2\nhostfile: hosts.txt\n")
    with pytest.raises(SpecError) as err:
        load_spec_file(job, check_files=False)
    assert str(err.value).splitlines()[1:] == [
        f"{job}:3: hostfile: cannot read the hostfile: not UTF-8 text: it is UTF-16 text (it starts with a UTF-16"
        " byte-order mark)",
        f"  got: '{tmp_path}/hosts.txt'",
        f"  fix: save it as UTF-8, e.g. iconv -f UTF-16 -t UTF-8 {tmp_path}/hosts.txt > {tmp_path}/hosts.txt.utf8"]


def test_files_are_checked_on_request(tmp_path):
    (tmp_path / "train.py").write_text("print('hi')\n")
    (tmp_path / "discover.sh").write_text("#!/bin/sh\necho localhost:2\n")
    text = "script: train.py\nnp: 2\nelastic: {discovery_script: discover.sh}\n"
    assert [line.strip() for line in spec_error(MINIMAL, check_files=True).splitlines()[1:]] == [
        "job.yaml:1: script: the training script does not exist",
        "got: '/jobs/train.py'",
        "fix: fix the path (relative paths are relative to the spec file)",
    ]
    with pytest.raises(SpecError) as err:
        load_spec(text, str(tmp_path / "job.yaml"), check_files=True)
    assert [line.strip() for line in str(err.value).replace(str(tmp_path), "T").splitlines()[1:]] == [
        "T/job.yaml:3: elastic.discovery_script: the discovery script is not executable",
        "got: 'T/discover.sh'",
        "fix: chmod +x T/discover.sh",
    ]
    (tmp_path / "discover.sh").chmod(0o755)
    assert load_spec(text, str(tmp_path / "job.yaml"), check_files=True).elastic is not None
    with pytest.raises(SpecError) as err:
        load_spec(text + "workdir: run\n", str(tmp_path / "job.yaml"), check_files=True)
    assert [line.strip() for line in str(err.value).replace(str(tmp_path), "T").splitlines()[1:]] == [
        "T/job.yaml:4: workdir: the working directory does not exist",
        "got: 'T/run'",
        "fix: create it, or fix the path (relative to the spec file)",
    ]
    (tmp_path / "run").mkdir()
    assert load_spec(text + "workdir: run\n", str(tmp_path / "job.yaml"), check_files=True).workdir == str(
        tmp_path / "run")


def test_schema_forbids_unknown_keys_and_describes_every_field():
    schema = JobSpec.model_json_schema()
    models = [schema, *schema["$defs"].values()]
    for model in models:
        assert model["additionalProperties"] is False
        for name, prop in model["properties"].items():
            assert prop.get("description"), f"{model.get('title')}.{name} has no description"
    assert {"script", "np"} <= set(schema["required"])
    json.dumps(schema)
