"""`hvdtrain-horovodrun ARGS...` (or `python -m hvdtrain.launch.hvdrun ARGS...`): horovodrun without its build probe.

Everything else is horovodrun's own code, run as horovodrun runs it: its argument parser (the same ARGS), host
checks over ssh, network-interface discovery, Gloo rendezvous server, MPI command, elastic driver, per-rank
middlemen and their teardown on SIGINT/SIGTERM. `hvdtrain run` starts jobs this way.

Why: before it starts anything, horovodrun asks whether Horovod was built with Gloo or MPI by importing each
framework's Horovod extension in a forked process, TensorFlow's first (`horovod.common.util.gloo_built`,
`mpi_built`). With TensorFlow installed that is an `import tensorflow` in every PyTorch job: ~8 s of the 11-14 s
a trivial 2-rank job took on 2 cores, and TensorFlow's start-up lines (absl, oneDNN, cudart) on the job's console. The
answer here comes from hvdtrain's probe of this interpreter instead (hvdtrain.doctor.probe.horovod_build: the
first framework whose Horovod extension loads, PyTorch's first; cached until that extension changes on disk), so
a job pays for that probe once per Horovod build. When the probe has no answer (Horovod broken, no framework
loads), horovodrun's own checks run and say what is wrong, as they would under horovodrun.

Only `sys` is imported at module level: horovodrun's per-rank middlemen are `spawn`ed processes, and each one
imports the main module (as `__mp_main__`) before it does anything.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

CHECKS = ("gloo", "mpi")  # horovodrun asks `<name>_built(verbose=...)` for these, through horovod.runner.launch


def _answer(value: bool) -> Callable[..., bool]:
    def built(verbose: bool = False) -> bool:
        return value
    return built


def install_build_answers(launch: object, controllers: dict[str, bool]) -> bool:
    """Make horovod.runner.launch's `gloo_built`/`mpi_built` answer from `controllers` (a probe's built flags);
    False (nothing changed: horovodrun's own checks run) when the probe has no answer for them."""
    if not all(name in controllers for name in CHECKS):
        return False
    for name in CHECKS:
        if not callable(getattr(launch, f"{name}_built", None)):
            raise RuntimeError(f"horovod.runner.launch has no {name}_built(): this Horovod is not the 0.28 line "
                               "hvdtrain.launch.hvdrun was written for; use horovodrun")
        setattr(launch, f"{name}_built", _answer(bool(controllers[name])))
    return True


def main() -> None:
    from horovod.runner import launch

    from hvdtrain.doctor import probe

    install_build_answers(launch, probe.horovod_build(sys.executable).controllers())
    launch.run_commandline()


if __name__ == "__main__":
    main()
