"""The first code a producer process runs: the producer that makes the rank's first batch starts first.

NOTE [first producer first]
Spawned producers import numpy and hvdtrain (0.1-0.2 CPU-s each) before they can make a batch, and the trainer waits
only for producer 0's at first: it makes the rank's first batch (the sampler's batches are dealt round robin from
the resume point; workers.py `dataset_batches`), producer 1 the second, a step later. On a machine with few cores, N
producers of every rank starting at once share the cores: the first batch came 0.1-0.3 s later in B6 (2 cores, 2
ranks of 2 producers), and B5's (4 producers) took 0.26-0.27 s instead of 0.16-0.17 s. So the loader starts them
all, but every producer other than producer 0 waits here, before importing anything beyond the standard library (the
package's `__init__` is lazy), until producer 0 has sent its first batch (or ended its first epoch, or exited: it
writes a byte to its end of a socket pair and closes it, and its death closes it too), or for `WAIT_S` at most. The
trainer keeps no end of that pair, so nothing else can hold it open. Later epochs do not wait. The second batch of a
rank can come later than it did, by one producer's start-up at most: a step the trainer is running anyway.
"""

from __future__ import annotations

import select
import signal
import socket

WAIT_S = 1.0  # the longest a producer waits for producer 0's first batch before it starts anyway


def producer_main(sock: socket.socket, payload: bytes, started: socket.socket | None,
                  wait_for: socket.socket | None) -> None:
    """Entry point of a producer process: `sock` is its end of the trainer's channel, `payload` its cloudpickled
    WorkerConfig; producer 0 gets `started` (to signal its first batch), the others `wait_for` (its other end)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # as worker_main: the trainer stops us (NOTE [shutdown])
    if wait_for is not None:
        select.select([wait_for], [], [], WAIT_S)
        wait_for.close()
    from hvdtrain.data.channel import Channel
    from hvdtrain.data.workers import worker_main

    worker_main(Channel(sock), payload, started)
