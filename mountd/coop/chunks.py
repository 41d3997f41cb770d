"""The lifecycle of a chunked dataset's chunks: loading, marking and co-ordinated eviction
(Quiver §5.1).

A dataset that does not fit the cache is split into ``K`` chunks, each a uniform sample of the
dataset, and the cache holds two of them: jobs read the *current* chunk while the *next* one
loads in the background; the older chunk is *marked* once the next is fully loaded and evicted
``grace`` seconds after the last job that referenced it finished it (a job reads the files it
was given up to a look-ahead window later), or a configurable time after the first job
finished it (a straggler must not block the third chunk for ever). docs/substitutable-reads.md
draws the state machine. How the dataset is cut into chunks is :mod:`mountd.coop.plans`;
how a chunk's files are drawn when it is planned, :mod:`mountd.coop.draws`.

Everything here is pure decision logic. :class:`ChunkManager` never does I/O: :meth:`tick`
returns :data:`Action` values (:class:`Preload`, :class:`Evict`, :class:`ChunkReady`) and the
caller performs them, then reports the outcome through :meth:`ChunkManager.on_cached` /
:meth:`on_evicted` / :meth:`on_failed`. Files are *compact ids* ``0..N-1`` in the digest's
order; sizes are bytes per compact id. All methods run in one thread (mountd's trio thread):
code between two calls is atomic.
"""

from __future__ import annotations

import enum
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from mountd.coop.draws import Needs, draw
from mountd.coop.plans import ChunkPlan, Moves

__all__ = [
    "DEFAULT_GRACE",
    "Action",
    "ChunkManager",
    "ChunkReady",
    "ChunkState",
    "Evict",
    "Preload",
]

#: Seconds a marked chunk stays after its last holder finished it (:class:`ChunkManager`'s
#: ``grace``; docs/substitutable-reads.md, "Grace"). Set by measurement (docs/benchmarks.md).
DEFAULT_GRACE = 1.0


class ChunkState(enum.StrEnum):
    """Where one chunk is in its lifecycle."""

    IDLE = "idle"  # not resident (never loaded, or evicted)
    LOADING = "loading"  # the next chunk: preload in progress
    LOADED = "loaded"  # resident; the newest loaded chunk is the one new jobs start on
    MARKED = "marked"  # resident, marked for eviction: a newer chunk is fully loaded

    @property
    def pinned(self) -> bool:
        """Whether mountd keeps the chunk's files pinned in the cache: loading or resident
        (:class:`mountd.coop.service.CoopService` pins them as they land)."""
        return self in (ChunkState.LOADING, ChunkState.LOADED, ChunkState.MARKED)


@dataclass(frozen=True)
class Preload:
    """Start loading ``chunk``: fetch ``ids`` (its uncached files, random order) in background."""

    dataset: str
    chunk: int
    ids: tuple[int, ...]


@dataclass(frozen=True)
class ChunkReady:
    """``chunk`` is fully loaded (cached or failed): new jobs now start on it."""

    dataset: str
    chunk: int


@dataclass(frozen=True)
class Evict:
    """Evict ``chunk``: remove ``ids`` (its files cached now) unless other datasets hold them.

    ``forced`` when the timeout after the first finished job expired with jobs still on it.
    ``members``: every file the chunk held when it was evicted (cached or not); the chunk
    may be re-drawn at once (:meth:`ChunkManager.plan_next`), so read this, not the plan.
    """

    dataset: str
    chunk: int
    ids: tuple[int, ...]
    forced: bool = False
    members: tuple[int, ...] = field(default=(), compare=False)


Action = Preload | ChunkReady | Evict

#: A finished holder's answer to "have your reads passed the chunk you finished?" (asked at
#: each tick while the chunk is in its grace; :meth:`ChunkManager.finished`).
Drained = Callable[[], bool]


@dataclass
class _Chunk:
    state: ChunkState = ChunkState.IDLE
    cached: int = 0  # files of this chunk in the cache now
    failed: set[int] = field(default_factory=set)  # preload failures while loading
    refs: set[object] = field(default_factory=set)  # holders reading it, not finished yet
    #: Holders that finished it (this residency), in the order they did: when, and whether
    #: they have read past it by now (None: unknown, the grace's time decides).
    finishers: list[tuple[float, Drained | None]] = field(default_factory=list)

    @property
    def first_done(self) -> float | None:
        """When the first holder finished it (this residency)."""
        return self.finishers[0][0] if self.finishers else None

    @property
    def last_done(self) -> float | None:
        """When a holder last finished it (this residency)."""
        return self.finishers[-1][0] if self.finishers else None


class ChunkManager:
    """The chunk lifecycle of one chunked dataset; decisions come back from :meth:`tick`.

    *Holders* are the readers of the dataset: any hashable object, in practice one per job and
    epoch (:class:`mountd.coop.claims.EpochPool`). A holder :meth:`attach`\\ es, :meth:`reference`\\ s
    the chunk it reads, reports :meth:`finished` when it has been given every file of it, and
    :meth:`detach`\\ es when it goes away (which releases its references).

    ``grace``: seconds a marked chunk stays resident after its last holder finished it, so
    that the files a job was given last are still cached when it reads them (its sampler and
    DataLoader read up to a window behind its claims); the chunk stays MARKED meanwhile and
    the next preload waits. ``evict_timeout`` still forces the eviction that long after the
    *first* holder finished it, grace or not.

    **Chunks are drawn, not fixed** (docs/substitutable-reads.md "Random order across
    epochs"). The plan's chunks are containers: a chunk's membership is drawn afresh when it
    is *planned* (:meth:`plan_next`: to be loaded next, or because a reader ran out of
    chunks), uniformly at random among the files of the *free* chunks (idle, not planned, no
    reader on them: nothing resident or referenced ever moves), preferring the files every
    reader still needs in its epoch (``demand``), then those the asking reader needs, then
    those any reader needs; files nobody needs are drawn only when nothing else is left.
    Chunks load in the order they were planned; each planning has a *generation* number
    (:meth:`generation`), which readers use to move only forward. ``on_moved`` is told every
    file that changed chunk (``(id, old, new)``), for the readers' per-chunk counts.

    Invariants (checked by tests): at most two chunks resident (LOADED or MARKED), at most one
    LOADING, and resident + loading <= ``slots``. ``slots=2`` is the paper's double buffering:
    the third chunk loads once the marked one is evicted. ``slots=3`` (a budget of three
    chunks) preloads it while the marked one drains; a loaded chunk then waits, still counted
    as loading, until no chunk is marked, so that at most two are ever resident.
    """

    def __init__(
        self,
        dataset: str,
        plan: ChunkPlan,
        is_cached: Callable[[int], bool],
        *,
        evict_timeout: float = 600.0,
        grace: float = DEFAULT_GRACE,
        seed: int = 0,
        slots: int = 2,
        demand: Callable[[object | None], Needs] | None = None,
        on_moved: Callable[[Moves], None] | None = None,
    ) -> None:
        if plan.chunks < 3:
            raise ValueError("a chunked dataset needs at least 3 chunks")
        if evict_timeout < 0:
            raise ValueError("evict_timeout must be >= 0")
        if not grace >= 0:  # also refuses NaN
            raise ValueError("grace must be >= 0")
        if slots not in (2, 3):
            raise ValueError("slots must be 2 or 3")
        self.slots = slots
        self.dataset = dataset
        self.plan = plan
        self.evict_timeout = evict_timeout
        self.grace = grace
        self._is_cached = is_cached
        self._rng = random.Random(f"preload:{dataset}:{seed}")
        self._draw_rng = random.Random(f"draw:{dataset}:{seed}")
        self._demand = demand
        self._on_moved = on_moved
        self._chunks = [_Chunk() for _ in range(plan.chunks)]
        #: Generation of each chunk's current membership (0: never planned).
        self._gen = [0] * plan.chunks
        self._generations = 0
        #: Chunks planned (membership drawn, frozen) and not loading yet, in load order.
        self.planned: list[int] = []
        self._last_planned = -1
        self._holders: set[object] = set()
        self.loading: int | None = None
        self._order: list[int] = []  # the loading chunk's uncached ids, shuffled
        self._cursor = 0  # next_preload's position in _order
        #: The newest fully loaded chunk (None before the first one is loaded).
        self.newest: int | None = None
        #: A reader entered or finished a chunk since the newest became the newest.
        self._read_since_ready = False
        for file_id in range(plan.count):
            if is_cached(file_id):
                self._chunks[plan.chunk_of(file_id)].cached += 1

    # -- queries ---------------------------------------------------------------------------

    def state(self, chunk: int) -> ChunkState:
        """``chunk``'s lifecycle state."""
        return self._chunks[chunk].state

    def states(self) -> list[ChunkState]:
        """Every chunk's state, by chunk index."""
        return [c.state for c in self._chunks]

    def resident(self) -> list[int]:
        """Chunks LOADED or MARKED."""
        return [i for i, c in enumerate(self._chunks) if c.state in _RESIDENT]

    def cached_count(self, chunk: int) -> int:
        """Files of ``chunk`` cached now (as reported)."""
        return self._chunks[chunk].cached

    def refs(self, chunk: int) -> frozenset[object]:
        """Holders that referenced ``chunk`` and have not finished it."""
        return frozenset(self._chunks[chunk].refs)

    def entry_chunk(self) -> int:
        """The chunk a new reader starts on: the newest loaded, else the loading one, else the
        next to load (Quiver: "all new jobs will now get hits only from the latest chunk")."""
        if self.newest is not None:
            return self.newest
        if self.loading is not None:
            return self.loading
        return self._next_to_load()

    def generation(self, chunk: int) -> int:
        """When ``chunk``'s membership was drawn: plannings are numbered 1, 2, … (0: never);
        chunks load in generation order."""
        return self._gen[chunk]

    @property
    def generations(self) -> int:
        """Plannings so far: the generation of the newest drawn chunk (0: none yet)."""
        return self._generations

    def is_free(self, chunk: int) -> bool:
        """Whether ``chunk`` may be re-drawn: idle, not planned, no reader on it."""
        c = self._chunks[chunk]
        return c.state is ChunkState.IDLE and not c.refs and chunk not in self.planned

    def held(self) -> list[int]:
        """The chunks that are not free (planned, loading, resident, or read), oldest
        generation first."""
        return sorted((c for c in range(self.plan.chunks) if not self.is_free(c)),
                      key=self._gen.__getitem__)

    def plan_next(self, requester: object | None = None) -> int | None:
        """Draw the membership of a free chunk and queue it to load next; the chunk, or None
        when no chunk is free.

        The draw (:func:`mountd.coop.draws.draw`) takes the free chunks' units (files, or
        whole packed chunks of a packed plan) in uniformly random order among those every
        reader still needs (``NEEDED_BY_ALL`` in ``demand``'s :class:`Needs`) until the chunk
        holds ``plan.target_bytes`` (it stops at the first unit that does not fit); if they
        run out first, it tops up with the units the asking reader needs
        (``NEEDED_BY_REQUESTER``), then those some reader needs (``NEEDED_BY_SOME``), each in
        random order, and with ``NEEDED_BY_NONE`` ones only when nothing else was taken.
        The chosen container keeps the drawn units; the units it held go to the free chunks
        the drawn ones came from (so chunk sizes stay near the plan's). No position is
        preferred: which files land together is decided afresh at each planning, so a file
        is as likely to be early in an epoch as late, whatever it was before.

        Cost: this runs on mountd's trio thread, so every step over the free files is a
        C-speed pass (masks, ``compress``, one ``random.sample``); the Python work is
        O(chunk). About 0.1 s for a 130,000-file chunk of a 1.3M-file dataset.
        """
        plan = self.plan
        free = [c for c in range(plan.chunks) if self.is_free(c)]
        if not free:
            return None
        needs = self._demand(requester) if self._demand is not None else None
        taken = draw(plan, self._draw_rng, plan.units_in_chunks(free), needs)
        # The container: the next free one after the last planned, cyclically (its index
        # means nothing: the membership is what was drawn).
        last = self.planned[-1] if self.planned else self._last_planned
        chunk = min(free, key=lambda c: (c - last - 1) % plan.chunks)
        self._last_planned = chunk
        self._reassign(chunk, free, taken)
        self._generations += 1
        self._gen[chunk] = self._generations
        self.planned.append(chunk)
        return chunk

    def _reassign(self, chunk: int, free: list[int], taken: list[int]) -> None:
        """``chunk`` gets the ``taken`` units; the units it gives up fill the places they
        left in the other free chunks (extra ones go to the smallest)."""
        plan = self.plan
        if not taken:
            return
        others = [d for d in free if d != chunk]
        if plan.packing is None:
            self._moved(plan.move_into(chunk, taken, others))
            return
        taken_set = set(taken)
        groups: dict[int, list[int]] = {chunk: list(taken)}
        holes: list[int] = []  # a donor chunk once per unit it gave
        for d in others:
            units = plan.units_of(d)
            kept = [u for u in units if u not in taken_set]
            if len(kept) != len(units):
                holes.extend([d] * (len(units) - len(kept)))
                groups[d] = kept
        back = [u for u in plan.units_of(chunk) if u not in taken_set]
        if not others:
            groups[chunk].extend(back)  # the only free chunk keeps what it had
            back = []
        for k, u in enumerate(back):
            if k < len(holes):
                d = holes[k]
            else:  # drew fewer units than it gave up (larger files): to the smallest
                d = min(others, key=lambda c: len(groups[c]) if c in groups else plan.size_of(c))
            if d not in groups:
                groups[d] = plan.units_of(d)
            groups[d].append(u)
        self._moved(plan.reassign(
            {c: [i for u in us for i in plan.unit_ids(u)] for c, us in groups.items()}
        ))

    def _moved(self, moves: Moves) -> None:
        """Files changed chunk: per-chunk cached counts, then the readers (``on_moved``)."""
        if not moves:
            return
        for (old, new), ids in moves.items():
            n = sum(map(bool, map(self._is_cached, ids)))
            self._chunks[old].cached -= n
            self._chunks[new].cached += n
        if self._on_moved is not None:
            self._on_moved(moves)

    def next_preload(self, limit: int) -> list[int]:
        """The next ``limit`` files to preload for the loading chunk (pull model).

        Walks the :class:`Preload` order, skipping files cached (by a job's miss) or failed
        meanwhile; past the end it starts again with the files still missing (preloads the
        cache dropped, or still in progress: a repeat is harmless, fills are single-flight), at
        most one new round per call. Empty when nothing is loading or all is in. A caller
        following DELI's "50/50" rule (§V-D) pulls a window of half its preload budget
        whenever the previous window is half done.
        """
        out: list[int] = []
        if self.loading is None:
            return out
        failed = self._chunks[self.loading].failed
        wrapped = False
        while len(out) < limit:
            if self._cursor >= len(self._order):
                if wrapped:
                    break
                wrapped = True
                self._order = [i for i in self._order if not self._is_cached(i) and i not in failed]
                self._cursor = 0
                if not self._order:
                    break
            i = self._order[self._cursor]
            self._cursor += 1
            if not self._is_cached(i) and i not in failed:
                out.append(i)
        return out

    def preload_remaining(self, limit: int | None = None) -> list[int]:
        """Files of the loading chunk neither cached nor failed yet (to re-issue preloads that
        the cache dropped or that are still queued), at most ``limit``."""
        if self.loading is None:
            return []
        chunk = self._chunks[self.loading]
        out = []
        for start, stop in self.plan.ranges_of(self.loading):
            for i in range(start, stop):
                if not self._is_cached(i) and i not in chunk.failed:
                    out.append(i)
                    if limit is not None and len(out) >= limit:
                        return out
        return out

    # -- readers ---------------------------------------------------------------------------

    def attach(self, holder: object) -> None:
        """A reader exists; preloading runs only while some reader is attached."""
        self._holders.add(holder)

    def detach(self, holder: object) -> None:
        """A reader went away: drop its references (it will not finish them)."""
        self._holders.discard(holder)
        for chunk in self._chunks:
            chunk.refs.discard(holder)

    def reference(self, holder: object, chunk: int) -> None:
        """``holder`` reads ``chunk`` now (Algorithm 1's ``informServers``)."""
        self._holders.add(holder)
        self._chunks[chunk].refs.add(holder)
        self._read_since_ready = True

    def detach_chunk(self, holder: object, chunk: int) -> None:
        """``holder`` leaves ``chunk`` without having read from it (not a finish)."""
        self._chunks[chunk].refs.discard(holder)

    def finished(self, holder: object, chunk: int, now: float,
                 drained: Drained | None = None) -> None:
        """``holder`` was given every file of ``chunk`` (``informServersDoneUsingChunk``).

        ``drained``, when the holder can tell, says whether its reads have passed the files
        it was given last: the chunk's grace then ends for this holder as soon as it says
        so, not only ``grace`` seconds later (:meth:`_in_grace`)."""
        c = self._chunks[chunk]
        c.refs.discard(holder)
        self._read_since_ready = True
        if c.state is not ChunkState.IDLE:
            c.finishers.append((now, drained))

    # -- cache notifications -----------------------------------------------------------------

    def on_cached(self, ids: Iterable[int]) -> None:
        """``ids`` became cached (each reported once: only ids that were not cached)."""
        for i in ids:
            chunk = self._chunks[self.plan.chunk_of(i)]
            chunk.cached += 1
            chunk.failed.discard(i)  # a later fetch (a job's miss) succeeded after all

    def on_evicted(self, ids: Iterable[int]) -> None:
        """``ids`` left the cache (each reported once: only ids that were cached)."""
        for i in ids:
            self._chunks[self.plan.chunk_of(i)].cached -= 1

    def on_failed(self, ids: Iterable[int]) -> None:
        """Preloads of ``ids`` failed for good; the loading chunk completes without them."""
        if self.loading is None:
            return
        chunk = self._chunks[self.loading]
        for i in ids:
            if self.plan.chunk_of(i) == self.loading and not self._is_cached(i):
                chunk.failed.add(i)

    # -- decisions ---------------------------------------------------------------------------

    def tick(self, now: float) -> list[Action]:
        """Advance the lifecycle; the actions to perform, in order.

        1. A marked chunk no holder still reads is evicted once ``grace`` has passed since
           its last holder finished it; so is one whose first finisher finished
           ``evict_timeout`` ago, holders or not (``forced``).
        2. The loading chunk, once every file is cached or failed (and no chunk is marked),
           becomes the newest (:class:`ChunkReady`) and the previous newest is marked for
           eviction — evicted at once (step 1 again) if no holder reads it.
        3. While a reader is attached and a slot is free, the next chunk starts loading
           (after the first, only while readers read: :meth:`_reading`).
        """
        actions: list[Action] = []
        self._evict_marked(now, actions)
        if self._promote(actions):
            self._evict_marked(now, actions)
        busy = len(self.resident()) + (self.loading is not None)
        if self.loading is None and self._holders and busy < self.slots and self._reading():
            if not self.planned:
                self.plan_next()
            if not self.planned:
                return actions  # nothing free to draw from
            index = self.planned.pop(0)
            chunk = self._chunks[index]
            chunk.state = ChunkState.LOADING
            chunk.failed.clear()
            chunk.finishers = []
            self.loading = index
            ids = self.plan.preload_order(index, self._rng, lambda i: not self._is_cached(i))
            self._order, self._cursor = ids, 0
            actions.append(Preload(self.dataset, index, tuple(ids)))
        return actions

    def release_planned(self) -> list[int]:
        """Planned chunks no reader is on go back to the free ones (re-drawn when planned
        again); the chunks released.

        For a job's next epoch (:meth:`mountd.coop.claims.EpochPool._start`): the chunks
        planned while it read its last epoch were drawn from the files it had not read yet
        then, in the order it went on to read them. Kept, the new epoch would read them in
        that order again, and a file read early in one epoch would be read early in the next
        (measured: epoch-to-epoch correlation of positions up to +0.7 with one job that ran
        ahead of the loads).
        """
        released = [c for c in self.planned if not self._chunks[c].refs]
        if released:
            self.planned = [c for c in self.planned if self._chunks[c].refs]
        return released

    def _promote(self, actions: list[Action]) -> bool:
        if self.loading is None:
            return False
        chunk = self._chunks[self.loading]
        if chunk.cached + len(chunk.failed) < self.plan.size_of(self.loading):
            return False
        if any(c.state is ChunkState.MARKED for c in self._chunks):
            return False  # slots=3: wait, or three chunks would be resident
        if self.newest is not None:
            self._chunks[self.newest].state = ChunkState.MARKED
        chunk.state = ChunkState.LOADED
        chunk.failed.clear()
        self._order, self._cursor = [], 0
        self.newest, self.loading = self.loading, None
        self._read_since_ready = False
        actions.append(ChunkReady(self.dataset, self.newest))
        return True

    def _reading(self) -> bool:
        """Whether the next chunk may load: before the first, always (a job's first chunk is
        ready when it starts reading); after, while a reader is on some chunk or has entered
        or finished one since the newest became the newest. Otherwise the next chunk's
        arrival would mark the newest and evict it unread, and the one after would do the
        same to it: a session opened but not claiming yet made mountd load and evict chunk
        after chunk."""
        return (self.newest is None or self._read_since_ready
                or any(c.refs for c in self._chunks))

    def _evict_marked(self, now: float, actions: list[Action]) -> None:
        for index, chunk in enumerate(self._chunks):
            if chunk.state is not ChunkState.MARKED:
                continue
            forced = chunk.first_done is not None and now - chunk.first_done >= self.evict_timeout
            if not forced and (chunk.refs or self._in_grace(chunk, now)):
                continue
            members = tuple(self.plan.ids_of(index))
            ids = tuple(i for i in members if self._is_cached(i))
            actions.append(Evict(self.dataset, index, ids, forced=bool(chunk.refs), members=members))
            chunk.state = ChunkState.IDLE
            # A straggler keeps its reference (it reads the chunk as misses now), so that the
            # chunk is not re-drawn under it; it goes when the straggler finishes or leaves.
            chunk.finishers = []

    def _in_grace(self, chunk: _Chunk, now: float) -> bool:
        """Whether a holder finished ``chunk`` less than ``grace`` ago and has not read past
        it yet (its ``drained`` says not, or it cannot say): its last given files may still
        be unread (a chunk whose holders all went away without finishing it has no grace).

        The time alone held every chunk a fixed second; with jobs whose look-ahead is read
        in a fraction of that, the next chunk loaded late and the jobs ran into it as misses
        (``shim_vs_lru.py`` at 600 files: 1 s met its targets in 1 run of 5, 0.25-0.4 s in
        3 of 3; docs/substitutable-reads.md "Grace")."""
        return any(now - done < self.grace and (drained is None or not drained())
                   for done, drained in chunk.finishers)

    def grace_deadline(self) -> float | None:
        """The earliest clock at which a marked chunk's grace ends by time (None: none
        pending), so that the caller can tick then instead of up to a tick interval later
        (a grace that ends because its holders read past the chunk ends at a claim, which
        ticks at once)."""
        ends = [
            c.last_done + self.grace
            for c in self._chunks
            if c.state is ChunkState.MARKED and not c.refs and c.last_done is not None
        ]
        return min(ends, default=None)

    def _next_to_load(self) -> int:
        """The chunk to load next: the first planned one, else the first free one (its
        membership is drawn when it is planned)."""
        if self.planned:
            return self.planned[0]
        return next((c for c in range(self.plan.chunks) if self.is_free(c)), 0)


_RESIDENT = (ChunkState.LOADED, ChunkState.MARKED)
