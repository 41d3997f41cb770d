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

Greedy by ``G_D`` per byte, in five passes: first every beneficial dataset gets its two chunks,
best ratio first (they are cheap and turn the dataset's misses co-operative), then the leftover
budget upgrades datasets to ``full`` in the order of ``G_D`` per extra byte, then what is still
left goes to the best dataset that got nothing, as smaller chunks (each at least
``min_chunk_bytes``, the 1% below which a chunk is too small to be random); the datasets left
``chunked`` then shrink their chunks to a lean size (:func:`lean_chunk_bytes`: 4% of the
dataset, at least 32 files), and what remains after that is *kept* by the chunked datasets
across epochs (:attr:`Allocation.retain`, best ratio first: files of evicted chunks stay
cached, so an epoch fetches less than the whole dataset; docs/substitutable-reads.md,
"Deviations"). A job not measured
yet counts with the median ``b`` of its dataset's measured jobs (jobs of one dataset tend to
gain alike; a third job of an insensitive dataset must not keep it cached until it is
measured), or with :data:`ASSUMED_BENEFIT` when none is measured (so a new dataset is cached,
its hits measured, then its job probed), and so does a dataset that no shim job reads (plain
readers report nothing).

:func:`allocate_in_order` is the allocation of the two other policies, *budget-only* (no
benefit: each dataset's mode from the budget alone) and *manual* (``--dataset-mode``): one
budget shared by every dataset, taken in registration order, each getting its mode only if it
fits what the earlier ones left. Each dataset sized against the whole budget on its own would
let three datasets each "fit" two chunks and together pin more than the cache.
"""

from __future__ import annotations

import statistics
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, replace

from mountd.coop.plans import Mode

__all__ = [
    "ASSUMED_BENEFIT",
    "BENEFIT_AWARE",
    "BUDGET_ONLY",
    "MANUAL",
    "Allocation",
    "DatasetDemand",
    "JobBenefit",
    "MIN_BENEFIT",
    "RETURN_MARGIN",
    "allocate",
    "allocate_in_order",
    "benefit_moved",
    "could_be_full",
    "counted_benefits",
    "lean_chunk_bytes",
]

#: The allocation policies, as ``quiverfs stats`` names them: by measured benefit (the
#: default), by the budget alone (each dataset in registration order takes its mode if it fits
#: what is left), or every mode fixed by ``--dataset-mode`` (charged in the same order).
BENEFIT_AWARE = "benefit-aware"
BUDGET_ONLY = "budget-only"
MANUAL = "manual"

#: Below this ``b`` a job gains nothing worth cache space (Quiver: times "don't differ by much").
MIN_BENEFIT = 1.1
#: ``b`` of a job not measured yet: cached like the budget-only policy would, until measured.
ASSUMED_BENEFIT = 2.0
#: Batch reports classified as hits a job needs before ``t_hit`` is known (and it may be probed).
#: Small, so that a job is measured within seconds of starting: reports that say which of the
#: batch's files were misses are classified exactly, and the mean of a few is enough to tell
#: ``b = 1`` from ``b = 2`` (the allocation only needs ``b`` against ``MIN_BENEFIT`` and the
#: order of ``G_D`` per byte; more samples and re-probes refine it).
HIT_SAMPLES = 4
#: Batch reports classified as misses a job needs before ``t_miss`` is known.
MISS_SAMPLES = 4
#: Miss-classified batches a probe collects before it ends.
PROBE_BATCHES = 4
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
#: A dataset the allocation turned ``off`` as insensitive comes back only when one of its jobs
#: counts at least ``MIN_BENEFIT + RETURN_MARGIN`` (hysteresis of the decision itself, where
#: :data:`MOVED_MARGIN` only decides when to decide again). A CPU-bound job's ``b`` is about 1
#: and its samples spread around it: in peers.py (b), 2026-11-30, one such job read 1.00–1.23
#: and without a margin its dataset changed mode 7–8 times in two epochs, each change
#: redrawing the chunks and stalling the job. Going off keeps the plain 1.1 (an insensitive
#: dataset must free its bytes for the others: benefit_aware.py); coming back needs the
#: stronger evidence, as turning a dataset on costs chunk loads and turning it off costs
#: nothing. A sensitive job measures far above it (3–65 in benefit_aware.py).
RETURN_MARGIN = 0.25


#: A dataset that holds cache now keeps its place in the greedy order unless another's G per
#: byte beats its own by this factor: noisy ``b`` samples otherwise swap two datasets' budgets
#: back and forth, and every swap reloads chunks of both (benefit_aware.py at a 15% cache:
#: four swaps in 15 s between the sensitive and the medium dataset, 2026-11-27). Each place
#: ahead counts once more: of the datasets holding cache, the one with the most counts
#: ``KEEP_FACTOR ** n``, the next ``KEEP_FACTOR ** (n - 1)``, ..., one holding none 1.
KEEP_FACTOR = 1.5


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
    #: the chunk the dataset shrinks to when it keeps files across epochs (pass 4 of
    #: :func:`allocate`, :func:`lean_chunk_bytes`); 0: it does not shrink
    lean_chunk_bytes: int = 0
    #: the most bytes its chunks (or, ``full``, the whole dataset) may pin: the cache less
    #: the room its one job's look-ahead needs (``SessionRegistry._max_pinned``); None: no
    #: bound. Below two chunks of ``min_chunk_bytes`` the dataset is ``off``.
    max_pinned: int | None = None


@dataclass(frozen=True)
class Allocation:
    """The decision for one dataset: its mode, the bytes it may use, and why."""

    dataset: str
    mode: Mode
    budget: int  # bytes allocated: the dataset's budget for its chunks (0 when off)
    benefit: float  # G_D as used for the order (assumed values included)
    reason: str
    #: ``chunked`` only: bytes of the dataset's files kept cached across epochs beyond its
    #: chunks (pass 5 of :func:`allocate`; mountd.coop.service keeps them at chunk eviction)
    retain: int = 0
    #: ``off`` because every job counts below the threshold (not for want of room): the next
    #: allocation needs :data:`RETURN_MARGIN` more to turn it back on
    insensitive: bool = False


#: A chunked dataset that keeps files across epochs shrinks its chunks to this share of itself
#: (Quiver's 10% is ``DatasetDemand.chunk_bytes``) ...
LEAN_CHUNK_FRACTION = 0.04
#: ... but never below this many files (of the dataset's mean size): a chunk of fewer is gone
#: in a claim or two of a sensitive job, and chunk turnover then stalls it (4% of 240 files,
#: 10 a chunk, cost benefit_aware.py 15% at a 15% cache; floors of 32 and 64 files, 48 and 64
#: a chunk of 1200 files, gave 4.8 and 4.5 at a 30% cache against 4.4 for 10% chunks;
#: 2026-11-28).
LEAN_CHUNK_FILES = 32


def lean_chunk_bytes(total: int, files: int, chunk_bytes: int, min_chunk_bytes: int) -> int:
    """The smallest chunk worth its turnover: ``max(LEAN_CHUNK_FRACTION × total,
    LEAN_CHUNK_FILES files, min_chunk_bytes)``, at most ``chunk_bytes``."""
    if files <= 0:
        return chunk_bytes
    lean = max(LEAN_CHUNK_FRACTION * total, LEAN_CHUNK_FILES * total / files, min_chunk_bytes)
    return int(min(chunk_bytes, lean))


def counted_benefits(demand: DatasetDemand, *, assumed: float = ASSUMED_BENEFIT) -> list[float]:
    """The ``b`` each of the dataset's jobs counts with, in ``demand.jobs`` order: its own when
    measured, else the median of the dataset's measured jobs, else ``assumed``."""
    measured = [j.b for j in demand.jobs if j.b is not None]
    stand_in = statistics.median(measured) if measured else assumed
    return [j.b if j.b is not None else stand_in for j in demand.jobs]


def dataset_benefit(demand: DatasetDemand, *, assumed: float = ASSUMED_BENEFIT) -> float:
    """``G_D``: Σ ``b × GPUs`` over the dataset's jobs (:func:`counted_benefits`: a job not
    measured yet counts with the median of the measured ones, or ``assumed``); a dataset no
    job reports on counts as one unmeasured job of one GPU."""
    if not demand.jobs:
        return assumed
    bs = counted_benefits(demand, assumed=assumed)
    return sum(b * j.gpus for b, j in zip(bs, demand.jobs, strict=True))


def _insensitive(demand: DatasetDemand, min_benefit: float) -> tuple[float, int] | None:
    """``(largest b, jobs not measured)`` when at least one job is measured and every job
    counts (:func:`counted_benefits`) below ``min_benefit``; else None."""
    if not any(j.measured for j in demand.jobs):
        return None
    top = max(counted_benefits(demand))
    if top >= min_benefit:
        return None
    return top, sum(1 for j in demand.jobs if not j.measured)


def _mb(n: float) -> str:
    return f"{n / 1e6:.1f} MB"


def allocate(
    demands: Iterable[DatasetDemand],
    budget: int,
    *,
    slots: int = 2,
    min_benefit: float = MIN_BENEFIT,
    assumed: float = ASSUMED_BENEFIT,
    holding: Sequence[str] = (),
    resting: Collection[str] = (),
) -> dict[str, Allocation]:
    """Each dataset's mode and budget under ``budget`` bytes (see the module docstring).

    ``holding``: the datasets that hold cache now, the most bytes first; their G per byte
    counts more in the greedy order, by their place (:data:`KEEP_FACTOR`: hysteresis).
    ``resting``: the datasets the last allocation turned ``off`` as insensitive; they stay
    off until a job counts :data:`RETURN_MARGIN` above ``min_benefit``.
    Deterministic: ties in the ratio are broken by dataset name.
    """
    demands = sorted(demands, key=lambda d: d.dataset)
    plan = _GreedyPlan(budget, slots, holding)
    # Manual modes first: they are not ours to change, but they use the budget.
    for d in demands:
        if d.fixed is not None:
            plan.fix(d, dataset_benefit(d, assumed=assumed))
    candidates: list[tuple[DatasetDemand, float]] = []
    for d in demands:
        if d.fixed is None:
            g = dataset_benefit(d, assumed=assumed)
            if not plan.turned_off_insensitive(d, g, min_benefit, d.dataset in resting):
                candidates.append((d, g))
    order = sorted(candidates, key=lambda c: (-c[1] * plan.kept(c[0]) / max(1, plan.two_chunks(c[0])),
                                              c[0].dataset))
    for rank, (d, g) in enumerate(order, 1):
        plan.give_two_chunks(d, g, rank)
    plan.upgrade_to_full(candidates)
    for rank, (d, g) in enumerate(order, 1):
        plan.give_smaller_chunks(d, g, rank)
    for d, _ in order:
        plan.shrink_to_lean(d)
    for d, g in order:
        plan.retain(d, g)
    return plan.out


def _pinnable(d: DatasetDemand, cost: int) -> int:
    """``cost`` within the dataset's ``max_pinned`` (room for a single job's look-ahead)."""
    return cost if d.max_pinned is None else min(cost, d.max_pinned)


class _GreedyPlan:
    """One run of :func:`allocate`: the allocations made so far and the bytes left, with one
    method per pass of the greedy (the module docstring), each called per dataset in the
    pass's order."""

    def __init__(self, budget: int, slots: int, holding: Sequence[str]) -> None:
        self.out: dict[str, Allocation] = {}
        self.left = budget
        self.slots = slots
        self._places = {name: len(holding) - i for i, name in enumerate(holding)}

    def kept(self, d: DatasetDemand) -> float:
        """How much more the dataset's G per byte counts for holding cache now."""
        return KEEP_FACTOR ** self._places.get(d.dataset, 0)

    def two_chunks(self, d: DatasetDemand) -> int:
        return min(d.total_bytes, self.slots * d.chunk_bytes)

    def _too_little(self, d: DatasetDemand, cost: int) -> bool:
        return cost <= 0 or (cost < d.total_bytes and cost < self.slots * d.min_chunk_bytes)

    def _set(self, d: DatasetDemand, mode: Mode, cost: int, g: float, why: str, *,
             retain: int = 0, insensitive: bool = False) -> None:
        self.out[d.dataset] = Allocation(d.dataset, mode, cost, g, why, retain, insensitive)

    def fix(self, d: DatasetDemand, g: float) -> None:
        """A manual mode: charged what it pins (a manual ``full`` its whole size)."""
        mode = d.fixed
        assert mode is not None
        cost = {Mode.FULL: d.total_bytes, Mode.CHUNKED: self.two_chunks(d)}.get(mode, 0)
        self.left -= cost
        self._set(d, mode, cost, g, "fixed by --dataset-mode")

    def turned_off_insensitive(self, d: DatasetDemand, g: float, min_benefit: float,
                               resting: bool) -> bool:
        """``off`` when every job of the dataset is insensitive (a dataset ``resting`` off
        needs :data:`RETURN_MARGIN` more to come back); True when so."""
        threshold = min_benefit + (RETURN_MARGIN if resting else 0.0)
        insensitive = _insensitive(d, threshold)
        if insensitive is None:
            return False
        top, unmeasured = insensitive
        why = f"insensitive: every job has b <= {top:.2f} < {threshold:.2f}"
        if resting:
            why += f" (off already: {min_benefit:.2f} + {RETURN_MARGIN:.2f} to come back)"
        if unmeasured:
            why += f" ({unmeasured} not measured yet: counted at the median of the measured)"
        self._set(d, Mode.OFF, 0, g, why, insensitive=True)
        return True

    def give_two_chunks(self, d: DatasetDemand, g: float, rank: int) -> None:
        """Pass 1: two chunks (or the whole dataset when that is no bigger), within the room
        its job's look-ahead leaves; ``off`` when they do not fit."""
        cost = _pinnable(d, self.two_chunks(d))
        why = f"G={g:.2f}, #{rank} by G per byte"
        if cost < self.two_chunks(d):
            if self._too_little(d, cost):
                self._set(d, Mode.OFF, 0, g, f"{why}: no room beside its job's look-ahead "
                          f"(files held ahead of its reads; its chunks may pin {_mb(cost)})")
                return
            why += f", chunks sized to leave room for its job's look-ahead ({_mb(cost)})"
        if cost > self.left:
            self._set(d, Mode.OFF, 0, g, f"{why}: no room (needs {_mb(cost)}, {_mb(max(0, self.left))} left)")
        elif cost >= d.total_bytes:
            self._set(d, Mode.FULL, d.total_bytes, g, f"{why}: fits whole ({_mb(d.total_bytes)})")
            self.left -= d.total_bytes
        else:
            self._set(d, Mode.CHUNKED, cost, g, f"{why}: two chunks ({_mb(cost)})")
            self.left -= cost

    def upgrade_to_full(self, candidates: Iterable[tuple[DatasetDemand, float]]) -> None:
        """Pass 2: ``chunked`` datasets become ``full``, best G per extra byte first, while
        the budget left allows and their look-ahead bound does."""
        chunked = [(d, g) for d, g in candidates if self.out[d.dataset].mode is Mode.CHUNKED]
        chunked.sort(key=lambda c: (-c[1] * self.kept(c[0]) / max(1, c[0].total_bytes - self.out[c[0].dataset].budget),
                                    c[0].dataset))
        for d, g in chunked:
            extra = d.total_bytes - self.out[d.dataset].budget
            if extra <= self.left and _pinnable(d, d.total_bytes) == d.total_bytes:
                self.left -= extra
                self._set(d, Mode.FULL, d.total_bytes, g, f"G={g:.2f}: upgraded to full "
                          f"({_mb(d.total_bytes)}), best G per extra byte that fits")

    def give_smaller_chunks(self, d: DatasetDemand, g: float, rank: int) -> None:
        """Pass 3: what is left goes, as smaller chunks (still >= ``min_chunk_bytes`` each),
        to a dataset that got nothing."""
        cost = _pinnable(d, self.left)
        if self.out[d.dataset].mode is Mode.OFF and d.min_chunk_bytes and cost >= self.slots * d.min_chunk_bytes:
            self._set(d, Mode.CHUNKED, cost, g,
                      f"G={g:.2f}, #{rank} by G per byte: smaller chunks in what was left ({_mb(cost)})")
            self.left -= cost

    def shrink_to_lean(self, d: DatasetDemand) -> None:
        """Pass 4: a ``chunked`` dataset's chunks shrink to its lean size, the bytes freed
        joining what is left. Chunk slots are emptied and fetched again every epoch; bytes
        kept across epochs are hits every epoch without a fetch. With datasets of 1200, 600
        and 60 files at a 30% cache, the sensitive one in two 10% chunks kept 1.4 MB and
        fetched 93% of itself each epoch (LRU, keeping what it last read, led it); in lean
        chunks it kept 4.7 MB and led LRU, 4.85 / 4.81 against 4.61 / 4.84
        (benefit_aware.py, 2026-11-28)."""
        a = self.out[d.dataset]
        if a.mode is Mode.CHUNKED and d.lean_chunk_bytes and a.budget > self.slots * d.lean_chunk_bytes:
            lean = self.slots * d.lean_chunk_bytes
            self.left += a.budget - lean
            self._set(d, a.mode, lean, a.benefit,
                      f"{a.reason}; chunks shrunk to {_mb(d.lean_chunk_bytes)} to keep files across epochs")

    def retain(self, d: DatasetDemand, g: float) -> None:
        """Pass 5: what is still left is kept by a ``chunked`` dataset across epochs
        (retained files), up to what its chunks do not hold."""
        a = self.out[d.dataset]
        if self.left <= 0 or a.mode is not Mode.CHUNKED:
            return
        retain = min(self.left, d.total_bytes - a.budget)
        if retain > 0:
            self.left -= retain
            self._set(d, a.mode, a.budget, g, f"{a.reason}; keeps {_mb(retain)} of its files "
                      f"across epochs in the budget left", retain=retain)


#: ``t_miss / t_hit`` that :func:`could_be_full` gives a dataset's jobs: more than any
#: measured benefit, so the dataset leads the greedy order whatever the others measure.
UNBOUNDED_BENEFIT = 1e9


def could_be_full(
    demands: Sequence[DatasetDemand],
    decided: dict[str, Allocation],
    budget: int,
    *,
    slots: int = 2,
    holding: Sequence[str] = (),
    resting: Collection[str] = (),
) -> set[str]:
    """The ``chunked`` datasets of ``decided`` that :func:`allocate` would make ``full`` if
    their jobs' ``b`` were as large as can be: those for which a larger measured ``b`` can
    change the decision.

    Why: a chunked dataset's jobs are first measured by their cold start, whose misses ride
    on other jobs' fills (co-operative) and so understate ``t_miss``; only a probe measures
    it, and probes cost the probed job (its claims give files from outside the loaded
    chunks, fetched for it alone). Probing at once only the jobs whose true ``b`` could win
    their dataset ``full`` mode keeps that cost where the answer can matter: with datasets
    of 1200, 600 and 60 files at a 90% cache the sensitive jobs measured ``b`` 3-5 cold (28x
    faster with the cache) and their dataset stayed chunked while the smaller medium one
    was full; probing every job at once instead cost 2-7% where no dataset could be full
    (benefit_aware.py, 2026-11-28)."""
    out = set()
    for demand in demands:
        chosen = decided.get(demand.dataset)
        if chosen is None or chosen.mode is not Mode.CHUNKED or demand.fixed is not None \
                or not demand.jobs:
            continue
        boosted = replace(demand, jobs=tuple(
            replace(j, t_hit=1.0, t_miss=UNBOUNDED_BENEFIT) for j in demand.jobs))
        whatif = [boosted if d.dataset == demand.dataset else d for d in demands]
        if allocate(whatif, budget, slots=slots, holding=holding,
                    resting=resting)[demand.dataset].mode is Mode.FULL:
            out.add(demand.dataset)
    return out


def allocate_in_order(
    demands: Iterable[DatasetDemand],
    budget: int,
    *,
    slots: int = 2,
    policy: str = BUDGET_ONLY,
) -> dict[str, Allocation]:
    """Each dataset's mode and budget under one shared ``budget``, in the order given
    (registration order, so that a dataset that arrives never takes what an earlier one holds):
    the budget-only and manual policies (see the module docstring).

    A dataset without a manual mode is ``full`` when it fits what is left, else ``chunked``
    with chunks of ``min(chunk_bytes, left / slots)`` when those are still at least
    ``min_chunk_bytes``, else ``off`` (:func:`mountd.coop.plans.choose_mode` with what is
    left for a budget). A manual ``chunked`` dataset is sized the same way and is ``off``
    when no chunk fits; a manual ``full`` one is charged up to what is left (nothing of it is
    pinned: the cache's policy keeps what fits); ``off`` and ``lru`` cost nothing.
    """
    out: dict[str, Allocation] = {}
    left = budget
    for d in demands:
        g = dataset_benefit(d)
        head = "fixed by --dataset-mode" if d.fixed is not None else policy
        if d.fixed in (Mode.OFF, Mode.LRU):
            out[d.dataset] = Allocation(d.dataset, d.fixed, 0, g, "fixed by --dataset-mode")
            continue
        if d.fixed is Mode.FULL or (d.fixed is None and d.total_bytes <= left):
            cost = min(d.total_bytes, left)
            over = "" if cost == d.total_bytes else f", more than the {_mb(left)} left: not all of it stays"
            out[d.dataset] = Allocation(d.dataset, Mode.FULL, cost, g,
                                        f"{head}: whole ({_mb(d.total_bytes)}){over}")
            left -= cost
            continue
        chunk = min(d.chunk_bytes, left // slots)
        if chunk > 0 and chunk >= d.min_chunk_bytes:
            cost = slots * chunk
            out[d.dataset] = Allocation(d.dataset, Mode.CHUNKED, cost, g,
                                        f"{head}: {slots} chunks of {_mb(chunk)} "
                                        f"({_mb(left)} of {_mb(budget)} left)")
            left -= cost
            continue
        out[d.dataset] = Allocation(d.dataset, Mode.OFF, 0, g,
                                    f"{head}: no room ({_mb(max(0, left))} of {_mb(budget)} left; "
                                    f"a chunk must be >= {_mb(max(1, d.min_chunk_bytes))})")
    return out
