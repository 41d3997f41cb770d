"""Calibrating the staggering model through a mount: cold, warm and concurrent passes.

The HiPC'23 method (§V-C): run each job for a few mini-batches (K) alone on a cold cache (its
compute time I and wait W), alone on a warm cache (W_cached), and all jobs together on a cold
cache (W_conc); average; hand the numbers to :mod:`quiverfs.plan.stagger`. Here a job is either

* the built-in emulated reader (:func:`read_batches`): a pool of threads loads whole
  mini-batches ahead (as DataLoader workers do) in the shared same-seed order
  (:func:`quiverfs.plan.stagger.epoch_order`), and the loop "computes" by sleeping; it measures the
  wait for each batch; or
* a command (``--reader-cmd``) that performs K iterations: only its wall time per pass is
  measured, so its profile carries the whole mini-batch time in the waits (compute 0), which is
  all the model uses (it only ever adds I to a W).

"Cold" means the dataset's files are evicted from mountd's store first (``evict``, as root or
mountd's user), and the reader drops each file from the kernel's page cache after reading it
(``POSIX_FADV_DONTNEED``), so every read goes through the mount to the store or the remote.
Used by ``quiverfs plan stagger --mount`` (quiverfs/cli/plan_cli.py) and scripts/bench/stagger.py.
"""

from __future__ import annotations

import concurrent.futures
import math
import os
import shlex
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from quiverfs.base.errors import UsageError
from quiverfs.plan.stagger import Profile, epoch_order


@dataclass(frozen=True)
class ReaderJob:
    """One emulated (or commanded) training job for calibration and benchmarks.

    ``compute``: seconds of "training" per mini-batch (a sleep: the GPU's share); ``batch``:
    files per mini-batch; ``workers``: batches loaded at once ahead of the loop; ``epochs``
    and ``gpus`` pass through to the profile. ``command``: a shell command to time instead of
    the built-in reader (it must perform the calibration's K iterations).
    """

    name: str
    compute: float = 0.05
    batch: int = 16
    workers: int = 4
    epochs: int = 1
    gpus: int = 1
    seed: int = 0
    command: str | None = None


@dataclass
class ReadResult:
    """What one run of the reader measured."""

    iterations: int = 0
    seconds: float = 0.0
    waits: list[float] = field(default_factory=list)
    compute: float = 0.0
    bytes: int = 0
    started: float = 0.0
    finished: float = 0.0

    #: leading waits left out of :attr:`mean_wait` (the pipeline filling up)
    skip: int = 0

    @property
    def mean_wait(self) -> float:
        """Mean wait per mini-batch after the first ``skip`` (the steady state)."""
        waits = self.waits[self.skip:] or self.waits
        return sum(waits) / len(waits) if waits else 0.0

    @property
    def mean_compute(self) -> float:
        return self.compute / self.iterations if self.iterations else 0.0


def _read_file(path: str) -> int:
    """Read ``path`` whole, then drop it from the page cache so the next read asks the mount."""
    fd = os.open(path, os.O_RDONLY)
    try:
        total = 0
        while chunk := os.read(fd, 1 << 20):
            total += len(chunk)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return total
    finally:
        os.close(fd)


def _read_batch(paths: Sequence[str]) -> int:
    return sum(_read_file(p) for p in paths)


def read_batches(paths: Sequence[str], job: ReaderJob, *, iterations: int | None = None,
                 epochs: int | None = None, start_epoch: int = 0,
                 stop: threading.Event | None = None) -> ReadResult:
    """Run the emulated job over ``paths`` (the dataset in index order): ``epochs`` epochs
    (default ``job.epochs``) in the shared order, or only the first ``iterations`` mini-batches.

    Each mini-batch is loaded by one of ``job.workers`` threads, up to ``job.workers`` batches
    ahead; the loop waits for the next batch (measured), then sleeps ``job.compute``.
    """
    result = ReadResult(started=time.monotonic())
    batches: list[list[str]] = []
    for epoch in range(start_epoch, start_epoch + (epochs or job.epochs)):
        order = epoch_order(len(paths), job.seed, epoch)
        batches += [[paths[i] for i in order[s:s + job.batch]] for s in range(0, len(order), job.batch)]
        if iterations is not None and len(batches) >= iterations:
            break
    if iterations is not None:
        batches = batches[:iterations]
    with concurrent.futures.ThreadPoolExecutor(job.workers) as pool:
        ahead = [pool.submit(_read_batch, b) for b in batches[: job.workers]]
        next_batch = len(ahead)
        for i in range(len(batches)):
            if stop is not None and stop.is_set():
                break
            t0 = time.monotonic()
            result.bytes += ahead[i].result()
            result.waits.append(time.monotonic() - t0)
            if next_batch < len(batches):
                ahead.append(pool.submit(_read_batch, batches[next_batch]))
                next_batch += 1
            c0 = time.monotonic()
            time.sleep(job.compute)
            result.compute += time.monotonic() - c0
            result.iterations += 1
        for future in ahead[result.iterations:]:
            future.cancel()
    result.finished = time.monotonic()
    result.seconds = result.finished - result.started
    return result


def run_command(job: ReaderJob, mountpoint: Path, phase: str) -> ReadResult:
    """Time ``job.command`` once (``QUIVERFS_MOUNT`` and ``QUIVERFS_CALIBRATION`` = ``phase`` in
    its environment); a failing command is a usage error with its status."""
    assert job.command is not None
    env = dict(os.environ, QUIVERFS_MOUNT=str(mountpoint), QUIVERFS_CALIBRATION=phase)
    started = time.monotonic()
    proc = subprocess.run(job.command, shell=True, env=env, stdout=subprocess.DEVNULL, check=False)
    finished = time.monotonic()
    if proc.returncode != 0:
        raise UsageError(f"the reader command of job {job.name} exited with {proc.returncode}: "
                         f"{shlex.quote(job.command)}")
    return ReadResult(seconds=finished - started, started=started, finished=finished)


@dataclass
class Calibration:
    """The passes' measurements and the profiles made of them."""

    profiles: list[Profile]
    passes: dict[str, dict[str, float]]


def calibrate(jobs: Sequence[ReaderJob], mountpoint: Path, paths: Sequence[str],
              evict: Callable[[], object], *, iterations: int = 20,
              log: Callable[[str], None] = lambda line: print(line, file=sys.stderr)) -> Calibration:
    """Measure every job cold, warm, and all together cold; ``evict()`` empties the cache of
    the dataset between passes. ``paths``: the dataset's files through the mount, in index
    order; ``iterations``: K, mini-batches per pass measured after the built-in reader's
    pipeline has filled (its first ``workers`` batches are read but not averaged); commands
    must do K themselves."""
    if len(jobs) < 2:
        raise UsageError("calibration needs at least two jobs")
    if iterations < 1:
        raise UsageError(f"--iters must be at least 1, not {iterations}")
    if not paths:
        raise UsageError(f"no files under {mountpoint}")

    def once(job: ReaderJob, phase: str) -> ReadResult:
        if job.command is not None:
            return run_command(job, mountpoint, phase)
        # The first ``workers`` batches are loaded all at once and wait for each other: the
        # pipeline filling up, which a whole epoch amortises. Measure the steady state after it
        # (the paper averages 100 mini-batches for the same reason).
        result = read_batches(paths, job, iterations=iterations + job.workers)
        result.skip = job.workers
        return result

    def per_batch(job: ReaderJob, r: ReadResult) -> tuple[float, float]:
        """(compute, wait) per mini-batch; a command's whole time counts as wait."""
        if job.command is not None:
            return 0.0, r.seconds / iterations
        return r.mean_compute, r.mean_wait

    passes: dict[str, dict[str, float]] = {job.name: {} for job in jobs}
    for job in jobs:
        evict()
        log(f"calibrating {job.name}: {iterations} mini-batches alone on a cold cache")
        cold = once(job, "cold")
        passes[job.name]["compute"], passes[job.name]["wait"] = per_batch(job, cold)
        log(f"calibrating {job.name}: {iterations} mini-batches alone on a warm cache")
        warm = once(job, "warm")
        passes[job.name]["wait_cached"] = per_batch(job, warm)[1]
    evict()
    log(f"calibrating {', '.join(j.name for j in jobs)}: {iterations} mini-batches together on a cold cache")
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(lambda j: once(j, "concurrent"), jobs))
    for job, r in zip(jobs, results, strict=True):
        passes[job.name]["wait_conc"] = per_batch(job, r)[1]
    n_files = len(paths)
    profiles = [
        Profile(job.name, math.ceil(n_files / job.batch), job.epochs,
                passes[job.name]["compute"], passes[job.name]["wait"],
                passes[job.name]["wait_cached"], passes[job.name]["wait_conc"], job.gpus)
        for job in jobs
    ]
    return Calibration(profiles, passes)


def mount_files(mountpoint: Path) -> list[str]:
    """Every regular file under ``mountpoint``, sorted (the dataset's index order here)."""
    out: list[str] = []
    for root, dirs, files in os.walk(mountpoint):
        dirs.sort()
        out += [os.path.join(root, f) for f in sorted(files)]
    return out
