"""mountd.coop.sessions: validation with errno, idempotent sessions, epochs, timing reports."""

from __future__ import annotations

import errno
import random

import pytest

from mountd.coop.jobs import fold_phase, widest_phase
from mountd.coop.plans import Mode
from mountd.coop.sessions import LIVE_EPOCHS, MAX_CLAIM, SessionRegistry
from mountd.errors import (
    InvalidRequest,
    SessionConflict,
    SessionError,
    StaleEpoch,
    TooManyJobs,
    UnknownDataset,
    UnknownSession,
)
from mountd.rpc.protocol import error_payload, exception_from_payload


def make_registry(n=500, **kwargs) -> SessionRegistry:
    registry = SessionRegistry(clock=lambda: 0.0, **kwargs)
    registry.add_dataset("ds", [100] * n, mode="full", cached=range(0, n, 5))
    return registry


def snapshot(registry: SessionRegistry) -> tuple:
    """Everything a request could change."""
    state = registry.dataset("ds")
    jobs = []
    for info in registry.sessions():
        pool = registry.pool("ds", info.job, info.epoch)
        jobs.append(
            (
                info,
                bytes(pool.given),
                pool.given_total,
                tuple(pool.given_by_rank),
                pool.chunk,
                registry._jobs[("ds", info.job)].sessions[info.rank].rng.getstate(),
            )
        )
    return bytes(state.cached), dict(state.in_flight), sorted(jobs, key=repr)


# -- errors carry errno ---------------------------------------------------------------------------


def test_error_classes_carry_errno_and_survive_the_protocol():
    assert InvalidRequest.errno == errno.EINVAL
    assert UnknownSession.errno == errno.ENOENT and UnknownDataset.errno == errno.ENOENT
    assert SessionConflict.errno == errno.EBUSY and StaleEpoch.errno == errno.ESTALE
    rebuilt = exception_from_payload(error_payload(StaleEpoch("epoch 1 is over")))
    assert isinstance(rebuilt, StaleEpoch) and rebuilt.errno == errno.ESTALE
    assert str(rebuilt) == "epoch 1 is over"


BAD_CLAIMS = [
    ({"n": 0}, InvalidRequest),
    ({"n": -3}, InvalidRequest),
    ({"n": MAX_CLAIM + 1}, InvalidRequest),
    ({"n": True}, InvalidRequest),
    ({"n": 2.0}, InvalidRequest),
    ({"n": "8"}, InvalidRequest),
    ({"epoch": -1}, InvalidRequest),
    ({"epoch": 1.5}, InvalidRequest),
    ({"rank": 4}, InvalidRequest),  # rank >= world size
    ({"rank": -1}, InvalidRequest),
    ({"rank": 2}, UnknownSession),  # in range, never opened
    ({"job": "nobody"}, UnknownSession),
    ({"job": ""}, InvalidRequest),
    ({"job": None}, InvalidRequest),
    ({"job": "x" * 300}, InvalidRequest),
    ({"job": "a\nb"}, InvalidRequest),
    ({"dataset": "other"}, UnknownDataset),
    ({"dataset": 7}, InvalidRequest),
]


@pytest.mark.parametrize(("change", "error"), BAD_CLAIMS)
def test_bad_claims_fail_with_errno_and_change_nothing(change, error):
    registry = make_registry()
    for rank in (0, 1):
        registry.open_session("ds", "job", rank=rank, world_size=4, seed=1)
    registry.open_session("ds", "other-job", seed=2)
    registry.claim("ds", "job", 0, 10)
    before = snapshot(registry)
    args = {"dataset": "ds", "job": "job", "rank": 0, "n": 8, "epoch": None} | change
    with pytest.raises(error) as info:
        registry.claim(args["dataset"], args["job"], args["rank"], args["n"], epoch=args["epoch"])
    assert info.value.errno == error.errno
    assert isinstance(info.value, SessionError)
    assert snapshot(registry) == before


def test_hostile_requests_do_not_disturb_other_sessions():
    # Twin registries see the same good requests; one also sees a stream of bad ones.
    clean, attacked = make_registry(), make_registry()
    for registry in (clean, attacked):
        registry.open_session("ds", "a", seed=1)
        registry.open_session("ds", "b", rank=1, world_size=2, seed=2)
    rng = random.Random(5)
    bad = [
        lambda r: r.claim("ds", "a", 0, 0),
        lambda r: r.claim("ds", "a", 0, 5, epoch=-2),
        lambda r: r.claim("ds", "b", 3, 5),
        lambda r: r.claim("ds", "ghost", 0, 5),
        lambda r: r.open_session("ds", "a", seed=99),  # same rank, other seed
        lambda r: r.open_session("ds", "b", rank=0, world_size=3),  # other world size
        lambda r: r.open_session("ds", "c", rank=2, world_size=2),
        lambda r: r.open_session("ds", "c", lookahead=0),
        lambda r: r.on_cached("ds", [1, 2, 10_000]),  # one id out of range: none applied
        lambda r: r.on_cached("ds", [1, "2"]),
        lambda r: r.on_evicted("ds", "0123"),
        lambda r: r.on_evicted("ds", [True]),
        lambda r: r.report_batch("ds", "a", 0, float("nan")),
        lambda r: r.report_batch("ds", "a", 0, -1.0),
        lambda r: r.report_epoch("ds", "a", 0, -1, 3.0),
        lambda r: r.next_epoch("ds", "a", 0, epoch=-5),
        lambda r: r.close_session("ds", "a", 1),
        lambda r: r.remove_dataset("ds"),
        lambda r: r.add_dataset("ds", [1, 2]),  # other file count
        lambda r: r.add_dataset("new", []),
        lambda r: r.add_dataset("new", [1, -1], mode="full"),
        lambda r: r.add_dataset("new", [1, 2], mode="bogus"),
        lambda r: r.add_dataset("new", [1, 2]),  # no budget to choose a mode
    ]
    outputs = {id(clean): [], id(attacked): []}
    for step in range(120):
        job, rank = ("a", 0) if step % 2 else ("b", 1)
        for registry in (clean, attacked):
            outputs[id(registry)].append(registry.claim("ds", job, rank, 7))
        for _ in range(3):
            with pytest.raises(SessionError) as info:
                rng.choice(bad)(attacked)
            assert info.value.errno in (errno.EINVAL, errno.ENOENT, errno.EBUSY)
        assert snapshot(clean) == snapshot(attacked)
    assert outputs[id(clean)] == outputs[id(attacked)]
    assert "new" not in attacked._datasets


def test_the_count_of_jobs_is_bounded():
    registry = make_registry(max_jobs=2)
    registry.open_session("ds", "a")
    registry.open_session("ds", "b")
    registry.open_session("ds", "b", rank=0)  # re-opening is not a new job
    with pytest.raises(TooManyJobs) as info:
        registry.open_session("ds", "c")
    assert info.value.errno == errno.EBUSY and len(registry.sessions()) == 2
    registry.close_session("ds", "a", 0)
    registry.open_session("ds", "c")


# -- sessions are keyed by (dataset, job, rank), not by process ------------------------------------


def test_reopening_a_session_is_idempotent():
    registry = make_registry()
    info = registry.open_session("ds", "job", rank=1, world_size=2, seed=3)
    first = registry.claim("ds", "job", 1, 20).ids
    # A DataLoader worker (another process) opens the same session: nothing resets.
    assert registry.open_session("ds", "job", rank=1, world_size=2, seed=3) == info
    second = registry.claim("ds", "job", 1, 20).ids
    assert not set(first) & set(second)
    # A worker that only knows an older epoch attaches to the session as it is.
    registry.next_epoch("ds", "job", 1)
    again = registry.open_session("ds", "job", rank=1, world_size=2, seed=3, epoch=0)
    assert again.epoch == 1 and registry.claim("ds", "job", 1, 5).epoch == 1
    assert info.quota == 250 and info.files == 500 and info.mode is Mode.FULL


def test_ranks_share_the_jobs_epoch_and_jobs_are_independent():
    registry = make_registry(n=100)
    registry.open_session("ds", "job", rank=0, world_size=2)
    registry.open_session("ds", "job", rank=1, world_size=2)
    registry.open_session("ds", "solo")
    a = registry.claim("ds", "job", 0, 50).ids
    b = registry.claim("ds", "job", 1, 50).ids
    assert sorted(a + b) == list(range(100))
    assert sorted(registry.claim("ds", "solo", 0, 100).ids) == list(range(100))


def test_unknown_dataset_and_session_are_enoent():
    registry = make_registry()
    with pytest.raises(UnknownDataset):
        registry.open_session("nope", "job")
    with pytest.raises(UnknownSession):
        registry.next_epoch("ds", "job", 0)
    with pytest.raises(UnknownSession):
        registry.timings("ds", "job")
    assert registry.sessions() == []


# -- epochs ---------------------------------------------------------------------------------------


def test_epochs_by_number_and_by_next_epoch():
    registry = make_registry(n=50)
    registry.open_session("ds", "job", seed=4)
    assert len(registry.claim("ds", "job", 0, 50).ids) == 50
    assert registry.claim("ds", "job", 0, 1).end_of_epoch
    assert registry.next_epoch("ds", "job", 0).epoch == 1
    assert sorted(registry.claim("ds", "job", 0, 50).ids) == list(range(50))
    claim = registry.claim("ds", "job", 0, 10, epoch=5)  # jumping ahead is allowed
    assert claim.epoch == 5 and claim.remaining == 40
    with pytest.raises(StaleEpoch) as info:
        registry.claim("ds", "job", 0, 10, epoch=4)
    assert info.value.errno == errno.ESTALE
    assert registry.claim("ds", "job", 0, 10).remaining == 30  # unchanged by the refusal


def test_ranks_may_straddle_an_epoch_boundary():
    registry = make_registry(n=100)
    for rank in (0, 1):
        registry.open_session("ds", "job", rank=rank, world_size=2)
    early = registry.claim("ds", "job", 1, 40).ids
    # Rank 0 finishes epoch 0 quickly and its workers start epoch 1 ...
    registry.claim("ds", "job", 0, 50)
    first_of_1 = registry.claim("ds", "job", 0, 50, epoch=1).ids
    # ... while rank 1 still finishes epoch 0 from the same pool.
    late = registry.claim("ds", "job", 1, 50).ids
    assert len(early) + len(late) == 50 and registry.pool("ds", "job", 0).remaining == 0
    assert len(first_of_1) == 50
    registry.next_epoch("ds", "job", 1)
    assert registry.pool("ds", "job", 0) is None  # nobody on epoch 0 any more
    assert sorted(first_of_1 + registry.claim("ds", "job", 1, 50).ids) == list(range(100))


def test_positions_say_how_far_each_job_is():
    """A job's position is its newest epoch plus the share of it given (stats show it, and
    which jobs read out of phase: docs/substitutable-reads.md "Jobs out of phase")."""
    registry = make_registry(n=100)
    for rank in (0, 1):
        registry.open_session("ds", "a", rank=rank, world_size=2)
    registry.open_session("ds", "b")
    registry.open_session("ds", "idle")
    registry.claim("ds", "a", 0, 30)
    registry.claim("ds", "a", 1, 10)
    registry.claim("ds", "b", 0, 50)
    registry.claim("ds", "b", 0, 50)
    registry.claim("ds", "b", 0, 25, epoch=1)  # b a quarter into epoch 1
    positions = registry.positions("ds")
    assert positions["a"] == pytest.approx(0.4) and positions["b"] == pytest.approx(1.25)
    assert positions["idle"] == pytest.approx(0.0)  # opened: epoch 0, nothing given
    # A scoped job counts only its scope's files.
    registry.open_session("ds", "scoped", scope=[[0, 20]])
    registry.claim("ds", "scoped", 0, 5)
    assert registry.positions("ds")["scoped"] == pytest.approx(0.25)
    with pytest.raises(UnknownDataset):
        registry.positions("nope")


def test_fold_phase_and_the_widest_pair():
    assert fold_phase(3.25 - 1.9) == pytest.approx(0.35)
    assert fold_phase(0.6) == pytest.approx(-0.4)
    assert fold_phase(2.0) == 0.0 and fold_phase(-0.5) == -0.5 and fold_phase(0.5) == -0.5
    assert widest_phase({"a": 1.0}) is None and widest_phase({}) is None
    a, b, apart = widest_phase({"a": 3.1, "b": 2.15, "c": 5.4})
    assert (a, b) == ("a", "c") and apart == pytest.approx(0.3)  # b is 0.05 from a


def test_a_new_rank_cannot_restart_an_epoch_that_is_over():
    registry = make_registry(n=10)
    registry.open_session("ds", "job", world_size=2)
    registry.claim("ds", "job", 0, 5, epoch=3)
    with pytest.raises(StaleEpoch):
        registry.open_session("ds", "job", rank=1, world_size=2, epoch=1)
    info = registry.open_session("ds", "job", rank=1, world_size=2, epoch=3)
    assert info.epoch == 3 and len(registry.claim("ds", "job", 1, 5).ids) == 5


def test_at_most_live_epochs_pools_and_laggards_get_estale():
    registry = make_registry(n=10)
    for rank in range(3):
        registry.open_session("ds", "job", rank=rank, world_size=3)
    registry.next_epoch("ds", "job", 1)  # epochs 0 and 1 live
    registry.next_epoch("ds", "job", 2, epoch=2)  # a third: the oldest (0) is dropped
    live = [e for e in range(3) if registry.pool("ds", "job", e) is not None]
    assert live == [1, 2] and len(live) == LIVE_EPOCHS
    with pytest.raises(StaleEpoch):
        registry.claim("ds", "job", 0, 1)
    registry.claim("ds", "job", 0, 1, epoch=2)  # the laggard catches up


def test_close_session_and_remove_dataset():
    registry = make_registry(n=10)
    registry.open_session("ds", "job", rank=0, world_size=2)
    registry.open_session("ds", "job", rank=1, world_size=2)
    registry.close_session("ds", "job", 0, seconds=12.5)
    assert registry.pool("ds", "job", 0) is not None  # rank 1 still on it
    with pytest.raises(SessionConflict):
        registry.remove_dataset("ds")
    registry.close_session("ds", "job", 1)
    assert registry.pool("ds", "job", 0) is None and registry.sessions() == []
    assert registry.dataset("ds").pools == set()
    assert registry.timings("ds", "job").closed == 2
    assert registry.timings("ds", "job").session_seconds == (12.5,)
    registry.remove_dataset("ds")
    with pytest.raises(UnknownDataset):
        registry.dataset("ds")


# -- datasets -------------------------------------------------------------------------------------


def test_add_dataset_chooses_the_mode_and_is_idempotent():
    registry = SessionRegistry()
    assert registry.add_dataset("big", [10] * 100, budget=200) is Mode.CHUNKED
    assert registry.add_dataset("huge", [10] * 10_000, budget=200) is Mode.OFF
    assert registry.add_dataset("small", [10] * 100, budget=10_000) is Mode.FULL
    assert registry.add_dataset("cmp", [10] * 100, mode="lru") is Mode.LRU
    assert registry.add_dataset("big", [10] * 100, budget=1) is Mode.CHUNKED  # no-op
    assert registry.dataset("big").manager is not None
    assert registry.dataset("huge").manager is None and registry.dataset("cmp").manager is None
    assert registry.mode("cmp") is Mode.LRU


def test_datasets_registered_one_after_another_share_one_budget():
    # `budget` is the whole cache budget: each dataset gets what the earlier ones left, so
    # three datasets that would each fit two chunks alone never hold more than it together.
    registry = SessionRegistry()
    sizes = [100] * 100  # 10 kB each; two chunks = 2 kB
    assert registry.add_dataset("a", sizes, budget=5_000) is Mode.CHUNKED
    assert registry.add_dataset("b", sizes, budget=5_000) is Mode.CHUNKED
    # 1 kB left: chunks of 500 B are still >= 1% of the dataset
    assert registry.add_dataset("c", sizes, budget=5_000) is Mode.CHUNKED
    assert registry.add_dataset("d", sizes, budget=5_000) is Mode.OFF  # nothing left
    held = {name: 2 * registry.dataset(name).plan.target_bytes for name in "abc"}
    assert held == {"a": 2_000, "b": 2_000, "c": 1_000}
    # b goes: the next allocation deals its share again, to c (and d), in registration order
    registry.remove_dataset("b")
    assert registry.allocation_due()
    registry.allocate(5_000)
    assert [registry.mode(n) for n in "acd"] == [Mode.CHUNKED, Mode.CHUNKED, Mode.CHUNKED]
    assert {n: 2 * registry.dataset(n).plan.target_bytes for n in "acd"} == {
        "a": 2_000,
        "c": 2_000,
        "d": 1_000,
    }
    assert sum(a.budget for a in registry.allocation().values()) <= 5_000
    assert "budget-only" in registry.allocation()["d"].reason


def test_manual_chunked_datasets_share_the_budget_too():
    registry = SessionRegistry()
    sizes = [100] * 100
    modes = [registry.add_dataset(n, sizes, budget=3_000, mode="chunked") for n in "abc"]
    assert modes == [Mode.CHUNKED, Mode.CHUNKED, Mode.OFF]  # 2 kB, then the 1 kB left, then none
    registry.allocate(3_000)
    held = sum(
        2 * registry.dataset(n).plan.target_bytes for n in "abc" if registry.mode(n) is Mode.CHUNKED
    )
    assert held <= 3_000
    assert [registry.mode(n) for n in "abc"] == [Mode.CHUNKED, Mode.CHUNKED, Mode.OFF]
    assert registry.allocation()["c"].reason.startswith("fixed by --dataset-mode: no room")
    # the room comes back: c is chunked again (its asked mode is kept)
    registry.remove_dataset("a")
    registry.allocate(3_000)
    assert registry.mode("c") is Mode.CHUNKED


# -- timing reports -------------------------------------------------------------------------------


def test_timing_reports_keep_a_ring_and_a_summary():
    registry = make_registry(ring=4)
    registry.open_session("ds", "job")
    for seconds in (1.0, 2.0, 3.0, 4.0, 5.0, 6.0):
        registry.report_batch("ds", "job", 0, seconds)
    registry.report_epoch("ds", "job", 0, 0, 120.0)
    summary = registry.timings("ds", "job")
    assert summary.batches == 6 and summary.recent == (3.0, 4.0, 5.0, 6.0)
    assert summary.mean == 4.5 and summary.median == 4.5
    assert summary.epochs == ((0, 0, 120.0),)
    registry.close_session("ds", "job", 0)
    assert registry.timings("ds", "job").batches == 6  # kept after the job closed


def test_timings_history_is_bounded():
    registry = make_registry(history=2)
    for job in ("a", "b", "c"):
        registry.open_session("ds", job)
        registry.close_session("ds", job, 0)
    with pytest.raises(UnknownSession):
        registry.timings("ds", "a")
    assert registry.timings("ds", "c").closed == 1
