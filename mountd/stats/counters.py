"""What the cache did, per dataset and in total, as plain numbers for stats and Prometheus.

Updated from the trio thread only, so reads need no lock. :meth:`Counters.snapshot` gives a
JSON-ready dict; the serving side renders it (stats table, Prometheus, cost estimate).
"""

from __future__ import annotations

import bisect
import itertools
from collections import Counter, deque
from dataclasses import dataclass, field

#: Upper bounds (seconds) of the fill-latency histogram buckets; a final +Inf bucket is implied.
#: Fine below 20 ms: a fill from a fast source takes about a millisecond (docs/store-layout.md).
LATENCY_BUCKETS: tuple[float, ...] = (
    0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5, 2.0, 10.0)
#: Latest observations kept for exact percentiles (``p50``/``p95`` in snapshots).
RECENT = 4096
#: Remote request kinds, always present in snapshots (zero when unused).
REQUEST_KINDS: tuple[str, ...] = ("GET", "HEAD", "LIST")


@dataclass
class Histogram:
    """Count, sum and cumulative-free bucket counts of observations (seconds)."""

    count: int = 0
    sum: float = 0.0
    buckets: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS) + 1))
    #: The latest :data:`RECENT` observations, for exact percentiles of recent fills.
    recent: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT))

    def observe(self, seconds: float, times: int = 1) -> None:
        """``times`` observations of ``seconds`` (the files of one batch took the same)."""
        self.count += times
        self.sum += seconds * times
        self.buckets[bisect.bisect_left(LATENCY_BUCKETS, seconds)] += times
        self.recent.extend(itertools.repeat(seconds, times))

    def snapshot(self) -> dict:
        """``{"count", "sum", "buckets": {"0.0005": n, …, "+Inf": n}, "recent": {"count",
        "p50", "p95"}}``: buckets per bucket (not cumulative) over all observations; exact
        percentiles over the latest :data:`RECENT` (absent when there are none)."""
        names = [repr(b) for b in LATENCY_BUCKETS] + ["+Inf"]
        out = {
            "count": self.count,
            "sum": self.sum,
            "buckets": dict(zip(names, self.buckets, strict=True)),
        }
        if self.recent:
            ordered = sorted(self.recent)
            out["recent"] = {
                "count": len(ordered),
                "p50": ordered[(len(ordered) - 1) // 2],
                "p95": ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))],
            }
        return out


@dataclass
class DatasetCounters:
    """One dataset's (or the total's) counters. Bytes are content bytes."""

    #: Reads answered from the store (ensure() on a cached hash, or record_hits from clients).
    hits: int = 0
    #: ensure() calls that had to wait for a fill (their own or one already in flight).
    misses: int = 0
    #: Fills started by prefetch() (no client waiting).
    prefetches: int = 0
    bytes_from_cache: int = 0
    bytes_from_remote: int = 0
    #: Remote requests issued by fills, by kind (GET/HEAD/LIST), counted once per logical request.
    remote_requests: Counter[str] = field(default_factory=Counter)
    #: Bytes received from the remote (equals bytes_from_remote unless a fill failed midway).
    remote_bytes: int = 0
    #: Fills rejected because size or blake3 did not match the hash.
    verify_failures: int = 0
    #: Fills that failed for any other reason (remote error, cache full, disk).
    fill_errors: int = 0
    #: Fills nobody waited for, dropped because the rest of the cache was pinned or
    #: protected (``PrefetchNoRoom``): not errors; their readers fetch them on demand.
    prefetches_dropped: int = 0
    evicted_files: int = 0
    evicted_bytes: int = 0
    #: Chunk fills (mountd/store/span.py): ranged GETs that brought several members of one
    #: packed object, and the members they stored (``chunk_members / chunk_fills`` files a
    #: GET; their GETs and bytes are in ``remote_requests`` and ``remote_bytes`` as any).
    chunk_fills: int = 0
    chunk_members: int = 0
    fill_latency: Histogram = field(default_factory=Histogram)

    def snapshot(self) -> dict:
        requests = {kind: self.remote_requests.get(kind, 0) for kind in REQUEST_KINDS}
        requests.update(self.remote_requests)
        return {
            "hits": self.hits,
            "misses": self.misses,
            "prefetches": self.prefetches,
            "bytes_from_cache": self.bytes_from_cache,
            "bytes_from_remote": self.bytes_from_remote,
            "remote_requests": requests,
            "remote_bytes": self.remote_bytes,
            "verify_failures": self.verify_failures,
            "fill_errors": self.fill_errors,
            "prefetches_dropped": self.prefetches_dropped,
            "evicted_files": self.evicted_files,
            "evicted_bytes": self.evicted_bytes,
            "chunk_fills": self.chunk_fills,
            "chunk_members": self.chunk_members,
            "fill_latency": self.fill_latency.snapshot(),
        }


#: Where a fill's time goes, in order (``quiverfs stats`` → ``fill_stages``): in mountd's main
#: process ``rpc`` (reading and checking an ``ensure`` or ``supply`` request), ``queue`` (the
#: fill waits for a fill slot, room, and the remote limits), then in a fill process ``read``,
#: ``hash``, ``write``, ``rename`` (mountd/store/fillwork.py), then ``transit`` (the rest of
#: the time from sending the job to having its answer: the fill process's queue and the
#: messages both ways), then ``index`` (the main process records the file), ``answer``
#: (sending the answer of an ``ensure`` or ``supply``), and ``commit`` (writing the file's
#: index row into SQLite with its group commit, in a worker thread of the main process:
#: mountd/store/commits.py). CPU is measured where the stage runs without giving way to
#: other work: ``rpc``, ``index``, ``commit`` and the fill process's four.
FILL_STAGES: tuple[str, ...] = ("rpc", "queue", "read", "hash", "write", "rename", "transit",
                                "index", "answer", "commit")

#: The stages a fill process reports, in the order of its list of times (fillwork.WORK_STAGES).
WORK_STAGES: tuple[str, ...] = ("read", "hash", "write", "rename")


@dataclass
class FillStages:
    """Seconds of wall-clock and of CPU spent in each of :data:`FILL_STAGES`, summed over
    fills; ``jobs`` counts the jobs fill processes ran (a chunk fill is one job)."""

    wall: dict[str, float] = field(default_factory=lambda: dict.fromkeys(FILL_STAGES, 0.0))
    cpu: dict[str, float] = field(default_factory=lambda: dict.fromkeys(FILL_STAGES, 0.0))
    count: Counter[str] = field(default_factory=Counter)
    jobs: int = 0

    def add(self, stage: str, wall: float, cpu: float | None = None, times: int = 1) -> None:
        """``times`` observations of ``stage`` that took ``wall`` seconds together (and
        ``cpu``, where measured)."""
        self.wall[stage] += wall
        if cpu is not None:
            self.cpu[stage] += cpu
        self.count[stage] += times

    def add_work(self, values: list[float], files: int = 1) -> None:
        """A fill process's times of one job: the wall seconds of each of
        :data:`WORK_STAGES`, then the CPU seconds of each; ``files`` observations of each
        (a batch of loose files is one job whose files were each read, hashed, written and
        renamed: its times then read per file, as a job of one file's do)."""
        n = len(WORK_STAGES)
        for i, stage in enumerate(WORK_STAGES):
            self.wall[stage] += values[i]
            self.cpu[stage] += values[i + n]
            self.count[stage] += files
        self.jobs += 1

    def snapshot(self) -> dict:
        """``{"jobs": n, "stages": {stage: {"count", "wall_s", "cpu_s"}}}`` (sums)."""
        return {"jobs": self.jobs,
                "stages": {stage: {"count": self.count[stage], "wall_s": self.wall[stage],
                                   "cpu_s": self.cpu[stage]} for stage in FILL_STAGES}}


class Counters:
    """Totals plus one :class:`DatasetCounters` per dataset id seen (``None`` = no dataset).

    Every ``add_*`` updates the total and, when given a dataset, that dataset's counters.
    """

    def __init__(self) -> None:
        self.total = DatasetCounters()
        self.datasets: dict[str, DatasetCounters] = {}
        #: Fills currently running (a gauge).
        self.fills_in_flight = 0
        #: Entries removed by scrub (bad bytes on disk) and by recovery (rows without files).
        self.scrub_removed = 0
        #: Where fills spend their time (all datasets together).
        self.stages = FillStages()

    def _targets(self, dataset: str | None) -> tuple[DatasetCounters, ...]:
        if dataset is None:
            return (self.total,)
        per = self.datasets.get(dataset)
        if per is None:
            per = self.datasets[dataset] = DatasetCounters()
        return (self.total, per)

    def dataset(self, dataset: str) -> DatasetCounters:
        """The counters of one dataset (created empty if unseen)."""
        return self._targets(dataset)[1]

    def add_hits(self, dataset: str | None, files: int, nbytes: int) -> None:
        for c in self._targets(dataset):
            c.hits += files
            c.bytes_from_cache += nbytes

    def add_miss(self, dataset: str | None) -> None:
        for c in self._targets(dataset):
            c.misses += 1

    def add_prefetch(self, dataset: str | None) -> None:
        for c in self._targets(dataset):
            c.prefetches += 1

    def add_request(self, dataset: str | None, kind: str, nbytes: int = 0) -> None:
        """One remote request of ``kind`` that returned ``nbytes``."""
        for c in self._targets(dataset):
            c.remote_requests[kind] += 1
            c.remote_bytes += nbytes

    def add_fill(self, dataset: str | None, nbytes: int, seconds: float, files: int = 1) -> None:
        """A fill that stored ``nbytes`` of verified content in ``seconds`` (or ``files``
        fills of one job that stored ``nbytes`` together, each in ``seconds``)."""
        for c in self._targets(dataset):
            c.bytes_from_remote += nbytes
            c.fill_latency.observe(seconds, files)

    def add_chunk_fill(self, dataset: str | None, members: int) -> None:
        """One chunk fill that stored ``members`` files from one GET."""
        for c in self._targets(dataset):
            c.chunk_fills += 1
            c.chunk_members += members

    def add_verify_failure(self, dataset: str | None) -> None:
        for c in self._targets(dataset):
            c.verify_failures += 1

    def add_fill_error(self, dataset: str | None) -> None:
        for c in self._targets(dataset):
            c.fill_errors += 1

    def add_prefetch_dropped(self, dataset: str | None) -> None:
        for c in self._targets(dataset):
            c.prefetches_dropped += 1

    def add_eviction(self, datasets: list[str], files: int, nbytes: int) -> None:
        """``files``/``nbytes`` evicted; attributed to the total once and to each dataset."""
        self.total.evicted_files += files
        self.total.evicted_bytes += nbytes
        for name in datasets:
            per = self.dataset(name)
            per.evicted_files += files
            per.evicted_bytes += nbytes

    def snapshot(self) -> dict:
        """JSON-ready: ``{"total": {...}, "datasets": {id: {...}}, "fills_in_flight": n, ...}``."""
        return {
            "total": self.total.snapshot(),
            "datasets": {name: c.snapshot() for name, c in sorted(self.datasets.items())},
            "fills_in_flight": self.fills_in_flight,
            "scrub_removed": self.scrub_removed,
            "fill_stages": self.stages.snapshot(),
        }

    def add_work_stages(self, values: list[float], files: int = 1) -> None:
        """A fill process's stage times of one job of ``files`` files (:meth:`FillStages.add_work`)."""
        self.stages.add_work(values, files)
