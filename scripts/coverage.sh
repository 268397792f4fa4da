#!/usr/bin/env bash
# scripts/coverage.sh — line coverage of hvdtrain/ and recipes/ over the whole suite, subprocesses included (every
# rank, producer, launcher and CLI process the tests start: coverage.py's process start-up hook, a1_coverage.pth,
# measures any Python process that inherits COVERAGE_PROCESS_START). Not part of the README's test command (it
# slows every process); docs/testing.md reports its numbers. Extra arguments go to pytest.
#
#   bash scripts/coverage.sh                       # the whole suite; report in .build/coverage/report.txt
#   bash scripts/coverage.sh tests/launch -x       # a part of it
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/setup.sh >/dev/null
.venv/bin/python -m pip install -q --disable-pip-version-check -c scripts/constraints.txt coverage
OUT="$ROOT/.build/coverage"
rm -rf "$OUT"
mkdir -p "$OUT/data"
# Absolute paths: ranks and producers run in other working directories.
cat >"$OUT/coveragerc" <<RC
[run]
parallel = true
data_file = $OUT/data/cov
source = $ROOT/hvdtrain, $ROOT/recipes
sigterm = true
[report]
precision = 1
RC
export COVERAGE_PROCESS_START="$OUT/coveragerc" COVERAGE_FILE="$OUT/data/cov"
set +e
.venv/bin/python -m pytest -q -p no:cacheprovider "$@" </dev/null
rc=$?
set -e
unset COVERAGE_PROCESS_START
.venv/bin/python -m coverage combine -q --rcfile "$OUT/coveragerc" --data-file "$OUT/cov" "$OUT/data"
.venv/bin/python -m coverage report --rcfile "$OUT/coveragerc" --data-file "$OUT/cov" >"$OUT/report.txt"
tail -n 1 "$OUT/report.txt"
echo "==> [coverage] report: $OUT/report.txt (pytest exit $rc)"
exit "$rc"
