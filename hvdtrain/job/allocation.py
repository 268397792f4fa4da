"""Inside a Slurm allocation: the hosts and slots Slurm gave the job, from its environment. Text in, values out.

`hvdtrain run` started in an sbatch script or under `salloc`, for a spec that names no hosts, runs on the
allocation: one host per node of `SLURM_JOB_NODELIST` (a hostlist expression: `node[01-03],gpu7`), with the
slots of `SLURM_TASKS_PER_NODE` (`2(x3),1`: 2 on each of the first three nodes, 1 on the last). Started as one of
several tasks of an srun step (`srun -n4 hvdtrain run ...`), every task would start the whole job: that is refused
before anything starts. Nothing here reads files, starts a process or touches the network.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass

from hvdtrain.job.hosts import Host, HostError, hostname_problem, hosts_arg

_GROUP = re.compile(r"\[([^\[\]]*)\]")
_RANGE = re.compile(r"(\d+)(?:-(\d+))?")
_TASKS = re.compile(r"(\d+)(?:\(x(\d+)\))?")
MAX_NODES = 65536  # a bound on what an expression may expand to (Slurm's own clusters stay far below it)


class SlurmError(HostError):
    """Slurm's environment cannot be used as it is; the message names the variable, its value and the fix."""


@dataclass(frozen=True)
class Allocation:
    """The Slurm job `hvdtrain run` runs inside, and the hosts it gives the ranks."""

    job_id: str
    nodelist: str
    tasks_per_node: str
    hosts: tuple[Host, ...]

    @property
    def hosts_arg(self) -> str:
        """The hosts as `-H` takes them: `node01:2,node02:2`."""
        return hosts_arg(self.hosts)

    def describe(self) -> str:
        """One line for `--dry-run` and the console: where the hosts come from."""
        return (f"hosts from Slurm job {self.job_id}: {self.hosts_arg} (SLURM_JOB_NODELIST={self.nodelist}, "
                f"SLURM_TASKS_PER_NODE={self.tasks_per_node})")


def _split_top(text: str) -> list[str]:
    """`a[1-2,5],b` -> ['a[1-2,5]', 'b']: commas outside brackets separate the entries."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += (ch == "[") - (ch == "]")
        if depth not in (0, 1):
            raise SlurmError(f"SLURM_JOB_NODELIST={text!r}: unbalanced brackets")
        if ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise SlurmError(f"SLURM_JOB_NODELIST={text!r}: unbalanced brackets")
    return [*parts, text[start:]]


def _expand_group(body: str, whole: str) -> list[str]:
    """`01-03,7` -> ['01', '02', '03', '7'] (zero padding kept from the lower bound)."""
    out: list[str] = []
    for item in body.split(","):
        m = _RANGE.fullmatch(item)
        if not m:
            raise SlurmError(f"SLURM_JOB_NODELIST={whole!r}: {item!r} in [{body}] is not a number or a range N-M")
        lo, hi = m.group(1), m.group(2) or m.group(1)
        if int(hi) < int(lo) or len(out) + int(hi) - int(lo) >= MAX_NODES:
            raise SlurmError(f"SLURM_JOB_NODELIST={whole!r}: the range {item!r} is empty or too large")
        out += [str(n).zfill(len(lo)) for n in range(int(lo), int(hi) + 1)]
    return out


def expand_hostlist(text: str) -> list[str]:
    """Slurm's hostlist expression as host names, in Slurm's order (what `scontrol show hostnames` prints)."""
    names: list[str] = []
    for entry in _split_top(text.strip()):
        if not entry:
            raise SlurmError(f"SLURM_JOB_NODELIST={text!r}: an empty entry (two commas, or one at an end)")
        literals = _GROUP.split(entry)[::2]
        groups = [_expand_group(body, text) for body in _GROUP.findall(entry)]
        if len(groups) > 2:  # Slurm orders 3+ dimensions its own way: better no hosts than misplaced ranks
            raise SlurmError(f"SLURM_JOB_NODELIST={text!r}: {entry!r} has {len(groups)} bracket groups; hvdtrain "
                             "reads at most 2: set hosts in the spec")
        if len(names) + math.prod(len(g) for g in groups) > MAX_NODES:
            raise SlurmError(f"SLURM_JOB_NODELIST={text!r}: more than {MAX_NODES} nodes")
        for combo in itertools.product(*groups):
            names.append("".join(lit + num for lit, num in zip(literals, [*combo, ""], strict=True)))
    return names


def expand_tasks_per_node(text: str) -> list[int]:
    """`2(x3),1` -> [2, 2, 2, 1]: the tasks Slurm placed on each node of the allocation, in node order."""
    counts: list[int] = []
    for item in text.strip().split(","):
        m = _TASKS.fullmatch(item)
        if not m or int(m.group(1)) < 1 or (m.group(2) is not None and int(m.group(2)) < 1):
            raise SlurmError(f"SLURM_TASKS_PER_NODE={text!r}: {item!r} is not N or N(xM) with N, M >= 1")
        repeat = int(m.group(2) or 1)
        if len(counts) + repeat > MAX_NODES:
            raise SlurmError(f"SLURM_TASKS_PER_NODE={text!r}: more than {MAX_NODES} nodes")
        counts += [int(m.group(1))] * repeat
    return counts


def allocation_from_env(env: Mapping[str, str]) -> Allocation | None:
    """The allocation this process runs in, or None outside Slurm (no SLURM_JOB_ID)."""
    job_id = env.get("SLURM_JOB_ID")
    if not job_id:
        return None
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST", "")
    tasks = env.get("SLURM_TASKS_PER_NODE", "")
    if not nodelist or not tasks:
        missing = "SLURM_JOB_NODELIST" if not nodelist else "SLURM_TASKS_PER_NODE"
        raise SlurmError(f"SLURM_JOB_ID={job_id} is set but {missing} is not: start hvdtrain run from the job's "
                         "batch script or salloc shell (where Slurm sets both), or set hosts in the spec")
    if env.get("SLURM_HET_SIZE"):
        raise SlurmError(f"Slurm job {job_id} is heterogeneous (SLURM_HET_SIZE={env['SLURM_HET_SIZE']}): its "
                         "variables describe one component only; set hosts in the spec (-o hosts=node1:4,node2:4)")
    if env.get("SLURM_STEP_ID"):
        raise SlurmError(f"this runs inside step {job_id}.{env['SLURM_STEP_ID']} (srun), where SLURM_TASKS_PER_NODE "
                         "describes the step, not the allocation: run hvdtrain run in the batch script or the "
                         "salloc shell, or set hosts in the spec (-o hosts=node1:4,node2:4)")
    names, counts = expand_hostlist(nodelist), expand_tasks_per_node(tasks)
    if len(names) != len(counts):
        raise SlurmError(f"SLURM_JOB_NODELIST={nodelist!r} names {len(names)} node(s) but SLURM_TASKS_PER_NODE="
                         f"{tasks!r} gives tasks for {len(counts)}: this environment is not from one Slurm job; "
                         "set hosts in the spec instead")
    for name in names:
        problem = hostname_problem(name)
        if problem:
            raise SlurmError(f"SLURM_JOB_NODELIST={nodelist!r}: {problem}; set hosts in the spec with the nodes' "
                             "addresses instead")
    hosts = tuple(Host(name, slots) for name, slots in zip(names, counts, strict=True))
    return Allocation(job_id=job_id, nodelist=nodelist, tasks_per_node=tasks, hosts=hosts)


def srun_task_problem(env: Mapping[str, str]) -> str | None:
    """Why `hvdtrain run` must not go on here: it is one of several tasks of an srun step. None when it may."""
    tasks = env.get("SLURM_STEP_NUM_TASKS", "")
    if not env.get("SLURM_JOB_ID") or not tasks.isdigit() or int(tasks) < 2:
        return None
    step = env.get("SLURM_STEP_ID", "?")
    return (f"this is task {env.get('SLURM_PROCID', '?')} of {tasks} of Slurm step {env['SLURM_JOB_ID']}.{step}: "
            f"every task would start the whole job. Run `hvdtrain run` once per allocation (in the batch script "
            f"or the salloc shell, not under srun): it starts every rank on the allocation's nodes itself; or "
            f"render a script whose ranks srun starts: `hvdtrain render slurm JOB.yaml --launcher srun`")
