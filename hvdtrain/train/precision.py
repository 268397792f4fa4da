"""Mixed precision and the model's layout for the PyTorch recipes: `--precision fp32|bf16|fp16`,
`--channels-last`, `--compile`.

bf16 and fp16 run the forward pass and the loss under `torch.autocast` (weights, gradients and the optimizer stay
fp32: Horovod averages fp32 gradients). bf16 has fp32's range and needs nothing else. fp16 gradients can overflow
or vanish, so a GradScaler multiplies the loss before backward() and divides the gradients back before the step.

NOTE [fp16 with Horovod]
DistributedOptimizer starts each gradient's allreduce from backward(), and step() waits for them; a GradScaler's
step() would read the gradients before the average is in. The order, as Horovod's docs give it, is:
    scaler.scale(loss).backward()          # allreduce of the *scaled* gradients starts
    optimizer.synchronize()                # wait for the averages
    scaler.unscale_(optimizer)             # averages back to their true scale; records whether any is inf/NaN
    with optimizer.skip_synchronize():     # step() must not wait a second time
        scaler.step(optimizer)             # skipped when the averaged gradients overflowed
    scaler.update()                        # lower the scale after an overflow, raise it after a quiet stretch
The scaler decides from the *averaged* gradients, identical on every rank, so every rank skips the same steps and
keeps the same scale (the weights stay identical). The scale is part of the checkpoint and is broadcast from rank 0
on resume. A non-finite average is therefore normal in fp16 (an overflow: the step is skipped); the recipes'
divergence check (NOTE [divergence checks] in divergence.py) fires only when the scale has fallen below
MIN_SCALE, i.e. the gradients stay non-finite however small the scale.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, cast

import torch
from torch import nn

from hvdtrain.settings.recipes import PRECISIONS

MIN_SCALE = 2.0 ** -8  # from the default 2**16, 24 overflows in a row without a step in between
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class Precision:
    """The step's numeric format on `device`: an autocast context and, for fp16, a GradScaler (the NOTE above)."""

    def __init__(self, name: str, device: torch.device | str) -> None:
        if name not in PRECISIONS:
            raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}; got {name!r}")
        self.name = name
        self.device_type = torch.device(device).type
        self.scaler = torch.amp.GradScaler(self.device_type) if name == "fp16" else None

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """The forward pass and the loss run under this (a no-op for fp32)."""
        if self.name == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=_DTYPES[self.name])

    def backward(self, loss: torch.Tensor) -> None:
        (loss if self.scaler is None else self.scaler.scale(loss)).backward()

    def nonfinite(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> torch.Tensor:
        """After the gradients are averaged, before the step: a 0-d bool tensor, true if training has diverged,
        computed where the gradients are without waiting for them (fp32/bf16; read it a step late: NOTE [flags read a
        step late] in stepflags.py). fp32/bf16: an averaged gradient is NaN/Inf. fp16: the gradients are unscaled
        first, and a non-finite one is an overflow the scaler skips, unless the scale has already fallen below
        MIN_SCALE (the scaler reads its scale on the host: fp16's step waits for the GPU anyway)."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)
            return torch.tensor(bool(nonfinite_gradients(model)) and self.scaler.get_scale() <= MIN_SCALE)
        return nonfinite_gradients(model)

    def diverged(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> bool:
        """`nonfinite`, read at once (the host waits for the GPU)."""
        return bool(self.nonfinite(model, optimizer))

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """Apply the averaged gradients (fp16: unless they overflowed, then adjust the scale)."""
        if self.scaler is None:
            optimizer.step()
            return
        self.scaler.step(optimizer)
        self.scaler.update()

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps: the fp16 scaler's state (empty otherwise)."""
        return {} if self.scaler is None else self.scaler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the fp16 scaler's state; ignored for fp32/bf16 or a checkpoint without one."""
        if self.scaler is not None and state:
            self.scaler.load_state_dict(state)


def nonfinite_gradients(model: nn.Module) -> torch.Tensor:
    """A 0-d bool tensor on the gradients' device: true if any gradient holds NaN/Inf (nothing waits for it).
    One multi-tensor kernel per device, the check GradScaler makes (its unscale by 1.0 leaves every value as it
    was); sparse gradients go through a norm (several times slower on a CPU)."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if not grads:
        return torch.tensor(False)
    if any(g.is_sparse for g in grads):
        return ~torch.isfinite(torch.nn.utils.get_total_norm(grads, norm_type=math.inf))
    flags = []
    for device in dict.fromkeys(g.device for g in grads):
        found, one = torch.zeros(1, device=device), torch.ones(1, device=device)
        torch._amp_foreach_non_finite_check_and_unscale_([g for g in grads if g.device == device], found, one)
        flags.append(found.to(grads[0].device))
    return (flags[0] if len(flags) == 1 else torch.stack(flags).amax()).reshape(()) > 0


def prepare_model(model: nn.Module, channels_last: bool, compile_model: bool) -> nn.Module:
    """Lay `model`'s weights out channels-last (in place) if asked; returns the module to call in training:
    `torch.compile(model)` with `compile_model`, else `model` itself. Checkpoints, digests and validation keep
    using `model` (the compiled wrapper shares its parameters, and its state-dict keys would carry a prefix)."""
    if channels_last:
        # torch's stubs list Module.to's documented memory_format keyword in none of its overloads
        model.to(memory_format=torch.channels_last)  # type: ignore[call-overload]  # torch's stub omits memory_format
    # torch.compile of a Module returns an OptimizedModule (a Module); its stub's return type is a plain callable
    return cast(nn.Module, torch.compile(model)) if compile_model else model


def as_input(x: torch.Tensor, channels_last: bool) -> torch.Tensor:
    """A batch in the layout the model was prepared for (channels-last for 4-D input if asked). A uint8 N×H×W×C
    batch (decoded images: hvdtrain.stream.images) is scaled to [0, 1] float32 here, on the batch's device: its
    N×C×H×W view is already channels-last, so with --channels-last no copy is made beyond the conversion."""
    if x.dtype == torch.uint8 and x.dim() == 4:
        x = x.permute(0, 3, 1, 2)
        x = (x if channels_last else x.contiguous()).float().mul_(1 / 255)
        return x.contiguous(memory_format=torch.channels_last) if channels_last else x
    return x.contiguous(memory_format=torch.channels_last) if channels_last and x.dim() == 4 else x
