"""Benefit-aware allocation (Quiver §5.3): the pure allocator, and probing through the registry."""

from __future__ import annotations

import itertools
from array import array
from dataclasses import replace

import pytest

from mountd.coop.benefit import (
    ASSUMED_BENEFIT,
    HIT_SAMPLES,
    KEEP_FACTOR,
    MISS_SAMPLES,
    PROBE_BATCHES,
    PROBE_MAX_S,
    PROBE_PERIOD,
    RETURN_MARGIN,
    DatasetDemand,
    JobBenefit,
    allocate,
    allocate_in_order,
    benefit_moved,
    could_be_full,
    counted_benefits,
    lean_chunk_bytes,
)
from mountd.coop.packing import Packing
from mountd.coop.plans import Mode
from mountd.coop.sessions import SessionRegistry
from mountd.coop.timings import COLD_MISS_SAMPLES, SETTLE_REPORTS, JobTimings, classify_batch
from mountd.errors import InvalidRequest
from quiverfs.testing.clock import FakeClock

MB = 1_000_000


def demand(name: str, total: int, *jobs: JobBenefit, fixed: Mode | None = None) -> DatasetDemand:
    return DatasetDemand(name, total, total // 10, total // 100, tuple(jobs), fixed)


def job(name: str, b: float | None, gpus: int = 1) -> JobBenefit:
    if b is None:
        return JobBenefit(name, gpus)
    return JobBenefit(name, gpus, t_hit=0.1, t_miss=0.1 * b)


# -- the allocator --------------------------------------------------------------------------------


def test_b_and_g_follow_the_paper() -> None:
    j = JobBenefit("j", 4, t_hit=0.1, t_miss=0.3)
    assert j.b == pytest.approx(3.0)
    assert j.g == pytest.approx(12.0)
    assert JobBenefit("k", 2, t_hit=0.1).b is None


def test_everything_fits_everything_beneficial_is_full() -> None:
    out = allocate([demand("a", 100 * MB, job("a1", 3.0)), demand("b", 100 * MB, job("b1", 1.5))],
                   300 * MB)
    assert {k: v.mode for k, v in out.items()} == {"a": Mode.FULL, "b": Mode.FULL}
    assert out["a"].budget == 100 * MB


def test_the_insensitive_jobs_dataset_is_left_uncached_even_with_room() -> None:
    out = allocate([demand("sens", 100 * MB, job("s", 3.0)), demand("insens", 100 * MB, job("i", 1.02, gpus=8))],
                   1000 * MB)
    assert out["sens"].mode is Mode.FULL
    assert out["insens"].mode is Mode.OFF
    assert out["insens"].budget == 0
    assert "insensitive" in out["insens"].reason


def test_a_dataset_with_one_sensitive_job_among_insensitive_ones_is_cached() -> None:
    out = allocate([demand("d", 100 * MB, job("i", 1.0), job("s", 2.0))], 1000 * MB)
    assert out["d"].mode is Mode.FULL


def test_greedy_two_chunks_first_then_full_by_benefit_per_byte() -> None:
    # Three 100 MB datasets; two chunks cost 20 MB each. 100 MB: all three get chunks
    # (60 MB), the rest (40 MB) cannot upgrade any to full (80 MB more each).
    ds = [demand("a", 100 * MB, job("a", 3.0, 4)), demand("b", 100 * MB, job("b", 2.0, 4)),
          demand("c", 100 * MB, job("c", 1.5, 4))]
    out = allocate(ds, 100 * MB)
    assert [out[k].mode for k in "abc"] == [Mode.CHUNKED] * 3
    # 150 MB: the best G per byte (a) is upgraded to full; b and c keep their chunks.
    out = allocate(ds, 150 * MB)
    assert [out[k].mode for k in "abc"] == [Mode.FULL, Mode.CHUNKED, Mode.CHUNKED]
    assert sum(a.budget for a in out.values()) <= 150 * MB
    # 45 MB: chunks go by G per byte: a and b take 40 MB; c gets smaller chunks in the 5 MB
    # left (still >= 1% of the dataset each).
    out = allocate(ds, 45 * MB)
    assert out["a"].mode is Mode.CHUNKED and out["b"].mode is Mode.CHUNKED
    assert out["c"].mode is Mode.CHUNKED and out["c"].budget == 5 * MB
    # 41 MB: nothing left for c beyond 1 MB (< two 1 MB chunks).
    out = allocate(ds, 41 * MB)
    assert out["c"].mode is Mode.OFF and "no room" in out["c"].reason


def test_budget_the_chunks_leave_keeps_files_of_the_best_chunked_datasets() -> None:
    """Pass 5: what no chunk and no upgrade took is kept across epochs by chunked datasets,
    best G per byte first, each up to what its chunks do not hold."""
    ds = [demand("a", 100 * MB, job("a", 3.0, 4)), demand("b", 100 * MB, job("b", 2.0, 4)),
          demand("c", 100 * MB, job("c", 1.5, 4))]
    out = allocate(ds, 100 * MB)  # chunks 60 MB, 40 MB left: all of it to a
    assert [(out[k].budget, out[k].retain) for k in "abc"] == [(20 * MB, 40 * MB), (20 * MB, 0), (20 * MB, 0)]
    assert "keeps 40.0 MB" in out["a"].reason
    out = allocate(ds, 150 * MB)  # a full (100), b and c chunks (40): 10 MB left, to b
    assert [out[k].retain for k in "abc"] == [0, 10 * MB, 0]
    out = allocate(ds, 260 * MB)  # a and b full (upgrades come first), 40 MB left: to c
    assert [(out[k].mode, out[k].retain) for k in "abc"] == [
        (Mode.FULL, 0), (Mode.FULL, 0), (Mode.CHUNKED, 40 * MB)]
    out = allocate(ds[1:], 170 * MB)  # b full, c two chunks and 50 MB kept
    assert (out["c"].budget, out["c"].retain) == (20 * MB, 50 * MB)
    assert sum(a.budget + a.retain for a in out.values()) <= 260 * MB
    out = allocate(ds, 45 * MB)  # smaller chunks for c took the rest: nothing is kept
    assert all(a.retain == 0 for a in out.values())
    # An insensitive dataset keeps nothing, whatever is left.
    out = allocate([demand("s", 100 * MB, job("s", 3.0)), demand("i", 100 * MB, job("i", 1.0))], 50 * MB)
    assert (out["s"].retain, out["i"].mode, out["i"].retain) == (30 * MB, Mode.OFF, 0)


def test_lean_chunks_are_4_percent_of_the_dataset_but_at_least_32_files() -> None:
    assert lean_chunk_bytes(1200 * MB, 12_000, 120 * MB, 12 * MB) == 48 * MB  # 4%
    assert lean_chunk_bytes(1200 * MB, 600, 120 * MB, 12 * MB) == 64 * MB  # 32 files of 2 MB
    assert lean_chunk_bytes(240 * MB, 240, 24 * MB, 2 * MB) == 24 * MB  # never above the chunk
    assert lean_chunk_bytes(100 * MB, 0, 10 * MB, 1 * MB) == 10 * MB  # no file count: as is


def test_chunked_datasets_shrink_to_lean_chunks_and_keep_what_that_frees() -> None:
    """Pass 4: a chunked dataset's chunks shrink to its lean size before pass 5 deals what
    is left, so slots emptied every epoch give way to files kept across epochs."""
    def lean(name: str, total: int, b: float, lean_bytes: int) -> DatasetDemand:
        return DatasetDemand(name, total, total // 10, total // 100, (job(name, b, 3),),
                             lean_chunk_bytes=lean_bytes)

    ds = [lean("big", 1000 * MB, 10.0, 40 * MB), lean("mid", 500 * MB, 2.0, 50 * MB)]
    out = allocate(ds, 300 * MB)  # chunks 200 + 100 MB would take it all and keep nothing
    assert [(out[k].mode, out[k].budget, out[k].retain) for k in ("big", "mid")] == [
        (Mode.CHUNKED, 80 * MB, 120 * MB), (Mode.CHUNKED, 100 * MB, 0)]  # "mid" is lean already
    assert "chunks shrunk to 40.0 MB" in out["big"].reason and "keeps 120.0 MB" in out["big"].reason
    assert sum(a.budget + a.retain for a in out.values()) == 300 * MB
    full = allocate(ds, 1200 * MB)  # "big" full: a full dataset keeps its whole self
    assert (full["big"].mode, full["big"].budget) == (Mode.FULL, 1000 * MB)
    assert (full["mid"].budget, full["mid"].retain) == (100 * MB, 100 * MB)  # 50 MB chunks
    unlean = allocate([replace(d, lean_chunk_bytes=0) for d in ds], 300 * MB)
    assert [(unlean[k].budget, unlean[k].retain) for k in ("big", "mid")] == [(200 * MB, 0), (100 * MB, 0)]


def test_the_registry_plans_a_loose_chunked_dataset_in_lean_chunks() -> None:
    # 2,000 files of 1 kB in a 300 kB budget: two 10% chunks (400 kB) do not fit, two of
    # 150 kB would; lean chunks are 4% (80 kB, more than 32 files) and the rest is kept.
    reg = registry(FakeClock())
    reg.add_dataset("d", [1000] * 2000, budget=300_000)
    reg.allocate(300_000)
    decision = reg.allocation()["d"]
    assert (decision.mode, decision.budget, decision.retain) == (Mode.CHUNKED, 160_000, 140_000)
    plan = reg.dataset("d").plan
    assert 25 <= plan.chunks <= 32  # at most 80 files each (the planner's target is the most)
    assert {len(plan.ids_of(c)) for c in range(plan.chunks)} <= set(range(60, 81))
    assert "chunks shrunk to 0.1 MB" in decision.reason


def test_a_packed_dataset_keeps_its_chunk_size() -> None:
    # Packs of 100 files (5%): lean 4% chunks could not hold a whole pack and the dataset
    # would go off; a packed dataset's chunks are not shrunk.
    n, per_pack = 2000, 100
    chunk_of = array("i", [i // per_pack for i in range(n)])
    starts = array("q", range(0, n + 1, per_pack))
    packing = Packing(chunk_of, starts, array("i", range(n)))
    reg = registry(FakeClock())
    reg.add_dataset("p", [1000] * n, budget=300_000, packing=packing)
    reg.allocate(300_000)
    decision = reg.allocation()["p"]
    assert (reg.mode("p"), decision.budget, decision.retain) == (Mode.CHUNKED, 300_000, 0)
    assert "shrunk" not in decision.reason


def test_could_be_full_names_the_chunked_datasets_a_larger_b_would_make_full() -> None:
    # "small" has the better G per byte and takes the upgrade to full; "big" stays chunked.
    # With its jobs' b unbounded, "big" would lead and fit whole in 1200 MB, not in 700 MB.
    ds = [demand("big", 1000 * MB, job("g1", 3.0)),
          demand("small", 500 * MB, job("s1", 3.0))]
    out = allocate(ds, 1200 * MB)
    assert (out["big"].mode, out["small"].mode) == (Mode.CHUNKED, Mode.FULL)
    assert could_be_full(ds, out, 1200 * MB) == {"big"}
    tight = allocate(ds, 700 * MB)
    assert (tight["big"].mode, tight["small"].mode) == (Mode.CHUNKED, Mode.FULL)
    assert could_be_full(ds, tight, 700 * MB) == set()
    both_chunked = allocate(ds, 600 * MB)
    assert {a.mode for a in both_chunked.values()} == {Mode.CHUNKED}
    assert could_be_full(ds, both_chunked, 600 * MB) == set()
    no_jobs = [demand("big", 1000 * MB), demand("small", 500 * MB, job("s1", 3.0))]
    assert could_be_full(no_jobs, allocate(no_jobs, 1200 * MB), 1200 * MB) == set()


def test_benefit_per_byte_not_benefit_decides() -> None:
    # big has more G but costs ten times as much per unit of G: the small one goes first.
    ds = [demand("big", 1000 * MB, job("x", 3.0, 8)), demand("small", 50 * MB, job("y", 2.0, 4))]
    out = allocate(ds, 120 * MB)
    assert out["small"].mode is Mode.FULL
    # its two chunks (200 MB) do not fit: it gets smaller ones in what is left (70 MB)
    assert out["big"].mode is Mode.CHUNKED and out["big"].budget == 70 * MB


def test_unmeasured_jobs_count_with_the_assumed_benefit() -> None:
    d = demand("d", 100 * MB, job("new", None, 2))
    out = allocate([d], 1000 * MB)
    assert out["d"].mode is Mode.FULL
    assert out["d"].benefit == pytest.approx(ASSUMED_BENEFIT * 2)


def test_a_dataset_holding_cache_keeps_its_place_until_another_clearly_beats_it() -> None:
    # Two datasets, room for one's two chunks plus smaller chunks for the other: whichever
    # is first by G per byte gets the two chunks. Noise in b must not swap them.
    def ds(b_a: float, b_b: float) -> list[DatasetDemand]:
        return [demand("a", 100 * MB, job("a", b_a)), demand("b", 100 * MB, job("b", b_b))]

    assert allocate(ds(3.0, 3.3), 30 * MB)["b"].budget == 20 * MB  # b first, held by nobody
    for holding in (["a", "b"], ["a"]):  # a holds the most: b's 1.1x lead does not move it
        kept = allocate(ds(3.0, 3.3), 30 * MB, holding=holding)
        assert kept["a"].budget == 20 * MB and kept["b"].budget == 10 * MB
    # A clear lead (beyond KEEP_FACTOR) still wins the place.
    moved = allocate(ds(3.0, 3.0 * KEEP_FACTOR * 1.1), 30 * MB, holding=["a", "b"])
    assert moved["b"].budget == 20 * MB and moved["a"].budget == 10 * MB


def test_after_a_probe_only_probes_refresh_t_miss() -> None:
    t = JobTimings(16)
    for _ in range(HIT_SAMPLES):
        t.on_batch(0.1, 0.0, (8, 0))
    for _ in range(MISS_SAMPLES):  # natural misses stand in before any probe
        t.on_batch(0.2, 0.0, (8, 8))
    assert t.t_miss == pytest.approx(0.2)
    t.start_probe(1.0)
    for _ in range(PROBE_BATCHES):
        t.on_batch(0.5, 1.0, (8, 8))
    assert t.finish_probe(2.0) and t.t_miss == pytest.approx(0.5)
    for _ in range(20):  # a cached dataset's prefetched misses: nearly hit-fast, ignored
        t.on_batch(0.11, 3.0, (8, 8))
    assert t.t_miss == pytest.approx(0.5)
    assert t.benefit("j").b == pytest.approx(5.0)


def test_t_miss_is_the_mean_so_a_claims_wait_on_its_first_batch_counts() -> None:
    # A claim's misses are fetched together: its first batch waits for them, the next three
    # find their files landed. The median of such samples is hit-fast (b = 1); the mean is
    # the time per batch the job averages without the cache.
    t = JobTimings(16)
    for _ in range(HIT_SAMPLES):
        t.on_batch(0.1, 0.0, (8, 0))
    for _ in range(2):
        for seconds in (0.9, 0.1, 0.1, 0.1):
            t.on_batch(seconds, 0.0, (8, 8))
    assert t.t_miss == pytest.approx(0.3)
    assert t.benefit("j").b == pytest.approx(3.0)


def test_a_dataloaders_bursts_measure_a_cpu_bound_job_at_b_1() -> None:
    # With 4 DataLoader workers the intervals between a job's reports come in turns: three
    # short, one long (peers.py (b), 2026-11-30). A CPU-bound job's time per batch is the
    # same whether its reads hit or miss, here 0.165 s, but the median of its hit samples is
    # a short interval (b 8.25 against steady misses, as the job's 0.42-5.5 across runs);
    # the mean is its time per batch: b = 1.
    t = JobTimings(16)
    for seconds in [0.02, 0.02, 0.02, 0.6] * 2:
        t.on_batch(seconds, 0.0, (8, 0))
    for _ in range(MISS_SAMPLES):
        t.on_batch(0.165, 0.0, (8, 8))
    assert t.t_hit == pytest.approx(0.165)
    assert t.benefit("j").b == pytest.approx(1.0)


def test_a_cached_datasets_natural_misses_count_only_for_its_cold_start() -> None:
    t = JobTimings(16)
    for _ in range(HIT_SAMPLES):
        t.on_batch(0.1, 0.0, (8, 0), cached=True)
    for _ in range(COLD_MISS_SAMPLES):  # the cold start: misses wait for the bucket
        t.on_batch(0.5, 0.0, (8, 8), cached=True)
    for _ in range(40):  # then co-operative and prefetched misses, nearly hit-fast: ignored
        t.on_batch(0.1, 1.0, (8, 8), cached=True)
    assert t.t_miss == pytest.approx(0.5) and len(t.miss_times) == COLD_MISS_SAMPLES
    for _ in range(COLD_MISS_SAMPLES):  # uncached (off): every miss is a fetch, all count
        t.on_batch(0.1, 2.0, (8, 8), cached=False)
    assert t.t_miss == pytest.approx(0.3)


@pytest.mark.parametrize(("mode", "counted"), [("full", COLD_MISS_SAMPLES), ("off", 40)])
def test_report_batch_tells_the_timings_whether_the_dataset_is_cached(mode: str, counted: int) -> None:
    reg = registry(FakeClock())
    reg.add_dataset("d", [1000] * 100, budget=1 * MB, mode=mode)
    reg.open_session("d", "j")
    for _ in range(40):
        reg.report_batch("d", "j", 0, 0.5, files=5, misses=5)
    assert len(reg._timings[("d", "j")].miss_times) == counted


def test_a_dataset_turned_off_as_insensitive_needs_a_margin_to_come_back() -> None:
    # Hysteresis of the decision: a CPU-bound job's b wanders around 1 (1.00-1.23 in
    # peers.py (b), 2026-11-30) and, without it, flipped its dataset 7-8 times in two epochs.
    back = 1.1 + RETURN_MARGIN
    cpu_bound = demand("d", 100 * MB, job("j", 1.2))
    assert allocate([cpu_bound], 1000 * MB)["d"].mode is Mode.FULL  # never off: on at 1.2
    out = allocate([cpu_bound], 1000 * MB, resting={"d"})
    assert out["d"].mode is Mode.OFF and out["d"].insensitive
    assert f"< {back:.2f}" in out["d"].reason
    assert allocate([demand("d", 100 * MB, job("j", back + 0.01))], 1000 * MB,
                    resting={"d"})["d"].mode is Mode.FULL
    # Going off keeps the plain threshold, and only insensitivity marks a dataset resting.
    assert allocate([demand("d", 100 * MB, job("j", 1.09))], 1000 * MB)["d"].insensitive
    crowded = allocate([demand("a", 100 * MB, job("a1", 3.0)), demand("b", 100 * MB, job("b1", 3.0))],
                       15 * MB)
    assert crowded["b"].mode is Mode.OFF and not crowded["b"].insensitive


def test_a_cpu_bound_job_on_the_threshold_turns_its_dataset_off_once() -> None:
    clock = FakeClock()
    reg = measured_off(clock, 0.1, 0.105)
    assert reg.allocation()["d"].insensitive
    timings = reg._timings[("d", "job")]
    timings.settling = 0
    changes, seen = 0, []
    for seconds in [0.14, 0.1, 0.15, 0.11, 0.13] * 8:  # b wanders 1.0-1.3 while off
        reg.report_batch("d", "job", 0, seconds, files=5, misses=5)
        seen.append(timings.benefit("job").b)
        clock.now += 1.0
        if reg.allocation_due():
            changes += len(reg.allocate(200_000))
    assert max(seen) > 1.2 and changes == 0 and reg.mode("d") is Mode.OFF
    for _ in range(64):  # the bucket slows down: misses now cost the job
        reg.report_batch("d", "job", 0, 0.2, files=5, misses=5)
    reg.allocate(200_000)
    assert reg.mode("d") is not Mode.OFF


def test_an_off_datasets_hits_are_not_hit_samples() -> None:
    # Hits of an off dataset are files left from before, read while nothing loads: faster
    # than the hits measured while its chunks loaded (0.14-0.17 s against 0.25-0.29 s a batch
    # in peers.py (b), 2026-11-30). As samples they pulled t_hit down until b passed 1.35
    # and the dataset came back on. Its misses still count: they are what can bring it back.
    clock = FakeClock()
    reg = measured_off(clock, 0.1, 0.105)
    timings = reg._timings[("d", "job")]
    timings.settling = 0
    hits, misses = list(timings.hit_times), len(timings.miss_times)
    for _ in range(40):
        reg.report_batch("d", "job", 0, 0.02, files=5, misses=0)
    assert list(timings.hit_times) == hits and timings.t_hit == pytest.approx(0.1)
    reg.report_batch("d", "job", 0, 0.105, files=5, misses=5)
    assert len(timings.miss_times) == misses + 1
    assert reg.mode("d") is Mode.OFF


def test_fixed_modes_are_kept_and_charged() -> None:
    out = allocate([demand("fixed", 100 * MB, job("f", 1.0), fixed=Mode.FULL),
                    demand("auto", 100 * MB, job("a", 3.0))], 150 * MB)
    assert out["fixed"].mode is Mode.FULL and out["fixed"].reason == "fixed by --dataset-mode"
    assert out["auto"].mode is Mode.CHUNKED  # 50 MB left: two chunks, not the whole


# -- timings: classifying reports -----------------------------------------------------------------


def test_reports_are_classified_by_what_recent_claims_gave() -> None:
    t = JobTimings(16)
    t.on_claim(10, 0)
    t.on_batch(0.1, 0.0)
    t.on_claim(0, 10)
    t.on_batch(0.2, 0.0)  # mixed window: not a sample
    assert list(t.hit_times) == [0.1] and not t.miss_times
    for _ in range(4):
        t.on_claim(0, 10)
    t.on_batch(0.3, 0.0)
    assert list(t.miss_times) == [0.3]


def test_a_report_that_says_what_its_batch_read_is_classified_exactly() -> None:
    # The claim window is mixed (it would classify nothing); the batch's own files decide.
    t = JobTimings(16)
    t.on_claim(10, 0)
    t.on_claim(0, 10)
    t.on_batch(0.1, 0.0, (8, 0))
    t.on_batch(0.5, 0.0, (8, 8))
    t.on_batch(0.3, 0.0, (8, 3))  # a mixed batch: not a sample
    t.on_batch(0.3, 0.0, (0, 0))  # an empty one neither
    assert list(t.hit_times) == [0.1] and list(t.miss_times) == [0.5]
    assert classify_batch(10, 9) == "miss" and classify_batch(10, 8) is None
    assert classify_batch(1, 0) == "hit" and classify_batch(0, 0) is None


def test_on_batch_says_when_the_job_is_first_measured() -> None:
    t = JobTimings(16)
    firsts = [t.on_batch(0.1, 0.0, (8, 0)) for _ in range(HIT_SAMPLES)]
    firsts += [t.on_batch(0.4, 0.0, (8, 8)) for _ in range(MISS_SAMPLES + 3)]
    assert firsts.count(True) == 1 and firsts[HIT_SAMPLES + MISS_SAMPLES - 1]
    assert t.t_hit == pytest.approx(0.1) and t.t_miss == pytest.approx(0.4)


# -- the registry: probes, exactly once, re-evaluation -----------------------------------------------


def drive(reg: SessionRegistry, clock: FakeClock, dataset: str, job: str, t_hit: float, t_miss: float,
          *, epochs: int = 1, n: int = 5, world: int = 1) -> list[list[int]]:
    """Claim through ``epochs`` epochs on every rank of ``job``, reporting each batch as the
    emulated job would take it: ``t_hit`` when its claim was all hits, else ``t_miss``.
    Returns every epoch's given ids."""
    given: list[list[int]] = []
    for rank in range(world):
        reg.open_session(dataset, job, rank=rank, world_size=world)
    start = reg.session_info(dataset, job, 0).epoch
    for epoch in range(start, start + epochs):
        got: list[int] = []
        done = [False] * world
        for rank in itertools.cycle(range(world)):
            if all(done):
                break
            if done[rank]:
                continue
            claim = reg.claim(dataset, job, rank, n, epoch=epoch)
            if claim.end_of_epoch:
                done[rank] = True
                continue
            got.extend(claim.ids)
            clock.now += 0.01
            reg.report_batch(dataset, job, rank, t_hit if not claim.fetch else t_miss)
        given.append(got)
    return given


def registry(clock: FakeClock) -> SessionRegistry:
    reg = SessionRegistry(clock=clock, idle_timeout=None)
    reg.benefit_aware = True
    return reg


def measured_off(clock: FakeClock, t_hit: float, t_miss: float, ranks: int = 1) -> SessionRegistry:
    """A registry with dataset "d" (400 files of 1 kB, half cached) and job "job" of
    ``ranks`` ranks, measured from exact reports at ``t_hit`` / ``t_miss`` (b below 1.1) and
    allocated 200 kB: the dataset is off."""
    reg = registry(clock)
    reg.add_dataset("d", [1000] * 400, budget=1 * MB, cached=range(0, 400, 2))
    for rank in range(ranks):
        reg.open_session("d", "job", rank=rank, world_size=ranks)
    for seconds, misses in [(t_hit, 0)] * HIT_SAMPLES + [(t_miss, 5)] * MISS_SAMPLES:
        reg.report_batch("d", "job", 0, seconds, files=5, misses=misses)
    reg.allocate(200_000)
    assert reg.mode("d") is Mode.OFF
    return reg


def test_a_probe_measures_t_miss_and_keeps_exactly_once() -> None:
    clock = FakeClock()
    reg = registry(clock)
    n_files = 1000
    reg.add_dataset("d", [1000] * n_files, budget=10 * MB, cached=range(0, n_files, 2))
    reg.open_session("d", "j", world_size=2, rank=0)
    reg.open_session("d", "j", world_size=2, rank=1)
    epochs = drive(reg, clock, "d", "j", 0.1, 0.4, epochs=3, world=2)
    for ids in epochs:  # exactly once per epoch, across the probe
        assert sorted(ids) == list(range(n_files))
    timings = reg._timings[("d", "j")]
    assert timings.probes >= 1 and timings.probe is None
    (benefit, probes), = reg.benefits("d")
    assert benefit.gpus == 2
    assert benefit.t_hit == pytest.approx(0.1) and benefit.t_miss == pytest.approx(0.4)
    assert benefit.b == pytest.approx(4.0) and benefit.g == pytest.approx(8.0)


def test_a_probe_gives_only_uncached_files() -> None:
    clock = FakeClock()
    reg = registry(clock)
    reg.add_dataset("d", [1000] * 2000, budget=10 * MB, cached=range(1000))
    reg.open_session("d", "j")
    probing_claims = []
    for _ in range(200):
        claim = reg.claim("d", "j", 0, 5)
        if reg._timings[("d", "j")].probe is not None:
            probing_claims.append(claim)
        reg.report_batch("d", "j", 0, 0.1 if not claim.fetch else 0.5)
    assert len(probing_claims) >= PROBE_BATCHES
    assert all(not c.hits and all(i >= 1000 for i in c.fetch) for c in probing_claims)


def test_a_cold_start_t_miss_waits_a_period_for_its_probe() -> None:
    t = JobTimings(16)
    for _ in range(HIT_SAMPLES):
        t.on_batch(0.1, 0.0, (8, 0), cached=True)
    assert t.probe_due(0.5, PROBE_PERIOD)  # t_hit known, t_miss not
    for _ in range(MISS_SAMPLES):
        t.on_batch(0.15, 1.0, (8, 8), cached=True)
    assert t.t_miss == pytest.approx(0.15)
    assert not t.probe_due(1.0 + PROBE_PERIOD - 1, PROBE_PERIOD)
    assert t.probe_due(1.0 + PROBE_PERIOD, PROBE_PERIOD)


def test_a_probe_that_settles_nothing_is_retried_after_a_while_not_at_every_claim() -> None:
    t = JobTimings(16)
    for _ in range(HIT_SAMPLES):
        t.on_batch(0.1, 0.0, (8, 0))
    t.start_probe(1.0)
    t.on_batch(0.5, 2.0, (8, 8))  # one sample: too few
    assert t.finish_probe(1.0 + PROBE_MAX_S) and t.t_miss is None
    assert not t.probe_due(1.0 + 2 * PROBE_MAX_S - 1, PROBE_PERIOD)
    assert t.probe_due(1.0 + 2 * PROBE_MAX_S, PROBE_PERIOD)


def test_a_wholly_cached_datasets_job_is_measured_by_its_cold_start() -> None:
    # A small dataset that ``full`` loaded before its job read it: nothing uncached is left
    # to probe with. The cold start's misses (the shim reports all of the first claim's
    # batches but the first: fewer than MISS_SAMPLES) give t_miss; the probe ends at once.
    clock = FakeClock()
    reg = registry(clock)
    reg.add_dataset("d", [1000] * 100, budget=1 * MB, cached=range(100))
    reg.open_session("d", "j")
    for _ in range(MISS_SAMPLES - 1):
        reg.report_batch("d", "j", 0, 1.5, files=8, misses=8)
    for _ in range(HIT_SAMPLES):
        reg.report_batch("d", "j", 0, 1.4, files=8, misses=0)
    timings = reg._timings[("d", "j")]
    assert timings.t_miss is None and reg.benefits("d")[0][0].b is None
    reg.allocate(1 * MB)
    claim = reg.claim("d", "j", 0, 8)
    assert len(claim.hits) == 8 and not claim.fetch  # a normal claim: the probe found nothing
    assert timings.probes == 1 and timings.probe is None and reg.allocation_due()
    (benefit, probes), = reg.benefits("d")
    assert benefit.t_miss == pytest.approx(1.5) and benefit.b == pytest.approx(1.5 / 1.4)
    for _ in range(20):  # not probed again at every claim
        clock.now += 1.0
        reg.claim("d", "j", 0, 8)
    assert timings.probes == 1
    clock.now += PROBE_PERIOD
    reg.claim("d", "j", 0, 8)
    assert timings.probes == 2 and timings.probe is None and timings.t_miss == pytest.approx(1.5)


def test_a_job_with_no_miss_sample_at_all_is_not_probed_at_every_claim() -> None:
    clock = FakeClock()
    reg = registry(clock)
    reg.add_dataset("d", [1000] * 100, budget=1 * MB, cached=range(100))
    reg.open_session("d", "j")
    for _ in range(HIT_SAMPLES):
        reg.report_batch("d", "j", 0, 0.1, files=8, misses=0)
    for _ in range(30):
        clock.now += 1.0
        reg.claim("d", "j", 0, 8)
    timings = reg._timings[("d", "j")]
    assert timings.probes == 1 and timings.t_miss is None
    clock.now += PROBE_MAX_S
    reg.claim("d", "j", 0, 8)
    assert timings.probes == 2


@pytest.mark.parametrize(("budget", "probed"), [(1_200_000, True), (700_000, False)])
def test_a_cold_measured_job_is_probed_at_once_when_its_b_could_make_its_dataset_full(
        budget: int, probed: bool) -> None:
    # Chunked "big" (its jobs measured b 3 from the cold start, co-operative misses that
    # understate it) beside full "small": at 1.2 MB a larger b would make "big" full, so its
    # job is probed at its next claim, not a probe period later; at 0.7 MB it cannot be.
    clock = FakeClock()
    reg = registry(clock)
    reg.add_dataset("big", [1000] * 1000, budget=budget)
    reg.add_dataset("small", [1000] * 500, budget=budget)
    for name, job_name in (("big", "jb"), ("small", "js")):
        reg.open_session(name, job_name)
    reg.allocate(budget)
    for name, job_name in (("big", "jb"), ("small", "js")):
        for _ in range(HIT_SAMPLES):
            reg.report_batch(name, job_name, 0, 0.1, files=8, misses=0)
        for _ in range(MISS_SAMPLES):
            reg.report_batch(name, job_name, 0, 0.3, files=8, misses=8)
    clock.now += 1.0
    reg.allocate(budget)
    assert (reg.mode("big"), reg.mode("small")) == (Mode.CHUNKED, Mode.FULL)
    big, small = reg._timings[("big", "jb")], reg._timings[("small", "js")]
    assert big.t_miss == pytest.approx(0.3) and not big.probed
    reg.claim("big", "jb", 0, 8)
    reg.claim("small", "js", 0, 8)
    assert (big.probe is not None, big.probes) == (probed, int(probed))
    assert (small.probe, small.probes) == (None, 0)  # full already: nothing a probe could win
    if probed:  # once: after it, probes wait their period
        for _ in range(PROBE_BATCHES):
            reg.report_batch("big", "jb", 0, 0.9, files=8, misses=8)
        reg.claim("big", "jb", 0, 8)
        assert big.probe is None and big.probed and big.t_miss == pytest.approx(0.9)
        clock.now += PROBE_MAX_S
        reg.claim("big", "jb", 0, 8)
        assert big.probes == 1


def test_allocation_is_re_evaluated_when_jobs_join_and_leave() -> None:
    clock = FakeClock()
    reg = registry(clock)
    sizes = [1000] * 400  # 400 kB each
    for name in ("a", "b"):
        reg.add_dataset(name, sizes, budget=1 * MB, cached=range(0, 400, 2))
    budget = 500_000  # one of the two fits whole
    reg.allocate(budget)
    assert reg.allocation_due() is False
    reg.open_session("a", "fast", world_size=1)
    reg.open_session("b", "slow", world_size=1)
    assert reg.allocation_due()
    drive(reg, clock, "a", "fast", 0.1, 0.5, epochs=2)
    drive(reg, clock, "b", "slow", 1.0, 1.02, epochs=2)
    reg.allocate(budget)
    modes = {k: a.mode for k, a in reg.allocation().items()}
    assert modes == {"a": Mode.FULL, "b": Mode.OFF}
    assert reg.mode("a") is Mode.FULL and reg.mode("b") is Mode.OFF
    assert "insensitive" in reg.allocation()["b"].reason
    # The insensitive job leaves, a sensitive one arrives on b: b is cached again.
    reg.close_session("b", "slow", 0)
    assert reg.allocation_due()
    reg.open_session("b", "hungry", world_size=4)
    drive(reg, clock, "b", "hungry", 0.1, 0.6, epochs=2, world=4)
    changes = reg.allocate(budget)
    assert {c.dataset for c in changes} >= {"b"}
    # b's G per byte (4 GPUs × 6) beats a's (1 × 5): b whole, a in two chunks.
    assert reg.mode("b") is Mode.FULL and reg.mode("a") is Mode.CHUNKED
    # a's job leaves: a counts as one unmeasured job again; still cached, by the assumed b.
    reg.close_session("a", "fast", 0)
    reg.allocate(budget)
    assert reg.allocation()["a"].benefit == pytest.approx(ASSUMED_BENEFIT)


def test_mode_changes_keep_exactly_once_mid_epoch() -> None:
    clock = FakeClock()
    reg = registry(clock)
    n_files = 600
    reg.add_dataset("d", [1000] * n_files, budget=10 * MB, cached=range(0, n_files, 3))
    reg.open_session("d", "j", world_size=2, rank=0)
    reg.open_session("d", "j", world_size=2, rank=1)
    modes = itertools.cycle([(Mode.CHUNKED, 120_000), (Mode.OFF, 0), (Mode.FULL, 600_000),
                             (Mode.CHUNKED, 200_000), (Mode.FULL, 600_000)])
    for epoch in range(3):
        got: list[int] = []
        done = [False, False]
        step = 0
        while not all(done):
            for rank in (0, 1):
                if done[rank]:
                    continue
                claim = reg.claim("d", "j", rank, 7, epoch=epoch)
                done[rank] = claim.end_of_epoch
                got.extend(claim.ids)
                reg.on_cached("d", claim.fetch)
                step += 1
                if step % 13 == 0:
                    mode, budget = next(modes)
                    change = reg.set_mode("d", mode, budget)
                    assert change is None or change.new is reg.mode("d")
                for action in reg.tick():
                    if hasattr(action, "ids") and type(action).__name__ == "Evict":
                        reg.on_evicted("d", action.ids)
        assert sorted(got) == list(range(n_files))


def test_exact_reports_measure_b_within_a_few_batches_and_allocate_at_once() -> None:
    # Half of each dataset is cached and the claims give hits first, so the claim-window rule
    # would call every report a hit. Reports that say which of their files missed (as a job
    # whose reader runs ahead knows) measure both jobs within HIT_SAMPLES + MISS_SAMPLES
    # batches each, and the first b makes an allocation due at once (not at the next
    # interval): the insensitive job's dataset goes off, the sensitive one is cached.
    clock = FakeClock()
    reg = registry(clock)
    for name in ("fast", "slow"):
        reg.add_dataset(name, [1000] * 400, budget=1 * MB, cached=range(0, 400, 2))
        reg.open_session(name, "job")
    reg.allocate(200_000)
    times = {"fast": (0.1, 0.5), "slow": (1.0, 1.02)}
    for name, (t_hit, t_miss) in times.items():
        reports = 0
        while not reg.allocation_due():
            # hits first; then t_hit is known and the job is probed (its claims give misses)
            claim = reg.claim(name, "job", 0, 10)
            miss = reports >= HIT_SAMPLES
            assert not miss or not claim.hits  # the probe
            clock.now += 0.01
            reg.report_batch(name, "job", 0, t_miss if miss else t_hit, files=5, misses=5 if miss else 0)
            reports += 1
        assert reports == HIT_SAMPLES + max(MISS_SAMPLES, PROBE_BATCHES)
        assert reg._timings[(name, "job")].probes == 1
        reg.allocate(200_000)
    (fast, _), = reg.benefits("fast")
    (slow, _), = reg.benefits("slow")
    assert fast.b == pytest.approx(5.0) and slow.b == pytest.approx(1.02)
    allocation = reg.allocation()
    assert allocation["slow"].mode is Mode.OFF and "insensitive" in allocation["slow"].reason
    assert allocation["fast"].mode is not Mode.OFF


def test_report_batch_checks_files_and_misses() -> None:
    reg = registry(FakeClock())
    reg.add_dataset("d", [1000] * 10, budget=1 * MB)
    reg.open_session("d", "j")
    for files, misses in ((5, None), (None, 2), (5, 6), (-1, 0), (5, True)):
        with pytest.raises(InvalidRequest):
            reg.report_batch("d", "j", 0, 0.1, files=files, misses=misses)
    reg.report_batch("d", "j", 0, 0.1, files=5, misses=5)
    assert len(reg._timings[("d", "j")].miss_times) == 1


def test_a_b_that_moves_makes_an_allocation_due() -> None:
    assert benefit_moved(None, 1.5) and not benefit_moved(None, None)
    assert not benefit_moved(2.0, 2.2) and benefit_moved(2.0, 2.6)
    assert benefit_moved(1.0, 1.2)  # crossed MIN_BENEFIT clearly
    assert not benefit_moved(1.08, 1.12)  # on the threshold: hysteresis
    # Through the registry: an early noisy b (1.0) sends the dataset off; as the job's miss
    # times grow, its b moves and the allocation follows at once, not 30 s later.
    clock = FakeClock()
    reg = measured_off(clock, 0.1, 0.1)
    reports = 0
    while not reg.allocation_due():
        reg.report_batch("d", "job", 0, 0.5, files=5, misses=5)
        reports += 1
    assert SETTLE_REPORTS < reports <= SETTLE_REPORTS + MISS_SAMPLES  # after the change settled
    reg.allocate(200_000)
    assert reg.mode("d") is not Mode.OFF


@pytest.mark.parametrize("ranks", [1, 2])
def test_the_batches_in_flight_at_a_mode_change_are_not_samples(ranks: int) -> None:
    # peers.py (b), 2026-11-30: a CPU-bound job measured b 0.91 on its cold start and its
    # dataset went off; the batch in flight then took 5.2 s (the change's own cost), its one
    # miss sample made b 5.95, and the dataset went off and on twice in half a second. The
    # reports of the batches in flight at a change (SETTLE_REPORTS per rank) are skipped.
    clock = FakeClock()
    reg = measured_off(clock, 0.126, 0.115, ranks)
    assert not reg.allocation_due()
    timings = reg._timings[("d", "job")]
    samples = list(timings.miss_times)
    reg.report_batch("d", "job", 0, 5.2, files=5, misses=5)  # the stall
    for i in range(SETTLE_REPORTS * ranks - 1):
        reg.report_batch("d", "job", i % ranks, 0.115, files=5, misses=5)
    assert list(timings.miss_times) == samples and not reg.allocation_due()
    reg.report_batch("d", "job", 0, 0.115, files=5, misses=5)  # settled: a sample again
    assert len(timings.miss_times) == len(samples) + 1
    assert not reg.allocation_due() and reg.mode("d") is Mode.OFF


def test_a_short_batch_counts_as_a_full_one_per_file() -> None:
    t = JobTimings(ring=16)
    for _ in range(HIT_SAMPLES - 1):
        t.on_batch(0.8, 0.0, (8, 0))
    t.on_batch(0.2, 0.0, (2, 0))  # the epoch's last batch: 2 files at the same 0.1 s a file
    assert t.t_hit == pytest.approx(0.8)
    assert list(t.hit_times) == pytest.approx([0.8] * HIT_SAMPLES)


def test_an_unmeasured_job_counts_at_the_median_b_of_its_datasets_measured_jobs() -> None:
    # Two of three insensitive jobs measured (b 1.0, 1.05): the third counts at their median,
    # so the dataset is off even with room (Quiver: such a dataset never enters the cache).
    d = demand("insens", 100 * MB, job("i0", 1.0), job("i1", 1.05), job("new", None))
    out = allocate([d], 1000 * MB)
    assert out["insens"].mode is Mode.OFF
    assert "1 not measured yet" in out["insens"].reason
    assert out["insens"].benefit == pytest.approx(1.0 + 1.05 + 1.025)
    assert counted_benefits(d) == pytest.approx([1.0, 1.05, 1.025])
    # Next to a sensitive measured job, the new one counts at the median (3.0), not 2.
    d = demand("sens", 100 * MB, job("s", 3.0, gpus=2), job("new", None, gpus=2))
    assert allocate([d], 1000 * MB)["sens"].benefit == pytest.approx(12.0)
    # None measured: the assumed value, and never "insensitive".
    d = demand("fresh", 100 * MB, job("a", None), job("b", None))
    out = allocate([d], 1000 * MB)
    assert out["fresh"].mode is Mode.FULL
    assert out["fresh"].benefit == pytest.approx(2 * ASSUMED_BENEFIT)


def test_budget_only_deals_one_budget_in_registration_order() -> None:
    ds = [demand(n, 100 * MB) for n in ("c", "a", "b")]  # given order, not name order
    out = allocate_in_order(ds, 50 * MB)
    assert [out[n].mode for n in "cab"] == [Mode.CHUNKED, Mode.CHUNKED, Mode.CHUNKED]
    assert [out[n].budget for n in "cab"] == [20 * MB, 20 * MB, 10 * MB]
    out = allocate_in_order(ds, 30 * MB)
    assert [out[n].budget for n in "cab"] == [20 * MB, 10 * MB, 0]
    assert out["b"].mode is Mode.OFF and "no room" in out["b"].reason
    assert sum(a.budget for a in out.values()) <= 30 * MB
    out = allocate_in_order([demand("small", 10 * MB), *ds], 45 * MB)
    assert out["small"].mode is Mode.FULL and out["small"].budget == 10 * MB
    assert [out[n].budget for n in "cab"] == [20 * MB, 15 * MB, 0]
    # manual: a fixed lru costs nothing, a fixed chunked is sized by what is left
    out = allocate_in_order([demand("l", 100 * MB, fixed=Mode.LRU),
                             demand("k", 100 * MB, fixed=Mode.CHUNKED)], 12 * MB)
    assert out["l"].budget == 0 and out["k"].mode is Mode.CHUNKED and out["k"].budget == 12 * MB


# -- room for a single job's look-ahead (issue 37 (b)) ------------------------------------------


def test_a_datasets_pins_leave_room_for_its_jobs_look_ahead() -> None:
    """``max_pinned`` bounds what a dataset's chunks (or, full, the whole dataset) may pin:
    below two of its smallest chunks it is off, above that its chunks shrink to fit, and a
    dataset that would fit whole is not upgraded past it."""
    d = demand("a", 100 * MB, job("a1", 3.0))
    assert allocate([d], 50 * MB)["a"].mode is Mode.CHUNKED  # no bound: two 10 MB chunks
    out = allocate([replace(d, max_pinned=1 * MB)], 50 * MB)["a"]  # under two 1 MB chunks
    assert (out.mode, out.budget) == (Mode.OFF, 0)
    assert "look-ahead" in out.reason
    out = allocate([replace(d, max_pinned=8 * MB)], 50 * MB)["a"]
    assert (out.mode, out.budget) == (Mode.CHUNKED, 8 * MB)
    assert "look-ahead" in out.reason
    small = demand("s", 30 * MB, job("s1", 3.0))
    assert allocate([small], 50 * MB)["s"].mode is Mode.FULL
    out = allocate([replace(small, max_pinned=20 * MB)], 50 * MB)["s"]
    assert (out.mode, out.budget) == (Mode.CHUNKED, 6 * MB)  # two 3 MB chunks: not upgraded
    assert allocate([replace(small, max_pinned=0)], 50 * MB)["s"].mode is Mode.OFF


def test_a_jobs_look_ahead_is_what_its_claims_gave_beyond_what_its_reports_read() -> None:
    timings = JobTimings(ring=8)
    timings.on_claim(30, 34)
    timings.on_batch(0.1, 0.0)  # a report that does not say what it read
    assert timings.ahead_files is None
    timings.on_batch(0.1, 0.1, (16, 0))
    assert timings.ahead_files == 48
    timings.on_claim(16, 0)
    timings.on_batch(0.1, 0.2, (16, 0))
    timings.on_batch(0.1, 0.3, (16, 0))
    assert timings.ahead_files == 48  # the most it held ahead


def test_only_a_dataset_read_by_one_job_leaves_room_for_its_look_ahead() -> None:
    """The registry bounds a dataset's pins by its one job's look-ahead (files x the mean
    size, over the protection share); two jobs share its chunks whatever their look-ahead,
    and a registry that does not know the cache's size bounds nothing."""
    clock = FakeClock()
    reg = registry(clock)
    reg.add_dataset("d", [1000] * 400, budget=200_000)
    reg.open_session("d", "a")
    claim = reg.claim("d", "a", 0, 40)
    reg.report_batch("d", "a", 0, 0.1, files=10, misses=0)
    assert reg.demands()[0].max_pinned is None  # the cache's size unknown
    reg.cache_bytes, reg.protect_share = 100_000, 0.5
    (d,) = reg.demands()
    assert d.max_pinned == 100_000 - (len(claim.ids) - 10) * 1000 * 2
    reg.open_session("d", "b")
    assert reg.demands()[0].max_pinned is None
