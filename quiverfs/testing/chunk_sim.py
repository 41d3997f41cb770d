"""The claim registry on a simulated cache: several jobs read a chunked dataset for some epochs.

Shared by the chunk-order tests (tests/unit/test_chunk_order.py) and the phase benchmark
(scripts/bench/chunk_phase.py). No I/O and no clock: a step of the simulation is one claim
of ``batch`` files by every rank of every started job, in random job order; preloads land
``rate`` files a step, claimed misses land at once, and above a capacity of 20% of the
dataset the oldest files no loading or resident chunk holds go first (LRU-like).

``offsets`` starts job ``k`` that many epochs (a fraction) after job 0, in steps of the
jobs' common pace, so the jobs read side by side out of phase, as jobs sharing a dataset
on a real machine do (docs/substitutable-reads.md "Jobs out of phase").
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import NamedTuple

from mountd.coop.chunks import Evict, Preload
from mountd.coop.packing import Packing
from mountd.coop.plans import Mode
from mountd.coop.sessions import SessionRegistry

__all__ = ["SimRun", "SimulatedCache", "job_seed", "run_epochs"]

#: The dataset's name in the simulated registry.
DATASET = "ds"


class SimulatedCache:
    """Performs the registry's actions on a cache of ``capacity`` files: preloads land
    ``rate`` files per step, claimed misses land at once, evictions happen at once; above
    the capacity the oldest files no loading/resident chunk holds go first (LRU-like)."""

    def __init__(self, registry: SessionRegistry, capacity: int, rate: int) -> None:
        self.registry = registry
        self.capacity = capacity
        self.rate = rate
        self.queue: list[int] = []
        self.files: OrderedDict[int, None] = OrderedDict()
        #: Files fetched from the (simulated) bucket so far.
        self.fetched = 0
        self.now = 0.0

    def fill(self, ids: Iterable[int]) -> None:
        state = self.registry.dataset(DATASET)
        new = [i for i in ids if not state.is_cached(i)]
        self.fetched += len(new)
        for i in new:
            self.files[i] = None
        self.registry.on_cached(DATASET, new)
        self._trim()

    def _trim(self) -> None:
        state = self.registry.dataset(DATASET)
        over = len(self.files) - self.capacity
        if over <= 0:
            return
        gone = []
        for i in self.files:
            if len(gone) >= over:
                break
            if not state.pinned(i):
                gone.append(i)
        for i in gone:
            del self.files[i]
        self.registry.on_evicted(DATASET, gone)

    def step(self) -> None:
        self.now += 1.0
        for action in self.registry.tick(self.now):
            if isinstance(action, Preload):
                self.queue = list(action.ids)
            elif isinstance(action, Evict):
                for i in action.ids:
                    self.files.pop(i, None)
                self.registry.on_evicted(DATASET, action.ids)
        state = self.registry.dataset(DATASET)
        batch = [i for i in self.queue[: self.rate] if not state.is_cached(i)]
        self.queue = self.queue[self.rate :]
        self.fill(batch)


class SimRun(NamedTuple):
    """What :func:`run_epochs` saw."""

    #: ``order[job][e]``: the files in the order job ``job`` was given them in epoch ``e``
    #: (its ranks' claims as they came).
    order: dict[str, list[list[int]]]
    #: Files fetched from the (simulated) bucket over the run.
    fetched: int
    registry: SessionRegistry
    #: ``starts[job][e]``: the step at which the job's rank 0 made its first claim of epoch
    #: ``e``.
    starts: dict[str, list[int]]


def job_seed(name: str) -> int:
    """The sampler seed of job ``job<k>``: ``k + 1``."""
    return int(name.removeprefix("job")) + 1


class _SimJob:
    """One job of :func:`run_epochs`: its ranks' epochs, the order it was given the files in,
    and the step each of its epochs began."""

    def __init__(self, registry: SessionRegistry, name: str, *, world: int, epochs: int,
                 start: int) -> None:
        self.registry = registry
        self.name = name
        self.world = world
        self.epochs = epochs
        self.start = start
        self.opened = False
        self.epoch = [0] * world
        self.order: list[list[int]] = [[] for _ in range(epochs)]
        self.starts: list[int] = []

    @property
    def done(self) -> bool:
        return min(self.epoch) >= self.epochs

    def open(self) -> None:
        self.opened = True
        for rank in range(self.world):
            self.registry.open_session(DATASET, self.name, rank=rank, world_size=self.world,
                                       seed=job_seed(self.name))

    def step(self, step: int, batch: int, cache: SimulatedCache) -> None:
        """Each rank claims ``batch`` files (from the step the job starts at)."""
        if step < self.start:
            return
        if not self.opened:
            self.open()
        for rank in range(self.world):
            e = self.epoch[rank]
            if e < self.epochs:
                self._claim(rank, e, step, batch, cache)

    def _claim(self, rank: int, e: int, step: int, batch: int, cache: SimulatedCache) -> None:
        registry = self.registry
        if rank == 0 and len(self.starts) == e:
            self.starts.append(step)
        claim = registry.claim(DATASET, self.name, rank, batch, epoch=e)
        self.order[e].extend(claim.ids)
        cache.fill(claim.fetch + claim.brought)
        if registry.pool(DATASET, self.name, e).rank_remaining(rank) == 0:
            self.epoch[rank] = e + 1
            if e + 1 < self.epochs:
                registry.next_epoch(DATASET, self.name, rank, e + 1)


def run_epochs(*, n: int, jobs: int, world: int, epochs: int, batch: int, rate: int,
               packing: Packing | None = None, seed: int = 7,
               offsets: Sequence[float] | None = None,
               ) -> SimRun:
    """Jobs claiming in turn (each rank ``batch`` files a step) for ``epochs`` epochs.

    Each rank moves to its next epoch as soon as it has its share of the last one, as a real
    rank does, so one rank may start epoch ``e + 1`` while another still claims in ``e``.
    ``offsets[k]``: epochs by which job ``k`` starts after the first step (default: all 0).
    """
    offsets = list(offsets) if offsets is not None else [0.0] * jobs
    if len(offsets) != jobs or min(offsets) < 0:
        raise ValueError("offsets: one non-negative value per job")
    clock = [0.0]
    registry = SessionRegistry(clock=lambda: clock[0], chunk_grace=0.0)
    sizes = [1000] * n
    cache_bytes = sum(sizes) // 5  # 20% of the dataset
    budget = int(cache_bytes * 0.8)  # mountd's BUDGET_FRACTION
    mode = registry.add_dataset(DATASET, sizes, budget=budget, seed=seed, packing=packing)
    assert mode is Mode.CHUNKED
    cache = SimulatedCache(registry, capacity=n // 5, rate=rate)
    rng = random.Random(seed)
    steps_per_epoch = n / (batch * world)
    sim = [_SimJob(registry, f"job{j}", world=world, epochs=epochs,
                   start=round(offset * steps_per_epoch)) for j, offset in enumerate(offsets)]
    for job in sim:
        if job.start == 0:
            job.open()  # before the first tick, as mountd sees jobs started together
    step = 0
    while not all(job.done for job in sim):
        cache.step()
        clock[0] = cache.now
        for job in rng.sample(sim, len(sim)):  # jobs interleave in random order
            job.step(step, batch, cache)
        step += 1
    return SimRun({job.name: job.order for job in sim}, cache.fetched, registry,
                  {job.name: job.starts for job in sim})
