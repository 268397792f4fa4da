#!/usr/bin/env bash
# scripts/fresh_state.sh — remove the state that earlier hvdtrain runs and test runs leave on this machine, so that
# the next test run sees what a fresh machine has. .ci/run calls it before the tests (CI machines are reused).
# Run it when no test run is in progress on this machine (it takes a half-built test cluster for a stale one).
#
# Removes only what hvdtrain or its tests create:
#   - hvdtrain's cache directory ($HVDTRAIN_CACHE_DIR, else ${XDG_CACHE_HOME:-~/.cache}/hvdtrain);
#   - the node cache of streamed datasets ($HVDTRAIN_DATA_CACHE, else ${TMPDIR:-/tmp}/hvdtrain-data-UID);
#   - /run/sshd, if it is empty and no sshd runs (older test runs made it for their namespace hosts);
#   - ~/.ssh/known_hosts entries for the test hosts' addresses (10.213.20-219.11-12; older test runs recorded them);
#   - /dev/shm/hvdtrain_<pid>_* segments whose creating process is gone;
#   - the namespace test hosts of a killed test run (network namespaces hvdt<N>h<I> with no process left in them,
#     and their bridge hb<N> once none of its namespaces is left: tests/netns.py).
# For tests/test_fresh_state.py: HVDTRAIN_PRIVSEP_DIR and HVDTRAIN_SHM_DIR put /run/sshd and /dev/shm elsewhere;
# HVDTRAIN_SKIP_NETNS=1 leaves namespaces and bridges alone.
set -euo pipefail
privsep="${HVDTRAIN_PRIVSEP_DIR:-/run/sshd}"
shm="${HVDTRAIN_SHM_DIR:-/dev/shm}"

say() { echo "==> [fresh-state] $*"; }

cache="${HVDTRAIN_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/hvdtrain}"
if [[ -d "$cache" ]]; then
  say "removing hvdtrain's cache $cache"
  rm -rf -- "$cache"
fi

data_cache="${HVDTRAIN_DATA_CACHE:-${TMPDIR:-/tmp}/hvdtrain-data-$(id -u)}"
if [[ -d "$data_cache" ]]; then
  say "removing the dataset cache $data_cache"
  rm -rf -- "$data_cache"
fi

if [[ -d "$privsep" ]] && ! pgrep -x sshd >/dev/null; then
  if rmdir "$privsep" 2>/dev/null; then say "removed $privsep (empty, no sshd running)"; fi
fi

known="$HOME/.ssh/known_hosts"
if [[ -f "$known" ]] && command -v ssh-keygen >/dev/null; then
  removed=0
  for n in $(seq 20 219); do
    for h in 11 12; do
      if ssh-keygen -F "10.213.$n.$h" -f "$known" >/dev/null 2>&1; then
        ssh-keygen -R "10.213.$n.$h" -f "$known" >/dev/null 2>&1
        removed=$((removed + 1))
      fi
    done
  done
  if ((removed)); then
    say "removed $removed test host(s) from $known"
    rm -f -- "$known.old"  # the backup ssh-keygen -R just wrote holds the removed lines
  fi
fi

shopt -s nullglob
for seg in "$shm"/hvdtrain_*; do
  pid="${seg#"$shm"/hvdtrain_}"
  pid="${pid%%_*}"
  if [[ "$pid" =~ ^[0-9]+$ ]] && [[ ! -d "/proc/$pid" ]]; then
    say "removing stale shared-memory segment $seg (its creator $pid is gone)"
    rm -f -- "$seg"
  fi
done

if [[ "${HVDTRAIN_SKIP_NETNS:-}" != 1 ]] && command -v ip >/dev/null && [[ $(id -u) == 0 ]]; then
  for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep -E '^hvdt[0-9]+h[0-9]+$' || true); do
    if [[ -z "$(ip netns pids "$ns" 2>/dev/null)" ]]; then
      say "removing the test host namespace $ns (no process left in it)"
      ip netns del "$ns" || true
    fi
  done
  for br in $(ip -o link show type bridge 2>/dev/null | awk -F': ' '{print $2}' | grep -E '^hb[0-9]+$' || true); do
    tok="${br#hb}"
    if ! ip netns list 2>/dev/null | awk '{print $1}' | grep -qE "^hvdt${tok}h[0-9]+$"; then
      say "removing the test hosts' bridge $br (none of its namespaces is left)"
      ip link del "$br" || true
    fi
  done
fi
