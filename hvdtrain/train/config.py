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
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

C = TypeVar("C", bound="DataclassInstance")


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


def config_parser(cls: type[DataclassInstance], *, description: str | None = None) -> argparse.ArgumentParser:
    """The parser for `cls`'s fields; each option's help ends with its default (`default_text`)."""
    parser = argparse.ArgumentParser(description=description)
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


@dataclass(frozen=True)
class RecipeConfig:
    """The flags every recipe takes (data, optimizer details, checkpoints); each recipe's Config adds its own."""

    dataset: str = field(default="digits", metadata={
        "help": "digits | synthetic | DIR of .npz/.npy shards | MDS dataset root (train/ and val/, streamed): a "
                "directory or s3:// gs:// http(s):// URL"})
    x_field: str = field(default="x", metadata={"help": "MDS datasets: the input column"})
    y_field: str = field(default="y", metadata={"help": "MDS datasets: the label column"})
    shuffle_block: str = field(default="auto", metadata={
        "help": "MDS datasets: shards per shuffle block (samples mix within a block; more: better mixing, more "
                "shards read at once); auto: 262,144 samples' worth (the whole of a smaller dataset), fewer under "
                "--cache-limit (NOTE [automatic blocks] in hvdtrain/stream/order.py)", "metavar": "N|auto"})
    cache_limit: str | None = field(default=None, metadata={
        "help": "streamed datasets: bytes of shards the node's cache keeps, e.g. 20GiB (none: no limit); the "
                "shards needed furthest in the future are evicted first"})
    image_size: int | None = field(default=None, metadata={
        "help": "MDS datasets of image files (jpeg/png columns): output squares of this many pixels, decoded in the "
                "loader's producers (none: the first training image's shorter side)"})
    augment: bool = field(default=True, metadata={
        "help": "MDS datasets of image files: random-resized-crop and flip the training images (off: centre crop, "
                "as validation)"})
    momentum: float = field(default=0.9, metadata={"help": "SGD momentum"})
    lr_milestones: tuple[int, ...] = field(default=(), metadata={"help": "epochs where LR ×= gamma, e.g. 10,20"})
    lr_gamma: float = field(default=0.1, metadata={"help": "LR factor at each of --lr-milestones"})
    fp16_allreduce: bool = field(default=False, metadata={"help": "compress gradients to fp16 for allreduce"})
    threads: int | None = field(default=None, metadata={
        "help": "CPU threads per rank (none: the cores // local ranks)"})
    seed: int = field(default=42, metadata={"help": "seed of the initial weights, the shuffle and synthetic data"})
    val_fraction: float = field(default=0.2, metadata={"help": "held-out share (digits, shard dirs)"})
    synthetic_shape: tuple[int, ...] = field(default=(3, 32, 32), metadata={"help": "sample shape, C,H,W"})
    synthetic_samples: int = field(default=1024, metadata={"help": "training samples (synthetic)"})
    num_classes: int | None = field(default=None, metadata={
        "help": "classes; labels must be below it (none: 10 for digits and synthetic, from the labels of shards)"})
    keep_checkpoints: int = field(default=3, metadata={"help": "newest checkpoints kept"})
    resume: bool = field(default=True, metadata={"help": "resume from the newest intact checkpoint"})
    stop_after_epoch: int | None = field(default=None, metadata={
        "help": "stop cleanly after this epoch (re-run to resume; none: train every epoch)"})
    sigterm_grace: float = field(default=4.0, metadata={
        "help": "seconds a rank sent SIGTERM has to reach a step boundary and checkpoint before it dies by it "
                "(SIGUSR1 has no deadline; the elastic recipe leaves SIGTERM alone: that rank goes; "
                "NOTE [stop requests] in hvdtrain/train/preempt.py)"})
    tensorboard: bool = field(default=True, metadata={"help": "TensorBoard logs on rank 0"})
    check_finite: bool = field(default=True, metadata={
        "help": "stop on NaN/Inf: in the samples (at load), each step (PyTorch: the averaged gradients, Keras: the "
                "weights), the loss (each epoch)"})

    def __post_init__(self) -> None:
        self.shuffle_block_shards  # noqa: B018 (checked now, as cache_limit below)
        for name in ("synthetic_samples", "keep_checkpoints"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        for name in ("threads", "stop_after_epoch"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1 (or none), got {getattr(self, name)}")
        if self.image_size is not None and not 8 <= self.image_size <= 4096:
            raise ValueError(f"--image-size must be 8..4096 pixels (or none), got {self.image_size}")
        if self.num_classes is not None and self.num_classes < 2:
            raise ValueError(f"--num-classes must be >= 2 (or none), got {self.num_classes}")
        if self.cache_limit is not None:
            self.cache_limit_bytes  # noqa: B018 (checked now: a bad value is a usage error before any process starts)
        if not 0 <= self.sigterm_grace < 3600:
            raise ValueError(f"--sigterm-grace must be 0..3600 seconds, got {self.sigterm_grace}")
        if not self.momentum >= 0:
            raise ValueError(f"--momentum must be >= 0, got {self.momentum}")
        if not 0 < self.val_fraction < 1:
            raise ValueError(f"--val-fraction must be in (0, 1), got {self.val_fraction}")

    @property
    def shuffle_block_shards(self) -> int | None:
        """--shuffle-block as shards per block; None for auto."""
        if self.shuffle_block == "auto":
            return None
        try:
            value = int(self.shuffle_block)
        except ValueError:
            value = 0
        if value < 1:
            raise ValueError(f"--shuffle-block must be an integer >= 1 or auto, got {self.shuffle_block!r}")
        return value

    @property
    def cache_limit_bytes(self) -> int | None:
        if self.cache_limit is None:
            return None
        from hvdtrain.stream.convert import parse_bytes

        try:
            value = parse_bytes(self.cache_limit)
        except ValueError as e:
            raise ValueError(f"--cache-limit: {e}") from None
        if value < 1:
            raise ValueError(f"--cache-limit must be at least 1 byte (or none), got {self.cache_limit!r}")
        return value

    def load_data(self) -> Any:
        """The dataset's train/val splits (hvdtrain.train.datasets.load, checked)."""
        from hvdtrain.train import datasets

        return datasets.load(self.dataset, val_fraction=self.val_fraction, split_seed=0,
                             synthetic_shape=self.synthetic_shape, synthetic_samples=self.synthetic_samples,
                             num_classes=self.num_classes, seed=self.seed, check_finite=self.check_finite,
                             x_field=self.x_field, y_field=self.y_field, shuffle_block=self.shuffle_block_shards,
                             cache_limit=self.cache_limit_bytes, image_size=self.image_size, augment=self.augment)
