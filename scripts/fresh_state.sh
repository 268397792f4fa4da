#!/usr/bin/env bash
# scripts/fresh_state.sh — remove the state that earlier hvdtrain runs and test runs leave on this machine, so that
# the next test run sees what a fresh machine has. .ci/run calls it before the tests (CI machines are reused).
# Run it when no test run is in progress on this machine (it takes a half-built cluster of namespace test hosts for
# a stale one; a live test run's Slurm cluster it recognises and keeps).
#
# Removes only what hvdtrain or its tests create:
#   - hvdtrain's cache directory ($HVDTRAIN_CACHE_DIR, else ${XDG_CACHE_HOME:-~/.cache}/hvdtrain);
#   - the patched horovodrun's build-probe answers ($HOROVOD_BUILD_CACHE_DIR, else ~/.horovod: build-flags-*.json;
#     the rest of ~/.horovod is horovodrun's own);
#   - the node cache of streamed datasets ($HVDTRAIN_DATA_CACHE, else ${TMPDIR:-/tmp}/hvdtrain-data-UID);
#   - /run/sshd, if it is empty and no sshd runs (older test runs made it for their namespace hosts);
#   - ~/.ssh/known_hosts entries for the test hosts' addresses (10.213.20-219.11-12; older test runs recorded them);
#   - /dev/shm/hvdtrain_<pid>_* segments whose creating process is gone;
#   - the namespace test hosts of a killed test run (network namespaces hvdt<N>h<I> with no process left in them,
#     and their bridge hb<N> once none of its namespaces is left: tests/support/netns.py);
#   - the private Slurm cluster of a killed test run (tests/support/slurm.py): munged, slurmctld and slurmd whose command line
#     names a directory ${TMPDIR:-/tmp}/hvdtrain-slurm-*, every process whose SLURM_CONF is in one (slurmstepd, job
#     tasks), and those directories; not a live test run's cluster (its directory's `owner` names a test process
#     still running). Slurm daemons of any other configuration are never touched.
# Keeps the Horovod wheels scripts/setup.sh built (~/.cache/hvdtrain-wheels): each is stored under a hash of every
# input of its build, so reusing one is what a fresh build would give, and no run leaves state in it.
# For tests/project/test_fresh_state.py: HVDTRAIN_PRIVSEP_DIR and HVDTRAIN_SHM_DIR put /run/sshd and /dev/shm elsewhere;
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

probe_answers="${HOROVOD_BUILD_CACHE_DIR:-$HOME/.horovod}"
for answers in "$probe_answers"/build-flags-*.json; do
  [[ -f "$answers" ]] || continue
  say "removing horovodrun's build-probe answers $answers"
  rm -f -- "$answers"
done

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

slurm_dir="${TMPDIR:-/tmp}/hvdtrain-slurm-"
start_time() {  # field 22 of /proc/$1/stat: when process $1 started (clock ticks after boot); fails if it is gone
  local stat fields
  stat=$(cat "/proc/$1/stat" 2>/dev/null) || return 1
  read -ra fields <<< "${stat##*) }"  # after the command name, which may hold spaces and parentheses
  [[ -n "${fields[19]:-}" ]] && echo "${fields[19]}"
}
running() {  # is process $1 there and not a zombie (dead, not reaped yet by its parent)?
  local stat
  stat=$(cat "/proc/$1/stat" 2>/dev/null) || return 1
  [[ "${stat##*) }" != Z* ]]
}
# A cluster is live when the test process that owns it is: its directory has `owner` (tests/support/slurm.py writes
# "PID START_TIME": the test process's pid and its start time, so that a pid reused since does not count). A directory
# without one (an older fixture's, or one made this instant) counts as live for its first minute.
live_slurm=()
for dir in "$slurm_dir"*/; do
  dir="${dir%/}"
  owner_pid="" owner_start=""
  if [[ -f "$dir/owner" ]]; then read -r owner_pid owner_start _ < "$dir/owner" || true; fi
  if [[ "$owner_pid" =~ ^[0-9]+$ && "$owner_start" =~ ^[0-9]+$ ]]; then
    if [[ "$(start_time "$owner_pid" || true)" == "$owner_start" ]]; then
      say "keeping the test Slurm cluster ${dir}: its test run (pid $owner_pid) is alive"
      live_slurm+=("$dir")
    fi
  elif [[ -n "$(find "$dir" -maxdepth 0 -mmin -1 2>/dev/null)" ]]; then
    say "keeping the test Slurm cluster ${dir}: no owner recorded (yet), made less than a minute ago"
    live_slurm+=("$dir")
  fi
done
cluster_of() {  # the test cluster under $slurm_dir that process $1 belongs to, in $cluster (fails if none)
  local var path="" i args=()
  mapfile -d '' -t args 2>/dev/null < "/proc/$1/cmdline" || return 1
  case "${args[0]:-}" in
    munged|*/munged)
      for var in "${args[@]}"; do
        [[ "$var" == "--socket=$slurm_dir"*/munge/munge.socket ]] && path="${var#--socket=}"
      done ;;
    slurmctld|*/slurmctld|slurmd|*/slurmd)
      for ((i = 1; i < ${#args[@]}; i++)); do
        [[ "${args[i-1]}" == -f && "${args[i]}" == "$slurm_dir"*/etc/slurm.conf ]] && path="${args[i]}"
      done ;;
  esac
  if [[ -z "$path" ]]; then
    mapfile -d '' -t args 2>/dev/null < "/proc/$1/environ" || return 1
    for var in "${args[@]}"; do [[ "$var" == "SLURM_CONF=$slurm_dir"* ]] && path="${var#SLURM_CONF=}"; done
  fi
  [[ -n "$path" ]] || return 1
  path="${path#"$slurm_dir"}"
  cluster="$slurm_dir${path%%/*}"
}
is_live() {  # is $1 one of live_slurm?
  local dir
  for dir in ${live_slurm[@]+"${live_slurm[@]}"}; do [[ "$dir" == "$1" ]] && return 0; done
  return 1
}
slurm_pids=()
for proc in /proc/[0-9]*; do
  pid="${proc#/proc/}"
  if [[ "$pid" != "$$" ]] && cluster_of "$pid" && ! is_live "$cluster"; then slurm_pids+=("$pid"); fi
done
if ((${#slurm_pids[@]})); then
  say "killing ${#slurm_pids[@]} process(es) of a killed test run's Slurm cluster (${slurm_dir}*): ${slurm_pids[*]}"
  kill -KILL "${slurm_pids[@]}" 2>/dev/null || true
  for _ in $(seq 50); do
    alive=0
    for pid in "${slurm_pids[@]}"; do if running "$pid"; then alive=1; fi; done
    ((alive)) || break
    sleep 0.1
  done
fi
for dir in "$slurm_dir"*/; do
  dir="${dir%/}"
  if ! is_live "$dir"; then
    say "removing the test Slurm cluster's directory $dir (its test run is gone)"
    rm -rf -- "$dir"
  fi
done

# After the Slurm clusters: a killed two-node run's slurmd live in the namespaces (tests/support/slurm.py `hosts=`).
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
