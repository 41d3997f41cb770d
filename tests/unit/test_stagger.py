"""The staggering model (quiverfs/plan/stagger.py): the state machine against the paper's closed
form (HiPC'23 eqs. 1–3), its edge cases, and the binary search against the exhaustive sweep."""

from __future__ import annotations

import math
import random

import pytest

from quiverfs.base.errors import UsageError
from quiverfs.plan.stagger import (
    CL,
    CR,
    DONE,
    SR,
    WARM,
    Profile,
    best,
    binary_search,
    epoch_order,
    grid,
    plan,
    predict,
    simulate,
    sweep,
)


def job(name: str = "A", n: int = 100, epochs: int = 1, compute: float = 0.3, wait: float = 0.45,
        cached: float = 0.05, conc: float = 0.7, gpus: int = 1) -> Profile:
    return Profile(name, n, epochs, compute, wait, cached, conc, gpus)


def paper_closed_form(a: Profile, b: Profile, t_b: float) -> tuple[float, float]:
    """Eqs. (1)–(3) for the case where B catches up with A inside A's first epoch: the
    finishing times of A and B."""
    n_e = a.iterations
    t_c = t_b / (1 - (b.wait_cached + b.compute) / (a.wait + a.compute))
    n = t_c / (a.wait + a.compute)
    t_a1 = t_c + (n_e - n) * (a.wait_conc + a.compute)
    t_b1 = t_c - t_b + (n_e - n) * (b.wait_conc + b.compute)
    total_a = t_a1 + (a.epochs - 1) * n_e * (a.wait_cached + a.compute)
    total_b = t_b1 + (b.epochs - 1) * n_e * (b.wait_cached + b.compute)
    return total_a, t_b + total_b


def close(x: float, y: float) -> bool:
    return math.isclose(x, y, rel_tol=1e-9, abs_tol=1e-9)


def test_standalone_is_the_cold_epoch_then_cached_epochs() -> None:
    a = job(n=10, epochs=3, compute=1.0, wait=2.0, cached=0.5)
    assert a.standalone() == 10 * 3.0 + 2 * 10 * 1.5
    (alone,) = simulate([a], [0.0]).finishes
    assert close(alone, a.standalone())


def test_simultaneous_start_is_concurrent_remote_for_the_whole_first_epoch() -> None:
    a = job("A", epochs=2)
    b = job("B", compute=0.2, wait=0.5, cached=0.03, conc=0.8, epochs=2)
    out = predict([a, b], 0.0)
    # The slower job (A, 1.0 s a batch) finishes epoch 1 after B (1.0 s): equal here, so both
    # spend the whole first epoch in CR.
    assert out.caught_up == [0.0, 0.0]
    assert close(out.finishes[0], 100 * (0.3 + 0.7) + 100 * (0.3 + 0.05))
    assert close(out.finishes[1], 100 * (0.2 + 0.8) + 100 * (0.2 + 0.03))
    assert close(out.makespan, max(out.finishes))


@pytest.mark.parametrize("stagger", [0.05, 0.1, 0.2, 0.3, 0.4])
def test_catch_up_matches_the_papers_equations(stagger: float) -> None:
    # B's cached batch (0.23 s) is faster than A's cold one (0.75 s): B catches up. In CR both
    # take 1.0 s a batch, so they finish their first epochs together and eq. (2) holds exactly
    # (otherwise the later one reads cached after the other is done: the refinement below).
    a = job("A", compute=0.3, wait=0.45, cached=0.05, conc=0.7, epochs=2)
    b = job("B", compute=0.2, wait=0.5, cached=0.03, conc=0.8, epochs=2)
    t_b = stagger * a.standalone()
    out = predict([a, b], stagger)
    finish_a, finish_b = paper_closed_form(a, b, t_b)
    assert out.starts[1] == pytest.approx(t_b)
    t_c = t_b / (1 - 0.23 / 0.75)
    assert out.caught_up[1] == pytest.approx(t_c)
    assert close(out.finishes[0], finish_a)
    assert close(out.finishes[1], finish_b)
    states_b = [s for _, j, s in out.trace if j == 1]
    assert states_b == [CL, CR, WARM, DONE]
    assert [s for _, j, s in out.trace if j == 0] == [SR, CR, WARM, DONE]


def test_a_second_job_slower_than_the_first_never_catches_up() -> None:
    a = job("A", compute=0.1, wait=0.1, cached=0.0, conc=0.5)
    b = job("B", compute=0.5, wait=0.6, cached=0.2, conc=0.9)  # cached 0.7 s > A's cold 0.2 s
    out = predict([a, b], 0.3)
    assert out.caught_up == [None, None]
    assert close(out.finishes[0], a.standalone())  # A never meets B: alone the whole time
    assert close(out.finishes[1], out.starts[1] + 100 * 0.7)  # B reads only cached files


def test_a_stagger_past_the_first_epoch_reads_everything_cached() -> None:
    a = job("A", epochs=3)
    b = job("B", compute=0.2, epochs=1)
    t_epoch = 100 * 0.75
    out = simulate([a, b], [0.0, t_epoch * 1.5])
    assert close(out.finishes[0], a.standalone())
    assert close(out.finishes[1], t_epoch * 1.5 + 100 * (0.2 + 0.05))


def test_full_stagger_is_serial() -> None:
    a = job("A")
    b = job("B", compute=0.2, cached=0.01)
    out = predict([a, b], 1.0)
    assert close(out.starts[1], a.standalone())
    assert close(out.makespan, a.standalone() + 100 * 0.21)
    assert close(out.gpu_seconds, a.standalone() + 100 * 0.21)


def test_after_the_faster_job_finishes_epoch_one_the_other_reads_cached() -> None:
    # B faster than A in CR: it finishes its first epoch first; every file is then cached, so
    # A's rest of epoch 1 runs at the cached rate (the refinement over eq. 2).
    a = job("A", compute=0.5, wait=0.5, cached=0.0, conc=1.0)
    b = job("B", compute=0.05, wait=0.1, cached=0.0, conc=0.15)
    out = predict([a, b], 0.0)
    assert close(out.finishes[1], 100 * 0.2)
    done_a = 20.0 / (100 * 1.5)  # A's progress when B is done
    assert close(out.finishes[0], 20.0 + (1 - done_a) * 100 * 0.5)


def test_gpu_time_weights_each_job_by_its_gpus() -> None:
    a = job("A", gpus=4)
    b = job("B", gpus=2)
    out = predict([a, b], 0.5)
    expected = 4 * (out.finishes[0] - out.starts[0]) + 2 * (out.finishes[1] - out.starts[1])
    assert close(out.gpu_seconds, expected)


def test_three_jobs_run_to_the_end() -> None:
    jobs = [job("A"), job("B", compute=0.2), job("C", compute=0.25, epochs=2)]
    out = predict(jobs, 0.0)
    assert out.caught_up == [0.0, 0.0, 0.0]
    staggered = predict(jobs, 0.2)
    assert staggered.starts == pytest.approx([0, 0.2 * jobs[0].standalone(), 0.4 * jobs[0].standalone()])
    assert all(math.isfinite(f) for f in staggered.finishes)
    assert [s for _, j, s in staggered.trace if j == 2][-1] == DONE


def test_zero_waits_leave_only_compute() -> None:
    a = job("A", wait=0.0, cached=0.0, conc=0.0, compute=1.0)
    b = job("B", wait=0.0, cached=0.0, conc=0.0, compute=1.0)
    p = plan([a, b], 0.1)
    assert p.simultaneous.makespan == pytest.approx(100.0)
    assert p.optimum.stagger == 0.0  # nothing to gain: any stagger only delays B
    assert p.gpu_saved == pytest.approx(0.0)


def test_the_papers_set_2_has_an_interior_optimum() -> None:
    # Table I, set 2 (ResNet-50 then EfficientNet-B0) with cached and concurrent waits chosen
    # as in §IV: B ~3x faster on a warm cache, contention slows both.
    a = Profile("resnet50", 1560, 1, 0.3036, 0.4493, 0.05, 0.70)
    b = Profile("effnet_b0", 1560, 1, 0.2047, 0.5433, 0.03, 0.80)
    p = plan([a, b], 0.1)
    assert 0 < p.optimum.stagger < 1
    assert p.optimum.makespan < p.simultaneous.makespan
    assert p.gpu_saved > 0
    assert p.optimum.stagger == p.exhaustive.stagger


def test_binary_search_finds_the_exhaustive_optimum_within_one_step() -> None:
    rng = random.Random(15)
    for case in range(400):
        profiles = []
        for name in "AB":
            compute = rng.uniform(0.01, 1.0)
            cached = rng.uniform(0.0, 0.3)
            wait = cached + rng.uniform(0.0, 1.0)
            conc = wait + rng.uniform(0.0, 1.0)
            profiles.append(Profile(name, rng.randint(10, 2000), rng.randint(1, 4), compute,
                                    wait, cached, conc, rng.randint(1, 8)))
        step = rng.choice([0.1, 0.05, 0.01])
        table = sweep(profiles, step)
        exhaustive = best(table)
        found = binary_search(profiles, step).optimum
        within_step = abs(found.stagger - exhaustive.stagger) <= step + 1e-9
        same_makespan = math.isclose(found.makespan, exhaustive.makespan, rel_tol=1e-6)
        assert within_step or same_makespan, (case, profiles, step, found.stagger, exhaustive.stagger)
        # and it never predicts a makespan worse than one step's worth of the sweep's spread
        assert found.makespan <= exhaustive.makespan * 1.05, (case, profiles)


def test_a_tolerance_picks_the_end_of_a_flat_makespan() -> None:
    # No contention (W_conc = W): the makespan is flat while B finishes before A, then rises.
    a = job("A", compute=0.1, wait=0.03, cached=0.0, conc=0.03, epochs=2)
    b = job("B", compute=0.04, wait=0.09, cached=0.0, conc=0.09, epochs=2)
    exact = plan([a, b], 0.1)
    flat = plan([a, b], 0.1, tolerance=0.01)
    assert flat.optimum.stagger >= exact.optimum.stagger
    assert flat.optimum.makespan <= exact.optimum.makespan * 1.01
    assert flat.optimum.gpu_seconds < exact.simultaneous.gpu_seconds
    nxt = predict([a, b], flat.optimum.stagger + 0.1)
    assert nxt.makespan > exact.optimum.makespan * 1.01  # the end of the flat stretch
    assert flat.optimum.stagger == flat.exhaustive.stagger


def test_binary_search_with_a_tolerance_matches_the_sweep() -> None:
    rng = random.Random(16)
    for case in range(300):
        profiles = []
        for name in "AB":
            compute = rng.uniform(0.01, 1.0)
            cached = rng.uniform(0.0, 0.3)
            wait = cached + rng.uniform(0.0, 1.0)
            conc = wait + rng.uniform(0.0, 0.5)
            profiles.append(Profile(name, rng.randint(10, 2000), rng.randint(1, 4), compute,
                                    wait, cached, conc, rng.randint(1, 8)))
        step = rng.choice([0.1, 0.05])
        tolerance = rng.choice([0.005, 0.01, 0.05])
        exhaustive = best(sweep(profiles, step), tolerance)
        found = binary_search(profiles, step, tolerance=tolerance).optimum
        within_step = abs(found.stagger - exhaustive.stagger) <= step + 1e-9
        near = math.isclose(found.makespan, exhaustive.makespan, rel_tol=tolerance)
        assert within_step or near, (case, profiles, step, tolerance, found.stagger, exhaustive.stagger)


def test_binary_search_takes_logarithmically_many_predictions() -> None:
    profiles = [job("A"), job("B", compute=0.2, cached=0.03, conc=0.8)]
    assert binary_search(profiles, 0.01).evaluations <= 2 * math.ceil(math.log2(101)) + 1


def test_grid_and_bad_input() -> None:
    assert grid(0.1) == [round(i / 10, 12) for i in range(11)]
    assert grid(0.25) == [0.0, 0.25, 0.5, 0.75, 1.0]
    for step in (0, -0.1, 1.5, math.nan):
        with pytest.raises(UsageError):
            grid(step)
    with pytest.raises(UsageError):
        plan([job("A")], 0.1)
    with pytest.raises(UsageError):
        predict([job("A"), job("B")], -0.1)
    with pytest.raises(UsageError, match="tolerance"):
        plan([job("A"), job("B")], 0.1, tolerance=1.5)
    with pytest.raises(UsageError, match="wait"):
        job("A", wait=-1.0)
    with pytest.raises(UsageError, match="iterations"):
        job("A", n=0)
    with pytest.raises(UsageError, match="some time"):
        job("A", compute=0.0, wait=0.0, cached=0.0, conc=0.0)


def test_epoch_order_is_shared_by_seed_and_differs_by_epoch() -> None:
    assert epoch_order(50, 7, 0) == epoch_order(50, 7, 0)
    assert sorted(epoch_order(50, 7, 0)) == list(range(50))
    assert epoch_order(50, 7, 0) != epoch_order(50, 7, 1)
    assert epoch_order(50, 7, 0) != epoch_order(50, 8, 0)
