"""One dataset's cache view, shared by every job reading it: :class:`DatasetState`.

What the claims of every job on a dataset share (:mod:`mountd.coop.claims`): which files are
cached (a bitmap the cache's notifications keep), which are being fetched for some job's claim
(the in-flight map that makes concurrent jobs fetch disjoint files), which another mountd of
the cluster holds, the packed datasets' reservations, and the dataset's
:class:`~mountd.coop.chunks.ChunkManager`. The epoch pools of the jobs
(:class:`~mountd.coop.claims.EpochPool`) point at it and it tells them what changed; it
knows them only as :class:`Reader`, so that it need not import them. All of it runs in
mountd's trio thread; a method call is atomic.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from typing import Protocol

from mountd.coop.brand import FillRates, unit_of
from mountd.coop.chunks import ChunkManager
from mountd.coop.draws import INVERT, Needs
from mountd.coop.packing import Packing
from mountd.coop.plans import ChunkPlan, Moves
from mountd.coop.unopened import Unopened

__all__ = ["DatasetState", "Reader", "protection_owner"]


def protection_owner(dataset: str, job: str, epoch: int) -> tuple[str, str, int]:
    """The key under which the cache protects what a job's epoch pool claimed
    (mountd/store/holds.py owners): set by the service's fetches, released when the pool
    closes, counted for the pool's claims (:meth:`DatasetState.pending`)."""
    return (dataset, job, epoch)


class Reader(Protocol):
    """What a :class:`DatasetState` asks of the epoch pools that read it
    (:class:`mountd.coop.claims.EpochPool`): their job, epoch and what they were given (for
    :meth:`DatasetState.demand`), their reservations and fill rates, and their notifications."""

    job: str
    epoch: int
    given: bytearray
    reserved: set[int]
    fill: FillRates | None

    def replanned(self) -> None: ...

    def on_moved(self, moves: Moves) -> None: ...

    def on_cached(self, ids: list[int]) -> None: ...

    def on_evicted(self, ids: list[int]) -> None: ...


class DatasetState:
    """One dataset's cache view, shared by every job reading it.

    ``cached`` is a bitmap fed by :meth:`mark_cached` / :meth:`mark_evicted` (the caller
    forwards the cache's fills and evictions). ``in_flight`` maps ids that claims handed out
    as misses to the time their fetch is presumed lost (``flight_ttl`` later); another job's
    miss draw skips them while others are available, so concurrent jobs fetch disjoint
    subsets (Quiver §5.2) and the remote serves about ``N`` files per epoch whatever the count
    of jobs. Chunked datasets have a :class:`ChunkManager`.

    A packed dataset has a ``packing`` (:mod:`mountd.coop.brand`): claims then hand out misses
    a packed chunk at a time, ``flying_units`` counts the in-flight ids per fetch unit, and,
    when ``reserve`` is on (every mode but lru), the members a claim's GET brings beyond its
    misses are *reserved* for the claiming pool until it is given them: ``reserved`` counts
    the pools holding each id. The cache protects what a claim fetches (its misses and the
    brought members) until it is read (mountd/store/holds.py); ``protect_room`` (bytes the
    cache's protection share has left, None: no bound) is the gate: a claim brings only as
    many extra members as fit, the rest stay unread and unfetched for later claims
    (Brand: load only into a free slot). ``closed`` collects the epoch pools that closed
    (:meth:`take_closed`): the caller releases what the cache protects for them.
    """

    def __init__(
        self,
        name: str,
        plan: ChunkPlan,
        *,
        manager_options: dict | None = None,
        flight_ttl: float = 120.0,
        packing: Packing | None = None,
        reserve: bool = True,
        protect_room: Callable[[], int] | None = None,
        protect_pending: Callable[[Hashable], int] | None = None,
        reports_opens: Callable[[str], bool] | None = None,
        mean_size: int = 1,
    ) -> None:
        self.name = name
        self.plan = plan
        self.count = plan.count
        self.cached = bytearray(plan.count)
        self.cached_total = 0
        self.in_flight: dict[int, float] = {}
        self.flight_ttl = flight_ttl
        self.packing = packing
        self.reserve = reserve and packing is not None
        #: unit -> ids of it in ``in_flight`` (packed datasets only; expired ones included
        #: until :meth:`flying` looks at them).
        self.flying_units: dict[int, int] = {}
        #: id -> pools that reserved it (packed datasets with ``reserve`` only).
        self.reserved: dict[int, int] = {}
        #: Bytes the cache may still protect (None: no bound), and the mean file size that
        #: turns them into files.
        self.protect_room = protect_room
        #: Files fetched ahead for a job's epoch and not read yet (its owner is
        #: ``(name, job, epoch)``, as the service protects claims' misses); None: unknown.
        self.protect_pending = protect_pending
        self.mean_size = max(1, mean_size)
        #: (job, epoch) of the pools closed since :meth:`take_closed`.
        self.closed: list[tuple[str, int]] = []
        #: Live epoch pools of every job on this dataset (they get cache notifications).
        self.pools: set[Reader] = set()
        self.manager: ChunkManager | None = None
        self.manager_options = manager_options or {}
        #: Chunked datasets: the files given out and not opened yet, per chunk (None
        #: without chunks); what ends a marked chunk's grace once its mounts report opens.
        self.unopened: Unopened | None = None
        #: Whether the dataset's mounts report opens (by name; None: they never do).
        self._reports_opens = reports_opens
        if plan.chunks > 1:
            self.manager = self._new_manager(plan)
        #: 1 for a file another mountd of the cluster stores (as last asked: it may have
        #: gone since; then the miss goes to the bucket as any would). Misses prefer these:
        #: a peer hit costs a LAN transfer, not a bucket GET (mountd/coop/service.py asks).
        self.peer_held = bytearray(plan.count)
        self.peer_held_total = 0

    def set_peer_held(self, ids: Iterable[int], held: Iterable[bool]) -> None:
        """Record what the cluster answered for ``ids`` (see :attr:`peer_held`)."""
        peer_held = self.peer_held
        total = self.peer_held_total
        for i, there in zip(ids, held, strict=True):
            if peer_held[i] != there:
                peer_held[i] = there
                total += 1 if there else -1
        self.peer_held_total = total

    def replan(self, plan: ChunkPlan) -> list[int]:
        """Switch to ``plan`` (a mode change, :mod:`mountd.coop.benefit`); returns the ids of
        the chunks the old manager held (loading or resident: pinned, for the caller to
        unpin unless something else holds them).

        What a job was given is kept (each pool's ``given`` bitmap), so exactly once per
        epoch holds across the change; every live pool leaves its chunk (without
        "finished": the old manager goes) and enters one of the new plan at its next claim.
        In-flight misses and reservations are per file and stay as they are.
        """
        held: list[int] = []
        old = self.manager
        if old is not None:
            for c, state in enumerate(old.states()):
                if state.pinned:
                    held.extend(self.plan.ids_of(c))
        self.plan = plan
        self.manager = None
        self.unopened = None
        if plan.chunks > 1:
            self.manager = self._new_manager(plan)
        for pool in self.pools:
            pool.replanned()
        return held

    def _new_manager(self, plan: ChunkPlan) -> ChunkManager:
        self.unopened = Unopened(plan.chunk_of, plan.chunks)
        # The bitmap's own getter: the manager asks it once per moved file.
        return ChunkManager(self.name, plan, self.cached.__getitem__, demand=self.demand,
                            on_moved=self._moved, **self.manager_options)

    # -- opens (mountd/coop/unopened.py) ---------------------------------------------------

    def given(self, file_id: int) -> None:
        """A claim gave ``file_id`` to a job: its chunk waits for one more open of it."""
        if self.unopened is not None:
            self.unopened.given(file_id)

    def opened(self, ids: Iterable[int]) -> int:
        """The dataset's mounts saw readers open ``ids``; returns how many opens a chunk
        waited for."""
        return 0 if self.unopened is None else self.unopened.opened(ids)

    def reports_opens(self) -> bool:
        """Whether the dataset's mounts report opens now: only then can
        :meth:`chunk_opened` be trusted, since a reader that sends none never opens."""
        return self._reports_opens is not None and self._reports_opens(self.name)

    def chunk_opened(self, chunk: int) -> bool:
        """Whether every file given out of ``chunk`` has been opened as often as given."""
        return self.unopened is None or self.unopened.all_opened(chunk)

    def unopened_total(self) -> int | None:
        """Gives not matched by an open yet, over every chunk (None: not counted, the
        dataset has no chunks or its mounts report no opens)."""
        if self.unopened is None or not self.reports_opens():
            return None
        return self.unopened.total()

    def chunk_evicted(self, members: Iterable[int]) -> None:
        """A chunk with ``members`` was evicted: stop waiting for their opens."""
        if self.unopened is not None:
            self.unopened.forget(members)

    def is_cached(self, file_id: int) -> bool:
        """Whether ``file_id`` is cached (as reported)."""
        return bool(self.cached[file_id])

    def pinned(self, file_id: int) -> bool:
        """Whether ``file_id``'s chunk is loading or resident, so that mountd keeps it pinned
        (:attr:`mountd.coop.chunks.ChunkState.pinned`); never for a dataset without chunks."""
        return self.manager is not None and self.manager.state(self.plan.chunk_of(file_id)).pinned

    def demand(self, requester: object | None) -> Needs | None:
        """Which files the live pools still need (:class:`mountd.coop.draws.Needs`; None:
        no pool, every file is wanted): the chunk manager draws the files every reader still
        has to read first. One pass over each pool's ``given`` mask at C speed.

        "Every reader" means one pool per job: the asking pool for its own job, the newest
        epoch's pool for the others. A job's older pool (a rank still finishing the last
        epoch while another started the next) is not a reader of its own: counted as one,
        it made the new epoch's first chunks out of the files the old one had left, the
        last files of one epoch became the first of the next (measured: positions moved
        from the last fifth of an epoch to the first fifth of the next). It still counts
        for ``by_some``; it draws no chunks of its own once its job has a later epoch
        (:meth:`mountd.coop.claims.EpochPool._chunk_after`).

        ``requester`` is the holder the manager draws for
        (:meth:`~mountd.coop.chunks.ChunkManager.plan_next`): one of the live pools (an
        epoch pool running out of chunks), or None (the manager's own tick)."""
        pools = self.pools
        if not pools:
            return None
        n = self.plan.count
        asker = requester if requester in pools else None  # else the manager's own tick
        readers: dict[str, Reader] = {}
        for pool in pools:
            seen = readers.get(pool.job)
            if seen is None or pool.epoch > seen.epoch:
                readers[pool.job] = pool
        if asker is not None:
            readers[asker.job] = asker
        given_any, given_all = 0, -1
        for pool in pools:
            given = int.from_bytes(pool.given, "little")
            if readers.get(pool.job) is pool:
                given_any |= given
            given_all &= given
        mine = None
        if asker is not None:
            mine = bytes(asker.given).translate(INVERT)
        return Needs(
            by_all=given_any.to_bytes(n, "little").translate(INVERT),
            by_requester=mine,
            by_some=given_all.to_bytes(n, "little").translate(INVERT),
        )

    def _moved(self, moves: Moves) -> None:
        """The chunk manager re-drew free chunks: the per-chunk counts follow."""
        if self.unopened is not None:
            self.unopened.moved(moves)
        for pool in self.pools:
            pool.on_moved(moves)

    def mark_cached(self, ids: Iterable[int]) -> list[int]:
        """Record fills; returns the ids that were not cached before."""
        new = []
        for i in ids:
            self._land(i)
            if not self.cached[i]:
                self.cached[i] = 1
                new.append(i)
        self.cached_total += len(new)
        if self.manager is not None:
            self.manager.on_cached(new)
        for pool in self.pools:
            pool.on_cached(new)
        return new

    def mark_evicted(self, ids: Iterable[int]) -> list[int]:
        """Record evictions; returns the ids that were cached before."""
        gone = []
        for i in ids:
            if self.cached[i]:
                self.cached[i] = 0
                gone.append(i)
        self.cached_total -= len(gone)
        if self.manager is not None:
            self.manager.on_evicted(gone)
        for pool in self.pools:
            pool.on_evicted(gone)
        return gone

    def fetch_failed(self, ids: Iterable[int]) -> None:
        """Fetches of ``ids`` failed: they are no longer in flight (and count as settled for a
        loading chunk)."""
        ids = list(ids)
        for i in ids:
            self._land(i)
        if self.manager is not None:
            self.manager.on_failed(ids)

    def flying(self, file_id: int, now: float) -> bool:
        """Whether a fetch of ``file_id`` handed out by a claim is still presumed running."""
        deadline = self.in_flight.get(file_id)
        if deadline is None:
            return False
        if deadline <= now:
            self._land(file_id)
            return False
        return True

    def fly(self, ids: Iterable[int], deadline: float) -> None:
        """Enter ``ids`` in the in-flight map until ``deadline``."""
        packing, units = self.packing, self.flying_units
        for i in ids:
            if packing is not None and i not in self.in_flight:
                u = unit_of(packing, i)
                units[u] = units.get(u, 0) + 1
                if units[u] == 1:
                    self._tell_flying(u, True)
            self.in_flight[i] = deadline

    def _land(self, file_id: int) -> None:
        """``file_id`` is no longer in flight (cached, failed, or presumed lost)."""
        if self.in_flight.pop(file_id, None) is not None and self.packing is not None:
            u = unit_of(self.packing, file_id)
            left = self.flying_units[u] - 1
            if left:
                self.flying_units[u] = left
            else:
                del self.flying_units[u]
                self._tell_flying(u, False)

    def _tell_flying(self, unit: int, flying: bool) -> None:
        for pool in self.pools:
            if pool.fill is not None:
                pool.fill.set_flying(unit, flying)

    # -- reservations (packed datasets) ------------------------------------------------------

    def reserve_room(self) -> int | None:
        """How many more files the cache may protect now, in files of the mean size (None:
        any number): how many members a claim may bring beyond its misses."""
        if self.protect_room is None:
            return None
        return self.protect_room() // self.mean_size

    def pending(self, job: str, epoch: int) -> int | None:
        """Files claimed as misses by ``job`` in ``epoch`` that its readers have not read yet
        (fetched and protected, or waiting for room); None when the cache does not say."""
        if self.protect_pending is None:
            return None
        return self.protect_pending(protection_owner(self.name, job, epoch))

    def add_reservations(self, ids: Iterable[int]) -> None:
        """A pool reserved ``ids`` (brought by its claim): one more pool holds each."""
        for i in ids:
            self.reserved[i] = self.reserved.get(i, 0) + 1

    def end_reservations(self, ids: Iterable[int]) -> None:
        """A pool no longer holds ``ids`` reserved (given to it, or it closed)."""
        for i in ids:
            left = self.reserved[i] - 1
            if left:
                self.reserved[i] = left
            else:
                del self.reserved[i]

    def drop_reservations(self, ids: Iterable[int]) -> None:
        """Co-ordinated eviction removes ``ids``: no pool holds them any longer."""
        ids = set(ids)
        for pool in self.pools:
            mine = pool.reserved & ids
            if mine:
                pool.reserved -= mine
                self.end_reservations(mine)

    def take_closed(self) -> list[tuple[str, int]]:
        """``(job, epoch)`` of the epoch pools closed since the last call."""
        out, self.closed = self.closed, []
        return out
