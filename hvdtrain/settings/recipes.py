"""The shipped recipes' settings, defined once: a frozen dataclass per recipe (`SHIPPED`, by script name), from which
the recipe's argparse is made (`hvdtrain.settings.parse.parse_config`) and with which `hvdtrain validate`, `run` and
`render` check a job's `recipe:` and `args:` before any process starts (hvdtrain/job/recipe.py). Nothing here
imports torch, TensorFlow or Horovod: the launcher reads these on a machine without them. What only a rank's own
machine can tell (a GPU for --channels-last) is checked by the recipe (`hvdtrain.train.torchkit.check_device`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

from hvdtrain.settings.parse import parse_bytes

MODEL_CHOICES = ("auto", "cnn", "mlp", "resnet")  # auto, and recipes/pytorch_models.py's MODELS (a test checks)
PRECISIONS = ("fp32", "bf16", "fp16")


def check_schedule(warmup_epochs: float, milestones: tuple[int, ...], gamma: float) -> None:
    """The LR schedule's own rules for its warmup, milestones and gamma (hvdtrain.train.lr.LRSchedule): ValueError
    naming the value."""
    if not (warmup_epochs >= 0 and math.isfinite(warmup_epochs)):
        raise ValueError(f"warmup_epochs must be a finite number >= 0, got {warmup_epochs!r}")
    if not (all(isinstance(m, int) and m >= 1 for m in milestones) and list(milestones) == sorted(set(milestones))):
        raise ValueError(f"milestones must be strictly increasing ints >= 1 (epochs), got {milestones!r}")
    if not 0 < gamma <= 1:
        raise ValueError(f"gamma must be a number in (0, 1], got {gamma!r}")


def _at_least_one(cfg: object, *names: str) -> None:
    for name in names:
        if getattr(cfg, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(cfg, name)}")


def _lr_flags(cfg: TorchConfig | KerasTrainConfig) -> None:
    if not (cfg.base_lr > 0 and math.isfinite(cfg.base_lr)):
        raise ValueError(f"--base-lr must be a finite number > 0, got {cfg.base_lr}")
    try:
        check_schedule(cfg.warmup_epochs, cfg.lr_milestones, cfg.lr_gamma)
    except ValueError as e:  # "milestones must be ...": say which flag
        flag = {"warmup_epochs": "--warmup-epochs", "milestones": "--lr-milestones", "gamma": "--lr-gamma"}
        raise ValueError(f"{flag[str(e).split()[0]]}: {e}") from None


@dataclass(frozen=True)
class RecipeConfig:
    """The flags every recipe takes (data, optimizer details, checkpoints); each recipe's Config adds its own.

    `accumulates`: a loader batch holds --backward-passes-per-step chunks; `stops_on_sigterm`: SIGTERM asks for a
    checkpointed stop within --sigterm-grace (False: it ends the rank at once; the elastic recipe drops it)."""

    script: ClassVar[str] = ""
    accumulates: ClassVar[bool] = False
    stops_on_sigterm: ClassVar[bool] = True
    if TYPE_CHECKING:  # every recipe has these; each declares them where its --help lists them
        run_dir: str
        batch_size: int
        num_workers: int

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
        if not self.synthetic_shape or min(self.synthetic_shape) < 1:
            raise ValueError(f"--synthetic-shape must be positive integers C,H,W (e.g. 3,224,224), got "
                             f"{','.join(map(str, self.synthetic_shape)) or 'none'}")
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
        try:
            value = parse_bytes(self.cache_limit)
        except ValueError as e:
            raise ValueError(f"--cache-limit: {e}") from None
        if value < 1:
            raise ValueError(f"--cache-limit must be at least 1 byte (or none), got {self.cache_limit!r}")
        return value


@dataclass(frozen=True)
class TorchConfig(RecipeConfig):
    """The flags both PyTorch recipes take (each recipe's Config adds its own and its --run-dir default)."""

    accumulates: ClassVar[bool] = True
    model: str = field(default="auto", metadata={"choices": MODEL_CHOICES,
                                                 "help": "auto: cnn for digits, resnet for synthetic"})
    model_width: int | None = field(default=None, metadata={"help": "channels/hidden units (none: the model's own)"})
    epochs: int = field(default=15, metadata={"help": "total epochs"})
    batch_size: int = field(default=32, metadata={"help": "samples per rank per backward pass"})
    base_lr: float = field(default=0.05, metadata={"help": "single-process LR; × size × backward passes"})
    weight_decay: float = field(default=0.0, metadata={"help": "SGD weight decay (L2)"})
    warmup_epochs: float = field(default=2.0, metadata={"help": "linear LR warmup (Goyal et al.)"})
    backward_passes_per_step: int = field(default=1, metadata={
        "help": "accumulate this many batches locally before each allreduce"})
    num_workers: int = field(default=1, metadata={"help": "data producer processes per rank"})
    progress: bool = field(default=True, metadata={"help": "tqdm progress bar on rank 0"})
    stall_plot: bool = field(default=False, metadata={
        "help": "rank 0 plots its wait-for-data and step time per step to <run-dir>/stall.png"})
    precision: str = field(default="fp32", metadata={
        "choices": PRECISIONS, "help": "forward pass and loss under autocast in bf16 or fp16 (fp16: with a "
                                       "GradScaler, checkpointed); weights and gradients stay fp32"})
    channels_last: bool = field(default=False, metadata={
        "help": "channels-last (NHWC) weights and images: faster convolutions on tensor cores"})
    compile: bool = field(default=False, metadata={
        "help": "train through torch.compile(model) (the first steps compile; needs a C++ compiler on CPU)"})

    def __post_init__(self) -> None:
        super().__post_init__()
        _at_least_one(self, "epochs", "batch_size", "backward_passes_per_step", "num_workers")
        if self.model_width is not None and self.model_width < 1:
            raise ValueError(f"--model-width must be >= 1 (or none), got {self.model_width}")
        if not self.weight_decay >= 0:
            raise ValueError(f"--weight-decay must be >= 0, got {self.weight_decay}")
        _lr_flags(self)


@dataclass(frozen=True)
class PytorchTrainConfig(TorchConfig):
    """recipes/pytorch_train.py's settings."""

    script: ClassVar[str] = "pytorch_train.py"
    scale_epochs_by_size: bool = field(default=False, metadata={
        "help": "run ceil(epochs / world size) epochs, as Horovod's Keras example does"})
    run_dir: str = field(default="runs/pytorch", metadata={"help": "checkpoints, TensorBoard, summary.json"})


@dataclass(frozen=True)
class PytorchElasticConfig(TorchConfig):
    """recipes/pytorch_elastic.py's settings."""

    script: ClassVar[str] = "pytorch_elastic.py"
    stops_on_sigterm: ClassVar[bool] = False  # SIGTERM ends the rank at once: the elastic job drops it
    run_dir: str = field(default="runs/elastic", metadata={"help": "checkpoints, TensorBoard, summary.json"})
    commit_every: int = field(default=10, metadata={
        "help": "commit the state every N optimizer steps (and at each epoch end): steps lost on a failure "
                "vs the cost of a commit (a state copy and a broadcast)"})

    def __post_init__(self) -> None:
        super().__post_init__()
        _at_least_one(self, "commit_every")
        if self.precision == "fp16":
            raise ValueError("--precision fp16 is not supported by the elastic recipe (the loss scale is not part "
                             "of its elastic state yet); use --precision bf16, or recipes/pytorch_train.py")


@dataclass(frozen=True)
class KerasTrainConfig(RecipeConfig):
    """recipes/keras_train.py's settings."""

    script: ClassVar[str] = "keras_train.py"
    width: int = field(default=32, metadata={"help": "channels of the first conv layer / hidden units"})
    epochs: int = field(default=10, metadata={"help": "total epochs"})
    scale_epochs_by_size: bool = field(default=False, metadata={
        "help": "run ceil(epochs / world size) epochs, as Horovod's Keras examples do"})
    batch_size: int = field(default=32, metadata={"help": "samples per rank per step"})
    num_workers: int = field(default=1, metadata={"help": "data producer processes per rank"})
    base_lr: float = field(default=0.05, metadata={"help": "single-process LR; × world size"})
    warmup_epochs: int = field(default=2, metadata={"help": "epochs of linear LR warmup (0: none)"})
    run_dir: str = field(default="runs/keras", metadata={"help": "checkpoints, TensorBoard, summary.json"})
    verbose: int = field(default=2, metadata={"choices": (0, 1, 2), "help": "Keras fit verbosity on rank 0"})
    precision: str = field(default="fp32", metadata={
        "choices": PRECISIONS, "help": "mixed precision: layers compute in bf16 or fp16 (fp16: with "
        "dynamic loss scaling, checkpointed; slow on CPU), the last layer, the loss and the weights in fp32"})

    def __post_init__(self) -> None:
        super().__post_init__()
        _at_least_one(self, "width", "epochs", "batch_size", "num_workers")
        if self.warmup_epochs < 0:
            raise ValueError(f"--warmup-epochs must be >= 0, got {self.warmup_epochs}")
        _lr_flags(self)


SHIPPED: dict[str, type[RecipeConfig]] = {c.script: c for c in (PytorchTrainConfig, PytorchElasticConfig,
                                                                  KerasTrainConfig)}
