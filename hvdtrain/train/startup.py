"""Time to a recipe's first training step, and where it went (issue 35 item 4).

A `StartupClock` holds wall-clock marks (time.time(), so that a mark taken in another process compares), in order:
- "launched": when the `hvdtrain run` that started this rank started (records.LAUNCHED_ENV, which the launcher sets
  for every rank); absent when the job was started some other way (horovodrun, mpirun, srun directly): the report
  then starts at this rank's process;
- "process": when this rank's process started (the script's own process, under its supervisor);
- the recipe's marks, `mark(name)`, each closing the part that ends there ("imports" as main() starts, then
  "rendezvous" after hvd.init(), and so on);
- "first batch" and "first step", taken by `watch` around the first epoch's batches: when the first batch is
  handed to the loop, and when the loop asks for the second one (the first step's work has been queued: on a GPU
  the host does not wait for it, as a torch.distributed script measured the same way would not).
A part is named by the mark that ends it: "launcher" (from "launched" to "process": hvdtrain's own start, the
launcher's, the supervisor's), "imports" (to main()), ...; a mark from another host's clock can be off by its skew.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from hvdtrain import records

PART_NAMES = {"process": "launcher"}  # the part that ends at "process" is the launcher's; others: the mark's name


class StartupClock:
    """Marks on the way to the first step; `on_first_step(clock)` is called once the first step has been taken."""

    def __init__(self, *, launched: float | None, process: float, now: Callable[[], float] = time.time,
                 on_first_step: Callable[[StartupClock], None] | None = None) -> None:
        self.now = now
        self.marks: list[tuple[str, float]] = ([("launched", launched)] if launched is not None else [])
        self.marks.append(("process", process))
        self.on_first_step = on_first_step
        self.done = False

    @classmethod
    def here(cls, on_first_step: Callable[[StartupClock], None] | None = None) -> StartupClock:
        """This process's clock: launched when `hvdtrain run` says so, the process's own start time."""
        process = records.process_started()  # None where /proc cannot tell: the clock starts now
        return cls(launched=records.launched_at(), process=time.time() if process is None else process,
                   on_first_step=on_first_step)

    def mark(self, name: str) -> None:
        """The part named `name` ends now (ignored once the first step was taken, or if `name` ended already)."""
        if not self.done and all(name != marked for marked, _ in self.marks):
            self.marks.append((name, self.now()))

    def watch(self, batches: Iterable[Any]) -> Iterator[Any]:
        """`batches`, marking "first batch" and "first step" on the first pass (then a plain pass-through)."""
        it = iter(batches)
        if self.done:
            yield from it
            return
        try:
            first = next(it)
        except StopIteration:
            return
        self.mark("first batch")
        yield first
        self._first_step()
        yield from it

    def _first_step(self) -> None:
        self.mark("first step")
        self.done = True
        if self.on_first_step is not None:
            self.on_first_step(self)

    def parts(self) -> dict[str, float]:
        """Seconds of each part, in order (named by the mark that ends it; see the module's docstring)."""
        return {PART_NAMES.get(name, name): end - start
                for (_, start), (name, end) in zip(self.marks, self.marks[1:], strict=False)}

    def report(self) -> dict[str, Any]:
        """For summary.json: where the clock starts, the total to the last mark, the parts."""
        return {"from": self.marks[0][0], "total_s": round(self.marks[-1][1] - self.marks[0][1], 3),
                "parts_s": {name: round(s, 3) for name, s in self.parts().items()}}

    def line(self) -> str:
        """One console line: 'first step 4.07 s after `hvdtrain run` started: launcher 1.21 s, imports 1.52 s, ...'."""
        start = "`hvdtrain run` started" if self.marks[0][0] == "launched" else "this rank's process started"
        parts = ", ".join(f"{name} {seconds:.2f} s" for name, seconds in self.parts().items())
        return f"first step {self.marks[-1][1] - self.marks[0][1]:.2f} s after {start}: {parts}"
