"""Cache-aware staggering: when should a second job that reads the same dataset start?

The calibrated model of Assogba, Rafique and Nicolae (HiPC'23, papers/cache-aware-staggering-
hipc23.txt §V), as a pure module (no I/O, no imports of ours above the base layer): the CLI
(``quiverfs plan stagger``, quiverfs/cli/plan_cli.py) and the benchmark (scripts/bench/stagger.py)
feed it numbers, docs/staggering.md explains it.

Each job is described by a :class:`Profile`: its mini-batches per epoch ``n`` (the paper's
N_E), epochs ``E``, compute time per mini-batch ``I`` and three I/O waits per mini-batch,
measured by a short calibration: ``W`` alone on a cold cache, ``W_cached`` alone on a warm
cache, ``W_conc`` on a cold cache while the other job runs too. The jobs read in one shared
(same-seed) order, so a job started later first reads what the earlier one has already cached.

The state machine (the paper's Fig. 5) tracks how far each job has come through its first
epoch, as a fraction of the dataset; the furthest job is the *frontier*, the end of what is
cached. A running job is in one of these states:

* ``SR`` standalone, remote: the only job at the frontier; mini-batch time ``I + W``.
* ``CR`` concurrent, remote: a later job has caught up with it (or they started together);
  both stream from the remote and compete for it, ``I + W_conc``. Sticky until the dataset is
  cached: jobs that have met stay in each other's way, as eq. (2) assumes.
* ``CL`` concurrent, local: behind the frontier, reading what is cached, ``I + W_cached``;
  when it reaches the frontier (the paper's t_C) it and the job there become ``CR``.
* ``WARM``: the dataset is fully cached (some job finished its first epoch, or this job is in
  epoch 2 or later), ``I + W_cached`` (eq. 3).

For two jobs this is eqs. (1)–(3) exactly, with one refinement: once one job has finished its
first epoch every file is cached, so the other's remaining first-epoch mini-batches are cached
reads (eq. 2 keeps charging them ``W_conc``). Both agree when the slower job is the first to
finish, and the tests check the closed form against the state machine.

A *stagger* ``s`` (a fraction, 0.4 = 40 %) starts job ``k`` at ``k × s × T₀``, where ``T₀`` is
the first job's standalone runtime (the paper: 100 % = the first job run alone, cold); with two
jobs, the second starts at ``s × T₀``. The optimum is found by the paper's binary search over a
grid of steps (:func:`binary_search`), which :func:`sweep` checks exhaustively; with a
``tolerance``, makespans that close to the optimum count as equal and the latest such stagger
wins (it frees the GPUs longest).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from quiverfs.base.errors import UsageError

#: Relative tolerance for "at the frontier" and for "equal makespan" (float noise only).
EPS = 1e-9

#: Most events one prediction may take (each job starts, meets, finishes an epoch, ends a few
#: times): a bound that only a bug could reach.
MAX_EVENTS = 10_000

#: The states of the machine (module docstring).
WAITING, SR, CR, CL, WARM, DONE = "waiting", "SR", "CR", "CL", "WARM", "done"


@dataclass(frozen=True)
class Profile:
    """One job, as the calibration measured it; times are seconds per mini-batch.

    ``iterations``: mini-batches per epoch (N_E); ``epochs``: E; ``compute``: I;
    ``wait``: W (alone, cold cache); ``wait_cached``: W_cached (alone, warm);
    ``wait_conc``: W_conc (cold, concurrent with the other job); ``gpus``: GPUs the job holds
    (weights its GPU time).
    """

    name: str
    iterations: int
    epochs: int
    compute: float
    wait: float
    wait_cached: float
    wait_conc: float
    gpus: int = 1

    def __post_init__(self) -> None:
        if self.iterations < 1 or self.epochs < 1 or self.gpus < 1:
            raise UsageError(f"job {self.name}: iterations, epochs and gpus must be at least 1")
        for what in ("compute", "wait", "wait_cached", "wait_conc"):
            value = getattr(self, what)
            if not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
                raise UsageError(f"job {self.name}: {what} must be a number of seconds >= 0, not {value!r}")
        if self.compute + min(self.wait, self.wait_cached, self.wait_conc) <= 0:
            raise UsageError(f"job {self.name}: a mini-batch must take some time (compute + wait > 0)")

    def standalone(self) -> float:
        """Seconds the job takes alone on a cold cache (the paper's 100 %)."""
        return self.iterations * ((self.compute + self.wait)
                                  + (self.epochs - 1) * (self.compute + self.wait_cached))

    def rate(self, state: str) -> float:
        """Epochs per second in ``state`` (0 when not running)."""
        wait = {SR: self.wait, CR: self.wait_conc, CL: self.wait_cached, WARM: self.wait_cached}.get(state)
        if wait is None:
            return 0.0
        return 1.0 / (self.iterations * (self.compute + wait))

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Outcome:
    """One prediction: when each job starts and finishes, the makespan and the GPU time."""

    stagger: float
    starts: list[float]
    finishes: list[float]
    #: time each job first met the frontier (the paper's t_C; None: never)
    caught_up: list[float | None]
    makespan: float
    gpu_seconds: float
    #: (time, job index, state) for each state a job entered, for explaining a prediction
    trace: list[tuple[float, int, str]] = field(default_factory=list, repr=False)


def offsets(profiles: Sequence[Profile], stagger: float) -> list[float]:
    """Start times for ``stagger`` (a fraction of the first job's standalone runtime): job k
    starts at ``k × stagger × T₀``."""
    base = profiles[0].standalone()
    return [k * stagger * base for k in range(len(profiles))]


def predict(profiles: Sequence[Profile], stagger: float) -> Outcome:
    """The model's prediction for ``profiles`` started ``stagger`` apart (module docstring)."""
    if len(profiles) < 1:
        raise UsageError("give at least one job")
    if not (math.isfinite(stagger) and stagger >= 0):
        raise UsageError(f"the stagger must be a fraction >= 0, not {stagger!r}")
    return simulate(profiles, offsets(profiles, stagger), stagger)


def simulate(profiles: Sequence[Profile], starts: Sequence[float], stagger: float = math.nan) -> Outcome:
    """Run the state machine for jobs starting at ``starts`` (seconds); see :class:`Outcome`."""
    n = len(profiles)
    pos = [0.0] * n  # epochs done (the first epoch is [0, 1))
    state = [WAITING] * n
    finish: list[float] = [math.inf] * n
    met: list[float | None] = [None] * n
    full = False  # every file cached: some job finished its first epoch
    t = 0.0
    trace: list[tuple[float, int, str]] = []

    def assign(now: float) -> None:
        """Decide every job's state at ``now`` (after the positions moved to ``now``)."""
        nonlocal full
        for j in range(n):
            if state[j] == WAITING and starts[j] <= now + EPS * max(1.0, now):
                state[j] = CL  # started; its state is decided below
            if state[j] not in (WAITING, DONE) and pos[j] >= profiles[j].epochs - EPS:
                state[j] = DONE
                finish[j] = now
                trace.append((now, j, DONE))
        full = full or any(state[j] != WAITING and pos[j] >= 1 - EPS for j in range(n))
        running = [j for j in range(n) if state[j] not in (WAITING, DONE)]
        first = [j for j in running if pos[j] < 1 - EPS]
        frontier = max((pos[j] for j in first), default=0.0)
        front = [j for j in first if pos[j] >= frontier - EPS]
        for j in running:
            if full or pos[j] >= 1 - EPS:
                new = WARM
            elif state[j] == CR:
                new = CR  # sticky: jobs that met stay in each other's way (eq. 2)
            elif j in front:
                new = CR if len(front) > 1 else SR
            else:
                new = CL
            if new == CR and met[j] is None:
                met[j] = now
            if new != state[j] or not any(e[1] == j for e in trace):
                trace.append((now, j, new))
            state[j] = new

    for _ in range(MAX_EVENTS):
        if all(s == DONE for s in state):
            break
        rates = [profiles[j].rate(state[j]) for j in range(n)]
        dt = math.inf
        for j in range(n):
            if state[j] == WAITING:
                dt = min(dt, starts[j] - t)
            elif state[j] != DONE:
                end = 1.0 if pos[j] < 1 - EPS else float(profiles[j].epochs)
                dt = min(dt, (end - pos[j]) / rates[j])
        # A CL job reaches the frontier when it has passed every streaming job.
        streaming = [k for k in range(n) if state[k] in (SR, CR) and pos[k] < 1 - EPS]
        for j in range(n):
            if state[j] != CL or not streaming:
                continue
            crossings = []
            for k in streaming:
                gap = pos[k] - pos[j]
                if gap <= EPS:
                    crossings.append(0.0)
                elif rates[j] > rates[k]:
                    crossings.append(gap / (rates[j] - rates[k]))
                else:
                    crossings.append(math.inf)
            dt = min(dt, max(crossings))
        if not math.isfinite(dt):
            raise AssertionError(f"the staggering model is stuck at t={t}: {state}")
        dt = max(dt, 0.0)
        for j in range(n):
            pos[j] += rates[j] * dt
            if state[j] == CL:
                # never past the frontier: snap float noise onto it
                front = max((pos[k] for k in streaming), default=pos[j])
                pos[j] = min(pos[j], front) if streaming else pos[j]
        t += dt
        for j in range(n):  # snap onto the epoch boundaries reached
            for edge in (1.0, float(profiles[j].epochs)):
                if abs(pos[j] - edge) <= EPS * max(1.0, edge):
                    pos[j] = edge
        assign(t)
    else:
        raise AssertionError("the staggering model took too many events")
    makespan = max(finish) - min(starts) if n else 0.0
    gpu = sum(p.gpus * (f - s) for p, f, s in zip(profiles, finish, starts, strict=True))
    return Outcome(stagger, list(starts), finish, met, makespan, gpu, trace)


# -- finding the optimum ---------------------------------------------------------------------------


def better(a: Outcome, b: Outcome) -> bool:
    """Whether ``a`` beats ``b``: a shorter makespan, or the same makespan for less GPU time (a
    later start frees the GPUs meanwhile, the paper's second goal)."""
    scale = max(a.makespan, b.makespan, 1e-12)
    if a.makespan < b.makespan - EPS * scale:
        return True
    if a.makespan > b.makespan + EPS * scale:
        return False
    return a.gpu_seconds < b.gpu_seconds - EPS * max(a.gpu_seconds, b.gpu_seconds, 1e-12)


def grid(step: float, top: float = 1.0) -> list[float]:
    """Staggers ``0, step, 2·step, …, top`` (fractions)."""
    if not (math.isfinite(step) and 0 < step <= top):
        raise UsageError(f"the step must be above 0 and at most {top:.0%}, not {step!r}")
    count = int(math.floor(top / step + 1e-9))
    return [round(i * step, 12) for i in range(count + 1)]


def sweep(profiles: Sequence[Profile], step: float = 0.1, top: float = 1.0) -> list[Outcome]:
    """The prediction at every stagger of the grid (the paper's "ideal", exhaustively)."""
    return [predict(profiles, s) for s in grid(step, top)]


def best(outcomes: Sequence[Outcome], tolerance: float = 0.0) -> Outcome:
    """The best of ``outcomes`` (in stagger order) by :func:`better`, the earliest among equals;
    with ``tolerance``, then the latest stagger after it whose makespan is within ``tolerance``
    (a fraction) of that best one, as :func:`binary_search` picks it."""
    index = 0
    for i in range(1, len(outcomes)):
        if better(outcomes[i], outcomes[index]):
            index = i
    limit = outcomes[index].makespan * (1 + tolerance)
    while tolerance > 0 and index + 1 < len(outcomes) and outcomes[index + 1].makespan <= limit:
        index += 1
    return outcomes[index]


@dataclass
class Search:
    """The binary search's answer and how many predictions it took."""

    optimum: Outcome
    evaluations: int


def binary_search(profiles: Sequence[Profile], step: float = 0.1, top: float = 1.0,
                  tolerance: float = 0.0) -> Search:
    """The paper's §V-B search: halve the grid by comparing neighbours.

    At the middle index ``m`` it predicts ``m`` and ``m + 1``; if ``m + 1`` is better the
    optimum lies to the right, else at ``m`` or to its left. The makespan falls while staggering
    trades contention for reuse and rises once the second job waits for nothing (the paper's
    Observation 3), so this finds the grid optimum in about ``2·log2(grid)`` predictions.

    ``tolerance`` (a fraction, e.g. 0.01): a makespan within it of the optimum counts as equal,
    and the latest such stagger after the optimum wins, since a later start frees the GPUs for
    longer (the paper's second goal). Where the makespan is flat, as when the jobs hardly
    contend (docs/staggering.md), this picks the end of the flat stretch instead of a point
    chosen by float noise. Right of the optimum the makespan only rises, so a second binary
    search finds that end.
    """
    points = grid(step, top)
    cache: dict[int, Outcome] = {}

    def at(i: int) -> Outcome:
        if i not in cache:
            cache[i] = predict(profiles, points[i])
        return cache[i]

    lo, hi = 0, len(points) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if better(at(mid + 1), at(mid)):
            lo = mid + 1
        else:
            hi = mid
    if tolerance > 0:
        limit = at(lo).makespan * (1 + tolerance)
        hi = len(points) - 1
        while lo < hi:  # the last index after the optimum with a makespan within the limit
            mid = (lo + hi + 1) // 2
            if at(mid).makespan <= limit:
                lo = mid
            else:
                hi = mid - 1
    return Search(at(lo), len(cache))


@dataclass
class Plan:
    """What ``quiverfs plan stagger`` prints: the sweep, the optimum, and what it saves."""

    profiles: list[Profile]
    step: float
    tolerance: float
    table: list[Outcome]
    optimum: Outcome
    exhaustive: Outcome
    simultaneous: Outcome
    evaluations: int

    @property
    def gpu_saved(self) -> float:
        """GPU-seconds the optimum saves against starting every job at once."""
        return self.simultaneous.gpu_seconds - self.optimum.gpu_seconds

    @property
    def makespan_ratio(self) -> float:
        """Makespan at the optimum ÷ makespan of a simultaneous start."""
        return self.optimum.makespan / self.simultaneous.makespan if self.simultaneous.makespan else 1.0

    def to_dict(self) -> dict:
        """The ``--json`` form (seconds; staggers as fractions and percentages)."""

        def row(o: Outcome) -> dict:
            return {"stagger": o.stagger, "stagger_percent": round(o.stagger * 100, 6),
                    "starts": o.starts, "finishes": o.finishes, "caught_up": o.caught_up,
                    "makespan": o.makespan, "gpu_seconds": o.gpu_seconds}

        return {
            "jobs": [p.to_dict() for p in self.profiles],
            "first_job_standalone": self.profiles[0].standalone(),
            "step": self.step,
            "tolerance": self.tolerance,
            "table": [row(o) for o in self.table],
            "optimum": row(self.optimum),
            "exhaustive_optimum": row(self.exhaustive),
            "simultaneous": row(self.simultaneous),
            "binary_search_predictions": self.evaluations,
            "gpu_seconds_saved": self.gpu_saved,
            "makespan_ratio": self.makespan_ratio,
        }


def plan(profiles: Sequence[Profile], step: float = 0.1, top: float = 1.0,
         tolerance: float = 0.0) -> Plan:
    """Sweep, search and compare with a simultaneous start (``tolerance``: see
    :func:`binary_search`)."""
    if len(profiles) < 2:
        raise UsageError("staggering needs at least two jobs")
    if not (math.isfinite(tolerance) and 0 <= tolerance < 1):
        raise UsageError(f"the tolerance must be a fraction from 0 to below 100%, not {tolerance!r}")
    table = sweep(profiles, step, top)
    search = binary_search(profiles, step, top, tolerance)
    return Plan(list(profiles), step, tolerance, table, search.optimum, best(table, tolerance),
                table[0], search.evaluations)


# -- the shared order ------------------------------------------------------------------------------


def epoch_order(count: int, seed: int, epoch: int) -> list[int]:
    """Indices ``0..count-1`` in the order every job with this ``seed`` reads ``epoch``.

    The paper's premise (§IV): jobs that share a seed visit the files in one order, so a later job
    reads what an earlier one cached. The shim's shared order and its off-mount fallback
    (quiverfs/client/torch.py) and the calibration reader (quiverfs/plan/calibrate.py) all use this
    one function, so they agree with each other.
    """
    order = list(range(count))
    random.Random(f"{seed}:{epoch}").shuffle(order)
    return order
