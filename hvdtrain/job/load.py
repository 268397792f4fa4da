"""Load a job spec: YAML text (+ `-o key.path=value` overrides) -> a validated `JobSpec`, or a `SpecError`.

Every error names where the bad value came from (`file:line`, or the `-o` override), the key path, the value,
what is allowed and how to fix it. The models live in `model.py`. Reading files is the only I/O here; nothing
starts a process or touches the network.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from hvdtrain import textfile
from hvdtrain.job import recipe
from hvdtrain.job.allocation import Allocation
from hvdtrain.job.flags import extra_args_problems, modeled_flags
from hvdtrain.job.hosts import MAX_SLOTS, Host, HostError, check_np, parse_hostfile, parse_hosts, total_slots
from hvdtrain.job.model import JobSpec

KeyPath = tuple[str | int, ...]
_NO_VALUE = object()
MODELED_FLAGS = modeled_flags(JobSpec)  # horovodrun option (every spelling) -> the spec key that sets it


# Keys whose values are passed on as text (argv elements, environment values): a plain (unquoted) scalar there is
# taken as the user wrote it. YAML 1.1 would read `1:30` as 90, `0x1F` as 31, `0.10` as 0.1, `yes` as true and
# `2024-01-01` as a date.
AS_WRITTEN = ("args", "env", "extra_args")
_STR_TAG, _NULL_TAG, _MERGE_TAG = "tag:yaml.org,2002:str", "tag:yaml.org,2002:null", "tag:yaml.org,2002:merge"


@dataclass(frozen=True)
class Issue:
    """One problem with a spec: the key path, what is wrong, and (when known) the value, what is allowed, the fix."""

    path: KeyPath
    problem: str
    value: Any = _NO_VALUE
    allowed: str = ""
    fix: str = ""


class SpecError(Exception):
    """An invalid job spec; `str()` is the full, user-facing report. The CLI maps it to exit code 2."""

    def __init__(self, origin: str, issues: Sequence[Issue], lines: dict[KeyPath, int] | None = None,
                 overrides: dict[KeyPath, str] | None = None) -> None:
        self.origin, self.issues = origin, list(issues)
        self.lines, self.overrides = lines or {}, overrides or {}
        super().__init__(self.render())

    def where(self, path: KeyPath) -> str:
        for n in range(len(path), 0, -1):
            if path[:n] in self.overrides:
                return f"override -o {self.overrides[path[:n]]}"
        line = self.line_of(path)
        return f"{self.origin}:{line}" if line else self.origin

    def line_of(self, path: KeyPath) -> int:
        return next((self.lines[path[:n]] for n in range(len(path), -1, -1) if path[:n] in self.lines), 0)

    def render(self) -> str:
        out = [f"{self.origin}: invalid job spec ({len(self.issues)} problem{'s' * (len(self.issues) > 1)})"]
        for issue in sorted(self.issues, key=lambda i: self.line_of(i.path)):
            key = dotted(issue.path) or "(top level)"
            out.append(f"{self.where(issue.path)}: {key}: {issue.problem}")
            if issue.value is not _NO_VALUE:
                out.append(f"  got: {issue.value!r}")
            if issue.allowed:
                out.append(f"  allowed: {issue.allowed}")
            out.append(f"  fix: {issue.fix or f'change {key} to an allowed value'}")
        return "\n".join(out)


def dotted(path: KeyPath) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path).lstrip(".")


def key_lines(node: yaml.Node | None, path: KeyPath = ()) -> tuple[dict[KeyPath, int], list[Issue]]:
    """Map each key path to its 1-based line (yaml's node API); also report keys repeated in one mapping."""
    lines: dict[KeyPath, int] = {}
    issues: list[Issue] = []
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            sub = (*path, key_node.value)
            if sub in lines:
                issues.append(Issue(sub, f"key repeated (first on line {lines[sub]}); YAML would silently keep "
                                         "only the last one", fix=f"remove one of the two {dotted(sub)} keys"))
            lines[sub] = key_node.start_mark.line + 1
            more, more_issues = key_lines(value_node, sub)
            lines.update(more)
            issues += more_issues
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            lines[(*path, index)] = item.start_mark.line + 1
            more, more_issues = key_lines(item, (*path, index))
            lines.update(more)
            issues += more_issues
    return lines, issues


def as_written(value: Any, node: yaml.Node | None, path: KeyPath = ()) -> Any:
    """`value` (what YAML built from `node`) with each plain scalar under AS_WRITTEN replaced by its source text.

    `path` is where `node` sits in the spec (an override's key path). Null stays None: the models reject it.
    """
    if isinstance(node, yaml.ScalarNode):
        text_key = len(path) == 2 and path[0] in AS_WRITTEN
        keep = text_key and node.style is None and node.tag not in (_STR_TAG, _NULL_TAG)
        return node.value if keep else value
    if len(path) >= 2:
        return value
    if isinstance(node, yaml.SequenceNode) and isinstance(value, list) and len(value) == len(node.value):
        return [as_written(v, n, (*path, i)) for i, (v, n) in enumerate(zip(value, node.value, strict=True))]
    if isinstance(node, yaml.MappingNode) and isinstance(value, dict):
        value = dict(value)
        for key, value_node in _entries(node).items():
            if key in value:
                value[key] = as_written(value[key], value_node, (*path, key))
    return value


def _entries(node: yaml.MappingNode) -> dict[str, yaml.Node]:
    """A mapping's string keys -> the node of the value YAML keeps: merged `<<: *base` entries first (an earlier
    one in `<<: [*a, *b]` wins), then the keys written in the mapping itself (they win over merged ones)."""
    entries: dict[str, yaml.Node] = {}
    for key_node, value_node in node.value:
        if key_node.tag == _MERGE_TAG:
            merged = value_node.value if isinstance(value_node, yaml.SequenceNode) else [value_node]
            for source in reversed(merged):
                if isinstance(source, yaml.MappingNode):
                    entries.update(_entries(source))
    for key_node, value_node in node.value:
        if key_node.tag == _STR_TAG:
            entries[key_node.value] = value_node
    return entries


def parse_yaml(text: str, origin: str) -> tuple[dict[str, Any], dict[KeyPath, int]]:
    """YAML text -> (mapping, key-path -> line). Syntax errors become a SpecError quoting the line."""
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = mark.line + 1 if mark else 0
        quoted = text.splitlines()[line - 1].strip() if 0 < line <= len(text.splitlines()) else ""
        problem = f"YAML syntax error: {getattr(exc, 'problem', None) or exc}"
        raise SpecError(origin, [Issue((), problem, value=quoted or _NO_VALUE,
                                       fix="fix the YAML syntax on that line (indentation, ':' after keys, quotes)")],
                        {(): line} if line else None) from None
    if not isinstance(data, dict):
        raise SpecError(origin, [Issue((), "the spec must be a mapping of keys (script, np, ...)", value=data,
                                       fix="start from jobs/quickstart.yaml; `hvdtrain schema` lists every key")])
    data = as_written(data, node)
    lines, issues = key_lines(node)
    if issues:
        raise SpecError(origin, issues, lines)
    return data, lines


def apply_override(data: dict[str, Any], override: str) -> KeyPath:
    """Set `key.path=value` (value parsed as YAML) in data, in place; returns the key path."""
    key, sep, raw = override.partition("=")
    path: KeyPath = tuple(int(p) if p.isdigit() else p for p in key.strip().split("."))
    if not sep or not key.strip() or any(p == "" for p in path):
        raise SpecError(f"-o {override}", [Issue((), "expected key.path=value", value=override,
                                                 fix="write e.g. -o np=4 or -o horovod.cycle_time_ms=2.5")])
    try:
        value = as_written(yaml.safe_load(raw), yaml.compose(raw, Loader=yaml.SafeLoader), path) if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise SpecError(f"-o {override}", [Issue(path, f"value is not valid YAML: {exc}", value=raw,
                                                 fix="quote the value")]) from None
    node: Any = data
    for i, part in enumerate(path[:-1]):
        if isinstance(node, list) and isinstance(part, int) and part < len(node):
            node = node[part]
            continue
        if not isinstance(node, dict):
            raise SpecError(f"-o {override}", [Issue(path[:i + 1], "cannot set a key inside a non-mapping value",
                                                     value=node, fix="override the whole value instead")])
        if node.get(part) is None:
            node[part] = {}
        node = node[part]
    last = path[-1]
    settable = isinstance(node, dict) or (isinstance(node, list) and isinstance(last, int) and last < len(node))
    if not settable:
        raise SpecError(f"-o {override}", [Issue(path, "cannot set this key", value=node,
                                                 fix="override the parent key as a whole")])
    node[last] = value
    return path


def _field_at(path: KeyPath) -> Any:
    """The pydantic FieldInfo a key path points to (inside lists/dicts: the containing field), or None."""
    model: type[BaseModel] | None = JobSpec
    field = None
    for part in path:
        if isinstance(part, int):
            continue
        if model is None:
            break
        field = model.model_fields.get(part)
        if field is None:
            return None
        model = _submodel(field.annotation)
    return field


def _submodel(annotation: Any) -> type[BaseModel] | None:
    for t in (annotation, *getattr(annotation, "__args__", ())):
        if isinstance(t, type) and issubclass(t, BaseModel):
            return t
    return None


def allowed_keys(parent: KeyPath) -> list[str]:
    field = _field_at(parent) if parent else None
    model = _submodel(field.annotation) if field is not None else JobSpec
    return sorted(model.model_fields) if model else []


def _fix_for(path: KeyPath, err: Any) -> str:
    value = err["input"]
    if err["type"] in ("int_type", "float_type", "bool_type") and isinstance(value, str):
        try:
            unquoted = yaml.safe_load(value)
        except yaml.YAMLError:
            unquoted = None
        if isinstance(unquoted, int | float) and not isinstance(unquoted, str):
            return f"remove the quotes: write {path[-1]}: {value}"
    return f"change {dotted(path)} to an allowed value"


def _validation_issues(exc: ValidationError) -> list[Issue]:
    issues = []
    for err in exc.errors(include_url=False):
        path: KeyPath = tuple(p for p in err["loc"] if p != "[key]")
        field = _field_at(path)
        described = field.description if field is not None else ""
        if err["type"] == "extra_forbidden":
            allowed = allowed_keys(path[:-1])
            guess = difflib.get_close_matches(str(path[-1]), allowed, n=1, cutoff=0.5)
            fix = f"remove {path[-1]!r}" + (f" or rename it to {guess[0]!r}" if guess else "")
            issues.append(Issue(path, "unknown key", err["input"], "keys here: " + ", ".join(allowed), fix))
        elif err["type"] == "missing":
            issues.append(Issue(path, "required key is missing", allowed=described,
                                fix=f"add '{path[-1]}:' to the spec"))
        else:
            problem = err["msg"].removeprefix("Value error, ")
            issues.append(Issue(path, problem, err["input"], described, _fix_for(path, err)))
    return issues


def _elastic_issues(spec: JobSpec) -> list[Issue]:
    el = spec.elastic
    if el is None:
        return []
    issues = []
    if spec.controller == "mpi":
        issues.append(Issue(("controller",), "elastic training runs only with the Gloo controller", "mpi",
                            "gloo (or leave controller unset)", "remove 'controller: mpi' or the elastic section"))
    for key in ("hosts", "hostfile"):
        if getattr(spec, key) is not None:
            issues.append(Issue((key,), "elastic jobs get their hosts from elastic.discovery_script",
                                getattr(spec, key), fix=f"remove {key} (or remove the elastic section)"))
    if el.min_np is not None and el.min_np > spec.np:
        issues.append(Issue(("elastic", "min_np"), f"min_np is above np ({spec.np})", el.min_np,
                            f"1..{spec.np}", f"lower elastic.min_np to at most {spec.np}, or raise np"))
    if el.max_np is not None and el.max_np < spec.np:
        issues.append(Issue(("elastic", "max_np"), f"max_np is below np ({spec.np})", el.max_np,
                            f">= {spec.np}", f"raise elastic.max_np to at least {spec.np}, or lower np"))
    return issues


def cross_checks(spec: JobSpec, *, in_allocation: bool = False) -> list[Issue]:
    """Rules that span several keys (the models check each key on its own). in_allocation: a spec without hosts
    runs on a Slurm allocation's nodes, not on this machine alone."""
    issues = _elastic_issues(spec)
    if spec.hosts is not None and spec.hostfile is not None:
        issues.append(Issue(("hostfile",), "hosts and hostfile are both set", spec.hostfile,
                            fix="keep one of them: hosts for a short list, hostfile for a file "
                                "(with -o hosts=..., also pass -o hostfile=null)"))
    if spec.elastic is None and spec.hosts is not None:
        try:
            check_np(parse_hosts(spec.hosts), spec.np, "hosts")
        except HostError as exc:
            issues.append(Issue(("np",), str(exc), spec.np, fix="lower np or add slots to hosts"))
    if spec.elastic is None and spec.hosts is None and spec.hostfile is None and spec.np > MAX_SLOTS \
            and not in_allocation:
        issues.append(Issue(("np",), f"with no hosts or hostfile every rank runs on this machine, and a host has at "
                                     f"most {MAX_SLOTS} slots", spec.np, f"1..{MAX_SLOTS} on one host",
                            "lower np, or set hosts (or a hostfile) to spread the ranks over several machines"))
    if spec.elastic is None:
        for i, rank in enumerate(spec.logs.console_ranks or []):
            if rank >= spec.np:
                issues.append(Issue(("logs", "console_ranks", i), f"there is no rank {rank} with np = {spec.np}",
                                    rank, f"0..{spec.np - 1}", "remove it or raise np"))
    issues += [Issue(("extra_args", i), problem, spec.extra_args[i], fix=fix)
               for i, problem, fix in extra_args_problems(spec.extra_args, MODELED_FLAGS)]
    if spec.horovod.autotune_log_file and not spec.horovod.autotune:
        issues.append(Issue(("horovod", "autotune_log_file"), "Horovod writes the autotune log only when "
                            "autotuning", spec.horovod.autotune_log_file, fix="also set horovod.autotune: true"))
    return issues


def file_issues(spec: JobSpec) -> list[Issue]:
    """Files the job needs must exist (and the discovery script be executable). Only stats files."""
    issues = []
    if not os.path.isfile(spec.script):
        issues.append(Issue(("script",), "the training script does not exist", spec.script,
                            fix="fix the path (relative paths are relative to the spec file)"))
    if spec.workdir is not None and not os.path.isdir(spec.workdir):
        issues.append(Issue(("workdir",), "the working directory does not exist", spec.workdir,
                            fix="create it, or fix the path (relative to the spec file)"))
    if "/" in spec.python and not os.access(spec.python, os.X_OK):
        issues.append(Issue(("python",), "the interpreter does not exist or is not executable", spec.python,
                            fix="fix the path, or leave python unset to use hvdtrain's own interpreter"))
    if spec.ssh.identity_file and not os.path.isfile(spec.ssh.identity_file):
        issues.append(Issue(("ssh", "identity_file"), "the identity file does not exist", spec.ssh.identity_file,
                            fix="fix the path (relative to the spec file)"))
    script = spec.elastic.discovery_script if spec.elastic else None
    if script and not (os.path.isfile(script) and os.access(script, os.X_OK)):
        problem = "is not executable" if os.path.isfile(script) else "does not exist"
        issues.append(Issue(("elastic", "discovery_script"), f"the discovery script {problem}", script,
                            fix=f"chmod +x {script}" if os.path.isfile(script) else "fix the path"))
    return issues


def _hostfile_hosts(path: str, np: int, read_text: Callable[[str], str]) -> tuple[list[Host] | None, list[Issue]]:
    try:
        text = read_text(path)
    except OSError as exc:  # NotText included: it names the line and says to save the file as UTF-8
        return None, [Issue(("hostfile",), f"cannot read the hostfile: {exc.strerror or exc}", path,
                            fix=textfile.fix_for(exc, "fix the path (relative to the spec file)"))]
    try:
        hosts = parse_hostfile(text, origin=path)
        check_np(hosts, np, path)
    except HostError as exc:
        return None, [Issue(("hostfile",), str(exc), fix=f"edit {path} as the message says")]
    return hosts, []


def _allocation_hosts(allocation: Allocation, np: int) -> tuple[list[Host] | None, list[Issue]]:
    hosts = list(allocation.hosts)
    try:
        check_np(hosts, np, f"the Slurm allocation (job {allocation.job_id})")
    except HostError as exc:
        return None, [Issue(("np",), str(exc), np, fix=f"lower np to at most {total_slots(hosts)}, or ask Slurm "
                                                       f"for {np} tasks (sbatch/salloc --ntasks={np})")]
    return hosts, []


def load_spec(text: str, origin: str, *, base_dir: str | Path | None = None, overrides: Sequence[str] = (),
              read_text: Callable[[str], str] | None = None, check_files: bool = False,
              allocation: Callable[[], Allocation | None] | None = None,
              local_file: Callable[[str], Path] | None = None) -> JobSpec:
    """Validate a spec's YAML text; `origin` names it in errors, relative paths resolve against base_dir.

    The returned spec's `hosts` is always the canonical `a:4,b:4` (from hosts, the hostfile, else the Slurm
    `allocation`'s nodes, else localhost:np), or None for elastic jobs. `allocation()` (the Slurm allocation this
    runs in, if any) is asked only for a spec that names no hosts. `read_text(path)` reads the hostfile (default:
    the real file); `local_file(path)` is where this machine has a file the spec names (default: the path itself;
    a render resolves paths against the cluster's folder), to tell a shipped recipe from a changed copy.
    """
    data, lines = parse_yaml(text, origin)
    override_at = {apply_override(data, o): o for o in overrides}
    context = {"base_dir": str(base_dir if base_dir is not None else Path(origin).parent)}
    try:
        spec = JobSpec.model_validate(data, context=context)
    except ValidationError as exc:
        raise SpecError(origin, _validation_issues(exc), lines, override_at) from None
    spec = recipe.decide(spec, local_file(spec.script) if local_file is not None else None)
    no_hosts = spec.hosts is None and spec.hostfile is None and spec.elastic is None
    found = allocation() if allocation is not None and no_hosts else None
    issues = cross_checks(spec, in_allocation=found is not None) + (file_issues(spec) if check_files else [])
    issues += [Issue(r.path, r.problem, r.value, r.allowed, r.fix) for r in recipe.problems(spec)]
    hosts: list[Host] | None = None
    if not issues and spec.hostfile is not None:
        hosts, issues = _hostfile_hosts(spec.hostfile, spec.np, read_text or textfile.read_text)
    if not issues and found is not None:
        hosts, issues = _allocation_hosts(found, spec.np)
    if issues:
        raise SpecError(origin, issues, lines, override_at)
    if hosts is not None:
        return spec.model_copy(update={"hosts": ",".join(str(h) for h in hosts)})
    if spec.hosts is None and spec.elastic is None:
        return spec.model_copy(update={"hosts": f"localhost:{spec.np}"})
    return spec


def read_spec_text(path: str | Path) -> str:
    """A spec file's text, or a SpecError: cannot read it, or not UTF-8 (then with the line of the bad byte)."""
    try:
        return textfile.read_text(path)
    except OSError as exc:
        line = exc.line if isinstance(exc, textfile.NotText) else 0
        raise SpecError(str(path), [Issue((), f"cannot read the spec: {exc.strerror or exc}",
                                          fix=textfile.fix_for(exc, "check the path"))],
                        {(): line} if line else None) from None


def load_spec_file(path: str | Path, overrides: Sequence[str] = (), check_files: bool = True,
                   allocation: Callable[[], Allocation | None] | None = None) -> JobSpec:
    """Read and validate a job spec file (relative paths inside it are relative to its folder); a spec with no
    hosts runs on the Slurm `allocation`'s nodes when there is one."""
    text = read_spec_text(path)
    return load_spec(text, str(path), base_dir=Path(path).resolve().parent, overrides=overrides,
                     check_files=check_files, allocation=allocation)
