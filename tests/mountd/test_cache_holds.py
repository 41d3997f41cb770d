"""Holds (mountd/store/holds.py): a file whose path ensure just answered is not evicted before
its client can open it, even when every other entry is pinned; the wait ends with the hold."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from mountd.errors import CacheFull
from mountd.store.holds import Holds
from tests.mountd.conftest import Backends, Source, config, running

HOLD = 0.3


async def test_holds_end_by_themselves_in_order(autojump_clock) -> None:
    holds = Holds(max_bytes=100, seconds=1.0)
    holds.hold(b"a" * 32, 10)
    await trio.sleep(0.5)
    holds.hold(b"b" * 32, 10)
    assert b"a" * 32 in holds and b"b" * 32 in holds and holds.count() == 2
    assert holds.deadline(b"a" * 32) == pytest.approx(trio.current_time() + 0.5)
    await trio.sleep(0.6)
    assert b"a" * 32 not in holds and b"b" * 32 in holds and holds.count() == 1
    assert holds.deadline(b"a" * 32) is None and holds.deadline(None) is None
    holds.hold(b"b" * 32, 10)  # renewed: a full second again
    await trio.sleep(0.9)
    assert holds.count() == 1
    await trio.sleep(0.2)
    assert holds.count() == 0


def test_holds_keep_at_most_their_bytes_the_oldest_end_first() -> None:
    async def main() -> None:
        holds = Holds(max_bytes=25, seconds=10.0)
        for name in b"abc":
            holds.hold(bytes([name]) * 32, 10)  # c's hold ends a's: 30 bytes > 25
        assert [bytes([n]) * 32 in holds for n in b"abc"] == [False, True, True]
        holds.hold(b"b" * 32, 10)  # renewed: now the newest, c is the oldest
        holds.hold(b"d" * 32, 10)
        assert [bytes([n]) * 32 in holds for n in b"bcd"] == [True, False, True]
        assert holds.count() == 2

    trio.run(main)


async def test_an_answered_file_outlives_the_next_fill_until_its_hold_ends(
    tmp_path: Path, source: Source, backends: Backends
) -> None:
    # Room for three files; two are pinned (a resident chunk), so the only evictable entry
    # is the one just answered. Without the hold, the next fill evicted it at once: the
    # client that asked for it met ENOENT (EIO after three tries, packed_training.py).
    p1, p2, x, y = source.many(4, 1000)
    async with running(config(tmp_path / "c", size=3000), backends) as cache:
        cache.holds.seconds = HOLD
        for o in (p1, p2):
            await cache.ensure(o.hash, o.size, o.location)
        cache.pin([p1.hash, p2.hash])
        path_x = await cache.ensure(x.hash, x.size, x.location)
        answered = trio.current_time()
        assert cache.usage()["held"] >= 1

        landed = trio.Event()
        state = {}

        async def fill_y() -> None:
            await cache.ensure(y.hash, y.size, y.location)
            state["at"] = trio.current_time()
            landed.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(fill_y)
            with open(path_x, "rb") as f:  # the client's open, after the answer: still there
                assert f.read() == x.data
            await landed.wait()
        assert state["at"] - answered >= HOLD * 0.9  # y waited for x's hold, not evicted it
        assert not cache.contains(x.hash) and cache.contains(y.hash)
        assert cache.contains(p1.hash) and cache.contains(p2.hash)


async def test_held_entries_alone_are_not_a_full_cache_but_pins_are(
    tmp_path: Path, source: Source, backends: Backends
) -> None:
    a, b, c = source.many(3, 1000)
    async with running(config(tmp_path / "c", size=2000), backends) as cache:
        cache.holds.seconds = HOLD
        await cache.ensure(a.hash, a.size, a.location)
        await cache.ensure(b.hash, b.size, b.location)
        await cache.ensure(c.hash, c.size, c.location)  # waits for a's hold, evicts a (LRU)
        assert [cache.contains(o.hash) for o in (a, b, c)] == [False, True, True]
        cache.pin([b.hash, c.hash])
        with pytest.raises(CacheFull, match="pinned"):
            await cache.ensure(a.hash, a.size, a.location)


class _OnLanding:
    """A cache listener that runs ``call`` in the very step a fill of ``target`` lands."""

    def __init__(self, target: bytes, call) -> None:
        self.target, self.call = target, call

    def filled(self, hashes) -> None:
        if self.target in hashes:
            self.call()

    def removed(self, hashes) -> None:
        pass

    def fill_failed(self, hash: bytes) -> None:
        pass


async def read_with_a_task_woken_at_landing(cache, objs, task, results: list,
                                            after=None) -> None:
    """Read each of ``objs`` through ``ensure`` (checking its bytes) while ``task`` starts in
    the step its fill lands, so that trio wakes it in the same batch as the reader, in either
    order; wait for the task's result each round, then call ``after(obj)``."""
    for n, obj in enumerate(objs):
        listener = _OnLanding(obj.hash, lambda: cache._nursery.start_soon(task))
        cache.add_listener(listener)
        path = await cache.ensure(obj.hash, obj.size, obj.location)
        with open(path, "rb") as f:
            assert f.read() == obj.data
        with trio.fail_after(10):
            while len(results) < n + 1:
                await trio.sleep(0.005)
        cache.remove_listener(listener)
        if after is not None:
            after(obj)


async def test_a_landed_file_stays_until_its_waiting_reader_has_the_path(
    tmp_path: Path, source: Source, backends: Backends
) -> None:
    # Another fill's eviction may run between a fill landing and its waiting reader being
    # answered: both are woken in the same trio batch, in either order (eight rounds, so
    # both orders occur). Room for three files, two pinned: the landed file is the only
    # one to evict. Before, the eviction took it and the reader's answer named a file that
    # was gone (158 of 3,104 fills in one shim_vs_lru.py run were such refetches).
    p1, p2 = source.many(2, 1000, "pinned")
    rounds = source.many(8, 1000, "round")
    async with running(config(tmp_path / "c", size=3000), backends) as cache:
        for o in (p1, p2):
            await cache.ensure(o.hash, o.size, o.location)
        cache.pin([p1.hash, p2.hash])
        freed: list[tuple[int, int]] = []

        async def evict_everything() -> None:  # woken with the reader
            freed.append(cache._evict_until(3000))

        def answered(x) -> None:
            assert cache._landing == {} and x.hash in cache.holds  # answered: held now
            cache.holds._drop(x.hash)  # let the next round's fill evict it

        await read_with_a_task_woken_at_landing(cache, rounds, evict_everything, freed, answered)
        assert freed == [(0, 0)] * len(rounds)

        # A prefetch no reader waits for is not kept: evictable the moment it lands.
        y = source.add("prefetched", b"y" * 1000)
        seen: dict = {}
        cache.add_listener(_OnLanding(y.hash, lambda: seen.update(y=y.hash in cache._landing)))
        assert cache.prefetch([(y.hash, y.size, y.location)]) == 1
        with trio.fail_after(10):
            while "y" not in seen:
                await trio.sleep(0.005)
        assert seen["y"] is False


async def test_a_fill_waits_for_files_landed_for_readers_instead_of_failing(
    tmp_path: Path, source: Source, backends: Backends
) -> None:
    # A one-file cache: a reservation starts the moment x lands for its reader, and runs
    # before or after the reader's answer (eight rounds: both orders occur). Either way it
    # waits for the answer and then for x's hold; it never fails with CacheFull.
    rounds = source.many(8, 1000, "round")
    async with running(config(tmp_path / "c", size=1000), backends) as cache:
        cache.holds.seconds = 0.05
        reserved: list[bool] = []

        async def reserve() -> None:
            await cache._reserve(1000)
            reserved.append(not cache.contains(rounds[len(reserved)].hash))
            cache.reserved -= 1000  # a fill that gave up: the room is free again
            cache._notify_space()

        await read_with_a_task_woken_at_landing(cache, rounds, reserve, reserved)
        assert reserved == [True] * len(rounds)  # each one evicted x after its answer
