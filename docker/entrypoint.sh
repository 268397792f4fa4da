#!/usr/bin/env bash
# hvdtrain container entrypoint (installed as /usr/local/bin/hvdtrain-entrypoint).
#
#   hvdtrain-entrypoint sshd [SSHD-ARGS...]   run the ssh server in the foreground: worker nodes, MPIJob workers
#   hvdtrain-entrypoint wait-ssh HOSTFILE PORT SECONDS -- CMD [ARGS...]
#                                             run CMD once every host of HOSTFILE ('host slots=N' lines) takes
#                                             TCP connections on PORT; exit 1 after SECONDS (an MPIJob's launcher)
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
  exec /usr/sbin/sshd -D -e "$@"
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
  exec "$@"
}

if [[ $# -eq 0 ]]; then
  exec bash
elif [[ "$1" == "sshd" ]]; then
  shift
  start_sshd "$@"
elif [[ "$1" == "wait-ssh" ]]; then
  shift
  wait_ssh "$@"
else
  exec "$@"
fi
