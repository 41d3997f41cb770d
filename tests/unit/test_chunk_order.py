"""Chunked mode: the claim order is random across epochs (issue 15).

Several jobs read a chunked dataset for ten epochs through the registry, on a simulated cache
(preloads land a few files per step, misses when claimed, co-ordinated evictions at once, and
a capacity of 20% of the dataset above which the oldest unheld files go, like LRU). Each
file's position in each epoch must be uniform (chi-square on deciles) and unrelated to its
position in the epoch before (Spearman's rank correlation), while every job is still given
every file exactly once per epoch and the remote serves about one dataset per epoch.
"""

from __future__ import annotations

import random
from array import array
from collections import OrderedDict

import pytest

from mountd.coop.chunks import Evict, Preload
from mountd.coop.packing import Packing
from mountd.coop.plans import Mode
from mountd.coop.sessions import SessionRegistry
from quiverfs.testing import order_stats


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
        self.fetched = 0
        self.now = 0.0

    def fill(self, ids) -> None:
        state = self.registry.dataset("ds")
        new = [i for i in ids if not state.is_cached(i)]
        self.fetched += len(new)
        for i in new:
            self.files[i] = None
        self.registry.on_cached("ds", new)
        self._trim()

    def _trim(self) -> None:
        state = self.registry.dataset("ds")
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
        self.registry.on_evicted("ds", gone)

    def step(self) -> None:
        self.now += 1.0
        for action in self.registry.tick(self.now):
            if isinstance(action, Preload):
                self.queue = list(action.ids)
            elif isinstance(action, Evict):
                for i in action.ids:
                    self.files.pop(i, None)
                self.registry.on_evicted("ds", action.ids)
        state = self.registry.dataset("ds")
        batch = [i for i in self.queue[: self.rate] if not state.is_cached(i)]
        self.queue = self.queue[self.rate :]
        self.fill(batch)


def run_epochs(*, n: int, jobs: int, world: int, epochs: int, batch: int, rate: int,
               packing: Packing | None = None, seed: int = 7):
    """Jobs claiming in turn (each rank ``batch`` files a step) for ``epochs`` epochs:
    per job and epoch the order the files were given in, and the files fetched.

    Each rank moves to its next epoch as soon as it has its share of the last one, as a real
    rank does, so one rank may start epoch ``e + 1`` while another still claims in ``e``."""
    clock = [0.0]
    registry = SessionRegistry(clock=lambda: clock[0], chunk_grace=0.0)
    sizes = [1000] * n
    cache_bytes = sum(sizes) // 5  # 20% of the dataset
    budget = int(cache_bytes * 0.8)  # mountd's BUDGET_FRACTION
    mode = registry.add_dataset("ds", sizes, budget=budget, seed=seed, packing=packing)
    assert mode is Mode.CHUNKED
    cache = SimulatedCache(registry, capacity=n // 5, rate=rate)
    rng = random.Random(seed)
    names = [f"job{j}" for j in range(jobs)]
    for name in names:
        for rank in range(world):
            registry.open_session("ds", name, rank=rank, world_size=world, seed=j_seed(name))
    order: dict[str, list[list[int]]] = {name: [[] for _ in range(epochs)] for name in names}
    epoch = {(name, rank): 0 for name in names for rank in range(world)}
    while any(e < epochs for e in epoch.values()):
        cache.step()
        clock[0] = cache.now
        for name in rng.sample(names, len(names)):  # jobs interleave in random order
            for rank in range(world):
                e = epoch[name, rank]
                if e >= epochs:
                    continue
                claim = registry.claim("ds", name, rank, batch, epoch=e)
                order[name][e].extend(claim.ids)
                cache.fill(claim.fetch + claim.brought)
                if registry.pool("ds", name, e).rank_remaining(rank) == 0:
                    epoch[name, rank] = e + 1
                    if e + 1 < epochs:
                        registry.next_epoch("ds", name, rank, e + 1)
    return order, cache.fetched, registry


def j_seed(name: str) -> int:
    return int(name.removeprefix("job")) + 1


def check_order(order: dict[str, list[list[int]]], n: int) -> tuple[list[float], list[float]]:
    """Per job: the p of the decile test over its epochs; and the correlations of positions
    in consecutive epochs of every job (quiverfs/testing/order_stats.py). Jobs are tested
    apart: jobs sharing a chunk read its files at about the same time (that is the
    co-operation), so pooling them would count one draw twice; what a model trains on is its
    own job's order."""
    ps, correlations = [], []
    for epochs in order.values():
        for seq in epochs:
            assert sorted(seq) == list(range(n))  # exactly once per epoch per job
        positions = [{i: p for p, i in enumerate(seq)} for seq in epochs]
        ps.append(order_stats.position_chi2_p(positions, n, bins=10))
        correlations += order_stats.lag_correlations(positions)
    return ps, correlations


def test_the_statistics_can_fail():
    """The two statistics reject the fixed order the issue found (a file at a similar place
    every epoch) and accept shuffles."""
    rng = random.Random(1)
    n = 600
    base = list(range(n))
    rng.shuffle(base)
    sticky = {"job": []}
    for _ in range(10):  # each file moves at most ±60 places between epochs
        keyed = sorted(range(n), key=lambda i: base.index(i) + rng.uniform(-60, 60))
        sticky["job"].append(keyed)
    [p], r = check_order(sticky, n)
    assert p < 1e-6 and min(r) > 0.5
    shuffled = {"job": [rng.sample(range(n), n) for _ in range(10)]}
    [p], r = check_order(shuffled, n)
    assert 0.01 < p < 0.999 and max(abs(x) for x in r) < 0.15


@pytest.mark.parametrize(("jobs", "world", "rate"),
                         [(2, 2, 12), (4, 1, 12), (2, 2, 3), (1, 2, 1), (2, 2, 1)])
def test_chunked_order_is_random_across_epochs(jobs, world, rate):
    """``rate`` 1: the readers run far ahead of the loads (as a job without compute does).

    Four seeds, judged together: one seed passed by luck before (at seed 7 every case
    passed, while over seeds 1-4 half the epoch pairs of the cases with two ranks had
    ``|r| >= 0.15`` and their mean r was -0.15 to -0.17: a rank finishing an epoch drew
    chunks of the files it had left, which the job's next epoch read first). Bounds, for
    600 files (one pair's r has a standard error of ~0.04): the mean r of all pairs within
    0.06 (what is left is +0.02 to +0.05, the share of the resident chunks a new epoch
    defers: EpochPool._start), at most 15% of pairs at ``|r| >= 0.15``, and each run's
    decile test neither clustered (p > 1e-4) nor too regular (p < 0.9999)."""
    n = 600
    ps: list[float] = []
    r: list[float] = []
    for seed in range(1, 5):
        order, fetched, registry = run_epochs(n=n, jobs=jobs, world=world, epochs=10, batch=8,
                                              rate=rate, seed=seed)
        assert registry.dataset("ds").plan.chunks >= 10
        run_ps, run_r = check_order(order, n)
        ps += run_ps
        r += run_r
        # The remote: about one dataset per epoch, whatever the number of jobs.
        assert fetched / n / 10 <= 1.2, (seed, fetched / n / 10)
    assert min(ps) > 1e-4 and max(ps) < 0.9999, ps  # neither clustered nor too regular
    assert abs(sum(r) / len(r)) < 0.06, r
    assert sum(abs(x) >= 0.15 for x in r) <= 0.15 * len(r), r


def test_a_rank_finishing_an_epoch_its_job_has_left_draws_no_chunk():
    """Once one rank of a job reads the next epoch, the other finishes the last one with the
    files left, in random order, without drawing a chunk of them (the next epoch would read
    such a chunk first: see the test above); every file still goes exactly once."""
    n = 600
    registry = SessionRegistry(clock=lambda: 0.0, chunk_grace=0.0)
    sizes = [1000] * n
    registry.add_dataset("ds", sizes, budget=int(sum(sizes) // 5 * 0.8), seed=7)
    for rank in (0, 1):
        registry.open_session("ds", "job", rank=rank, world_size=2, seed=1)
    got: list[int] = []
    while registry.pool("ds", "job", 0).rank_remaining(0):
        got += registry.claim("ds", "job", 0, 8, epoch=0).ids
    for _ in range(10):
        got += registry.claim("ds", "job", 1, 8, epoch=0).ids
    registry.next_epoch("ds", "job", 0, 1)
    registry.claim("ds", "job", 0, 8, epoch=1)
    manager = registry.dataset("ds").manager
    drawn = manager.generations
    left = n - len(got)
    assert left > 150
    late: list[int] = []
    while registry.pool("ds", "job", 0).rank_remaining(1):
        claim = registry.claim("ds", "job", 1, 8, epoch=0)
        assert claim.ids and not claim.wait
        late += claim.ids
    assert manager.generations == drawn  # no chunk drawn for the old epoch
    assert sorted(got + late) == list(range(n))


def test_packed_chunked_order_is_random_across_epochs():
    """Packed datasets: chunks are drawn a packed chunk at a time (shuffled packing)."""
    n, pack = 600, 6
    rng = random.Random(3)
    ids = list(range(n))
    rng.shuffle(ids)  # `digests pack` shuffles files into packed chunks
    chunk_of = [0] * n
    groups = [sorted(ids[k : k + pack]) for k in range(0, n, pack)]
    for c, g in enumerate(groups):
        for i in g:
            chunk_of[i] = c
    members = array("i", [i for g in groups for i in g])
    starts = array("i", list(range(0, n + 1, pack)))
    packing = Packing(array("i", chunk_of), starts, members)
    order, fetched, registry = run_epochs(n=n, jobs=2, world=2, epochs=10, batch=8, rate=12,
                                          packing=packing)
    plan = registry.dataset("ds").plan
    for c in range(plan.chunks):  # chunks stay unions of whole packed chunks
        assert {chunk_of[i] for i in plan.ids_of(c)}.isdisjoint(
            {chunk_of[i] for d in range(plan.chunks) if d != c for i in plan.ids_of(d)})
    ps, r = check_order(order, n)
    assert min(ps) > 0.01 and max(ps) < 0.999, ps  # neither clustered nor too regular
    assert abs(sum(r) / len(r)) < 0.1, r
    assert fetched / n / 10 <= 1.3, fetched / n / 10
