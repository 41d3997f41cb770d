"""Job sessions: the validated request surface of substitutable, co-operative reads.

:class:`SessionRegistry` is what mountd's RPC handlers (and, through them, the mount's xattr
control channel and the PyTorch sampler) call. It owns the datasets' cache views
(:class:`mountd.coop.dataset_state.DatasetState`), the jobs' epoch pools
(:class:`mountd.coop.claims.EpochPool`) and their timing reports, and returns chunk decisions
from :meth:`SessionRegistry.tick`.

A session is keyed by ``(dataset, job, rank)`` — never by pid: DataLoader worker processes and
the main process of one rank share it, and :meth:`~SessionRegistry.open_session` with the same
parameters is idempotent. All ranks of a job share the job's epoch pool, so each file goes to
one claim of the job per epoch. Ranks may straddle an epoch boundary (one rank's workers start
epoch ``e+1`` while another finishes ``e``): a job keeps at most :data:`LIVE_EPOCHS` pools.

Every request is validated before anything changes; a bad one raises a :class:`SessionError`
subclass whose class attribute ``errno`` is the code for the control channel (a class
attribute, so it survives :func:`mountd.rpc.protocol.exception_from_payload`), and leaves every
session as it was. All methods run in mountd's trio thread: each call is atomic.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any

from mountd.coop.benefit import (
    PROBE_PERIOD,
    REALLOCATE_INTERVAL,
    Allocation,
    DatasetDemand,
    JobBenefit,
    allocate,
    allocate_in_order,
    benefit_moved,
    could_be_full,
)
from mountd.coop.chunks import DEFAULT_GRACE, Action, Evict
from mountd.coop.claims import Claim, EpochPool
from mountd.coop.dataset_state import DatasetState, protection_owner
from mountd.coop.jobs import Job, Session, SessionInfo, session_rng
from mountd.coop.packing import Packing
from mountd.coop.plans import MIN_FRACTION, Mode
from mountd.coop.registrations import ModeChange, Registration, too_few_to_chunk
from mountd.coop.requests import (
    LIVE_EPOCHS,
    MAX_CLAIM,
    MAX_EPOCH,
    MAX_LOOKAHEAD,
    MAX_WORLD,
    check_ids,
    check_int,
    check_mode,
    check_name,
    check_seconds,
    check_sizes,
    scope_mask,
)
from mountd.coop.timings import JobTimings, TimingSummary
from mountd.errors import (
    InvalidRequest,
    SessionConflict,
    SessionError,
    StaleEpoch,
    TooManyJobs,
    UnknownDataset,
    UnknownSession,
)

__all__ = [
    "LIVE_EPOCHS",
    "MAX_CLAIM",
    "InvalidRequest",
    "SessionConflict",
    "SessionError",
    "SessionInfo",
    "SessionRegistry",
    "StaleEpoch",
    "TimingSummary",
    "TooManyJobs",
    "UnknownDataset",
    "UnknownSession",
]

# -- sessions ------------------------------------------------------------------------------------

log = logging.getLogger(__name__)


def _ahead_moved(before: int | None, now: int | None) -> bool:
    """Whether a job's look-ahead (:attr:`JobTimings.ahead_files`) became known or grew by
    half since it was last seen: its dataset's allocation may then change."""
    return now is not None and (before is None or now > 1.5 * before)


class SessionRegistry:
    """Datasets, job sessions, claims, timing reports and chunk decisions of one mountd.

    ``clock`` (seconds, monotonic) is injectable for tests. ``flight_ttl``: seconds after which
    a miss handed out by a claim and never reported cached or failed is presumed lost.
    ``evict_timeout``: seconds after the first job finished a marked chunk before it is
    evicted anyway. ``ring``: mini-batch times kept per job. ``history``: jobs whose timings
    are kept after their last session closed. ``chunk_slots``: chunks of a chunked dataset's
    budget (2: double buffering; 3: also preload the next while the marked one drains).
    ``chunk_grace``: seconds a marked chunk stays after the last job finished it (its last
    given files may still be unread; :class:`mountd.coop.chunks.ChunkManager`'s ``grace``).
    ``max_jobs``: open jobs at once, all datasets together (bounds memory against a client
    opening sessions in a loop). ``idle_timeout``: a job none of whose ranks made a request
    for that long is closed by :meth:`tick` (a job that died without closing would otherwise
    hold its chunk for ever when no other job finishes it); None never.
    """

    def __init__(
        self,
        *,
        clock: Callable[[], float] = time.monotonic,
        flight_ttl: float = 120.0,
        evict_timeout: float = 600.0,
        ring: int = 256,
        history: int = 1024,
        max_claim: int = MAX_CLAIM,
        chunk_slots: int = 2,
        chunk_grace: float = DEFAULT_GRACE,
        max_jobs: int = 256,
        idle_timeout: float | None = 3600.0,
        protect_room: Callable[[], int] | None = None,
        protect_pending: Callable[[Hashable], int] | None = None,
        reports_opens: Callable[[str], bool] | None = None,
    ) -> None:
        if chunk_slots not in (2, 3):
            raise ValueError("chunk_slots must be 2 or 3")
        if not chunk_grace >= 0:  # also refuses NaN
            raise ValueError("chunk_grace must be >= 0")
        self.chunk_slots = chunk_slots
        self.chunk_grace = chunk_grace
        self.max_jobs = max_jobs
        self.idle_timeout = idle_timeout
        self.clock = clock
        self.flight_ttl = flight_ttl
        self.evict_timeout = evict_timeout
        self.ring = ring
        self.history = history
        self.max_claim = max_claim
        #: Bytes the cache's protection share has left (mountd/store/holds.py), None: no
        #: bound; packed claims bring only as many members as fit (set by the service).
        self.protect_room = protect_room
        #: Files fetched ahead for an owner ``(dataset, job, epoch)`` and not read yet (the
        #: cache's :meth:`~mountd.store.protection.Protection.protect_pending`; set by the
        #: service), None: unknown: claims then bound misses by the room alone.
        self.protect_pending = protect_pending
        #: Whether a dataset's mounts report their readers' opens (the cache's
        #: :meth:`~mountd.store.protection.Protection.reports_opens`; set by the service),
        #: None: never: a finished chunk's grace then ends by the window, not by opens.
        self.reports_opens = reports_opens
        #: Cache bytes that a dataset's pins and the room its job's look-ahead needs share,
        #: and the share of the unpinned room that protections may take (set by the
        #: service from the cache's config); None: the look-ahead is not weighed.
        self.cache_bytes: int | None = None
        self.protect_share = 0.5
        self._datasets: dict[str, DatasetState] = {}
        self._modes: dict[str, Mode] = {}
        self._jobs: dict[tuple[str, str], Job] = {}
        self._timings: OrderedDict[tuple[str, str], JobTimings] = OrderedDict()
        self._registrations: dict[str, Registration] = {}
        #: Benefit-aware allocation (Quiver §5.3): probe jobs and let :meth:`allocate` choose
        #: the modes of datasets registered without one. Off: modes come from one budget
        #: shared in registration order (:func:`mountd.coop.benefit.allocate_in_order`).
        self.benefit_aware = False
        self.probe_period = PROBE_PERIOD
        self.reallocate_interval = REALLOCATE_INTERVAL
        self._allocation: dict[str, Allocation] = {}
        self._allocate_due = True  # a job arrived or left, or a probe ended
        #: Datasets whose cold-measured jobs are probed at once: a larger ``b`` could make
        #: them ``full`` (mountd.coop.benefit.could_be_full, as of the last allocation).
        self._probe_early: set[str] = set()
        self._allocated_at: float | None = None

    # -- datasets ------------------------------------------------------------------------------

    def add_dataset(
        self,
        dataset: str,
        sizes: Sequence[int],
        *,
        budget: int | None = None,
        mode: Mode | str | None = None,
        fraction: float = 0.1,
        max_chunk_bytes: int | None = None,
        cached: Iterable[int] = (),
        seed: int = 0,
        packing: Packing | None = None,
    ) -> Mode:
        """Register ``dataset`` (``sizes[i]`` = bytes of compact id ``i``); returns its mode.

        ``mode`` None picks the mode from ``budget`` (required then; also required for
        ``chunked``): ``budget`` is the whole cache budget, and the dataset gets what the
        datasets registered before it leave of it (:meth:`_share`: full if it fits, else two
        chunks if they can still be ``MIN_FRACTION`` of it, else off; a manual ``chunked``
        gets chunks of what is left, or ``off`` when none fit). ``cached`` are the ids in the
        cache now. Registering the same dataset again with the same file count is a no-op.

        ``packing``: the packed chunks of a packed dataset (None: loose). Its chunks are
        then unions of whole packed chunks (:func:`~mountd.coop.plans.plan_packed_chunks`)
        and its claims follow Brand's policy (docs/substitutable-reads.md "Packed datasets").
        """
        check_name("dataset", dataset)
        check_sizes(sizes)
        if budget is not None:
            check_int("budget", budget, 0, 1 << 62)
        if type(fraction) not in (int, float) or not 0 < fraction <= 1:
            raise InvalidRequest("fraction must be a number in (0, 1]")
        if max_chunk_bytes is not None:
            check_int("max_chunk_bytes", max_chunk_bytes, 1, 1 << 62)
        check_int("seed", seed, 0, (1 << 64) - 1)
        if packing is not None and len(packing.chunk_of) != len(sizes):
            raise InvalidRequest("the packing must cover every file of the dataset")
        chosen = check_mode(mode) if mode is not None else None
        if (chosen is None or chosen is Mode.CHUNKED) and budget is None:
            raise InvalidRequest("a budget is needed to choose a mode or plan chunks")
        nothing_to_chunk = too_few_to_chunk(len(sizes), packing)
        if chosen is Mode.CHUNKED and nothing_to_chunk:
            chosen = Mode.FULL
        existing = self._datasets.get(dataset)
        if existing is not None:
            if existing.count != len(sizes):
                raise SessionConflict(f"dataset {dataset} is registered with another file count")
            return self._modes[dataset]
        registration = Registration(sizes, sum(sizes), fraction, max_chunk_bytes, seed, packing,
                                     fixed=mode is not None, budget=budget, asked=chosen)
        if chosen is None or chosen is Mode.CHUNKED:
            assert budget is not None
            chosen, budget = self._share(dataset, registration, budget)
            registration.budget = budget
            if chosen is Mode.CHUNKED and nothing_to_chunk:
                chosen = Mode.FULL
        chosen, plan = registration.plan(dataset, chosen, budget, self.chunk_slots)
        state = DatasetState(
            dataset,
            plan,
            manager_options={
                "evict_timeout": self.evict_timeout,
                "grace": self.chunk_grace,
                "seed": seed,
                "slots": self.chunk_slots,
            },
            flight_ttl=self.flight_ttl,
            packing=packing,
            # lru is the comparison baseline: the cache's own policy alone decides.
            reserve=chosen is not Mode.LRU,
            protect_room=self.protect_room,
            protect_pending=self.protect_pending,
            reports_opens=self.reports_opens,
            mean_size=sum(sizes) // len(sizes),
        )
        cached_ids = check_ids(state, cached)
        state.mark_cached(cached_ids)
        self._datasets[dataset] = state
        self._modes[dataset] = chosen
        self._registrations[dataset] = registration
        self._allocate_due = True
        return chosen

    def _share(self, dataset: str, reg: Registration, budget: int) -> tuple[Mode, int]:
        """The mode and budget of a dataset being registered: what the registered datasets
        leave of ``budget`` (:func:`mountd.coop.benefit.allocate_in_order` with it last), so
        that datasets registered one after the other never hold more than ``budget`` together
        (each sized against the whole budget, three datasets each fitting two chunks pinned
        more than the cache: ``CacheFull``). The benefit-aware allocation that follows may
        move it (it runs at the next tick, before any chunk preloads)."""
        left = max(0, budget - sum(r.charge(self._modes[name], self.chunk_slots)
                                   for name, r in self._registrations.items()))
        demand = DatasetDemand(dataset, reg.total, reg.chunk_bytes(), int(MIN_FRACTION * reg.total),
                               fixed=reg.asked)
        decision = allocate_in_order([demand], left, slots=self.chunk_slots)[dataset]
        return decision.mode, decision.budget

    def remove_dataset(self, dataset: str) -> None:
        """Forget ``dataset``; :class:`SessionConflict` while sessions are open on it."""
        self._dataset(dataset)
        if any(key[0] == dataset for key in self._jobs):
            raise SessionConflict(f"dataset {dataset} has open sessions")
        del self._datasets[dataset]
        del self._modes[dataset]
        del self._registrations[dataset]
        self._allocation.pop(dataset, None)
        self._probe_early.discard(dataset)
        self._allocate_due = True

    def dataset(self, dataset: str) -> DatasetState:
        """The dataset's state (read-only use: plan, manager, cached bitmap)."""
        return self._dataset(dataset)

    def mode(self, dataset: str) -> Mode:
        """The mode ``dataset`` was registered with."""
        self._dataset(dataset)
        return self._modes[dataset]

    def retain_bytes(self, dataset: str) -> int:
        """Bytes of ``dataset``'s files the allocation keeps cached across epochs beyond its
        chunks (:attr:`mountd.coop.benefit.Allocation.retain`; 0 unless ``chunked``)."""
        decision = self._allocation.get(dataset)
        if decision is None or self._modes.get(dataset) is not Mode.CHUNKED:
            return 0
        return decision.retain

    # -- benefit-aware allocation (Quiver §5.3, mountd.coop.benefit) ----------------------------

    def set_mode(self, dataset: str, mode: Mode | str, budget: int) -> ModeChange | None:
        """Plan ``dataset`` again in ``mode`` within ``budget`` bytes; None when nothing changed.

        Safe under load (:meth:`mountd.coop.dataset_state.DatasetState.replan`): what every job was
        given stays given, claims in flight stay in flight, reservations stay; the chunks the
        old mode held come back in :attr:`ModeChange.released` for the caller to unpin. The
        dataset's jobs skip their next reports (:meth:`JobTimings.settle`): they measure the
        change, not the new mode.
        """
        state = self._dataset(dataset)
        check_int("budget", budget, 0, 1 << 62)
        chosen = check_mode(mode)
        reg = self._registrations[dataset]
        if chosen is Mode.CHUNKED and too_few_to_chunk(state.count, reg.packing):
            chosen = Mode.FULL
        old = self._modes[dataset]
        if chosen is old and (chosen is not Mode.CHUNKED or reg.budget == budget):
            return None
        chosen, plan = reg.plan(dataset, chosen, budget, self.chunk_slots)
        if chosen is old and old is not Mode.CHUNKED:
            return None
        released = state.replan(plan)
        self._modes[dataset] = chosen
        reg.budget = budget
        for key in self._jobs:
            if key[0] == dataset:
                self._timings_of(key, touch=False).settle()
        log.debug("dataset %s: mode %s -> %s (%d bytes)", dataset, old, chosen, budget)
        return ModeChange(dataset, old, chosen, budget, tuple(released))

    def demands(self) -> list[DatasetDemand]:
        """Every dataset as :func:`mountd.coop.benefit.allocate` sees it: sizes, its open
        jobs' measured times, and its manual mode if it was registered with one."""
        jobs: dict[str, list[JobBenefit]] = {name: [] for name in self._datasets}
        ahead: dict[str, list[int | None]] = {name: [] for name in self._datasets}
        for dataset, job in self._jobs:
            timings = self._timings_of((dataset, job), touch=False)
            jobs[dataset].append(timings.benefit(job))
            ahead[dataset].append(timings.ahead_files)
        return [reg.demand(name, self._modes[name], jobs[name], self._max_pinned(reg, ahead[name]))
                for name, reg in self._registrations.items()]  # registration order

    def _max_pinned(self, reg: Registration, ahead: list[int | None]) -> int | None:
        """The most bytes a dataset read by one job may pin so that the files the job holds
        ahead of its training step (``ahead``: one entry per job) still fit the protection
        room the pins leave; None: no bound (several jobs, or the look-ahead not known).

        Why (issue 37, ``peers.py`` (b), 2026-12-01): a DataLoader holds ``num_workers x
        prefetch_factor`` batches ahead, 512 files with 4 workers and batches of 64. Chunks
        pinning 80% of a 20% cache left protection room for ~40 of them: the claims' other
        misses were read on demand, one bucket latency each, and the job trained at 140-293
        img/s where the same job with its dataset ``off`` made 291-376. Jobs that share a
        dataset keep their chunks whatever their look-ahead: reading each chunk once for
        all of them is what keeps their traffic near one dataset an epoch
        (``scripts/bench/shim_vs_lru.py``)."""
        if self.cache_bytes is None or len(ahead) != 1 or ahead[0] is None or not reg.sizes:
            return None
        ahead_bytes = ahead[0] * reg.total / len(reg.sizes)
        return max(0, int(self.cache_bytes - ahead_bytes / max(self.protect_share, 1e-9)))

    @property
    def watches_the_store(self) -> bool:
        """Whether a change of the store (a fill landed, files left) may give a tick work at
        once: a job is open, or a dataset has chunks to manage. Otherwise the change is only
        recorded (which files are cached), and the periodic tick is soon enough. A tick every
        few fills cost a plain mount's shuffled cold pass ~6% of mountd's CPU (372 against
        349 µs a fill, three alternated runs of 10,000 files, 2026-11-30)."""
        return bool(self._jobs) or any(state.manager is not None
                                       for state in self._datasets.values())

    def allocation_due(self, now: float | None = None) -> bool:
        """Whether :meth:`allocate` should run: a job arrived or left, a probe ended, a
        dataset came or went, or :attr:`reallocate_interval` passed. Without
        :attr:`benefit_aware` only a dataset that came or went matters (and the first time):
        the shared budget is then dealt again, so one that left frees its share."""
        if not self.benefit_aware:
            return self._allocate_due or self._allocated_at is None
        now = self.clock() if now is None else now
        return (self._allocate_due or self._allocated_at is None
                or now - self._allocated_at >= self.reallocate_interval)

    def allocate(self, budget: int, now: float | None = None) -> list[ModeChange]:
        """Choose every dataset's mode and apply the changes (:meth:`set_mode`).

        :attr:`benefit_aware`: by benefit (:func:`mountd.coop.benefit.allocate`); datasets
        with a manual mode keep it. Otherwise (budget-only, or manual modes): one budget dealt
        in registration order (:func:`mountd.coop.benefit.allocate_in_order`), which sizes
        manual ``chunked`` datasets too (or turns them ``off`` when no chunk fits)."""
        self._allocate_due = False
        self._allocated_at = self.clock() if now is None else now
        if self.benefit_aware:
            held = {name: self._allocation[name].budget for name, mode in self._modes.items()
                    if mode.holds_cache and name in self._allocation}
            holding = sorted(held, key=lambda name: (-held[name], name))
            resting = {name for name, a in self._allocation.items() if a.insensitive}
            demands = self.demands()
            decided = allocate(demands, budget, slots=self.chunk_slots, holding=holding,
                               resting=resting)
            self._probe_early = could_be_full(demands, decided, budget, slots=self.chunk_slots,
                                              holding=holding, resting=resting)
        else:
            decided = allocate_in_order(self.demands(), budget, slots=self.chunk_slots)
        for key in self._jobs:
            timings = self._timings_of(key, touch=False)
            timings.allocated_b = timings.benefit(key[1]).b
        changes = []
        for name, decision in decided.items():
            if not self.benefit_aware or not self._registrations[name].fixed:
                change = self.set_mode(name, decision.mode, decision.budget)
                if change is not None:
                    changes.append(change)
                if self._modes[name] is not decision.mode:  # e.g. packed chunks too large
                    decision = Allocation(name, self._modes[name], 0, decision.benefit,
                                          f"{decision.reason}; its packed chunks are too large: off")
            self._allocation[name] = decision
        return changes

    def allocation(self) -> dict[str, Allocation]:
        """The last allocation per dataset (empty before the first)."""
        return dict(self._allocation)

    def benefits(self, dataset: str) -> list[tuple[JobBenefit, int]]:
        """Measured times of ``dataset``'s open jobs, with each job's probe count."""
        self._dataset(dataset)
        out = []
        for (name, job), _entry in sorted(self._jobs.items()):
            if name == dataset:
                timings = self._timings_of((name, job), touch=False)
                out.append((timings.benefit(job), timings.probes))
        return out

    def _dataset(self, dataset: Any) -> DatasetState:
        check_name("dataset", dataset)
        try:
            return self._datasets[dataset]
        except KeyError:
            raise UnknownDataset(f"dataset {dataset} is not registered") from None

    # -- cache notifications -------------------------------------------------------------------

    def on_cached(self, dataset: str, ids: Iterable[int]) -> int:
        """Files of ``dataset`` were filled; returns how many were new."""
        state = self._dataset(dataset)
        return len(state.mark_cached(check_ids(state, ids)))

    def on_evicted(self, dataset: str, ids: Iterable[int]) -> int:
        """Files of ``dataset`` left the cache; returns how many were cached."""
        state = self._dataset(dataset)
        return len(state.mark_evicted(check_ids(state, ids)))

    def on_fetch_failed(self, dataset: str, ids: Iterable[int]) -> None:
        """Fetches (claimed misses or preloads) of ``ids`` failed for good."""
        state = self._dataset(dataset)
        state.fetch_failed(check_ids(state, ids))

    def next_preload(self, dataset: str, limit: int) -> list[int]:
        """Up to ``limit`` files of ``dataset``'s loading chunk to preload next (pull model,
        :meth:`mountd.coop.chunks.ChunkManager.next_preload`); empty unless a chunk is loading."""
        state = self._dataset(dataset)
        check_int("limit", limit, 1, 1 << 24)
        return [] if state.manager is None else state.manager.next_preload(limit)

    def tick(self, now: float | None = None) -> list[Action]:
        """Chunk decisions of every chunked dataset (:meth:`mountd.coop.chunks.ChunkManager.tick`).

        Call it after claims and notifications and at least every few seconds (forced
        eviction is time based); perform the actions in order. It first closes jobs idle for
        ``idle_timeout``.
        """
        now = self.clock() if now is None else now
        if self.idle_timeout is not None:
            for key, entry in list(self._jobs.items()):
                if now - entry.seen >= self.idle_timeout:
                    self._close_job(key, entry)
        actions: list[Action] = []
        for state in self._datasets.values():
            if state.manager is not None:
                for action in state.manager.tick(now):
                    if isinstance(action, Evict) and state.reserved:
                        # Co-ordinated eviction ends the reservations of the chunk's files.
                        state.drop_reservations(action.members)
                    actions.append(action)
        return actions

    def take_closed(self, dataset: str) -> list[tuple[str, str, int]]:
        """``(dataset, job, epoch)`` of ``dataset``'s epoch pools closed since the last call
        (sessions closed, the epoch moved on, the job was reaped as idle): the caller
        releases what the cache protects for them (the owner keys of
        :meth:`mountd.store.cache.Cache.fetch_now`)."""
        return [protection_owner(dataset, job, epoch)
                for job, epoch in self._dataset(dataset).take_closed()]

    def next_deadline(self) -> float | None:
        """The earliest clock (``self.clock``) at which a chunk's grace ends, if any: the
        caller ticks then rather than up to its tick interval later."""
        ends = [
            end
            for state in self._datasets.values()
            if state.manager is not None
            and (end := state.manager.grace_deadline()) is not None
        ]
        return min(ends, default=None)

    # -- sessions ------------------------------------------------------------------------------

    def open_session(
        self,
        dataset: str,
        job: str,
        *,
        rank: int = 0,
        world_size: int = 1,
        epoch: int = 0,
        seed: int = 0,
        lookahead: int = 10,
        scope: Sequence[Sequence[int]] | None = None,
    ) -> SessionInfo:
        """Open (or re-open, idempotently) the session of ``job``'s ``rank`` on ``dataset``.

        ``scope`` (``[[start, stop], ...]`` id ranges) limits the job to those files, e.g. an
        ImageFolder over one sub-directory; it is the job's, set by its first session, and a
        later session giving another scope is :class:`SessionConflict`.

        Re-opening with another seed or look-ahead is :class:`SessionConflict`; with a later
        epoch it moves the rank there (like :meth:`next_epoch`); with an earlier one it
        returns the session as it is (a DataLoader worker may only know the epoch it was
        started with): the returned :class:`SessionInfo` says the epoch. A *new* rank session
        on an epoch that is over is :class:`StaleEpoch`. All ranks of a job must agree on
        ``world_size``.
        """
        state = self._dataset(dataset)
        check_name("job", job)
        check_int("world_size", world_size, 1, MAX_WORLD)
        check_int("rank", rank, 0, world_size - 1)
        check_int("epoch", epoch, 0, MAX_EPOCH)
        check_int("seed", seed, 0, (1 << 64) - 1)
        check_int("lookahead", lookahead, 1, MAX_LOOKAHEAD)
        mask = None if scope is None else scope_mask(state, scope)
        key = (dataset, job)
        entry = self._jobs.get(key)
        if entry is not None and entry.world_size != world_size:
            raise SessionConflict(f"job {job} has world size {entry.world_size}, not {world_size}")
        if entry is not None and mask is not None and entry.scope != mask:
            raise SessionConflict(f"job {job} was opened with another scope")
        session = entry.sessions.get(rank) if entry is not None else None
        if session is not None and (session.seed, session.lookahead) != (seed, lookahead):
            raise SessionConflict(f"rank {rank} of job {job} is open with other parameters")
        if session is not None:
            epoch = max(epoch, session.epoch)
        if entry is not None:
            entry.check_epoch(session.epoch if session else None, epoch)
        elif len(self._jobs) >= self.max_jobs:
            raise TooManyJobs(f"{len(self._jobs)} jobs are open already; close some first")
        if entry is None:
            entry = self._jobs[key] = Job(dataset, job, world_size, mask)
            self._timings_of(key).world_size = world_size
            self._allocate_due = True
        if session is None:
            session = Session(rank, seed, lookahead, epoch, session_rng(seed, job, epoch, rank))
            entry.sessions[rank] = session
        entry.move(session, epoch, state)
        entry.seen = self.clock()
        return self._info(entry, session)

    def close_session(
        self, dataset: str, job: str, rank: int, *, seconds: float | None = None
    ) -> None:
        """Close a rank's session (``seconds``: its run time, kept with the timings). The job's
        pools go when its last rank closes, releasing its chunk references."""
        entry, session = self._session(dataset, job, rank)
        if seconds is not None:
            check_seconds("seconds", seconds)
        del entry.sessions[rank]
        timings = self._timings_of((dataset, job))
        timings.closed += 1
        if seconds is not None:
            timings.session_seconds.append(float(seconds))
        entry.drop_unused_pools()
        if not entry.sessions:
            del self._jobs[(dataset, job)]
            timings.probe = None
            self._allocate_due = True

    def _close_job(self, key: tuple[str, str], entry: Job) -> None:
        """Close every session of an idle job (its timings stay)."""
        timings = self._timings_of(key)
        timings.closed += len(entry.sessions)
        timings.probe = None
        entry.sessions.clear()
        entry.drop_unused_pools()
        del self._jobs[key]
        self._allocate_due = True

    def next_epoch(
        self, dataset: str, job: str, rank: int, epoch: int | None = None
    ) -> SessionInfo:
        """Move ``rank`` to ``epoch`` (default: its epoch + 1), which must not be behind."""
        entry, session = self._session(dataset, job, rank)
        target = session.epoch + 1 if epoch is None else epoch
        check_int("epoch", target, 0, MAX_EPOCH)
        entry.check_epoch(session.epoch, target)
        entry.move(session, target, self._datasets[dataset])
        entry.seen = self.clock()
        return self._info(entry, session)

    def claim(
        self, dataset: str, job: str, rank: int, n: int, *, epoch: int | None = None,
        batch: int | None = None,
    ) -> Claim:
        """Up to ``n`` files for ``rank``: cached unread ones first, then misses to fetch now.

        ``epoch`` None means the rank's current epoch; a later one moves the rank there first.
        An empty claim means the rank's part of the epoch is given out (``end_of_epoch``),
        unless it says ``wait`` (``batch``, the rank's batch size, given: the cache has no
        room for more misses yet; :meth:`mountd.coop.claims.EpochPool.claim`).
        """
        entry, session = self._session(dataset, job, rank)
        check_int("n", n, 1, self.max_claim)
        if batch is not None:
            check_int("batch", batch, 1, self.max_claim)
        target = session.epoch if epoch is None else check_int("epoch", epoch, 0, MAX_EPOCH)
        entry.check_epoch(session.epoch, target)
        entry.move(session, target, self._datasets[dataset])
        pool = entry.pools[session.epoch]
        entry.seen = now = self.clock()
        timings = self._timings_of((dataset, job))
        if self.benefit_aware and self._probe_may_start(entry, timings, now):
            timings.start_probe(now)
            log.info("dataset %s: probing job %s (claims give uncached files only)", dataset, job)
        claim = None
        if timings.probe is not None:
            claim = pool.claim_uncached(rank, n, session.rng, now)
            if claim is None and pool.dataset.cached_total >= pool.dataset.count:
                timings.cannot_probe(now)
                log.info("dataset %s: job %s cannot be probed (every file cached): t_miss %s "
                         "from its cold start", dataset, job, timings.t_miss)
                self._allocate_due = True
        if claim is None:
            claim = pool.claim(rank, n, session.rng, session.lookahead, now, batch)
        timings.on_claim(len(claim.hits), len(claim.fetch))
        return claim

    def _probe_may_start(self, entry: Job, timings: JobTimings, now: float) -> bool:
        """A probe starts when the job is due (:meth:`JobTimings.probe_due`, or
        :meth:`JobTimings.early_probe_due` when a larger ``b`` could make its dataset
        ``full``), its dataset's mode is the allocator's, and no other job of the dataset is
        being probed (one slowed job at a time)."""
        if self._registrations[entry.dataset].fixed:
            return False
        if not timings.probe_due(now, self.probe_period) and not (
                entry.dataset in self._probe_early and timings.early_probe_due()):
            return False
        return not any(
            key[0] == entry.dataset and (t := self._timings.get(key)) is not None and t.probe is not None
            for key in self._jobs
        )

    def session_info(self, dataset: str, job: str, rank: int) -> SessionInfo:
        """The open session of ``job``'s ``rank``."""
        entry, session = self._session(dataset, job, rank)
        return self._info(entry, session)

    def sessions(self) -> list[SessionInfo]:
        """Every open session."""
        return [
            self._info(entry, session)
            for entry in self._jobs.values()
            for session in entry.sessions.values()
        ]

    def positions(self, dataset: str) -> dict[str, float]:
        """Each open job's position in ``dataset``: its newest epoch plus the share of it
        given so far (:attr:`EpochPool.position`); jobs with no epoch open are left out."""
        self._dataset(dataset)
        return {job: max(pool.position for pool in entry.pools.values())
                for (name, job), entry in sorted(self._jobs.items())
                if name == dataset and entry.pools}

    def pool(self, dataset: str, job: str, epoch: int) -> EpochPool | None:
        """The job's pool for ``epoch`` if live (for tests and stats)."""
        self._dataset(dataset)
        entry = self._jobs.get((dataset, job))
        return entry.pools.get(epoch) if entry is not None else None

    # -- timing reports ------------------------------------------------------------------------

    def report_batch(self, dataset: str, job: str, rank: int, seconds: float,
                     files: int | None = None, misses: int | None = None) -> None:
        """One mini-batch took ``seconds`` (data wait + compute, as the shim measures it).

        ``files`` and ``misses`` (optional, together): how many files the batch read and how
        many of them its claim gave as ``fetch`` (uncached). With them the report is
        classified exactly as a hit or miss sample (:meth:`JobTimings.on_batch`); without
        them, by the job's last claims.
        """
        entry, _ = self._session(dataset, job, rank)
        value = check_seconds("seconds", seconds)
        if (files is None) != (misses is None):
            raise InvalidRequest("files and misses go together")
        if files is not None:
            check_int("files", files, 0, MAX_CLAIM)
            check_int("misses", misses, 0, files)
        entry.seen = now = self.clock()
        timings = self._timings_of((dataset, job))
        timings.batches += 1
        timings.recent.append(value)
        mode = self._modes[dataset]
        ahead = timings.ahead_files
        if timings.on_batch(value, now, None if files is None else (files, misses),
                            cached=mode.holds_cache, off=mode is Mode.OFF):
            log.info("dataset %s: job %s measured: t_hit %s, t_miss %s", dataset, job,
                     timings.t_hit, timings.t_miss)
        if self.benefit_aware and self.cache_bytes is not None \
                and _ahead_moved(ahead, timings.ahead_files):
            self._allocate_due = True  # known now, or half as large again: may change the pins
        if self.benefit_aware and benefit_moved(timings.allocated_b, timings.benefit(job).b):
            # its first b, or one that moved since the last allocation: allocate now, not at
            # the next interval (an early b from a few noisy samples must not stick for 30 s)
            self._allocate_due = True
        if timings.finish_probe(now):
            benefit = timings.benefit(job)
            log.info("dataset %s: job %s probed: t_hit %s, t_miss %s, b %s", dataset, job,
                     benefit.t_hit, benefit.t_miss, benefit.b)
            self._allocate_due = True

    def report_epoch(self, dataset: str, job: str, rank: int, epoch: int, seconds: float) -> None:
        """``rank`` finished ``epoch`` in ``seconds``."""
        entry, _ = self._session(dataset, job, rank)
        check_int("epoch", epoch, 0, MAX_EPOCH)
        value = check_seconds("seconds", seconds)
        entry.seen = self.clock()
        self._timings_of((dataset, job)).epochs.append((epoch, rank, value))

    def timings(self, dataset: str, job: str) -> TimingSummary:
        """What ``job`` reported (also for a while after it closed)."""
        check_name("dataset", dataset)
        check_name("job", job)
        try:
            return self._timings[(dataset, job)].summary()
        except KeyError:
            raise UnknownSession(f"no timings for job {job} on {dataset}") from None

    # -- internals -----------------------------------------------------------------------------

    def _session(self, dataset: Any, job: Any, rank: Any) -> tuple[Job, Session]:
        self._dataset(dataset)
        check_name("job", job)
        check_int("rank", rank, 0, MAX_WORLD - 1)
        entry = self._jobs.get((dataset, job))
        session = entry.sessions.get(rank) if entry is not None else None
        if entry is not None and rank >= entry.world_size:
            raise InvalidRequest(f"rank must be below the world size {entry.world_size}")
        if entry is None or session is None:
            raise UnknownSession(f"no session for job {job} rank {rank} on {dataset}")
        return entry, session

    def _timings_of(self, key: tuple[str, str], *, touch: bool = True) -> JobTimings:
        timings = self._timings.get(key)
        if timings is None:
            timings = self._timings[key] = JobTimings(self.ring)
            while len(self._timings) > self.history:
                self._timings.popitem(last=False)
        if touch:
            self._timings.move_to_end(key)
        return timings

    def _info(self, entry: Job, session: Session) -> SessionInfo:
        return entry.info(self._datasets[entry.dataset], session, self._modes[entry.dataset])
