"""A worker's batch announcements in shared memory, so that the trainer takes a small batch without a system call.

NOTE [ring]
Reading a Batch message from the socket (NOTE [wire] in channel.py) costs the trainer a `recv` whose kernel path and
buffers are cold after a training step and were last touched by the producer's core: a large part of a small
batch's hand-off (docs/performance.md, "Small batches"). So each worker also has a ring of batch descriptors in a small
shared-memory segment (a page for up to 120 descriptors; created by the trainer, attached and unlinked by the worker
at start, like a slot: NOTE [loader shutdown] in resources.py):

    cell 0 (bytes 0-7)      head: descriptors the worker has published      written by the worker only
    cell 8 (bytes 64-71)    tail: descriptors the trainer has taken         written by the trainer only
    cell 16 (bytes 128-135) waiting: 1 while the trainer sleeps             written by the trainer only
    cell 24 (bytes 192-199) sent: messages the worker has sent on the socket    written by the worker only
    cells 32..              descriptors (generation, seq, slot, layout_id), `capacity` of them

(a) Only a Batch whose layout the trainer already has (protocol.Batch: layout None) goes through the ring; a new
    layout, EpochDone, GrowSlot and WorkerFailed go through the socket. The trainer files every message under
    (worker, seq) whichever way it came, so the two paths need no order between them, with one exception: a
    descriptor may name a layout number whose layout is still in the socket (sent first, read later). A number
    is never reused for another layout, and it is resolved only when its batch is lent; if it is unknown then,
    the trainer reads the worker's socket, where the layout already is (the worker sent it before publishing).
(b) Publishing: the worker writes the batch into its slot, then the descriptor, then `head + 1`; the trainer reads
    `head`, then the descriptors, then the batch. Each cell is one aligned 8-byte load or store (a memoryview of
    'q' items), and x86-64 keeps stores in order and loads in order (TSO), so a descriptor the trainer can see is
    complete and so is its batch. Python has no memory fences, so the ring is used only on x86-64 (`SUPPORTED`);
    elsewhere every message goes through the socket.
(c) Capacity: the worker owns `prefetch + 1` slots and a descriptor names a slot it filled; the slot comes back
    only after the trainer took the descriptor, so at most `prefetch + 1` are ever untaken. A full ring (never
    expected) sends the Batch through the socket instead.
(d) Wake-ups: the trainer sleeps only in `Watch.wait` on the sockets. Before it does, it sets `waiting` and looks
    at the rings once more; a worker that publishes while `waiting` is set also sends an empty frame (a doorbell)
    on the socket. Without fences the two stores and loads can still cross (each side may read the other's old
    value), so the trainer never sleeps long before it looks at the rings again: `RECHECK_S` (1 ms) at first,
    twice as long after each sleep while it waits for the same batch, up to `RECHECK_MAX_S` (50 ms; a trainer
    waiting seconds for a download wakes 20 times a second, not 1000). A lost wake-up, a window of nanoseconds,
    costs at most that, never a hang.
(e) The socket is read only when `sent` moved since the trainer's last read (the worker counts a message after
    sending it, so a count the trainer sees is in its socket) — looked at for every worker at every batch, so a
    GrowSlot or an EpochDone is taken in at the next batch, and a batch in the ring costs no system call at all
    — or when the socket woke the trainer's poll (a doorbell; a dead worker's end of stream).
A worker killed mid-publish leaves `head` unchanged: the trainer never sees a half-written descriptor or batch.
"""

from __future__ import annotations

import os
import platform
import sys

from hvdtrain.data import shm

SUPPORTED = (platform.machine().lower() in ("x86_64", "amd64") and sys.maxsize > 2**32  # 64-bit: 8-byte cells
             and os.environ.get("HVDTRAIN_RING", "1") != "0")
RECHECK_S, RECHECK_MAX_S = 0.001, 0.05  # how long the trainer sleeps before it looks at the rings: NOTE [ring] (d)
_HEAD, _TAIL, _WAITING, _SENT, _FIRST = 0, 8, 16, 24, 32


class Ring:
    """One worker's descriptor ring on a shared-memory segment (NOTE [ring]); both ends use the same class."""

    @staticmethod
    def nbytes(capacity: int) -> int:
        """The segment size a ring of `capacity` descriptors needs."""
        return 8 * (_FIRST + 4 * capacity)

    def __init__(self, seg: shm.Segment, capacity: int) -> None:
        if Ring.nbytes(capacity) > seg.size:
            raise ValueError(f"a ring of {capacity} descriptors does not fit in {seg.size} bytes")
        self.seg, self.capacity = seg, capacity
        self.cells = seg.buf.cast("q")
        self._tail = self.cells[_TAIL]

    # ---- the worker's side ----------------------------------------------------------------------------------

    def post(self, generation: int, seq: int, slot: int, layout_id: int) -> bool:
        """Publish one descriptor; False when the ring is full (then send the Batch on the socket)."""
        cells = self.cells
        head = cells[_HEAD]
        if head - cells[_TAIL] >= self.capacity:
            return False
        at = _FIRST + 4 * (head % self.capacity)
        cells[at], cells[at + 1], cells[at + 2], cells[at + 3] = generation, seq, slot, layout_id
        cells[_HEAD] = head + 1  # NOTE [ring] (b): last
        return True

    def trainer_waiting(self) -> bool:
        return self.cells[_WAITING] != 0

    def count_sent(self) -> None:
        """One more message is in the socket (call after sending it): NOTE [ring] (e)."""
        self.cells[_SENT] += 1

    # ---- the trainer's side ---------------------------------------------------------------------------------

    def take(self) -> list[tuple[int, int, int, int]]:
        """Every descriptor published since the last call, in order: (generation, seq, slot, layout_id)."""
        cells, tail = self.cells, self._tail
        head = cells[_HEAD]
        if head == tail:
            return []
        if not 0 < head - tail <= self.capacity:
            raise ValueError(f"corrupt batch ring: head {head}, tail {tail}, capacity {self.capacity}")
        out = []
        for n in range(tail, head):
            at = _FIRST + 4 * (n % self.capacity)
            out.append((cells[at], cells[at + 1], cells[at + 2], cells[at + 3]))
        cells[_TAIL] = self._tail = head
        return out

    def sent(self) -> int:
        """How many messages the worker has sent on the socket so far: NOTE [ring] (e)."""
        return self.cells[_SENT]

    def published(self) -> bool:
        """Whether descriptors wait to be taken."""
        return self.cells[_HEAD] != self._tail

    def set_waiting(self, waiting: bool) -> None:
        self.cells[_WAITING] = 1 if waiting else 0

    def close(self) -> None:
        """Drop the view of the segment (the segment itself is released by its owner)."""
        self.cells.release()
