"""The per-user quota of the shared cache (mountd/store/quota.py): who each entry is charged
to, which entries a user over its quota loses, what survives a reopen, and what is refused."""

from __future__ import annotations

import errno
import os
import sqlite3
import threading
from functools import partial
from pathlib import Path

import pytest
import trio
import trio.testing

from mountd.errors import QuotaExceeded
from mountd.store import layout
from mountd.store.cache import Cache, SuppliedBytes
from quiverfs.base.errors import errno_for
from tests.mountd.conftest import Backends, Obj, Source, config, running, store_files, wait_until

A, B = 1001, 1002  # two users' uids (nothing here needs them to exist)


def supplied(data: bytes, holder: object | None = None) -> SuppliedBytes:
    """A memfd holding ``data``, as another user's mount supplies it."""
    fd = os.memfd_create("test-quota", os.MFD_CLOEXEC)
    os.pwrite(fd, data, 0)
    return SuppliedBytes(fd, 0, holder)


def owners_on_disk(cache_dir: Path) -> dict[bytes, int]:
    """The index's ``owners`` table, read from the file."""
    with sqlite3.connect(layout.index_path(cache_dir)) as db:
        return dict(db.execute("SELECT hash, uid FROM owners"))


def simulate_crash(cache_dir: Path) -> None:
    """Leave the index as a killed mountd would: not marked clean (open reconciles)."""
    with sqlite3.connect(layout.index_path(cache_dir)) as db:
        db.execute("UPDATE meta SET value='0' WHERE key='clean'")


def cached(cache: Cache, objs: list[Obj]) -> list[bool]:
    return [cache.contains(o.hash) for o in objs]


def charged(cache: Cache, uid: int) -> tuple[int, int]:
    """(entries, bytes) charged to ``uid``."""
    row = cache.charges.snapshot([uid])[uid]
    return row["cached_files"], row["cached_bytes"]


async def test_fills_are_charged_to_the_requester_or_supplier_and_hits_move_nothing(
    tmp_path: Path, source: Source, backends: Backends
):
    a_objs = source.many(3, 1000, "a")
    b_objs = source.many(2, 2000, "b")
    mine = source.add("mountd-own", os.urandom(500))
    async with running(config(tmp_path / "c"), backends) as cache:
        for o in a_objs:
            await cache.ensure(o.hash, o.size, o.location, "ds", uid=A)
        for o in b_objs:
            await cache.ensure_supplied(o.hash, o.size, o.location, supplied(o.data), "ds", uid=B)
        await cache.ensure(mine.hash, mine.size, mine.location)  # nobody's (no uid)
        # Hits, by hash or reported, by the other user: the charge stays where it is.
        await cache.ensure_supplied(a_objs[0].hash, a_objs[0].size, a_objs[0].location,
                                    supplied(a_objs[0].data), "ds", uid=B)
        await cache.ensure(b_objs[0].hash, b_objs[0].size, b_objs[0].location, uid=A)
        cache.record_hits("ds", [a_objs[1].hash, b_objs[1].hash], 3000)
        assert charged(cache, A) == (3, 3000)
        assert charged(cache, B) == (2, 4000)
        assert cache.charges.snapshot() == {
            A: {"cached_files": 3, "cached_bytes": 3000, "quota": None,
                "quota_evicted_files": 0, "quota_evicted_bytes": 0},
            B: {"cached_files": 2, "cached_bytes": 4000, "quota": None,
                "quota_evicted_files": 0, "quota_evicted_bytes": 0},
        }
        assert cache.used == 3000 + 4000 + 500
        assert backends.gets() == 4  # A's three and mountd's own; B's bytes were supplied
        assert cache.evict("ds") == (5, 7000)
        assert cache.charges.snapshot() == {}
    assert owners_on_disk(tmp_path / "c") == {}


async def test_a_lease_is_charged_to_the_user_who_supplies_it(
    tmp_path: Path, source: Source, backends: Backends
):
    obj = source.add("x", os.urandom(3000))
    holder = object()
    async with running(config(tmp_path / "c", user_quota=10_000), backends) as cache:
        assert await cache.lease(obj.hash, obj.size, "ds", holder=holder, uid=B) is None
        path = await cache.ensure_supplied(obj.hash, obj.size, obj.location,
                                           supplied(obj.data, holder=holder), "ds", uid=B)
        assert Path(path).read_bytes() == obj.data
        assert charged(cache, B) == (1, 3000)
        assert charged(cache, A) == (0, 0)
    assert owners_on_disk(tmp_path / "c") == {obj.hash: B}


async def test_a_user_over_its_quota_loses_its_own_oldest_entries_and_nobody_elses(
    tmp_path: Path, source: Source, backends: Backends
):
    size = 1000
    b_objs = source.many(3, size, "b")  # the oldest entries of the whole cache
    a_objs = source.many(5, size, "a")
    cache_dir = tmp_path / "c"
    async with running(config(cache_dir, size=100 * size, user_quota=3 * size), backends) as cache:
        for o in b_objs:
            await cache.ensure_supplied(o.hash, o.size, o.location, supplied(o.data), "ds", uid=B)
        for o in a_objs:
            await cache.ensure(o.hash, o.size, o.location, "ds", uid=A)
            assert cache.charges.bytes[A] <= 3 * size
        assert cached(cache, a_objs) == [False, False, True, True, True]
        assert cached(cache, b_objs) == [True, True, True]
        assert set(store_files(cache_dir)) == {o.hash.hex() for o in a_objs[2:] + b_objs}
        assert charged(cache, A) == (3, 3 * size)
        assert charged(cache, B) == (3, 3 * size)
        snap = cache.charges.snapshot()
        assert (snap[A]["quota_evicted_files"], snap[A]["quota_evicted_bytes"]) == (2, 2 * size)
        assert (snap[B]["quota_evicted_files"], snap[B]["quota"]) == (0, 3 * size)
        assert cache.counters.total.evicted_files == 2  # counted as evictions, too
        assert cache.used == 6 * size
    assert owners_on_disk(cache_dir) == {**{o.hash: A for o in a_objs[2:]},
                                         **{o.hash: B for o in b_objs}}


async def test_a_user_loses_its_least_recently_used_entry_whoever_used_the_others(
    tmp_path: Path, source: Source, backends: Backends
):
    a, b, c, d, e, f = source.many(6, 1000, "a")
    async with running(config(tmp_path / "c", user_quota=3000), backends) as cache:
        for o in (a, b, c):
            await cache.ensure(o.hash, o.size, o.location, uid=A)
        cache.record_hits(None, [a.hash], 1000)  # a is now newer than b and c
        await cache.ensure(d.hash, d.size, d.location, uid=A)  # evicts b
        assert cached(cache, [a, b, c, d]) == [True, False, True, True]
        # Another user's hit refreshes c (it stays A's): the oldest of A's is now a.
        await cache.ensure_supplied(c.hash, c.size, c.location, supplied(c.data), uid=B)
        await cache.ensure(e.hash, e.size, e.location, uid=A)  # evicts a
        assert cached(cache, [a, c, d, e]) == [False, True, True, True]
        await cache.ensure(f.hash, f.size, f.location, uid=A)  # evicts d (c was used after it)
        assert cached(cache, [c, d, e, f]) == [True, False, True, True]
        assert charged(cache, A) == (3, 3000) and charged(cache, B) == (0, 0)
        assert set(store_files(tmp_path / "c")) == {o.hash.hex() for o in (c, e, f)}


async def test_content_larger_than_the_quota_is_refused_before_anything_is_evicted_or_read(
    tmp_path: Path, source: Source, backends: Backends
):
    small = source.many(2, 1000, "a")
    big = source.add("big", os.urandom(5000))
    async with running(config(tmp_path / "c", user_quota=4000), backends) as cache:
        for o in small:
            await cache.ensure(o.hash, o.size, o.location, uid=A)
        gets = backends.gets()
        with pytest.raises(QuotaExceeded, match="larger than the per-user quota") as info:
            await cache.ensure(big.hash, big.size, big.location, uid=A)
        assert errno_for(info.value) == errno.EDQUOT
        with pytest.raises(QuotaExceeded):  # another user's mount is told before it reads
            await cache.lease(big.hash, big.size, "ds", holder=object(), uid=B)
        source_bytes = supplied(big.data)
        with pytest.raises(QuotaExceeded):
            await cache.ensure_supplied(big.hash, big.size, big.location, source_bytes, uid=B)
        assert source_bytes.fd == -1  # closed unread
        assert backends.gets() == gets
        assert cached(cache, small) == [True, True] and not cache.contains(big.hash)
        assert charged(cache, A) == (2, 2000)
        assert cache.counters.total.evicted_files == 0
        # Filled by nobody's request (mountd's own preload), it is a hit for everybody.
        path = await cache.ensure(big.hash, big.size, big.location)
        assert await cache.ensure(big.hash, big.size, big.location, uid=A) == path
        assert charged(cache, A) == (2, 2000)


async def test_pinned_entries_of_the_user_are_kept_and_the_fill_fails(
    tmp_path: Path, source: Source, backends: Backends
):
    a, b, c, d = source.many(4, 1000, "a")
    async with running(config(tmp_path / "c", user_quota=2000), backends) as cache:
        await cache.ensure(a.hash, a.size, a.location, uid=A)
        await cache.ensure(b.hash, b.size, b.location, uid=A)
        cache.pin([a.hash, b.hash])
        with pytest.raises(QuotaExceeded, match="pinned") as info:
            await cache.ensure(c.hash, c.size, c.location, uid=A)
        assert errno_for(info.value) == errno.EDQUOT
        assert cached(cache, [a, b, c]) == [True, True, False]
        # B is not held back by A's quota.
        await cache.ensure(c.hash, c.size, c.location, uid=B)
        assert charged(cache, B) == (1, 1000)
        cache.unpin([a.hash])
        await cache.ensure(d.hash, d.size, d.location, uid=A)  # a goes, b is still pinned
        assert cached(cache, [a, b, c, d]) == [False, True, True, True]
        assert charged(cache, A) == (2, 2000)


async def test_concurrent_fills_of_one_user_never_exceed_its_quota(
    tmp_path: Path, source: Source
):
    size, quota = 10_000, 50_000
    a_objs = source.many(30, size, "a")
    b_objs = source.many(4, size, "b")
    cache_dir = tmp_path / "c"
    cfg = config(cache_dir, size=1 << 20, user_quota=quota, fill_concurrency=16,
                 remote_bandwidth=2e6)
    samples = []
    async with running(cfg, Backends()) as cache:
        for o in b_objs:
            await cache.ensure(o.hash, o.size, o.location, uid=B)
        done = trio.Event()

        async def watch() -> None:
            while not done.is_set():
                held = cache.charges.bytes.get(A, 0) + cache.charges.reserved.get(A, 0)
                samples.append(held)
                assert held <= quota, held
                await trio.sleep(0.002)

        async def fill_all() -> None:
            async with trio.open_nursery() as nursery:
                for o in a_objs:
                    nursery.start_soon(partial(cache.ensure, o.hash, o.size, o.location, uid=A))
            done.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch)
            nursery.start_soon(fill_all)
        assert charged(cache, A) == (5, quota)
        assert cache.charges.reserved == {}
        assert cached(cache, b_objs) == [True] * 4
        assert sum(cached(cache, a_objs)) == 5
        snap = cache.charges.snapshot()[A]
        assert (snap["quota_evicted_files"], snap["quota_evicted_bytes"]) == (25, 25 * size)
        assert len(store_files(cache_dir)) == 9
    assert max(samples) == quota  # the watcher saw the user at its quota


async def test_charges_survive_a_clean_reopen_a_crash_and_a_lowered_quota(
    tmp_path: Path, source: Source, backends: Backends
):
    a_objs = source.many(4, 1000, "a")
    b_objs = source.many(2, 3000, "b")
    cache_dir = tmp_path / "c"
    async with running(config(cache_dir, user_quota=10_000), backends) as cache:
        for o in a_objs:
            await cache.ensure(o.hash, o.size, o.location, uid=A)
        for o in b_objs:
            await cache.ensure_supplied(o.hash, o.size, o.location, supplied(o.data), uid=B)
        cache.record_hits(None, [a_objs[0].hash], 1000)  # a0 is A's newest by use
    async with running(config(cache_dir, user_quota=10_000), backends) as cache:
        assert not cache.recovery.reconciled  # clean: charges come from the index alone
        assert charged(cache, A) == (4, 4000) and charged(cache, B) == (2, 6000)
    # A crash, and one of A's files removed behind mountd's back: the row goes, and so does
    # its charge.
    simulate_crash(cache_dir)
    os.unlink(layout.store_path(cache_dir, a_objs[3].hash))
    async with running(config(cache_dir, user_quota=10_000), backends) as cache:
        assert cache.recovery.reconciled and cache.recovery.rows_dropped == 1
        assert charged(cache, A) == (3, 3000) and charged(cache, B) == (2, 6000)
    # The quota lowered: open evicts each user's least recently used down to it.
    async with running(config(cache_dir, user_quota=2000), backends) as cache:
        assert cached(cache, a_objs[:3]) == [True, False, True]
        assert charged(cache, A) == (2, 2000)
        assert charged(cache, B) == (0, 0) and cached(cache, b_objs) == [False, False]
        assert cache.charges.snapshot()[B]["quota_evicted_files"] == 2
    assert owners_on_disk(cache_dir) == {a_objs[0].hash: A, a_objs[2].hash: A}


async def test_a_rebuilt_index_charges_nobody(tmp_path: Path, source: Source, backends: Backends):
    objs = source.many(3, 1000, "a")
    cache_dir = tmp_path / "c"
    async with running(config(cache_dir), backends) as cache:
        for o in objs:
            await cache.ensure(o.hash, o.size, o.location, uid=A)
    layout.index_path(cache_dir).write_bytes(b"garbage" * 100)
    async with running(config(cache_dir, user_quota=1000), backends) as cache:
        assert cache.recovery.index_rebuilt and cache.entries == 3
        assert cache.charges.snapshot() == {}  # adopted files are nobody's
        # A starts again from zero: its next fill evicts nothing of what was adopted.
        extra = source.add("a-extra", os.urandom(1000))
        await cache.ensure(extra.hash, extra.size, extra.location, uid=A)
        assert cached(cache, objs) == [True] * 3 and charged(cache, A) == (1, 1000)


async def test_a_fill_waits_for_the_users_own_fills_in_flight_then_evicts_them(
    tmp_path: Path, source: Source
):
    """Quota 1.5 files: a second fill of the same user waits while the first is in flight
    (never over the quota meanwhile), then evicts it once it landed (nothing else of the
    user's is evictable)."""
    first, second = source.many(2, 100_000, "a")
    gate = threading.Event()

    def gated(backend):
        original = backend._read_range

        def read(*args):
            assert gate.wait(10), "the test never opened the gate"
            return original(*args)

        backend._read_range = read
        return backend

    backends = Backends(wrap=gated)
    async with running(config(tmp_path / "c", user_quota=150_000), backends) as cache:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(partial(cache.ensure, first.hash, first.size, first.location, uid=A))
            await wait_until(lambda: cache.charges.reserved.get(A) == 100_000, what="reserve")
            nursery.start_soon(partial(cache.ensure, second.hash, second.size, second.location,
                                       uid=A))
            await trio.testing.wait_all_tasks_blocked()
            assert cache.reserved == 100_000 and cache.charges.reserved == {A: 100_000}
            gate.set()
        assert cached(cache, [first, second]) == [False, True]
        assert charged(cache, A) == (1, 100_000)
        assert cache.charges.snapshot()[A]["quota_evicted_files"] == 1
        assert backends.gets() == 2


async def test_an_index_from_before_quotas_is_kept_and_charges_nobody(
    tmp_path: Path, source: Source, backends: Backends
):
    old, new = source.many(3, 1000, "old"), source.add("new", os.urandom(1000))
    cache_dir = tmp_path / "c"
    async with running(config(cache_dir), backends) as cache:
        for o in old:
            await cache.ensure(o.hash, o.size, o.location, "ds", uid=A)
    with sqlite3.connect(layout.index_path(cache_dir)) as db:  # as an older quiverfs left it
        db.execute("DROP TABLE owners")
    async with running(config(cache_dir, user_quota=1000), backends) as cache:
        assert not cache.recovery.index_rebuilt and not cache.recovery.reconciled
        assert cache.entries == 3 and cache.charges.snapshot() == {}
        await cache.ensure(new.hash, new.size, new.location, "ds", uid=A)
        assert cached(cache, [*old, new]) == [True] * 4 and charged(cache, A) == (1, 1000)
    assert owners_on_disk(cache_dir) == {new.hash: A}
