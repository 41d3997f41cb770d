"""Prefetch protection (mountd/store/holds.py, docs/store-layout.md "Holds and protection").

Files fetched ahead for a job (``Cache.fetch_now`` with an owner, the prefetch queue) are kept
from policy eviction until read, released by their owner, or timed out; new prefetches wait
when the protection share is full; on-demand misses never wait for protection and never get
``CacheFull`` for its sake. Real cache, real SQLite index, real ``file://`` fills."""

from __future__ import annotations

from pathlib import Path

import trio

from mountd.store.holds import Holds
from tests.mountd.conftest import Backends, Obj, Source, config, running

K = 1000  # bytes per object: a cache of 5 K holds five


def items(objs: list[Obj]) -> list:
    return [(o.hash, o.size, o.location) for o in objs]


async def landed(cache, objs: list[Obj]) -> None:
    with trio.fail_after(20):
        while not all(cache.contains(o.hash) for o in objs):
            await trio.sleep(0.005)


def stored(tmp: Path, o: Obj) -> bytes:
    from mountd.store import layout

    return layout.store_path(tmp / "c", o.hash).read_bytes()


def test_protections_end_by_read_owner_time_and_stay_within_their_bytes() -> None:
    async def main() -> None:
        holds = Holds(max_bytes=100, protect_bytes=30, protect_seconds=10.0)
        a, b, c, d = (bytes([n]) * 32 for n in b"abcd")
        assert holds.fits(10) and holds.room() == 30
        holds.protect(a, 10, "job1")
        holds.protect(b, 10, "job1")
        holds.protect(b, 10, "job2")  # two owners: both must let go
        holds.protect(c, 10)
        assert holds.protected_bytes == 30 and not holds.fits(1) and holds.room() == 0
        assert holds.consumed([a, d]) == 1 and not holds.protected(a)
        assert holds.release("job1") == 0  # b is still job2's
        assert holds.protected(b) and holds.release("job2") == 1 and not holds.protected(b)
        await trio.sleep(10.5)
        assert not holds.protected(c) and holds.protected_count() == 0
        assert holds.ended == {"read": 1, "released": 1, "timeout": 1, "demand": 0, "removed": 0}
        assert holds.fits(10**9)  # nothing protected: even an oversized one may start

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_a_protection_cut_short_ends_at_its_new_deadline_and_a_renewal_undoes_the_cut() -> None:
    """A chunk's eviction keeps its protected files for a few seconds more (Holds.shorten):
    they end then, ahead of older protections, and free their bytes; one protected again
    meanwhile keeps its new full term."""

    async def main() -> None:
        holds = Holds(max_bytes=100, protect_bytes=100, protect_seconds=30.0)
        old, cut, renewed, later = (bytes([n]) * 32 for n in b"ocrl")
        holds.protect(old, 10)
        await trio.sleep(1)
        for content_hash in (cut, renewed, later):
            holds.protect(content_hash, 10)
        assert holds.shorten([cut, renewed, bytes(32)], 5.0) == 2  # unprotected: not cut
        assert holds.shorten([cut], 10.0) == 0  # never lengthened
        assert holds.next_protection_deadline() == trio.current_time() + 5.0
        await trio.sleep(2)
        holds.protect(renewed, 10)  # given again: a full term from now
        await trio.sleep(3.5)
        assert not holds.protected(cut) and holds.protected(renewed) and holds.protected(old)
        assert holds.protected_count() == 3 and holds.protected_bytes == 30
        assert holds.ended["timeout"] == 1
        await trio.sleep(30)
        assert holds.protected_count() == 0 and holds.ended["timeout"] == 4

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_protections_count_their_bytes_started_and_ended_by_reason() -> None:
    """What ``quiverfs stats`` shows as fetched ahead, read, unread now and dropped unread."""

    async def main() -> None:
        holds = Holds(max_bytes=10**9, protect_seconds=10.0)
        read, mine, gone, taken, renewed, old, now = (bytes([n]) * 32 for n in b"rmgtnoc")
        holds.protect(old, 7_000)
        await trio.sleep(5)
        for content_hash, size in ((read, 100), (mine, 2_000), (gone, 30_000), (taken, 500),
                                   (renewed, 40), (now, 1)):
            holds.protect(content_hash, size, "job" if content_hash == mine else None)
        holds.protect(renewed, 40)  # renewed: not started again
        assert holds.consumed([read]) == 1
        assert holds.release("job") == 1
        assert holds.forget([gone]) == 1  # left the store, or its fill failed
        assert holds.forget([taken], "demand") == 1
        await trio.sleep(5.5)  # old times out; the others were protected 5 s after it
        snap = holds.snapshot()
        assert snap["started"] == 7 and snap["started_bytes"] == 39_641
        assert snap["ended"] == {"read": 1, "released": 1, "timeout": 1, "demand": 1, "removed": 1}
        assert snap["ended_bytes"] == {"read": 100, "released": 2_000, "timeout": 7_000,
                                       "demand": 500, "removed": 30_000}
        assert (snap["files"], snap["bytes"]) == (2, 41)  # renewed and now, unread so far
        assert snap["started_bytes"] == sum(snap["ended_bytes"].values()) + snap["bytes"]

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


async def test_protected_files_survive_eviction_pressure_until_read(
    tmp_path: Path, source: Source, backends: Backends
) -> None:
    ahead = source.many(2, K, "ahead")
    others = source.many(6, K, "other")
    async with running(config(tmp_path / "c", size=5 * K), backends) as cache:
        cache.holds.seconds = 0.01  # answer holds out of the way
        assert cache.fetch_now(items(ahead), "ds", owner=("ds", "job", 0)) == 2
        await landed(cache, ahead)
        for o in others:  # six misses through a cache of five: plain LRU took `ahead` first
            assert Path(await cache.ensure(o.hash, o.size, o.location, "ds")).read_bytes() == o.data
            await trio.sleep(0.02)
        assert [cache.contains(o.hash) for o in ahead] == [True, True]
        assert [stored(tmp_path, o) for o in ahead] == [o.data for o in ahead]
        assert sum(cache.contains(o.hash) for o in others) == 3
        assert cache.counters.snapshot()["total"]["evicted_files"] == 3
        cache.record_hits("ds", [ahead[0].hash], K)  # read: plain LRU from now on
        assert not cache.holds.protected(ahead[0].hash) and cache.holds.protected(ahead[1].hash)
        extra = source.add("extra", b"x" * K)
        await cache.ensure(extra.hash, extra.size, extra.location, "ds")
        await trio.sleep(0.02)
        more = source.add("more", b"y" * K)
        await cache.ensure(more.hash, more.size, more.location, "ds")
        assert cache.contains(ahead[1].hash)
        assert cache.usage()["protection"]["ended"]["read"] == 1


async def test_protection_ends_when_its_owner_goes_or_its_time_is_up(
    tmp_path: Path, source: Source, backends: Backends
) -> None:
    mine, theirs = source.many(1, K, "mine"), source.many(1, K, "theirs")
    async with running(config(tmp_path / "c", size=5 * K, protect_seconds=0.3), backends) as cache:
        cache.fetch_now(items(mine), "ds", owner="pool-a")
        cache.fetch_now(items(theirs), "ds", owner="pool-b")
        await landed(cache, mine + theirs)
        assert cache.usage()["protection"]["files"] == 2
        assert cache.release_protection("pool-a") == 1
        assert not cache.holds.protected(mine[0].hash) and cache.holds.protected(theirs[0].hash)
        with trio.fail_after(5):
            while cache.holds.protected(theirs[0].hash):
                await trio.sleep(0.02)
        snap = cache.usage()["protection"]
        assert snap["files"] == 0 and snap["ended"]["released"] == 1
        assert snap["ended"]["timeout"] == 1
        # unprotected now: ordinary LRU victims
        fill = source.many(5, K, "fill")
        for o in fill:
            await cache.ensure(o.hash, o.size, o.location, "ds")
        assert not cache.contains(mine[0].hash) and not cache.contains(theirs[0].hash)


async def test_new_prefetches_wait_while_protection_is_full_then_start_as_reads_free_room(
    tmp_path: Path, source: Source, backends: Backends
) -> None:
    objs = source.many(4, K, "p")
    # share 0.4 of 5 K: room for two protected files
    async with running(config(tmp_path / "c", size=5 * K, protect_share=0.4), backends) as cache:
        assert cache.fetch_now(items(objs), "ds", owner="job") == 2
        await landed(cache, objs[:2])
        await trio.sleep(0.1)
        assert not cache.contains(objs[2].hash) and not cache.contains(objs[3].hash)
        assert cache.usage()["protection"]["waiting"] == 2
        assert cache.counters.snapshot()["total"]["evicted_files"] == 0
        # What claims see: the waiting ones take the room first, and count as the owner's.
        assert cache.holds.room() == 0 and cache.protect_room() == 0
        assert cache.protect_pending("job") == 4 and cache.protect_pending("other") == 0
        cache.record_hits("ds", [objs[0].hash], K)  # one read: one more may start
        await landed(cache, objs[:3])
        await trio.sleep(0.1)
        assert not cache.contains(objs[3].hash)
        assert cache.protect_pending("job") == 3
        cache.record_hits("ds", [objs[1].hash], K)
        await landed(cache, objs)
        assert cache.usage()["protection"]["waiting"] == 0
        assert cache.protect_pending("job") == 2
        assert [stored(tmp_path, o) for o in objs] == [o.data for o in objs]
        # the mounts' prefetch queue pauses the same way
        queued = source.many(3, K, "q")
        cache.record_hits("ds", [objs[2].hash], K)  # room for one: objs[3] + one queued
        assert cache.prefetch(items(queued), "ds") == 3
        with trio.fail_after(20):  # the workers take them in no fixed order
            while not any(cache.contains(o.hash) for o in queued):
                await trio.sleep(0.005)
        await trio.sleep(0.1)
        first = [o for o in queued if cache.contains(o.hash)]
        assert len(first) == 1
        cache.record_hits("ds", [objs[3].hash, first[0].hash], 2 * K)
        await landed(cache, queued)
        # Fetched ahead: 7 files; read: 5; the other two queued ones are unread, protected.
        snap = cache.usage()["protection"]
        assert (snap["started"], snap["started_bytes"]) == (7, 7 * K)
        assert (snap["ended"]["read"], snap["ended_bytes"]["read"]) == (5, 5 * K)
        assert (snap["files"], snap["bytes"]) == (2, 2 * K)


async def test_on_demand_misses_proceed_when_everything_is_protected(
    tmp_path: Path, source: Source, backends: Backends
) -> None:
    """A reader never waits for protection: it takes the room of the newest protections
    (whose readers come last), and those files wait to be fetched again as reads free room,
    so the job that was given them still finds them cached."""
    ahead = source.many(5, K, "ahead")
    readers = source.many(3, K, "read")
    async with running(config(tmp_path / "c", size=5 * K, protect_share=1.0), backends) as cache:
        # Readers' files stay held (their clients have not opened them): only protected
        # files are left to evict. (A fetch that finds a held file first in line sleeps
        # until that hold ends: keep it short.)
        cache.holds.seconds = 2.0
        for o in ahead:  # one at a time: the newest protection is ahead[4]
            cache.fetch_now(items([o]), "ds", owner="job")
            await landed(cache, [o])
        assert cache.usage()["protection"]["bytes"] == 5 * K == cache.used
        for o in readers:  # a reader never waits for protection, never gets CacheFull
            with trio.fail_after(5):
                path = await cache.ensure(o.hash, o.size, o.location, "ds")
            assert Path(path).read_bytes() == o.data
        # the newest protections ended, the oldest stand
        assert [cache.contains(o.hash) for o in ahead] == [True, True, False, False, False]
        assert cache.usage()["protection"]["ended"]["demand"] == 3
        assert cache.holds.protected(ahead[0].hash) and cache.holds.protected(ahead[1].hash)
        # the job still has five files coming: two protected, three to be fetched again
        assert cache.protect_pending("job") == 5
        gets = cache.counters.total.remote_requests["GET"]
        # The job reads its two, and holds keep at most half the cache (the first reader's
        # ended): that room goes to the three displaced files, fetched again for the job
        # (the first of them once the hold it met has run out).
        cache.record_hits("ds", [ahead[0].hash, ahead[1].hash], 2 * K)
        await landed(cache, ahead[2:])
        await trio.sleep(0.1)
        assert cache.counters.total.remote_requests["GET"] == gets + 3
        assert all(cache.holds.protected(o.hash) for o in ahead[2:])
        assert [stored(tmp_path, o) for o in ahead[2:]] == [o.data for o in ahead[2:]]
        assert cache.used <= 5 * K  # the room came from files read or no longer held
        assert cache.usage()["protection"]["waiting"] == 0


async def test_files_protected_for_nobody_are_not_fetched_again_when_displaced(
    tmp_path: Path, source: Source, backends: Backends
) -> None:
    """The mounts' read-ahead protects for nobody in particular: a reader that takes its
    room lets those files go (no job was given them)."""
    ahead = source.many(2, K, "ahead")
    reader = source.many(1, K, "read")[0]
    async with running(config(tmp_path / "c", size=2 * K, protect_share=1.0), backends) as cache:
        cache.holds.seconds = 1.0
        cache.fetch_now(items(ahead), "ds")  # no owner
        await landed(cache, ahead)
        await cache.ensure(reader.hash, reader.size, reader.location, "ds")
        assert [cache.contains(o.hash) for o in ahead] == [True, False]
        assert cache.usage()["protection"]["waiting"] == 0
        await trio.sleep(1.2)  # the reader's hold is over: room, and still nobody fetches it
        assert not cache.contains(ahead[1].hash)
        assert cache.counters.total.remote_requests["GET"] == 3


def test_displaced_protections_go_newest_first_with_what_fetches_them_again() -> None:
    async def main() -> None:
        holds = Holds(max_bytes=100, protect_bytes=100)
        a, b, c = (bytes([n]) * 32 for n in b"abc")
        holds.protect(a, 10, "job1", source="where a lies")
        holds.protect(b, 20, "job1")
        holds.protect(b, 20, "job2", source="where b lies")
        holds.protect(c, 30)
        assert [h for h, _ in holds.newest_protected()] == [c, b, a]
        out = holds.displace([b, a])
        assert [(d.hash, d.size, d.owners, d.source) for d in out] == [
            (b, 20, frozenset({"job1", "job2"}), "where b lies"),
            (a, 10, frozenset({"job1"}), "where a lies"),
        ]
        assert holds.ended["demand"] == 2 and holds.protected_bytes == 30
        assert holds.owned("job1") == 0 and holds.displace([a]) == []

    trio.run(main)


async def test_every_answer_holds_and_counts_as_a_read(
    tmp_path: Path, source: Source, backends: Backends
) -> None:
    a, b = source.many(2, K, "a")
    async with running(config(tmp_path / "c", size=5 * K), backends) as cache:
        cache.fetch_now(items([a, b]), "ds", owner="job")
        await landed(cache, [a, b])
        assert cache.holds.protected(a.hash) and a.hash not in cache.holds
        await cache.ensure(a.hash, a.size, a.location, "ds")  # a hit answered
        assert not cache.holds.protected(a.hash) and a.hash in cache.holds
        holder = object()
        assert await cache.lease(b.hash, b.size, "ds", holder) is not None  # a lease answered
        assert not cache.holds.protected(b.hash) and b.hash in cache.holds


async def test_a_prefetch_that_finds_no_room_is_dropped_not_a_fill_error(
    tmp_path: Path, source: Source, backends: Backends
) -> None:
    pinned = source.many(3, K, "pinned")
    ahead = source.many(2, K, "ahead")
    late = source.many(1, K, "late")
    async with running(config(tmp_path / "c", size=5 * K, protect_share=1.0), backends) as cache:
        cache.holds.seconds = 0.01  # answer holds out of the way
        for o in pinned:
            await cache.ensure(o.hash, o.size, o.location, "ds")
        cache.fetch_now(items(ahead), "ds", owner="job")
        await landed(cache, ahead)
        await trio.sleep(0.05)
        assert cache.usage()["protection"]["bytes"] == 2 * K and cache.used == 5 * K
        # The share has room for a third when it starts; pins taken before its fill runs
        # leave the cache nothing but pinned and protected files, and a prefetch nobody waits
        # for may not end another job's protection: dropped.
        assert cache.fetch_now(items(late), "ds", owner="job2") == 1
        cache.pin([o.hash for o in pinned])
        with trio.fail_after(5):
            while cache.counters.total.prefetches_dropped == 0:
                await trio.sleep(0.01)
        snap = cache.counters.snapshot()
        assert snap["total"]["prefetches_dropped"] == 1 and snap["total"]["fill_errors"] == 0
        assert snap["datasets"]["ds"]["prefetches_dropped"] == 1
        assert not cache.contains(late[0].hash)
        assert all(cache.contains(o.hash) for o in pinned + ahead)
        # the reader that comes for it fills it on demand (ending the oldest protection)
        path = await cache.ensure(late[0].hash, late[0].size, late[0].location, "ds")
        assert Path(path).read_bytes() == late[0].data
        assert cache.usage()["protection"]["ended"]["demand"] == 1


async def test_protection_takes_its_share_of_the_room_pins_leave(
    tmp_path: Path, source: Source, backends: Backends
) -> None:
    """With chunks pinned, a share of the whole cache let prefetches protect all of the rest,
    and every read on demand then ended a protection (docs/store-layout.md "Budget")."""
    pinned = source.many(6, K, "pinned")
    ahead = source.many(3, K, "ahead")
    async with running(config(tmp_path / "c", size=10 * K, protect_share=0.5), backends) as cache:
        assert cache.holds.protect_bytes == 5 * K
        for o in pinned:
            await cache.ensure(o.hash, o.size, o.location, "ds")
        assert cache.pin([o.hash for o in pinned]) == 6
        assert cache.index.pinned_bytes == 6 * K
        assert cache.holds.protect_bytes == 2 * K  # half of the 4 K left
        assert cache.pin([pinned[0].hash]) == 1 and cache.index.pinned_bytes == 6 * K  # no change
        assert cache.fetch_now(items(ahead), "ds", owner="job") == 2
        await landed(cache, ahead[:2])
        await trio.sleep(0.1)
        assert not cache.contains(ahead[2].hash) and cache.usage()["protection"]["waiting"] == 1
        cache.unpin([o.hash for o in pinned[:2]])  # more room: the waiting one starts
        assert cache.index.pinned_bytes == 4 * K and cache.holds.protect_bytes == 3 * K
        await landed(cache, ahead)
        assert [stored(tmp_path, o) for o in ahead] == [o.data for o in ahead]
        # A pinned row that goes (an admin's evict unpins first; scrub drops bad rows) leaves
        # the count: the index and the cap agree with the table.
        cache.unpin([o.hash for o in pinned[2:]])
        assert cache.index.pinned_bytes == 0 and cache.holds.protect_bytes == 5 * K
        cache.pin([pinned[5].hash])
        cache._drop_entries([pinned[5].hash], reason="missing")
        assert cache.index.pinned_bytes == 0 and cache.holds.protect_bytes == 5 * K
    # Pins are durable: a restart sizes the cap from the table.
    async with running(config(tmp_path / "c", size=10 * K, protect_share=0.5), backends) as cache:
        cache.pin([o.hash for o in pinned[2:5]])
        assert cache.index.pinned_bytes == 3 * K
    async with running(config(tmp_path / "c", size=10 * K, protect_share=0.5), backends) as cache:
        assert cache.index.pinned_bytes == 3 * K and cache.holds.protect_bytes == 3500


async def test_pins_expected_for_a_loading_chunk_count_before_their_files_land(
    tmp_path: Path, source: Source, backends: Backends
) -> None:
    """While a chunk loads, its slot's room is taken already: the cap must not grow into it
    (prefetches filled it and the chunk's own fills waited; docs/store-layout.md "Budget")."""
    chunk = source.many(4, K, "chunk")
    ahead = source.many(4, K, "ahead")
    async with running(config(tmp_path / "c", size=10 * K, protect_share=0.5), backends) as cache:
        cache.expect_pins([(o.hash, o.size) for o in chunk])
        cache.expect_pins([(chunk[0].hash, K)])  # named twice: counted once
        assert cache.holds.protect_bytes == 3 * K  # half of the 6 K the chunk leaves
        await cache.ensure(chunk[0].hash, K, chunk[0].location, "ds")
        assert cache.pin([chunk[0].hash]) == 1  # landed and pinned: expected no longer
        assert cache.index.pinned_bytes == K and cache.holds.protect_bytes == 3 * K
        assert cache.fetch_now(items(ahead), "ds", owner="job") == 3
        await landed(cache, ahead[:3])
        await trio.sleep(0.1)
        assert not cache.contains(ahead[3].hash) and cache.usage()["protection"]["waiting"] == 1
        cache.unpin([o.hash for o in chunk])  # the chunk went: its expected pins with it
        assert cache.index.pinned_bytes == 0 and cache.holds.protect_bytes == 5 * K
        await landed(cache, ahead)
        assert [stored(tmp_path, o) for o in ahead] == [o.data for o in ahead]


async def test_a_renewed_prefetch_protects_cached_files_and_keeps_them_protected(
    tmp_path: Path, source: Source, backends: Backends
) -> None:
    # A mount's bounded sweep (docs/mount.md "The sweep"): files in the store its reader has
    # yet to read are protected at its asking, and stay so while it renews them.
    cached = source.many(3, K, "cached")
    absent = source.many(1, K, "absent")
    async with running(config(tmp_path / "c", size=10 * K, protect_seconds=0.4), backends) as cache:
        for o in cached:
            await cache.ensure(o.hash, o.size, o.location, "ds")
        assert cache.prefetch(items(cached), "ds") == 0  # cached: skipped, not protected
        assert not any(cache.holds.protected(o.hash) for o in cached)
        # With renew: the cached ones protected (at the store's size, not the one asked),
        # the absent one queued as before.
        asked = [(o.hash, 99 * K, o.location) for o in cached] + items(absent)
        assert cache.prefetch(asked, "ds", renew=True) == 1
        assert all(cache.holds.protected(o.hash) for o in cached)
        await landed(cache, absent)
        assert cache.holds.protected(absent[0].hash)
        assert cache.usage()["protection"]["bytes"] == 4 * K
        for _ in range(4):  # renewed every 0.2 s: still protected after 0.8 s
            await trio.sleep(0.2)
            cache.prefetch(items(cached[:2]), "ds", renew=True)
        assert [cache.holds.protected(o.hash) for o in cached] == [True, True, False]
        assert not cache.holds.protected(absent[0].hash)
        cache.record_hits("ds", [cached[0].hash], K)  # read: its protection ends
        assert not cache.holds.protected(cached[0].hash)
        assert cache.usage()["protection"]["ended"]["read"] == 1


async def test_a_renewal_protects_no_new_file_past_the_sweeps_share(
    tmp_path: Path, source: Source, backends: Backends
) -> None:
    # A sweep's files may take SWEEP_SHARE (0.8) of the room, other prefetches --protect-share.
    cached = source.many(10, K, "cached")
    async with running(config(tmp_path / "c", size=10 * K, protect_share=0.2), backends) as cache:
        for o in cached:
            await cache.ensure(o.hash, o.size, o.location, "ds")
        assert (cache.holds.protect_bytes, cache.holds.sweep_bytes) == (2 * K, 8 * K)
        cache.prefetch(items(cached), "ds", renew=True)  # room for 8 K of the 10 K
        assert [cache.holds.protected(o.hash) for o in cached] == [True] * 8 + [False] * 2
        cache.prefetch(items(cached), "ds", renew=True)  # the eight renewed, no ninth
        assert [cache.holds.protected(o.hash) for o in cached] == [True] * 8 + [False] * 2
        assert not cache.holds.fits(K)  # a claim's or read-ahead's prefetch waits
        assert cache.usage()["protection"]["sweep_cap_bytes"] == 8 * K


async def test_files_a_reader_is_done_with_are_evicted_first(
    tmp_path: Path, source: Source, backends: Backends
) -> None:
    # A shuffled reader's epochs over a larger dataset: LRU would evict the files it read
    # an epoch ago, those it reads next; the ones it read this epoch go first instead.
    old = source.many(3, K, "old")  # read last epoch, not yet this one
    now = source.many(2, K, "now")  # read this epoch
    async with running(config(tmp_path / "c", size=5 * K), backends) as cache:
        cache.holds.seconds = 0.01  # answer holds out of the way
        for o in old + now:
            await cache.ensure(o.hash, o.size, o.location, "ds")
            await trio.sleep(0.02)
        cache.record_read_done([o.hash for o in now] + [b"\0" * 32])  # an unknown one: ignored
        fresh = source.many(2, K, "fresh")
        for o in fresh:
            await cache.ensure(o.hash, o.size, o.location, "ds")
            await trio.sleep(0.02)
        assert [cache.contains(o.hash) for o in old] == [True, True, True]
        assert [cache.contains(o.hash) for o in now] == [False, False]


async def test_a_sweeps_prefetches_wait_for_the_sweeps_share_not_protect_share(
    tmp_path: Path, source: Source, backends: Backends
) -> None:
    plain, swept = source.many(4, K, "plain"), source.many(5, K, "swept")
    async with running(config(tmp_path / "c", size=10 * K, protect_share=0.2), backends) as cache:
        assert cache.prefetch(items(plain), "ds") == 4
        await landed(cache, plain[:2])
        await trio.sleep(0.3)  # the other two wait for --protect-share's 2 K
        assert sum(cache.contains(o.hash) for o in plain) == 2
        assert cache.prefetch(items(swept), "ds", renew=True) == 5
        await landed(cache, swept)  # up to the sweep's 8 K: 2 K + 5 K
        assert all(cache.holds.protected(o.hash) for o in swept)
        assert sum(cache.contains(o.hash) for o in plain) == 2


def test_kept_hits_are_counted_apart_from_files_fetched_ahead_but_share_the_cap() -> None:
    """A claim's hits kept for their reader (``kept``) fetched nothing: ``quiverfs stats``
    shows them on a line of their own, while both kinds fill the protection share."""

    async def main() -> None:
        holds = Holds(max_bytes=100, protect_bytes=30, protect_seconds=10.0)
        fetched, hit, other = (bytes([n]) * 32 for n in b"fho")
        holds.protect(fetched, 10, "job")
        holds.protect(hit, 15, "job", kept=True)
        holds.protect(hit, 15, "job2")  # protected again: keeps the kind it started with
        assert holds.protected_bytes == 25 and not holds.fits(10) and holds.fits(5)
        snap = holds.snapshot()
        assert (snap["started"], snap["files"], snap["bytes"]) == (1, 1, 10)
        kept = snap["kept"]
        assert (kept["started"], kept["started_bytes"], kept["files"], kept["bytes"]) == (1, 15, 1, 15)
        assert holds.consumed([hit, other]) == 1
        assert holds.release("job") == 1  # the fetched one: its only owner let go
        snap = holds.snapshot()
        assert snap["ended"]["released"] == 1 and snap["ended"]["read"] == 0
        assert snap["kept"]["ended"]["read"] == 1 and snap["kept"]["ended_bytes"]["read"] == 15
        assert (snap["kept"]["files"], snap["files"], holds.protected_bytes) == (0, 0, 0)

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


async def test_a_claims_hits_are_kept_until_opened_once_the_mounts_report_opens(
    tmp_path: Path, source: Source, backends: Backends
) -> None:
    """``protect_hits`` keeps cached, unpinned files for their owner, but only for a dataset
    whose mounts report opens (nothing else would end it: a hit is read from the kernel's
    pages); an open ends it, and policy eviction passes over it until then."""
    hits = source.many(3, K, "hit")
    others = source.many(4, K, "other")
    async with running(config(tmp_path / "c", size=5 * K), backends) as cache:
        cache.holds.seconds = 0.01  # answer holds out of the way
        for o in hits:
            await cache.ensure(o.hash, o.size, o.location, "ds")
        cache.pin([hits[2].hash])
        owner = ("ds", "job", 1)
        assert cache.protect_hits(items(hits), "ds", owner=owner) == 0  # no opens seen yet
        cache.record_opened("other-ds", [])  # another dataset's mounts: not this one's
        assert cache.protect_hits(items(hits), "ds", owner=owner) == 0
        cache.record_opened("ds", [])
        uncached = source.add("uncached", b"u" * K)
        assert cache.protect_hits(items(hits) + items([uncached]), "ds", owner=owner) == 2
        assert cache.usage()["protection"]["kept"]["files"] == 2  # not the pinned one
        await trio.sleep(0.02)
        for o in others:  # four misses through a cache of five: LRU took the hits first
            assert Path(await cache.ensure(o.hash, o.size, o.location, "ds")).read_bytes() == o.data
            await trio.sleep(0.02)
        assert all(cache.contains(o.hash) for o in hits)
        cache.record_opened("ds", [hits[0].hash])
        protection = cache.usage()["protection"]
        assert protection["kept"]["ended"]["read"] == 1 and protection["kept"]["files"] == 1
        assert protection["started"] == 0  # nothing was fetched ahead
        extra = source.add("extra", b"x" * K)
        await cache.ensure(extra.hash, extra.size, extra.location, "ds")
        assert not cache.contains(hits[0].hash) and cache.contains(hits[1].hash)
