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
