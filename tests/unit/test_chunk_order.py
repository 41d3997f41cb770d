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

import pytest

from mountd.coop.packing import Packing
from mountd.coop.sessions import SessionRegistry
from quiverfs.testing import order_stats
from quiverfs.testing.chunk_sim import run_epochs


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
        order, fetched, registry, _ = run_epochs(n=n, jobs=jobs, world=world, epochs=10,
                                                 batch=8, rate=rate, seed=seed)
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
    order, fetched, registry, _ = run_epochs(n=n, jobs=2, world=2, epochs=10, batch=8,
                                             rate=12, packing=packing)
    plan = registry.dataset("ds").plan
    for c in range(plan.chunks):  # chunks stay unions of whole packed chunks
        assert {chunk_of[i] for i in plan.ids_of(c)}.isdisjoint(
            {chunk_of[i] for d in range(plan.chunks) if d != c for i in plan.ids_of(d)})
    ps, r = check_order(order, n)
    assert min(ps) > 0.01 and max(ps) < 0.999, ps  # neither clustered nor too regular
    assert abs(sum(r) / len(r)) < 0.1, r
    assert fetched / n / 10 <= 1.3, fetched / n / 10


def test_jobs_started_out_of_phase_keep_their_offset_and_read_every_file_once():
    """The simulation's ``offsets`` (scripts/bench/chunk_phase.py): a job started 0.3 of an
    epoch late stays about that far behind at the same pace, and every job is still given
    every file exactly once per epoch."""
    n = 600
    run = run_epochs(n=n, jobs=2, world=2, epochs=6, batch=8, rate=12, offsets=[0.0, 0.3])
    check_order(run.order, n)  # exactly once per epoch per job
    assert run.starts["job0"][0] == 0
    assert round(n / 16 * 0.3) <= run.starts["job1"][0] <= round(n / 16 * 0.3) + 1
    phase = order_stats.phase_offset(run.starts["job0"], run.starts["job1"])
    assert 0.2 < phase < 0.4, phase
    # Together from the start: in phase.
    together = run_epochs(n=n, jobs=2, world=2, epochs=6, batch=8, rate=12)
    assert abs(order_stats.phase_offset(together.starts["job0"], together.starts["job1"])) < 0.1


def test_phase_offset():
    """Fractions of the reference's epochs, folded into [-0.5, 0.5), the first epoch left out."""
    ref = [0.0, 10.0, 20.0, 30.0, 40.0]
    assert order_stats.phase_offset(ref, [0.0, 13.0, 23.0, 33.0]) == pytest.approx(0.3)
    assert order_stats.phase_offset(ref, [0.0, 18.0, 28.0, 38.0]) == pytest.approx(-0.2)
    assert order_stats.phase_offset(ref, [4.0, 10.0, 20.0], skip=0) == pytest.approx(0.4 / 3)
    assert order_stats.phase_offset(ref, [0.0, 15.0], skip=1) == pytest.approx(-0.5)
    assert order_stats.phase_offset(ref, [0.0]) != order_stats.phase_offset(ref, [0.0])  # NaN
