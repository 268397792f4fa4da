"""The wire between the trainer and one producer process: protocol.py's messages over a Unix socket pair.

NOTE [wire]
Over a multiprocessing pipe, most of a small batch's hand-off cost is the pipe's: `Connection.poll` (a system
call), `Connection.recv` (two reads: length, then body) and unpickling a dataclass — per batch, plus a pickled
FreeSlot per returned slot. Two messages make up nearly all the traffic, and both repeat what the other end knows:
a Batch with a layout the trainer has (protocol.Batch, layout None), and a FreeSlot that hands back the
segment the worker already has for that slot. So:
(a) Frames. Every message is a frame: a 4-byte little-endian length, then the body. A body is either a compact
    struct — `b"B"` + (generation, seq, slot, layout_id) for a Batch with layout None, `b"F"` + slot for a
    FreeSlot equal to the last one sent for that slot — or a pickle (first byte 0x80) of any other message. Each
    end remembers the FreeSlots it sent/received per slot, so a compact FreeSlot decodes to exactly the message it
    stands for.
(b) Reads take everything there is. `receive()` reads without blocking (MSG_DONTWAIT, so the socket stays
    blocking for sends) until the socket is empty and returns every complete frame, in order; a frame split
    across reads waits in a buffer. One system call usually brings one or more batches; no poll(0) before it.
(c) Order and end of stream. A stream socket keeps each end's frames in order, and the kernel orders the slot's
    bytes (written before the frame) before the frame, on any CPU. When the peer has closed, the frames read
    before the end are returned first; the next `receive()` raises EOFError — so a worker's last words (its
    WorkerFailed) are read before its death is reported (NOTE [loader shutdown] in resources.py).
Sends are one `sendall` of one frame: a blocking write that waits only while the peer's socket buffer is full.
An empty frame is a doorbell (NOTE [ring] in ring.py): it wakes the peer and decodes to nothing.
"""

from __future__ import annotations

import pickle
import socket
import struct
from typing import Any

from hvdtrain.data.protocol import Batch, FreeSlot

_LEN = struct.Struct("<I")
_BATCH = struct.Struct("<cqqii")  # b"B", generation, seq, slot, layout_id
_FREE = struct.Struct("<ci")  # b"F", slot
_PICKLE = 0x80  # the first byte of every pickle of protocol >= 2
_READ = 1 << 16


class Channel:
    """One end of a trainer <-> worker socket pair, speaking NOTE [wire]. Picklable to a spawned child (the socket
    is duplicated into it) until first used."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._buf = bytearray()
        self._eof = False
        self._sent: dict[int, FreeSlot] = {}  # slot -> last FreeSlot sent (NOTE [wire] (a))
        self._got: dict[int, FreeSlot] = {}  # slot -> last FreeSlot received

    @staticmethod
    def pair() -> tuple[Channel, Channel]:
        a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        return Channel(a), Channel(b)

    def __getstate__(self) -> dict[str, Any]:
        return {"sock": self.sock}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.sock, self._buf, self._eof, self._sent, self._got = state["sock"], bytearray(), False, {}, {}

    def fileno(self) -> int:
        return self.sock.fileno()

    def send(self, msg: Any) -> None:
        """Send one message (OSError when the peer is gone)."""
        if type(msg) is Batch and msg.layout is None:
            body = _BATCH.pack(b"B", msg.generation, msg.seq, msg.slot, msg.layout_id)
        elif type(msg) is FreeSlot and self._sent.get(msg.slot) == msg:
            body = _FREE.pack(b"F", msg.slot)
        else:
            body = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        self.sock.sendall(_LEN.pack(len(body)) + body)
        if type(msg) is FreeSlot:  # only once sent whole: a compact frame must stand for what the peer has
            self._sent[msg.slot] = msg

    def doorbell(self) -> None:
        """Send a doorbell: an empty frame, which wakes the peer's poll and decodes to nothing (NOTE [ring] (d))."""
        self.sock.sendall(_LEN.pack(0))

    def receive(self) -> list[Any]:
        """Every message that has arrived, in order, without blocking ([] if none); EOFError once the peer has
        closed and every message before that was returned (NOTE [wire] (b), (c)); OSError on a broken socket."""
        if self._eof:
            raise EOFError("the other end closed the channel")
        while True:
            try:
                data = self.sock.recv(_READ, socket.MSG_DONTWAIT)
            except BlockingIOError:
                break
            except ConnectionResetError:  # the peer died: what it sent before still counts (c)
                self._eof = True
                break
            if not data:
                self._eof = True
                break
            self._buf += data
            if len(data) < _READ:
                break
        msgs = self._frames()
        if self._eof and not msgs:
            raise EOFError("the other end closed the channel")
        return msgs

    def _frames(self) -> list[Any]:
        buf, pos, msgs = self._buf, 0, []
        while len(buf) - pos >= 4:
            (n,) = _LEN.unpack_from(buf, pos)
            if len(buf) - pos - 4 < n:
                break
            if n:  # an empty frame is a doorbell
                msgs.append(self._decode(buf, pos + 4, n))
            pos += 4 + n
        del buf[:pos]
        return msgs

    def _decode(self, buf: bytearray, start: int, n: int) -> Any:
        tag = buf[start]
        if tag == _PICKLE:
            msg = pickle.loads(buf[start:start + n])
            if type(msg) is FreeSlot:
                self._got[msg.slot] = msg
            return msg
        if tag == 66 and n == _BATCH.size:  # b"B"
            return Batch(*_BATCH.unpack_from(buf, start)[1:])
        if tag == 70 and n == _FREE.size and _FREE.unpack_from(buf, start)[1] in self._got:  # b"F"
            return self._got[_FREE.unpack_from(buf, start)[1]]
        raise ValueError(f"corrupt frame on the trainer/worker channel (first byte {tag:#x})")

    def close(self) -> None:
        self.sock.close()
