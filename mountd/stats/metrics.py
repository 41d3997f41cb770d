"""Prometheus metrics: mountd's counters as Prometheus series, on ``/metrics`` over a tiny HTTP responder.

``GET /metrics`` on ``127.0.0.1:PORT`` (``quiverfs mountd --metrics-port PORT``) answers with
format 0.0.4 text. It is loopback-only on purpose: scrape it with a local agent, or put a
proxy in front. Totals have no label (``quiverfs_hits_total``); per-dataset series carry a
``dataset`` label (``quiverfs_dataset_hits_total{dataset="…"}``), so neither double-counts.

The series are ``prometheus_client``'s: :class:`MountdCollector` is a custom collector that
reads a ``stats`` answer (and ``usage``) when it is scraped and yields them as metric
families; ``prometheus_client``'s registry and :func:`~prometheus_client.generate_latest`
write the exposition (names, ``HELP``/``TYPE`` once per family, label escaping, numbers in
Go's float format). mountd keeps no second set of counters: it has its own
(:mod:`mountd.stats.counters`), kept on the trio thread, and those are what a scrape reads.

The HTTP responder stays ours, in the trio loop, rather than ``prometheus_client``'s
``start_http_server``: that one serves from a thread of its own, and a scrape there would
read mountd's state (the cache's counters, the session layer's allocation) from outside the
trio thread that owns it and changes it without locks. Ours reads one request (at most
8 KiB, within 5 s), calls ``generate_latest`` on the trio thread, answers and closes: enough
for a scraper, with nothing to configure.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import trio
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

log = logging.getLogger("mountd.stats.metrics")

#: counter key in a counters snapshot → (metric suffix, help text). Order is output order.
COUNTERS: dict[str, tuple[str, str]] = {
    "hits": ("hits_total", "Reads served from the cache (RPC or client-reported)."),
    "misses": ("misses_total", "ensure() calls that waited for a remote fill."),
    "prefetches": ("prefetches_total", "Fills started by prefetch."),
    "bytes_from_cache": ("cache_bytes_total", "Content bytes served from the cache."),
    "bytes_from_remote": ("remote_fill_bytes_total", "Verified content bytes fetched from remotes."),
    "remote_bytes": ("remote_received_bytes_total", "Bytes received from remotes."),
    "verify_failures": ("verify_failures_total", "Fills rejected: size or blake3 mismatch."),
    "fill_errors": ("fill_errors_total", "Fills that failed for other reasons."),
    "prefetches_dropped": ("prefetches_dropped_total",
                           "Fills nobody waited for, dropped: the rest of the cache was pinned or protected."),
    "evicted_files": ("evicted_files_total", "Files evicted from the cache."),
    "evicted_bytes": ("evicted_bytes_total", "Bytes evicted from the cache."),
    "chunk_fills": ("chunk_fills_total", "Ranged GETs that filled several members of one packed object."),
    "chunk_members": ("chunk_members_total", "Files stored by chunk fills."),
}

#: cluster counter key (``stats`` → ``cluster``, docs/cluster.md) → (metric, help text).
CLUSTER_COUNTERS: dict[str, tuple[str, str]] = {
    "peer_hits": ("peer_hits_total", "Misses served by a peer mountd."),
    "peer_bytes": ("peer_bytes_total", "Content bytes received from peers (verified)."),
    "peer_misses": ("peer_misses_total", "Peers asked that did not hold the file."),
    "bucket_turns": ("bucket_turns_total", "Bucket fetches this node made for the cluster."),
    "lock_waits": ("lock_waits_total", "Misses that waited for another node's fetch."),
    "take_overs": ("take_overs_total", "Fill locks taken over from a node that died."),
    "pushes": ("pushes_total", "Fetched files pushed to their owner."),
    "push_errors": ("push_errors_total", "Pushes that failed."),
    "served_hits": ("served_hits_total", "Files served to peers."),
    "served_bytes": ("served_bytes_total", "Bytes served to peers."),
    "served_misses": ("served_misses_total", "Peer requests for files not held here."),
    "pushes_received": ("pushes_received_total", "Files peers pushed here and were stored."),
    "auth_failures": ("auth_failures_total", "Peer connections refused: wrong cluster secret."),
    "redis_errors": ("redis_errors_total", "Redis calls that failed."),
    "membership_changes": ("membership_changes_total", "Changes of the member list seen."),
}

MAX_REQUEST = 8192
REQUEST_TIMEOUT = 5.0

#: What a scrape reads: a ``stats`` answer and the cache's ``usage`` (None: none).
Snapshot = Callable[[], tuple[dict[str, Any], dict[str, Any] | None]]


class _Families:
    """The metric families of one scrape, in the order they were first sampled: a family
    is made at its first sample (a series with no sample is not declared) and takes the
    label names of that sample."""

    _KINDS = {"counter": CounterMetricFamily, "gauge": GaugeMetricFamily}

    def __init__(self) -> None:
        self._by_name: dict[str, Metric] = {}

    def sample(self, name: str, kind: str, help_text: str, value: Any,
               labels: dict[str, str] | None = None) -> None:
        labels = labels or {}
        family = self._by_name.get(name)
        if family is None:
            family = self._by_name[name] = self._KINDS[kind](name, help_text, labels=list(labels))
        family.add_metric(list(labels.values()), float(value))

    def histogram(self, name: str, help_text: str, snapshot: dict[str, Any],
                  labels: dict[str, str]) -> None:
        """A histogram from a :meth:`mountd.stats.counters.Histogram.snapshot` (per-bucket
        counts, made cumulative here; the ``+Inf`` bucket is the count)."""
        family = self._by_name.get(name)
        if family is None:
            family = self._by_name[name] = HistogramMetricFamily(name, help_text, labels=list(labels))
        cumulative = 0
        buckets = []
        for bound, count in snapshot.get("buckets", {}).items():
            cumulative += count
            buckets.append((bound, cumulative))
        if not buckets:
            buckets = [("+Inf", snapshot.get("count", 0))]
        family.add_metric(list(labels.values()), buckets, float(snapshot.get("sum", 0.0)))

    def __iter__(self) -> Iterator[Metric]:
        return iter(self._by_name.values())


class MountdCollector:
    """A ``prometheus_client`` collector of mountd's series, read from ``snapshot`` at every
    scrape (see the module docstring). Call it on mountd's trio thread only."""

    def __init__(self, snapshot: Snapshot) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        stats, usage = self._snapshot()
        out = _Families()
        counters = stats.get("counters", {})
        _counter_set(out, "quiverfs", counters.get("total", {}), {})
        for dataset, per in counters.get("datasets", {}).items():
            _counter_set(out, "quiverfs_dataset", per, {"dataset": dataset})
        if "fills_in_flight" in counters:
            out.sample("quiverfs_fills_in_flight", "gauge", "Fills running now.", counters["fills_in_flight"])
        if "scrub_removed" in counters:
            out.sample("quiverfs_scrub_removed_total", "counter",
                       "Entries removed by scrub and recovery.", counters["scrub_removed"])
        server = stats.get("server", {})
        for key, kind, help_text in (
            ("connections", "gauge", "Client connections open now."),
            ("mounts", "gauge", "Registered mounts."),
            ("uptime", "gauge", "Seconds since mountd started."),
            ("requests_served", "counter", "Requests answered."),
            ("protocol_errors", "counter", "Malformed frames and requests."),
        ):
            if key in server:
                name = f"quiverfs_mountd_{key}" + ("_total" if kind == "counter" else "")
                if key == "uptime":
                    name = "quiverfs_mountd_uptime_seconds"
                out.sample(name, kind, help_text, server[key])
        _cluster(out, stats.get("cluster"))
        _allocation(out, stats.get("allocation") or {})
        for key, value in sorted((usage or {}).items()):
            if isinstance(value, int | float) and not isinstance(value, bool):
                out.sample(f"quiverfs_cache_{key}", "gauge", f"Cache usage: {key}.", value)
        yield from out


def _counter_set(out: _Families, prefix: str, counters: dict[str, Any], labels: dict[str, str]) -> None:
    for key, (suffix, help_text) in COUNTERS.items():
        if key in counters:
            out.sample(f"{prefix}_{suffix}", "counter", help_text, counters[key], labels)
    for kind, count in sorted(counters.get("remote_requests", {}).items()):
        out.sample(f"{prefix}_remote_requests_total", "counter", "Remote requests by kind.",
                   count, {**labels, "kind": kind})
    if "fill_latency" in counters:
        out.histogram(f"{prefix}_fill_latency_seconds", "Seconds from fill start to stored.",
                      counters["fill_latency"], labels)


def _cluster(out: _Families, cluster: dict[str, Any] | None) -> None:
    """The cluster's series: counters, per-peer errors, membership gauges."""
    if not cluster:
        return
    for key, (suffix, help_text) in CLUSTER_COUNTERS.items():
        if key in cluster:
            out.sample(f"quiverfs_cluster_{suffix}", "counter", help_text, cluster[key])
    for key, suffix, help_text in (
            ("peer_errors", "peer_errors_total", "Failed transfers, per peer."),
            ("peer_corrupt", "peer_corrupt_total", "Transfers whose bytes did not verify, per peer.")):
        for peer, count in sorted(cluster.get(key, {}).items()):
            out.sample(f"quiverfs_cluster_{suffix}", "counter", help_text, count, {"peer": peer})
    out.sample("quiverfs_cluster_members", "gauge", "Live members this node sees (itself included).",
               len(cluster.get("members", [])))
    out.sample("quiverfs_cluster_connected", "gauge", "1 when Redis answers, 0 when serving alone.",
               bool(cluster.get("connected")))


def _allocation(out: _Families, allocation: dict[str, Any]) -> None:
    """Cache allocation (Quiver §5.3): the policy in force; per dataset mode, bytes, G_D and
    how far apart its jobs read (chunked); per job b, g and its position."""
    if allocation.get("policy"):
        out.sample("quiverfs_allocation_policy", "gauge",
                   "1 for the allocation policy in force (benefit-aware, budget-only, manual).", 1,
                   {"policy": allocation["policy"]})
    for dataset, row in (allocation.get("datasets") or {}).items():
        labels = {"dataset": dataset}
        out.sample("quiverfs_dataset_mode", "gauge", "1 for the dataset's residency mode.", 1,
                   {**labels, "mode": row.get("mode") or "unknown"})
        if row.get("bytes") is not None:
            out.sample("quiverfs_dataset_allocated_bytes", "gauge",
                       "Cache bytes the allocation gives the dataset.", row["bytes"], labels)
        if row.get("benefit") is not None:
            out.sample("quiverfs_dataset_benefit", "gauge",
                       "G_D: sum of b x GPUs over the dataset's jobs (assumed where unmeasured).",
                       float(row["benefit"]), labels)
        if row.get("mode") == "chunked":
            apart = row.get("out_of_phase")
            out.sample("quiverfs_dataset_out_of_phase_epochs", "gauge",
                       "How far apart (share of an epoch) the two jobs furthest apart in phase "
                       "read, when over a tenth (0: in phase).",
                       float(apart["epochs"]) if apart else 0.0, labels)
        for job in row.get("jobs") or []:
            job_labels = {**labels, "job": str(job.get("job"))}
            for key, name, help_text in (
                ("t_hit", "quiverfs_job_hit_batch_seconds", "Median mini-batch time on hits."),
                ("t_miss", "quiverfs_job_miss_batch_seconds", "Mean mini-batch time on misses."),
                ("b", "quiverfs_job_benefit", "b = t_miss / t_hit."),
                ("g", "quiverfs_job_gpu_benefit", "g = b x GPUs (world size)."),
                ("position", "quiverfs_job_position_epochs",
                 "The job's epoch plus the share of it given so far."),
            ):
                if job.get(key) is not None:
                    out.sample(name, "gauge", help_text, float(job[key]), job_labels)
            out.sample("quiverfs_job_probing", "gauge", "1 while the job is being probed.",
                       bool(job.get("probing")), job_labels)


def registry_of(snapshot: Snapshot) -> CollectorRegistry:
    """A registry holding only a :class:`MountdCollector` over ``snapshot`` (not the
    process-wide default registry: mountd exports its own series, not the client's
    process and platform collectors)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(MountdCollector(snapshot))
    return registry


def render(stats: dict[str, Any], usage: dict[str, Any] | None = None) -> str:
    """The exposition text for a ``stats`` answer (and ``usage``, when given)."""
    return generate_latest(registry_of(lambda: (stats, usage))).decode()


async def _respond(stream: trio.SocketStream, registry: CollectorRegistry) -> None:
    request = b""
    with trio.move_on_after(REQUEST_TIMEOUT):
        while b"\r\n\r\n" not in request and len(request) < MAX_REQUEST:
            data = await stream.receive_some(4096)
            if not data:
                break
            request += data
    line = request.split(b"\r\n", 1)[0].decode("latin-1", "replace").split()
    if len(line) >= 2 and line[0] in ("GET", "HEAD") and line[1].split("?")[0] == "/metrics":
        body = generate_latest(registry)
        status, ctype = "200 OK", CONTENT_TYPE_PLAIN_0_0_4
    elif len(line) >= 2 and line[0] in ("GET", "HEAD") and line[1] == "/":
        body, status, ctype = b"quiverfs mountd: see /metrics\n", "200 OK", "text/plain"
    else:
        body, status, ctype = b"not found: try /metrics\n", "404 Not Found", "text/plain"
    head = (f"HTTP/1.0 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
            "Connection: close\r\n\r\n").encode()
    await stream.send_all(head + (b"" if line[:1] == ["HEAD"] else body))


async def serve_metrics(server: Any, port: int, *, host: str = "127.0.0.1",
                        task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
    """Serve ``/metrics`` for ``server`` on ``host:port``; ``task_status`` gets the bound port."""
    registry = registry_of(lambda: (server.stats_snapshot(), server.cache.usage()))
    listeners = await trio.open_tcp_listeners(port, host=host)
    bound = listeners[0].socket.getsockname()[1]

    async def handle(stream: trio.SocketStream) -> None:
        try:
            async with stream:
                await _respond(stream, registry)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        except Exception:
            log.exception("metrics request failed")

    async with trio.open_nursery() as nursery:
        await nursery.start(trio.serve_listeners, handle, listeners)
        task_status.started(bound)
