#!/usr/bin/env bash
# hvdtrain container entrypoint (installed as /usr/local/bin/hvdtrain-entrypoint).
#
#   hvdtrain-entrypoint sshd [SSHD-ARGS...]   run the ssh server in the foreground: worker nodes, MPIJob workers
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

if [[ $# -eq 0 ]]; then
  exec bash
elif [[ "$1" == "sshd" ]]; then
  shift
  start_sshd "$@"
else
  exec "$@"
fi
