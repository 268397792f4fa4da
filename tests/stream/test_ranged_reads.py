"""A cold start's first batches read by range GETs while their shards download whole (NOTE [first batches by range]
in hvdtrain/stream/ranged.py), against real servers on 127.0.0.1: moto's S3 server and the static HTTP server of
tests/scripts/http_store.py (ranges answered 206, after a delay if asked, or with the whole file: `--no-ranges`)."""

from __future__ import annotations

import os
import re
import shutil
import threading
import time
import zlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from hvdtrain.data import ShmLoader
from hvdtrain.stream import StreamError, StreamingDataset, mds, ranged
from tests.support import stores
from tests.support.stores import SAMPLE_BYTES, HttpStore, MotoS3, moto_bucket, point_at

BUCKET = "hvdtrain-ranged"
STRIDE = SAMPLE_BYTES - 4  # x float32[3], y int64: every sample is one fixed-size row (4: MDS's offset)


def write_dataset(out: Path, n: int = 200, *, compression: str | None = None) -> Path:
    """Samples whose x encodes their own index (x[0] == i), ~20 per raw shard, checksummed."""
    return stores.write_dataset(out, n, per_shard=20, compression=compression, hashes=("sha1",))


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MotoS3]:
    with moto_bucket(tmp_path_factory.mktemp("moto") / "requests.log", BUCKET) as server:
        yield server


@pytest.fixture(autouse=True)
def _env(s3: MotoS3, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    point_at(s3, tmp_path / "cache", monkeypatch)


def upload(s3: MotoS3, local: Path, prefix: str) -> str:
    client = s3.client()
    for path in sorted(local.iterdir()):
        client.put_object(Bucket=BUCKET, Key=f"{prefix}/{path.name}", Body=path.read_bytes())
    return f"s3://{BUCKET}/{prefix}"


def ranged_gets(s3: MotoS3, prefix: str) -> int:
    """GETs of `prefix`'s shards that moto answered 206 (a range)."""
    return len(re.findall(rf"GET /{BUCKET}/{prefix}/shard\.\S+ HTTP/1\.1\S*\"? 206", s3.log.read_text()))  # (colored)


def test_a_cold_starts_first_batch_is_read_by_range_then_every_sample_from_the_checked_shards(
        tmp_path: Path, s3: MotoS3) -> None:
    local = write_dataset(tmp_path / "ds")
    url = upload(s3, local, "first")
    ds = StreamingDataset(url, block_shards=4, fetch_threads=0)  # no whole shard before the test reads one
    here = StreamingDataset(local, block_shards=4)
    assert ds._ranged.eligible and not here._ranged.eligible  # a local raw shard is read in place anyway
    ds.plan_epoch(3, 0)
    order = ds.order(3, 0)
    first = ds.take(order[:16])
    assert np.array_equal(first["x"][:, 0], order[:16]) and np.array_equal(first["y"], here.take(order[:16])["y"])
    assert ds._ranged.bytes == 16 * STRIDE and ds._ranged.failed == 0
    touched = {int(s) for s in ds.locate(order[:16])[0]}
    assert 1 <= ranged_gets(s3, "first") <= len(touched)  # adjacent rows of a shard coalesce into one request
    assert set(ds._ranged.unchecked) == touched
    assert (ds.cache_dir / ranged.LEDGER).read_text() == f"3 0 {16 * STRIDE}"
    rest = ds.take(order[16:])  # only the first batch of a plan: the rest waits for the whole shards
    assert ds._ranged.bytes == 16 * STRIDE
    assert np.array_equal(rest["x"], here.take(order[16:])["x"])
    assert ds._ranged.unchecked == {}  # each row read by range was compared with its checked shard
    ds.close()


def test_only_the_producer_of_the_ranks_first_batch_reads_by_range_and_every_sample_comes_once(
        tmp_path: Path, s3: MotoS3) -> None:
    """Real producer processes (2), the ledger file shared by the node: producer 0 makes the rank's first batch
    and reads it by range; producer 1 (the second batch) waits for that read, then for the whole shards."""
    url = upload(s3, write_dataset(tmp_path / "ds", 240), "loader")
    ds = StreamingDataset(url, block_shards=4)
    loader = ShmLoader(ds, batch_size=12, rank=0, size=1, num_workers=2, fetch=StreamingDataset.take,
                       order=ds.order, seed=1, epochs=1)
    try:
        seen = [int(v) for batch in loader for v in batch["x"][:, 0]]
    finally:
        loader.close()
        ds.close()
    assert sorted(seen) == list(range(240))
    plan, _, spent = (ds.cache_dir / ranged.LEDGER).read_text().rpartition(" ")
    assert plan == "1 0" and 0 < int(spent) <= 12 * STRIDE and int(spent) % STRIDE == 0  # one batch at most
    assert ranged_gets(s3, "loader") >= 1
    assert not ranged.busy(ds.cache_dir)  # the announcement ended with the read


def test_whole_shards_wait_while_another_process_reads_its_first_batch_by_range(
        tmp_path: Path, s3: MotoS3, monkeypatch: pytest.MonkeyPatch) -> None:
    """A process that does not lead (leads=False: not the rank's first batch) neither reads by range nor starts
    whole shards (fetch threads and reader alike) while another process's announced range read is in flight;
    it goes on when that ends, and after HOLD_S whatever happens."""
    monkeypatch.setattr(ranged, "HOLD_S", 6.0)  # long enough that only the announcement can end the wait
    url = upload(s3, write_dataset(tmp_path / "ds"), "hold")
    ds = StreamingDataset(url, block_shards=4, fetch_threads=2)
    other = ranged.announce(ds.cache_dir)  # the leading process (a separate open file: flock treats it as one)
    assert other is not None and ranged.busy(ds.cache_dir)
    ds.plan_epoch(5, 0, leads=False)
    order = ds.order(5, 0)
    timer = threading.Timer(1.0, os.close, (other,))  # the leader's range read ends after 1 s
    timer.start()
    t0 = time.monotonic()
    try:
        time.sleep(0.6)
        assert ds.node.usage() == []  # the fetch threads hold: nothing of the block was downloaded
        assert np.array_equal(ds.take(order[:16])["x"][:, 0], order[:16])
    finally:
        timer.join()
    assert 1.0 <= time.monotonic() - t0 < 5.0
    assert ds._ranged.bytes == 0 and ranged_gets(s3, "hold") == 0 and ds._ranged.left == 0
    ds.close()
    monkeypatch.setattr(ranged, "HOLD_S", 0.5)
    again = StreamingDataset(url, block_shards=4, fetch_threads=0, cache_dir=tmp_path / "cache2")
    stuck = ranged.announce(again.cache_dir)  # a leader that never finishes: the wait still ends after HOLD_S
    again.plan_epoch(5, 1, leads=False)
    t0 = time.monotonic()
    assert len(again.take(again.order(5, 1)[:16])["x"]) == 16
    assert 0.5 <= time.monotonic() - t0 < 5.0
    again.close()
    os.close(stuck)


def test_range_reads_stay_within_the_nodes_budget(tmp_path: Path, s3: MotoS3) -> None:
    assert ranged.claim(tmp_path, "0 0", 60, 100)
    assert not ranged.claim(tmp_path, "0 0", 50, 100)  # 110 > 100: refused, nothing added
    assert ranged.claim(tmp_path, "0 0", 40, 100)
    assert ranged.claim(tmp_path, "0 1", 100, 100)  # another epoch's plan starts again at 0
    url = upload(s3, write_dataset(tmp_path / "ds"), "budget")
    ds = StreamingDataset(url, block_shards=4)
    assert ds._ranged.budget(ds) == ranged.MIN_BYTES  # 1.5% of a small dataset is less
    ds.plan_epoch(0, 0)
    assert ranged.claim(ds.cache_dir, "0 0", ranged.MIN_BYTES - 16 * STRIDE + 1, ranged.MIN_BYTES)  # others' reads
    idx = ds.order(0, 0)[:16]
    assert np.array_equal(ds.take(idx)["x"][:, 0], idx)
    assert ds._ranged.bytes == 0 and ranged_gets(s3, "budget") == 0
    ds.close()


def test_compressed_shards_and_a_zero_share_are_never_read_by_range(tmp_path: Path, s3: MotoS3) -> None:
    zipped = StreamingDataset(upload(s3, write_dataset(tmp_path / "z", compression="zstd"), "zipped"))
    off = StreamingDataset(upload(s3, write_dataset(tmp_path / "raw"), "off"), ranged=0.0)
    for ds in (zipped, off):
        assert not ds._ranged.eligible
        ds.plan_epoch(0, 0)
        idx = ds.order(0, 0)[:8]
        assert np.array_equal(ds.take(idx)["x"][:, 0], idx) and ds._ranged.bytes == 0
        ds.close()
    with pytest.raises(ValueError, match="ranged share must be in"):
        StreamingDataset(url_of(tmp_path, s3), ranged=1.5)


def test_the_share_comes_from_the_environment_and_a_bad_one_is_named(tmp_path: Path, s3: MotoS3,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    url = url_of(tmp_path, s3)
    monkeypatch.setenv(ranged.ENV_SHARE, "0")
    assert not StreamingDataset(url)._ranged.eligible
    monkeypatch.setenv(ranged.ENV_SHARE, "0.1")
    assert StreamingDataset(url)._ranged.share == 0.1
    monkeypatch.setenv(ranged.ENV_SHARE, "lots")
    with pytest.raises(StreamError, match=r"HVDTRAIN_STREAM_RANGED='lots' is not allowed: .* from 0 \(off\) to 1"):
        StreamingDataset(url)


def url_of(tmp_path: Path, s3: MotoS3) -> str:
    return upload(s3, write_dataset(tmp_path / "any", 40), "any")


def test_a_row_that_changed_between_its_range_read_and_the_whole_shard_is_named(tmp_path: Path, s3: MotoS3) -> None:
    local = write_dataset(tmp_path / "ds")
    url = upload(s3, local, "changed")
    ds = StreamingDataset(url, block_shards=4, fetch_threads=0)  # whole shards only when read: the test decides when
    ds.plan_epoch(7, 0)
    order = ds.order(7, 0)
    shard, row = (int(v[0]) for v in ds.locate(order[:1]))
    info = ds.index.shards[shard]
    good = (local / info.raw.basename).read_bytes()
    bad = bytearray(good)
    at = mds.first_row(info) + row * STRIDE
    bad[at:at + 4] = np.float32(-1).tobytes()  # sample order[0]'s x[0], same length
    s3.client().put_object(Bucket=BUCKET, Key=f"changed/{info.raw.basename}", Body=bytes(bad))
    assert ds.take(order[:16])["x"][0, 0] == -1  # read by range: the changed bytes
    s3.client().put_object(Bucket=BUCKET, Key=f"changed/{info.raw.basename}", Body=good)  # the index's version
    with pytest.raises(StreamError, match=rf"{re.escape(ds.shard_name(shard))}: sample {row}, read by range before "
                                          "the whole shard arrived, differs from the shard's checked copy"):
        ds.take(order[16:])
    ds.close()


def test_whole_shards_local_before_the_range_read_answers_are_read_instead(tmp_path: Path) -> None:
    """The race: a server that answers ranges after 10 s; the fetch threads wait HOLD_S, fetch the block whole,
    and the batch is made from it without waiting for the range read."""
    root = tmp_path / "www"
    write_dataset(root / "ds")
    server = HttpStore(root, tmp_path / "http.log", range_delay=10.0)
    server.start()
    try:
        ds = StreamingDataset(f"{server.url}/ds", block_shards=4)
        ds.plan_epoch(4, 0)
        order = ds.order(4, 0)
        t0 = time.monotonic()
        assert np.array_equal(ds.take(order[:16])["x"][:, 0], order[:16])
        assert time.monotonic() - t0 < 8.0
        assert ds._ranged.lost == 1 and ds._ranged.bytes == 0 and ds._ranged.unchecked == {}
        assert np.array_equal(ds.take(order[16:])["x"][:, 0], order[16:])
        ds.close()
    finally:
        server.stop()


def test_a_server_without_range_requests_reads_the_whole_shards(tmp_path: Path) -> None:
    root = tmp_path / "www"
    write_dataset(root / "ds")
    server = HttpStore(root, tmp_path / "http.log", ranges=False)  # a range gets the whole file (200)
    server.start()
    try:
        ds = StreamingDataset(f"{server.url}/ds", block_shards=4)
        ds.plan_epoch(2, 0)
        order = ds.order(2, 0)
        assert np.array_equal(ds.take(order)["x"][:, 0], order)
        assert ds._ranged.failed == 1 and ds._ranged.bytes == 0
        ds.close()
    finally:
        server.stop()
    shutil.rmtree(root)


def test_rows_read_by_range_of_a_shard_another_thread_mapped_meanwhile_are_checked_at_once(
        tmp_path: Path, s3: MotoS3) -> None:
    ds = StreamingDataset(upload(s3, write_dataset(tmp_path / "ds"), "mapped"), fetch_threads=0)
    with ds._lock:
        good = zlib.crc32(ds._reader(0).row_bytes(1))
    ds._ranged._note(ds, 0, {1: good})
    assert ds._ranged.unchecked == {}
    with pytest.raises(StreamError, match=r"sample 1, read by range before the whole shard arrived, differs"):
        ds._ranged._note(ds, 0, {1: good ^ 1})
    assert ds._ranged.unchecked == {0: {1: good ^ 1}}  # kept: every later opening of the shard fails the same way
    ds.close()


def test_only_a_plans_first_batch_may_be_read_by_range_even_when_it_needed_none(tmp_path: Path, s3: MotoS3) -> None:
    ds = StreamingDataset(upload(s3, write_dataset(tmp_path / "ds"), "warm"), block_shards=4, fetch_threads=0)
    ds.plan_epoch(0, 0)
    order = ds.order(0, 0)
    ds.take(order[:16])  # by range
    ds.take(order[16:])  # from whole shards: every shard is cached now
    spent = ds._ranged.bytes
    assert spent == 16 * STRIDE and ds._ranged.unchecked == {}
    ds.plan_epoch(0, 1)
    later = ds.order(0, 1)
    ds.take(later[:16])  # nothing missing: it still was the plan's first batch
    for path in ds.cache_dir.iterdir():
        if not path.name.startswith("."):
            path.unlink()  # the cache emptied behind the reader's back (evicted)
    while ds._readers:
        ds._readers.popitem()[1].close()
    assert np.array_equal(ds.take(later[16:32])["x"][:, 0], later[16:32])
    assert ds._ranged.bytes == spent and ds._ranged.left == 0
    ds.close()
