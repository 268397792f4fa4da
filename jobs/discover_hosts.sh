#!/bin/sh
# Host discovery for jobs/elastic.yaml. horovodrun runs this every second while the job runs: print one
# `host:slots` line per host that may run ranks now. A host that leaves the output is removed (its ranks stop, the
# others go on); a host that appears is added (up to max_np ranks). A non-zero exit fails the job at start and is
# retried later on.
#
# With $HVDTRAIN_HOSTS_FILE set, this prints that file (edit it while the job runs; write a new file and rename it
# over the old one, so that a half-written file is never read). Otherwise it prints this machine under two names:
# Horovod treats each name as a separate host (and blacklists a failed host by name), and starts ranks on a name
# that resolves to one of this machine's addresses locally, without ssh. On a cluster, replace this with a query
# of your scheduler or cloud API.
if [ -n "${HVDTRAIN_HOSTS_FILE:-}" ]; then
    exec cat -- "$HVDTRAIN_HOSTS_FILE"
fi
printf 'localhost:1\n127.0.0.1:1\n'
