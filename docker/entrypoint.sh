#!/usr/bin/env bash
# hvdtrain container entrypoint (installed as /usr/local/bin/hvdtrain-entrypoint).
#
#   hvdtrain-entrypoint sshd [SSHD-ARGS...]   run the ssh server in the foreground (supervised, below): worker
#                                             nodes, MPIJob workers
#   hvdtrain-entrypoint supervise CMD [ARGS...]
#                                             run CMD; SIGTERM (kubectl delete, a node drain, preemption: to the
#                                             pod's PID 1) goes to the training ranks among CMD's descendants, which
#                                             checkpoint at their next step boundary and exit; then CMD is stopped
#                                             and this exits 143 (HVDTRAIN_STOP_WAIT_S, default 300: the most it
#                                             waits for the ranks)
#   hvdtrain-entrypoint wait-ssh HOSTFILE PORT SECONDS -- CMD [ARGS...]
#                                             run CMD once every host of HOSTFILE ('host slots=N' lines) takes
#                                             TCP connections on PORT; exit 1 after SECONDS (an MPIJob's launcher);
#                                             a SIGTERM then waits for CMD to end (the ranks' own pods stop them)
#   hvdtrain-entrypoint CMD [ARGS...]         run CMD (default: bash)
#
# Host keys are made on first start, per container: they are never baked into the image, so two containers
# never share a host key. The port and the key-only rules are in /etc/ssh/sshd_config.d/hvdtrain.conf.
set -euo pipefail

start_sshd() {
  if ! compgen -G "/etc/ssh/ssh_host_*_key" >/dev/null; then
    ssh-keygen -A >/dev/null
  fi
  mkdir -p /run/sshd
  if [[ ! -s "${HOME:-/root}/.ssh/authorized_keys" ]]; then
    echo "hvdtrain-entrypoint: warning: ${HOME:-/root}/.ssh/authorized_keys is missing or empty: nobody can log in." >&2
    echo "hvdtrain-entrypoint: fix: mount the cluster's shared key folder there (see docker/README.md)." >&2
  fi
  /usr/sbin/sshd -t
  echo "hvdtrain-entrypoint: sshd listening on port ${SSHD_PORT:-22} (key-only)" >&2
  supervise /usr/sbin/sshd -D -e "$@"
}

# Does process $1 have a rank's environment (horovodrun's HOROVOD_RANK under Gloo, mpirun's OMPI_COMM_WORLD_RANK)?
has_rank_env() {
  local entries=()
  { mapfile -d '' entries < "/proc/$1/environ"; } 2>/dev/null || return 1
  local entry
  for entry in "${entries[@]}"; do
    [[ "$entry" == HOROVOD_RANK=* || "$entry" == OMPI_COMM_WORLD_RANK=* ]] && return 0
  done
  return 1
}

# Could process $1 be a rank: a rank's environment, and not a shell, ssh or a pipe's helper that only starts one?
is_rank_like() {
  local exe
  exe=$(readlink "/proc/$1/exe" 2>/dev/null) || return 1
  case "${exe##*/}" in
    sh | bash | dash | env | ssh | sshd | sshd-session | tee | cat | "") return 1 ;;
  esac
  has_rank_env "$1"
}

# The training ranks among the descendants of process $1: rank-like, with no rank-like ancestor (a rank's data
# producers, compile workers and the like inherit its environment: they must not be signalled, or the rank could
# not finish its checkpoint). One scan of /proc; each process is looked at once.
rank_pids() {
  local root=$1 stat pid line p
  local -A parent=() like=()
  for stat in /proc/[0-9]*/stat; do
    pid=${stat#/proc/}
    pid=${pid%/stat}
    { read -r line < "$stat"; } 2>/dev/null || continue  # a process that ended meanwhile
    line=${line##*) }  # after the command's name, which may hold spaces: "STATE PPID ..."
    line=${line#* }
    parent[$pid]=${line%% *}
  done
  for pid in "${!parent[@]}"; do
    p=$pid
    while [[ "$p" != "$root" && -n "${parent[$p]:-}" ]]; do
      p=${parent[$p]}
    done
    [[ "$p" == "$root" && "$pid" != "$root" ]] || continue  # not a descendant
    is_rank_like "$pid" && like[$pid]=1
  done
  for pid in "${!like[@]}"; do
    p=${parent[$pid]}
    while [[ "$p" != "$root" && -z "${like[$p]:-}" ]]; do
      p=${parent[$p]}
    done
    [[ "$p" == "$root" ]] && echo "$pid"
  done
  return 0
}

# HVDTRAIN_STOP_WAIT_S: how long a stop may take (a whole number of seconds, default 300).
stop_wait_s() {
  local limit=${HVDTRAIN_STOP_WAIT_S:-300}
  if [[ ! "$limit" =~ ^[0-9]{1,6}$ ]]; then
    echo "hvdtrain-entrypoint: HVDTRAIN_STOP_WAIT_S='$limit' is not a whole number of seconds; using 300" >&2
    limit=300
  fi
  echo $((10#$limit))
}

# NOTE [a worker pod's SIGTERM]: Kubernetes signals only a container's PID 1 (this script), which under sshd would
# be the ssh server: the ranks (started over ssh by horovodrun or mpirun) would get nothing until the SIGKILL at
# the end of terminationGracePeriodSeconds. So PID 1 keeps CMD as its child and, on SIGTERM, `supervise` passes it
# to the ranks among CMD's descendants (the recipes checkpoint at the next step boundary, every rank of the job
# stops after the same step, exit 75: hvdtrain/train/preempt.py), waits for them to exit, and only then stops CMD
# (sshd: the ranks' ssh sessions stay up while they checkpoint). The launcher (`wait-ssh`) keeps horovodrun as its
# child too and does not pass SIGTERM on (`outlast`): deleting the MPIJob signals every pod, and a horovodrun
# stopped at once would tear down the ranks' sessions (a second SIGTERM ends a rank at once) before their
# checkpoint; it ends by itself when the ranks exit. Either waits at most HVDTRAIN_STOP_WAIT_S, and Kubernetes
# kills what is left at the end of the pod's grace period.
supervise() {
  run_past_sigterm ranks "$@"
}

outlast() {
  run_past_sigterm none "$@"
}

run_past_sigterm() {
  local forward=$1
  shift
  stop_requested=0
  trap 'stop_requested=1' TERM
  "$@" <&0 &  # <&0: a background job's stdin would be /dev/null
  local child=$! code=0 pids="" limit
  wait "$child" || code=$?  # returns early when SIGTERM comes (its trap ran)
  if (( ! stop_requested )); then
    return "$code"  # CMD ended by itself
  fi
  trap - TERM
  limit=$(stop_wait_s)
  local deadline=$((SECONDS + limit))
  if [[ "$forward" == ranks ]]; then
    pids=$(rank_pids "$child" | paste -sd ' ' -)
    echo "hvdtrain-entrypoint: SIGTERM: passed to the ranks here (pids ${pids:-none}) to checkpoint and stop" >&2
    if [[ -n "$pids" ]]; then
      # shellcheck disable=SC2086  # one pid per word
      kill -TERM $pids 2>/dev/null || true
    fi
    while [[ -n "$(rank_pids "$child")" ]] && (( SECONDS < deadline )); do
      sleep 0.2
    done
  else
    echo "hvdtrain-entrypoint: SIGTERM: waiting up to $limit s for the job's ranks to stop (their pods were" \
         "signalled too) before stopping $1" >&2
    while kill -0 "$child" 2>/dev/null && (( SECONDS < deadline )); do
      sleep 0.2
    done
  fi
  kill -TERM "$child" 2>/dev/null || true
  wait "$child" 2>/dev/null || true
  exit 143
}

wait_ssh() {
  local usage="usage: wait-ssh HOSTFILE PORT SECONDS -- CMD [ARGS...]"
  if [[ $# -lt 5 || "$4" != "--" ]]; then
    echo "hvdtrain-entrypoint: $usage" >&2
    exit 2
  fi
  if [[ ! "$2" =~ ^[0-9]{1,5}$ ]] || (( 10#$2 < 1 || 10#$2 > 65535 )); then
    echo "hvdtrain-entrypoint: wait-ssh: PORT '$2' is not a port (1..65535); $usage" >&2
    exit 2
  fi
  if [[ ! "$3" =~ ^[0-9]{1,6}$ ]]; then
    echo "hvdtrain-entrypoint: wait-ssh: SECONDS '$3' is not a whole number of seconds; $usage" >&2
    exit 2
  fi
  local hostfile=$1 port=$((10#$2)) limit=$((10#$3)) host="" rest="" waited=0
  shift 4
  if [[ ! -f "$hostfile" || ! -r "$hostfile" ]]; then
    echo "hvdtrain-entrypoint: wait-ssh: cannot read the hostfile $hostfile (an MPIJob's launcher has the" \
         "operator's /etc/mpi/hostfile)" >&2
    exit 1
  fi
  # The operator starts the launcher with the workers: a `kubectl delete` meanwhile ends the wait at once.
  trap 'exit 143' TERM
  local deadline=$((SECONDS + limit))
  while read -r host rest || [[ -n "$host" ]]; do
    [[ -z "$host" || "$host" == \#* ]] && continue
    # /dev/tcp/HOST/PORT: bash opens a TCP connection; the name resolves once the worker's pod has its address.
    until timeout 3 bash -c 'exec 3<>"/dev/tcp/$1/$2"' _ "$host" "$port" 2>/dev/null; do
      if (( SECONDS >= deadline )); then
        echo "hvdtrain-entrypoint: $host:$port took no connection within $limit s: is the worker's pod running" \
             "(kubectl get pods; kubectl describe pod for an image pull or scheduling problem)?" >&2
        exit 1
      fi
      waited=1
      sleep 1
    done
  done < "$hostfile"
  trap - TERM
  if (( waited )); then
    echo "hvdtrain-entrypoint: every host in $hostfile takes connections on port $port" >&2
  fi
  outlast "$@"  # NOTE [a worker pod's SIGTERM]
}

if [[ $# -eq 0 ]]; then
  exec bash
elif [[ "$1" == "sshd" ]]; then
  shift
  start_sshd "$@"
elif [[ "$1" == "wait-ssh" ]]; then
  shift
  wait_ssh "$@"
elif [[ "$1" == "supervise" ]]; then
  shift
  if [[ $# -eq 0 ]]; then
    echo "hvdtrain-entrypoint: usage: supervise CMD [ARGS...]" >&2
    exit 2
  fi
  supervise "$@"
else
  exec "$@"
fi
