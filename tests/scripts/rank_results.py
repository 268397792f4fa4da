"""What the rank programs in tests/scripts share: cases recorded by name, and one result file per rank.

A rank writes OUT_DIR/result.<rank>.json atomically (temp file + rename): mpirun's output forwarding can splice
lines that two ranks write at the same instant, so results never travel through stdout.
"""

import json
import os
import traceback


class Cases:
    """`@cases.case(name)` runs the function at once and records "ok" or its error (with the failing line)."""

    def __init__(self):
        self.results: dict[str, str] = {}

    def case(self, name):
        def run(fn):
            try:
                fn()
                self.results[name] = "ok"
            except Exception as exc:  # recorded; the test reports it with the failing line
                where = traceback.format_exc().splitlines()[-3].strip()
                self.results[name] = f"{type(exc).__name__}: {exc} | {where}"
            return fn
        return run


def write_result(out_dir: str, rank: int, result: dict) -> None:
    tmp = os.path.join(out_dir, f".result.{rank}.tmp")
    with open(tmp, "w") as f:
        json.dump(result, f, indent=1)
    os.replace(tmp, os.path.join(out_dir, f"result.{rank}.json"))
