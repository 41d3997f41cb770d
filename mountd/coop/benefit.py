"""Who gets the cache: benefit-aware allocation (Quiver §5.3). Pure decision logic, no I/O.

A job's benefit from caching is ``b = t_miss / t_hit``: its mini-batch time when its reads
miss over the time when they hit (the shim reports every mini-batch's time; mountd sorts the
reports into hit and miss samples by what the job's recent claims gave it, and *probes* a job
whose miss time it does not know by giving it only uncached files for a few mini-batches:
:mod:`mountd.coop.timings`). ``g = b × GPUs`` (the job's world size) weighs it by the GPUs it
holds, and ``G_D = Σ g`` over the jobs reading dataset ``D`` is what caching ``D`` saves.

:func:`allocate` then gives each dataset one of three modes (intermediate sizes buy nothing
over two chunks, given substitutable hits):

* ``off`` — cost 0: a dataset whose every job is insensitive (``b < min_benefit``), or
  for which the budget has no room left;
* ``chunked`` — cost two chunks (``slots × chunk``; Quiver's 10% of the dataset, or
  ``max_chunk_bytes``): co-operative misses and substitutable hits;
* ``full`` — cost the whole dataset.

Greedy by ``G_D`` per byte, in three passes: first every beneficial dataset gets its two chunks,
best ratio first (they are cheap and turn the dataset's misses co-operative), then the leftover
budget upgrades datasets to ``full`` in the order of ``G_D`` per extra byte, and what is still
left goes to the best dataset that got nothing, as smaller chunks (each at least
``min_chunk_bytes``, the 1% below which a chunk is too small to be random). A job not measured
yet counts with :data:`ASSUMED_BENEFIT` (so a new dataset is cached, its hits measured, then
its job probed), and so does a dataset that no shim job reads (plain readers report nothing).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from mountd.coop.chunks import Mode

__all__ = [
    "ASSUMED_BENEFIT",
    "Allocation",
    "DatasetDemand",
    "JobBenefit",
    "MIN_BENEFIT",
    "allocate",
    "benefit_moved",
    "median",
]

#: Below this ``b`` a job gains nothing worth cache space (Quiver: times "don't differ by much").
MIN_BENEFIT = 1.1
#: ``b`` of a job not measured yet: cached like the budget-only policy would, until measured.
ASSUMED_BENEFIT = 2.0
#: Batch reports classified as hits a job needs before ``t_hit`` is known (and it may be probed).
#: Small, so that a job is measured within seconds of starting: reports that say which of the
#: batch's files were misses are classified exactly, and the median of a few is robust enough
#: to tell ``b = 1`` from ``b = 2`` (the allocation only needs ``b`` against ``MIN_BENEFIT`` and
#: the order of ``G_D`` per byte; re-probes refine it).
HIT_SAMPLES = 4
#: Batch reports classified as misses a job needs before ``t_miss`` is known.
MISS_SAMPLES = 4
#: Miss-classified batches a probe collects before it ends.
PROBE_BATCHES = 8
#: A probe ends after this many of the job's claims, or :data:`PROBE_MAX_S` seconds, even if
#: it could not collect its batches (e.g. nothing uncached was left to give).
PROBE_MAX_CLAIMS = 32
PROBE_MAX_S = 60.0
#: Seconds after a job's miss time was measured before it is probed again (Quiver re-probes
#: periodically: remote load changes how much a job gains).
PROBE_PERIOD = 600.0
#: Seconds between two allocations when no job arrived, left or finished a probe.
REALLOCATE_INTERVAL = 30.0
#: A job's ``b`` that moved by this factor since the last allocation makes a new one due.
MOVED_FACTOR = 1.25
#: ... and so does one that crossed :data:`MIN_BENEFIT` by more than this (hysteresis: a job
#: sitting on the threshold does not flip its dataset on and off at every report).
MOVED_MARGIN = 0.05


def benefit_moved(old: float | None, new: float | None) -> bool:
    """Whether a job's ``b`` changed enough since the last allocation to allocate again: it
    was first measured, crossed :data:`MIN_BENEFIT` (by more than :data:`MOVED_MARGIN`), or
    moved by :data:`MOVED_FACTOR`. The first ``b`` comes from a few samples; the allocation
    follows it as more arrive instead of keeping an early noisy decision for
    :data:`REALLOCATE_INTERVAL` (an ``off`` dataset gets no hit samples, so only its miss
    times can move it back)."""
    if new is None:
        return False
    if old is None:
        return True
    if (old < MIN_BENEFIT) != (new < MIN_BENEFIT) and abs(new - MIN_BENEFIT) > MOVED_MARGIN:
        return True
    return max(old, new) / max(1e-9, min(old, new)) >= MOVED_FACTOR


def median(values: Sequence[float]) -> float | None:
    """The median of ``values``; None when empty."""
    return statistics.median(values) if values else None


@dataclass(frozen=True)
class JobBenefit:
    """One job's measured times (seconds per mini-batch; None: not measured yet)."""

    job: str
    gpus: int  # the job's world size
    t_hit: float | None = None
    t_miss: float | None = None
    probing: bool = False

    @property
    def measured(self) -> bool:
        return self.t_hit is not None and self.t_miss is not None and self.t_hit > 0

    @property
    def b(self) -> float | None:
        """``t_miss / t_hit``; None until both are measured."""
        if not self.measured:
            return None
        assert self.t_hit is not None and self.t_miss is not None
        return self.t_miss / self.t_hit

    @property
    def g(self) -> float | None:
        """``b × GPUs``; None until measured."""
        b = self.b
        return None if b is None else b * self.gpus


@dataclass(frozen=True)
class DatasetDemand:
    """What :func:`allocate` needs of one dataset.

    ``chunk_bytes``: one chunk in chunked mode (``min(fraction × total, max_chunk_bytes)``);
    ``min_chunk_bytes``: the smallest chunk still random enough to train on
    (``MIN_FRACTION × total``); ``fixed``: a manual mode (``--dataset-mode``), kept as is and
    charged against the budget.
    """

    dataset: str
    total_bytes: int
    chunk_bytes: int
    min_chunk_bytes: int = 0
    jobs: tuple[JobBenefit, ...] = ()
    fixed: Mode | None = None


@dataclass(frozen=True)
class Allocation:
    """The decision for one dataset: its mode, the bytes it may use, and why."""

    dataset: str
    mode: Mode
    budget: int  # bytes allocated: the dataset's budget for its chunks (0 when off)
    benefit: float  # G_D as used for the order (assumed values included)
    reason: str


def dataset_benefit(demand: DatasetDemand, *, assumed: float = ASSUMED_BENEFIT) -> float:
    """``G_D``: Σ ``b × GPUs`` over the dataset's jobs, :data:`ASSUMED_BENEFIT` for a job not
    measured yet; a dataset no job reports on counts as one unmeasured job of one GPU."""
    if not demand.jobs:
        return assumed
    return sum((j.b if j.b is not None else assumed) * j.gpus for j in demand.jobs)


def _insensitive(demand: DatasetDemand, min_benefit: float) -> float | None:
    """The largest ``b`` when every job is measured and below ``min_benefit``, else None."""
    if not demand.jobs or not all(j.measured for j in demand.jobs):
        return None
    top = max(j.b for j in demand.jobs if j.b is not None)
    return top if top < min_benefit else None


def _mb(n: float) -> str:
    return f"{n / 1e6:.1f} MB"


def allocate(
    demands: Iterable[DatasetDemand],
    budget: int,
    *,
    slots: int = 2,
    min_benefit: float = MIN_BENEFIT,
    assumed: float = ASSUMED_BENEFIT,
) -> dict[str, Allocation]:
    """Each dataset's mode and budget under ``budget`` bytes (see the module docstring).

    Deterministic: ties in the ratio are broken by dataset name.
    """
    demands = sorted(demands, key=lambda d: d.dataset)
    out: dict[str, Allocation] = {}
    left = budget
    # Manual modes first: they are not ours to change, but they use the budget.
    for d in demands:
        if d.fixed is None:
            continue
        cost = {Mode.FULL: d.total_bytes, Mode.CHUNKED: min(d.total_bytes, slots * d.chunk_bytes)}.get(d.fixed, 0)
        left -= cost
        out[d.dataset] = Allocation(d.dataset, d.fixed, cost, dataset_benefit(d, assumed=assumed),
                                    "fixed by --dataset-mode")
    candidates: list[tuple[DatasetDemand, float]] = []
    for d in demands:
        if d.fixed is not None:
            continue
        g = dataset_benefit(d, assumed=assumed)
        top = _insensitive(d, min_benefit)
        if top is not None:
            out[d.dataset] = Allocation(d.dataset, Mode.OFF, 0, g,
                                        f"insensitive: every job has b <= {top:.2f} < {min_benefit:.2f}")
            continue
        candidates.append((d, g))

    def two_chunks(d: DatasetDemand) -> int:
        return min(d.total_bytes, slots * d.chunk_bytes)

    # Pass 1: two chunks each (or the whole dataset when that is no bigger), best G per byte first.
    order = sorted(candidates, key=lambda c: (-c[1] / max(1, two_chunks(c[0])), c[0].dataset))
    for rank, (d, g) in enumerate(order, 1):
        cost = two_chunks(d)
        why = f"G={g:.2f}, #{rank} by G per byte"
        if cost >= d.total_bytes and cost <= left:
            out[d.dataset] = Allocation(d.dataset, Mode.FULL, d.total_bytes, g,
                                        f"{why}: fits whole ({_mb(d.total_bytes)})")
        elif cost < d.total_bytes and cost <= left:
            out[d.dataset] = Allocation(d.dataset, Mode.CHUNKED, cost, g,
                                        f"{why}: two chunks ({_mb(cost)})")
        else:
            out[d.dataset] = Allocation(d.dataset, Mode.OFF, 0, g,
                                        f"{why}: no room (needs {_mb(cost)}, {_mb(max(0, left))} left)")
            continue
        left -= out[d.dataset].budget
    # Pass 2: upgrade to full, best G per extra byte first, while the rest of the budget allows.
    chunked = [(d, g) for d, g in candidates if out[d.dataset].mode is Mode.CHUNKED]
    chunked.sort(key=lambda c: (-c[1] / max(1, c[0].total_bytes - out[c[0].dataset].budget), c[0].dataset))
    for d, g in chunked:
        extra = d.total_bytes - out[d.dataset].budget
        if extra <= left:
            left -= extra
            out[d.dataset] = Allocation(d.dataset, Mode.FULL, d.total_bytes, g,
                                        f"G={g:.2f}: upgraded to full ({_mb(d.total_bytes)}), "
                                        f"best G per extra byte that fits")
    # Pass 3: what is left goes, as smaller chunks (still >= min_chunk_bytes each), to the
    # datasets that got nothing, best G per byte first.
    for rank, (d, g) in enumerate(order, 1):
        if out[d.dataset].mode is Mode.OFF and d.min_chunk_bytes and left >= slots * d.min_chunk_bytes:
            out[d.dataset] = Allocation(d.dataset, Mode.CHUNKED, left, g,
                                        f"G={g:.2f}, #{rank} by G per byte: smaller chunks in "
                                        f"what was left ({_mb(left)})")
            left = 0
    return out
