"""Emulated training jobs: one process each, a real DataLoader, a sleep for compute.

A job reads its dataset's files with a ``torch.utils.data.DataLoader`` (``workers`` worker
processes, ``prefetch_factor`` batches each, persistent across epochs) over a dataset that
returns each file's bytes as a uint8 tensor (no decoding), and sleeps ``compute_s`` per
mini-batch (the GPU step). Readers (``JobSpec.reader``):

=================  =================================================================================
``mount-shuffle``  files through the mount, a shuffled sampler (``RandomSampler`` per epoch)
``mount-shim``     files through the mount, :class:`quiverfs.torch.QuiverBatchSampler`
``bucket``         straight from the bucket with quiverfs's backend code (``open_backend`` +
                   ``read_range``), no cache, shuffled; optionally throttled per worker so that
                   the jobs together get ``bucket_bandwidth`` / ``bucket_requests``, and
                   slowed by a per-GET latency (``bucket_latency_s``)
``synthetic``      no I/O: zero tensors of the file size, shuffled (the upper bound)
=================  =================================================================================

Each mini-batch is timed from asking the loader for it to the end of its compute: data wait
+ compute. :func:`run_jobs` starts N jobs, waits until every one has set up (torch imported,
dataset and sampler built), starts them together and returns each job's JSON result.

Run as a script (``python jobs.py SPEC.json``) it is one job: it prints ``ready``, waits for
a line on stdin, runs, and prints its result as one JSON line.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # run as a job process: scripts/bench on the path, for harness
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness.launch import run_together, wait_for_go  # noqa: E402

READERS = ("mount-shuffle", "mount-shim", "bucket", "synthetic")


@dataclass
class JobSpec:
    """One emulated training job (see the module docstring)."""

    name: str
    reader: str
    #: Directory the relative paths are under: the mountpoint, or the bucket's directory.
    root: str
    #: A file with the dataset's relative paths, one a line (the dataset's index order).
    rels_file: str
    #: Bytes per file (the synthetic reader's tensor size).
    file_size: int
    #: The bucket's URL (``bucket`` reader).
    url: str = ""
    batch_size: int = 16
    epochs: int = 1
    #: Stop each epoch after this many mini-batches (None: the whole epoch).
    batches: int | None = None
    #: Seconds of emulated compute per mini-batch.
    compute_s: float = 0.1
    workers: int = 2
    prefetch_factor: int = 2
    seed: int = 0
    #: QuiverBatchSampler's fetch size (None: its default, 4 × batch size).
    fetch_size: int | None = None
    #: ``bucket`` reader: this job's share of the bucket's bytes/s and requests/s (None: no cap).
    bucket_bandwidth: float | None = None
    bucket_requests: float | None = None
    #: ``bucket`` reader: seconds each GET takes (a per-request latency, slept in the worker).
    bucket_latency_s: float | None = None
    #: QuiverBatchSampler's pre-fetch threshold (None: its default, 0.5).
    threshold: float | None = None
    #: Mount readers: drop the file's pages from the kernel's page cache after reading it
    #: (``POSIX_FADV_DONTNEED``), so that every read reaches quiverfs. The mount lets the kernel
    #: keep file pages; a scaled-down dataset fits in RAM, so without this the page cache would
    #: be a second, unbounded cache in front of the one a benchmark sizes.
    drop_pages: bool = False
    #: The shim's job id, equal on every rank of one job (None: ``name``).
    job: str | None = None
    #: This process's rank and the job's rank count (each rank is a process of its own, as
    #: under DDP; the shuffled readers split each epoch as ``DistributedSampler`` does).
    rank: int = 0
    world_size: int = 1
    #: A file for torch.distributed's rendezvous (ranks of one job: the same file). The ranks
    #: then all-reduce after each step, as DDP's gradient sync keeps them in step.
    rendezvous: str | None = None
    #: Put the order read in the result: per epoch, the dataset indices of each mini-batch.
    record_order: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.reader not in READERS:
            raise ValueError(f"unknown reader {self.reader!r}; one of {READERS}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is not below world_size {self.world_size}")


# -- inside the job process ---------------------------------------------------------------------


class _BucketReader:
    """Reads through a quiverfs backend from a sync DataLoader worker: a trio loop in a
    thread of the worker process (created lazily, after the fork), calls handed to it."""

    def __init__(self, url: str, bandwidth: float | None, requests: float | None,
                 latency: float | None = None) -> None:
        self.url, self.bandwidth, self.requests, self.latency = url, bandwidth, requests, latency
        self._pid: int | None = None

    def _start(self) -> None:
        import trio

        from mountd.store.limits import RemoteLimits
        from quiverfs.base.backends import open_backend

        ready = threading.Event()

        async def serve() -> None:
            self.backend = open_backend(self.url)
            self.limits = RemoteLimits(self.bandwidth, self.requests, 1)
            self.token = trio.lowlevel.current_trio_token()
            ready.set()
            await trio.sleep_forever()

        threading.Thread(target=trio.run, args=(serve,), daemon=True).start()
        ready.wait()
        self._pid = os.getpid()

    def read(self, key: str, length: int) -> tuple[bytes, int]:
        """The object's bytes and the GET requests it cost."""
        import trio

        if self._pid != os.getpid():
            self._start()

        async def one() -> tuple[bytes, int]:
            before = self.backend.counters.requests["GET"]
            async with self.limits.request(length):
                if self.latency:
                    await trio.sleep(self.latency)
                data = await self.backend.read_range(key, 0, length)
            return data, self.backend.counters.requests["GET"] - before

        return trio.from_thread.run(one, trio_token=self.token)


def _make_dataset(spec: JobSpec, rels: list[str]):  # -> torch Dataset
    import torch
    from torch.utils.data import Dataset

    class Files(Dataset):
        """Item i: (file i's bytes as a uint8 tensor, remote GETs it cost, i)."""

        def __init__(self) -> None:
            self.paths = [os.path.join(spec.root, rel) for rel in rels]
            self.bucket = None
            if spec.reader == "bucket":
                self.bucket = _BucketReader(spec.url, spec.bucket_bandwidth, spec.bucket_requests,
                                            spec.bucket_latency_s)

        def __len__(self) -> int:
            return len(self.paths)

        def __getitem__(self, i: int):
            if spec.reader == "synthetic":
                return torch.zeros(spec.file_size, dtype=torch.uint8), 0, i
            if self.bucket is not None:
                data, gets = self.bucket.read(rels[i], spec.file_size)
            else:
                with open(self.paths[i], "rb") as f:
                    data, gets = f.read(), 0
                    if spec.drop_pages:
                        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
            return torch.frombuffer(bytearray(data), dtype=torch.uint8), gets, i

    return Files()


def run_job(spec: JobSpec, go: Any = None) -> dict[str, Any]:
    """Set up, wait for ``go()`` (the start signal), run the epochs; the result dict."""
    t_setup = time.perf_counter()
    import torch
    from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, RandomSampler

    if spec.rendezvous is not None and spec.world_size > 1:
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"file://{spec.rendezvous}", rank=spec.rank,
                                world_size=spec.world_size)
    rels = Path(spec.rels_file).read_text().split("\n")
    rels = [r for r in rels if r]
    dataset = _make_dataset(spec, rels)
    sampler = None
    if spec.reader == "mount-shim":
        from quiverfs.torch import QuiverBatchSampler

        sampler = QuiverBatchSampler(dataset, spec.batch_size, paths=dataset.paths,
                                     job=spec.job or spec.name, rank=spec.rank,
                                     world_size=spec.world_size, seed=spec.seed,
                                     fetch_size=spec.fetch_size,
                                     **({} if spec.threshold is None else {"threshold": spec.threshold}))
        if not sampler.on_quiver:
            raise RuntimeError(f"{spec.root} is not a quiverfs mount with a control channel")
        batch_sampler = sampler
    elif spec.world_size > 1:
        sampler = DistributedSampler(dataset, num_replicas=spec.world_size, rank=spec.rank,
                                     shuffle=True, seed=spec.seed)
        batch_sampler = BatchSampler(sampler, spec.batch_size, drop_last=False)
    else:
        generator = torch.Generator().manual_seed(spec.seed)
        batch_sampler = BatchSampler(RandomSampler(dataset, generator=generator),
                                     spec.batch_size, drop_last=False)
    loader = DataLoader(dataset, batch_sampler=batch_sampler, num_workers=spec.workers,
                        persistent_workers=spec.workers > 0,
                        prefetch_factor=spec.prefetch_factor if spec.workers > 0 else None,
                        # fork: the dataset class is local, and the bucket reader's thread
                        # starts in each worker after the fork
                        multiprocessing_context="fork" if spec.workers > 0 else None)
    setup_s = time.perf_counter() - t_setup
    if go is not None:
        go()

    started = time.perf_counter()
    epochs: list[dict[str, Any]] = []
    batch_times: list[float] = []
    waits: list[float] = []
    files = nbytes = gets = 0
    for epoch in range(spec.epochs):
        if sampler is not None:
            sampler.set_epoch(epoch)  # QuiverBatchSampler's and DistributedSampler's
        e_start = time.perf_counter()
        e_wall = time.time()
        e_times: list[float] = []
        e_waits: list[float] = []
        e_order: list[list[int]] = []
        it = iter(loader)
        while spec.batches is None or len(e_times) < spec.batches:
            t0 = time.perf_counter()
            try:
                data, got, indices = next(it)
            except StopIteration:
                break
            if spec.record_order:
                e_order.append(indices.tolist())
            t1 = time.perf_counter()
            time.sleep(spec.compute_s)
            if spec.rendezvous is not None and spec.world_size > 1:
                torch.distributed.all_reduce(torch.zeros(1))  # DDP's gradient sync
            t2 = time.perf_counter()
            e_waits.append(t1 - t0)
            e_times.append(t2 - t0)
            files += data.shape[0]
            nbytes += data.numel()
            gets += int(got.sum())
        del it
        epochs.append({"epoch": epoch, "seconds": time.perf_counter() - e_start,
                       "batches": len(e_times), "mean_batch_s": _mean(e_times),
                       "mean_wait_s": _mean(e_waits), "started_at": e_wall, "ended_at": time.time(),
                       **({"order": e_order} if spec.record_order else {})})
        batch_times += e_times
        waits += e_waits
    wall = time.perf_counter() - started
    fetch = None  # the shim's fetch size at the end: its own, or mountd's advice
    if spec.reader == "mount-shim":
        fetch = sampler.fetch_now()
        sampler.close()
    if spec.rendezvous is not None and spec.world_size > 1:
        torch.distributed.destroy_process_group()
    return {
        "name": spec.name, "job": spec.job or spec.name, "rank": spec.rank,
        "reader": spec.reader, "setup_s": setup_s, "wall_s": wall,
        "batches": len(batch_times), "files": files, "bytes": nbytes, "bucket_gets": gets,
        "mean_batch_s": _mean(batch_times), "mean_wait_s": _mean(waits),
        "p50_batch_s": _quantile(batch_times, 0.5), "p95_batch_s": _quantile(batch_times, 0.95),
        "epochs": epochs, "fetch_size": fetch,
    }


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def _quantile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _main(spec_path: str) -> None:
    spec = JobSpec(**json.loads(Path(spec_path).read_text()))
    result = run_job(spec, wait_for_go)
    print(json.dumps(result), flush=True)


# -- the harness side ---------------------------------------------------------------------------


def write_rels(path: Path, rels: list[str] | tuple[str, ...]) -> str:
    """Write the relative paths file a :class:`JobSpec` names; returns its path."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(rels) + "\n")
    return str(path)


def run_jobs(specs: list[JobSpec], workdir: Path, timeout: float = 900.0) -> list[dict[str, Any]]:
    """Run ``specs`` as concurrent job processes started together; their results, in order
    (:func:`harness.launch.run_together`: logs in ``workdir/NAME.log``, results in
    ``workdir/NAME.result.json``)."""
    workdir.mkdir(parents=True, exist_ok=True)
    jobs = []
    for spec in specs:
        spec_file = workdir / f"{spec.name}.json"
        spec_file.write_text(json.dumps(asdict(spec)))
        jobs.append((spec.name, spec_file))
    return run_together(jobs, Path(__file__), workdir, timeout=timeout,
                        cwd=Path(__file__).resolve().parents[3])


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
    _main(sys.argv[1])
