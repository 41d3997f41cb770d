"""Fills: single-flight, verification, streaming, errors, hits, prefetch, the directory lock."""

from __future__ import annotations

import os
import threading
import time
from functools import partial
from pathlib import Path

import blake3
import pytest
import trio

from mountd.errors import CacheLocked
from mountd.store import commits, layout
from mountd.store.cache import Cache
from mountd.store.commits import TOUCH_INTERVAL
from quiverfs.base.backends.base import Location
from quiverfs.base.errors import CorruptObject, NotFound
from tests.mountd.conftest import (
    Backends,
    Source,
    config,
    running,
    store_files,
    tmp_files,
    wait_until,
)


async def test_fill_stores_verified_file_and_indexes_it(
    tmp_path: Path, source: Source, backends: Backends
):
    obj = source.add("a/b.jpg", os.urandom(110 * 1024))
    async with running(config(tmp_path / "c"), backends) as cache:
        assert not cache.contains(obj.hash)
        path = await cache.ensure(obj.hash, obj.size, obj.location, "ds")
        assert path == str(layout.store_path(tmp_path / "c", obj.hash))
        assert Path(path).read_bytes() == obj.data
        assert cache.contains(obj.hash)
        assert cache.usage()["used_bytes"] == obj.size
        # A second ensure is a hit: no new remote read.
        assert await cache.ensure(obj.hash, obj.size, obj.location, "ds") == path
        assert backends.gets() == 1
        snap = cache.counters.snapshot()
        assert snap["total"]["misses"] == 1 and snap["total"]["hits"] == 1
        assert snap["datasets"]["ds"]["bytes_from_remote"] == obj.size
        assert snap["total"]["remote_requests"]["GET"] == 1
        assert snap["total"]["fill_latency"]["count"] == 1
        assert snap["fills_in_flight"] == 0
    assert tmp_files(tmp_path / "c") == []


async def test_fifty_concurrent_ensures_make_one_remote_read(
    tmp_path: Path, source: Source, backends: Backends
):
    obj = source.add("big", os.urandom(3 * 1024 * 1024))
    results: list[str] = []
    async with running(config(tmp_path / "c", remote_bandwidth=30e6), backends) as cache:

        async def one() -> None:
            results.append(await cache.ensure(obj.hash, obj.size, obj.location))

        async with trio.open_nursery() as nursery:
            for _ in range(50):
                nursery.start_soon(one)
        assert backends.gets() == 1
        assert cache.counters.total.misses == 50
        assert cache.counters.total.bytes_from_remote == obj.size
    assert len(results) == 50 and len(set(results)) == 1
    assert blake3.blake3(Path(results[0]).read_bytes()).digest() == obj.hash


async def test_single_flight_without_run(tmp_path: Path, source: Source, backends: Backends):
    """Without run() the first caller fills inline; the others still share its read."""
    obj = source.add("x", os.urandom(200_000))
    cache = Cache(config(tmp_path / "c", remote_bandwidth=4e6), backends)
    await cache.open()
    try:
        paths = []

        async def one() -> None:
            paths.append(await cache.ensure(obj.hash, obj.size, obj.location))

        async with trio.open_nursery() as nursery:
            for _ in range(20):
                nursery.start_soon(one)
        assert backends.gets() == 1 and len(set(paths)) == 1
    finally:
        await cache.aclose()


@pytest.mark.parametrize("chunk_size", [1 << 20, 64 * 1024], ids=["one-chunk", "streamed"])
async def test_corrupt_object_is_never_cached(
    tmp_path: Path, source: Source, backends: Backends, chunk_size: int
):
    obj = source.add("liar", os.urandom(300_000))
    wrong = blake3.blake3(b"something else").digest()
    async with running(config(tmp_path / "c", chunk_size=chunk_size), backends) as cache:
        errors = []

        async def one() -> None:
            try:
                await cache.ensure(wrong, obj.size, obj.location, "ds")
            except CorruptObject as exc:
                errors.append(exc)

        async with trio.open_nursery() as nursery:
            for _ in range(5):
                nursery.start_soon(one)
        assert len(errors) == 5
        assert "liar" in str(errors[0]) and wrong.hex() in str(errors[0])
        assert not cache.contains(wrong)
        assert cache.index.totals() == (0, 0)
        assert cache.counters.total.verify_failures == 1
        assert cache.counters.dataset("ds").verify_failures == 1
        assert backends.gets() == (1 if chunk_size > obj.size else 5)  # streamed: 5 chunks, once
        assert cache.usage()["used_bytes"] == 0 and cache.reserved == 0
    assert store_files(tmp_path / "c") == {}
    assert tmp_files(tmp_path / "c") == []


async def test_size_mismatch_is_corrupt(tmp_path: Path, source: Source, backends: Backends):
    obj = source.add("short", os.urandom(1000))
    loc = Location(obj.location.url, obj.location.key, 0, 2000)  # object is shorter than claimed
    async with running(config(tmp_path / "c"), backends) as cache:
        with pytest.raises(CorruptObject, match="1000 bytes"):
            await cache.ensure(obj.hash, 2000, loc)
        assert cache.counters.total.verify_failures == 1
    assert store_files(tmp_path / "c") == {} and tmp_files(tmp_path / "c") == []


async def test_a_hit_asked_for_another_size_is_corrupt(tmp_path: Path, source: Source, backends: Backends):
    """The content fixes its size: a warm cache refuses a wrong size as a cold one does."""
    obj = source.add("f", os.urandom(3000))
    async with running(config(tmp_path / "c"), backends) as cache:
        path = await cache.ensure(obj.hash, obj.size, obj.location, "ds")
        for wrong in (1 << 40, 100):
            with pytest.raises(CorruptObject, match=f"holds {obj.hash.hex()} as 3000 bytes, but {wrong}"):
                await cache.ensure(obj.hash, wrong, obj.location, "ds")
        assert cache.counters.total.verify_failures == 2
        assert cache.counters.total.hits == 0 and backends.gets() == 1
        # The right size still hits, and the store file is untouched.
        assert await cache.ensure(obj.hash, obj.size, obj.location, "ds") == path
        assert Path(path).read_bytes() == obj.data


async def test_a_fill_in_flight_with_another_size_decides_for_a_waiter(
    tmp_path: Path, source: Source, backends: Backends
):
    obj = source.add("f", os.urandom(3000))
    async with running(config(tmp_path / "c"), backends) as cache:
        results: dict[int, object] = {}

        async def ask(size: int) -> None:
            try:
                results[size] = await cache.ensure(obj.hash, size, obj.location)
            except CorruptObject as exc:
                results[size] = exc

        async with trio.open_nursery() as nursery:
            nursery.start_soon(ask, obj.size)
            nursery.start_soon(ask, 100)
        assert results[obj.size] == str(layout.store_path(tmp_path / "c", obj.hash))
        assert isinstance(results[100], CorruptObject)
        assert cache.used == 3000  # (either may start first: trio picks the order)


async def test_large_object_streams_in_chunks(tmp_path: Path, source: Source, backends: Backends):
    obj = source.add("shard.tar", os.urandom(1_000_000))
    async with running(config(tmp_path / "c", chunk_size=128 * 1024), backends) as cache:
        path = await cache.ensure(obj.hash, obj.size, obj.location)
        assert Path(path).read_bytes() == obj.data
        assert backends.gets() == 8  # ceil(1_000_000 / 131072)
        assert cache.counters.total.remote_requests["GET"] == 8


async def test_packed_object_range(tmp_path: Path, source: Source, backends: Backends):
    """A location can point into a packed shard (offset, length)."""
    parts = [os.urandom(n) for n in (1000, 5000, 700)]
    packed = source.add("shard", b"".join(parts))
    loc = Location(packed.location.url, "shard", 1000, 5000)
    h = blake3.blake3(parts[1]).digest()
    async with running(config(tmp_path / "c"), backends) as cache:
        path = await cache.ensure(h, 5000, loc)
        assert Path(path).read_bytes() == parts[1]


async def test_not_found_propagates_and_caches_nothing(
    tmp_path: Path, source: Source, backends: Backends
):
    h = blake3.blake3(b"gone").digest()
    async with running(config(tmp_path / "c"), backends) as cache:
        with pytest.raises(NotFound):
            await cache.ensure(h, 4, Location(source.url, "missing", 0, 4))
        assert cache.counters.total.fill_errors == 1
        assert not cache.contains(h) and cache.reserved == 0
    assert tmp_files(tmp_path / "c") == []


async def test_one_backend_per_url_closed_on_aclose(tmp_path: Path, backends: Backends):
    a, b = Source(tmp_path / "ra"), Source(tmp_path / "rb")
    objs = a.many(3, 100) + b.many(3, 100, prefix="b")
    async with running(config(tmp_path / "c"), backends) as cache:
        for o in objs:
            await cache.ensure(o.hash, o.size, o.location)
        assert len(backends.made) == 2
        closed = []
        for backend in backends.made:
            original = backend.aclose

            async def aclose(original=original, backend=backend) -> None:
                closed.append(backend.url)
                await original()

            backend.aclose = aclose
    assert sorted(closed) == sorted([a.url, b.url])


async def test_prefetch_fills_in_background(tmp_path: Path, source: Source, backends: Backends):
    objs = source.many(40, 10_000)
    async with running(config(tmp_path / "c", prefetch_concurrency=4), backends) as cache:
        queued = cache.prefetch([(o.hash, o.size, o.location) for o in objs], "ds")
        assert queued == 40
        assert (
            cache.prefetch([(o.hash, o.size, o.location) for o in objs[:5]], "ds") == 0
        )  # queued already
        await wait_until(lambda: all(cache.contains(o.hash) for o in objs), what="prefetch")
        assert backends.gets() == 40
        assert cache.counters.total.prefetches == 40 and cache.counters.total.misses == 0
        assert cache.usage()["datasets"]["ds"]["entries"] == 40


async def test_record_hits_counts_and_refreshes(tmp_path: Path, source: Source, backends: Backends):
    objs = source.many(3, 1000)
    async with running(config(tmp_path / "c"), backends) as cache:
        for o in objs:
            await cache.ensure(o.hash, o.size, o.location)
        cache.record_hits("ds", [o.hash for o in objs], 3000)
        snap = cache.counters.snapshot()
        assert snap["datasets"]["ds"]["hits"] == 3
        assert snap["datasets"]["ds"]["bytes_from_cache"] == 3000
        assert cache.usage()["datasets"]["ds"]["entries"] == 3


async def test_hit_references_reach_the_index_within_the_touch_interval(tmp_path: Path, source: Source,
                                                                       backends: Backends):
    objs = source.many(2, 1000)
    async with running(config(tmp_path / "c"), backends) as cache:
        for o in objs:
            await cache.ensure(o.hash, o.size, o.location, "a")
        cache.record_hits("b", [objs[0].hash], 1000)
        await trio.sleep(TOUCH_INTERVAL * 1.5)  # the cache's own writer, not a reader, wrote it
        refs = cache.index.conn.execute("SELECT dataset, hash FROM refs WHERE dataset='b'").fetchall()
        assert refs == [("b", objs[0].hash)]


async def test_hit_recency_in_memory_stays_bounded(tmp_path: Path, source: Source, backends: Backends,
                                                  monkeypatch):
    monkeypatch.setattr(commits, "TOUCH_MEMORY", 4)
    objs = source.many(10, 100)
    async with running(config(tmp_path / "c"), backends) as cache:
        for o in objs:
            await cache.ensure(o.hash, o.size, o.location)
        cache.record_hits(None, [o.hash for o in objs], 1000)
        assert cache.index.touches_waiting == 10
        await trio.sleep(TOUCH_INTERVAL * 1.5)
        assert cache.index.touches_waiting == 3  # written down to three quarters of the bound
        stamps = dict(cache.index.conn.execute("SELECT hash, last_use FROM entries"))
        written = [stamps[o.hash] for o in objs[:7]]
        assert written == sorted(written) and written[0] > max(stamps[o.hash] for o in objs[7:])


async def test_second_owner_of_a_cache_dir_is_refused(tmp_path: Path):
    first = Cache(config(tmp_path / "c"))
    await first.open()
    try:
        with pytest.raises(CacheLocked, match="in use by another mountd"):
            await Cache(config(tmp_path / "c")).open()
    finally:
        await first.aclose()
    second = Cache(config(tmp_path / "c"))
    await second.open()  # the lock is released by aclose
    await second.aclose()


async def test_register_and_usage(tmp_path: Path, source: Source, backends: Backends):
    obj = source.add("f", b"hello")
    async with running(config(tmp_path / "c", size=10_000), backends) as cache:
        cache.register_dataset("imagenet", {"url": source.url, "files": 1})
        await cache.ensure(obj.hash, obj.size, obj.location, "imagenet")
        usage = cache.usage()
        assert usage["cap_bytes"] == 10_000 and usage["entries"] == 1 and usage["used_bytes"] == 5
        assert usage["datasets"]["imagenet"] == {
            "entries": 1,
            "bytes": 5,
            "registered": True,
            "info": {"url": source.url, "files": 1},
        }
        cache.unregister_dataset("imagenet")
        assert cache.usage()["datasets"]["imagenet"]["registered"] is False
        assert cache.contains(obj.hash)


async def test_bad_hash_argument(tmp_path: Path, source: Source):
    async with running(config(tmp_path / "c")) as cache:
        with pytest.raises(ValueError):
            await cache.ensure(b"short", 1, Location(source.url, "k", 0, 1))


async def test_indexed_file_removed_behind_our_back_is_refetched(
    tmp_path: Path, source: Source, backends: Backends
):
    obj = source.add("f", os.urandom(5000))
    async with running(config(tmp_path / "c"), backends) as cache:
        path = await cache.ensure(obj.hash, obj.size, obj.location)
        os.unlink(path)
        assert await cache.ensure(obj.hash, obj.size, obj.location) == path
        assert Path(path).read_bytes() == obj.data
        assert backends.gets() == 2 and cache.used == 5000 and cache.entries == 1


async def test_cancelled_requester_does_not_cancel_the_shared_fill(
    tmp_path: Path, source: Source, backends: Backends
):
    obj = source.add("slow", os.urandom(400_000))
    cfg = config(tmp_path / "c", remote_bandwidth=2e6, chunk_size=64 * 1024)  # ~0.2 s
    async with running(cfg, backends) as cache:
        paths = []
        cancelled = []

        async def impatient(task_status=trio.TASK_STATUS_IGNORED) -> None:
            with trio.CancelScope() as scope:
                task_status.started(scope)
                await cache.ensure(obj.hash, obj.size, obj.location)
            cancelled.append(scope.cancelled_caught)

        async def patient() -> None:
            paths.append(await cache.ensure(obj.hash, obj.size, obj.location))

        async with trio.open_nursery() as nursery:
            scope = await nursery.start(impatient)
            await wait_until(lambda: cache.counters.fills_in_flight == 1, what="fill start")
            nursery.start_soon(patient)
            await wait_until(lambda: cache.counters.total.misses == 2, what="second waiter")
            scope.cancel()
        assert cancelled == [True]
        assert paths == [cache.store_path(obj.hash)]
        assert Path(paths[0]).read_bytes() == obj.data
        assert backends.gets() == 7  # ceil(400_000 / 65_536): one fill, not two


async def test_cancelled_inline_fill_leaves_nothing_and_others_retry(
    tmp_path: Path, source: Source, backends: Backends
):
    """Without run() the first caller fills inline; cancelling it removes its temp file
    and a waiter starts a fresh fill."""
    obj = source.add("slow", os.urandom(300_000))
    cfg = config(tmp_path / "c", remote_bandwidth=1e6, chunk_size=32 * 1024)
    cache = Cache(cfg, backends)
    await cache.open()
    try:
        got = []
        cancelled = []

        async def first(task_status=trio.TASK_STATUS_IGNORED) -> None:
            with trio.CancelScope() as scope:
                task_status.started(scope)
                await cache.ensure(obj.hash, obj.size, obj.location)
            cancelled.append(scope.cancelled_caught)

        async def second() -> None:
            got.append(await cache.ensure(obj.hash, obj.size, obj.location))

        async with trio.open_nursery() as nursery:
            scope = await nursery.start(first)
            await wait_until(lambda: tmp_files(tmp_path / "c") != [], what="temp file")
            nursery.start_soon(second)
            await wait_until(lambda: cache.counters.total.misses == 2, what="second waiter")
            scope.cancel()
        assert cancelled == [True]
        assert got and Path(got[0]).read_bytes() == obj.data
        assert tmp_files(tmp_path / "c") == []
        assert cache.reserved == 0 and cache.used == obj.size
        assert backends.gets() > 10  # ceil(300_000 / 32_768) = 10 for the fill that finished
    finally:
        await cache.aclose()


async def test_aclose_during_fills_leaves_a_consistent_store(tmp_path: Path, source: Source):
    objs = source.many(30, 50_000)
    cfg = config(tmp_path / "c", remote_bandwidth=1e6, chunk_size=16 * 1024)
    cache = Cache(cfg)
    await cache.open()
    async with trio.open_nursery() as nursery:
        await nursery.start(cache.run)
        cache.prefetch([(o.hash, o.size, o.location) for o in objs])
        await wait_until(lambda: tmp_files(tmp_path / "c") != [], what="fills in flight")
        await cache.aclose()
    assert tmp_files(tmp_path / "c") == []
    reopened = Cache(cfg)
    await reopened.open(reconcile=True)
    try:
        assert reopened.recovery.adopted == 0 and reopened.recovery.rows_dropped == 0
        assert set(store_files(tmp_path / "c")) == {h.hex() for h, _ in reopened.index.entries()}
        assert (await reopened.scrub()).bad == 0
    finally:
        await reopened.aclose()


class SlowReads:
    """Wraps a FileBackend so each read takes ``delay`` seconds in its thread, and records how
    many reads were in flight at once (the real part is too fast to overlap on demand)."""

    def __init__(self, delay: float) -> None:
        self.delay = delay
        self.lock = threading.Lock()
        self.now = self.most = 0

    def __call__(self, backend):
        original = backend._read_range

        def slow(*args):
            with self.lock:
                self.now += 1
                self.most = max(self.most, self.now)
            try:
                time.sleep(self.delay)
                return original(*args)
            finally:
                with self.lock:
                    self.now -= 1

        backend._read_range = slow
        return backend


@pytest.mark.parametrize("how", ["misses", "claimed", "preload"])
async def test_fills_overlap_up_to_the_remote_concurrency(tmp_path: Path, source: Source, how: str):
    """Misses of many readers and a claim's fetches keep exactly ``remote_concurrency``
    remote reads in flight, a preload (the prefetch queue) exactly background work's share
    of them (the rest are kept for readers' misses): no fewer (nothing serialises them
    behind one thread or a smaller pool), no more."""
    objs = source.many(24, 4000)
    slow = SlowReads(0.1)
    backends = Backends(wrap=slow)
    items = [(o.hash, o.size, o.location) for o in objs]
    async with running(config(tmp_path / "c", remote_concurrency=6), backends) as cache:
        with trio.fail_after(20):
            if how == "misses":
                async with trio.open_nursery() as readers:
                    for o in objs:
                        readers.start_soon(cache.ensure, o.hash, o.size, o.location, "ds")
            elif how == "claimed":
                assert cache.fetch_now(items, "ds") == len(objs)
            else:
                assert cache.prefetch(items, "ds") == len(objs)
            await wait_until(lambda: all(cache.contains(o.hash) for o in objs), what="fills")
        background = cache.limits.concurrency.background
    assert background == 4
    assert slow.most == (background if how == "preload" else 6)
    assert backends.gets() == len(objs)
    for o in objs:
        assert layout.store_path(tmp_path / "c", o.hash).read_bytes() == o.data


class LandingOrder:
    """A cache listener that records the order files land in."""

    def __init__(self) -> None:
        self.order: list[bytes] = []

    def filled(self, hashes) -> None:
        self.order.extend(hashes)

    def removed(self, hashes) -> None:
        pass

    def fill_failed(self, hash: bytes) -> None:
        pass


async def test_a_readers_miss_does_not_wait_behind_the_prefetch_queue(
    tmp_path: Path, source: Source
):
    """With the prefetch queue holding every worker and more files than slots (the sweep
    keeps it so for a whole cold epoch), a reader's miss takes one of the slots background
    work may not hold and lands with the first wave of prefetches, not after the queue
    (before, it waited in line behind every worker: the 8th of 13 to land at the best)."""
    objs = source.many(13, 4000)
    queued, wanted = objs[:12], objs[12]
    slow = SlowReads(0.1)
    async with running(config(tmp_path / "c", remote_concurrency=6), Backends(wrap=slow)) as cache:
        order = LandingOrder()
        cache.add_listener(order)
        assert cache.prefetch([(o.hash, o.size, o.location) for o in queued], "ds") == 12
        await wait_until(lambda: slow.now >= 4, what="the prefetches in flight")
        with trio.fail_after(20):
            await cache.ensure(wanted.hash, wanted.size, wanted.location, "ds")
        await wait_until(lambda: all(cache.contains(o.hash) for o in queued), what="the queue")
    assert slow.most == 5  # the four background slots, and one of the two kept
    assert len(order.order) == 13
    assert order.order.index(wanted.hash) < 5


async def test_a_claims_fetches_take_the_bandwidth_in_the_order_asked(
    tmp_path: Path, source: Source, backends: Backends
):
    """A claim's misses are read in claim order: under a bandwidth cap they must land in that
    order (trio runs a batch of new tasks in either order; without mountd.store.limits.Turns,
    half the claims landed last file first and the job waited for the whole claim)."""
    objs = source.many(12, 20_000)
    # 20 ms a file, one after another (no burst to let several through at once)
    cfg = config(tmp_path / "c", remote_bandwidth=1e6, burst_seconds=0.001)
    async with running(cfg, backends) as cache:
        order = LandingOrder()
        cache.add_listener(order)
        for attempt in range(3):  # one order in two would pass by luck without the turns
            batch = objs[4 * attempt:4 * attempt + 4]
            assert cache.fetch_now([(o.hash, o.size, o.location) for o in batch], "ds",
                                   owner="job") == 4
            await wait_until(lambda b=batch: all(cache.contains(o.hash) for o in b),
                             what="the claim's fetches")
        assert order.order == [o.hash for o in objs]


class HungSource:
    """Wraps the FileBackends of URLs containing ``part``: their reads wait for :attr:`go`
    (a bucket that stops answering: the real emulator cannot hang on demand)."""

    def __init__(self, part: str) -> None:
        self.part = part
        self.go = threading.Event()
        self.waiting = 0

    def __call__(self, backend):
        if self.part not in backend.url:
            return backend
        original = backend._read_range

        def hung(*args):
            self.waiting += 1
            self.go.wait(30)
            return original(*args)

        backend._read_range = hung
        return backend


async def test_a_source_whose_fills_hang_leaves_slots_to_the_others(tmp_path: Path):
    """A bucket that stops answering holds every fill it has started (each retries until its
    deadline); the fills of another dataset's source still run, in the spare slots
    (mountd/store/limits.py SourceSlots), and the hung fills finish once it answers."""
    hung_source, good_source = Source(tmp_path / "bucket-a"), Source(tmp_path / "bucket-b")
    hung = [hung_source.add(f"a-{i}", os.urandom(3000 + i)) for i in range(12)]
    good = [good_source.add(f"b-{i}", os.urandom(2000 + i)) for i in range(6)]
    stuck = HungSource("bucket-a")
    async with running(config(tmp_path / "c", remote_concurrency=4, fill_concurrency=4),
                       Backends(wrap=stuck)) as cache:
        async with trio.open_nursery() as nursery:
            for o in hung:  # misses of the dataset whose bucket hangs
                nursery.start_soon(cache.ensure, o.hash, o.size, o.location, "a")
            await wait_until(lambda: stuck.waiting == 4, what="the hung source's reads")
            assert cache._fill_slots.held(hung_source.url) == 4
            with trio.fail_after(10):  # before: every fill slot was the hung source's
                for o in good:
                    path = await cache.ensure(o.hash, o.size, o.location, "b")
                    assert Path(path).read_bytes() == o.data
            assert stuck.waiting == 4 and not any(cache.contains(o.hash) for o in hung)
            stuck.go.set()
        assert all(cache.contains(o.hash) for o in hung)
        for o in hung:
            assert layout.store_path(tmp_path / "c", o.hash).read_bytes() == o.data


@pytest.mark.parametrize("how", ["prefetch", "ensure"])
async def test_a_fill_that_lands_while_the_cache_closes_is_indexed(tmp_path: Path,
                                                                   source: Source, how: str):
    """A fill whose read had started when the cache began to close is waited for; the file
    it lands is indexed and counted. Refused ("the cache is not open"), it stayed at its
    final name with no row, and the index was marked clean: a file nobody would adopt."""
    obj = source.add("late", os.urandom(30_000))
    slow = SlowReads(0.3)
    cfg = config(tmp_path / "c")
    async with running(cfg, Backends(wrap=slow)) as cache:
        if how == "prefetch":
            cache.prefetch([(obj.hash, obj.size, obj.location)], "ds")
        else:
            cache._nursery.start_soon(partial(cache.ensure, obj.hash, obj.size, obj.location))
        await wait_until(lambda: slow.now == 1, what="the read")
        await cache.aclose()
    assert store_files(tmp_path / "c") == {obj.hash.hex(): obj.size}
    async with running(cfg) as reopened:
        assert reopened.contains(obj.hash)
        assert reopened.used == obj.size and reopened.entries == 1
