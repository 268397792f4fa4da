"""scripts/gpu_report.py STEPS_TSV OUT_DIR — scripts/gpu_check.sh's report: OUT_DIR/gpu_check.json (every step with
its status, seconds and note, the machine, the key numbers of the benchmark, collectives and recipe files beside
it) and OUT_DIR/summary.txt (the same, readable). Exit 0 if no step failed or timed out, else 1."""

from __future__ import annotations

import datetime
import json
import sys
from pathlib import Path
from typing import Any


def read_steps(text: str) -> list[dict[str, Any]]:
    """Parse the TSV of gpu_check.sh's run_step: name, status, milliseconds, exit code, note."""
    steps = []
    for line in text.splitlines():
        if not line.strip():
            continue
        name, status, ms, rc, note = (line.split("\t") + [""] * 5)[:5]
        steps.append({"name": name, "status": status, "seconds": round(int(ms) / 1000, 1),
                      "exit": None if rc == "-" else int(rc), "note": note})
    return steps


def _load(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def build_report(steps: list[dict[str, Any]], out: Path, work: Path) -> dict[str, Any]:
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "ok": all(s["status"] in ("pass", "skipped") for s in steps),
        "machine": _load(work / "env.json"),
        "steps": steps,
        "collectives": _load(out / "collectives.json"),
        "h2d_overlap": _load(out / "h2d_overlap.json"),
        "recipe": _load(out / "recipe_summary.json"),
        "recipe_bf16": _load(work / "recipe_bf16_summary.json"),
        "jpeg_decode": _load(work / "jpeg_decode.json"),
        "gpu_jpeg": {k: v for k, v in (_load(work / "gpu_jpeg.json") or {}).items() if k != "windows"} or None,
        "gpu_feed": {k: v for k, v in (_load(out / "gpu_feed.json") or {}).items() if k != "windows"} or None,
        "p4_recipe_vs_synthetic": _load(work / "p4_gpu.json"),
        "step_overhead": _load(work / "step_overhead.json"),
    }


def feed_lines(title: str, feed: dict[str, Any] | None) -> list[str]:
    """A feed bench's (B8, B9) medians and judged goals; nothing if it did not run or judged nothing (no GPU)."""
    if not feed or not isinstance(feed.get("goals"), dict):
        return []
    lines = ["", f"{title}: {feed.get('config')}"]
    lines += [f"  {name:<11} {m['samples_per_s']:>9.0f} samples/s  step {m['step_ms']:.3f} ms  GPU idle "
              f"{m['gpu_idle_share'] or 0:.2%}  host wait {m['data_wait_share']:.2%}"
              for name, m in feed["median"].items()]
    return lines + [f"  goal {k}: {g['value']:.4g} {'met' if g['met'] else 'NOT met'}"
                    for k, g in feed["goals"].items()]


def summary_text(report: dict[str, Any]) -> str:
    lines = [f"hvdtrain GPU check, {report['date']}: {'ALL PASSED' if report['ok'] else 'FAILED'}"]
    m = report["machine"] or {}
    if m:
        lines.append(f"machine: {m.get('gpu')} (capability {m.get('capability')}), {m.get('cores')} cores, Python "
                     f"{m.get('python')}, torch {m.get('torch')}, NCCL {m.get('nccl_torch')}, nvcc {m.get('nvcc')}")
    lines.append("")
    for s in report["steps"]:
        lines.append(f"  {s['name']:<12} {s['status']:<8} {s['seconds']:>7.1f} s  {s['note']}")
    lines += feed_lines("B8 gpu_feed.json", report.get("gpu_feed"))
    lines += feed_lines("B9 (gpu_check.json gpu_jpeg)", report.get("gpu_jpeg"))
    h2d = report["h2d_overlap"]
    if h2d:
        lines += ["", "h2d_overlap.json:", json.dumps(h2d, indent=1)[:3000]]
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: gpu_report.py STEPS_TSV OUT_DIR", file=sys.stderr)
        return 2
    tsv, out = Path(argv[0]), Path(argv[1])
    report = build_report(read_steps(tsv.read_text()), out, tsv.parent)
    (out / "gpu_check.json").write_text(json.dumps(report, indent=2) + "\n")
    text = summary_text(report)
    (out / "summary.txt").write_text(text)
    print(text, end="")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
