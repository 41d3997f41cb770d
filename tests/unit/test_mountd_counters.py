"""mountd.stats.counters: per-dataset and total counts, histogram buckets, JSON snapshots."""

from __future__ import annotations

import json

from mountd.stats.counters import LATENCY_BUCKETS, RECENT, Counters


def test_counts_go_to_total_and_dataset():
    c = Counters()
    c.add_hits("a", 3, 300)
    c.add_hits(None, 1, 10)
    c.add_miss("a")
    c.add_request("a", "GET", 1000)
    c.add_request("b", "LIST")
    c.add_fill("a", 1000, 0.003)
    c.add_verify_failure("b")
    c.add_eviction(["a", "b"], 2, 2000)
    snap = c.snapshot()
    json.dumps(snap)  # JSON-ready
    total, a, b = snap["total"], snap["datasets"]["a"], snap["datasets"]["b"]
    assert (total["hits"], total["bytes_from_cache"]) == (4, 310)
    assert (a["hits"], a["bytes_from_cache"], a["misses"]) == (3, 300, 1)
    assert total["remote_requests"] == {"GET": 1, "HEAD": 0, "LIST": 1}
    assert a["remote_requests"] == {"GET": 1, "HEAD": 0, "LIST": 0}
    assert (total["remote_bytes"], a["bytes_from_remote"]) == (1000, 1000)
    assert (total["verify_failures"], a["verify_failures"], b["verify_failures"]) == (1, 0, 1)
    assert (total["evicted_files"], total["evicted_bytes"]) == (2, 2000)  # counted once in total
    assert a["evicted_files"] == 2 and b["evicted_bytes"] == 2000
    assert snap["fills_in_flight"] == 0


def test_latency_histogram_buckets():
    c = Counters()
    for seconds in (0.0005, 0.001, 0.004, 0.5, 100.0):
        c.add_fill(None, 1, seconds)
    hist = c.snapshot()["total"]["fill_latency"]
    assert hist["count"] == 5
    assert abs(hist["sum"] - 100.5055) < 1e-9
    names = [repr(b) for b in LATENCY_BUCKETS] + ["+Inf"]
    assert list(hist["buckets"]) == names
    assert hist["buckets"]["0.0005"] == 1  # upper bounds are inclusive
    assert hist["buckets"]["0.001"] == 1
    assert hist["buckets"]["0.002"] == 0
    assert hist["buckets"]["0.005"] == 1
    assert hist["buckets"]["0.5"] == 1
    assert hist["buckets"]["+Inf"] == 1
    assert sum(hist["buckets"].values()) == 5
    # exact percentiles of the latest fills: the median of five is the third
    assert hist["recent"] == {"count": 5, "p50": 0.004, "p95": 100.0}


def test_latency_percentiles_cover_only_the_latest_fills():
    c = Counters()
    for _ in range(RECENT):
        c.add_fill(None, 1, 10.0)
    for _ in range(RECENT // 2 + 1):  # more than half of the window is now fast
        c.add_fill(None, 1, 0.001)
    hist = c.snapshot()["total"]["fill_latency"]
    assert hist["count"] == RECENT + RECENT // 2 + 1
    assert hist["recent"]["count"] == RECENT
    assert hist["recent"]["p50"] == 0.001 and hist["recent"]["p95"] == 10.0
