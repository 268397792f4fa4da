#!/usr/bin/env bash
# scripts/quickstart.sh — the README's first command: set up (idempotent), then train the quickstart job
# (2 Horovod ranks on this machine, scikit-learn's bundled digits; nothing is downloaded).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/setup.sh
exec .venv/bin/hvdtrain run jobs/quickstart.yaml "$@"
