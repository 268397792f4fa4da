"""A real Slurm cluster on this machine, for tests: its own munged, slurmctld and slurmd, private ports and one
private directory, and nothing left behind. One node (this machine, by its short hostname), or one node per test
host of tests/support/netns.py (`hosts=`): a slurmd in each host's network namespace and under its hostname, so a job's
tasks on two nodes have two hostnames and addresses, and reach each other over the hosts' bridge (ssh too: the
hosts' sshd, the node names in the ssh client's private config).

    T = $TMPDIR/hvdtrain-slurm-XXXXXXXX (0755: munged runs as user munge and must traverse it)
      ├─ owner    "PID START_TIME" of the test process that owns the cluster (/proc/PID/stat field 22)
      ├─ munge/   munge.key (munge, 0400), munge.socket, munged.pid, munged.seed   (munged -F, as user munge)
      ├─ etc/     slurm.conf: SlurmctldPort/SlurmdPort free TCP ports picked now; node <short hostname> at
      │           127.0.0.1 with os.cpu_count() CPUs (or each host's name at its address, slurmctld at the hosts'
      │           bridge); partition `debug` (default); no accounting, no cgroups
      ├─ state/ spool/ tmpfs/   slurmctld's state, slurmd's spool (spool/<node>), the node's TmpFS (tmpfs/<node>
      │                         with several nodes: PMIx makes the same folder names on each)
      ├─ log/     slurmctld.log, slurmd.log (slurmd-<node>.log), and each daemon's stdout+stderr <name>.out
      └─ jobs/    the batch jobs' output files (<job id>.out)

Nothing under /etc/munge, /run/munge, /etc/slurm or /var is read or written: every Slurm command finds the cluster
through SLURM_CONF (`SlurmCluster.env()`), and the helpers here run them with it and without any SLURM_* variable
inherited from outside (a test run inside a real Slurm job must not talk to that job's cluster). The daemons run
in the foreground as children of this process (munged -F, slurmctld -D -i, slurmd -D), each in its own session; a
host's slurmd through `nsenter --net` (not `ip netns exec`, which mounts a sysfs of its own without the cgroup
filesystem slurmd needs) and `unshare --uts`, as the host's sshd.

NOTE [ Job processes and the per-test process check ]
slurmd starts a slurmstepd per job step through a middle process that exits, so slurmstepd and the job's tasks are
orphans: under pytest they re-parent to the test process (a child subreaper, tests/conftest.py) and count as that
test's processes. A test must therefore wait for its jobs to end (`wait()`, `scancel()`), and a job process that
escapes Slurm's tracking fails the test that started it (proctrack/linuxproc, the only tracking without cgroups,
does not kill a `setsid cmd &` the batch script left when it ends; a real cluster's proctrack/cgroup would). The
daemons themselves are started by a module-scoped fixture, before any test's check begins, and are exempt.

Teardown (every wait bounded): scancel every job, wait for them to leave the node; SIGTERM slurmd, slurmctld and
munged, SIGKILL after STOP_S, reap them; SIGKILL whatever still carries this cluster's SLURM_CONF in its
environment (slurmstepd and job tasks inherit it); remove T. scripts/fresh_state.sh knows the `hvdtrain-slurm-`
prefix and T/owner, and removes what a killed test run's cluster left (never a cluster whose owner still runs): keep
them in step.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.support import harness
from tests.support.netns import SshCluster, SshHost, as_host

PREFIX = "hvdtrain-slurm-"  # scripts/fresh_state.sh matches it
DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "srun", "salloc", "scontrol", "scancel", "squeue", "sinfo")
START_S = 30  # each daemon's readiness; the whole start takes ~0.4 s here (the first job starts ~3 s later)
STOP_S = 10  # SIGTERM -> SIGKILL
JOB_TIMEOUT_S = 120  # the test jobs end in ~8 s (horovodrun's own start is most of it)
SALLOC_TIMEOUT_S = 120
CMD_TIMEOUT_S = 30
# A job step's credential lifetime; also how long a requeued job waits before it may start again (default 120 s:
# a requeued job here runs again ~10 s after `scontrol requeue`). Too short and a slow slurmd rejects steps.
CRED_EXPIRE_S = 10
# Job states after which nothing of the job runs any more (a job COMPLETING still has processes).
DONE_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY",
               "BOOT_FAIL", "DEADLINE"}


@dataclass(frozen=True)
class JobResult:
    """A finished batch job as `scontrol show job` reports it: ExitCode=<exit_code>:<signal>."""

    job_id: int
    state: str
    exit_code: int
    signal: int
    output_text: str  # the job's StdOut file ('' if there is none)
    fields: dict[str, str]  # everything `scontrol -o show job` said


@dataclass(frozen=True)
class RunResult:
    argv: list[str]
    returncode: int
    output: str  # stdout and stderr together

    def describe(self) -> str:
        return f"$ {' '.join(self.argv)}\nexit code {self.returncode}\n--- output ---\n{self.output}"


@dataclass
class SlurmCluster:
    root: Path  # T
    node: str  # the first node (the only one without hosts)
    cpus: int  # each node's
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    hosts: list[SshHost] = field(default_factory=list)  # the nodes, when they are test hosts (tests/support/netns.py)
    client_env: dict[str, str] = field(default_factory=dict)  # for every command: the hosts' ssh client
    hosts_file: Path | None = None  # the hosts' /etc/hosts (tests/support/netns.py)

    @property
    def node_names(self) -> list[str]:
        return [host.hostname for host in self.hosts] or [self.node]

    @property
    def conf(self) -> Path:
        return self.root / "etc" / "slurm.conf"

    @property
    def munge_socket(self) -> Path:
        return self.root / "munge" / "munge.socket"

    def env(self) -> dict[str, str]:
        """What every Slurm command needs to find this cluster."""
        return {"SLURM_CONF": str(self.conf)}

    def full_env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        """os.environ without SLURM_* variables, plus env() and extra."""
        base = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
        return {**base, **self.client_env, **self.env(), **(extra or {})}

    def run(self, argv: Sequence[str], timeout_s: float = CMD_TIMEOUT_S, env: dict[str, str] | None = None,
            cwd: Path | None = None) -> RunResult:
        """Run a command (salloc, srun, scontrol ...) against this cluster in a new session; on timeout, kill its
        group and fail the test with its output."""
        return run_bounded(list(argv), timeout_s, self.full_env(env), cwd or self.root / "jobs")

    def sbatch(self, script_path: Path, *args: str, env: dict[str, str] | None = None) -> int:
        """Submit a batch script (output to jobs/<id>.out unless args say otherwise); return the job id."""
        argv = ["sbatch", "--parsable", f"--output={self.root / 'jobs' / '%j.out'}", *args, str(script_path)]
        result = self.run(argv, env=env)
        if result.returncode != 0:
            pytest.fail(f"sbatch failed\n{result.describe()}", pytrace=False)
        return int(result.output.strip().splitlines()[-1].split(";")[0])

    def job_fields(self, job_id: int) -> dict[str, str]:
        """`scontrol -o show job ID` as a dict ({} once the job is forgotten)."""
        result = self.run(["scontrol", "-o", "show", "job", str(job_id)])
        return parse_fields(result.output) if result.returncode == 0 else {}

    def wait(self, job_id: int, timeout_s: float) -> JobResult:
        """Wait until the job has ended (its state final, not COMPLETING); fail the test after timeout_s."""
        deadline = time.monotonic() + timeout_s
        while (fields := self.job_fields(job_id)).get("JobState") not in DONE_STATES:
            if time.monotonic() > deadline:
                pytest.fail(f"job {job_id} did not end in {timeout_s} s: {fields}\n{self.logs()}", pytrace=False)
            time.sleep(0.2)
        code, sig = (int(x) for x in fields.get("ExitCode", "0:0").split(":"))
        out = Path(fields.get("StdOut", "/nonexistent"))
        text = out.read_text(errors="replace") if out.is_file() else ""
        return JobResult(job_id, fields["JobState"], code, sig, text, fields)

    def scancel(self, job_id: int, *args: str) -> None:
        result = self.run(["scancel", *args, str(job_id)])
        if result.returncode != 0:
            pytest.fail(f"scancel failed\n{result.describe()}", pytrace=False)

    def processes(self, job_id: int | None = None) -> dict[int, str]:
        """pid -> command line of this cluster's job processes (and slurmstepds), or of one job's."""
        return cluster_processes(self.conf, job_id)

    def step_daemons(self, job_id: int) -> dict[int, str]:
        """pid -> command line of the job's slurmstepds (`slurmstepd: [JOB.STEP]`: they carry SLURM_CONF but no
        SLURM_JOB_ID, so processes(job_id) misses them). A step's slurmstepd can outlive its tasks by seconds (here
        ~3 s after an srun --mpi=pmix step, finalising PMIx), and the job's final state."""
        return {pid: cmd for pid, cmd in cluster_processes(self.conf).items()
                if cmd.startswith(f"slurmstepd: [{job_id}.")}

    def node_state(self, node: str | None = None) -> str:
        result = self.run(["sinfo", "-h", "-N", "-n", node or self.node, "-o", "%T"], timeout_s=10)
        return result.output.strip() if result.returncode == 0 else ""

    def logs(self, lines: int = 20) -> str:
        parts = []
        for path in sorted((self.root / "log").glob("*")):
            tail = path.read_text(errors="replace").splitlines()[-lines:]
            parts.append(f"--- {path} (last {lines} lines) ---\n" + "\n".join(tail))
        return "\n".join(parts)


def parse_fields(text: str) -> dict[str, str]:
    """Key=Value pairs of one `scontrol -o show` line (values have no spaces in what the tests read)."""
    return {m[1]: m[2] for m in re.finditer(r"(\w[\w/:]*)=(\S*)", text)}


def run_bounded(argv: list[str], timeout_s: float, env: dict[str, str], cwd: Path) -> RunResult:
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env, cwd=cwd, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        out, _ = proc.communicate(timeout=STOP_S)
        pytest.fail(f"timed out after {timeout_s:.0f} s: {' '.join(argv)}\n--- output ---\n{out}", pytrace=False)
    finally:
        kill_group(proc)  # what srun/salloc started in their group
    return RunResult(argv, proc.returncode, out)


def kill_group(proc: subprocess.Popen[bytes] | subprocess.Popen[str]) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


def unavailable_reason() -> str | None:
    """Why no cluster can start here: None, or a reason to skip (not root). Missing binaries fail the test."""
    if os.geteuid() != 0:
        return "a private Slurm cluster needs root (munged runs as user munge, slurmd as root)"
    return None


def missing_binaries() -> list[str]:
    return [name for name in (*DAEMONS, *CLIENTS) if shutil.which(name, path=_sbin_path()) is None]


def _sbin_path() -> str:
    return os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])


def free_ports(n: int) -> list[int]:
    """n distinct TCP ports free on every address right now (held together, so never the same one twice)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("0.0.0.0", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def start_time(pid: int) -> int:
    """Field 22 of /proc/PID/stat: when the process started, in clock ticks after boot (with the pid, it names one
    process for good: a pid reused later has another start time)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat[stat.rindex(")") + 2:].split()[19])  # after the command name, which may hold spaces and ")"


def write_owner(root: Path, pid: int | None = None) -> None:
    """T/owner: "PID START_TIME" of the process that owns the cluster (this one), written whole (a temporary file
    renamed): scripts/fresh_state.sh leaves a cluster alone while its owner runs."""
    pid = os.getpid() if pid is None else pid
    tmp = root / "owner.tmp"
    tmp.write_text(f"{pid} {start_time(pid)}\n")
    tmp.replace(root / "owner")


def make_root(parent: Path | None = None) -> Path:
    root = Path(tempfile.mkdtemp(prefix=PREFIX, dir=parent))
    write_owner(root)
    root.chmod(0o755)
    for sub in ("etc", "state", "spool", "tmpfs", "log", "jobs"):
        (root / sub).mkdir()
    return root


def write_munge_key(root: Path) -> None:
    munge = pwd.getpwnam("munge")
    (root / "munge").mkdir(mode=0o755)
    key = root / "munge" / "munge.key"
    key.write_bytes(os.urandom(128))
    for path in (root / "munge", key):
        os.chown(path, munge.pw_uid, munge.pw_gid)
    key.chmod(0o400)


def slurm_conf(root: Path, node: str, cpus: int, ctld_port: int, slurmd_port: int,
               hosts: Sequence[SshHost] = (), ctld_address: str = "127.0.0.1") -> str:
    """The cluster's slurm.conf: node `node` at 127.0.0.1, or one node per host (its hostname at its address), with
    slurmd on `slurmd_port` (in each host's namespace) and slurmctld at `ctld_address`."""
    here = socket.gethostname().split(".")[0]  # slurmctld runs only where SlurmctldHost names this machine
    lines = {
        "ClusterName": "hvdtrain", "SlurmctldHost": f"{here}({ctld_address})",
        "SlurmUser": "root", "SlurmdUser": "root",
        "SlurmctldPort": ctld_port, "SlurmdPort": slurmd_port,
        "AuthType": "auth/munge", "CredType": "cred/munge",
        "AuthInfo": f"socket={root / 'munge' / 'munge.socket'},cred_expire={CRED_EXPIRE_S}",
        "StateSaveLocation": root / "state", "SlurmdSpoolDir": root / "spool" / "%n", "TmpFS": root / "tmpfs",
        "SlurmctldPidFile": root / "slurmctld.pid", "SlurmdPidFile": root / "slurmd.pid",
        "SlurmctldLogFile": root / "log" / "slurmctld.log", "SlurmdLogFile": root / "log" / "slurmd.log",
        "ProctrackType": "proctrack/linuxproc", "TaskPlugin": "task/none",
        "JobAcctGatherType": "jobacct_gather/none", "AccountingStorageType": "accounting_storage/none",
        "JobCompType": "jobcomp/none",
        "SelectType": "select/cons_tres", "SelectTypeParameters": "CR_Core", "MpiDefault": "none",
        "ReturnToService": 2, "MinJobAge": 300, "KillWait": 5, "JobRequeue": 1,
        # The node as configured even where the hardware's sockets/cores differ (CPUs= alone means N sockets).
        "SlurmdParameters": "config_overrides",
        "MailProg": "/bin/true",
        # A batch job starts within ~1 s of sbatch, not up to 3 s later (the scheduler's default batching), and a
        # pending job whose begin time has come (a requeued one) within ~1 s, not at the next 60 s pass.
        "SchedulerParameters": "batch_sched_delay=0,sched_interval=1",
    }
    if hosts:  # one slurmd per node on this machine's disk: each its own pid file, log and TmpFS (PMIx's folders)
        lines |= {"SlurmdPidFile": root / "slurmd-%n.pid", "SlurmdLogFile": root / "log" / "slurmd-%n.log",
                  "TmpFS": root / "tmpfs" / "%n"}
    text = [f"{k}={v}" for k, v in lines.items()]
    nodes = [(host.hostname, host.address) for host in hosts] or [(node, "127.0.0.1")]
    text += [f"NodeName={name} NodeAddr={address} CPUs={cpus} State=UNKNOWN" for name, address in nodes]
    text.append(f"PartitionName=debug Nodes={','.join(name for name, _ in nodes)} Default=YES MaxTime=INFINITE "
                "State=UP")
    return "\n".join(text) + "\n"


def _popen(cluster: SlurmCluster, name: str, argv: list[str], user: str | None = None) -> None:
    """Start a daemon in its own session, its stdout and stderr to log/<name>.out (as `user` and that user's
    group only, if given)."""
    with open(cluster.root / "log" / f"{name}.out", "wb") as log:
        cluster.procs[name] = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, cwd=cluster.root,
            env=cluster.full_env({"PATH": _sbin_path()}), start_new_session=True,
            user=user, group=user, extra_groups=[] if user else None)


def _wait_until(cluster: SlurmCluster, what: str, ready: Callable[[], bool]) -> None:
    deadline = time.monotonic() + START_S
    while not ready():
        for name, proc in cluster.procs.items():
            if proc.poll() is not None:
                out = (cluster.root / "log" / f"{name}.out").read_text(errors="replace")
                raise RuntimeError(f"{name} exited ({proc.returncode}) before {what}:\n{out}\n{cluster.logs()}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"no {what} within {START_S} s\n{cluster.logs()}")
        time.sleep(0.1)


def start(cluster: SlurmCluster) -> None:
    """munged, then slurmctld, then slurmd; return once sinfo shows the node idle."""
    m = cluster.root / "munge"
    _popen(cluster, "munged", [
        "munged", "-F", f"--key-file={m / 'munge.key'}", f"--socket={cluster.munge_socket}",
        f"--pid-file={m / 'munged.pid'}", f"--seed-file={m / 'munged.seed'}"], user="munge")
    _wait_until(cluster, "munged's socket", cluster.munge_socket.exists)
    _popen(cluster, "slurmctld", ["slurmctld", "-D", "-i", "-f", str(cluster.conf)])
    _wait_until(cluster, "slurmctld answering", lambda: cluster.run(["scontrol", "ping"], 10).returncode == 0)
    for node in cluster.node_names:
        for folder in ("spool", "tmpfs"):
            (cluster.root / folder / node).mkdir(exist_ok=True)
    slurmd = ["slurmd", "-D", "-f", str(cluster.conf), "-N"]
    if not cluster.hosts:
        _popen(cluster, "slurmd", [*slurmd, cluster.node])
    hosts_file = cluster.hosts_file or Path("/etc/hosts")
    for host in cluster.hosts:  # in the host's network namespace, under its names (NOTE [ Each host's names ])
        _popen(cluster, _slurmd(cluster, host.hostname), ["nsenter", f"--net=/run/netns/{host.namespace}",
                                                          *as_host(host, hosts_file, [*slurmd, host.hostname])])
    for node in cluster.node_names:
        _wait_until(cluster, f"node {node} idle", lambda node=node: cluster.node_state(node) == "idle")


def _slurmd(cluster: SlurmCluster, node: str) -> str:
    """The name a node's slurmd has in `cluster.procs` (and its log/<name>.out)."""
    return f"slurmd-{node}" if cluster.hosts else "slurmd"


def cancel_all(cluster: SlurmCluster) -> None:
    """scancel every job and wait (bounded) until none runs or completes any more."""
    if cluster.procs.get("slurmctld") is None or cluster.procs["slurmctld"].poll() is not None:
        return
    cluster.run(["scancel", "--quiet", f"--user={os.getuid()}"], timeout_s=10)
    deadline = time.monotonic() + STOP_S + 5  # KillWait=5 after the first SIGTERM
    while time.monotonic() < deadline:
        active = cluster.run(["squeue", "-h", "-o", "%i"], timeout_s=10)  # pending, running, completing ...
        if active.returncode != 0 or not active.output.strip():
            return
        time.sleep(0.2)


def stop_daemons(cluster: SlurmCluster) -> None:
    """SIGTERM each daemon (the slurmds first, munged last), SIGKILL after STOP_S, reap it."""
    for name in [*(_slurmd(cluster, node) for node in cluster.node_names), "slurmctld", "munged"]:
        proc = cluster.procs.get(name)
        if proc is None:
            continue
        with contextlib.suppress(ProcessLookupError):
            proc.terminate()
        try:
            proc.wait(timeout=STOP_S)
        except subprocess.TimeoutExpired:
            kill_group(proc)
            proc.wait(timeout=STOP_S)
        kill_group(proc)  # anything a daemon left in its session


def cluster_processes(conf: Path, job_id: int | None = None) -> dict[int, str]:
    """pid -> command line of every process whose environment names this cluster's SLURM_CONF (slurmstepd and job
    tasks inherit it, as do srun and salloc run through SlurmCluster.run); with job_id, only that job's."""
    markers = {f"SLURM_CONF={conf}".encode()} | ({f"SLURM_JOB_ID={job_id}".encode()} if job_id else set())
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            if markers <= set((entry / "environ").read_bytes().split(b"\0")):
                found[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    return found


def kill_leftovers(conf: Path) -> dict[int, str]:
    """SIGKILL what still runs with this cluster's SLURM_CONF; wait (bounded) until gone; return whom it hit."""
    hit = cluster_processes(conf)
    deadline = time.monotonic() + STOP_S
    while (pids := cluster_processes(conf)) and time.monotonic() < deadline:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)
    return hit


def teardown(cluster: SlurmCluster) -> None:
    try:
        cancel_all(cluster)
    finally:
        stop_daemons(cluster)
        kill_leftovers(cluster.conf)
        shutil.rmtree(cluster.root, ignore_errors=True)


@contextlib.contextmanager
def slurm_cluster_running(parent: Path | None = None, hosts: SshCluster | None = None) -> Iterator[SlurmCluster]:
    """Start a private cluster of one node, or of one node per host of `hosts` (T in `parent`, default $TMPDIR:
    every folder above T must be traversable by user munge); yield it; tear everything down (see the module
    docstring)."""
    nodes = hosts.hosts if hosts else []
    cluster = SlurmCluster(make_root(parent), nodes[0].hostname if nodes else socket.gethostname().split(".")[0],
                           os.cpu_count() or 2, hosts=list(nodes), client_env=hosts.client_env() if hosts else {},
                           hosts_file=hosts.hosts_file if hosts else None)
    try:
        write_munge_key(cluster.root)
        ctld_port, slurmd_port = free_ports(2)
        # The hosts reach slurmctld at the bridge's address in the root namespace (`.1` of their subnet).
        ctld_address = nodes[0].address.rsplit(".", 1)[0] + ".1" if nodes else "127.0.0.1"
        cluster.conf.write_text(slurm_conf(cluster.root, cluster.node, cluster.cpus, ctld_port, slurmd_port, nodes,
                                           ctld_address))
        start(cluster)
        yield cluster
    finally:
        teardown(cluster)



def render(spec: Path, *overrides: str, out: Path | None = None, flags: Sequence[str] = ()) -> Path:
    """`hvdtrain render slurm SPEC FLAGS -o ... --output OUT` (default: job.sbatch beside the spec), as a user runs
    it, from OUT's folder."""
    script = out or spec.parent / "job.sbatch"
    argv = [sys.executable, "-m", "hvdtrain.cli", "render", "slurm", str(spec), *flags, "--output", str(script)]
    for override in overrides:
        argv += ["-o", override]
    result = harness.run_bounded(argv, timeout=60, cwd=script.parent)
    assert result.returncode == 0, result.describe()
    return script


def submit(cluster: SlurmCluster, script: Path) -> int:
    """`sbatch SCRIPT` from the script's folder, with the script's own #SBATCH --output; the job id."""
    result = cluster.run(["sbatch", "--parsable", str(script)], cwd=script.parent)
    assert result.returncode == 0, result.describe()
    return int(result.output.strip().splitlines()[-1].split(";")[0])


def granted_job(output: str) -> int:
    """The job id of `salloc: Granted job allocation N`."""
    m = re.search(r"^salloc: Granted job allocation (\d+)$", output, re.M)
    assert m, output
    return int(m[1])


def check_slurm() -> None:
    reason = unavailable_reason()
    if reason:
        pytest.skip(f"no Slurm cluster: {reason}")
    missing = missing_binaries()
    if missing:
        pytest.fail(f"Slurm is not installed here (missing: {', '.join(missing)}): run `bash scripts/setup.sh` "
                    "(its apt step installs slurmctld, slurmd, slurm-client and munge)", pytrace=False)


def cluster_for_tests(hosts: SshCluster | None = None) -> Iterator[SlurmCluster]:
    check_slurm()
    with slurm_cluster_running(hosts=hosts) as cluster:
        yield cluster
