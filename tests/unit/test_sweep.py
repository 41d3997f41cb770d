"""The sweep (quiverfs/filesystem/sweep.py) on its own: which ids it names for which reads.

Ids here are 1 .. 1000 and every file is 100 bytes unless a test says otherwise; the mount's
use of it (what is sent to mountd) is in test_fs_readahead.py, a real mount in
tests/mount/test_readahead.py.
"""

from __future__ import annotations

import random

import pytest

from quiverfs.filesystem.sweep import (
    MAX_STEP,
    START_BYTES,
    START_READS,
    STEP,
    Sweep,
)


def sweep(factor: int = 8, size: int = 100, last: int = 1000, sizes=None) -> Sweep:
    return Sweep(1, last, sizes or (lambda first, end: [size] * (end - first + 1)), factor)


def read(s: Sweep, ids, size: int = 100, seen: set[int] | None = None) -> list[int]:
    """Read ``ids`` one by one; every id the sweep named on the way. ``seen``: the ids read
    before, which it must never name (updated)."""
    named: list[int] = []
    seen = set() if seen is None else seen
    for file_id in ids:
        s.read(file_id, size)
        seen.add(file_id)
        step = s.step()
        assert not seen & set(step), "named a file already read"
        named += step
    return named


def test_nothing_is_asked_before_enough_reads() -> None:
    s = sweep()
    assert read(s, range(100, 100 + START_READS * 10, 10)[:START_READS - 1]) == []
    assert s.requested == 0


def test_only_ids_between_the_lowest_and_highest_read_are_asked() -> None:
    s = sweep()
    reads = list(range(300, 400, 6))[:START_READS]  # 300 .. 390
    named = read(s, reads)
    assert named == [i for i in range(300, 391) if i not in reads]  # the range, nothing else
    assert s.requested == len(named)


def test_the_budget_is_factor_times_the_reads() -> None:
    s = sweep(factor=2)
    reads = [1, 1000] + list(range(500, 500 + START_READS - 2))
    named = read(s, reads)
    # 16 reads at factor 2: 32 ids, the first uncovered ones from the first read on.
    assert named == list(range(2, 34))
    # A read gives 2 more ids: too few for a step (STEP ids), until 16 more reads.
    assert read(s, range(600, 600 + STEP // 2 - 1)) == []
    assert read(s, [700]) == list(range(34, 34 + STEP))


def test_the_bytes_asked_are_bounded_by_the_bytes_read() -> None:
    # Large files ahead of small reads: the budget in bytes stops the step first.
    sizes = lambda first, end: [1 << 20] * (end - first + 1)  # noqa: E731
    s = sweep(factor=8, sizes=sizes)
    named = read(s, [1, 1000] + list(range(500, 500 + START_READS - 2)), size=1000)
    # 8 x 16,000 bytes read + START_BYTES: four files of 1 MiB, a fifth would pass it.
    assert len(named) == START_BYTES // (1 << 20) == 4
    assert s.requested_bytes == len(named) << 20


def test_a_step_takes_at_most_max_step_ids() -> None:
    s = sweep(factor=64, last=100_000)
    named = read(s, [1, 100_000] + list(range(50_000, 50_000 + START_READS - 2)))
    assert len(named) == MAX_STEP  # 64 x 16 reads = 1,024 ids, in one step


def test_reading_files_again_does_not_widen_the_sweep() -> None:
    # A job that reads a random subset of 100 files every epoch: the first epoch's reads
    # let the sweep ask for 4 x 100 files, and no epoch after it asks for more.
    s = sweep(factor=4, last=100_000)
    subset = random.Random(2).sample(range(1, 100_001), 100)
    first_epoch = read(s, subset)
    assert 4 * 100 - STEP < len(first_epoch) <= 4 * 100  # the rest is less than a step
    for epoch in range(3):
        order = random.Random(epoch).sample(subset, len(subset))
        assert read(s, order) == []
        s.read_many(order, 100 * len(order))  # the same files reported again as hits
        assert s.step() == []
    assert s.requested == len(first_epoch)


def test_reported_hits_count_their_bytes_for_the_files_read_first() -> None:
    # Files read: 1 MiB each (the reports say so); files to sweep: 8 MiB each.
    s = sweep(factor=2, size=8 << 20, last=100_000)
    s.read_many(list(range(1, 17)), 16 << 20)  # 16 files, first reads
    s.read_many(list(range(1, 17)), 16 << 20)  # the same again: neither files nor bytes
    assert s.step() == []  # nothing between them unread
    s.read_many([40_000], 1 << 20)
    # 17 MiB read once (not 33): 2 x 17 MiB + START_BYTES = 38 MiB, four files of 8 MiB.
    assert START_BYTES == 4 << 20
    assert s.step() == [17, 18, 19, 20]


def test_the_range_growing_below_the_cursor_is_swept_too() -> None:
    s = sweep(factor=4)
    reads = list(range(500, 516))  # the range 500 .. 515, all read: nothing to ask
    assert read(s, reads) == []
    # A read at 400 widens the range downwards: the sweep wraps round to its low end.
    assert read(s, [400]) == list(range(401, 469))  # 4 x 17 = 68 ids
    assert s.requested == 68


def test_a_shuffled_epoch_is_swept_whole_and_can_start_over() -> None:
    s = sweep(factor=8)
    never_read = set(range(500, 505))  # the reader skips these: they are only ever asked for
    order = [i for i in range(1, 1001) if i not in never_read]
    random.Random(4).shuffle(order)
    first, seen = order[:200], set()
    named = read(s, first, seen=seen)
    # Every id between the lowest and the highest read was read or named; none named twice.
    assert set(named) | set(first) == set(range(min(first), max(first) + 1))
    assert len(named) == len(set(named)) == s.requested
    # The rest are hits (the sweep's files, and a few outside that range, named as the
    # range widens): then every id was read or named, and the sweep is done.
    named += read(s, order[200:], seen=seen)
    assert s.done and len(named) == len(set(named)) == s.requested
    assert never_read <= set(named)
    assert read(s, order[:START_READS]) == [] and s.done  # nothing left to ask
    # A file read before that misses now was lost by the cache; one only asked for may not
    # have landed yet.
    assert s.lost(order[0]) and not any(s.lost(i) for i in never_read)
    s.start_over()
    assert not s.lost(order[0])
    assert not s.done and s.restarts == 1
    assert read(s, order[:START_READS]) != []


@pytest.mark.parametrize("factor", [0, -1])
def test_a_factor_below_one_is_refused(factor: int) -> None:
    with pytest.raises(ValueError, match="at least 1"):
        sweep(factor=factor)


def bounded(bound: int, last: int = 1000) -> Sweep:
    return Sweep(1, last, lambda first, end: [100] * (end - first + 1), 8, bound_bytes=bound)


def test_a_bounded_sweep_keeps_what_is_asked_and_unread_within_its_bound() -> None:
    s = bounded(2_000)  # 20 files of 100 bytes
    order = random.Random(4).sample(range(1, 1001), 1000)
    asked: set[int] = set()
    for n, file_id in enumerate(order):
        s.read(file_id, 100)
        asked |= set(s.step())
        unread = asked - set(order[:n + 1])
        assert set(s.outstanding()) == unread
        assert s.outstanding_bytes == 100 * len(unread) <= 2_000
    assert s.done and s.outstanding() == [] and s.outstanding_bytes == 0
    assert s.requested > 3 * 20  # it went on asking as the reads freed room (~20 (1 + ln 50))


def test_a_bounded_sweep_asks_again_only_when_reads_freed_a_step() -> None:
    s = bounded(3_200)  # 32 files; a step is a 32nd of the bound: one file
    reads = list(range(1, 1001, 50))[:START_READS]
    named = read(s, reads)
    assert s.outstanding_bytes == 3_200 and len(named) == 32
    assert read(s, [999]) == []  # a file it did not ask for frees nothing
    assert read(s, [named[5]]) == [named[-1] + 1]  # one it asked for frees one file's room
    s2 = Sweep(1, 10_000, lambda first, end: [100] * (end - first + 1), 64, bound_bytes=32_000)
    named = read(s2, [i * 10 for i in reads])  # 320 files, a step 10 files of room
    assert len(named) == 320
    assert read(s2, named[:9]) == []
    assert len(read(s2, named[9:10])) == 10


def test_a_shuffled_epoch_finds_about_the_share_the_bound_predicts() -> None:
    # An ideal cache that keeps what the sweep asked for until it is read: with B files
    # unread at a time, a shuffled epoch of N files finds about B/N (1 + ln(N/B)) of them
    # there (each read finds B of the R files left): 0.31 for B = 90, N = 1,000.
    s = bounded(9_000)
    order = random.Random(9).sample(range(1, 1001), 1000)
    kept: set[int] = set()
    found = 0
    for file_id in order:
        found += file_id in kept
        kept.discard(file_id)
        s.read(file_id, 100)
        kept |= set(s.step())
    assert 0.25 <= found / 1000 <= 0.36


def test_one_reader_is_a_file_read_once_per_sweep() -> None:
    s = bounded(9_000)
    order = random.Random(2).sample(range(1, 1001), 1000)
    for file_id in order[:500]:
        s.read(file_id, 100)
    s.read(order[0], 100)  # one file read again (a page the kernel dropped): still one reader
    assert s.one_reader
    # A second job reading the same files through the same mount, in an order of its own:
    second = random.Random(3).sample(order[:500], 500)
    for file_id in second[:100]:
        s.read(file_id, 100)
    assert not s.one_reader
    # The next sweep is not taken for one reader's until a quarter of the files were read
    # with few rereads (several jobs' reads only meet a tenth into their epochs).
    s.start_over()
    assert not s.one_reader
    for file_id in order[:249]:
        s.read(file_id, 100)
    assert not s.one_reader
    s.read(order[249], 100)
    assert s.one_reader
