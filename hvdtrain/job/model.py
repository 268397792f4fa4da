"""The job spec's typed models (pydantic v2): every key a job YAML may hold, with what it allows.

`load.py` loads YAML into these models and turns validation errors into `file:line` messages; `plan.py` turns a
`JobSpec` into horovodrun's argv. Relative paths are resolved against the spec file's folder (the validation
context's `base_dir`). Nothing here starts a process or touches the network.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
)

from hvdtrain.job.flags import Flag, flag_field
from hvdtrain.job.hosts import hosts_arg, parse_hosts
from hvdtrain.settings.parse import setting_argv

LOG_LEVELS = ("TRACE", "DEBUG", "INFO", "WARNING", "ERROR", "FATAL")
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
NIC_NAME = re.compile(r"[A-Za-z0-9_.:@-]{1,64}")
# horovodrun puts these paths into shell command strings without quoting (ssh -i, the discovery script).
SHELL_SAFE_PATH = re.compile(r"[A-Za-z0-9_./+@%=:,~-]+")
SHELL_SAFE_ALLOWED = "letters, digits and _ . / + @ % = : , ~ - (no spaces or shell characters)"

PosInt = Annotated[int, Field(ge=1)]
NonNegInt = Annotated[int, Field(ge=0)]


def _numbers_to_str(value: Any) -> Any:
    """args and env values are strings. A spec's YAML gives them as written (hvdtrain.job.load.as_written); a spec built
    in Python may hold numbers: take them as str()."""
    if value is None:
        raise ValueError("the value is empty (YAML reads nothing after the colon or dash, `~` and `null` as no "
                         "value); write \"\" for an empty string, or remove it")
    if isinstance(value, bool):
        raise ValueError("YAML read this as a boolean (yes/no/true/false/on/off); quote it, e.g. \"true\"")
    if isinstance(value, int | float):
        return str(value)
    return value


def _env_name(name: str) -> str:
    if not ENV_NAME.fullmatch(name):
        raise ValueError("invalid variable name: use letters, digits and _, not starting with a digit")
    return name


Text = Annotated[str, BeforeValidator(_numbers_to_str)]
EnvName = Annotated[str, AfterValidator(_env_name)]
HostsValue = Annotated[str, WithJsonSchema(
    {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]})]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


def resolve_path(value: str | None, info: ValidationInfo) -> str | None:
    """A path relative to the spec file's folder (validation context `base_dir`), made absolute."""
    if value is None:
        return None
    if not value.strip():
        raise ValueError("the path is empty")
    base = Path((info.context or {}).get("base_dir", "."))
    return str((base / Path(value).expanduser()).resolve(strict=False))


def _shell_safe(value: str | None) -> str | None:
    if value is not None and not SHELL_SAFE_PATH.fullmatch(value):
        raise ValueError(f"horovodrun passes this path to a shell unquoted; it may only contain {SHELL_SAFE_ALLOWED}")
    return value


class Ssh(_Model):
    """How horovodrun reaches remote hosts over ssh (it checks every host with ssh before launching)."""

    port: Annotated[int, Field(ge=1, le=65535)] | None = flag_field(
        Flag("--ssh-port", aliases=("-p",)), "ssh port on every host, 1..65535.")
    identity_file: str | None = flag_field(
        Flag("--ssh-identity-file", aliases=("-i",)),
        f"Private key file for ssh (relative to the spec file); {SHELL_SAFE_ALLOWED}.")

    _resolve = field_validator("identity_file")(lambda v, info: _shell_safe(resolve_path(v, info)))


def _switch(name: str) -> Flag:
    return Flag(f"--{name}", off=f"--no-{name}")


class HorovodKnobs(_Model):
    """Horovod runtime knobs, each mapped to the horovodrun flag of the same meaning. Unset means Horovod's default."""

    fusion_threshold_mb: NonNegInt | None = flag_field(
        Flag("--fusion-threshold-mb"), "tensor fusion buffer in MB, an integer >= 0 (0 disables fusion).")
    cycle_time_ms: Annotated[float, Field(gt=0)] | None = flag_field(
        Flag("--cycle-time-ms"), "delay between fusion cycles in ms, a number > 0.")
    cache_capacity: NonNegInt | None = flag_field(
        Flag("--cache-capacity"), "tensor names cached for coordination, an integer >= 0.")
    hierarchical_allreduce: bool | None = flag_field(
        _switch("hierarchical-allreduce"), "allreduce within hosts, then across them.")
    hierarchical_allgather: bool | None = flag_field(
        _switch("hierarchical-allgather"), "allgather within hosts, then across them.")
    autotune: bool | None = flag_field(_switch("autotune"), "let Horovod tune fusion and cycle time while training.")
    autotune_log_file: str | None = flag_field(
        Flag("--autotune-log-file"), "CSV of autotune trials (relative to the spec file); needs autotune: true.")
    timeline_file: str | None = flag_field(
        Flag("--timeline-filename"), "JSON timeline of Horovod events (relative to the spec file).")
    timeline_mark_cycles: bool | None = flag_field(
        _switch("timeline-mark-cycles"), "mark fusion cycles in the timeline.")
    stall_check: bool | None = flag_field(
        Flag("--stall-check", off="--no-stall-check"), "warn when ranks stall in a collective.")
    stall_check_warning_s: PosInt | None = flag_field(
        Flag("--stall-check-warning-time-seconds"), "an integer >= 1.")
    stall_check_shutdown_s: NonNegInt | None = flag_field(
        Flag("--stall-check-shutdown-time-seconds"), "an integer >= 0 (0: never shut down).")
    log_level: Literal["TRACE", "DEBUG", "INFO", "WARNING", "ERROR", "FATAL"] | None = flag_field(
        Flag("--log-level"), f"Horovod's backend log level: one of {', '.join(LOG_LEVELS)}.")
    gloo_timeout_s: PosInt | None = flag_field(Flag("--gloo-timeout-seconds"), "an integer >= 1.")
    start_timeout_s: PosInt | None = flag_field(
        Flag("--start-timeout"), "seconds horovodrun may take to check hosts and start ranks, >= 1.")
    num_nccl_streams: PosInt | None = flag_field(Flag("--num-nccl-streams"), "an integer >= 1.")
    tcp_only: bool = flag_field(Flag("--tcp"), "use only TCP for communication (true/false).", False)
    verbose: bool = flag_field(Flag("--verbose"), "horovodrun prints what it does (true/false).", False)

    _resolve = field_validator("autotune_log_file", "timeline_file")(resolve_path)


class Elastic(_Model):
    """Elastic training (Gloo only): hosts come from a discovery script and the job rescales between min/max np."""

    discovery_script: str = flag_field(
        Flag("--host-discovery-script"), "executable that prints one 'host:slots' per line (relative to the "
                                         f"spec file); {SHELL_SAFE_ALLOWED}.", ...)
    min_np: PosInt | None = flag_field(
        Flag("--min-np", aliases=("--min-num-proc",)), "fewest ranks to keep training, 1..np (default: np).")
    max_np: PosInt | None = flag_field(
        Flag("--max-np", aliases=("--max-num-proc",)),
        "most ranks, >= np (default: np; horovodrun itself would leave it unbounded).")
    slots_per_host: PosInt | None = flag_field(
        Flag("--slots-per-host"), "slots on hosts the discovery script prints without ':slots', >= 1.")
    reset_limit: NonNegInt | None = flag_field(Flag("--reset-limit"), "most rescales before failing, >= 0.")
    timeout_s: PosInt | None = flag_field(
        Flag("--elastic-timeout"), "seconds to wait for hosts after a rescale, >= 1 (Horovod: 600).")
    blacklist_cooldown_s: list[Annotated[int, Field(ge=1, le=3600)]] | None = flag_field(
        Flag("--blacklist-cooldown-range"), "[MIN, MAX] seconds, 1 <= MIN <= MAX <= 3600: a host blacklisted for "
                                            "a failed rank may rejoin after ~MIN × 2^failures s (at most MAX) if "
                                            "discovery lists it; unset: it never rejoins.")

    _resolve = field_validator("discovery_script")(lambda v, info: _shell_safe(resolve_path(v, info)))

    @field_validator("blacklist_cooldown_s")
    @classmethod
    def _cooldown(cls, value: list[int] | None) -> list[int] | None:
        if value is not None and (len(value) != 2 or value[0] > value[1]):
            raise ValueError("expected [MIN, MAX] seconds with MIN <= MAX, e.g. [10, 300]")
        return value


class Logs(_Model):
    """Where rank output goes: the console (rank-prefixed) and, with `dir`, one file per rank."""

    dir: str | None = Field(
        None, description="Folder for rank.<N>.log (one per rank) and launcher.log (relative to the spec file).")
    timestamp: bool = Field(False, description="Prefix every output line with the local time (true/false).")
    console_ranks: list[NonNegInt] | None = Field(
        None, description="Ranks whose output is echoed to the console: a list of ranks, [] for none; "
                          "omit for all. Log files always get every rank.")

    _resolve = field_validator("dir")(resolve_path)


# Kubernetes names: a DNS-1123 subdomain (Secrets, PersistentVolumeClaims) and label (namespaces); a Secret's key.
K8S_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
K8S_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
SECRET_KEY = re.compile(r"[-._a-zA-Z0-9]{1,253}")
# A Kubernetes quantity as the API server takes it (e.g. 16Gi, 512Mi, 2G).
QUANTITY = re.compile(r"[0-9]+(\.[0-9]+)?([KMGTPE]i|[kMGTPE])?")
CPU_QUANTITY = re.compile(r"([0-9]+(\.[0-9]+)?|[0-9]+m)")  # cores (2, 0.5) or millicores (3500m)


def _matching(pattern: re.Pattern[str], what: str) -> AfterValidator:
    def check(value: str | None) -> str | None:
        if value is not None and (len(value) > 253 or not pattern.fullmatch(value)):
            raise ValueError(f"not {what}")
        return value
    return AfterValidator(check)


K8sName = Annotated[str, _matching(K8S_SUBDOMAIN, "a Kubernetes object name: lowercase letters, digits, '-' and '.', "
                                                  "starting and ending with a letter or digit (e.g. s3-creds)")]


class SecretRef(_Model):
    """One key of a Secret in the job's namespace (`kubectl create secret generic NAME --from-literal=KEY=...`)."""

    secret: K8sName = Field(description="The Secret's name.")
    key: Annotated[str, _matching(SECRET_KEY, "a Secret key: letters, digits, '-', '_' and '.'")] = Field(
        description="The key within the Secret.")


def _image(value: str | None) -> str | None:
    if value is not None and (not value or any(c.isspace() for c in value) or value.startswith("-")):
        raise ValueError("not an image reference; write it as the cluster pulls it, e.g. "
                         "registry.example.com/team/hvdtrain:gpu")
    return value


def _quantity(value: str) -> str:
    if value != "auto" and not QUANTITY.fullmatch(value):
        raise ValueError("expected 'auto' or a Kubernetes quantity such as 16Gi or 512Mi")
    return value


def _memory(value: str | None) -> str | None:
    if value is not None and not QUANTITY.fullmatch(value):
        raise ValueError("expected a Kubernetes quantity such as 64Gi or 512Mi")
    return value


def _cpu_text(value: object) -> object:
    """`cpu: 16` in YAML is a number: the quantity's text."""
    return str(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else value


def _cpu(value: str | None) -> str | None:
    if value is not None and (not CPU_QUANTITY.fullmatch(value) or not float(value.removesuffix("m")) > 0):
        raise ValueError("expected cores > 0 as a Kubernetes quantity such as 16, 0.5 or 3500m (millicores)")
    return value


def quantity_bytes(value: str) -> float:
    """A quantity QUANTITY matches, in bytes (16Gi -> 16 x 2**30; 2G -> 2 x 10**9)."""
    m = QUANTITY.fullmatch(value)
    if m is None:
        raise ValueError(f"not a Kubernetes quantity: {value!r}")
    suffix = m.group(2) or ""
    number = float(value[:len(value) - len(suffix)])
    if suffix.endswith("i"):  # Ki Mi Gi Ti Pi Ei
        return number * float(1024 ** ("KMGTPE".index(suffix[0]) + 1))
    return number * float(1000 ** ("kMGTPE".index(suffix) + 1)) if suffix else number  # k M G T P E


class Kubernetes(_Model):
    """What `hvdtrain render k8s` needs beyond the job itself: the image, the run volume, Secrets, /dev/shm.
    `hvdtrain run` does not read this section."""

    image: Annotated[str, AfterValidator(_image)] | None = Field(
        None, description="Image the launcher and worker pods run, as the cluster pulls it (e.g. "
                          "registry.example.com/team/hvdtrain:gpu): docker/Dockerfile built and pushed to your "
                          "registry. Required by `hvdtrain render k8s`.")
    pull_policy: Literal["Always", "IfNotPresent", "Never"] = Field(
        "IfNotPresent", description="The pods' imagePullPolicy: Always, IfNotPresent or Never.")
    namespace: Annotated[str, _matching(K8S_LABEL, "a namespace name: 1-63 lowercase letters, digits and '-'")] \
        | None = Field(None, description="Namespace of the MPIJob (default: kubectl's current one).")
    run_volume: K8sName | None = Field(
        None, description="PersistentVolumeClaim mounted at run_mount on every worker; the job runs there, so the "
                          "recipes' relative --run-dir (checkpoints, summary.json) outlives the pods. Required by "
                          "`hvdtrain render k8s`; create it first (ReadWriteMany when there are several workers).")
    run_mount: Annotated[str, AfterValidator(lambda v: _shell_safe(_absolute(v)))] = Field(
        "/runs", description="Where run_volume is mounted in every worker pod, an absolute path; where the ranks "
                             "start unless workdir is set.")
    secret_env: dict[EnvName, SecretRef] = Field(
        default_factory=dict, description="Environment variables read from Secrets (NAME: {secret: ..., key: ...}), "
                                          "e.g. AWS_SECRET_ACCESS_KEY: never written into the manifest.")
    plain_env: list[EnvName] = Field(
        default_factory=list, description="env names that look like credentials but are not (e.g. "
                                          "HF_HUB_DISABLE_IMPLICIT_TOKEN): written into the manifest as given.")
    termination_grace_s: int = Field(
        120, ge=20, le=86400,
        description="The pods' terminationGracePeriodSeconds: the most a deleted, drained or preempted pod has "
                    "between its SIGTERM and Kubernetes' SIGKILL (a node shutting down, an eviction or the "
                    "autoscaler may give less). The ranks checkpoint at their next step boundary and exit meanwhile "
                    "(the entrypoint waits for them until 10 s before the end); a recipe's --sigterm-grace must fit "
                    "in it. 20-86400 seconds.")
    cpu: Annotated[str | None, BeforeValidator(_cpu_text), AfterValidator(_cpu), WithJsonSchema(
        {"anyOf": [{"type": "string"}, {"type": "number"}, {"type": "null"}], "default": None})] = Field(
        None, description="Each worker's CPU request and limit (cores, such as 16 or 3500m): its ranks and their "
                          "loaders' producers (each rank's --num-workers). Unset: none, so a CPU job's pods are "
                          "scheduled as if they needed no cores.")
    memory: Annotated[str | None, AfterValidator(_memory)] = Field(
        None, description="Each worker's memory request and limit (a quantity such as 64Gi): its ranks, their "
                          "producers and its /dev/shm, which counts against it. Unset: none (a LimitRange of the "
                          "namespace may still set one, which then has to hold /dev/shm too).")
    shm_size: Annotated[str, AfterValidator(_quantity)] = Field(
        "auto", description="Size of each worker's /dev/shm (a memory-backed emptyDir): a quantity such as 16Gi, or "
                            "'auto': what the shipped recipes' loaders need for the ranks of one worker, with NCCL's "
                            "share on GPU jobs.")


def _absolute(value: str) -> str:
    if not value.startswith("/") or ".." in value.split("/"):
        raise ValueError("expected an absolute path without '..', e.g. /runs")
    return value


class JobSpec(_Model):
    """One Horovod job: what to run, where, and how. Every relative path is relative to the spec file."""

    script: str = Field(description="Training script to run on every rank (a path, relative to the spec file).")
    workdir: str | None = Field(
        None, description="Folder every rank starts in (relative to the spec file), so relative paths in args "
                          "resolve there; it must exist on every host (horovodrun changes to the same path on remote "
                          f"hosts); {SHELL_SAFE_ALLOWED}. Default: the folder `hvdtrain run` is started from.")
    args: list[Text] = Field(
        default_factory=list, description="Arguments for the script, a list of strings; unquoted values are taken "
                                          "as written (1:30 stays '1:30', 0x1F stays '0x1F'); each reaches the "
                                          "script as one literal argv element.")
    recipe: dict[str, Any] = Field(
        default_factory=dict, description="A shipped recipe's settings (recipes/pytorch_train.py, pytorch_elastic.py, "
        "keras_train.py), typed: `epochs: 2`, `resume: false`, `lr_milestones: [10, 20]`, `threads: null` — one key "
        "per flag of the recipe (`python recipes/NAME.py --help` lists them, `--batch-size` is batch_size). Checked "
        "with the recipe's own definition before any process starts, as its args are; the script gets them as flags "
        "before args. Not for other scripts: their flags go in args.")
    python: str = Field(
        default_factory=lambda: sys.executable,
        description="Interpreter that runs the script (default: the one running hvdtrain); a name is looked up "
                    "on PATH, a path containing '/' is relative to the spec file.")
    np: PosInt = flag_field(Flag("-np", aliases=("--num-proc",)), "Number of ranks (processes) to start, an "
                                                                   "integer >= 1.", ..., lead=False)
    hosts: HostsValue | None = flag_field(
        Flag("-H", aliases=("--hosts",)), "Hosts and slots: 'a:4,b:4' or a list of 'host:slots' (default: "
                                          "localhost:<np>); not together with hostfile.", lead=False)
    hostfile: str | None = flag_field(
        Flag("--hostfile", aliases=("-hostfile",)), "Hostfile path (relative to the spec file) with 'host "
        "slots=N' or 'host:N' lines, # comments allowed; not together with hosts.", lead=False)
    controller: Literal["gloo", "mpi"] | None = flag_field(
        Flag("--gloo", aliases=("--mpi",)),
        "'gloo' or 'mpi' (default: what Horovod was built with, Gloo preferred).", lead=False)
    gpus_per_rank: NonNegInt = Field(
        0, description="GPUs each rank uses, an integer >= 0 (0: a CPU job). `hvdtrain render` asks the cluster for "
                       "gpus_per_rank x ranks-per-node GPUs on every node; `hvdtrain run` starts the ranks on the "
                       "hosts given, and each rank pins its local GPU itself.")
    env: dict[EnvName, Text] = Field(
        default_factory=dict, description="Environment variables (NAME: value) set for every rank; unquoted values are "
                                          "taken as written, like args.")
    ssh: Ssh = Field(default_factory=Ssh, description="ssh settings: port, identity_file.")
    network_interfaces: list[str] = flag_field(
        Flag("--network-interfaces", aliases=("--network-interface",)), "NIC names to use, e.g. [eth0, ib0].",
        default_factory=list)
    horovod: HorovodKnobs = Field(default_factory=HorovodKnobs, description="Horovod runtime knobs.")
    elastic: Elastic | None = Field(None, description="Elastic training settings (Gloo only).")
    logs: Logs = Field(default_factory=Logs, description="Console echo and per-rank log files.")
    kubernetes: Kubernetes = Field(
        default_factory=Kubernetes, description="`hvdtrain render k8s` only: image, run volume, Secrets, /dev/shm.")
    extra_args: list[str] = Field(
        default_factory=list, description="Arguments passed to horovodrun verbatim, before the command, for "
                                          "what the spec does not model (e.g. ['--mpi-args=--map-by ppr:2:node']).")

    # The shipped recipe the script is (its file name; "" for another script), decided when the spec is loaded from
    # the file on this machine (hvdtrain.job.recipe.decide); None: not decided, the path alone tells.
    _shipped_as: str | None = PrivateAttr(default=None)

    @property
    def script_args(self) -> list[str]:
        """The script's argv after its path: the `recipe:` settings as flags, then `args`."""
        return setting_argv(self.recipe) + list(self.args)

    _resolve = field_validator("script", "hostfile")(resolve_path)
    # horovodrun's Gloo launcher puts the working directory into the remote hosts' shell command unquoted.
    _workdir = field_validator("workdir")(lambda v, info: _shell_safe(resolve_path(v, info)))

    @field_validator("python")
    @classmethod
    def _python(cls, value: str, info: ValidationInfo) -> str:
        if not value.strip():
            raise ValueError("the interpreter is empty")
        if "/" not in value:
            return value
        # Absolute, but symlinks kept: a venv's bin/python is a symlink, and resolving it would leave the venv.
        base = Path((info.context or {}).get("base_dir", "."))
        return os.path.abspath(base / Path(value).expanduser())

    @field_validator("hosts", mode="before")
    @classmethod
    def _hosts(cls, value: Any) -> Any:
        if value is None:
            return None
        if isinstance(value, str) or (isinstance(value, list) and all(isinstance(v, str) for v in value)):
            return hosts_arg(parse_hosts(value, origin="hosts"))
        raise ValueError("expected a string 'a:4,b:4' or a list of 'host:slots' strings")

    @field_validator("network_interfaces")
    @classmethod
    def _nics(cls, value: list[str]) -> list[str]:
        bad = [nic for nic in value if not NIC_NAME.fullmatch(nic)]
        if bad:
            raise ValueError(f"invalid interface name(s) {', '.join(map(repr, bad))}: letters, digits, _ . : @ -")
        return value
