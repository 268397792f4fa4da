#!/usr/bin/env bash
# scripts/test.sh — the README's test command: install what is missing (idempotent), lint, type-check, run every test.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -k hosts -x`, `bash scripts/test.sh tests/job`, or the fast
# tier: `bash scripts/test.sh -m "not slow"` (docs/testing.md).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/setup.sh
echo "==> [lint] ruff"
.venv/bin/ruff check hvdtrain recipes tests bench scripts
echo "==> [types] mypy"
.venv/bin/mypy  # what and how strictly: [tool.mypy] in pyproject.toml
echo "==> [tests] pytest"
# --durations=25 and the time per test folder (tests/conftest.py's summary) end every run, before pytest's closing
# line: what makes the suite slow stays visible in CI's output (docs/testing.md).
exec .venv/bin/python -m pytest --durations=25 "$@"
