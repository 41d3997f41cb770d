"""What every paper-reproduction section shares: one measured run as a plain, JSON-able record.

A *run* is N emulated jobs (:mod:`.jobs`) started together, either in a fresh
:class:`~harness.world.World` (mountd + mount; its remote counters are read before and after)
or without one (``bucket`` and ``synthetic`` readers). :func:`measure` returns a dict that the
report renders and the tests fake: the job summary (:func:`harness.report.summarize`), the
per-epoch means, what the bucket served (mountd's counters, or the bucket readers' own GETs and
bytes) and the run's wall time.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any

from harness.cli import remote_limits
from harness.jobs import JobSpec, run_jobs, write_rels
from harness.report import RemoteDelta, epoch_means, summarize
from harness.world import BENCH, Dataset, MountdConfig, World

WORK = BENCH / "papers"


@dataclass(frozen=True)
class Workload:
    """The knobs of one section's jobs (the bucket's limits are the section's own)."""

    jobs: int
    batch_size: int
    compute_s: float
    workers: int = 2
    prefetch_factor: int = 2
    epochs: int = 1
    batches: int | None = None
    fetch_size: int | None = None
    threshold: float | None = None
    #: Mount readers drop each file's kernel pages after reading it (JobSpec.drop_pages): the
    #: scaled-down dataset fits in RAM, the papers' datasets do not.
    drop_pages: bool = True

    def demand(self) -> float:
        """Files/s one job reads when data never waits."""
        return self.batch_size / self.compute_s


@dataclass(frozen=True)
class Bucket:
    """The bucket of a section: ``files_per_s`` files of ``file_size`` bytes per second, for
    mountd (``limits``) and, split evenly over every worker of every job, for the ``bucket``
    reader, which also sleeps ``latency_s`` per GET when given."""

    files_per_s: float
    file_size: int
    latency_s: float | None = None

    @property
    def limits(self) -> dict[str, float]:
        return remote_limits(self.files_per_s, self.file_size)

    def params(self) -> dict[str, Any]:
        return {"bucket_files_per_s": round(self.files_per_s, 1),
                "bucket_bytes_per_s": int(self.files_per_s * self.file_size)}

    def reader_limits(self, load: Workload) -> dict[str, Any]:
        """JobSpec fields of one ``bucket`` job's share."""
        per = load.jobs * max(1, load.workers)
        out: dict[str, Any] = {"bucket_bandwidth": self.files_per_s * self.file_size / per,
                               "bucket_requests": self.files_per_s / per}
        if self.latency_s:
            out["bucket_latency_s"] = self.latency_s
        return out


def job_specs(dataset: Dataset, load: Workload, reader: str, root: str, rels_file: str,
              prefix: str, **extra: Any) -> list[JobSpec]:
    """``load.jobs`` job specs of ``reader`` (seeds 0..N-1)."""
    return [JobSpec(name=f"{prefix}-{i}", reader=reader, root=root, rels_file=rels_file,
                    file_size=dataset.spec.file_size, url=dataset.url, batch_size=load.batch_size,
                    epochs=load.epochs, batches=load.batches, compute_s=load.compute_s,
                    workers=load.workers, prefetch_factor=load.prefetch_factor, seed=i,
                    fetch_size=load.fetch_size, threshold=load.threshold,
                    drop_pages=load.drop_pages and reader.startswith("mount"), **extra)
            for i in range(load.jobs)]


class Sampler:
    """Samples ``world.stats()`` / usage every ``interval`` s in a thread while a run goes on
    (``interval`` 0.05 s costs mountd ~40 requests a second)."""

    def __init__(self, world: World, interval: float = 0.25) -> None:
        self.world, self.interval = world, interval
        self.samples: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        from mountd.rpc.client import SyncClient

        try:
            with SyncClient.connect(self.world.cache_dir, timeout=10.0) as client:
                while not self._stop.is_set():
                    usage = client.usage()
                    total = client.stats()["counters"]["total"]
                    self.samples.append({"t": time.time(), "used_bytes": usage["used_bytes"],
                                         "entries": usage["entries"],
                                         "remote_bytes": total["remote_bytes"],
                                         "gets": total["remote_requests"]["GET"],
                                         "misses": total["misses"]})
                    self._stop.wait(self.interval)
        except Exception as exc:  # a sampler must never break the run it watches
            self.samples.append({"t": time.time(), "error": repr(exc)})

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=15)


def measure(name: str, dataset: Dataset, load: Workload, reader: str, *,
            config: MountdConfig | None = None, warm: bool = False,
            bucket: Bucket | None = None, sample: bool = False,
            log_needles: tuple[str, ...] = (), progress: Callable[[str], None] | None = None,
            sample_interval: float = 0.25) -> dict[str, Any]:
    """Run ``load`` with ``reader``; in a fresh world when ``config`` is given.

    ``bucket``: the ``bucket`` reader's bucket (limits shared by all its jobs, latency).
    ``sample``: record mountd's store and counters every ``sample_interval`` s
    (:class:`Sampler`; ``record["before"]`` holds the counters the samples count from)."""
    work = WORK / name
    rels_file = write_rels(WORK / "rels" / f"{dataset.spec.name}.txt", dataset.rels)
    extra = bucket.reader_limits(load) if bucket is not None else {}
    record: dict[str, Any] = {"name": name, "reader": reader, "load": asdict(load),
                              "config": None if config is None else asdict(config),
                              "remote": None, "warm_s": None, "samples": [], "log": []}
    started = time.perf_counter()
    progress = progress or (lambda line: print(line, flush=True))
    progress(f"[papers] {name}: {load.jobs} x {reader}"
             + ("" if config is None else f", cache {config.cache_size / dataset.total_bytes:.0%}"
                f" of the dataset, mode {config.dataset_mode or 'auto'}"))
    if config is None:
        root = str(dataset.source)
        results = run_jobs(job_specs(dataset, load, reader, root, rels_file, name, **extra), work)
    else:
        with World(dataset, f"papers-{name}", config) as world:
            if warm:
                record["warm_s"] = world.warm()
            before = world.counters()
            record["before"] = {"gets": before["remote_requests"]["GET"],
                                "misses": before["misses"]}
            specs = job_specs(dataset, load, reader, str(world.mountpoint), rels_file, name, **extra)
            if sample:
                with Sampler(world, sample_interval) as sampler:
                    results = run_jobs(specs, work)
                record["samples"] = sampler.samples
            else:
                results = run_jobs(specs, work)
            record["remote"] = asdict(RemoteDelta.between(before, world.counters()))
            record["log"] = list(dict.fromkeys(
                line for needle in log_needles for line in world.mountd_log_lines(needle)))
    record["summary"] = summarize(results)
    record["epoch_means"] = epoch_means(results)
    record["job_walls"] = [r["wall_s"] for r in results]
    record["wait_totals"] = [r["mean_wait_s"] * r["batches"] for r in results]
    record["run_s"] = time.perf_counter() - started
    s = record["summary"]
    progress(f"[papers] {name}: mini-batch {s['mean_batch_s']:.3f} s (wait {s['mean_wait_s']:.3f}),"
             f" slowest job {s['wall_s']:.1f} s, run {record['run_s']:.0f} s")
    return record


def served(run: dict[str, Any]) -> tuple[int, int]:
    """(GETs, bytes) the bucket served in a run: mountd's counters, else the bucket readers'."""
    if run.get("remote"):
        return run["remote"]["gets"], run["remote"]["bytes"]
    if run["reader"] == "bucket":
        return int(run["summary"]["bucket_gets"]), int(run["summary"]["bytes"])
    return 0, 0


def with_load(load: Workload, **changes: Any) -> Workload:
    return replace(load, **changes)
