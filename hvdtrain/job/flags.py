"""Which spec key sets which horovodrun flag, declared once.

A key that maps to a horovodrun flag is declared in `model.py` with `flag_field(Flag(...), description)`: the
`Flag` lives in the field's metadata, leads its description (schema, error messages) and is listed in the JSON
schema as `x-horovodrun-flags`. `plan.py` emits the flags from it and `load.py` refuses `extra_args` that would set
one of them behind the spec's back, in any spelling horovodrun's argparse accepts (`--flag=value`, an alias, an
abbreviation such as `--gloo-timeout`, `-Hhost:2`). Nothing here does I/O.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, Field
from pydantic.fields import FieldInfo

SCHEMA_KEY = "x-horovodrun-flags"
# Every option string of horovodrun 0.28.1's parser (tests/job/test_flags.py compares it with the installed one).
HOROVODRUN_OPTIONS = frozenset((
    "--autotune", "--autotune-bayes-opt-max-samples", "--autotune-gaussian-process-noise", "--autotune-log-file",
    "--autotune-steps-per-sample", "--autotune-warmup-samples", "--binding-args", "--blacklist-cooldown-range",
    "--cache-capacity", "--check-build", "--config-file", "--cycle-time-ms", "--disable-cache", "--elastic-timeout",
    "--fusion-threshold-mb", "--gloo", "--gloo-timeout-seconds", "--help", "--hierarchical-allgather",
    "--hierarchical-allreduce", "--host-discovery-script", "--hostfile", "--hosts", "--jsrun",
    "--log-hide-timestamp", "--log-level", "--log-with-timestamp", "--log-without-timestamp", "--max-np",
    "--max-num-proc", "--min-np", "--min-num-proc", "--mpi", "--mpi-args", "--mpi-threads-disable",
    "--network-interface", "--network-interfaces", "--no-autotune", "--no-hierarchical-allgather",
    "--no-hierarchical-allreduce", "--no-log-hide-timestamp", "--no-mpi-threads-disable", "--no-stall-check",
    "--no-timeline-mark-cycles", "--no-torus-allreduce", "--num-nccl-streams", "--num-proc", "--output-filename",
    "--prefix-output-with-timestamp", "--reset-limit", "--slots-per-host", "--ssh-identity-file", "--ssh-port",
    "--stall-check", "--stall-check-shutdown-time-seconds", "--stall-check-warning-time-seconds", "--start-timeout",
    "--tcp", "--thread-affinity", "--timeline-filename", "--timeline-mark-cycles", "--torus-allreduce",
    "--verbose", "--version", "-H", "-cb", "-h", "-hostfile", "-i", "-np", "-p", "-prefix-timestamp", "-v",
))
# horovodrun options no spec key emits that extra_args must not pass either: option -> (why, how to fix).
_EXITS = ("horovodrun would print and exit instead of running the job", "run hvdtrain doctor to see the build")
_TIMESTAMP = ("hvdtrain prefixes the lines itself", "set logs.timestamp: true")
NOT_IN_EXTRA_ARGS = {
    "--output-filename": ("hvdtrain writes every rank's output itself", "set logs.dir"),
    "--config-file": ("the job spec is the configuration", "set the spec's keys"),
    "--jsrun": ("hvdtrain starts Gloo or MPI jobs", "set controller: gloo or mpi"),
    "--prefix-output-with-timestamp": _TIMESTAMP, "-prefix-timestamp": _TIMESTAMP,
    "--check-build": _EXITS, "-cb": _EXITS, "--version": _EXITS, "-v": _EXITS,
    "--help": (_EXITS[0], "run horovodrun --help"), "-h": (_EXITS[0], "run horovodrun --help"),
}


@dataclass(frozen=True)
class Flag:
    """The horovodrun option a spec key sets: `name` is what the plan emits (with the value, or alone when the key
    is true), `off` what it emits when a tri-state switch is false, `aliases` other spellings of the same option."""

    name: str
    off: str | None = None
    aliases: tuple[str, ...] = ()

    @property
    def spellings(self) -> tuple[str, ...]:
        return (self.name, *self.aliases, *((self.off,) if self.off else ()))

    @property
    def label(self) -> str:
        if self.off:
            return f"{self.name} (true) / {self.off} (false)"
        return self.name

    def args(self, value: Any) -> list[str]:
        """The argv elements for `value` (None: nothing, Horovod's default)."""
        if value is None or (value is False and self.off is None):
            return []
        if isinstance(value, bool):
            return [self.name if value else str(self.off)]
        if isinstance(value, list | tuple):
            return [self.name, *map(_fmt, value)]
        return [self.name, _fmt(value)]


def _fmt(value: object) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def flag_field(flag: Flag, description: str, default: Any = None, *, lead: bool = True, **kwargs: Any) -> Any:
    """A pydantic Field for a key that sets `flag`, kept in the field's metadata. The flag leads the description
    (`lead`) where the key is that flag by another name; keys hvdtrain translates (np, hosts) list it only in the
    schema."""
    if "default_factory" not in kwargs:
        kwargs["default"] = default
    field: FieldInfo = Field(description=f"{flag.label}: {description}" if lead else description,
                             json_schema_extra={SCHEMA_KEY: list(flag.spellings)}, **kwargs)
    field.metadata.append(flag)
    return field


def flag_of(field: FieldInfo) -> Flag | None:
    return next((m for m in field.metadata if isinstance(m, Flag)), None)


def model_flags(model: type[BaseModel]) -> dict[str, Flag]:
    """Each key of `model` (one level) that sets a flag, in declaration order."""
    return {name: flag for name, field in model.model_fields.items() if (flag := flag_of(field)) is not None}


def all_flags(model: type[BaseModel], prefix: str = "") -> Iterator[tuple[str, Flag]]:
    """(dotted key, Flag) for every key of `model` and its nested models."""
    for name, field in model.model_fields.items():
        flag = flag_of(field)
        if flag is not None:
            yield prefix + name, flag
        nested = _nested_model(field.annotation)
        if nested is not None:
            yield from all_flags(nested, f"{prefix}{name}.")


def _nested_model(annotation: Any) -> type[BaseModel] | None:
    for candidate in (annotation, *getattr(annotation, "__args__", ())):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def option_of(arg: str, options: frozenset[str] = HOROVODRUN_OPTIONS) -> str | None:
    """The option horovodrun's argparse reads `arg` as, or None (a value, or what argparse would refuse itself).

    Follows argparse: an exact option, `--opt=value`, then a unique abbreviation (`--gloo-timeout`) or a one-letter
    option with its value attached (`-Hhost:2`, even `-H a:2`)."""
    if len(arg) < 2 or arg[0] != "-":
        return None
    name = arg.split("=", 1)[0]
    if arg in options or name in options:
        return arg if arg in options else name
    if arg[1] == "-":
        matches = {o for o in options if o.startswith(name)}
    else:
        matches = {o for o in options if o == arg[:2] or o.startswith(arg)}
    if len(matches) == 1:
        return matches.pop()
    return None


def modeled_flags(model: type[BaseModel]) -> dict[str, str]:
    """Each horovodrun option the keys of `model` set, in every spelling -> the dotted key."""
    return {spelling: key for key, flag in all_flags(model) for spelling in flag.spellings}


def extra_args_problems(extra_args: list[str], modeled: dict[str, str]) -> list[tuple[int, str, str]]:
    """(index, problem, fix) for each extra argument that sets what a spec key sets (`modeled`: modeled_flags), in
    any spelling horovodrun accepts, or an option hvdtrain does itself (NOT_IN_EXTRA_ARGS)."""
    found = []
    for i, arg in enumerate(extra_args):
        option = option_of(arg)
        if option in modeled:
            said = option if arg.split("=", 1)[0] == option else f"{option} (as horovodrun reads it)"
            found.append((i, f"{said} is what the spec key {modeled[option]} sets",
                          f"remove it from extra_args and set {modeled[option]} instead"))
        elif option in NOT_IN_EXTRA_ARGS:
            why, fix = NOT_IN_EXTRA_ARGS[option]
            found.append((i, f"{option} is not for extra_args: {why}", f"remove it from extra_args; {fix}"))
    return found
