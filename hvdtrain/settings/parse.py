"""A flat, typed settings dataclass <-> argv: one `--flag` per field. The recipes parse their command line with
it (`parse_config`: bad input exits 2, as argparse does); `hvdtrain validate`/`run`/`render` check a job's recipe
arguments with the same parser before any process starts (`check_args`: an `ArgsError` naming the flag), and turn a
spec's typed `recipe:` mapping into argv (`setting_argv`) — one definition, one parser, both sides.

Supported field types: bool (`--x/--no-x`), int, float, str, `T | None` of those, `tuple[int, ...]` /
`tuple[float, ...]` (comma-separated). A field's help text and allowed values come from its metadata:
`field(default=..., metadata={"help": "...", "choices": (...)})`.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import re
import types
import typing
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

C = TypeVar("C", bound="DataclassInstance")


def parse_config(cls: type[C], argv: Sequence[str] | None = None, *, description: str | None = None,
                 check: Callable[[C], None] | None = None) -> C:
    """Build an argparse parser from dataclass `cls`, parse `argv`, return a `cls` instance.

    Bad input exits with status 2 and a usage message, as argparse does: a value that does not parse, or one the
    dataclass's `__post_init__` (or `check`: what only this machine can tell, e.g. whether it has a GPU) rejects with
    ValueError.
    """
    parser = config_parser(cls, description=description)
    ns = parser.parse_args(argv)
    try:
        cfg = cls(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(cls)})
        if check is not None:
            check(cfg)
    except ValueError as e:  # the dataclass's own checks (__post_init__): report like any bad flag
        parser.error(str(e))
    return cfg


class ArgsError(ValueError):
    """Arguments `check_args` refuses: `str()` is the parser's own message; `flag` the option it is about (None when
    the message names none); `token` the argv element at fault where one is (an unknown flag); `guess` a flag that
    `token` may have meant."""

    def __init__(self, message: str, flag: str | None = None, token: str | None = None,
                 guess: str | None = None) -> None:
        super().__init__(message)
        self.flag, self.token, self.guess = flag, token, guess


class _Refusing(argparse.ArgumentParser):
    """A parser that raises instead of printing usage and exiting (ambiguous abbreviations, missing values)."""

    def error(self, message: str) -> typing.NoReturn:
        raise ArgsError(message)


def check_args(cls: type[C], argv: Sequence[str]) -> C:
    """`argv` parsed by the very parser `parse_config` uses (abbreviations included), raising `ArgsError` where the
    script would exit 2: an unknown flag (with the closest known one), a value that does not parse, one the
    dataclass rejects. Prints nothing, exits never."""
    parser = config_parser(cls, parser_class=_Refusing)
    try:
        ns, extra = parser.parse_known_args(list(argv))
    except argparse.ArgumentError as exc:
        raise ArgsError(str(exc), flag=exc.argument_name) from None
    if extra:
        token = next((t for t in extra if t.startswith("-")), extra[0])
        flags = [o for a in parser._actions for o in a.option_strings]
        guess = difflib.get_close_matches(token.split("=", 1)[0], flags, n=1, cutoff=0.6)
        raise ArgsError(f"unrecognized argument{'s' * (len(extra) > 1)}: {' '.join(extra)}", token=token,
                        guess=guess[0] if guess else None)
    try:
        return cls(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(cls)})
    except ValueError as exc:
        named = re.search(r"--[a-z][a-z0-9-]*", str(exc))
        raise ArgsError(str(exc), flag=named.group(0) if named else None) from None


def given_settings(cls: type[DataclassInstance], argv: Sequence[str]) -> dict[str, tuple[str, ...]]:
    """The fields `argv` sets (each with its option strings); the argv must parse (`check_args` first)."""
    parser = config_parser(cls, parser_class=_Refusing)
    for action in parser._actions:  # not set_defaults: argparse would put SUPPRESS's text through the types
        action.default = argparse.SUPPRESS
    ns, _ = parser.parse_known_args(list(argv))
    options = {a.dest: tuple(a.option_strings) for a in parser._actions}
    return {name: options[name] for name in vars(ns)}


def token_for(argv: Sequence[str], options: Sequence[str], every: Collection[str]) -> int | None:
    """The index of the last `argv` element that gives one of `options`, exactly or abbreviated as argparse takes
    it (`--batch 64`, `--batch-size=64`: a prefix of one option alone among `every` option of the parser), or
    None."""
    found = None
    for i, token in enumerate(argv):
        name = token.split("=", 1)[0]
        if not name.startswith("--") or len(name) < 3:
            continue
        matches = {name} if name in every else {o for o in every if o.startswith(name)}
        if len(matches) == 1 and matches <= set(options):
            found = i
    return found


def option_strings(cls: type[DataclassInstance]) -> dict[str, tuple[str, ...]]:
    """Each field's option strings (`--resume`, `--no-resume`)."""
    return {a.dest: tuple(a.option_strings) for a in config_parser(cls)._actions if a.dest != "help"}


def setting_argv(settings: Mapping[str, Any]) -> list[str]:
    """A typed mapping of settings (`recipe:` in a job spec) as the argv the recipe's parser reads: `epochs: 2` ->
    `--epochs 2`, `resume: false` -> `--no-resume`, `lr_milestones: [10, 20]` -> `--lr-milestones 10,20`, `threads:
    null` -> `--threads none`. The values' types are checked by `setting_problem`."""
    argv: list[str] = []
    for name, value in settings.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + flag[2:])
            continue
        text = "none" if value is None else ",".join(map(str, value)) if isinstance(value, list | tuple) else str(value)
        argv += [f"{flag}={text}"] if text.startswith("-") else [flag, text]  # argparse takes "-1" alone as a flag
    return argv


def setting_problem(cls: type[DataclassInstance], name: str, value: Any) -> str | None:
    """Why `value` (from YAML) cannot be field `name` of `cls`, or None. Types only: ranges and choices are the
    parser's and the dataclass's to check."""
    field_type = typing.get_type_hints(cls).get(name)
    if field_type is None:
        return "unknown"
    kind, optional = _unwrap(field_type, name)
    if value is None:
        return None if optional else "is null; a value is required here"
    if typing.get_origin(kind) is tuple:
        item = typing.get_args(kind)[0]
        ok = isinstance(value, list) and all(_is(v, item) for v in value)
        return None if ok else f"expected a list of {item.__name__}s, e.g. [10, 20]"
    return None if _is(value, kind) else f"expected {_TYPE_WORDS.get(kind, kind.__name__)}"


def _is_float(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


_TYPE_WORDS = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


def _is(value: Any, kind: Any) -> bool:
    if kind is bool or isinstance(value, bool):
        return kind is bool and isinstance(value, bool)
    if kind is float:  # YAML 1.1 reads 1e-5 (no dot) as text: taken as the number it is
        return isinstance(value, int | float) or (isinstance(value, str) and _is_float(value))
    if kind is str:  # a number is taken as written: shuffle_block: 2, run_dir: 2024
        return isinstance(value, str | int | float)
    return isinstance(value, kind)


def config_parser(cls: type[DataclassInstance], *, description: str | None = None,
                  parser_class: type[argparse.ArgumentParser] = argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The parser for `cls`'s fields; each option's help ends with its default (`default_text`). The refusing
    parser of `check_args` has no --help (it would print and exit): there, `-h` is an unknown flag."""
    refusing = parser_class is not argparse.ArgumentParser
    parser = parser_class(description=description, add_help=not refusing, exit_on_error=not refusing)
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        flag = "--" + f.name.replace("_", "-")
        kind, optional = _unwrap(hints[f.name], f.name)
        default = _default(f)
        help_text = with_default(f.metadata.get("help", ""), default)
        if kind is bool:
            parser.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=default,
                                help=help_text)
            continue
        parser.add_argument(flag, dest=f.name, type=_converter(kind, optional, flag), default=default,
                            choices=f.metadata.get("choices"), help=help_text,
                            metavar=f.metadata.get("metavar"))
    return parser


def _default(f: dataclasses.Field[Any]) -> Any:
    """A field's default: its `default`, or what its `default_factory` makes."""
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    raise TypeError(f"config field {f.name!r} has no default (every option needs one)")


def default_text(default: Any) -> str:
    """A default as it is typed on the command line: on/off for a --x/--no-x flag, 3,32,32 for a tuple, none for
    None or an empty tuple (the help text says what none means)."""
    if default is None:
        return "none"
    if isinstance(default, bool):
        return "on" if default else "off"
    if isinstance(default, tuple):
        return ",".join(str(v) for v in default) or "none"
    return str(default)


def with_default(help_text: str, default: Any) -> str:
    """`help_text` ending with "(default: ...)", unless it places the default itself (%(default)s); escaped for
    argparse's %-formatting."""
    if "%(default)" in help_text:
        return help_text
    return f"{help_text} (default: {default_text(default).replace('%', '%%')})".strip()


def _unwrap(tp: Any, name: str) -> tuple[Any, bool]:
    """(inner type, optional?) for `T` or `T | None`."""
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        if len(rest) != 1:
            raise TypeError(f"config field {name}: unsupported type {tp!r}")
        return rest[0], True
    return tp, False


def _converter(kind: Any, optional: bool, flag: str) -> Callable[[str], Any]:
    if typing.get_origin(kind) is tuple:
        item = typing.get_args(kind)[0]

        def convert(text: str) -> Any:
            parts = [p.strip() for p in text.split(",") if p.strip()]
            try:
                return tuple(item(p) for p in parts)
            except ValueError:
                raise argparse.ArgumentTypeError(
                    f"{flag}: expected comma-separated {item.__name__}s, got {text!r}") from None
    elif kind in (int, float, str):
        def convert(text: str) -> Any:
            try:
                return kind(text)
            except ValueError:
                raise argparse.ArgumentTypeError(f"{flag}: expected {kind.__name__}, got {text!r}") from None
    else:
        raise TypeError(f"{flag}: unsupported config type {kind!r}")
    if not optional:
        return convert
    return lambda text: None if text.lower() in ("none", "") else convert(text)


BYTE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "kib": 1 << 10, "mib": 1 << 20,
              "gib": 1 << 30, "tib": 1 << 40}


def parse_bytes(text: str) -> int:
    """Bytes from '1000000', '64MiB', '1GB', '512 KiB', '2TiB' (KB/MB/GB/TB are powers of 1000, KiB/... of 1024)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    unit = m and m.group(2).lower()
    if not m or unit not in BYTE_UNITS:
        raise ValueError(f"{text!r} is not a size: give bytes (1000000) or a number with a unit "
                         "B, KB, MB, GB, TB, KiB, MiB, GiB, TiB (e.g. 64MiB)")
    return int(float(m.group(1)) * BYTE_UNITS[unit])
