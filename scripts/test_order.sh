#!/usr/bin/env bash
# scripts/test_order.sh — prove the tests do not depend on their order or on an earlier run: after
# scripts/fresh_state.sh, run the whole suite in reverse order, then in a random order, then each test file alone.
# Not part of the README's test command (about three times as long); run it after changing fixtures or tests.
#
#   bash scripts/test_order.sh                 # all three
#   bash scripts/test_order.sh reverse|random|files
#   RANDOM_SEED=1234 bash scripts/test_order.sh random   # replay a random order (the seed is printed)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/setup.sh
PYTEST=(.venv/bin/python -m pytest -q)
# pytest-randomly lives outside the venv (pyproject.toml's dev extra says why): installed, at the version pinned in
# scripts/constraints.txt, into a directory of its own and put on the path of the random-order run alone.
ORDER_PLUGINS="$ROOT/.build/pytest-order"
random_order_plugin() {
  .venv/bin/python -m pip install -q --disable-pip-version-check --no-deps --upgrade -c scripts/constraints.txt \
    --target "$ORDER_PLUGINS" pytest-randomly
}
if (($#)); then modes=("$@"); else modes=(reverse random files); fi
failed=()

run() {  # name, pytest arguments...
  local name="$1"; shift
  bash scripts/fresh_state.sh
  echo "==> [order] $name: pytest $*"
  local start=$SECONDS
  if "${PYTEST[@]}" "$@" </dev/null; then
    echo "==> [order] $name: passed in $((SECONDS - start)) s"
  else
    echo "==> [order] $name: FAILED (exit $?) after $((SECONDS - start)) s"
    failed+=("$name")
  fi
}

for mode in "${modes[@]}"; do
  case "$mode" in
    reverse) run reverse --reverse ;;
    random) random_order_plugin
            PYTHONPATH="$ORDER_PLUGINS${PYTHONPATH:+:$PYTHONPATH}" \
              run "random (seed ${RANDOM_SEED:=$RANDOM})" -p randomly "--randomly-seed=$RANDOM_SEED" ;;
    files) while read -r file; do run "$file alone" "$file"; done < <(find tests -name "test_*.py" | sort) ;;
    *) echo "unknown mode '$mode': expected reverse, random or files" >&2; exit 2 ;;
  esac
done

if ((${#failed[@]})); then
  echo "==> [order] FAILED: ${failed[*]}"
  exit 1
fi
echo "==> [order] every run passed: ${modes[*]}"
