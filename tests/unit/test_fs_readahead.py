"""Read-ahead in the mount's main process (quiverfs/fs.py), without a kernel: misses forwarded
as raw READs and hit reports as a worker sends them feed the detector, and
``send_prefetches`` hands the files it names to the prefetcher, leaving out files already in
the store and empty ones. The detector itself is tested in test_readahead.py."""

from __future__ import annotations

import random
import struct
from pathlib import Path

import pytest
import trio
import trio.testing

from digests.digest import Digest, FileEntry
from digests.write import NewFile, write_digest
from mountd.store import layout
from quiverfs import fuse_wire as w
from quiverfs import fuse_worker
from quiverfs.fs import QuiverOperations
from quiverfs.reads import SharedCounters
from tests.unit.test_fs_ops import FakeFetcher, b3, read_request

#: 400 files in one directory (ids in name order), file 30 empty.
FILES = {f"d/f{i:03d}": (b"" if i == 30 else f"content {i}".encode()) for i in range(400)}


class FakePrefetcher:
    """Plays mountd's ``prefetch``: records the paths of each notification."""

    def __init__(self, cache_size: int | None = 1 << 30) -> None:
        self.sent: list[list[str]] = []
        self.cache_size = cache_size

    async def cache_bytes(self) -> int | None:
        return self.cache_size

    async def prefetch(self, entries: list[FileEntry]) -> None:
        self.sent.append([entry.path for entry in entries])


@pytest.fixture
def digest(tmp_path: Path):
    path = tmp_path / "d.qd"
    write_digest(path, [NewFile(p, len(d), b3(d)) for p, d in FILES.items()], ["file:///nowhere"])
    with Digest.open(path) as opened:
        yield opened


def operations(digest: Digest, cache: Path, readahead: int = 8,
               cache_size: int | None = 1 << 30) -> tuple[QuiverOperations, FakePrefetcher]:
    prefetcher = FakePrefetcher(cache_size)
    fetcher = FakeFetcher(cache, {b3(d): d for d in FILES.values()})
    ops = QuiverOperations(digest, cache, fetcher, SharedCounters(2), prefetcher=prefetcher,
                           readahead=readahead)
    return ops, prefetcher


def ino(digest: Digest, i: int) -> int:
    return digest.lookup_path(f"d/f{i:03d}").id


async def read_files(ops: QuiverOperations, digest: Digest, numbers, reader: int = 4242) -> None:
    """Misses of ``d/fNN`` for each number, as forwarded READs from process ``reader``."""
    for i in numbers:
        request = bytearray(read_request(ino(digest, i), 0, 4096))
        struct.pack_into("<I", request, 32, reader)  # fuse_in_header.pid
        out = await ops.answer(bytes(request))
        assert b"".join(out)[w.OUT_HEADER.size:] == FILES[f"d/f{i:03d}"]
        await trio.testing.wait_all_tasks_blocked()  # the sender sends before the next read


async def sent_after(ops: QuiverOperations, prefetcher: FakePrefetcher, work) -> list[list[str]]:
    """Run ``work`` with ``send_prefetches`` running; the notifications sent meanwhile."""
    async with trio.open_nursery() as nursery:
        nursery.start_soon(ops.send_prefetches)
        await trio.testing.wait_all_tasks_blocked()  # it has learnt the cache's size
        await work()
        await trio.testing.wait_all_tasks_blocked()
        nursery.cancel_scope.cancel()
    return prefetcher.sent


async def test_misses_in_order_prefetch_the_next_files(digest: Digest, tmp_path: Path) -> None:
    ops, prefetcher = operations(digest, tmp_path / "cache")
    sent = await sent_after(ops, prefetcher, lambda: read_files(ops, digest, range(15)))
    # The 15th read (f14) makes it a scan: the next 8 files, in one notification.
    assert sent == [[f"d/f{i:03d}" for i in range(15, 23)]]
    assert ops.stats()["readahead"] == 8 and ops.stats()["readahead_files"] == 8
    ops.close()


async def test_cached_and_empty_files_are_left_out(digest: Digest, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    ops, prefetcher = operations(digest, cache)
    for i in (25, 27):  # already in the store
        store = layout.store_path(cache, b3(FILES[f"d/f{i:03d}"]))
        store.parent.mkdir(parents=True, exist_ok=True)
        store.write_bytes(FILES[f"d/f{i:03d}"])
    sent = await sent_after(ops, prefetcher, lambda: read_files(ops, digest, range(24)))
    flat = [path for batch in sent for path in batch]
    # Asked for: f15 .. f31 (8 ahead of f23); sent: all but the cached f25, f27 and empty f30.
    assert flat == [f"d/f{i:03d}" for i in range(15, 32) if i not in (25, 27, 30)]
    ops.close()


async def test_worker_hit_reports_move_the_window(digest: Digest, tmp_path: Path) -> None:
    ops, prefetcher = operations(digest, tmp_path / "cache")

    async def work() -> None:
        await read_files(ops, digest, range(15))
        await trio.testing.wait_all_tasks_blocked()
        # f15 .. f19 were then read from the store by a worker, which reports them.
        records = b"".join(fuse_worker.HIT_RECORD.pack(b3(FILES[f"d/f{i:03d}"]), ino(digest, i))
                           for i in range(15, 20))
        ops.add_hits(struct.pack("<Q", 0) + records)

    sent = await sent_after(ops, prefetcher, work)
    assert sent == [[f"d/f{i:03d}" for i in range(15, 23)], [f"d/f{i:03d}" for i in range(23, 28)]]
    ops.close()


async def test_shuffled_misses_prefetch_nothing(digest: Digest, tmp_path: Path) -> None:
    ops, prefetcher = operations(digest, tmp_path / "cache")
    order = [i for i in range(400) if i != 30]
    random.Random(5).shuffle(order)
    sent = await sent_after(ops, prefetcher, lambda: read_files(ops, digest, order))
    assert sent == [] and ops.stats()["readahead_files"] == 0
    ops.close()


async def test_readahead_zero_is_off(digest: Digest, tmp_path: Path) -> None:
    ops, prefetcher = operations(digest, tmp_path / "cache", readahead=0)
    sent = await sent_after(ops, prefetcher, lambda: read_files(ops, digest, range(40)))
    assert ops.readahead is None
    assert sent == [] and ops.stats()["readahead"] == 0
    ops.close()


@pytest.mark.parametrize(("cache_size", "window"), [(1 << 30, 8), (8 * 10, 1), (8 * 30, 3), (None, 8)])
async def test_the_window_is_a_small_share_of_the_cache(digest: Digest, tmp_path: Path,
                                                         cache_size: int | None, window: int) -> None:
    # Files here are ~10 bytes: a window holds at most an eighth of the cache (None: unknown,
    # then only the fixed cap of 512 MiB).
    ops, prefetcher = operations(digest, tmp_path / "cache", cache_size=cache_size)
    sent = await sent_after(ops, prefetcher, lambda: read_files(ops, digest, range(15)))
    assert ops.stats()["readahead"] == window
    assert sent == [[f"d/f{i:03d}" for i in range(15, 15 + window)]]
    ops.close()
