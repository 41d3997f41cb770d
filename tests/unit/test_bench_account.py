"""The benchmarks' account of mountd's bucket reads (scripts/bench/harness/report.py
``BucketAccount``) and of a dataset's modes (scripts/bench/peers/report.py ``modes_of``), on
counters and log lines shaped as mountd writes them. No FUSE, no jobs."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts" / "bench"))

from harness.report import BucketAccount, RemoteDelta  # noqa: E402
from peers.report import modes_of  # noqa: E402


def counters(gets: int, prefetches: int) -> dict:
    return {"remote_requests": {"GET": gets, "HEAD": 0, "LIST": 0}, "prefetches": prefetches,
            "remote_bytes": 1000 * gets, "hits": 0, "misses": 0}


def account(before: dict, after: dict, protection_before: dict,
            protection_after: dict) -> BucketAccount:
    return BucketAccount.of(RemoteDelta.between(before, after), protection_before,
                            protection_after)


def protection(started: int, **ended: int) -> dict:
    return {"started": started, "ended": {"read": 0, "released": 0, "timeout": 0, "demand": 0,
                                          "removed": 0, **ended}}


def test_account_splits_the_gets_of_the_run_only():
    before = account(counters(0, 0), counters(100, 60), protection(0),
                     protection(40, read=30))
    assert before.gets == 100
    run = account(
        counters(100, 60), counters(1_300, 960),
        protection(40, read=30, released=2),
        protection(740, read=630, released=32, timeout=2, demand=18))
    assert run.gets == 1_200
    assert run.prefetches == 900
    assert run.on_demand == 300  # GETs no prefetch made: fills readers waited for
    assert run.fetched_ahead == 700
    assert run.preloads == 200  # prefetches that started no protection: chunk loads
    assert run.on_demand + run.preloads + run.fetched_ahead == run.gets
    assert run.read == 600
    assert run.dropped == {"released": 30, "timeout": 2, "demand": 18}  # zeros left out


def test_account_line_is_in_datasets():
    run = account(
        counters(0, 0), counters(1_200, 900), protection(0),
        protection(700, read=600, released=30, demand=20))
    assert run.line(1_000) == (
        "1.20 = on demand 0.30 + chunk loads 0.20 + fetched ahead 0.70 "
        "(read 0.60, dropped unread 0.05: released 0.03, demand 0.02)")


def test_account_line_without_drops_or_prefetches():
    run = account(counters(0, 0), counters(500, 0), {}, {})
    assert run.on_demand == 500 and run.preloads == 0 and run.dropped == {}
    assert run.line(500) == (
        "1.00 = on demand 1.00 + chunk loads 0.00 + fetched ahead 0.00 (read 0.00, "
        "dropped unread 0.00)")


def test_account_never_counts_negative_parts():
    # A protection started for a file already in flight (a claim of a file a chunk load
    # fetches) makes no prefetch of its own: more protections than prefetches.
    run = account(counters(0, 0), counters(100, 50), {}, protection(70, read=70))
    assert run.preloads == 0
    assert run.on_demand == 50


LOG = [
    "2026-12-02 04:44:00,370 mountd[1] INFO mountd.coop.service: dataset d0: 2000 files, 0 "
    "cached, mode chunked",
    "2026-12-02 04:44:00,384 mountd[1] INFO mountd.coop.service: dataset d0: mode chunked -> "
    "chunked (16419914 bytes): G=2.00, #1 by G per byte: smaller chunks",
    "2026-12-02 04:44:04,228 mountd[1] INFO mountd.coop.service: dataset d0: mode chunked -> off "
    "(0 bytes): G=2.00, #1 by G per byte: no room beside its job's look-ahead",
    "2026-12-02 04:44:14,278 mountd[1] INFO mountd.coop.service: dataset d0: mode off -> chunked "
    "(16419914 bytes): G=2.00",
]


def test_modes_in_order_without_repeats():
    assert modes_of(LOG) == ["chunked", "off", "chunked"]
    assert modes_of(LOG[:2]) == ["chunked"]  # a new budget for the same mode
    assert modes_of(LOG[:1]) == []  # the registration line is not a change
    assert modes_of([]) == []


def test_account_of_a_fresh_mountd():
    after = counters(300, 120)
    fresh = BucketAccount.of(RemoteDelta.since_start(after), {}, protection(100, read=90))
    assert fresh == account(counters(0, 0), after, {}, protection(100, read=90))
    assert RemoteDelta.since_start(after).bytes == 300_000
