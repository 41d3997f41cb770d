"""Fills in fill processes (mountd/store/fillpool.py): every guarantee of a fill, across the
process boundary.

The cache's other tests run its fills in worker threads (their fault-injecting backends live
in the test's process); these run the same cache with real forked fill processes, as mountd
does, and check what crossing processes could break: verification, single-flight, counting,
supplied descriptors, chunk pacing under the remote limits, cancellation, stopping, and a
fill process that dies (a full disk: tests/mountd/test_cache_space.py, with both).
"""

from __future__ import annotations

import os
import signal
from functools import partial
from pathlib import Path

import blake3
import pytest
import trio

from mountd.errors import CacheError
from mountd.store.batchfill import PREFETCH_BATCH
from mountd.store.cache import Cache
from mountd.store.fillpool import ProcessFills
from mountd.store.fillwork import FillJob, Target
from mountd.store.supplied import SuppliedBytes
from quiverfs.base.backends import BackendOptions, open_backend
from quiverfs.base.backends.base import Location
from quiverfs.base.errors import CorruptObject
from tests.mountd.conftest import Source, config, pooled, store_files, tmp_files, wait_until


def gets(cache: Cache) -> int:
    """GETs the fills made, as ``stats`` reports them (the fill processes' backends)."""
    return sum(source["requests"].get("GET", 0) for source in cache.backend_counters().values())


async def test_fills_land_verified_in_the_fill_processes(tmp_path: Path, source: Source):
    objs = source.many(40, 110 * 1024)
    async with pooled(config(tmp_path / "c")) as (cache, fills):
        async with trio.open_nursery() as nursery:
            for o in objs:
                nursery.start_soon(partial(cache.ensure, o.hash, o.size, o.location, "ds"))
        for o in objs:
            assert blake3.blake3(Path(cache.store_path(o.hash)).read_bytes()).digest() == o.hash
        assert gets(cache) == len(objs)
        snap = cache.counters.snapshot()
        assert snap["total"]["remote_requests"]["GET"] == len(objs)
        assert snap["total"]["bytes_from_remote"] == sum(o.size for o in objs)
        stages = snap["fill_stages"]
        # Forty misses of one moment: five batches of PREFETCH_BATCH (mountd/store/batchfill.py).
        assert stages["jobs"] == len(objs) // PREFETCH_BATCH
        assert all(stages["stages"][s]["count"] == len(objs) for s in ("read", "hash", "write"))
        assert stages["stages"]["write"]["wall_s"] > 0
        # The fills ran in the children: this process's threads never touched the source.
        assert len(fills.pids) == 2 and os.getpid() not in fills.pids
        [url] = cache.backend_counters()
        assert url == source.url
    assert tmp_files(tmp_path / "c") == []


async def test_fifty_concurrent_misses_make_one_read(tmp_path: Path, source: Source):
    obj = source.add("big", os.urandom(3 << 20))
    paths: list[str] = []
    async with pooled(config(tmp_path / "c", remote_bandwidth=30e6)) as (cache, _):
        async def one() -> None:
            paths.append(await cache.ensure(obj.hash, obj.size, obj.location))

        async with trio.open_nursery() as nursery:
            for _ in range(50):
                nursery.start_soon(one)
        assert gets(cache) == 1
        assert cache.counters.total.misses == 50
    assert len(set(paths)) == 1 and Path(paths[0]).read_bytes() == obj.data


async def test_large_files_hash_in_a_child_forked_after_the_parent_hashed(
        tmp_path: Path, source: Source):
    """blake3's own thread pool does not survive fork: a fill process forked after its parent
    had used it hung in its first large hash, until fills hashed in their own thread."""
    blake3.blake3(os.urandom(4 << 20), max_threads=blake3.blake3.AUTO).digest()
    obj = source.add("large", os.urandom(3 << 20))
    async with pooled(config(tmp_path / "c")) as (cache, _):
        with trio.fail_after(30):
            path = await cache.ensure(obj.hash, obj.size, obj.location)
        assert Path(path).read_bytes() == obj.data


async def test_corrupt_bytes_are_refused_and_nothing_is_stored(tmp_path: Path, source: Source):
    obj = source.add("a", os.urandom(50_000))
    lie = Location(obj.location.url, obj.location.key, 0, obj.size)
    wrong = blake3.blake3(b"something else").digest()
    async with pooled(config(tmp_path / "c")) as (cache, _):
        with pytest.raises(CorruptObject, match="does not verify"):
            await cache.ensure(wrong, obj.size, lie)
        assert not cache.contains(wrong) and store_files(tmp_path / "c") == {}
        assert cache.counters.total.verify_failures == 1
        assert gets(cache) == 1  # the GET itself succeeded and is counted
    assert tmp_files(tmp_path / "c") == []


async def test_supplied_descriptor_is_read_in_the_fill_process(tmp_path: Path, source: Source):
    obj = source.add("mine", os.urandom(200_000))
    async with pooled(config(tmp_path / "c")) as (cache, _):
        fd = os.open(source.root / "mine", os.O_RDONLY)
        path = await cache.ensure_supplied(obj.hash, obj.size, obj.location,
                                           SuppliedBytes(fd, 0), "ds", uid=1234)
        assert Path(path).read_bytes() == obj.data
        assert gets(cache) == 0  # the client read the source, not mountd
        assert cache.charges.bytes[1234] == obj.size
        with pytest.raises(OSError):
            os.fstat(fd)  # the fill closed the caller's descriptor after taking it over


async def test_streamed_chunks_are_paced_one_by_one(tmp_path: Path, source: Source):
    """A file of several chunks: each later chunk waits for the remote limits in the main
    process before the fill process reads it (here: the latency of one request each)."""
    obj = source.add("streamed", os.urandom(5 * 65_536 + 100))
    cfg = config(tmp_path / "c", chunk_size=65_536, remote_latency=0.001)
    async with pooled(cfg) as (cache, _):
        path = await cache.ensure(obj.hash, obj.size, obj.location)
        assert Path(path).read_bytes() == obj.data
        assert cache.limits.delayed == 6  # one latency per chunk: 5 full, 1 short
        assert gets(cache) == 6


async def test_cancelled_stream_leaves_nothing(tmp_path: Path, source: Source):
    """Closing the cache in the middle of a slow streamed fill stops it between chunks: no
    temp file, no row, no file at the final name."""
    obj = source.add("slow", os.urandom(400_000))
    cfg = config(tmp_path / "c", remote_bandwidth=200_000, chunk_size=32 * 1024)
    cache_dir = tmp_path / "c"
    async with pooled(cfg) as (cache, _):
        cache.prefetch([(obj.hash, obj.size, obj.location)])
        await wait_until(lambda: tmp_files(cache_dir) != [], what="the stream's temp file")
        await cache.aclose()
    assert tmp_files(cache_dir) == []
    assert store_files(cache_dir) == {}


async def test_a_dead_fill_process_fails_its_fills_and_is_replaced(tmp_path: Path,
                                                                  source: Source):
    slow = source.add("slow", os.urandom(300_000))
    after = source.many(8, 10_000)
    cfg = config(tmp_path / "c", remote_bandwidth=100_000, chunk_size=16 * 1024)
    async with pooled(cfg, processes=1) as (cache, fills):
        [victim] = fills.pids
        failed: list[BaseException] = []

        async def reader() -> None:
            try:
                await cache.ensure(slow.hash, slow.size, slow.location)
            except CacheError as exc:
                failed.append(exc)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(reader)
            await wait_until(lambda: tmp_files(tmp_path / "c") != [], what="the slow fill")
            os.kill(victim, signal.SIGKILL)
        assert failed and "died" in str(failed[0])
        assert not cache.contains(slow.hash)
        await wait_until(lambda: fills.pids and fills.pids != [victim], what="a new fill process")
        for o in after:  # the replacement serves the next fills
            assert Path(await cache.ensure(o.hash, o.size, o.location)).read_bytes() == o.data
        # And the first one fills again, from scratch.
        path = await cache.ensure(slow.hash, slow.size, slow.location)
        assert Path(path).read_bytes() == slow.data


async def test_a_job_sent_after_the_readers_stopped_fails_at_once(tmp_path: Path, source: Source):
    """mountd closing: the fill pool's readers stop (each fails the jobs it was still
    waiting for), while a fill that had already taken its slot sends its job. Nobody would
    answer that job, and its task refuses cancellation (a fill in hand is never abandoned),
    so shutdown waited for it for ever: the in-process mountd of tests/mountd/test_coop.py
    hung at exit in about 1 run of 10. Such a job now fails at once."""
    obj = source.add("late", os.urandom(10_000))
    fills = ProcessFills(tmp_path / "c", 1, 1,
                         partial(open_backend, options=BackendOptions(concurrency=1)))
    (tmp_path / "c").mkdir()
    try:
        with trio.CancelScope() as scope:
            async with trio.open_nursery() as nursery:
                await nursery.start(fills.serve)
                scope.cancel()  # as the cache's nursery is when mountd closes
        job = FillJob(Target.of(obj.hash, obj.size, obj.location))
        with trio.fail_after(10):
            outcome = await fills.run(job)
        [error] = outcome.results
        assert isinstance(error, CacheError) and "stopped" in str(error)
    finally:
        fills.close()
    assert not list((tmp_path / "c").rglob("*" + obj.hash.hex()))
