"""Batched prefetches (mountd/store/batchfill.py): queued files of one bucket filled by one
job, each still verified, single-flight, counted and indexed on its own, whichever runs the
fills (mountd's threads or fill processes)."""

from __future__ import annotations

import multiprocessing
import os
import time
from pathlib import Path

import blake3
import pytest
import trio

from mountd.store.batchfill import PREFETCH_BATCH
from mountd.store.cache import Cache
from quiverfs.base.backends import BackendOptions, open_backend
from tests.mountd.conftest import (
    Backends,
    Source,
    config,
    pooled,
    running,
    running_with,
    store_files,
    tmp_files,
    wait_until,
)
from tests.mountd.test_cache_fill import SlowReads


def gets(cache: Cache) -> int:
    """GETs the fills made (the fill processes' backends, or the cache's own)."""
    return sum(source["requests"].get("GET", 0) for source in cache.backend_counters().values())


def filled(cache: Cache) -> int:
    """Fills that stored a file (each is one observation of the fill latency)."""
    return cache.counters.total.fill_latency.count


@pytest.mark.parametrize("fills", ["threads", "processes"])
async def test_a_queue_longer_than_the_workers_is_filled_in_batches(tmp_path: Path,
                                                                    source: Source, fills: str):
    objs = source.many(40, 10_000)
    cfg = config(tmp_path / "c", remote_concurrency=2)  # two prefetch workers
    async with running_with(fills, cfg) as cache:
        assert cache.prefetch([(o.hash, o.size, o.location) for o in objs], "ds") == 40
        await wait_until(lambda: all(cache.contains(o.hash) for o in objs), what="the prefetches")
        snap = cache.counters.snapshot()
        total = snap["total"]
        assert total["prefetches"] == 40 and filled(cache) == 40
        assert total["remote_requests"]["GET"] == 40 and gets(cache) == 40
        assert total["bytes_from_remote"] == 40 * 10_000
        stages = snap["fill_stages"]
        # Twenty files a worker: batches of PREFETCH_BATCH, the queue's tail in smaller ones.
        assert 40 // PREFETCH_BATCH <= stages["jobs"] <= 12
        assert stages["stages"]["read"]["count"] == stages["stages"]["rename"]["count"] == 40
        assert cache.reserved == 0 and cache.counters.fills_in_flight == 0
        assert cache.used == 40 * 10_000 and cache.entries == 40
    for o in objs:
        assert Path(cache.store_path(o.hash)).read_bytes() == o.data
    assert tmp_files(tmp_path / "c") == []


async def test_a_short_queue_is_spread_over_the_workers(tmp_path: Path, source: Source):
    """In mountd's threads, where a batch's files are read one after another: fewer queued
    files than workers go one job each, so their reads overlap as far as background work's
    share of the slots allows (6 slots, 2 of them kept for readers' misses)."""
    objs = source.many(6, 4000)
    slow = SlowReads(0.1)
    async with running(config(tmp_path / "c", remote_concurrency=6), Backends(wrap=slow)) as cache:
        assert cache._batch_share(6) == 1 and cache._batch_share(6 * 3 + 1) == 4
        assert cache._batch_share(10_000) == PREFETCH_BATCH
        cache.prefetch([(o.hash, o.size, o.location) for o in objs], "ds")
        await wait_until(lambda: all(cache.contains(o.hash) for o in objs), what="the prefetches")
        assert cache.counters.stages.jobs == 6
        assert cache.limits.concurrency.background == 4
    assert slow.most == 4


class SharedSlowReads:
    """:class:`SlowReads` for the fill processes: it wraps the backends they open (after the
    fork) and counts the reads in flight across them in shared memory."""

    def __init__(self, delay: float) -> None:
        self.delay = delay
        self._now = multiprocessing.Value("i", 0)
        self._most = multiprocessing.Value("i", 0)

    @property
    def most(self) -> int:
        return self._most.value

    def __call__(self, url: str):
        backend = open_backend(url, BackendOptions(concurrency=16))
        original = backend._read_range

        def slow(*args):
            with self._now.get_lock():
                self._now.value += 1
                self._most.value = max(self._most.value, self._now.value)
            try:
                time.sleep(self.delay)
                return original(*args)
            finally:
                with self._now.get_lock():
                    self._now.value -= 1

        backend._read_range = slow
        return backend


async def test_a_batch_in_a_fill_process_reads_side_by_side_up_to_the_request_slots(
        tmp_path: Path, source: Source):
    """In fill processes a batch takes as many queued files as it may (PREFETCH_BATCH) and
    runs them side by side, one request slot each: as many reads overlap as background
    work's share of the remote concurrency allows, no more, in a few jobs."""
    objs = source.many(24, 4000)
    slow = SharedSlowReads(0.1)
    cfg = config(tmp_path / "c", remote_concurrency=6)
    async with pooled(cfg, child_factory=slow) as (cache, _):
        assert cache._batch_share(1) == PREFETCH_BATCH
        cache.prefetch([(o.hash, o.size, o.location) for o in objs], "ds")
        await wait_until(lambda: all(cache.contains(o.hash) for o in objs), what="the prefetches")
        assert gets(cache) == 24 and filled(cache) == 24
        assert cache.counters.stages.jobs == 24 // PREFETCH_BATCH
        assert cache.reserved == 0 and cache.counters.fills_in_flight == 0
        assert cache._fill_slots.held(source.url) == 0
        assert cache.limits.concurrency.held(source.url) == 0
    assert slow.most == 4  # 6 slots, 2 of them kept for readers' misses
    for o in objs:
        assert Path(cache.store_path(o.hash)).read_bytes() == o.data


async def test_a_batch_takes_no_more_slots_than_its_fill_process_runs_at_once(
        tmp_path: Path, source: Source):
    """A batch runs in the thread that received it and the fill process's helper threads:
    with 2 threads a process, 3 files at once. It holds no more fill or request slots than
    that (on 16 cores, 3 threads a process, a batch of 8 held 8 request slots for 4 running
    files, and a cold pass had half the reads in flight that its slots allowed)."""
    objs = source.many(PREFETCH_BATCH, 4000)
    slow = SharedSlowReads(0.3)
    cfg = config(tmp_path / "c", remote_concurrency=16, fill_concurrency=16)
    async with pooled(cfg, processes=8, child_factory=slow) as (cache, fills):
        assert fills.threads == 2 and fills.batch_parallel == 3
        held = []
        cache.prefetch([(o.hash, o.size, o.location) for o in objs], "ds")
        while not all(cache.contains(o.hash) for o in objs):
            held.append((cache._fill_slots.held(source.url),
                         cache.limits.concurrency.held(source.url)))
            await trio.sleep(0.01)
        assert cache.counters.stages.jobs == 1 and gets(cache) == PREFETCH_BATCH
    assert max(held) == (3, 3)
    assert slow.most == 3
    for o in objs:
        assert Path(cache.store_path(o.hash)).read_bytes() == o.data


class Landings:
    """A cache listener that keeps each ``filled`` event."""

    def __init__(self) -> None:
        self.events: list[list[bytes]] = []

    def filled(self, hashes) -> None:
        self.events.append(list(hashes))

    def removed(self, hashes) -> None:
        pass

    def fill_failed(self, hash: bytes) -> None:
        pass


async def test_a_batch_is_settled_once_for_all_its_files(tmp_path: Path, source: Source):
    """The files of one job are indexed, told to the listeners and counted together (one
    event, one timing), each file still a fill, an index row and an observation of its own."""
    objs = source.many(PREFETCH_BATCH, 4000)
    async with pooled(config(tmp_path / "c")) as (cache, _):
        landings = Landings()
        cache.add_listener(landings)
        cache.prefetch([(o.hash, o.size, o.location) for o in objs], "ds")
        await wait_until(lambda: all(cache.contains(o.hash) for o in objs), what="the prefetches")
        assert cache.counters.stages.jobs == 1
        assert landings.events == [[o.hash for o in objs]]
        assert cache.counters.stages.count["index"] == PREFETCH_BATCH
        latency = cache.counters.dataset("ds").fill_latency
        assert latency.count == PREFETCH_BATCH and len(set(latency.recent)) == 1
        assert cache.counters.dataset("ds").bytes_from_remote == sum(o.size for o in objs)
        assert filled(cache) == PREFETCH_BATCH
        assert sorted(h for h, _ in cache.index.entries()) == sorted(o.hash for o in objs)


async def test_a_bad_file_in_a_batch_fails_alone(tmp_path: Path, source: Source):
    good = source.many(15, 20_000)
    other = source.add("other", os.urandom(20_000))
    lie = blake3.blake3(b"not what the object holds").digest()  # a damaged digest row
    items = [(o.hash, o.size, o.location) for o in good]
    items.insert(7, (lie, other.size, other.location))
    async with pooled(config(tmp_path / "c", remote_concurrency=1)) as (cache, _):
        assert cache.prefetch(items, "ds") == 16
        await wait_until(lambda: all(cache.contains(o.hash) for o in good), what="the good files")
        await wait_until(lambda: cache.counters.total.verify_failures == 1, what="the bad one")
        assert not cache.contains(lie)
        assert cache.counters.stages.jobs == 2  # two batches of eight, the bad one in the first
        assert gets(cache) == 16  # the bad file's GET is counted: its bytes came
        assert filled(cache) == 15
        assert cache.reserved == 0 and cache.used == 15 * 20_000
    assert sorted(store_files(tmp_path / "c")) == sorted(o.hash.hex() for o in good)
    assert tmp_files(tmp_path / "c") == []


async def test_a_reader_of_a_batched_file_joins_its_flight(tmp_path: Path, source: Source):
    objs = source.many(8, 5000)
    slow = SlowReads(0.05)
    backends = Backends(wrap=slow)
    async with running(config(tmp_path / "c", remote_concurrency=1), backends) as cache:
        cache.prefetch([(o.hash, o.size, o.location) for o in objs], "ds")
        await wait_until(lambda: slow.now == 1, what="the batch's first read")
        last = objs[-1]
        with trio.fail_after(10):
            path = await cache.ensure(last.hash, last.size, last.location, "ds")
        assert Path(path).read_bytes() == last.data
        await wait_until(lambda: all(cache.contains(o.hash) for o in objs), what="the batch")
        assert cache.counters.stages.jobs == 1
        assert sum(b.counters.requests["GET"] for b in backends.made) == 8  # one read each
        assert cache.counters.total.misses == 1 and filled(cache) == 8


class SlowKey:
    """Wraps a FileBackend so reads of one key take ``delay`` seconds (in their thread)."""

    def __init__(self, key: str, delay: float) -> None:
        self.key, self.delay = key, delay
        self.reading = False

    def __call__(self, backend):
        original = backend._read_range

        def read(key, *args):
            if key == self.key:
                self.reading = True
                time.sleep(self.delay)
            return original(key, *args)

        backend._read_range = read
        return backend


async def test_a_file_that_landed_while_queued_is_not_fetched_again(tmp_path: Path,
                                                                   source: Source):
    """A landing takes its hash off the prefetch queue: the worker passes over it without
    asking the index (without that, a reader's fill of a queued file was fetched again and
    indexed twice)."""
    first = source.add("first", os.urandom(5000))
    elsewhere = Source(tmp_path / "elsewhere")  # its own fill slots: the reader need not wait
    queued = elsewhere.add("queued", os.urandom(5000))
    slow = SlowKey("first", 0.5)
    backends = Backends(wrap=slow)
    async with running(config(tmp_path / "c", remote_concurrency=1), backends) as cache:
        cache.prefetch([(first.hash, first.size, first.location)], "ds")
        await wait_until(lambda: slow.reading, what="the only worker to be busy")
        assert cache.prefetch([(queued.hash, queued.size, queued.location)], "ds") == 1
        await cache.ensure(queued.hash, queued.size, queued.location, "ds")  # lands at once
        assert cache._prefetches and not cache.contains(first.hash)  # still queued
        await wait_until(lambda: cache.contains(first.hash), what="the first prefetch")
        await wait_until(lambda: not cache._prefetches, what="the queue to be taken")
        await wait_until(lambda: cache.counters.fills_in_flight == 0, what="the worker")
        assert sum(b.counters.requests["GET"] for b in backends.made) == 2
        assert filled(cache) == 2 and cache.entries == 2 and cache.used == 10_000


async def test_closing_in_the_middle_of_a_batch_leaves_only_verified_indexed_files(
        tmp_path: Path, source: Source):
    """A batch whose files run two at a time stops before its next file when the cache
    closes: no temp file is left, and every file it stored is complete, verified and
    indexed."""
    objs = source.many(8, 50_000)
    cache_dir = tmp_path / "c"
    cfg = config(cache_dir, remote_concurrency=2)
    async with pooled(cfg, child_factory=SharedSlowReads(0.2)) as (cache, _):
        cache.prefetch([(o.hash, o.size, o.location) for o in objs], "ds")
        await wait_until(lambda: len(store_files(cache_dir)) >= 2, what="two files stored")
        await cache.aclose()
    stored = store_files(cache_dir)
    assert 2 <= len(stored) < 8 and tmp_files(cache_dir) == []
    by_hex = {o.hash.hex(): o for o in objs}
    for name in stored:
        path = Path(Cache(cfg).store_path(bytes.fromhex(name)))
        assert path.read_bytes() == by_hex[name].data
    async with running(cfg) as reopened:
        assert {h.hex() for h in (o.hash for o in objs) if reopened.contains(h)} == set(stored)
        assert reopened.used == 50_000 * len(stored)


async def test_a_file_larger_than_a_chunk_is_filled_alone(tmp_path: Path, source: Source):
    small = source.many(12, 1000)
    large = source.add("large", os.urandom(200_000))
    items = [(o.hash, o.size, o.location) for o in small]
    items.insert(3, (large.hash, large.size, large.location))
    cfg = config(tmp_path / "c", remote_concurrency=1, chunk_size=65_536)
    async with running(cfg) as cache:
        cache.prefetch(items, "ds")
        await wait_until(lambda: all(cache.contains(o.hash) for o in [*small, large]),
                         what="the prefetches")
        # The three before it in one batch, it alone (four GETs), the nine after it in two.
        assert cache.counters.stages.jobs == 4
        assert cache.counters.total.remote_requests["GET"] == 12 + 4
    assert Path(cache.store_path(large.hash)).read_bytes() == large.data


async def test_a_claims_misses_go_in_batches(tmp_path: Path, source: Source):
    """In fill processes a claim's misses (``fetch_now``) go as batches, each with one turn
    among the claim's fetches: protected for their owner until read, one GET each."""
    objs = source.many(20, 20_000)
    async with pooled(config(tmp_path / "c")) as (cache, _):
        items = [(o.hash, o.size, o.location) for o in objs]
        assert cache.fetch_now(items, "ds", owner="job") == 20
        await wait_until(lambda: all(cache.contains(o.hash) for o in objs), timeout=20,
                         what="the claim's fetches")
        assert cache.counters.stages.jobs == 3  # 8 + 8 + 4
        assert gets(cache) == 20 and filled(cache) == 20
        assert cache.counters.total.prefetches == 20
        assert cache.protect_pending("job") == 20  # kept until the job reads them


async def test_paced_claims_are_not_batched_and_take_the_bandwidth_in_the_order_asked(
        tmp_path: Path, source: Source):
    """Under a bandwidth cap the bucket bounds the fills, and each takes its tokens in its
    turn: a claim's misses are filled one by one, sent to the fill processes in the order
    asked (batched, a later batch's files took the bandwidth first). What is checked is the
    order of the jobs sent, each right after its tokens: the order they land in also
    depends on which fill process the machine runs first."""
    objs = source.many(12, 20_000)
    cfg = config(tmp_path / "c", remote_bandwidth=2e6, burst_seconds=0.001)
    async with pooled(cfg) as (cache, fills):
        sent: list[bytes] = []
        run = fills.run

        async def recorded(job, fd=None):
            sent.extend(t.hash for t in getattr(job, "members", (job.target,)))
            return await run(job, fd)

        fills.run = recorded
        assert cache.fetch_now([(o.hash, o.size, o.location) for o in objs], "ds",
                               owner="job") == 12
        await wait_until(lambda: all(cache.contains(o.hash) for o in objs), timeout=20,
                         what="the claim's fetches")
        assert sent == [o.hash for o in objs]
        assert cache.counters.stages.jobs == 12
