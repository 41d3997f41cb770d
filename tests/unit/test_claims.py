"""mountd.coop.claims: exactly-once epochs, random order, substitutable hits, co-operative misses."""

from __future__ import annotations

import random
from array import array

import pytest

from mountd.coop.claims import EpochPool, advised_fetch
from mountd.coop.dataset_state import DatasetState
from mountd.coop.plans import ChunkPlan
from mountd.coop.sessions import SessionRegistry
from mountd.coop.unread import UnreadSet
from quiverfs.testing.clock import FakeClock
from quiverfs.testing.order_stats import spearman


def full_registry(n: int, *, cached=(), clock=None, **kwargs) -> SessionRegistry:
    registry = SessionRegistry(clock=clock or FakeClock(), **kwargs)
    registry.add_dataset("ds", [1000] * n, mode="full", cached=cached)
    return registry


def drain(registry, job, rank, n, epoch=None):
    """Claims of one rank until its end of epoch; the ids in claim order."""
    out = []
    while True:
        claim = registry.claim("ds", job, rank, n, epoch=epoch)
        if claim.end_of_epoch:
            return out
        out.extend(claim.ids)


# -- UnreadSet ------------------------------------------------------------------------------------


def unread_set(capacity: int, ids) -> UnreadSet:
    members = array("i", ids)
    pos = array("i", [7]) * capacity  # garbage on purpose: a sparse set needs no clearing
    for k, i in enumerate(members):
        pos[i] = k
    return UnreadSet(members, pos)


def test_unread_set_regions_discard_and_sampling():
    s = unread_set(10, [1, 3, 5, 7])
    assert len(s) == 4 and 3 in s and 4 not in s and 0 not in s
    s.set_cached(3, True)
    s.set_cached(3, True)  # idempotent
    s.set_cached(4, True)  # not a member: no-op
    s.set_cached(7, True)
    assert s.cached == 2 and s.is_cached(7) and not s.is_cached(1)
    rng = random.Random(0)
    assert {s.sample_cached(rng) for _ in range(100)} == {3, 7}
    assert {s.sample_uncached(rng) for _ in range(100)} == {1, 5}
    s.discard(3)
    s.discard(9)  # absent: no-op
    assert sorted(s) == [1, 5, 7] and s.cached == 1 and 3 not in s
    s.set_cached(7, False)
    assert s.cached == 0
    s.set_all_cached()
    assert s.cached == 3 and all(s.is_cached(i) for i in (1, 5, 7))


def test_unread_set_matches_a_model_under_random_operations():
    rng = random.Random(7)
    s = unread_set(200, range(0, 200, 2))
    members, cached = set(range(0, 200, 2)), set()
    for _ in range(5000):
        i, op = rng.randrange(200), rng.random()
        if op < 0.4:
            s.set_cached(i, True)
            if i in members:
                cached.add(i)
        elif op < 0.8:
            s.set_cached(i, False)
            cached.discard(i)
        elif op < 0.85:
            s.discard(i)
            members.discard(i)
            cached.discard(i)
        assert len(s) == len(members) and s.cached == len(cached)
    assert set(s) == members
    assert all((i in s) == (i in members) and s.is_cached(i) == (i in cached) for i in range(200))


def test_unread_set_from_mask_splits_cached_first():
    ids = array("i", [2, 4, 6, 8, 10])
    s = UnreadSet.from_mask(ids, bytes([1, 0, 0, 1, 0]), 12)
    assert s.cached == 2 and {i for i in s if s.is_cached(i)} == {2, 8}
    assert sorted(s) == [2, 4, 6, 8, 10] and 3 not in s and 0 not in s
    s.discard(8)
    assert s.cached == 1 and sorted(s) == [2, 4, 6, 10]


@pytest.mark.parametrize("fraction", [0.0, 0.05, 0.3, 0.5, 0.95, 1.0])
def test_entering_a_chunk_sorts_cached_files_whatever_the_mix(fraction):
    n = 1000
    cached = set(random.Random(2).sample(range(n), int(n * fraction)))
    state = DatasetState("ds", ChunkPlan.whole(n))
    state.mark_cached(cached)
    pool = EpochPool(state, "job", 0)
    claim = pool.claim(0, n, random.Random(0), 10, 0.0)
    assert set(claim.hits) == cached and set(claim.fetch) == set(range(n)) - cached


# -- exactly once ---------------------------------------------------------------------------------


def test_one_rank_gets_every_file_exactly_once_per_epoch():
    n = 1000
    registry = full_registry(n)
    registry.open_session("ds", "job", seed=1)
    orders = []
    for epoch in range(3):
        got = drain(registry, "job", 0, 37, epoch=epoch)
        assert sorted(got) == list(range(n))
        orders.append(got)
        # Once given out, the epoch stays over for this rank.
        assert registry.claim("ds", "job", 0, 5).end_of_epoch
    assert orders[0] != orders[1] != orders[2]  # a new order each epoch


def test_four_ranks_interleaved_partition_each_epoch():
    n, world = 2003, 4  # not a multiple of the world size
    registry = full_registry(n)
    for rank in range(world):
        registry.open_session("ds", "job", rank=rank, world_size=world, seed=5)
    rng = random.Random(3)
    for epoch in range(3):
        per_rank: dict[int, list[int]] = {r: [] for r in range(world)}
        active = set(range(world))
        while active:
            rank = rng.choice(sorted(active))
            claim = registry.claim("ds", "job", rank, rng.randint(1, 50), epoch=epoch)
            if claim.end_of_epoch:
                active.discard(rank)
            assert claim.epoch == epoch
            per_rank[rank].extend(claim.ids)
        everything = [i for ids in per_rank.values() for i in ids]
        assert len(everything) == n and set(everything) == set(range(n))
        quota = -(-n // world)
        # Balanced for DDP: no rank gets more than ceil(N / world), so step counts match.
        assert all(len(ids) <= quota for ids in per_rank.values())
        assert sum(len(ids) == quota for ids in per_rank.values()) >= world - 1


def test_claim_never_exceeds_n_and_counts_remaining():
    registry = full_registry(100)
    registry.open_session("ds", "job")
    claim = registry.claim("ds", "job", 0, 30)
    assert len(claim.ids) == 30 and claim.remaining == 70
    assert len(set(claim.ids)) == 30
    assert len(registry.claim("ds", "job", 0, 1000).ids) == 70
    assert registry.claim("ds", "job", 0, 1).remaining == 0


def test_same_seed_reproduces_the_order():
    orders = []
    for _ in range(2):
        registry = full_registry(500)
        registry.open_session("ds", "job", seed=42)
        orders.append(drain(registry, "job", 0, 16))
    assert orders[0] == orders[1]
    other = full_registry(500)
    other.open_session("ds", "job", seed=43)
    assert drain(other, "job", 0, 16) != orders[0]


# -- randomness -----------------------------------------------------------------------------------


def test_claim_order_is_uncorrelated_with_id_order():
    n = 5000
    registry = full_registry(n)
    registry.open_session("ds", "job", seed=11)
    order = drain(registry, "job", 0, 64)
    assert abs(spearman(order)) < 0.1


def test_claim_order_uncorrelated_with_cache_warming_as_it_goes():
    # Misses become cached as the harness "fetches" them; order must stay random.
    n = 5000
    registry = full_registry(n, cached=range(0, n, 10))
    registry.open_session("ds", "job", seed=12)
    order = []
    while True:
        claim = registry.claim("ds", "job", 0, 50)
        if claim.end_of_epoch:
            break
        order.extend(claim.ids)
        registry.on_cached("ds", claim.fetch)
    assert sorted(order) == list(range(n))
    assert abs(spearman(order)) < 0.1


def test_positions_of_low_ids_spread_over_every_decile_of_the_epoch():
    n = 5000
    registry = full_registry(n)
    registry.open_session("ds", "job", seed=13)
    order = drain(registry, "job", 0, 25)
    position = {file_id: pos for pos, file_id in enumerate(order)}
    deciles = [0] * 10
    for file_id in range(n // 10):
        deciles[position[file_id] * 10 // n] += 1
    # 500 ids over 10 deciles: about 50 each; every decile gets a fair share.
    assert all(20 <= count <= 90 for count in deciles), deciles


# -- substitutable hits ---------------------------------------------------------------------------


def test_hits_first_while_cached_unread_files_remain():
    n = 5000
    cached = set(random.Random(1).sample(range(n), n // 10))
    registry = full_registry(n, cached=cached)
    registry.open_session("ds", "job", seed=2)
    hits = claimed = 0
    given: set[int] = set()
    while True:
        cached_unread = len(cached - given)
        claim = registry.claim("ds", "job", 0, 32)
        if claim.end_of_epoch:
            break
        assert set(claim.hits) <= cached and not set(claim.fetch) & cached
        if cached_unread >= 32:
            hits += len(claim.hits)
            claimed += len(claim.ids)
        given.update(claim.ids)
        registry.on_cached("ds", claim.fetch)  # the harness fetched the misses
        cached.update(claim.fetch)
    assert claimed >= 400  # the cached 10% lasted about 15 claims
    assert hits / claimed >= 0.95


def test_background_fills_become_hits_for_the_reader():
    # A preload (another job, a chunk load) fills files while the job reads: they are hits.
    n = 2000
    registry = full_registry(n)
    registry.open_session("ds", "job", seed=3)
    rng = random.Random(4)
    uncached = list(range(n))
    rng.shuffle(uncached)
    hits = total = 0
    while True:
        for _ in range(40):  # the preload runs faster than the job reads
            if uncached:
                registry.on_cached("ds", [uncached.pop()])
        claim = registry.claim("ds", "job", 0, 20)
        if claim.end_of_epoch:
            break
        hits += len(claim.hits)
        total += len(claim.ids)
        registry.on_cached("ds", claim.fetch)
    assert total == n and hits / total >= 0.95


def test_evicted_files_are_no_longer_hits():
    registry = full_registry(100, cached=range(50))
    registry.open_session("ds", "job", seed=1)
    assert registry.on_evicted("ds", range(10, 50)) == 40
    claim = registry.claim("ds", "job", 0, 20)
    assert set(claim.hits) == set(range(10)) and len(claim.fetch) == 10
    assert not set(claim.fetch) & set(range(10))


# -- co-operative misses ------------------------------------------------------------------------


def run_jobs(registry, jobs, n_claim, *, lag=1, epoch=0):
    """Jobs claim in turns; a claim's misses complete ``lag`` turns later. Returns the
    fetched ids in order and per-job claimed ids."""
    pending: list[list[int]] = []
    fetched: list[int] = []
    claimed = {job: [] for job in jobs}
    active = list(jobs)
    while active:
        for job in list(active):
            claim = registry.claim("ds", job, 0, n_claim, epoch=epoch)
            if claim.end_of_epoch:
                active.remove(job)
                continue
            claimed[job].extend(claim.ids)
            fetched.extend(claim.fetch)
            pending.append(list(claim.fetch))
            while len(pending) > lag:
                registry.on_cached("ds", pending.pop(0))
    for ids in pending:
        registry.on_cached("ds", ids)
    return fetched, claimed


@pytest.mark.parametrize("seeds", [(1, 2), (0, 0)])  # equal seeds must co-operate too
def test_two_jobs_cold_cache_fetch_each_file_about_once(seeds):
    n = 3000
    registry = full_registry(n)
    for job, seed in zip(("a", "b"), seeds, strict=True):
        registry.open_session("ds", job, seed=seed)
    fetched, claimed = run_jobs(registry, ["a", "b"], 16, lag=8)
    for ids in claimed.values():
        assert sorted(ids) == list(range(n))
    # Misses disjoint while possible: only the last claims, finding nothing but files the
    # other job is fetching, share them. The remote serves about N files for two jobs.
    assert set(fetched) == set(range(n))
    assert len(fetched) <= 1.02 * n


def test_the_in_flight_map_is_what_keeps_concurrent_misses_disjoint():
    totals = {}
    for ttl in (0.0, 120.0):  # ttl 0: no in-flight marks survive, misses are merely random
        registry = full_registry(3000, flight_ttl=ttl)
        registry.open_session("ds", "a", seed=1)
        registry.open_session("ds", "b", seed=2)
        fetched, _ = run_jobs(registry, ["a", "b"], 16, lag=8)
        totals[ttl] = len(fetched)
    assert totals[120.0] - 3000 < (totals[0.0] - 3000) / 2


def test_four_jobs_share_fetches_and_a_second_epoch_is_all_hits():
    n = 2000
    registry = full_registry(n)
    jobs = ["a", "b", "c", "d"]
    for seed, job in enumerate(jobs):
        registry.open_session("ds", job, seed=seed)
    fetched, _ = run_jobs(registry, jobs, 10, lag=3)
    assert len(fetched) <= 1.05 * n
    again, claimed = run_jobs(registry, jobs, 10, epoch=1)
    assert again == [] and all(sorted(v) == list(range(n)) for v in claimed.values())


def test_in_flight_files_are_taken_when_nothing_else_is_left():
    # Job a's misses never complete; b still gets every file (progress beats co-operation).
    registry = full_registry(50)
    registry.open_session("ds", "a", seed=1)
    registry.open_session("ds", "b", seed=2)
    assert len(registry.claim("ds", "a", 0, 50).fetch) == 50
    claim = registry.claim("ds", "b", 0, 50)
    assert sorted(claim.fetch) == list(range(50))


def test_in_flight_marks_expire_after_the_ttl():
    clock = FakeClock()
    registry = full_registry(100, clock=clock, flight_ttl=30.0)
    registry.open_session("ds", "a", seed=1)
    first = registry.claim("ds", "a", 0, 10).fetch
    state = registry.dataset("ds")
    assert all(state.flying(i, clock.now) for i in first)
    clock.now = 31.0
    assert not any(state.flying(i, clock.now) for i in first)
    assert not set(first) & set(state.in_flight)


def test_failed_fetches_leave_the_in_flight_map():
    registry = full_registry(100)
    registry.open_session("ds", "a", seed=1)
    fetch = registry.claim("ds", "a", 0, 10).fetch
    registry.on_fetch_failed("ds", fetch[:4])
    assert set(registry.dataset("ds").in_flight) == set(fetch[4:])
    registry.on_cached("ds", fetch[4:])
    assert registry.dataset("ds").in_flight == {}


# -- pool internals -------------------------------------------------------------------------------


def test_pool_quota_and_close_stop_notifications():
    state = DatasetState("ds", ChunkPlan.whole(10))
    pool = EpochPool(state, "job", 0, world_size=3)
    assert pool.quota == 4
    rng = random.Random(0)
    assert len(pool.claim(1, 10, rng, 10, 0.0).ids) == 4
    assert pool.claim(1, 10, rng, 10, 0.0).end_of_epoch  # rank 1's share is given out
    assert len(pool.claim(0, 10, rng, 10, 0.0).ids) == 4
    assert len(pool.claim(2, 10, rng, 10, 0.0).ids) == 2
    assert pool.remaining == 0
    pool.close()
    assert pool not in state.pools
    state.mark_cached([0])  # no error after close


# -- scope: a job over part of the dataset ---------------------------------------------------------


def test_a_scoped_job_gets_exactly_its_files_each_epoch():
    registry = full_registry(100, cached=range(0, 100, 3))
    scope = [[10, 30], [60, 75]]
    in_scope = set(range(10, 30)) | set(range(60, 75))
    info = registry.open_session("ds", "part", rank=0, world_size=1, scope=scope)
    assert info.quota == len(in_scope)
    for epoch in range(2):
        got = drain(registry, "part", 0, 7, epoch=epoch)
        assert sorted(got) == sorted(in_scope), f"epoch {epoch}"
        registry.next_epoch("ds", "part", 0)


def test_scoped_ranks_split_the_scope_with_equal_quotas():
    registry = full_registry(50)
    for rank in range(2):
        info = registry.open_session("ds", "ddp", rank=rank, world_size=2, scope=[[5, 26]])
        assert info.quota == 11  # ceil(21 / 2)
    per_rank = [drain(registry, "ddp", rank, 4) for rank in range(2)]
    assert sorted(per_rank[0] + per_rank[1]) == list(range(5, 26))
    assert not set(per_rank[0]) & set(per_rank[1])


def test_a_scoped_job_skips_chunks_without_its_files():
    registry = SessionRegistry(clock=FakeClock())
    mode = registry.add_dataset("ds", [100] * 200, budget=200 * 100 // 4, fraction=0.1)
    assert mode.value == "chunked"
    registry.open_session("ds", "few", scope=[[0, 3]])
    got = drain(registry, "few", 0, 2)
    assert sorted(got) == [0, 1, 2]


@pytest.mark.parametrize("scope", [[], [[5, 5]], [[10, 5]], [[0, 101]], [[20, 30], [25, 40]],
                                    [[30, 40], [0, 10]], "0-10", [[0, "10"]], [[0, 10, 20]],
                                    [[i, i + 1] for i in range(0, 130, 2)]])
def test_malformed_scopes_are_refused(scope):
    from mountd.errors import InvalidRequest

    registry = full_registry(100)
    with pytest.raises(InvalidRequest):
        registry.open_session("ds", "bad", scope=scope)
    assert registry.sessions() == []


def test_a_job_has_one_scope():
    from mountd.errors import SessionConflict

    registry = full_registry(100)
    registry.open_session("ds", "job", rank=0, world_size=2, scope=[[0, 50]])
    with pytest.raises(SessionConflict):
        registry.open_session("ds", "job", rank=1, world_size=2, scope=[[0, 60]])
    registry.open_session("ds", "job", rank=1, world_size=2, scope=[[0, 50]])  # the same: fine
    registry.open_session("ds", "job", rank=1, world_size=2)  # none: the job's stands


def test_misses_are_claimed_only_as_far_as_the_cache_can_protect_them():
    """A claim's misses are protected until read; those the protection share has no room for
    were evicted before their read and fetched twice (half of all fills with 4 jobs of 2
    ranks and no compute at a 20% cache). So a claim takes no more misses than fit, and one
    when it has nothing else to give (progress); exactly once is unchanged."""
    room = [3000]  # bytes the cache may still protect: 3 files of 1000 B
    registry = SessionRegistry(clock=FakeClock(), protect_room=lambda: room[0])
    registry.add_dataset("ds", [1000] * 50, mode="full", cached=range(10))
    registry.open_session("ds", "job", seed=1)
    first = registry.claim("ds", "job", 0, 20, epoch=0)
    assert len(first.hits) == 10 and len(first.fetch) == 3
    room[0] = 0
    second = registry.claim("ds", "job", 0, 20, epoch=0)
    assert second.hits == () and len(second.fetch) == 1  # nothing fits: one, to go on
    room[0] = 10**9
    rest = drain(registry, "job", 0, 20, epoch=0)
    assert sorted(first.ids + second.ids + tuple(rest)) == list(range(50))


def test_a_sampler_that_says_its_batch_waits_instead_of_claiming_miss_after_miss():
    """With no room to protect misses, "one miss to go on" let a sampler claim miss after
    miss in a loop (it wants a buffer of fetch_size / 2): 188 misses in 0.6 s for one job, a
    cascade of demand fills ending other jobs' protections, epochs 4x slower. A sampler that
    says its batch gets enough for every rank's batch counting what the job has claimed and
    not read yet (pending), then ``wait`` (not the end of the epoch) until its readers read."""
    pending = {("ds", "job", 0): 0}
    registry = SessionRegistry(clock=FakeClock(), protect_room=lambda: 0,
                               protect_pending=lambda owner: pending.get(owner, 0))
    registry.add_dataset("ds", [1000] * 100, mode="full", cached=range(5))
    for rank in (0, 1):
        registry.open_session("ds", "job", rank=rank, world_size=2, seed=1)
    first = registry.claim("ds", "job", 0, 20, epoch=0, batch=8)
    assert len(first.hits) == 5 and first.fetch == () and not first.wait  # hits: no misses
    second = registry.claim("ds", "job", 0, 20, epoch=0, batch=8)
    assert second.hits == () and len(second.fetch) == 16  # a batch for each of 2 ranks
    pending[("ds", "job", 0)] = 16
    third = registry.claim("ds", "job", 1, 20, epoch=0, batch=8)
    assert third.ids == () and third.wait and not third.end_of_epoch
    assert third.remaining == 100 - 5 - 16
    pending[("ds", "job", 0)] = 10  # its readers read 6 of them
    fourth = registry.claim("ds", "job", 1, 20, epoch=0, batch=8)
    assert len(fourth.fetch) == 6 and not fourth.wait
    older = registry.claim("ds", "job", 1, 20, epoch=0)  # no batch: an older sampler
    assert len(older.fetch) == 1 and not older.wait
    pending[("ds", "job", 0)] = 0
    given = first.ids + second.ids + fourth.ids + older.ids
    rest = []
    for rank in (0, 1, 0, 1) * 40:
        claim = registry.claim("ds", "job", rank, 20, epoch=0, batch=8)
        assert not claim.wait
        rest.extend(claim.ids)
    assert sorted(given + tuple(rest)) == list(range(100))  # exactly once


def test_chunked_claims_advise_a_quarter_chunk_between_the_ranks():
    """A chunked dataset's claims say the fetch size for the job's ranks: a quarter of a chunk
    between them (at least 1); a dataset that fits says nothing (no chunk to outrun)."""
    registry = SessionRegistry(clock=FakeClock())
    assert registry.add_dataset("ds", [100] * 200, budget=200 * 100 // 4, fraction=0.1).value == "chunked"
    plan = registry.dataset("ds").plan
    per_chunk = plan.count // plan.chunks
    registry.open_session("ds", "two", rank=0, world_size=2)
    registry.open_session("ds", "two", rank=1, world_size=2)
    registry.open_session("ds", "one")
    assert registry.claim("ds", "two", 0, 4).advised_fetch == per_chunk // 4 // 2
    assert registry.claim("ds", "two", 1, 4).advised_fetch == per_chunk // 4 // 2
    assert registry.claim("ds", "one", 0, 4).advised_fetch == per_chunk // 4
    assert per_chunk // 4 // 2 >= 1  # the test means something: the advice is not the floor
    full = full_registry(50)
    full.open_session("ds", "job")
    assert full.claim("ds", "job", 0, 4).advised_fetch is None


@pytest.mark.parametrize(("chunk_files", "world", "advice"),
                         [(94, 2, 11), (94, 1, 23), (48, 2, 6), (3, 2, 1), (0, 1, 1), (130_000, 8, 4062)])
def test_advised_fetch_is_a_quarter_chunk_per_rank_at_least_one(chunk_files, world, advice):
    assert advised_fetch(chunk_files, world) == advice


def test_a_finished_chunk_is_read_past_once_every_rank_was_given_its_window_more():
    """The pool tells its chunk manager when it has read past a chunk it finished: a sampler
    claims again only as it reads, so each rank given its window (``max(n, batch) + n``) more
    files since has read all it held; a rank that can claim no more never says so."""
    registry = SessionRegistry(clock=FakeClock())
    assert registry.add_dataset("ds", [100] * 200, budget=200 * 100 // 4, fraction=0.1).value == "chunked"
    manager = registry.dataset("ds").manager
    finished = []
    real = manager.finished

    def spy(holder, chunk, now, drained=None):
        finished.append(drained)
        real(holder, chunk, now, drained)

    manager.finished = spy
    for rank in (0, 1):
        registry.open_session("ds", "job", rank=rank, world_size=2)
    pool = registry.pool("ds", "job", 0)
    rank = 0
    while not finished:
        registry.claim("ds", "job", rank, 4, batch=2)
        rank = 1 - rank
    drained = finished[0]
    assert pool.windows == [8, 8]
    marks = [given + 8 for given in pool.given_by_rank]
    assert not drained()
    while pool.given_by_rank[0] < marks[0]:
        registry.claim("ds", "job", 0, 4, batch=2)
    assert not drained()  # rank 1 has not moved on
    while pool.given_by_rank[1] < marks[1] - 1:
        registry.claim("ds", "job", 1, 1, batch=2)
    assert not drained()
    registry.claim("ds", "job", 1, 1, batch=2)
    assert drained()
    # An older sampler (no batch): its window is two claims.
    registry.open_session("ds", "old")
    registry.claim("ds", "old", 0, 5)
    assert registry.pool("ds", "old", 0).windows == [10]
