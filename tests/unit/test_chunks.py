"""mountd.coop.plans, draws and chunks: striped partitions, mode choice, the draw, the chunk
lifecycle and chunked claims."""

from __future__ import annotations

import random
from collections import deque

import pytest

from mountd.coop.chunks import ChunkManager, ChunkReady, ChunkState, Evict, Preload
from mountd.coop.draws import INVERT, Needs
from mountd.coop.plans import ChunkPlan, Mode, choose_mode, plan_chunks
from mountd.coop.sessions import SessionRegistry
from mountd.errors import UnknownSession

# -- striped partitions ---------------------------------------------------------------------------


@pytest.mark.parametrize(("n", "k"), [(10_000, 10), (10_007, 7), (1_000, 20)])
def test_striped_plan_partitions_ids_into_balanced_chunks(n, k):
    plan = ChunkPlan(n, k)
    chunks = [list(plan.ids_of(c)) for c in range(k)]
    assert sorted(i for ids in chunks for i in ids) == list(range(n))
    sizes = [len(ids) for ids in chunks]
    assert sizes == [plan.size_of(c) for c in range(k)]
    assert max(sizes) - min(sizes) <= plan.partitions
    for c, ids in enumerate(chunks):
        assert all(plan.chunk_of(i) == c for i in ids)


def test_each_chunk_is_a_uniform_sample_of_the_id_range():
    n, k = 10_000, 10
    plan = ChunkPlan(n, k)
    for c in range(k):
        ids = list(plan.ids_of(c))
        # One stripe unit in every tenth of the dataset (Quiver §5.1): a sorted dataset
        # (e.g. by sequence length) still gives every chunk every length.
        per_decile = [0] * 10
        for i in ids:
            per_decile[i * 10 // n] += 1
        assert per_decile == [n // k // 10] * 10
        mean = sum(ids) / len(ids)
        assert abs(mean - (n - 1) / 2) < n * 0.06
        assert len(plan.ranges_of(c)) == plan.partitions  # contiguous stripe units


def test_stripe_units_are_dealt_by_a_seeded_permutation():
    a, b, a2 = ChunkPlan(1000, 10, seed=1), ChunkPlan(1000, 10, seed=2), ChunkPlan(1000, 10, seed=1)
    assert [a.ranges_of(c) for c in range(10)] == [a2.ranges_of(c) for c in range(10)]
    assert [a.ranges_of(c) for c in range(10)] != [b.ranges_of(c) for c in range(10)]
    # Not the same unit position in every partition (no aliasing with periodic orders).
    offsets = {start % 100 for start, _ in a.ranges_of(0)}
    assert len(offsets) > 1


def test_plan_with_more_partitions_and_tiny_datasets():
    plan = ChunkPlan(1000, 4, partitions=25)
    assert plan.partitions == 25 and len(plan.ranges_of(0)) == 25
    tiny = ChunkPlan(5, 3)  # fewer files than units: one partition
    assert sorted(i for c in range(3) for i in tiny.ids_of(c)) == list(range(5))
    assert ChunkPlan.whole(7).chunks == 1 and list(ChunkPlan.whole(7).ids_of(0)) == list(range(7))
    with pytest.raises(ValueError):
        ChunkPlan(0, 1)
    with pytest.raises(ValueError):
        ChunkPlan(5, 6)


# -- mode and chunk size --------------------------------------------------------------------------


def test_choose_mode_from_size_and_budget():
    assert choose_mode(100, 100) is Mode.FULL
    assert choose_mode(100, 1000) is Mode.FULL
    assert choose_mode(1000, 200) is Mode.CHUNKED  # chunks of 100 (10%), two fit
    assert choose_mode(1000, 0) is Mode.OFF
    # 1% of the dataset per chunk still trains well; 0.5% does not.
    assert choose_mode(10_000, 200) is Mode.CHUNKED
    assert choose_mode(20_000, 200) is Mode.OFF
    assert choose_mode(10_000, 5000, max_chunk_bytes=50) is Mode.OFF
    assert choose_mode(10_000, 300, slots=3) is Mode.CHUNKED  # 100-byte chunks, three fit
    assert choose_mode(10_000, 200, slots=3) is Mode.OFF
    with pytest.raises(ValueError):
        choose_mode(-1, 10)


def test_plan_chunks_bounds_chunk_bytes():
    rng = random.Random(0)
    sizes = [rng.randint(1, 1000) for _ in range(5000)]
    total = sum(sizes)
    plan = plan_chunks(sizes, total // 4)  # 10% chunks fit twice
    assert plan.chunks >= 10
    plan = plan_chunks(sizes, total // 10)  # bound by budget / 2 = 5% of the dataset
    biggest = max(sum(sizes[i] for i in plan.ids_of(c)) for c in range(plan.chunks))
    assert biggest <= total // 10 / 2 and plan.chunks >= 20
    plan = plan_chunks(sizes, total, max_chunk_bytes=total // 30)
    assert plan.chunks >= 30
    plan = plan_chunks(sizes, total // 10, slots=3)  # three chunks must fit
    biggest = max(sum(sizes[i] for i in plan.ids_of(c)) for c in range(plan.chunks))
    assert biggest <= total // 10 / 3
    assert plan_chunks([10] * 10, 80, fraction=0.5).chunks == 3  # 40-byte chunks
    assert plan_chunks([10] * 10, 1000, fraction=0.9).chunks == 3  # at least three chunks


# -- the lifecycle, decision by decision ----------------------------------------------------------


class Cache:
    """The cached set the manager reads; tests fill and evict it."""

    def __init__(self, manager_plan: ChunkPlan) -> None:
        self.ids: set[int] = set()
        self.manager: ChunkManager | None = None

    def fill(self, ids) -> None:
        new = [i for i in ids if i not in self.ids]
        self.ids.update(new)
        self.manager.on_cached(new)

    def evict(self, ids) -> None:
        gone = [i for i in ids if i in self.ids]
        self.ids.difference_update(gone)
        self.manager.on_evicted(gone)


def make_manager(n=100, k=5, timeout=100.0, slots=2, grace=0.0):
    """A manager on a fake cache; ``grace`` 0 by default: these tests assert exact timing."""
    plan = ChunkPlan(n, k)
    cache = Cache(plan)
    manager = ChunkManager(
        "ds", plan, cache.ids.__contains__, evict_timeout=timeout, slots=slots, grace=grace
    )
    cache.manager = manager
    return manager, cache, plan


def check_invariants(manager: ChunkManager) -> None:
    states = manager.states()
    resident = sum(s in (ChunkState.LOADED, ChunkState.MARKED) for s in states)
    loading = states.count(ChunkState.LOADING)
    assert resident <= 2 and loading <= 1 and resident + loading <= manager.slots, states


def test_no_preload_without_readers():
    manager, _, _ = make_manager()
    assert manager.tick(0.0) == []
    assert manager.entry_chunk() == 0


def test_lifecycle_load_mark_evict_then_load_the_third():
    manager, cache, plan = make_manager()
    job = object()
    manager.attach(job)
    [preload] = manager.tick(0.0)
    assert preload == Preload("ds", 0, preload.ids)
    assert sorted(preload.ids) == list(plan.ids_of(0)) and manager.state(0) is ChunkState.LOADING
    manager.reference(job, manager.entry_chunk())
    cache.fill(preload.ids[:10])
    assert manager.tick(1.0) == []  # not fully loaded yet
    assert manager.preload_remaining() == sorted(set(plan.ids_of(0)) - cache.ids)
    cache.fill(preload.ids[10:])
    ready, preload1 = manager.tick(2.0)
    assert ready == ChunkReady("ds", 0) and manager.newest == 0
    assert isinstance(preload1, Preload) and preload1.chunk == 1
    cache.fill(preload1.ids)
    assert manager.tick(3.0) == [ChunkReady("ds", 1)]
    assert manager.state(0) is ChunkState.MARKED and manager.entry_chunk() == 1
    check_invariants(manager)
    # The job still reads chunk 0: no eviction, no third chunk.
    assert manager.tick(50.0) == []
    manager.finished(job, 0, 60.0)
    manager.reference(job, 1)
    members = tuple(plan.ids_of(0))
    evict, preload2 = manager.tick(61.0)
    assert evict == Evict("ds", 0, members, forced=False)
    assert preload2.chunk == 2 and manager.state(0) is ChunkState.IDLE
    # Chunk 2 was drawn from the free chunks, the evicted one included (nothing resident
    # moves: chunk 1 is as it was).
    assert manager.generation(2) > manager.generation(1) > manager.generation(0)
    cache.evict(evict.ids)
    check_invariants(manager)


def test_a_chunk_is_pinned_from_its_load_to_its_eviction():
    assert [s for s in ChunkState if s.pinned] == [
        ChunkState.LOADING, ChunkState.LOADED, ChunkState.MARKED]
    manager, cache, plan = make_manager()
    job = object()
    manager.attach(job)
    [preload] = manager.tick(0.0)
    assert [manager.state(c).pinned for c in range(plan.chunks)] == [True] + [False] * 4
    cache.fill(preload.ids)
    manager.tick(1.0)
    assert manager.state(0).pinned and manager.state(0) is ChunkState.LOADED


@pytest.mark.parametrize("slots", [2, 3])
def test_a_reader_that_has_not_started_gets_one_chunk_not_a_cycle_of_them(slots):
    """A session opened but not claiming yet: its first chunk loads, and then nothing, where
    each next chunk used to mark the newest and evict it unread, round after round."""
    manager, cache, plan = make_manager(slots=slots)
    job = object()
    manager.attach(job)
    [preload] = manager.tick(0.0)
    cache.fill(preload.ids)
    assert manager.tick(1.0) == [ChunkReady("ds", 0)]
    for t in range(2, 50):
        assert manager.tick(float(t)) == []
    assert manager.newest == 0 and manager.loading is None and len(cache.ids) == plan.size_of(0)
    # The job starts reading: the next chunk loads while it reads the first.
    manager.reference(job, manager.entry_chunk())
    [preload1] = manager.tick(50.0)
    assert isinstance(preload1, Preload) and preload1.chunk != 0
    cache.fill(preload1.ids)
    assert manager.tick(51.0)[0] == ChunkReady("ds", preload1.chunk)
    assert manager.state(0) is ChunkState.MARKED and manager.refs(0) == {job}
    check_invariants(manager)


def test_a_reader_entering_another_chunk_than_the_newest_lets_loading_go_on():
    manager, cache, plan = make_manager()
    job = object()
    manager.attach(job)
    cache.fill(manager.tick(0.0)[0].ids)
    assert manager.tick(1.0) == [ChunkReady("ds", 0)]
    assert manager.tick(2.0) == []
    manager.reference(job, 3)  # it has read the newest's files elsewhere
    [preload] = manager.tick(3.0)
    assert isinstance(preload, Preload)


def test_three_slots_preload_the_next_chunk_while_the_marked_one_drains():
    manager, cache, plan = make_manager(slots=3)
    job = object()
    manager.attach(job)
    cache.fill(manager.tick(0.0)[0].ids)
    manager.reference(job, 0)
    ready0, preload1 = manager.tick(1.0)
    cache.fill(preload1.ids)
    ready1, preload2 = manager.tick(2.0)
    assert ready1 == ChunkReady("ds", 1) and manager.state(0) is ChunkState.MARKED
    assert preload2.chunk == 2  # with two slots this would wait for chunk 0's eviction
    check_invariants(manager)
    cache.fill(preload2.ids)
    assert manager.tick(3.0) == []  # loaded, but promoting it would make three resident
    assert manager.state(2) is ChunkState.LOADING
    check_invariants(manager)
    manager.finished(job, 0, 4.0)
    manager.reference(job, 1)
    evict0, ready2, preload3 = manager.tick(5.0)
    assert (evict0.chunk, ready2.chunk, preload3.chunk) == (0, 2, 3)
    assert manager.state(1) is ChunkState.MARKED and manager.refs(1) == {job}
    check_invariants(manager)
    with pytest.raises(ValueError):
        make_manager(slots=4)


def test_eviction_waits_for_every_referencing_job_then_forces_after_timeout():
    manager, cache, plan = make_manager(timeout=100.0)
    fast, slow = object(), object()
    for job in (fast, slow):
        manager.attach(job)
    cache.fill(manager.tick(0.0)[0].ids)
    for job in (fast, slow):
        manager.reference(job, manager.entry_chunk())
    cache.fill(manager.tick(1.0)[1].ids)  # chunk 1
    manager.tick(2.0)
    assert manager.state(0) is ChunkState.MARKED
    manager.finished(fast, 0, 10.0)
    assert manager.tick(50.0) == [] and manager.refs(0) == {slow}
    assert manager.tick(109.9) == []
    evict, preload = manager.tick(110.0)
    assert evict.chunk == 0 and evict.forced and preload.chunk == 2


def test_detaching_the_last_reader_releases_the_marked_chunk():
    manager, cache, _ = make_manager()
    job = object()
    manager.attach(job)
    cache.fill(manager.tick(0.0)[0].ids)
    manager.reference(job, 0)
    cache.fill(manager.tick(1.0)[1].ids)
    manager.tick(2.0)
    manager.detach(job)
    actions = manager.tick(3.0)
    assert [type(a) for a in actions] == [Evict]  # no reader left: no further preload
    assert not actions[0].forced


def load_two_chunks(manager, cache, jobs):
    """Chunk 0 loaded then marked, chunk 1 the newest; every job references chunk 0."""
    for job in jobs:
        manager.attach(job)
    cache.fill(manager.tick(0.0)[0].ids)
    for job in jobs:
        manager.reference(job, 0)
    cache.fill(manager.tick(1.0)[1].ids)
    assert manager.tick(2.0) == [ChunkReady("ds", 1)]
    assert manager.state(0) is ChunkState.MARKED


def test_grace_keeps_a_finished_chunk_and_its_files_until_it_passes():
    manager, cache, plan = make_manager(grace=2.0)
    job = object()
    load_two_chunks(manager, cache, [job])
    manager.finished(job, 0, 10.0)
    manager.reference(job, 1)
    assert manager.grace_deadline() == 12.0
    for now in (10.0, 11.0, 11.99):
        assert manager.tick(now) == []  # no eviction, and so no third chunk loading
        assert manager.state(0) is ChunkState.MARKED and manager.loading is None
        assert manager.cached_count(0) == plan.size_of(0)
        check_invariants(manager)
    members = tuple(plan.ids_of(0))
    evict, preload = manager.tick(12.0)
    assert evict == Evict("ds", 0, members, forced=False) and evict.members == members
    assert preload.chunk == 2 and manager.state(0) is ChunkState.IDLE
    assert manager.grace_deadline() is None
    check_invariants(manager)


def test_grace_counts_from_the_last_job_to_finish():
    manager, cache, _ = make_manager(grace=2.0)
    fast, slow = object(), object()
    load_two_chunks(manager, cache, [fast, slow])
    manager.finished(fast, 0, 10.0)
    assert manager.grace_deadline() is None  # the slow job still reads it: no deadline
    assert manager.tick(13.0) == []
    manager.finished(slow, 0, 20.0)
    assert manager.grace_deadline() == 22.0
    assert manager.tick(21.9) == [] and manager.state(0) is ChunkState.MARKED
    assert [type(a) for a in manager.tick(22.0)] == [Evict, Preload]


def test_forced_eviction_does_not_wait_for_the_grace():
    manager, cache, _ = make_manager(timeout=100.0, grace=50.0)
    fast, slow = object(), object()
    load_two_chunks(manager, cache, [fast, slow])
    manager.finished(fast, 0, 10.0)
    assert manager.tick(109.9) == []
    evict, preload = manager.tick(110.0)
    assert evict.chunk == 0 and evict.forced and preload.chunk == 2
    # A chunk in its grace, no holder left, is forced out at the timeout too.
    manager, cache, _ = make_manager(timeout=100.0, grace=500.0)
    job = object()
    load_two_chunks(manager, cache, [job])
    manager.finished(job, 0, 10.0)
    assert manager.tick(109.9) == []
    evict, _ = manager.tick(110.0)
    assert evict.chunk == 0 and manager.state(0) is ChunkState.IDLE


def test_a_chunk_left_by_detached_readers_has_no_grace():
    manager, cache, _ = make_manager(grace=30.0)
    job = object()
    load_two_chunks(manager, cache, [job])
    manager.detach(job)  # it never finished chunk 0: nobody is reading its files
    assert [type(a) for a in manager.tick(3.0)] == [Evict]


def test_grace_must_not_be_negative():
    with pytest.raises(ValueError, match="grace"):
        make_manager(grace=-1.0)
    with pytest.raises(ValueError, match="grace"):
        make_manager(grace=float("nan"))
    with pytest.raises(ValueError, match="chunk_grace"):
        SessionRegistry(chunk_grace=-0.5)


def test_failed_preloads_complete_the_chunk():
    manager, cache, plan = make_manager()
    manager.attach(object())
    ids = manager.tick(0.0)[0].ids
    cache.fill(ids[2:])
    manager.on_failed(ids[:2])
    assert manager.tick(1.0)[0] == ChunkReady("ds", 0)


def test_next_preload_pulls_windows_and_reoffers_dropped_files():
    manager, cache, plan = make_manager()
    assert manager.next_preload(5) == []  # nothing loading
    manager.attach(object())
    [preload] = manager.tick(0.0)
    first = manager.next_preload(8)
    assert list(first) == list(preload.ids[:8])
    cache.fill(preload.ids[8:12])  # a job's misses filled some meanwhile: skipped
    second = manager.next_preload(8)
    assert second == list(preload.ids[12:20])
    cache.fill(first[:6] + second)  # two of the first window were dropped by the cache
    assert manager.next_preload(100) == first[6:]  # past the end: what is still missing
    assert manager.next_preload(100) == first[6:]  # still missing: offered again
    cache.fill(first[6:])
    assert manager.next_preload(100) == []
    assert manager.tick(1.0)[0] == ChunkReady("ds", 0)


def test_cached_files_are_counted_at_start_and_follow_redraws():
    plan = ChunkPlan(100, 5)
    cached = set(plan.ids_of(0))
    manager = ChunkManager("ds", plan, cached.__contains__)
    assert manager.cached_count(0) == 20
    manager.attach(object())
    [preload] = manager.tick(0.0)  # chunk 0 is drawn afresh: some of its files moved
    assert set(preload.ids) == set(plan.ids_of(0)) - cached
    for c in range(5):
        assert manager.cached_count(c) == len(set(plan.ids_of(c)) & cached)
    cached.update(preload.ids)
    manager.on_cached(preload.ids)
    assert manager.tick(0.0)[0] == ChunkReady("ds", 0)


def check_plan(plan: ChunkPlan) -> None:
    """Every id in exactly one chunk, and the plan's indexes agree with its chunks' lists."""
    index = plan.index_in_chunk()
    seen = []
    for c in range(plan.chunks):
        ids = plan.ids_of(c)
        assert plan.size_of(c) == len(ids)
        for k, i in enumerate(ids):
            assert plan.chunk_of(i) == c and index[i] == k
        seen.extend(ids)
    assert sorted(seen) == list(range(plan.count))


def mask(n: int, ids) -> bytes:
    out = bytearray(n)
    for i in ids:
        out[i] = 1
    return bytes(out)


def test_a_draw_prefers_what_every_reader_needs_then_the_asker_then_anyone():
    n, k = 2_000, 10
    plan = ChunkPlan(n, k)
    rng = random.Random(5)
    by_all = set(rng.sample(range(n), 60))  # fewer than a chunk (200 files)
    by_requester = by_all | set(rng.sample(sorted(set(range(n)) - by_all), 50))
    by_some = by_requester | set(rng.sample(sorted(set(range(n)) - by_requester), 500))
    needs = Needs(mask(n, by_all), mask(n, by_requester), mask(n, by_some))
    moved: list = []
    manager = ChunkManager("ds", plan, lambda _i: False, demand=lambda _r: needs,
                           on_moved=moved.append)
    before = [plan.chunk_of(i) for i in range(n)]
    chunk = manager.plan_next(object())
    drawn = set(plan.ids_of(chunk))
    assert len(drawn) == 200
    assert by_requester <= drawn  # every file the asker needs came first (110 of them)
    assert drawn <= by_some  # then 90 that someone needs; none that nobody needs
    check_plan(plan)
    # The moves say exactly which files changed chunk, grouped by (old, new).
    [moves] = moved
    reported = {(i, old, new) for (old, new), ids in moves.items() for i in ids}
    actual = {(i, before[i], plan.chunk_of(i)) for i in range(n) if before[i] != plan.chunk_of(i)}
    assert reported == actual and len(actual) > 300  # the chunk's old files left, drawn ones came


def test_a_draw_uses_files_nobody_needs_only_when_nothing_else_is_left():
    n = 300
    plan = ChunkPlan(n, 3)
    nobody = Needs(bytes(n), None, bytes(n))
    manager = ChunkManager("ds", plan, lambda _i: False, demand=lambda _r: nobody)
    assert len(plan.ids_of(manager.plan_next())) == 100
    one = Needs(bytes(n), None, mask(n, [7]))
    manager = ChunkManager("ds", ChunkPlan(n, 3), lambda _i: False, demand=lambda _r: one)
    assert list(manager.plan.ids_of(manager.plan_next())) == [7]
    check_plan(manager.plan)


def test_a_draw_fills_the_chunk_by_bytes_and_takes_one_file_larger_than_it():
    n = 3_000
    rng = random.Random(9)
    sizes = [rng.choice((1_000, 5_000, 50_000)) for _ in range(n)]
    plan = ChunkPlan(n, 10)
    plan.set_sizes(sizes)
    manager = ChunkManager("ds", plan, lambda _i: False)
    for _ in range(3):
        chunk = manager.plan_next()
        got = sum(sizes[i] for i in plan.ids_of(chunk))
        assert plan.target_bytes - 50_000 < got <= plan.target_bytes
        check_plan(plan)
    # One file larger than a whole chunk is still drawn alone.
    big = ChunkPlan(30, 3)
    big.set_sizes([10] * 29 + [10_000])
    big.target_bytes = 100
    only_big = Needs(mask(30, [29]), None, mask(30, [29]))
    manager = ChunkManager("ds", big, lambda _i: False, demand=lambda _r: only_big)
    assert list(big.ids_of(manager.plan_next())) == [29]


def test_the_needs_masks_invert_to_what_was_given():
    given = bytes([1, 0, 1, 0])
    assert given.translate(INVERT) == bytes([0, 1, 0, 1])


def test_manager_needs_three_chunks():
    with pytest.raises(ValueError):
        ChunkManager("ds", ChunkPlan(100, 2), lambda i: False)


# -- chunked claims through the registry, simulated -----------------------------------------------


class Harness:
    """Performs the registry's actions: preloads at ``rate`` files per step, evictions at once."""

    def __init__(self, registry: SessionRegistry, rate: int) -> None:
        self.registry = registry
        self.rate = rate
        self.queue: deque[int] = deque()
        self.evictions: list[Evict] = []
        self.evicted_members: list[set[int]] = []
        self.ready: list[int] = []
        self.now = 0.0

    def step(self) -> None:
        self.now += 1.0
        for action in self.registry.tick(self.now):
            if isinstance(action, Preload):
                self.queue.extend(action.ids)
            elif isinstance(action, Evict):
                self.evictions.append(action)
                # Chunks are re-drawn later: keep what this one held when it was evicted.
                self.evicted_members.append(set(action.members))
                self.registry.on_evicted("ds", action.ids)
            else:
                self.ready.append(action.chunk)
        manager = self.registry.dataset("ds").manager
        check_invariants(manager)
        batch = [self.queue.popleft() for _ in range(min(self.rate, len(self.queue)))]
        self.registry.on_cached("ds", batch)


def read_through(registry, harness, job, chunk, *, clock=None):
    """``job`` claims until it has left ``chunk`` (the harness steps between claims)."""
    while True:
        if clock is not None:
            clock[0] = harness.now
        claim = registry.claim("ds", job, 0, 50)
        assert {registry.dataset("ds").plan.chunk_of(i) for i in claim.ids} == {chunk}
        if registry.pool("ds", job, 0).chunk != chunk:
            return
        harness.step()


def chunked_registry(n=2000, clock=None, **kwargs):
    kwargs.setdefault("chunk_grace", 0.0)  # the tests below assert exact eviction steps
    registry = SessionRegistry(clock=clock or (lambda: 0.0), **kwargs)
    budget = 100 * n * registry.chunk_slots // 10  # 10% chunks, two (or three) fit
    mode = registry.add_dataset("ds", [100] * n, budget=budget)
    assert mode is Mode.CHUNKED and registry.dataset("ds").plan.chunks == 10
    return registry


@pytest.mark.parametrize(
    ("rate", "min_hits", "max_job_fetches"),
    [
        (30, 0.95, 100),  # preload outpaces the jobs: hits after the first few claims
        (0, 0.45, 2040),  # no preload: the two jobs' misses load the chunks, co-operatively
    ],
)
def test_chunked_claims_stay_in_the_jobs_chunk_and_cover_the_epoch(rate, min_hits, max_job_fetches):
    registry = chunked_registry()
    harness = Harness(registry, rate=rate)
    plan = registry.dataset("ds").plan
    for job, seed in (("a", 1), ("b", 2)):
        registry.open_session("ds", job, seed=seed)
    claimed = {"a": [], "b": []}
    hits = total = job_fetches = 0
    active = {"a", "b"}
    while active:
        harness.step()
        for job in sorted(active):
            claim = registry.claim("ds", job, 0, 10, epoch=0)
            if claim.end_of_epoch:
                active.discard(job)
                continue
            chunks = {plan.chunk_of(i) for i in claim.ids}
            assert chunks == {claim.chunk}  # one claim never spans two chunks
            hits += len(claim.hits)
            total += len(claim.ids)
            job_fetches += len(claim.fetch)
            claimed[job].extend(claim.ids)
            registry.on_cached("ds", claim.fetch)  # the job's own urgent fetches
    for ids in claimed.values():
        assert sorted(ids) == list(range(2000))
    # Two jobs read 4000 files; the remote serves about 2000 (N) of them.
    assert total == 4000 and hits / total >= min_hits
    assert job_fetches <= max_job_fetches
    assert len(harness.evictions) >= 8 and not any(e.forced for e in harness.evictions)
    # Each eviction removed files of one chunk only.
    for evict, members in zip(harness.evictions, harness.evicted_members, strict=True):
        assert set(evict.ids) <= members


def test_claim_chunk_sequence_follows_the_manager():
    registry = chunked_registry()
    harness = Harness(registry, rate=1000)  # preloads complete within a step
    registry.open_session("ds", "a", seed=1)
    seen = []
    while True:
        harness.step()
        claim = registry.claim("ds", "a", 0, 50)
        if claim.end_of_epoch:
            break
        if claim.ids:
            chunk = registry.dataset("ds").plan.chunk_of(claim.ids[0])
            if not seen or seen[-1] != chunk:
                seen.append(chunk)
    assert seen == list(range(10))  # every chunk once, in load order
    assert len(harness.evictions) >= 8


def test_new_jobs_start_on_the_newest_chunk_and_old_chunk_waits_for_slow_job():
    registry = chunked_registry()
    harness = Harness(registry, rate=1000)
    manager = registry.dataset("ds").manager
    plan = registry.dataset("ds").plan
    registry.open_session("ds", "slow", seed=1)
    registry.open_session("ds", "fast", seed=2)
    harness.step()
    assert registry.claim("ds", "slow", 0, 1).ids[0] in set(plan.ids_of(0))
    # The fast job reads chunk 0 to its end while the slow job sits on it.
    read_through(registry, harness, "fast", 0)
    assert registry.pool("ds", "fast", 0).chunk == 1
    for _ in range(3):
        harness.step()
    assert manager.newest == 1 and manager.state(0) is ChunkState.MARKED
    assert manager.refs(0) == {registry.pool("ds", "slow", 0)}
    assert not harness.evictions  # chunk 0 waits for the slow job
    registry.open_session("ds", "new", seed=3)
    claim = registry.claim("ds", "new", 0, 20)
    assert {plan.chunk_of(i) for i in claim.ids} == {1}  # the newest, fully loaded chunk
    assert len(claim.hits) == 20
    read_through(registry, harness, "slow", 0)
    harness.step()
    assert [e.chunk for e in harness.evictions] == [0]


def test_straggler_chunk_is_forced_out_after_the_timeout():
    clock = [0.0]
    registry = chunked_registry(clock=lambda: clock[0], evict_timeout=30.0)
    harness = Harness(registry, rate=1000)
    registry.open_session("ds", "slow", seed=1)
    registry.open_session("ds", "fast", seed=2)
    harness.step()
    registry.claim("ds", "slow", 0, 1)
    read_through(registry, harness, "fast", 0, clock=clock)
    finished_at = clock[0]
    while harness.now < finished_at + 29:
        harness.step()
    assert not harness.evictions
    while harness.now < finished_at + 31:
        harness.step()
    assert [(e.chunk, e.forced) for e in harness.evictions] == [(0, True)]
    # The slow job goes on reading chunk 0, now as misses.
    claim = registry.claim("ds", "slow", 0, 10)
    assert claim.fetch and not claim.hits


def test_registry_grace_keeps_the_last_claimed_files_cached_a_while():
    clock = [0.0]
    registry = chunked_registry(clock=lambda: clock[0], chunk_grace=3.0)
    harness = Harness(registry, rate=1000)
    registry.open_session("ds", "job", seed=1)
    harness.step()
    assert registry.claim("ds", "job", 0, 1).chunk == 0
    harness.step()
    harness.step()
    state = registry.dataset("ds")
    assert state.manager.state(0) is ChunkState.MARKED
    read_through(registry, harness, "job", 0, clock=clock)
    finished_at = clock[0]
    assert registry.next_deadline() == finished_at + 3.0
    while harness.now < finished_at + 2:
        harness.step()
        assert not harness.evictions and state.manager.loading is None
        assert all(state.is_cached(i) for i in state.plan.ids_of(0))
    while harness.now < finished_at + 3:
        harness.step()
    assert [e.chunk for e in harness.evictions] == [0]
    assert not any(state.is_cached(i) for i in state.plan.ids_of(0))
    assert registry.next_deadline() is None


def test_a_job_that_died_without_closing_is_reaped_and_frees_its_chunk():
    clock = [0.0]
    registry = chunked_registry(clock=lambda: clock[0], idle_timeout=100.0)
    harness = Harness(registry, rate=1000)

    def step():
        harness.step()
        clock[0] = harness.now

    registry.open_session("ds", "dead", seed=1)
    step()
    assert registry.claim("ds", "dead", 0, 5).chunk == 0  # then it dies, never closing
    step()
    step()
    manager = registry.dataset("ds").manager
    assert manager.state(0) is ChunkState.MARKED and manager.newest == 1
    registry.open_session("ds", "live", seed=2)
    while harness.now < 99:
        assert registry.claim("ds", "live", 0, 1).chunk == 1
        step()
    assert not harness.evictions  # nobody finished chunk 0: no forced eviction either
    step()
    step()
    assert [e.chunk for e in harness.evictions] == [0]
    assert [s.job for s in registry.sessions()] == ["live"]
    assert registry.timings("ds", "dead").closed == 1
    with pytest.raises(UnknownSession):
        registry.claim("ds", "dead", 0, 5)


def test_closing_a_session_releases_its_chunk():
    registry = chunked_registry()
    harness = Harness(registry, rate=1000)
    registry.open_session("ds", "a", seed=1)
    registry.open_session("ds", "b", seed=2)
    harness.step()
    registry.claim("ds", "b", 0, 1)
    read_through(registry, harness, "a", 0)
    harness.step()
    assert not harness.evictions
    registry.close_session("ds", "b", 0)
    harness.step()
    assert [e.chunk for e in harness.evictions] == [0]


# -- a randomized run against a model -------------------------------------------------------------


def check_pool(registry: SessionRegistry, pool) -> None:
    """The pool's unread set is exactly the chunk's ungiven files, cached ones apart."""
    if pool.unread is None:
        return
    state = registry.dataset("ds")
    chunk_ids = set(state.plan.ids_of(pool.chunk))
    expected = {i for i in chunk_ids if not pool.given[i]}
    if pool.thinned:  # a share of a chunk the job's previous epoch read (order across epochs)
        assert set(pool.unread) <= expected
    else:
        assert set(pool.unread) == expected
    members = set(pool.unread)
    assert {i for i in members if pool.unread.is_cached(i)} == {
        i for i in members if state.cached[i]
    }


@pytest.mark.parametrize(("seed", "slots"), [(1, 2), (2, 2), (3, 3), (4, 3)])
def test_random_interleaving_keeps_every_invariant(seed, slots):
    rng = random.Random(seed)
    clock = [0.0]
    registry = chunked_registry(
        n=600, clock=lambda: clock[0], evict_timeout=20.0, chunk_slots=slots
    )
    plan = registry.dataset("ds").plan
    harness = Harness(registry, rate=rng.randint(0, 12))
    jobs = {"a": 1, "b": 2, "c": 4}  # job -> world size
    for job, world in jobs.items():
        for rank in range(world):
            registry.open_session("ds", job, rank=rank, world_size=world, seed=rng.randrange(9))
    epoch = dict.fromkeys(jobs, 0)
    given: dict[str, set[int]] = {job: set() for job in jobs}
    epochs_done = dict.fromkeys(jobs, 0)
    for _ in range(3000):
        clock[0] = harness.now
        op = rng.random()
        if op < 0.1:
            harness.step()
        elif op < 0.15:  # the cache's own policy evicts something
            cached = [i for i in range(plan.count) if registry.dataset("ds").cached[i]]
            registry.on_evicted("ds", rng.sample(cached, min(len(cached), rng.randint(1, 20))))
        else:
            job = rng.choice(sorted(jobs))
            rank = rng.randrange(jobs[job])
            cached_before = bytes(registry.dataset("ds").cached)
            generations = [registry.dataset("ds").manager.generation(c) for c in range(plan.chunks)]
            claim = registry.claim("ds", job, rank, rng.randint(1, 40), epoch=epoch[job])
            assert all(cached_before[i] for i in claim.hits)
            assert not any(cached_before[i] for i in claim.fetch)
            assert not set(claim.ids) & given[job]
            assert len(set(claim.ids)) == len(claim.ids)
            manager = registry.dataset("ds").manager
            if (claim.ids and manager.generation(claim.chunk) == generations[claim.chunk]
                    and not manager.is_free(claim.chunk)):
                # (a chunk the claim finished may be re-drawn at once when nothing holds it,
                # or give files to a chunk drawn after it)
                assert {plan.chunk_of(i) for i in claim.ids} == {claim.chunk}
            given[job].update(claim.ids)
            if rng.random() < 0.8:
                registry.on_cached("ds", claim.fetch)
            pool = registry.pool("ds", job, epoch[job])
            check_pool(registry, pool)
            if pool.remaining == 0:  # the job's epoch is given out: check, start the next
                assert given[job] == set(range(plan.count))
                given[job] = set()
                epoch[job] += 1
                epochs_done[job] += 1
                for r in range(jobs[job]):
                    registry.next_epoch("ds", job, r, epoch[job])
        check_invariants(registry.dataset("ds").manager)
    assert min(epochs_done.values()) >= 10, epochs_done
    assert len(harness.evictions) >= 20


def test_grace_ends_once_every_finisher_has_read_past_the_chunk():
    """A finisher that can tell (``drained``) ends its part of the grace as soon as its reads
    pass the chunk; one that cannot keeps the time; the grace ends when both are over."""
    manager, cache, _ = make_manager(grace=5.0)
    told, untold = object(), object()
    load_two_chunks(manager, cache, [told, untold])
    read_past = [False]
    manager.finished(told, 0, 10.0, lambda: read_past[0])
    assert manager.tick(11.0) == []  # the other job is still on the chunk
    read_past[0] = True
    manager.finished(untold, 0, 12.0)  # no drained: its grace runs to 17.0
    assert manager.tick(13.0) == [] and manager.state(0) is ChunkState.MARKED
    assert [type(a) for a in manager.tick(17.0)] == [Evict, Preload]


def test_a_drained_finisher_releases_the_chunk_before_the_grace_time():
    manager, cache, _ = make_manager(grace=5.0)
    job = object()
    load_two_chunks(manager, cache, [job])
    read_past = [False]
    manager.finished(job, 0, 10.0, lambda: read_past[0])
    manager.reference(job, 1)
    assert manager.tick(11.0) == [] and manager.state(0) is ChunkState.MARKED
    read_past[0] = True
    evict, preload = manager.tick(11.5)
    assert evict.chunk == 0 and not evict.forced and preload.chunk == 2
    assert evict.ids == evict.members and manager.state(0) is ChunkState.IDLE
    # Never drained: the time still ends the grace.
    manager, cache, _ = make_manager(grace=5.0)
    load_two_chunks(manager, cache, [job])
    manager.finished(job, 0, 10.0, lambda: False)
    assert manager.tick(14.9) == []
    assert [type(a) for a in manager.tick(15.0)] == [Evict, Preload]
