"""The read-ahead detector (quiverfs/filesystem/readahead.py): which reads make a scan, exactly
which file ids it asks for, and how its window grows in files and bytes with what the reader reads.
Pure: ids in, ids out; the files' sizes come from a function given here."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from quiverfs.filesystem.readahead import (
    AHEAD,
    LAG,
    START_BYTES,
    START_FILES,
    WINDOW_BYTES,
    ReadAhead,
    window_bytes,
)

FIRST, LAST = 1001, 100_000  # file ids of a digest with 1000 directories and 99,000 files
KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30


def ids(first: int, last: int) -> list[int]:
    return list(range(first, last + 1))


def flat(size: int) -> Callable[[int, int], list[int]]:
    """Sizes of a dataset whose files are all ``size`` bytes."""
    return lambda first, last: [size] * (last - first + 1)


def sized(default: int, **special: int) -> Callable[[int, int], list[int]]:
    """Sizes: ``default`` bytes, but ``special`` ones for the ids named ``f<id>``."""
    sizes = {int(name[1:]): size for name, size in special.items()}
    return lambda first, last: [sizes.get(i, default) for i in range(first, last + 1)]


#: The window these tests' expectations were worked out for (the default was 64 until the
#: batches of mountd's prefetch queue made it 256); the mechanics do not depend on it.
TEST_WINDOW = 64


def detector(window: int = TEST_WINDOW, size: int = 10 * KIB, **kwargs) -> ReadAhead:
    """A detector over FIRST .. LAST, files of ``size`` bytes unless ``sizes=`` says."""
    sizes = kwargs.pop("sizes", flat(size))
    return ReadAhead(FIRST, LAST, sizes, window, **kwargs)


def read_all(ra: ReadAhead, reads: list[int], reader: int = 7) -> list[list[int]]:
    """What each read of ``reads`` (by one reader) asked for."""
    return [ra.observe(file_id, reader) for file_id in reads]


def flatten(asked: list[list[int]]) -> list[int]:
    return [file_id for ids_ in asked for file_id in ids_]


# -- one reader in order: the window in files ---------------------------------------------------


def test_a_scan_is_seen_after_fourteen_steps_and_starts_with_a_small_window() -> None:
    ra = detector()
    assert read_all(ra, ids(1001, 1014)) == [[]] * 14 and not ra.sequential  # 13 steps: not yet
    assert ra.windows() == (0, 0)
    # The 15th read makes the 14th sequential step: the next START_FILES files, at once.
    assert ra.observe(1015, 7) == ids(1016, 1019) and START_FILES == 4
    assert ra.sequential
    # Each file read passes one and widens the window by one: two new files per read.
    assert read_all(ra, ids(1016, 1019)) == [[1020, 1021], [1022, 1023], [1024, 1025], [1026, 1027]]
    assert ra.requested == 4 + 8 and ra.requested_bytes == 12 * 10 * KIB
    # 8 files ahead of 1019; bytes: START_BYTES and the 5 files read since the run began.
    assert ra.windows() == (8, START_BYTES + 5 * 10 * KIB)


def test_the_window_doubles_with_each_window_read_up_to_the_files_given() -> None:
    ra = detector()
    read_all(ra, ids(1001, 1014))
    asked = {1014: 1014}
    for file_id in ids(1015, 1200):
        got = ra.observe(file_id, 7)
        asked[file_id] = got[-1] if got else asked[file_id - 1]
    # The frontier reaching what was asked finds the window twice as wide: 4, 8, 16, 32, 64.
    assert [asked[f] - f for f in (1015, 1019, 1027, 1043, 1075)] == [4, 8, 16, 32, 64]
    assert [asked[f] for f in (1015, 1019, 1027, 1043)] == [1019, 1027, 1043, 1075]
    # Then it stays at `window` files: one new file per file read, nothing asked twice.
    assert all(asked[f] == f + 64 for f in ids(1075, 1200))
    assert ra.requested == 1200 + 64 - 1015 and ra.windows()[0] == 64


def test_a_shell_loop_with_a_new_process_per_file_is_a_scan_too() -> None:
    ra = detector()
    asked = [ra.observe(file_id, reader=5000 + i) for i, file_id in enumerate(ids(1001, 1016))]
    assert asked[:14] == [[]] * 14
    assert asked[14:] == [ids(1016, 1019), [1020, 1021]]


def test_small_gaps_are_a_scan_and_the_window_follows_the_frontier() -> None:
    # Empty files are never read from the mount; a reader may skip a few files.
    ra = detector(window=8)
    reads = [1001 + 3 * i for i in range(16)]  # steps of 3
    asked = read_all(ra, reads)
    assert asked[:14] == [[]] * 14
    assert asked[14] == ids(1044, 1047)  # the run starts at 1043: 4 ahead of it
    # Frontier 1046: three ids passed, the window is 7 files: up to 1053.
    assert asked[15] == ids(1048, 1053)


def test_the_window_stops_at_the_end_of_the_digest() -> None:
    ra = ReadAhead(11, 50, flat(10 * KIB), TEST_WINDOW)
    asked = read_all(ra, ids(11, 50))
    assert asked[14] == ids(26, 29)
    assert flatten(asked) == ids(26, 50) and asked[26:] == [[]] * 14  # 50 is the last file
    assert ra.requested == 25
    assert ra.observe(51, 7) == [] and ra.observe(10, 7) == []  # not file ids


def test_the_window_size_is_the_callers() -> None:
    ra = detector(window=3)
    assert read_all(ra, ids(1001, 1017))[14:] == [[1016, 1017, 1018], [1019], [1020]]
    assert ra.windows()[0] == 3
    with pytest.raises(ValueError):
        detector(window=0)
    with pytest.raises(ValueError):
        detector(max_bytes=0)


# -- the window in bytes --------------------------------------------------------------------------


def test_large_files_are_asked_for_within_the_bytes_read() -> None:
    # 4 MiB files: a new run may hold START_BYTES plus the first file read (8 MiB): 2 files;
    # each file read adds its 4 MiB and frees the 4 MiB it passes: two more per read.
    ra = detector(size=4 * MIB)
    asked = read_all(ra, ids(1001, 1025))
    assert asked[14:] == [ids(1016, 1017), *([1016 + 2 * k, 1017 + 2 * k] for k in range(1, 11))]
    # 1025 read: 11 files (44 MiB) read since the run began, so 48 MiB may be ahead: 12 files,
    # fewer than the 14 its window has in files.
    assert ra.windows() == (4 + 10, START_BYTES + 11 * 4 * MIB)
    assert asked[-1][-1] - 1025 == 12


def test_the_bytes_ahead_never_pass_the_cap() -> None:
    # An eighth of a 256 MiB cache: 32 MiB, 8 files of 4 MiB.
    ra = detector(size=4 * MIB, max_bytes=window_bytes(256 * MIB))
    asked = read_all(ra, ids(1001, 1100))
    assert ra.windows() == (64, 32 * MIB)
    assert all(a == [f + 8] for a, f in zip(asked[22:], ids(1023, 1100), strict=True))
    assert flatten(asked) == ids(1016, 1108)


def test_a_file_larger_than_the_cap_is_read_on_demand_and_the_window_goes_on_after_it() -> None:
    # A cache of 8 MiB: at most 1 MiB ahead, two files of 512 KiB; the 2 MiB file 1030 never.
    ra = detector(sizes=sized(512 * KIB, f1030=2 * MIB), max_bytes=window_bytes(8 * MIB))
    asked = read_all(ra, ids(1001, 1033))
    assert asked[14:29] == [ids(1016, 1017), *([f + 2] for f in ids(1016, 1027)), [], []]
    assert asked[29] == [1031, 1032]  # the reader read 1030 itself: the run goes on after it
    assert asked[30:] == [[1033], [1034], [1035]]
    assert 1030 not in flatten(asked)


def test_small_files_then_large_ones_nobody_reads_are_not_fetched() -> None:
    # The issue: a reader of 2.5 MB of 10 KiB files in one folder made mountd fetch 52.9 MB,
    # because the files after them (30 MB and 1 MB) were next in digest order.
    sizes = sized(10 * KIB, f1251=30_000_000, f1252=1_000_000)
    ra = detector(sizes=sizes)
    asked = flatten(read_all(ra, ids(1001, 1200)))
    # Read up to 1200: the window (64 files) reaches the end of the small files, and stops
    # before the 30 MB file, which alone is more than START_BYTES + the bytes read.
    assert asked == ids(1016, 1250)
    assert ra.requested_bytes == 235 * 10 * KIB
    asked_ahead = 50 * 10 * KIB  # 1201 .. 1250, asked and not read (yet)
    assert asked_ahead <= START_BYTES + 186 * 10 * KIB < 30_000_000
    # Reading on to the end of the small files asks for nothing more; the reader stops there.
    assert flatten(read_all(ra, ids(1201, 1250))) == []
    assert all(ra.reported(f) == [] for f in ids(1100, 1250))  # late hit reports: nothing
    assert ra.requested == 235 and ra.requested_bytes == 235 * 10 * KIB
    # A reader that does go on reads the 30 MB file on demand; its bytes widen the window,
    # and the 1 MB file and the small ones after it come ahead of it again.
    assert ra.observe(1251, 7) == ids(1252, 1315)
    assert ra.requested_bytes == 235 * 10 * KIB + 1_000_000 + 63 * 10 * KIB


def test_a_reader_that_stops_leaves_at_most_one_window_asked() -> None:
    ra = detector(size=100 * KIB)
    asked = flatten(read_all(ra, ids(1001, 1100)))
    assert asked == ids(1016, 1164)  # 64 past the last file read
    # Nothing more is asked without reads: hits reported late land behind the frontier.
    assert all(ra.reported(f) == [] for f in ids(1050, 1100))
    assert ra.requested == len(asked)


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
    ra = detector()
    asked = [ra.observe(file_id, reader) for file_id, reader in arrivals]
    first = next(i for i, a in enumerate(asked) if a)
    assert first == 14  # every step is sequential: the 15th read turns it on
    start = arrivals[first][0]
    assert asked[first] == ids(start + 1, start + 4)
    # Afterwards each read asks for what its progress adds: in all, from the run's start to
    # 64 past the highest file read (the window grew to 64 files), each id once.
    assert flatten(asked) == ids(start + 1, 1001 + 8 * 12 - 1 + 64)


def test_readers_drifting_apart_stay_one_scan_within_the_lag() -> None:
    ra = detector()
    fast, slow = 1, 2
    for i in range(40):  # both at the start
        ra.observe(1001 + 2 * i, fast)
        ra.observe(1002 + 2 * i, slow)
    assert ra.sequential
    frontier = 1080
    # The fast reader runs ahead; the slow one keeps reading LAG - 1 behind it.
    for file_id in ids(1081, 1081 + LAG):
        ra.observe(file_id, fast)
        frontier = file_id
    assert ra.observe(frontier - LAG + 1, slow) == []  # in the run: nothing new, still a scan
    assert ra.sequential and ra.observe(frontier + 1, fast) == [frontier + 1 + 64]


def test_two_scans_at_two_places_each_get_a_window_and_nothing_twice() -> None:
    ra = detector()
    asked_a, asked_b = [], []
    for i in range(40):
        asked_a += ra.observe(1001 + i, 1)
        asked_b += ra.observe(50_001 + i, 2)
    # Reader 1's first read after the other's is a long step; each own step is +1: the 15th
    # read turns it on, at reader 2's 8th file, then reader 1's 9th starts a run of its own.
    assert ra.sequential
    assert asked_b[:4] == ids(50_009, 50_012) and asked_a[:4] == ids(1010, 1013)
    # Each window grew by the 31 files its reader read since: 35 files.
    assert asked_a == ids(1010, 1040 + 35)
    assert asked_b == ids(50_009, 50_040 + 36)  # its run began one read earlier
    assert ra.windows() == (36, START_BYTES + 33 * 10 * KIB)


def test_runs_that_meet_merge_and_no_id_is_asked_twice() -> None:
    ra = detector(window=16)
    everything = []
    for i in range(20):  # a scan from 1001 …
        everything += ra.observe(1001 + i, 1)
    for i in range(20):  # … and one from 1201, which the first one will reach
        everything += ra.observe(1201 + i, 2)
    for i in range(20, 400):
        everything += ra.observe(1001 + i, 1)
    assert len(everything) == len(set(everything))
    assert everything[-1] == 1400 + 16  # one window past the end of the first scan
    # Every id from the first window on, but 1202, where the second run began (its first
    # read, 1201, was a long step: a stray read; the first run asked for it on its way).
    assert sorted(everything) == [f for f in ids(1016, 1416) if f != 1202]
    assert ra.windows()[0] == 16


def test_a_scan_that_starts_over_gets_a_new_small_window() -> None:
    ra = detector()
    read_all(ra, ids(1001, 3000))
    assert ra.observe(1001, 7) == []  # one jump back is a stray read …
    assert ra.observe(1002, 7) == ids(1003, 1006)  # … a step from there starts a new run
    assert ra.observe(1003, 7) == [1007, 1008]


# -- random reads -------------------------------------------------------------------------------


@pytest.mark.parametrize("files", [400, 1_000, 99_000])
def test_a_shuffled_order_asks_for_nothing(files: int) -> None:
    order = ids(FIRST, FIRST + files - 1)
    for seed in range(5):
        random.Random(seed).shuffle(order)
        ra = ReadAhead(FIRST, FIRST + files - 1, flat(10 * KIB), TEST_WINDOW)
        assert all(ra.observe(file_id, 7) == [] for file_id in order)
        assert all(ra.reported(file_id) == [] for file_id in order)
        assert not ra.sequential and ra.requested == 0 and ra.requested_bytes == 0


def test_several_readers_of_a_shuffled_order_ask_for_nothing() -> None:
    order = ids(FIRST, FIRST + 4999)
    random.Random(1).shuffle(order)
    ra = ReadAhead(FIRST, FIRST + 4999, flat(10 * KIB), TEST_WINDOW)
    assert all(ra.observe(file_id, 100 + i % 8) == [] for i, file_id in enumerate(order))


def test_when_the_reads_turn_random_read_ahead_stops_and_comes_back_with_a_scan() -> None:
    ra = detector()
    read_all(ra, ids(1001, 1100))
    assert ra.sequential
    shuffled = random.Random(2).sample(ids(FIRST, LAST), 1000)
    asked = read_all(ra, shuffled)
    stopped = next(i for i, _ in enumerate(asked) if not ra.sequential or i > 20)
    assert stopped <= 20 and not ra.sequential  # off within a few random reads …
    assert sum(len(a) for a in asked) <= 2 * (TEST_WINDOW + AHEAD)  # … asking for little meanwhile
    assert ra.windows() == (0, 0)  # its runs are gone
    # A scan elsewhere turns it on again, with a fresh, small window there.
    asked = read_all(ra, ids(70_001, 70_030))
    start = next(i for i, a in enumerate(asked) if a)
    assert asked[start] == ids(70_002 + start, 70_005 + start)


def test_a_reader_stepping_back_a_little_is_still_a_scan() -> None:
    reads = []
    for block in range(10):  # pairs read out of order: 1002, 1001, 1004, 1003, ...
        base = 1001 + 2 * block
        reads += [base + 1, base]
    ra = detector()
    asked = read_all(ra, reads)
    assert ra.sequential and asked[14] == ids(reads[14] + 1, reads[14] + 4)
    assert asked[15] == []  # 1015, behind the frontier 1016: nothing new


# -- hit reports --------------------------------------------------------------------------------


def test_reported_hits_move_the_window_but_never_start_it() -> None:
    ra = detector()
    assert all(ra.reported(file_id) == [] for file_id in ids(1001, 1100))  # hits alone: no scan
    assert not ra.sequential
    read_all(ra, ids(2001, 2014))
    assert ra.observe(2015, 7) == ids(2016, 2019)
    # Hits arrive in batches, one worker's after another's: ahead of the frontier they move
    # it (15 files passed: a window of 19), behind it (a late batch) they change nothing.
    assert ra.reported(2030) == ids(2031, 2049)  # 2020 .. 2030 are being read: not asked
    assert ra.reported(2020) == []
    assert ra.reported(2031) == [2050, 2051]
    assert ra.reported(2031 - LAG - 1) == []  # far behind every run
    assert ra.reported(2051 + AHEAD + 1) == []  # far past what was asked for: not this scan


def test_misses_inside_the_window_keep_the_scan_going() -> None:
    # Once read-ahead works, a reader's reads are mostly hits the main process never sees
    # in order; the few misses it sees (files still being fetched) are far apart.
    ra = detector()
    read_all(ra, ids(1001, 1015))
    for frontier in range(1100, 5000, 100):
        ra.reported(frontier - 40)  # a late batch of hits moves the window
        ra.observe(frontier - 30, 7)  # then a miss 100 files after the last
        assert ra.sequential


# -- the cost of knowing sizes -------------------------------------------------------------------


def test_sizes_are_asked_for_a_few_ids_at_a_time() -> None:
    calls: list[tuple[int, int]] = []

    def sizes(first: int, last: int) -> list[int]:
        calls.append((first, last))
        return [10 * KIB] * (last - first + 1)

    ra = ReadAhead(FIRST, LAST, sizes, TEST_WINDOW)
    read_all(ra, ids(1001, 6000))
    # One range for the ids each read passes and one for those it asks for: about two ids
    # per file read, never more than a window's worth at once.
    assert max(last - first + 1 for first, last in calls) <= TEST_WINDOW
    assert sum(last - first + 1 for first, last in calls) <= 2 * 5000 + TEST_WINDOW


def test_window_bytes_is_an_eighth_of_the_cache_at_most_512_mib() -> None:
    assert window_bytes(8 * MIB) == MIB  # 8 files of 1 MiB: one ahead
    assert window_bytes(1 * GIB) == 128 * MIB
    assert window_bytes(100 * GIB) == WINDOW_BYTES == 512 * MIB
    assert window_bytes(None) == WINDOW_BYTES  # unknown cache size
    assert window_bytes(3) == 1
