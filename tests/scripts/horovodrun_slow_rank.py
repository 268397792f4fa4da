"""`horovodrun ARGS`, with one fault injected: the last local rank is slow in the local rendezvous, as when it is
descheduled on a loaded node. Its address (HTTP PUT /local_<host>/<local_size - 1>) and its "done" (DELETE of the
same path) reach horovodrun's rendezvous server 0.3 s late. Everything else is horovodrun's own code.

Horovod 0.28.1's server cleared every scope's list of finished ranks whenever any one scope finished; the other
rank's size-1 cross scope finishes within the late DELETE's 0.3 s, so the local scope was never cleared. At the
next hvd.init() the other rank read the slow rank's address from the cycle before (before the late PUT replaced
it) and connected to a closed port: "Connection refused" or "Connect timeout", then an abort
(tests/scripts/gloo_reinit.py; the http_server.py hunk of scripts/patches/horovod-0.28.1.patch).
"""

import sys
import time

from horovod.runner.http import http_server

DELAY_S = 0.3


def _late(handler):
    def late(self):
        scope, _, key = self.path.strip("/").partition("/")
        local_size = self.server.scope_size.get(scope) if scope.startswith("local_") else None
        if local_size is not None and key == str(local_size - 1):
            time.sleep(DELAY_S)
        return handler(self)
    return late


http_server.RendezvousHandler.do_PUT = _late(http_server.RendezvousHandler.do_PUT)
http_server.RendezvousHandler.do_DELETE = _late(http_server.RendezvousHandler.do_DELETE)

if __name__ == "__main__":  # horovodrun starts processes with multiprocessing: the main-module guard is needed
    from horovod.runner.launch import run_commandline

    sys.exit(run_commandline())
