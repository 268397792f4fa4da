"""A flat, typed training config (a dataclass) parsed from argv: one `--flag` per field.

Supported field types: bool (`--x/--no-x`), int, float, str, `T | None` of those, `tuple[int, ...]` /
`tuple[float, ...]` (comma-separated). A field's help text and allowed values come from its metadata:
`field(default=..., metadata={"help": "...", "choices": (...)})`.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

C = TypeVar("C")


def parse_config(cls: type[C], argv: Sequence[str] | None = None, *, description: str | None = None) -> C:
    """Build an argparse parser from dataclass `cls`, parse `argv`, return a `cls` instance.

    Bad input exits with status 2 and a usage message, as argparse does: a value that does not parse, or
    one the dataclass's `__post_init__` rejects with ValueError.
    """
    parser = config_parser(cls, description=description)
    ns = parser.parse_args(argv)
    try:
        return cls(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(cls)})
    except ValueError as e:  # the dataclass's own checks (__post_init__): report like any bad flag
        parser.error(str(e))


def config_parser(cls: type, *, description: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description,
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        flag = "--" + f.name.replace("_", "-")
        kind, optional = _unwrap(hints[f.name], f.name)
        help_text = f.metadata.get("help", " ")
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        if kind is bool:
            parser.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=default,
                                help=help_text)
            continue
        parser.add_argument(flag, dest=f.name, type=_converter(kind, optional, flag), default=default,
                            choices=f.metadata.get("choices"), help=help_text,
                            metavar=f.metadata.get("metavar"))
    return parser


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
