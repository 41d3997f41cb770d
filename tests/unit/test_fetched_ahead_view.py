"""`quiverfs stats`' read-ahead figures: mountd's line on the files it fetched ahead (read,
unread now, dropped unread: the cache's ``protection``, mountd/store/holds.py), and each
mount's files and bytes sent for read-ahead in the mounts table."""

from __future__ import annotations

from rich.console import Console

from quiverfs.cli.mountd_views import print_fetched_ahead, print_mounts

MIB = 1 << 20


def shown(print_it, *args) -> str:
    console = Console(record=True, width=400)
    print_it(*args, console)
    return console.export_text()


def test_the_fetched_ahead_line_splits_what_was_fetched_by_what_became_of_it() -> None:
    protection = {
        "files": 4, "bytes": 3 * MIB, "cap_bytes": 512 * MIB, "seconds": 30.0,
        "started": 120, "started_bytes": 60 * MIB,
        "ended": {"read": 100, "released": 0, "timeout": 15, "demand": 1, "removed": 0},
        "ended_bytes": {"read": 2 * MIB, "released": 0, "timeout": 50 * MIB, "demand": 5 * MIB,
                        "removed": 0},
        "waiting": 0,
    }
    assert shown(print_fetched_ahead, protection).strip() == (
        "fetched ahead 120 files (60.0 MiB): read 100 files (2.0 MiB), unread now 4 files "
        "(3.0 MiB), dropped unread 16 files (55.0 MiB: timeout 15, demand 1)")


def test_nothing_dropped_shows_no_reasons() -> None:
    protection = {"files": 0, "bytes": 0, "started": 2, "started_bytes": 2000,
                  "ended": {"read": 2, "timeout": 0}, "ended_bytes": {"read": 2000, "timeout": 0}}
    assert shown(print_fetched_ahead, protection).strip() == (
        "fetched ahead 2 files (2.0 KiB): read 2 files (2.0 KiB), unread now 0 files (0 B), "
        "dropped unread 0 files (0 B)")


def test_a_claims_hits_kept_for_their_readers_get_a_line_of_their_own() -> None:
    """Kept hits fetched nothing: not in the fetched-ahead figures, a second line once any
    was kept, none before (or from a mountd that does not keep them)."""
    protection = {
        "files": 0, "bytes": 0, "started": 2, "started_bytes": 2000,
        "ended": {"read": 2, "timeout": 0}, "ended_bytes": {"read": 2000, "timeout": 0},
        "kept": {"files": 1, "bytes": MIB, "started": 40, "started_bytes": 40 * MIB,
                 "ended": {"read": 37, "released": 2, "timeout": 0},
                 "ended_bytes": {"read": 37 * MIB, "released": 2 * MIB, "timeout": 0}},
    }
    assert shown(print_fetched_ahead, protection).strip().splitlines() == [
        "fetched ahead 2 files (2.0 KiB): read 2 files (2.0 KiB), unread now 0 files (0 B), "
        "dropped unread 0 files (0 B)",
        "kept for their readers 40 files (40.0 MiB): read 37 files (37.0 MiB), unread now 1 "
        "file (1.0 MiB), dropped unread 2 files (2.0 MiB: released 2)"]
    none_kept = {**protection, "kept": {**protection["kept"], "started": 0}}
    assert len(shown(print_fetched_ahead, none_kept).strip().splitlines()) == 1


def test_an_older_mountd_without_bytes_shows_files() -> None:
    protection = {"files": 1, "bytes": 10, "started": 5,
                  "ended": {"read": 2, "released": 0, "timeout": 2, "demand": 0, "removed": 0}}
    assert shown(print_fetched_ahead, protection).strip() == (
        "fetched ahead 5 files: read 2 files, unread now 1 file (10 B), dropped unread 2 files "
        "(timeout 2)")


def test_the_mounts_table_shows_each_mounts_read_ahead_and_sweep() -> None:
    rows = [
        {"mountpoint": "/mnt/on", "dataset": "a" * 64, "pid": 10,
         "stats": {"opens": 5, "hits": 4, "misses": 1, "reads": 9, "bytes": 100, "errors": 0,
                   "readahead": 64, "readahead_files": 12, "readahead_bytes": 3 * MIB,
                   "sweep": 8, "sweep_running": True, "sweep_files": 40, "sweep_bytes": 5 * MIB}},
        {"mountpoint": "/mnt/off", "dataset": "b" * 64, "pid": 11,
         "stats": {"opens": 1, "hits": 0, "misses": 1, "reads": 1, "bytes": 1, "errors": 0,
                   "readahead": 0, "readahead_files": 0, "readahead_bytes": 0,
                   "sweep": 0, "sweep_running": False, "sweep_files": 0, "sweep_bytes": 0}},
        {"mountpoint": "/mnt/big", "dataset": "d" * 64, "pid": 13,
         "stats": {"opens": 1, "hits": 0, "misses": 1, "reads": 1, "bytes": 1, "errors": 0,
                   "readahead": 64, "readahead_files": 0, "readahead_bytes": 0,
                   "sweep": 8, "sweep_running": False, "sweep_files": 0, "sweep_bytes": 0}},
        {"mountpoint": "/mnt/bounded", "dataset": "e" * 64, "pid": 14,
         "stats": {"opens": 1, "hits": 0, "misses": 1, "reads": 1, "bytes": 1, "errors": 0,
                   "readahead": 64, "readahead_files": 0, "readahead_bytes": 0,
                   "sweep": 8, "sweep_running": True, "sweep_files": 9, "sweep_bytes": MIB,
                   "sweep_bound_bytes": 4 * MIB, "sweep_unread_bytes": MIB // 2}},
        {"mountpoint": "/mnt/gone", "dataset": "c" * 64, "pid": 12, "stats": None,
         "stats_error": "not a mount point"},
    ]
    lines = shown(print_mounts, rows).splitlines()
    cells = {line.split("│")[1].strip(): (line.split("│")[-3].strip(), line.split("│")[-2].strip())
             for line in lines if "/mnt/" in line}
    assert cells == {"/mnt/on": ("12 (3.0 MiB)", "40 (5.0 MiB)"), "/mnt/off": ("off", "off"),
                     "/mnt/big": ("0 (0 B)", "idle"), "/mnt/gone": ("-", "-"),
                     "/mnt/bounded": ("0 (0 B)", "9 (1.0 MiB), unread 512.0 KiB of 4.0 MiB")}
