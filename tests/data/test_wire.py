"""The trainer <-> producer wire: framed messages on a socket pair (NOTE [wire] in hvdtrain/data/channel.py) and the
descriptor ring in shared memory (NOTE [ring] in hvdtrain/data/ring.py), alone and under a real ShmLoader."""

from __future__ import annotations

import os
import select
import time
from pathlib import Path

import numpy as np
import pytest

from hvdtrain.data import ShardSampler, ShmLoader, ring, shm
from hvdtrain.data.channel import Channel
from hvdtrain.data.protocol import MAX_LAYOUTS, Batch, EpochDone, FreeSlot, GrowSlot, StartEpoch, Stop, WorkerFailed
from tests.support import loaders as fx

pytestmark = pytest.mark.timeout(120)
needs_ring = pytest.mark.skipif(not ring.SUPPORTED, reason="the ring is used on x86-64 only (NOTE [ring] (b))")


def receive_all(chan: Channel, count: int, timeout: float = 10.0) -> list[object]:
    got: list[object] = []
    deadline = time.monotonic() + timeout
    while len(got) < count and time.monotonic() < deadline:
        select.select([chan.sock], [], [], 0.1)
        got += chan.receive()
    return got


# ---- the channel ---------------------------------------------------------------------------------------------

def test_every_message_crosses_the_channel_intact_in_order_and_the_common_ones_compactly() -> None:
    layout, _ = shm.plan_layout({"x": np.zeros((256, 3, 32, 32), np.float32), "y": np.zeros(256, np.int64)})
    messages = [FreeSlot(0, None, 0), FreeSlot(3, "hvdtrain_1_abcdef012345", 4096),
                FreeSlot(3, "hvdtrain_1_abcdef012345", 4096),  # the same again: a compact frame
                StartEpoch(2, 5, ShardSampler(10, 0, 1, batch_size=2).state_dict()), StartEpoch(2, 5, None), Stop(),
                Batch(2, 7, 3, 0, layout), Batch(2, 8, 3, 0), Batch(2, 9, 1, -1, layout), GrowSlot(3, 1 << 20),
                EpochDone(2, 8), WorkerFailed(2, 7, "Traceback ...", "boom", bad_data=True)]
    frames: list[bytes] = []
    sink = Channel(None)  # type: ignore[arg-type]  # only to see each frame
    sink.sock = type("Sink", (), {"sendall": lambda self, data: frames.append(data)})()  # type: ignore[assignment]
    for msg in messages:
        sink.send(msg)
    assert max(len(f) for f in frames) < 600  # small messages, never array data
    assert EpochDone(2, 7) != WorkerFailed(2, 7, "") and GrowSlot(1, 2) != (1, 2)  # told apart by type
    a, b = Channel.pair()
    try:
        for msg in messages:
            a.send(msg)
        back = receive_all(b, len(messages))
        assert back == messages and [type(m) for m in back] == [type(m) for m in messages]
        # on the wire: a repeated FreeSlot and a Batch without a layout are small structs, not pickles
        a.send(FreeSlot(3, "hvdtrain_1_abcdef012345", 4096))
        a.send(Batch(2, 10, 3, 0))
        a.send(FreeSlot(4, "hvdtrain_1_000000000000", 4096))  # first time for slot 4: pickled
        time.sleep(0.05)
        raw = b.sock.recv(1 << 16)
        assert raw[:9] == b"\x05\x00\x00\x00F\x03\x00\x00\x00"  # length 5, b"F", slot 3
        assert raw[9:13] == b"\x19\x00\x00\x00" and raw[13:14] == b"B"  # length 25, b"B", 4 numbers
        assert raw[42] == 0x80 and len(raw) < 200  # then a length and a pickle
    finally:
        a.close()
        b.close()


def test_a_frame_split_across_reads_waits_for_its_rest() -> None:
    a, b = Channel.pair()
    try:
        c = Channel(None)  # type: ignore[arg-type]  # only to encode: send into a buffer we control
        frame = bytearray()
        c.sock = type("Sink", (), {"sendall": lambda self, data: frame.extend(data)})()  # type: ignore[assignment]
        c.send(EpochDone(4, 17))
        a.sock.sendall(bytes(frame[:3]))
        time.sleep(0.05)
        assert b.receive() == []  # not even a whole length yet
        a.sock.sendall(bytes(frame[3:-1]))
        time.sleep(0.05)
        assert b.receive() == []  # the body is one byte short
        a.sock.sendall(bytes(frame[-1:]))
        assert receive_all(b, 1) == [EpochDone(4, 17)]
    finally:
        a.close()
        b.close()


def test_messages_before_the_end_of_stream_come_first_then_eof() -> None:
    a, b = Channel.pair()
    a.send(WorkerFailed(1, 3, "Traceback: the worker's last words"))
    a.send(EpochDone(1, 3))
    a.close()
    time.sleep(0.05)
    assert b.receive() == [WorkerFailed(1, 3, "Traceback: the worker's last words"), EpochDone(1, 3)]
    with pytest.raises(EOFError):
        b.receive()
    b.close()


def test_a_doorbell_wakes_the_peer_and_decodes_to_nothing() -> None:
    a, b = Channel.pair()
    try:
        assert b.receive() == []
        a.doorbell()
        assert select.select([b.sock], [], [], 5.0)[0]  # it woke the poll
        assert b.receive() == []
        assert not select.select([b.sock], [], [], 0)[0]  # and was consumed
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("raw", [b"\x01\x00\x00\x00Z", b"\x05\x00\x00\x00F\x09\x00\x00\x00",
                                 b"\x03\x00\x00\x00B\x01\x02"])
def test_a_corrupt_frame_is_an_error_not_a_message(raw: bytes) -> None:
    a, b = Channel.pair()
    try:
        a.sock.sendall(raw)  # an unknown tag; a compact FreeSlot for a slot never sent; a Batch struct cut short
        time.sleep(0.05)
        with pytest.raises(ValueError, match="corrupt frame"):
            b.receive()
    finally:
        a.close()
        b.close()


# ---- the ring ------------------------------------------------------------------------------------------------

def ring_pair(capacity: int) -> tuple[ring.Ring, ring.Ring]:
    """The trainer's and the worker's view of one ring, as two mappings of one segment (as in two processes)."""
    seg = shm.create_segment(shm.PAGE)
    return ring.Ring(seg, capacity), ring.Ring(shm.attach_segment(seg.name), capacity)


def close_rings(*rings: ring.Ring) -> None:
    for r in rings:
        r.close()
        shm.release_segment(r.seg, unlink=False)


def test_the_ring_hands_descriptors_over_in_order_wraps_around_and_refuses_when_full() -> None:
    trainer, worker = ring_pair(capacity=3)
    try:
        assert trainer.take() == [] and not trainer.published()
        expected = []
        for n in range(20):  # many times around a ring of 3
            assert worker.post(7, n, n % 3, n % 2)
            expected.append((7, n, n % 3, n % 2))
            if n % 2:
                assert trainer.published()
                assert trainer.take() == expected
                expected = []
        assert expected == [] and worker.post(8, 100, 0, 0) and worker.post(8, 101, 1, 0)
        assert worker.post(8, 102, 2, 0)
        assert not worker.post(8, 103, 0, 0)  # full: the Batch goes by socket instead
        assert trainer.take() == [(8, 100, 0, 0), (8, 101, 1, 0), (8, 102, 2, 0)]
        assert worker.post(8, 103, 0, 0) and trainer.take() == [(8, 103, 0, 0)]
    finally:
        close_rings(trainer, worker)


def test_the_ring_counts_socket_messages_flags_a_waiting_trainer_and_rejects_a_corrupt_head() -> None:
    trainer, worker = ring_pair(capacity=2)
    try:
        assert trainer.sent() == 0 and not worker.trainer_waiting()
        worker.count_sent()
        worker.count_sent()
        assert trainer.sent() == 2
        trainer.set_waiting(True)
        assert worker.trainer_waiting()
        trainer.set_waiting(False)
        assert not worker.trainer_waiting()
        worker.cells[0] = 5  # head 5 descriptors past the tail of a ring of 2: never written by a worker
        with pytest.raises(ValueError, match="corrupt batch ring"):
            trainer.take()
        with pytest.raises(ValueError, match="does not fit"):
            ring.Ring(trainer.seg, 1000)
    finally:
        close_rings(trainer, worker)


# ---- under a real loader -------------------------------------------------------------------------------------

def count_socket_batches(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the Batch messages the trainer reads from its sockets (this process only; the producers are other
    processes)."""
    calls = [0]
    real = Channel.receive

    def counting(self: Channel) -> list[object]:
        msgs = real(self)
        calls[0] += sum(isinstance(m, Batch) for m in msgs)
        return msgs

    monkeypatch.setattr(Channel, "receive", counting)
    return calls


def epochs_of_labels(use_ring: bool, monkeypatch: pytest.MonkeyPatch, epochs: int = 3) -> tuple[list, int]:
    monkeypatch.setattr(ring, "SUPPORTED", use_ring)
    socket_batches = count_socket_batches(monkeypatch)
    out = []
    with ShmLoader(fx.IndexDataset(301), rank=1, size=2, batch_size=5, num_workers=2, seed=4) as ld:
        assert len(ld._res.rings) == (2 if use_ring else 0)
        for epoch in range(epochs):
            ld.set_epoch(epoch)
            batches = []
            for x, y in ld:
                batches.append((x.copy(), y.copy()))
                time.sleep(0.005)  # a training step: the producers are ahead, as they should be
            assert all(np.array_equal(x[:, 0], y) for x, y in batches)  # every row is its label's sample
            out.append([y.tolist() for _, y in batches])
    return out, socket_batches[0]


@needs_ring
def test_batches_come_through_the_ring_without_socket_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    with_ring, by_socket = epochs_of_labels(True, monkeypatch)
    for epoch, labels in enumerate(with_ring):
        sampler = ShardSampler(301, 1, 2, seed=4, batch_size=5)
        sampler.set_epoch(epoch)
        assert labels == [b.tolist() for b in sampler.batches()]  # exactly the sampler's batches, once each
    batches = sum(len(e) for e in with_ring)
    assert batches == 93
    # Only a batch with a layout new to the trainer comes by socket: each worker's first batch and the epoch's one
    # short last batch (151 samples, batches of 5); every other batch is in the ring.
    assert by_socket == 3, f"{by_socket} of {batches} batches came by socket"


def test_without_the_ring_the_socket_carries_the_same_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a machine other than x86-64 runs (NOTE [ring] (b)): the same batches, all by socket."""
    without, by_socket = epochs_of_labels(False, monkeypatch)
    for epoch, labels in enumerate(without):
        sampler = ShardSampler(301, 1, 2, seed=4, batch_size=5)
        sampler.set_epoch(epoch)
        assert labels == [b.tolist() for b in sampler.batches()]
    assert by_socket == 93


@pytest.mark.parametrize("ordered", [True, False])
def test_more_layouts_than_a_worker_numbers_arrive_intact(ordered: bool) -> None:
    """84 batches of 80 distinct shapes per worker (past MAX_LAYOUTS: sent with every batch), then early shapes
    again; unordered, a batch may be taken from the ring before the batch that described its layout."""
    assert MAX_LAYOUTS < 80
    with ShmLoader.from_generator(fx.many_shapes, rank=0, size=1, num_workers=2, ordered=ordered) as ld:
        for _ in range(2):
            got = [(x.shape, float(x[0, 0]) if len(x) else None, tuple(t.tolist())) for x, t in ld]
            assert len(got) == 2 * 84
            for shape, value, (_, j) in got:
                n = [*range(1, 81), 3, 1, 80, 40][j]
                assert shape == (n, 2) and value == n
            for w in (0, 1):  # each producer's batches in its order, each exactly once
                assert [j for _, _, (v, j) in got if v == w] == list(range(84))


@needs_ring
def test_a_lost_wake_up_costs_milliseconds_not_a_hang() -> None:
    """The producer never rings its doorbell, so the trainer's poll on its socket never wakes for a batch; with
    poll_s=10 s only the ring's re-check (RECHECK_S) can find the batches in time (NOTE [ring] (d))."""
    with ShmLoader.from_generator(fx.no_doorbell, rank=0, size=1, num_workers=1, poll_s=10.0, timeout=60) as ld:
        start = time.monotonic()
        got = [int(b[0]) for b in ld]
        took = time.monotonic() - start
    assert got == [0, 1, 2, 3, 4]
    assert took < 3.0, f"5 batches of 50 ms took {took:.1f} s: a batch waited for poll_s, not for the re-check"


def test_a_deep_prefetch_gets_a_ring_big_enough_and_leaves_no_segment() -> None:
    """prefetch=150: 151 slots per worker, more descriptors than one page holds."""
    with ShmLoader.from_generator(fx.endless, rank=0, size=1, num_workers=1, prefetch=150, batches_per_epoch=5) as ld:
        assert [int(y[1]) for _, y in ld] == [0, 1, 2, 3, 4]
        if ring.SUPPORTED:
            assert ld._res.rings[0].seg.size >= ring.Ring.nbytes(151) > shm.PAGE
    assert not list(Path("/dev/shm").glob(f"hvdtrain_{os.getpid()}_*"))
