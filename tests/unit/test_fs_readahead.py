"""Read-ahead in the mount's main process (quiverfs/filesystem/fs.py), without a kernel: misses
forwarded as raw READs and hit reports as a worker sends them feed the detector, with the files'
sizes from the digest, and ``send_prefetches`` hands the files it names to the prefetcher, leaving
out files already in the store and empty ones; ``user.quiver.stats`` shows the window and what was
sent. The detector itself is tested in test_readahead.py."""

from __future__ import annotations

import json
import random
import struct
from pathlib import Path

import pytest
import trio
import trio.testing

from digests.digest import Digest, FileEntry
from digests.write import NewFile, write_digest
from mountd.store import layout
from quiverfs.filesystem.fs import BOUNDED_SHARE, SIZES_AHEAD, KeepTerms, QuiverOperations
from quiverfs.filesystem.readahead import START_BYTES, window_bytes
from quiverfs.filesystem.reads import SharedCounters
from quiverfs.filesystem.sweep import BOUND_STEPS, START_READS
from quiverfs.filesystem.tree import ROOT_INODE
from quiverfs.protocol import fuse_wire as w
from quiverfs.protocol import worker_messages
from quiverfs.protocol.control import make_name
from tests.unit.test_fs_ops import FakeFetcher, b3, read_request

#: 400 files in one directory (ids in name order), file 30 empty.
FILES = {f"d/f{i:03d}": (b"" if i == 30 else f"content {i}".encode()) for i in range(400)}


class FakePrefetcher:
    """Plays mountd's ``prefetch``: records the paths of each notification, and the bytes;
    ``renewed`` the notifications sent with ``renew``."""

    def __init__(self, cache_size: int | None = 1 << 30,
                 terms: KeepTerms | None = KeepTerms(0.5, 30.0)) -> None:
        self.sent: list[list[str]] = []
        self.renewed: list[list[str]] = []
        #: inodes whose pages the kernel was told to drop
        self.invalidated: list[int] = []
        self.bytes = 0
        self.cache_size = cache_size
        self.terms = terms

    async def cache_bytes(self) -> int | None:
        return self.cache_size

    async def keep_terms(self) -> KeepTerms | None:
        return self.terms

    async def prefetch(self, entries: list[FileEntry], *, renew: bool = False) -> None:
        self.sent.append([entry.path for entry in entries])
        self.bytes += sum(entry.size for entry in entries)
        if renew:
            self.renewed.append(self.sent[-1])


@pytest.fixture
def digest(tmp_path: Path):
    path = tmp_path / "d.qd"
    write_digest(path, [NewFile(p, len(d), b3(d)) for p, d in FILES.items()], ["file:///nowhere"])
    with Digest.open(path) as opened:
        yield opened


def operations(digest: Digest, cache: Path, readahead: int = 8, cache_size: int | None = 1 << 30,
               files: dict[str, bytes] = FILES, sweep: int = 0) -> tuple[QuiverOperations, FakePrefetcher]:
    prefetcher = FakePrefetcher(cache_size)
    fetcher = FakeFetcher(cache, {b3(d): d for d in files.values()})
    ops = QuiverOperations(digest, cache, fetcher, SharedCounters(2), prefetcher=prefetcher,
                           readahead=readahead, sweep=sweep)
    return ops, prefetcher


def ino(digest: Digest, i: int) -> int:
    return digest.lookup_path(f"d/f{i:03d}").id


async def read_files(ops: QuiverOperations, digest: Digest, numbers, reader: int = 4242,
                     files: dict[str, bytes] = FILES, folder: str = "d") -> None:
    """Misses of ``d/fNNN`` for each number, as forwarded READs from process ``reader``."""
    for i in numbers:
        path = f"{folder}/f{i:03d}"
        request = bytearray(read_request(digest.lookup_path(path).id, 0, 4096))
        struct.pack_into("<I", request, 32, reader)  # fuse_in_header.pid
        out = await ops.answer(bytes(request))
        assert b"".join(out)[w.OUT_HEADER.size:] == files[path][:4096]
        await trio.testing.wait_all_tasks_blocked()  # the sender sends before the next read


async def sent_after(ops: QuiverOperations, prefetcher: FakePrefetcher, work) -> list[list[str]]:
    """Run ``work`` with ``send_prefetches`` running; the notifications sent meanwhile."""
    async with trio.open_nursery() as nursery:
        nursery.start_soon(ops.send_prefetches, prefetcher.invalidated.extend)
        await trio.testing.wait_all_tasks_blocked()  # it has learnt the cache's size
        await work()
        await trio.testing.wait_all_tasks_blocked()
        nursery.cancel_scope.cancel()
    return prefetcher.sent


async def test_misses_in_order_prefetch_the_next_files(digest: Digest, tmp_path: Path) -> None:
    ops, prefetcher = operations(digest, tmp_path / "cache")
    sent = await sent_after(ops, prefetcher, lambda: read_files(ops, digest, range(15)))
    # The 15th read (f14) makes it a scan: the next 4 files (a new run's window), in one
    # notification; each is 10 bytes ("content 15" ...).
    assert sent == [[f"d/f{i:03d}" for i in range(15, 19)]]
    stats = ops.stats()
    assert stats["readahead"] == 8 and stats["readahead_cap_bytes"] == window_bytes(1 << 30)
    assert (stats["readahead_window_files"], stats["readahead_window_bytes"]) == (4, START_BYTES + 10)
    assert (stats["readahead_files"], stats["readahead_bytes"]) == (4, 40) and prefetcher.bytes == 40
    ops.close()


async def test_the_window_grows_as_the_scan_goes_on(digest: Digest, tmp_path: Path) -> None:
    ops, prefetcher = operations(digest, tmp_path / "cache")
    sent = await sent_after(ops, prefetcher, lambda: read_files(ops, digest, range(20)))
    # Each file read after f14 widens the window by one, up to 8 (--readahead): f19 + 8.
    assert sent == [[f"d/f{i:03d}" for i in range(15, 19)], ["d/f019", "d/f020"],
                    ["d/f021", "d/f022"], ["d/f023", "d/f024"], ["d/f025", "d/f026"], ["d/f027"]]
    assert ops.stats()["readahead_window_files"] == 8
    assert ops.stats()["readahead_window_bytes"] == START_BYTES + 6 * 10
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
    assert ops.stats()["readahead_bytes"] == prefetcher.bytes == 14 * 10
    ops.close()


async def test_worker_hit_reports_move_the_window(digest: Digest, tmp_path: Path) -> None:
    ops, prefetcher = operations(digest, tmp_path / "cache")

    async def work() -> None:
        await read_files(ops, digest, range(15))
        await trio.testing.wait_all_tasks_blocked()
        # f15 .. f19 were then read from the store by a worker, which reports them.
        records = b"".join(worker_messages.HIT_RECORD.pack(b3(FILES[f"d/f{i:03d}"]), ino(digest, i))
                           for i in range(15, 20))
        ops.add_hits(struct.pack("<Q", 0) + records)

    sent = await sent_after(ops, prefetcher, work)
    # The five reported hits move the frontier to f19 and widen the window to 8 files.
    assert sent == [[f"d/f{i:03d}" for i in range(15, 19)], [f"d/f{i:03d}" for i in range(19, 28)]]
    ops.close()


async def test_shuffled_misses_prefetch_nothing_without_the_sweep(digest: Digest, tmp_path: Path) -> None:
    ops, prefetcher = operations(digest, tmp_path / "cache")
    order = [i for i in range(400) if i != 30]
    random.Random(5).shuffle(order)
    sent = await sent_after(ops, prefetcher, lambda: read_files(ops, digest, order))
    assert sent == [] and ops.stats()["readahead_files"] == 0
    assert ops.stats()["sweep"] == 0 and ops.sweep is None
    ops.close()


def hits(digest: Digest, numbers) -> bytes:
    """A worker's hit report of ``d/fNNN`` for each number (10 bytes each)."""
    records = b"".join(worker_messages.HIT_RECORD.pack(b3(FILES[f"d/f{i:03d}"]), ino(digest, i))
                       for i in numbers)
    return struct.pack("<Q", 10 * len(numbers)) + records


async def test_shuffled_misses_sweep_the_files_between_them(digest: Digest, tmp_path: Path) -> None:
    ops, prefetcher = operations(digest, tmp_path / "cache", sweep=4)
    order = [i for i in range(400) if i != 30]
    random.Random(5).shuffle(order)
    read = order[:START_READS]
    sent = await sent_after(ops, prefetcher, lambda: read_files(ops, digest, read))
    # 16 misses: 4 x 16 files of the range they span, from the first one read on, none read.
    low, high = min(read), max(read)
    named = [i for i in range(read[0], high + 1) if i not in read][:4 * START_READS]
    assert sent == [[f"d/f{i:03d}" for i in named if i != 30]]  # the empty file is not sent
    assert low < read[0]  # the range below the first read comes when the budget allows
    stats = ops.stats()
    assert (stats["sweep"], stats["sweep_running"]) == (4, True)
    assert (stats["sweep_files"], stats["sweep_bytes"]) == (len(sent[0]), 10 * len(sent[0]))
    assert stats["readahead_files"] == 0  # not a scan: read-ahead asked for nothing
    ops.close()


async def test_hits_the_workers_report_widen_the_sweep(digest: Digest, tmp_path: Path) -> None:
    ops, prefetcher = operations(digest, tmp_path / "cache", sweep=4)
    order = [i for i in range(400) if i != 30]
    random.Random(5).shuffle(order)

    async def work() -> None:
        await read_files(ops, digest, order[:START_READS])
        ops.add_hits(hits(digest, order[START_READS:START_READS + 16]))

    sent = await sent_after(ops, prefetcher, work)
    # 32 reads at 4 files each: 64 named after the misses (the empty f030 among them, not
    # sent) and 64 more after the report.
    assert [len(batch) for batch in sent] == [63, 64]
    flat = [path for batch in sent for path in batch]
    assert len(flat) == len(set(flat))
    assert not {f"d/f{i:03d}" for i in order[:START_READS]} & set(flat)
    ops.close()


async def test_a_miss_after_the_sweep_was_done_starts_it_over(digest: Digest, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    ops, prefetcher = operations(digest, cache, sweep=8)
    order = [i for i in range(400) if i != 30]
    random.Random(5).shuffle(order)

    async def work() -> None:
        await read_files(ops, digest, order)  # every file once: misses, then in the store
        assert ops.sweep is not None and ops.sweep.done
        await read_files(ops, digest, order[:20])  # hits (the kernel dropped its pages)
        assert ops.stats()["sweep_restarts"] == 0
        # mountd evicted a file, and it is read again: the sweep starts over.
        layout.store_path(cache, b3(FILES[f"d/f{order[0]:03d}"])).unlink()
        await read_files(ops, digest, order[:1])
        assert ops.stats()["sweep_restarts"] == 1 and not ops.sweep.done

    await sent_after(ops, prefetcher, work)
    ops.close()


def larger_than_the_cache(digest: Digest, cache: Path) -> tuple[QuiverOperations, FakePrefetcher]:
    """Operations whose cache (1,000 bytes) is smaller than the dataset (~4 KB), with the
    sweep on: a bounded sweep."""
    return operations(digest, cache, cache_size=1000, sweep=8)


def shuffled() -> list[int]:
    """Every non-empty file's number, in one shuffled order."""
    order = [i for i in range(400) if i != 30]
    random.Random(5).shuffle(order)
    return order


async def test_a_dataset_larger_than_the_cache_is_swept_within_a_bound(digest: Digest, tmp_path: Path) -> None:
    # 399 files of 9-11 bytes against a cache of 1,000 bytes, mountd protecting half of it:
    # the sweep keeps at most 0.9 x 500 bytes asked for and not read yet, and sends every
    # file with ``renew`` (in the store or not: its reader reads each once this epoch).
    ops, prefetcher = larger_than_the_cache(digest, tmp_path / "cache")
    order = shuffled()
    unread: list[int] = []

    async def work() -> None:
        for i in order[:200]:
            await read_files(ops, digest, [i])
            assert ops.sweep is not None
            unread.append(ops.sweep.outstanding_bytes)

    sent = await sent_after(ops, prefetcher, work)
    bound = int(1000 * 0.5 * BOUNDED_SHARE)
    assert ops.sweep is not None and ops.sweep.bound_bytes == bound
    assert max(unread) <= bound and max(unread) > bound - 2 * bound // BOUND_STEPS
    flat = [path for batch in sent for path in batch]
    assert len(flat) == len(set(flat)) and prefetcher.renewed == sent
    # Each file sent was read since, or is still counted as asked for and unread.
    read = {f"d/f{i:03d}" for i in order[:200]}
    still = {ops.tree.file(file_id).path for file_id in ops.sweep.outstanding()}
    assert set(flat) == (set(flat) & read) | still and not still & read
    assert sum(len(FILES[path]) for path in still) == ops.sweep.outstanding_bytes
    # Every file read is reported done for the epoch (mountd evicts those first).
    assert sorted(ops.take_read_done()) == sorted(b3(FILES[f"d/f{i:03d}"]) for i in order[:200])
    assert ops.take_read_done() == []
    stats = ops.stats()
    assert (stats["sweep_running"], stats["sweep_bound_bytes"]) == (True, bound)
    assert stats["sweep_unread_bytes"] == ops.sweep.outstanding_bytes
    ops.close()


async def test_a_bounded_sweeps_new_epoch_drops_the_kernels_pages_and_late_reports(
        digest: Digest, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    ops, prefetcher = larger_than_the_cache(digest, cache)
    order = shuffled()

    async def work() -> None:
        await read_files(ops, digest, order)  # an epoch: every file read once, here
        assert ops.sweep is not None and ops.sweep.done and prefetcher.invalidated == []
        # The next epoch's first read misses a file read before: a new sweep, and every
        # file served so far has its pages dropped, so that each read reaches the mount.
        layout.store_path(cache, b3(FILES[f"d/f{order[0]:03d}"])).unlink()
        await read_files(ops, digest, order[:1])
        assert ops.stats()["sweep_restarts"] == 1
        with trio.fail_after(5):
            while not prefetcher.invalidated:
                await trio.sleep(0.01)  # sent from a thread
        assert sorted(prefetcher.invalidated) == sorted(ino(digest, i) for i in order)
        # A hit report right after: reads of the epoch that ended, not shown to the sweep.
        ops.add_hits(hits(digest, order[1:11]))
        assert ops.sweep.reads_seen == len(order) + 1

    await sent_after(ops, prefetcher, work)
    ops.close()


async def test_a_bounded_sweep_stands_aside_when_several_jobs_read_through_the_mount(
        digest: Digest, tmp_path: Path) -> None:
    # Two jobs, each a shuffle of its own over the same files: a file one read, the other
    # reads later in its epoch, so it must not go first from mountd's cache.
    ops, prefetcher = larger_than_the_cache(digest, tmp_path / "cache")
    files = [i for i in range(400) if i != 30]
    first, second = random.Random(5).sample(files, 399), random.Random(6).sample(files, 399)

    async def work() -> None:
        await read_files(ops, digest, first[:100])
        assert len(ops.take_read_done()) == 100  # one reader so far
        ops.add_hits(hits(digest, second[:100]))  # the other job: hits, a quarter rereads
        await read_files(ops, digest, first[100:150])
        assert ops.sweep is not None and not ops.sweep.one_reader
        assert ops.take_read_done() == []
        # Nor does it keep a share of the cache for files nobody read yet: the jobs' next
        # reads are mostly of files another read, which that share would push out.
        await trio.testing.wait_all_tasks_blocked()
        sent = len(prefetcher.sent)
        await read_files(ops, digest, first[150:250])
        assert len(prefetcher.sent) == sent

    await sent_after(ops, prefetcher, work)
    ops.close()


async def test_a_mount_that_supplies_its_own_fills_does_not_sweep_a_larger_dataset(
        digest: Digest, tmp_path: Path) -> None:
    # Nothing keeps what such a mount fetches ahead: files swept early would be evicted unread.
    ops, prefetcher = larger_than_the_cache(digest, tmp_path / "cache")
    prefetcher.terms = None
    order = shuffled()
    sent = await sent_after(ops, prefetcher, lambda: read_files(ops, digest, order[:100]))
    assert sent == [] and ops.sweep is None
    assert (ops.stats()["sweep"], ops.stats()["sweep_running"]) == (8, False)
    ops.close()


async def test_a_bounded_sweep_renews_what_is_unread_while_its_reader_reads(
        digest: Digest, tmp_path: Path) -> None:
    ops, prefetcher = larger_than_the_cache(digest, tmp_path / "cache")
    prefetcher.terms = KeepTerms(0.5, 0.3)  # renewals every 0.1 s
    order = shuffled()

    async def work() -> None:
        await read_files(ops, digest, order[:60])
        assert ops.sweep is not None
        swept = len(prefetcher.sent)
        await trio.sleep(0.15)  # one renewal: what was asked and is not read yet
        renewal = prefetcher.renewed[swept:]
        assert [path for batch in renewal for path in batch] == [
            ops.tree.file(file_id).path for file_id in ops.sweep.outstanding()]
        assert ops.stats()["sweep_renewed"] == len(ops.sweep.outstanding()) > 0
        # The reader stopped: no more renewals (mountd lets them go when their time is up).
        await trio.sleep(0.35)
        assert len(prefetcher.sent) == swept + len(renewal)
        await read_files(ops, digest, order[60:61])  # it reads again: renewed again
        await trio.sleep(0.15)
        assert len(prefetcher.sent) > swept + len(renewal)

    await sent_after(ops, prefetcher, work)
    ops.close()


async def test_a_bounded_sweep_asks_nothing_while_a_sampler_uses_the_control_channel(
        digest: Digest, tmp_path: Path) -> None:
    ops, prefetcher = larger_than_the_cache(digest, tmp_path / "cache")
    order = shuffled()

    async def work() -> None:
        info = json.loads(await ops.getxattr(ROOT_INODE, make_name("info").encode()))
        assert info["files"] == 400
        await read_files(ops, digest, order[:100])

    sent = await sent_after(ops, prefetcher, work)
    assert sent == [] and ops.sweep is not None and ops.sweep.bound_bytes is not None
    assert ops.take_read_done() == []  # nor does it tell mountd what to evict first
    ops.close()


async def test_readahead_zero_is_off(digest: Digest, tmp_path: Path) -> None:
    ops, prefetcher = operations(digest, tmp_path / "cache", readahead=0)
    sent = await sent_after(ops, prefetcher, lambda: read_files(ops, digest, range(40)))
    assert ops.readahead is None
    assert sent == [] and ops.stats()["readahead"] == 0
    ops.close()


@pytest.mark.parametrize(("cache_size", "cap", "ahead"),
                         [(1 << 30, 128 << 20, 4), (8 * 10, 10, 1), (8 * 30, 30, 3), (None, 512 << 20, 4)])
async def test_the_bytes_ahead_are_a_small_share_of_the_cache(digest: Digest, tmp_path: Path,
                                                              cache_size: int | None, cap: int,
                                                              ahead: int) -> None:
    # Files here are 10 bytes: a window holds at most an eighth of the cache (None: unknown,
    # then only the fixed cap of 512 MiB), and a new run's window 4 files.
    ops, prefetcher = operations(digest, tmp_path / "cache", cache_size=cache_size)
    sent = await sent_after(ops, prefetcher, lambda: read_files(ops, digest, range(15)))
    assert ops.stats()["readahead"] == 8 and ops.stats()["readahead_cap_bytes"] == cap
    assert sent == [[f"d/f{i:03d}" for i in range(15, 15 + ahead)]]
    ops.close()


#: The issue's folder: 250 files of 10 KiB, then a folder whose first files are 30 MB and 1 MB
#: (declared in the digest only: nobody reads them, so no content is needed).
SMALL = {f"a/f{i:03d}": f"{i:05d}".encode() * 2048 for i in range(250)}
LARGE = {"b/f000": 30_000_000, "b/f001": 1_000_000, **{f"b/f{i:03d}": 10 << 10 for i in range(2, 50)}}


@pytest.fixture
def mixed(tmp_path: Path):
    path = tmp_path / "mixed.qd"
    files = [NewFile(p, len(d), b3(d)) for p, d in SMALL.items()]
    files += [NewFile(p, size, b3(p.encode())) for p, size in LARGE.items()]
    write_digest(path, files, ["file:///nowhere"])
    with Digest.open(path) as opened:
        yield opened


async def test_large_files_after_the_small_ones_read_are_not_fetched(mixed: Digest,
                                                                     tmp_path: Path) -> None:
    # A reader of 2.5 MB of small files made mountd fetch 52.9 MB: the 30 MB and 1 MB files
    # next in digest order. Now the window ends before a file that alone would hold more than
    # START_BYTES + what was read, and the reader that stops there stops read-ahead.
    ops, prefetcher = operations(mixed, tmp_path / "cache", readahead=64, files=SMALL)
    sent = await sent_after(ops, prefetcher,
                            lambda: read_files(ops, mixed, range(250), files=SMALL, folder="a"))
    flat = [path for batch in sent for path in batch]
    assert flat == [f"a/f{i:03d}" for i in range(15, 250)]
    assert ops.stats()["readahead_bytes"] == prefetcher.bytes == 235 * 10240
    ops.close()


async def test_sizes_come_from_the_range_queries_the_notifications_use(
        digest: Digest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Read-ahead asks the digest for the sizes of the files it considers, a range at a time;
    # the notification then finds those entries remembered.
    queried: list[int] = []
    files_between = digest.files_between

    def counting(first: int, last: int):
        queried.append(last - first + 1)
        return files_between(first, last)

    monkeypatch.setattr(digest, "files_between", counting)
    ops, prefetcher = operations(digest, tmp_path / "cache", readahead=64)
    sent = await sent_after(ops, prefetcher, lambda: read_files(ops, digest, range(100)))
    asked = sum(len(batch) for batch in sent) + 1  # f030 is empty: asked, not sent
    assert asked == 163 - 15 + 1  # f015 .. f163: 64 past f099, the last file read
    # One query per SIZES_AHEAD files or so, each row read once (the ranges do not overlap).
    assert len(queried) <= asked // SIZES_AHEAD + 1
    assert sum(queried) <= asked + SIZES_AHEAD
    ops.close()
