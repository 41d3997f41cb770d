"""The read-ahead detector (quiverfs/readahead.py): which reads make a scan, and exactly which
file ids it asks for. Pure: ids in, ids out."""

from __future__ import annotations

import random

import pytest

from quiverfs.readahead import AHEAD, LAG, WINDOW, WINDOW_BYTES, ReadAhead, window_bytes, window_for

FIRST, LAST = 1001, 100_000  # file ids of a digest with 1000 directories and 99,000 files


def ids(first: int, last: int) -> list[int]:
    return list(range(first, last + 1))


def read_all(ra: ReadAhead, reads: list[int], reader: int = 7) -> list[list[int]]:
    """What each read of ``reads`` (by one reader) asked for."""
    return [ra.observe(file_id, reader) for file_id in reads]


# -- one reader in order ---------------------------------------------------------------------


def test_a_scan_is_seen_after_fourteen_steps_and_read_ahead_by_the_window() -> None:
    ra = ReadAhead(FIRST, LAST)
    asked = read_all(ra, ids(1001, 1014))
    assert asked == [[]] * 14 and not ra.sequential  # 13 steps: not yet
    # The 15th read makes the 14th sequential step: the next 64 files, at once.
    assert ra.observe(1015, 7) == ids(1016, 1079)
    assert ra.sequential
    # Then one more file per file read: the window slides, nothing is asked for twice.
    assert read_all(ra, ids(1016, 1020)) == [[1080], [1081], [1082], [1083], [1084]]
    assert ra.requested == 64 + 5


def test_a_shell_loop_with_a_new_process_per_file_is_a_scan_too() -> None:
    ra = ReadAhead(FIRST, LAST)
    asked = [ra.observe(file_id, reader=5000 + i) for i, file_id in enumerate(ids(1001, 1016))]
    assert asked[:14] == [[]] * 14
    assert asked[14:] == [ids(1016, 1079), [1080]]


def test_small_gaps_are_a_scan_and_the_window_follows_the_frontier() -> None:
    # Empty files are never read from the mount; a reader may skip a few files.
    ra = ReadAhead(FIRST, LAST, window=8)
    reads = [1001 + 3 * i for i in range(16)]  # steps of 3
    asked = read_all(ra, reads)
    assert asked[:14] == [[]] * 14
    assert asked[14] == ids(1044, 1051)  # the run starts at 1043: 8 ahead of it
    assert asked[15] == ids(1052, 1054)  # frontier 1046: up to 1054


def test_the_window_stops_at_the_end_of_the_digest() -> None:
    ra = ReadAhead(11, 50)
    asked = read_all(ra, ids(11, 50))
    assert asked[14] == ids(26, 50)  # 64 asked, 25 left
    assert all(a == [] for a in asked[15:])
    assert ra.requested == 25
    assert ra.observe(51, 7) == [] and ra.observe(10, 7) == []  # not file ids


def test_the_window_size_is_the_callers() -> None:
    ra = ReadAhead(FIRST, LAST, window=3)
    assert read_all(ra, ids(1001, 1016))[14:] == [[1016, 1017, 1018], [1019]]
    with pytest.raises(ValueError):
        ReadAhead(FIRST, LAST, window=0)


# -- several readers ---------------------------------------------------------------------------


def test_eight_readers_of_interleaved_shares_are_one_scan() -> None:
    # Reader r reads files k, k+8, k+16, ... of its share; the main process sees their reads
    # as they come, in a different order within each round.
    order = random.Random(8)
    arrivals = []
    for round_ in range(12):
        readers = list(range(8))
        order.shuffle(readers)
        arrivals += [(1001 + 8 * round_ + r, 100 + r) for r in readers]
    ra = ReadAhead(FIRST, LAST)
    asked = [ra.observe(file_id, reader) for file_id, reader in arrivals]
    first = next(i for i, a in enumerate(asked) if a)
    assert first == 14  # every step is sequential: the 15th read turns it on
    start = arrivals[first][0]
    assert asked[first] == ids(start + 1, start + 64)
    # Afterwards each read asks for what its progress adds: in all, from the run's start to
    # 64 past the highest file read, each id once.
    everything = [i for a in asked for i in a]
    assert everything == ids(start + 1, 1001 + 8 * 12 - 1 + 64)


def test_readers_drifting_apart_stay_one_scan_within_the_lag() -> None:
    ra = ReadAhead(FIRST, LAST)
    fast, slow = 1, 2
    for i in range(20):  # both at the start
        ra.observe(1001 + 2 * i, fast)
        ra.observe(1002 + 2 * i, slow)
    assert ra.sequential
    frontier = 1040
    # The fast reader runs ahead; the slow one keeps reading LAG - 1 behind it.
    for file_id in ids(1041, 1041 + LAG):
        ra.observe(file_id, fast)
        frontier = file_id
    assert ra.observe(frontier - LAG + 1, slow) == []  # in the run: nothing new, still a scan
    assert ra.sequential and ra.observe(frontier + 1, fast) == [frontier + 1 + 64]


def test_two_scans_at_two_places_each_get_a_window_and_nothing_twice() -> None:
    ra = ReadAhead(FIRST, LAST)
    asked_a, asked_b = [], []
    for i in range(40):
        asked_a += ra.observe(1001 + i, 1)
        asked_b += ra.observe(50_001 + i, 2)
    # Reader 1's first read after the other's is a long step; each own step is +1.
    assert ra.sequential
    assert asked_a == ids(asked_a[0], 1001 + 39 + 64)
    assert asked_b == ids(asked_b[0], 50_001 + 39 + 64)
    assert not set(asked_a) & set(asked_b)


def test_runs_that_meet_merge_and_no_id_is_asked_twice() -> None:
    ra = ReadAhead(FIRST, LAST, window=16)
    everything = []
    for i in range(20):  # a scan from 1001 …
        everything += ra.observe(1001 + i, 1)
    for i in range(20):  # … and one from 1201, which the first one will reach
        everything += ra.observe(1201 + i, 2)
    for i in range(20, 400):
        everything += ra.observe(1001 + i, 1)
    assert len(everything) == len(set(everything))
    assert everything[-1] == 1400 + 16  # one window past the end of the first scan


def test_a_scan_that_starts_over_gets_a_new_window() -> None:
    ra = ReadAhead(FIRST, LAST)
    read_all(ra, ids(1001, 3000))
    assert ra.observe(1001, 7) == []  # one jump back is a stray read …
    assert ra.observe(1002, 7) == ids(1003, 1066)  # … a step from there starts a new run
    assert ra.observe(1003, 7) == [1067]


# -- random reads -------------------------------------------------------------------------------


@pytest.mark.parametrize("files", [400, 1_000, 99_000])
def test_a_shuffled_order_asks_for_nothing(files: int) -> None:
    order = ids(FIRST, FIRST + files - 1)
    for seed in range(5):
        random.Random(seed).shuffle(order)
        ra = ReadAhead(FIRST, FIRST + files - 1)
        assert all(ra.observe(file_id, 7) == [] for file_id in order)
        assert all(ra.reported(file_id) == [] for file_id in order)
        assert not ra.sequential and ra.requested == 0


def test_several_readers_of_a_shuffled_order_ask_for_nothing() -> None:
    order = ids(FIRST, FIRST + 4999)
    random.Random(1).shuffle(order)
    ra = ReadAhead(FIRST, FIRST + 4999)
    assert all(ra.observe(file_id, 100 + i % 8) == [] for i, file_id in enumerate(order))


def test_when_the_reads_turn_random_read_ahead_stops_and_comes_back_with_a_scan() -> None:
    ra = ReadAhead(FIRST, LAST)
    read_all(ra, ids(1001, 1100))
    assert ra.sequential
    shuffled = random.Random(2).sample(ids(FIRST, LAST), 1000)
    asked = read_all(ra, shuffled)
    stopped = next(i for i, _ in enumerate(asked) if not ra.sequential or i > 20)
    assert stopped <= 20 and not ra.sequential  # off within a few random reads …
    assert sum(len(a) for a in asked) <= 2 * (WINDOW + AHEAD)  # … asking for little meanwhile
    # A scan elsewhere turns it on again, with a fresh window there.
    asked = read_all(ra, ids(70_001, 70_030))
    start = next(i for i, a in enumerate(asked) if a)
    assert asked[start] == ids(70_002 + start, 70_001 + start + 64)


def test_a_reader_stepping_back_a_little_is_still_a_scan() -> None:
    reads = []
    for block in range(10):  # pairs read out of order: 1002, 1001, 1004, 1003, ...
        base = 1001 + 2 * block
        reads += [base + 1, base]
    ra = ReadAhead(FIRST, LAST)
    asked = read_all(ra, reads)
    assert ra.sequential and asked[14] == ids(reads[14] + 1, reads[14] + 64)


# -- hit reports --------------------------------------------------------------------------------


def test_reported_hits_move_the_window_but_never_start_it() -> None:
    ra = ReadAhead(FIRST, LAST)
    assert all(ra.reported(file_id) == [] for file_id in ids(1001, 1100))  # hits alone: no scan
    assert not ra.sequential
    read_all(ra, ids(2001, 2014))
    assert ra.observe(2015, 7) == ids(2016, 2079)
    # Hits arrive in batches, one worker's after another's: ahead of the frontier they move
    # it, behind it (a late batch) they change nothing.
    assert ra.reported(2030) == ids(2080, 2094)
    assert ra.reported(2020) == []
    assert ra.reported(2031) == [2095]
    assert ra.reported(2030 - LAG - 1) == []  # far behind every run
    assert ra.reported(2095 + AHEAD + 1) == []  # far past what was asked for: not this scan


def test_misses_inside_the_window_keep_the_scan_going() -> None:
    # Once read-ahead works, a reader's reads are mostly hits the main process never sees
    # in order; the few misses it sees (files still being fetched) are far apart.
    ra = ReadAhead(FIRST, LAST)
    read_all(ra, ids(1001, 1015))
    for frontier in range(1100, 5000, 100):
        ra.reported(frontier - 40)  # a late batch of hits moves the window
        ra.observe(frontier - 30, 7)  # then a miss 100 files after the last
        assert ra.sequential


# -- the window in bytes ------------------------------------------------------------------------


def test_window_for_caps_the_window_in_bytes() -> None:
    kib, mib, gib = 1 << 10, 1 << 20, 1 << 30
    assert window_for(64, 1000 * 110 * kib, 1000) == 64  # ImageNet-like files
    assert window_for(64, 10 * 100 * mib, 10) == 5  # 512 MiB / 100 MiB
    assert window_for(64, 4 * 2 * gib, 4) == 1  # at least one file
    assert window_for(0, 1000, 10) == 0  # off stays off
    assert window_for(64, 0, 10) == 64 and window_for(64, 0, 0) == 64  # empty files only, none
    assert window_for(64, 10 * mib, 10, max_bytes=4 * mib) == 4


def test_window_bytes_is_an_eighth_of_the_cache_at_most_512_mib() -> None:
    mib, gib = 1 << 20, 1 << 30
    assert window_bytes(8 * mib) == mib  # 8 files of 1 MiB: one ahead
    assert window_bytes(1 * gib) == 128 * mib
    assert window_bytes(100 * gib) == WINDOW_BYTES == 512 * mib
    assert window_bytes(None) == WINDOW_BYTES  # unknown cache size
    assert window_bytes(3) == 1
    assert window_for(64, 40 * mib, 40, window_bytes(8 * mib)) == 1  # the 8 MiB cache above
