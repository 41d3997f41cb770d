"""DELI's cost model over mountd's counters: prices, savings, the stats report, Prometheus text."""

from __future__ import annotations

import pytest
from rich.console import Console

from mountd.stats import costs
from mountd.stats.metrics import render
from quiverfs.cli.mountd_views import print_stats
from quiverfs.testing.prometheus import scraped


def test_every_cloud_has_a_dated_sourced_price_table():
    assert set(costs.PRICES) == {"s3", "az", "gs", "file"}
    assert set(costs.SOURCES) == set(costs.PRICES)
    for scheme in ("s3", "az", "gs"):
        table = costs.PRICES[scheme]
        assert table.read_per_1000 > 0 and table.list_per_1000 > table.read_per_1000
        assert table.egress_per_gb > 0
        assert costs.SOURCES[scheme].startswith("https://")
    assert costs.PRICES_AS_OF.count("-") == 2


def test_s3_savings_are_requests_times_price_plus_bytes_times_egress():
    est = costs.estimate("s3", hits=1000, bytes_from_cache=2 * costs.GB,
                         remote_requests={"GET": 500, "LIST": 2000}, bytes_from_remote=costs.GB)
    # saved: 1000 GETs x $0.0004/1k + 2 GB x $0.09; remote: 500 GETs + 2000 LISTs x $0.005/1k + 1 GB
    assert est.cost_saved == pytest.approx(0.0004 + 0.18)
    assert est.remote_cost == pytest.approx(500 * 0.0004 / 1000 + 2000 * 0.005 / 1000 + 0.09)
    assert (est.requests_saved, est.bytes_saved) == (1000, 2 * costs.GB)


def test_gcs_list_is_class_a_and_head_is_priced_as_a_read():
    gs = costs.PRICES["gs"]
    assert gs.request_price("LIST") == pytest.approx(0.05 / 10_000)
    assert gs.request_price("GET") == gs.request_price("HEAD") == pytest.approx(0.004 / 10_000)


def test_in_region_drops_egress_and_file_costs_nothing():
    est = costs.estimate("az", hits=10_000, bytes_from_cache=10 * costs.GB, remote_requests={},
                         bytes_from_remote=0, in_region=True)
    assert est.cost_saved == pytest.approx(10_000 * 0.00044 / 1000)
    free = costs.estimate("file", hits=10**6, bytes_from_cache=10**12, remote_requests={"GET": 10**6},
                          bytes_from_remote=10**12)
    assert free.cost_saved == 0 and free.remote_cost == 0 and free.requests_saved == 10**6


def test_unknown_or_mixed_scheme_is_not_priced():
    est = costs.estimate("", hits=5, bytes_from_cache=5, remote_requests={}, bytes_from_remote=0)
    assert est.cost_saved is None and est.remote_cost is None and est.requests_saved == 5
    assert costs.scheme_of("S3://bucket/x") == "s3" and costs.scheme_of("/data") == "file"


def _counters(hits, misses, gets, cache_bytes, remote_bytes):
    return {
        "hits": hits, "misses": misses, "prefetches": 0, "bytes_from_cache": cache_bytes,
        "bytes_from_remote": remote_bytes, "remote_requests": {"GET": gets, "HEAD": 0, "LIST": 0},
        "remote_bytes": remote_bytes, "verify_failures": 1, "fill_errors": 0, "evicted_files": 2,
        "evicted_bytes": 20, "fill_latency": {"count": 4, "sum": 0.4, "buckets": {
            "0.001": 0, "0.005": 0, "0.02": 1, "0.1": 2, "0.5": 1, "2.0": 0, "10.0": 0, "+Inf": 0}},
    }


STATS = {
    "counters": {
        "total": _counters(30, 10, 10, 3 * costs.GB, costs.GB),
        "datasets": {"imagenet": _counters(20, 5, 5, 2 * costs.GB, costs.GB // 2),
                     "local": _counters(10, 5, 5, costs.GB, costs.GB // 2)},
        "fills_in_flight": 0,
        "scrub_removed": 0,
    },
    "schemes": {"total": ["file", "s3"], "datasets": {"imagenet": ["s3"], "local": ["file"]}},
    "server": {"connections": 1, "mounts": 0, "uptime": 3.5, "requests_served": 9, "protocol_errors": 0},
}


def test_stats_report_rows():
    report = costs.stats_report(STATS)
    imagenet = report["datasets"]["imagenet"]
    assert imagenet["hit_ratio"] == pytest.approx(20 / 25)
    assert imagenet["cost_saved"] == pytest.approx(20 * 0.0004 / 1000 + 2 * 0.09)
    assert report["datasets"]["local"]["cost_saved"] == 0.0
    # The total mixes two clouds: it is the sum of the priced datasets.
    assert report["total"]["cost_saved"] == pytest.approx(imagenet["cost_saved"])
    assert report["total"]["hit_ratio"] == pytest.approx(0.75)
    assert not report["total_priced_partially"]
    latency = report["total"]["fill_latency"]
    assert latency["mean_s"] == pytest.approx(0.1) and latency["p95_le_s"] == 0.5


def test_prometheus_text_has_totals_datasets_and_cumulative_buckets():
    text = render(STATS, {"used_bytes": 123, "cap_bytes": 1000, "policy": "lru"})
    lines = text.splitlines()
    got = scraped(text)
    assert got["quiverfs_hits_total"] == 30
    assert got['quiverfs_dataset_hits_total{dataset="imagenet"}'] == 20
    assert got['quiverfs_remote_requests_total{kind="GET"}'] == 10
    assert got['quiverfs_fill_latency_seconds_bucket{le="0.1"}'] == 3
    assert got['quiverfs_fill_latency_seconds_bucket{le="+Inf"}'] == 4
    assert got["quiverfs_fill_latency_seconds_count"] == 4
    assert got["quiverfs_cache_used_bytes"] == 123 and got["quiverfs_mountd_uptime_seconds"] == 3.5
    assert lines.count("# TYPE quiverfs_dataset_hits_total counter") == 1
    assert not any("policy" in line for line in lines)  # strings are not metrics


def test_prometheus_label_values_are_escaped():
    stats = {"counters": {"total": {}, "datasets": {'we"ird\\name\n': {"hits": 1}}}}
    assert 'quiverfs_dataset_hits_total{dataset="we\\"ird\\\\name\\n"} 1' in render(stats)


def test_dropped_prefetches_are_counted_apart_from_fill_errors() -> None:
    total = {**_counters(30, 10, 10, 3 * costs.GB, costs.GB), "prefetches": 12,
             "prefetches_dropped": 3}
    stats = {**STATS, "counters": {**STATS["counters"], "total": total}}
    report = costs.stats_report(stats)
    assert report["total"]["prefetches_dropped"] == 3 and report["total"]["fill_errors"] == 0
    assert report["datasets"]["imagenet"]["prefetches_dropped"] == 0  # an older mountd: absent
    console = Console(record=True, width=200)
    print_stats(report, console)
    assert "12 (3 dropped)" in console.export_text()
    assert scraped(render(stats, {"used_bytes": 1, "cap_bytes": 10}))[
        "quiverfs_prefetches_dropped_total"] == 3
