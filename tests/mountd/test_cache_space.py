"""Space: the cap under concurrent fills, LRU order, pins, evict by dataset, disk full."""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import blake3
import pytest
import trio

import mountd.store.fillwork as fillwork
from mountd.errors import CacheFull
from mountd.store import disk
from mountd.store.fillwork import BytesReader, FillJob, Store, Target
from mountd.store.index import Index
from quiverfs.base.backends.base import Location
from quiverfs.base.errors import CorruptObject
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


def disk_bytes(cache_dir: Path) -> int:
    """Bytes of content on disk: store files plus temp files."""
    total = sum(store_files(cache_dir).values())
    for name in tmp_files(cache_dir):
        with contextlib.suppress(FileNotFoundError):
            total += os.path.getsize(cache_dir / "tmp" / name)
    return total


async def test_cap_holds_under_concurrent_fills(tmp_path: Path, source: Source, backends: Backends):
    size, cap = 100_000, 1_000_000
    objs = source.many(60, size)
    cache_dir = tmp_path / "c"
    cfg = config(cache_dir, size=cap, fill_concurrency=16, remote_bandwidth=20e6)
    observed = []
    async with running(cfg, backends) as cache:
        done = trio.Event()

        async def watch() -> None:
            while not done.is_set():
                on_disk = disk_bytes(cache_dir)
                in_flight = cache.counters.fills_in_flight * size
                observed.append(on_disk)
                assert on_disk <= cap + in_flight, (on_disk, in_flight)
                assert cache.used + cache.reserved <= cap
                await trio.sleep(0.002)

        async def fill_all() -> None:
            async with trio.open_nursery() as nursery:
                for o in objs:
                    nursery.start_soon(cache.ensure, o.hash, o.size, o.location, "ds")
            done.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch)
            nursery.start_soon(fill_all)
        final = store_files(cache_dir)
        assert sum(final.values()) <= cap
        assert sum(final.values()) == cache.used == cache.usage()["used_bytes"]
        assert len(final) == cache.entries == cap // size
        assert cache.counters.total.evicted_files == 60 - cap // size
        assert cache.counters.total.evicted_bytes == (60 - cap // size) * size
        assert cache.counters.dataset("ds").evicted_files == 60 - cap // size
        assert backends.gets() == 60
    assert len(observed) > 5  # the watcher really sampled during the run
    # Whatever stayed is intact.
    for name in final:
        data = next(o.data for o in objs if o.hash.hex() == name)
        assert blake3.blake3(data).hexdigest() == name


async def test_lru_victim_follows_use(tmp_path: Path, source: Source, backends: Backends):
    a, b, c, d, e = source.many(5, 1000)
    async with running(config(tmp_path / "c", size=3000), backends) as cache:
        for o in (a, b, c):
            await cache.ensure(o.hash, o.size, o.location)
        cache.record_hits(None, [a.hash], 1000)  # a is now newer than b and c
        await cache.ensure(d.hash, d.size, d.location)  # evicts b (oldest)
        assert [cache.contains(o.hash) for o in (a, b, c, d)] == [True, False, True, True]
        await cache.ensure(c.hash, c.size, c.location)  # a hit: c is now newest
        await cache.ensure(e.hash, e.size, e.location)  # evicts a
        assert [cache.contains(o.hash) for o in (a, c, d, e)] == [False, True, True, True]
        assert set(store_files(tmp_path / "c")) == {o.hash.hex() for o in (c, d, e)}


async def test_files_kept_across_epochs_go_after_every_other_file(
    tmp_path: Path, source: Source, backends: Backends
):
    """Files ``set_retained`` names (a chunked dataset keeps them across epochs) are evicted
    after every other evictable file, each one met marked used; when only held files stand
    before them, they go rather than the reader wait for a hold (0.5 s) to end."""
    a, b, c, d, e, f, g = source.many(7, 1000)
    async with running(config(tmp_path / "c", size=4000), backends) as cache:
        for o in (a, b, c, d):
            await cache.ensure(o.hash, o.size, o.location)
        kept = {a.hash}
        cache.set_retained(kept.__contains__)
        await cache.ensure(e.hash, e.size, e.location)  # a is the oldest, but kept: b goes
        assert [cache.contains(o.hash) for o in (a, b, c, d, e)] == [True, False, True, True, True]
        await cache.ensure(f.hash, f.size, f.location)  # c goes, a was marked used
        assert [cache.contains(o.hash) for o in (a, c, d, e, f)] == [True, False, True, True, True]
        # Holds keep half the cache: e and f were just answered. d is kept too now, so only
        # kept files are free to go: the older of them (d; a was marked used after d was
        # stored) goes at once, not e or f once their holds end.
        kept.add(d.hash)
        assert e.hash in cache.holds and f.hash in cache.holds
        with trio.fail_after(0.25):
            await cache.ensure(g.hash, g.size, g.location)
        assert [cache.contains(o.hash) for o in (a, d, e, f, g)] == [True, False, True, True, True]
    assert tmp_files(tmp_path / "c") == []


async def test_pinned_entries_are_never_evicted(tmp_path: Path, source: Source, backends: Backends):
    a, b, c, d = source.many(4, 1000)
    async with running(config(tmp_path / "c", size=2000), backends) as cache:
        await cache.ensure(a.hash, a.size, a.location)
        await cache.ensure(b.hash, b.size, b.location)
        assert cache.pin([a.hash]) == 1
        await cache.ensure(c.hash, c.size, c.location)  # must evict b, not the older a
        assert cache.contains(a.hash) and not cache.contains(b.hash)
        cache.pin([c.hash])
        with pytest.raises(CacheFull, match="holds 2000 of 2000 bytes, 2000 pinned and 0 protected until read"):
            await cache.ensure(d.hash, d.size, d.location)
        assert cache.evict() == (0, 0)  # everything is pinned
        cache.unpin([a.hash, c.hash])
        await cache.ensure(d.hash, d.size, d.location)
        assert cache.contains(d.hash)
    assert tmp_files(tmp_path / "c") == []


async def test_object_larger_than_cache_is_a_clean_error(
    tmp_path: Path, source: Source, backends: Backends
):
    big = source.add("big", os.urandom(5000))
    async with running(config(tmp_path / "c", size=4000), backends) as cache:
        with pytest.raises(CacheFull, match="larger than the whole cache"):
            await cache.ensure(big.hash, big.size, big.location)
        assert backends.gets() == 0
    assert store_files(tmp_path / "c") == {} and tmp_files(tmp_path / "c") == []


async def test_a_row_larger_than_the_cache_and_its_object_is_a_verify_failure(
    tmp_path: Path, source: Source, backends: Backends
):
    """A lying row (2^40 bytes naming a 3,000-byte object) is CorruptObject (EIO) on a cold
    cache as on a warm one, found out by one HEAD, not "raise --cache-size"."""
    small = source.add("small", os.urandom(3000))
    lying = Location(small.location.url, small.location.key, 0, 1 << 40)
    async with running(config(tmp_path / "c", size=4000), backends) as cache:
        with pytest.raises(CorruptObject, match="the object holds 3000: the digest row is damaged"):
            await cache.ensure(small.hash, 1 << 40, lying)
        assert backends.gets() == 0
        assert cache.counters.total.verify_failures == 1 and cache.counters.total.fill_errors == 0
    assert store_files(tmp_path / "c") == {} and tmp_files(tmp_path / "c") == []


async def test_evict_dataset_keeps_shared_content(
    tmp_path: Path, source: Source, backends: Backends
):
    x, y, z = source.many(3, 1000)
    async with running(config(tmp_path / "c"), backends) as cache:
        await cache.ensure(x.hash, x.size, x.location, "one")
        await cache.ensure(y.hash, y.size, y.location, "one")
        await cache.ensure(y.hash, y.size, y.location, "two")  # a hit, now shared
        await cache.ensure(z.hash, z.size, z.location, "two")
        assert cache.evict("one") == (1, 1000)
        assert [cache.contains(o.hash) for o in (x, y, z)] == [False, True, True]
        usage = cache.usage()["datasets"]
        assert "one" not in usage and usage["two"]["entries"] == 2
        assert cache.counters.dataset("one").evicted_files == 1
        assert cache.evict(None) == (2, 2000)
        assert store_files(tmp_path / "c") == {} and cache.used == 0


# -- disk full (ENOSPC) on a real, small tmpfs ------------------------------------------------


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 4 MiB tmpfs, always unmounted; skipped when not root or mounting fails."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    result = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)], capture_output=True, text=True
    )
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {result.stderr.strip() or result.returncode}")
    try:
        yield mnt
    finally:
        if subprocess.run(["umount", str(mnt)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


@pytest.mark.parametrize("fills", ["threads", "processes"])
@pytest.mark.parametrize("chunk_size", [8 << 20, 128 * 1024], ids=["one-chunk", "streamed"])
async def test_disk_full_evicts_and_succeeds(
    small_tmpfs: Path, source: Source, backends: Backends, chunk_size: int, fills: str
):
    objs = source.many(16, 512 * 1024)  # 8 MiB of content for a 4 MiB disk
    cache_dir = small_tmpfs / "c"
    cfg = config(cache_dir, size=100 << 20, chunk_size=chunk_size, fill_concurrency=2)
    async with running_with(fills, cfg, backends) as cache:
        for o in objs:
            path = await cache.ensure(o.hash, o.size, o.location)
            assert blake3.blake3(Path(path).read_bytes()).digest() == o.hash
        assert cache.counters.total.evicted_files > 0
        assert cache.counters.total.fill_errors == 0
        files = store_files(cache_dir)
        assert sum(files.values()) == cache.used and len(files) == cache.entries
        assert tmp_files(cache_dir) == []
        report = await cache.scrub()
        assert report.bad == 0 and report.missing == 0 and report.ok == len(files)


@pytest.mark.parametrize("fills", ["threads", "processes"])
@pytest.mark.parametrize("chunk_size", [8 << 20, 512 * 1024], ids=["one-chunk", "streamed"])
async def test_file_larger_than_disk_is_a_clean_error(
    small_tmpfs: Path, source: Source, backends: Backends, chunk_size: int, fills: str
):
    small = source.many(2, 100_000)
    huge = source.add("huge", os.urandom(5 << 20))
    cache_dir = small_tmpfs / "c"
    cfg = config(cache_dir, size=100 << 20, chunk_size=chunk_size)
    async with running_with(fills, cfg, backends) as cache:
        for o in small:
            await cache.ensure(o.hash, o.size, o.location)
        with pytest.raises(CacheFull, match="no space left"):
            await cache.ensure(huge.hash, huge.size, huge.location)
        assert not cache.contains(huge.hash)
        assert tmp_files(cache_dir) == []
        assert huge.hash.hex() not in store_files(cache_dir)
        assert cache.reserved == 0 and cache.used == sum(store_files(cache_dir).values())
        # The cache still works afterwards.
        again = source.add("after", os.urandom(1000))
        await cache.ensure(again.hash, again.size, again.location)


def _fill_disk(path: Path) -> Path:
    """Write a ballast file under ``path`` until its filesystem is full; the ballast."""
    ballast = path / "ballast"
    fd = os.open(ballast, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        with contextlib.suppress(OSError):
            while True:
                os.write(fd, b"\0" * 4096)
    finally:
        os.close(fd)
    return ballast


def test_a_pinned_row_that_cannot_be_written_counts_once_written(small_tmpfs: Path):
    """A row pinned before its batch was written counts in ``pinned_bytes`` (the room left
    for protection) only while it is in the table or about to be: on a full disk it waits
    unwritten and uncounted, and counts again once a retry writes it, pinned."""
    index = Index.open(small_tmpfs / "index.sqlite")
    try:
        row = b"\x03" * 32
        index.insert(b"\x01" * 32, 1000, "ds")
        index.flush()
        index.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")  # the log must grow for the next write
        ballast = _fill_disk(small_tmpfs)
        index.insert(row, 3000, "ds")
        assert index.set_pinned([row], True) == 1 and index.pinned_bytes == 3000
        index.flush()
        assert [r.hash for r in index.lost] == [row] and index.pinned_bytes == 0
        assert index.retry_lost() == 1 and index.pinned_bytes == 0
        ballast.unlink()
        assert index.retry_lost() == 0 and index.pinned_bytes == 3000
        assert index.conn.execute("SELECT pinned FROM entries WHERE hash=?", (row,)).fetchone() == (1,)
    finally:
        index.close()


def test_index_rows_wait_for_room_on_a_full_disk(small_tmpfs: Path):
    """SQLite needs room to delete rows and to write new ones. On a full disk a delete's
    rows are hidden and deleted later, and new rows stay visible until they can be written:
    neither is lost, nor raises."""
    index = Index.open(small_tmpfs / "index.sqlite")
    try:
        old, new = b"\x01" * 32, b"\x02" * 32
        index.insert(old, 1000, "ds")
        index.flush()
        index.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")  # the log must grow for the next write
        ballast = _fill_disk(small_tmpfs)
        assert index.delete([old]) is False
        assert index.size_of(old) is None and old in index.deleting
        assert list(index.least_recent()) == []
        index.insert(new, 2000, "ds")
        index.flush()
        assert [row.hash for row in index.lost] == [new] and index.size_of(new) == 2000
        assert index.retry_deletes() is False and index.retry_lost() == 1
        ballast.unlink()
        assert index.retry_deletes() is True and not index.deleting
        assert index.retry_lost() == 0 and index.lost == []
        assert index.conn.execute("SELECT hash, size FROM entries").fetchall() == [(new, 2000)]
    finally:
        index.close()


def test_sizes_known_in_memory_leave_with_their_files(tmp_path: Path, monkeypatch) -> None:
    """size_of answers hashes it has seen without a query (read-ahead asks about the same
    files again and again), and forgets each one the moment it leaves the store: deleted, or
    a lost row taken (its file removed). A memory that outlived the row would report a
    missing file as cached, and a read would then find no file."""
    import mountd.store.index as index_module

    monkeypatch.setattr(index_module, "KNOWN_SIZES", 3)
    index = Index.open(tmp_path / "index.sqlite")
    try:
        hashes = [bytes([i]) * 32 for i in range(5)]
        for i, h in enumerate(hashes):
            index.insert(h, 1000 + i, "ds")
        index.flush()
        assert list(index._known) == hashes[2:]  # the most recent 3
        queries: list[str] = []
        index._conn.set_trace_callback(queries.append)
        assert [index.size_of(h) for h in hashes[2:]] == [1002, 1003, 1004]
        assert index.size_of(hashes[0]) == 1000
        assert sum("SELECT size" in q for q in queries) == 1  # only the one forgotten
        assert index.size_of(hashes[0]) == 1000 and list(index._known) == [*hashes[3:], hashes[0]]
        assert sum("SELECT size" in q for q in queries) == 1  # learnt by its lookup
        index._conn.set_trace_callback(None)
        assert index.delete([hashes[0]]) is True
        assert index.size_of(hashes[0]) is None and hashes[0] not in index._known
        lost = b"\x09" * 32
        index.insert(lost, 77, "ds")
        index._unwritten.pop(lost)
        index._keep_lost(index_module.NewRow(lost, 77, "ds", None, index.now(), False))
        assert index.size_of(lost) == 77
        assert [row.hash for row in index.take_lost()] == [lost]
        assert index.size_of(lost) is None
    finally:
        index.close()


async def test_a_batch_whose_files_meet_a_full_disk_together_makes_room_for_each(
        small_tmpfs: Path, source: Source):
    """The files of a prefetch batch run side by side in a fill process; on a full disk
    several ask for room at once, each with its own ask (one ask per job used to be
    overwritten by the next: that file waited for ever), and every one lands."""
    earlier = source.many(12, 256 * 1024, prefix="earlier")  # 3 MiB of a 4 MiB disk
    batch = source.many(8, 256 * 1024, prefix="batch")
    cache_dir = small_tmpfs / "c"
    async with pooled(config(cache_dir, size=100 << 20)) as (cache, _):
        for o in earlier:
            await cache.ensure(o.hash, o.size, o.location)
        with trio.fail_after(30):
            cache.prefetch([(o.hash, o.size, o.location) for o in batch], "ds")
            await wait_until(lambda: all(cache.contains(o.hash) for o in batch), timeout=30,
                             what="the batch")
        assert cache.counters.stages.jobs == 12 + 1  # the earlier files one by one, one batch
        assert cache.counters.total.evicted_files > 0
        assert cache.counters.total.fill_errors == 0
        files = store_files(cache_dir)
        assert sum(files.values()) == cache.used and len(files) == cache.entries
        assert tmp_files(cache_dir) == []
        for o in batch:
            assert Path(cache.store_path(o.hash)).read_bytes() == o.data


# -- one fill that meets a full disk, against a gate that says what the main process would ---


class _Gate:
    """A fill's gate whose ``room`` runs ``make_room`` (what the main process does: free the
    bytes, or not) and says the room is there; counts the asks."""

    def __init__(self, make_room=lambda need: None) -> None:
        self.make_room = make_room
        self.asks: list[int] = []

    def room(self, need: int) -> bool:
        self.asks.append(need)
        self.make_room(need)
        return True

    def next_read(self, nbytes: int, remote: bool) -> None:
        pass


def _fill_one(cache_dir: Path, data: bytes, gate: _Gate) -> str | BaseException:
    """One file's fill (bytes already in memory) into ``cache_dir``; its path or error."""
    disk.prepare(cache_dir)
    target = Target(blake3.blake3(data).digest(), len(data), "file:///src", "f", 0, len(data))
    job = FillJob(target, source="bytes", data=data)
    return Store(cache_dir).fill(job, BytesReader(data), gate).results[0]


def test_a_fill_that_loses_the_room_made_for_it_again_and_again_still_lands(small_tmpfs: Path):
    """Fills that meet a full disk together each get room made and the first to write takes
    it: the room made for this one goes to others 12 times (a CI run's fill failed after 8
    such losses), then stays; the file lands whole."""
    cache_dir = small_tmpfs / "c"
    disk.prepare(cache_dir)
    ballast = _fill_disk(small_tmpfs)
    data = os.urandom(256 * 1024)

    def make_room(need: int) -> None:
        if len(gate.asks) > 12:  # others wrote theirs: this time the room stays
            os.truncate(ballast, max(0, ballast.stat().st_size - need - (64 << 10)))

    gate = _Gate(make_room)
    path = _fill_one(cache_dir, data, gate)
    assert not isinstance(path, BaseException), path
    assert Path(path).read_bytes() == data
    assert len(gate.asks) == 13 and set(gate.asks) == {len(data)}
    assert tmp_files(cache_dir) == []


def test_a_write_that_fails_with_the_room_free_fails_after_room_tries(tmp_path: Path,
                                                                      monkeypatch) -> None:
    """A quota (EDQUOT) fails the write however much the disk has free: evicting cannot help,
    so the file fails after ROOM_TRIES writes with the room there, not after ROOM_WAIT."""
    def over_quota(self, data, offset):
        raise OSError(errno.EDQUOT, "Disk quota exceeded (injected)")

    monkeypatch.setattr(disk.TempFile, "write_at", over_quota)
    monkeypatch.setattr(fillwork, "ROOM_WAIT", 60.0)
    gate = _Gate()
    started = time.monotonic()
    result = _fill_one(tmp_path / "c", b"x" * 5000, gate)
    assert isinstance(result, CacheFull) and "no space left" in str(result)
    assert len(gate.asks) == fillwork.ROOM_TRIES
    assert time.monotonic() - started < 30
    assert tmp_files(tmp_path / "c") == [] and store_files(tmp_path / "c") == {}


def test_a_fill_whose_room_others_always_take_fails_after_room_wait(small_tmpfs: Path,
                                                                     monkeypatch) -> None:
    """Room made and always taken by others (the disk never shows it free): the fill goes on
    asking for ROOM_WAIT seconds, then fails with CacheFull and leaves no temp file."""
    monkeypatch.setattr(fillwork, "ROOM_WAIT", 0.3)
    cache_dir = small_tmpfs / "c"
    disk.prepare(cache_dir)
    _fill_disk(small_tmpfs)
    gate = _Gate(lambda need: time.sleep(0.01))
    started = time.monotonic()
    result = _fill_one(cache_dir, os.urandom(100_000), gate)
    assert isinstance(result, CacheFull), result
    assert 0.3 <= time.monotonic() - started < 10
    assert len(gate.asks) > fillwork.ROOM_TRIES  # losses are not tries
    assert tmp_files(cache_dir) == [] and store_files(cache_dir) == {}
