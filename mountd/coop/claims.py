"""Substitutable hits and co-operative misses: the claim algorithm (Quiver §4.7, §5.2, Alg. 1).

A job reads a dataset of ``N`` files, compact ids ``0..N-1`` in the digest's order. In each
epoch every file goes to exactly one claim of the job, across all its ranks. A claim of ``n``
returns up to ``n`` files the job has not been given this epoch:

1. **hits** — a uniform random sample of the *cached* unread files of the job's current chunk;
2. **misses** (only when too few are cached) — random unread files of that chunk, preferring
   files no other job is fetching already (:attr:`DatasetState.in_flight`) and, in a cluster,
   files another mountd holds (:attr:`DatasetState.peer_held`: a peer hit, not a bucket GET);
   the caller must start fetching them at once (claims are DELI's sampler-informed prefetch
   hint).

A packed dataset (one with a :class:`~mountd.coop.packing.Packing`) draws its misses
differently: whole packed chunks of the current chunk by fill rate, the members beyond ``n``
returned as ``brought`` and reserved for the job (:mod:`mountd.coop.brand`;
docs/substitutable-reads.md "Packed datasets (Brand)"). Loose datasets are unaffected.

Algorithm 1 samples ``10 × n`` random unread indices and keeps the cached ones; that yields a
uniform sample of ``cached ∩ unread``, cut short when the lookup budget runs out. The cache
state here is a local bitmap, so this module samples ``cached ∩ unread`` *directly*: the same
distribution, without the budget's shortfall (the hit rate stays at 100% while cached unread
files remain). The look-ahead factor bounds instead how many in-flight candidates a miss draw
may skip before it accepts one (co-operation is best effort, progress is guaranteed).

A chunk (:mod:`mountd.coop.chunks`) bounds both: hits and misses come from the job's current chunk
only, and one claim never spans two chunks (a claim that exhausts its chunk returns short and
moves the job to the next chunk with unread files). Modes full/lru/off have a single chunk: the
whole dataset.

Data structures (``N`` = 1.3M files costs about 12 MB per job and epoch): the given set is a
``bytearray(N)``; the unread files of the current chunk are an :class:`UnreadSet` (cached ones
apart; O(1) membership, moves, removal and uniform sampling of either part), built when the job
enters a chunk (memcpy copies of the plan's templates plus O(min(cached, uncached)) steps, or
one pass when cached and uncached are well mixed: at most ~0.4 s for 1.3M files), and kept
current in O(1) per cache notification — so a claim costs O(n), never O(N). All of it runs in
one thread (mountd's trio thread); a method call is atomic.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from itertools import compress

from mountd.coop.brand import FillRates, unit_members
from mountd.coop.chunks import Drained
from mountd.coop.dataset_state import DatasetState
from mountd.coop.draws import INVERT
from mountd.coop.plans import Moves
from mountd.coop.unread import UnreadSet

__all__ = ["ADVICE_SHARE", "Claim", "EpochPool", "advised_fetch"]

#: A rank's advised fetch size is its share of this fraction of a chunk
#: (:func:`advised_fetch`).
ADVICE_SHARE = 0.25


def advised_fetch(chunk_files: int, world_size: int) -> int:
    """The most files each of a job's ``world_size`` ranks should claim at a time when the
    dataset's chunks hold ``chunk_files`` files: an :data:`ADVICE_SHARE` of a chunk between
    them (at least 1).

    Why: a sampler holds up to two fetches claimed and not read yet, and its DataLoader
    more. When that look-ahead spans chunks, the job gives out a chunk before its reads
    reach it and runs chunks ahead of the loads: it takes its files as misses from chunks
    not loaded yet, the marked chunk it still reads is evicted under it, and loads fetch
    again what was fetched for it (4 jobs of 2 ranks at a 20% cache, 1,200 files: 94-file
    chunks against 2 x 128 claimed files a job; 42-88 of each chunk's 94 files fetched
    twice). A sampler left at its default fetch size follows the advice; one given a fetch
    size keeps it (docs/shim.md)."""
    return max(1, int(chunk_files * ADVICE_SHARE) // world_size)


@dataclass(frozen=True)
class Claim:
    """The answer to one claim: ``hits`` are cached now, ``fetch`` must be fetched at once.

    ``ids`` (hits first: they can be read while the misses arrive) is what the sampler yields.
    ``end_of_epoch`` is true exactly when ``ids`` is empty: this rank's part of the epoch is
    given out. ``chunk`` is the chunk every id belongs to (0 when the dataset is not chunked;
    None for an empty claim). ``remaining`` counts the job's files not yet given this epoch.
    ``brought`` (packed datasets): the other wanted members of the packed chunks the misses
    come from; not given, but fetched with them in the same GET, and reserved for the job
    (they become its hits as they land). The caller fetches ``fetch + brought``.
    """

    epoch: int
    hits: tuple[int, ...]
    fetch: tuple[int, ...]
    chunk: int | None
    remaining: int
    brought: tuple[int, ...] = ()
    #: Nothing was given, but the epoch is not over: the cache has no room to protect more
    #: misses and the job's readers still have a batch's worth per rank to read; claim
    #: again once they have read some (:meth:`EpochPool.claim`).
    wait: bool = False
    #: The fetch size the job's ranks are advised to claim with (:func:`advised_fetch`);
    #: None when the dataset is not chunked (no chunk for a look-ahead to outrun).
    advised_fetch: int | None = None

    @property
    def ids(self) -> tuple[int, ...]:
        """Every id of the claim, hits first."""
        return self.hits + self.fetch

    @property
    def end_of_epoch(self) -> bool:
        """Nothing was given and nothing is to wait for: this rank's part of the epoch is
        over."""
        return not self.hits and not self.fetch and not self.wait


@dataclass(eq=False)
class EpochPool:
    """One job's epoch: what was given out, and the unread files of its current chunk.

    Shared by every rank of the job (so a file goes to exactly one rank); each rank gets at
    most ``quota`` files (``ceil(N / world_size)``) so ranks finish with equal step counts
    (±1) as DDP needs. Identity-hashed: it is the job's *holder* in the :class:`ChunkManager`.
    """

    dataset: DatasetState
    job: str
    epoch: int
    world_size: int = 1
    #: The job's files (1 = in scope; None: the whole dataset), e.g. an ImageFolder over one
    #: sub-directory of the mount. Files out of scope count as given from the start: they
    #: are never claimed, and the epoch ends once the scope is given out.
    scope: bytearray | None = None
    given: bytearray = field(init=False)
    given_total: int = field(init=False, default=0)
    given_by_rank: list[int] = field(init=False)
    #: Per rank, the most files its sampler can hold claimed and not read (0: it has not
    #: claimed): its fetch size plus its claim threshold, at most ``max(n, batch) + n``
    #: (:meth:`_drained`).
    windows: list[int] = field(init=False)
    quota: int = field(init=False)
    #: Files of the epoch (the scope's, or the dataset's).
    in_scope: int = field(init=False)
    #: The chunk the job reads now (None before its first claim and after the epoch's end).
    chunk: int | None = field(init=False, default=None)
    #: Unread files of the current chunk, cached ones apart (None when no chunk).
    unread: UnreadSet | None = field(init=False, default=None)
    given_per_chunk: list[int] = field(init=False)
    #: Packed datasets: open members per fetch unit of the current chunk (None otherwise).
    fill: FillRates | None = field(init=False, default=None)
    #: Ids reserved for this pool (brought by its claims, not given yet; packed datasets).
    reserved: set[int] = field(init=False, default_factory=set)
    #: Chunk generations up to this one are not entered at the start of the epoch: the job's
    #: previous epoch read them last, so starting there would put the same files at the end
    #: of one epoch and the start of the next (None: no previous epoch).
    after: int | None = None
    #: The generation (:meth:`ChunkManager.generation`) of the chunk read now or last.
    generation: int = field(init=False, default=0)
    #: Resident chunks of the previous epoch still to take a share of (:meth:`_start`).
    _prelude: list[int] = field(init=False, default_factory=list)
    #: Whether the current chunk was thinned (:meth:`_start`): its unread set then holds a
    #: share of the chunk's files not given yet, not all of them.
    thinned: bool = field(init=False, default=False)
    #: The files still to give, in random order, once this pool reads without chunks (a
    #: rank finishing an epoch its job has left: :meth:`_claim_left`); None until then.
    _left: list[int] | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        n = self.dataset.count
        plan = self.dataset.plan
        self.given_by_rank = [0] * self.world_size
        self.windows = [0] * self.world_size
        if self.scope is None:
            self.given = bytearray(n)
            self.given_per_chunk = [0] * plan.chunks
            in_scope = n
        else:
            if len(self.scope) != n:
                raise ValueError(f"scope covers {len(self.scope)} files, the dataset has {n}")
            self.given = self.scope.translate(INVERT)
            in_scope = self.scope.count(1)
            self.given_total = n - in_scope
            self.given_per_chunk = [plan.count_in(c, self.given) for c in range(plan.chunks)]
        self.in_scope = in_scope
        self.quota = -(-in_scope // self.world_size)
        self.dataset.pools.add(self)
        if self.dataset.manager is not None:
            self.dataset.manager.attach(self)

    # -- lifecycle -------------------------------------------------------------------------

    def close(self) -> None:
        """Forget the pool: no more notifications, chunk references released."""
        if self in self.dataset.pools:
            self.dataset.closed.append((self.job, self.epoch))
        self.dataset.pools.discard(self)
        if self.dataset.manager is not None:
            self.dataset.manager.detach(self)
        if self.reserved:
            self.dataset.end_reservations(self.reserved)
            self.reserved = set()
        self.unread = None
        self.fill = None
        self.chunk = None

    @property
    def position(self) -> float:
        """How far the job is: its epoch plus the share of the epoch's files given so far
        (``3.25``: a quarter into epoch 3)."""
        given = self.given_total - (self.dataset.count - self.in_scope)
        return self.epoch + (given / self.in_scope if self.in_scope else 1.0)

    @property
    def remaining(self) -> int:
        """Files of the dataset not given to the job in this epoch yet."""
        return self.dataset.count - self.given_total

    def rank_remaining(self, rank: int) -> int:
        """Files rank ``rank`` may still claim in this epoch."""
        return min(self.quota - self.given_by_rank[rank], self.remaining)

    # -- the claim -------------------------------------------------------------------------

    def claim(self, rank: int, n: int, rng: random.Random, lookahead: int, now: float,
              batch: int | None = None) -> Claim:
        """Up to ``n`` files for ``rank`` (see the module docstring); marks them given.

        Misses are entered in the dataset's in-flight map; the caller must fetch them.
        ``batch``: the rank's batch size, when its sampler says (see :meth:`_miss_quota`).
        """
        self.windows[rank] = max(n, batch or n) + n
        n = min(n, self.rank_remaining(rank))
        hits: list[int] = []
        fetch: list[int] = []
        brought: list[int] = []
        chunk = None
        wait = False
        if n > 0:
            if self.chunk is None and self._left is None:
                self._start()
            if self._left is not None:
                hits, fetch = self._claim_left(n, now, batch)
                wait = not hits and not fetch
            else:
                chunk = self.chunk
                hits, fetch, brought, wait = self._claim_chunk(n, rng, lookahead, now, batch)
            self.given_by_rank[rank] += len(hits) + len(fetch)
            if self._left is None and not self.unread:
                self._leave(now)
        return Claim(
            self.epoch, tuple(hits), tuple(fetch), chunk, self.remaining, tuple(brought), wait,
            self.advised_fetch(),
        )

    def advised_fetch(self) -> int | None:
        """The fetch size for this job's ranks (:func:`advised_fetch`) from the plan's mean
        chunk; None when the dataset is not chunked."""
        if self.dataset.manager is None:
            return None
        plan = self.dataset.plan
        return advised_fetch(plan.count // plan.chunks, self.world_size)

    def _claim_chunk(self, n: int, rng: random.Random, lookahead: int, now: float,
                     batch: int | None) -> tuple[list[int], list[int], list[int], bool]:
        """Up to ``n`` files of the current chunk: ``(hits, fetch, brought, wait)``, cached
        unread files first, then misses (:meth:`_miss_quota`; packed: :meth:`_packed_misses`)."""
        unread = self.unread
        assert unread is not None
        hits: list[int] = []
        fetch: list[int] = []
        brought: list[int] = []
        wait = False
        while len(hits) < n and unread.cached:
            hits.append(self._give(unread.sample_cached(rng)))
        if len(hits) < n:
            if self.fill is None:
                want = self._miss_quota(n - len(hits), bool(hits), batch)
                if want:
                    fetch = self._misses(want, rng, lookahead, now)
                wait = not hits and not fetch
            else:
                fetch, brought = self._packed_misses(n - len(hits), rng, now)
        return hits, fetch, brought, wait

    def _miss_quota(self, want: int, has_hits: bool, batch: int | None) -> int:
        """How many of ``want`` misses a claim may give: what the cache can protect until
        they are read (:meth:`DatasetState.reserve_room`), since misses beyond it are
        evicted before their read and fetched twice (4 jobs of 2 ranks without compute at
        a 20% cache: half of all fills).

        A claim with no hits still needs misses to make progress. A sampler that says its
        ``batch`` gets enough that the job's claimed misses not read yet (protected, or
        waiting for room: :meth:`DatasetState.pending`) make a batch for each of its
        ``world_size`` ranks, and nothing beyond (the claim then says ``wait``): a rank
        whose readers still have that much to read will not starve, and a job cannot claim
        miss after miss while the cache has no room for them, which ran every claimed
        miss through a demand fill that ended another job's protection (a cascade: epochs
        up to 4× slower at 4 jobs of 2 ranks, 1,200 files, a 20% cache). Without
        ``batch`` (an older sampler), one miss, as before."""
        room = self.dataset.reserve_room()
        if room is None or room >= want:
            return want
        if has_hits:
            return room
        pending = None if batch is None else self.dataset.pending(self.job, self.epoch)
        if pending is None:
            return max(room, 1)
        return min(want, max(room, batch * self.world_size - pending))

    def _misses(self, need: int, rng: random.Random, lookahead: int, now: float) -> list[int]:
        """``need`` random unread (uncached) files, skipping in-flight ones, and in a cluster
        ones no peer holds (peer hits before misses), within the budget of
        ``lookahead × need`` draws."""
        assert self.unread is not None
        dataset = self.dataset
        out: list[int] = []
        skips = lookahead * need
        peer_held = dataset.peer_held if dataset.peer_held_total else None
        while len(out) < need and len(self.unread) > self.unread.cached:
            i = self.unread.sample_uncached(rng)
            if skips > 0 and (dataset.flying(i, now)
                              or (peer_held is not None and not peer_held[i])):
                skips -= 1
                continue
            out.append(self._give(i))
        dataset.fly(out, now + dataset.flight_ttl)
        return out

    def _packed_misses(
        self, need: int, rng: random.Random, now: float
    ) -> tuple[list[int], list[int]]:
        """Brand's misses: whole packed chunks of the current chunk, highest fill rate first.

        Takes units (:meth:`FillRates.best`: most open members not in flight, as a share of
        the unit) until ``need`` misses are given; every wanted member of a taken unit goes
        in flight (its one GET brings them all), the ones beyond ``need`` as ``brought``:
        reserved for this pool, read as hits by its later claims; but only as many as the
        cache's protection share has room for (:meth:`DatasetState.reserve_room`, after the
        misses): the others stay unread and not in flight. When every open member is
        in flight already (another job's GET, or this pool's own brought ones), the unit
        with the most open members is given anyway: progress is guaranteed, and the fetch
        joins the running one (single-flight).
        """
        unread, fill, dataset = self.unread, self.fill, self.dataset
        assert unread is not None and fill is not None and dataset.packing is not None
        packing = dataset.packing

        def open_members(u: int) -> list[int]:
            return [i for i in unit_members(packing, u) if i in unread and not unread.is_cached(i)]

        def wanted(u: int) -> list[int]:
            return [i for i in open_members(u) if not dataset.flying(i, now)]

        fetch: list[int] = []
        brought: list[int] = []
        deadline = now + dataset.flight_ttl
        room = dataset.reserve_room()
        if room is not None:
            room -= need  # the misses are protected first: the job reads them next
        while len(fetch) < need and fill.open:
            pick = fill.best(rng, wanted)
            if pick is None:
                # Everything open is in flight: join the unit with the most open members.
                top = max(fill.open.values())
                unit = rng.choice([u for u, c in fill.open.items() if c == top])
                ids = open_members(unit)
                rng.shuffle(ids)
                fetch.extend(self._give(i) for i in ids[: need - len(fetch)])
                break
            _, ids = pick
            rng.shuffle(ids)
            take = ids[: need - len(fetch)]
            extra = ids[len(take) :]
            if room is not None:
                # No room to protect them: they wait for a later claim instead of pushing
                # out files fetched for jobs that have not read them yet.
                keep = max(0, min(len(extra), room))
                room -= keep
                extra = extra[:keep]
            dataset.fly(take + extra, deadline)
            fetch.extend(self._give(i) for i in take)
            if extra:
                brought.extend(extra)
                if dataset.reserve:
                    fresh = [i for i in extra if i not in self.reserved]
                    self.reserved.update(fresh)
                    dataset.add_reservations(fresh)
        return fetch, brought

    def _give(self, i: int) -> int:
        assert self.unread is not None
        if self.fill is not None and i in self.unread and not self.unread.is_cached(i):
            self.fill.remove(i)
        self._mark_given(i)
        self.unread.discard(i)
        return i

    def _mark_given(self, i: int) -> None:
        """``i`` is given to the job for this epoch (its reservation, if any, ends)."""
        if i in self.reserved:
            self.reserved.discard(i)
            self.dataset.end_reservations((i,))
        self.given[i] = 1
        self.given_total += 1
        self.given_per_chunk[self.dataset.plan.chunk_of(i)] += 1
        self.dataset.given(i)

    def claim_uncached(self, rank: int, n: int, rng: random.Random, now: float,
                       draws: int = 64) -> Claim | None:
        """A probe's claim (:mod:`mountd.coop.timings`): up to ``n`` files not given to the
        job in this epoch and not cached, from any chunk; None when none was found in
        ``draws × n`` random draws (e.g. the dataset is all cached): claim normally then.

        Still files the job has not been given, so exactly once per epoch holds. Files of
        chunks other than the current one are given without referencing their chunk (a
        probe's reads must be misses; the loaded chunks are cached): when the pool enters
        such a chunk later, the files already given are skipped (:meth:`_enter`).
        """
        n = min(n, self.rank_remaining(rank))
        if n <= 0:
            return None
        if self.chunk is None and self._left is None:
            self._start()
        if self._left is not None:
            return None  # a rank finishing an epoch its job has left: its files as they come
        dataset, given = self.dataset, self.given
        out: list[int] = []
        for _ in range(draws * n):
            i = rng.randrange(dataset.count)
            if given[i] or dataset.cached[i] or dataset.flying(i, now):
                continue
            out.append(self._give(i))
            if len(out) == n:
                break
        if not out:
            return None
        dataset.fly(out, now + dataset.flight_ttl)
        self.given_by_rank[rank] += len(out)
        chunk = self.chunk
        if self.unread is not None and not self.unread:
            self._leave(now)
        return Claim(self.epoch, (), tuple(out), chunk, self.remaining,
                     advised_fetch=self.advised_fetch())

    # -- chunks ----------------------------------------------------------------------------

    def replanned(self) -> None:
        """The dataset changed its plan (:meth:`DatasetState.replan`): count what was given
        per new chunk and enter one of them at the next claim (the old manager's chunk
        generations mean nothing to the new one: no prelude, no floor)."""
        plan = self.dataset.plan
        self.given_per_chunk = [plan.count_in(c, self.given) for c in range(plan.chunks)]
        self.chunk = None
        self.unread = None
        self.fill = None
        self.thinned = False
        self._left = None
        self._prelude = []
        self.after = None
        if self.dataset.manager is not None:
            self.dataset.manager.attach(self)

    def _start(self) -> None:
        """Enter the epoch's first chunk: the newest loaded one (Quiver: new jobs start on
        the latest chunk); for a job's next epoch, a share of the chunks its previous epoch
        read last, then the chunks drawn after them.

        The resident and loading chunks hold the files the job read last (the loading one
        was drawn from what its last epoch had left). A new epoch that read them all first
        would put them at the end of one epoch and the start of the next; one that skipped
        them would keep them out of its start (the next chunk is drawn while they are
        held, so without them). So the new epoch takes from each of them (oldest first) a
        random ``1 / K`` of its files — the share a uniform order puts in a chunk's worth of
        first places — and leaves the rest to the chunks drawn once those are evicted; it
        does not enter them in full afterwards (``after``). The share is drawn by the
        chunk's generation, the same for every job, so that jobs still read the same files.
        Chunks planned but not loading are released first: drawn for the last epoch, they
        would replay its order (:meth:`ChunkManager.release_planned`)."""
        manager = self.dataset.manager
        if manager is None:
            self._enter(0)
            return
        if self.after is not None:
            manager.release_planned()  # drawn for the last epoch: not this one's order
            self._prelude = [c for c in manager.held() if manager.state(c).pinned]
            # Not entered again in full once their share is read (other jobs' newer chunks
            # still are: that is the co-operation).
            self.after = max([self.after, *map(manager.generation, self._prelude)])
        self._enter_next(0 if manager.newest is None else manager.generation(manager.newest) - 1)

    def _enter_next(self, floor: int) -> None:
        """Enter the next prelude chunk (thinned, see :meth:`_start`) with unread files, else
        the next chunk after generation ``floor`` (:meth:`_chunk_after`)."""
        manager = self.dataset.manager
        assert manager is not None
        while self._prelude:
            c = self._prelude.pop(0)
            if not self._has_unread(c):
                continue
            self._enter(c)
            self._thin(random.Random(f"thin:{self.dataset.name}:{manager.generation(c)}"))
            if self.unread:
                return
            manager.detach_chunk(self, c)  # nothing kept: not a finish
            self.chunk = self.unread = self.fill = None
        if self.after is not None:
            floor = max(floor, self.after)
        chunk = self._chunk_after(floor)
        if chunk is None:
            self._read_left()
        else:
            self._enter(chunk)

    def _thin(self, rng: random.Random) -> None:
        """Keep a random ``1 / K`` of the current chunk's unread files (``K`` chunks)."""
        assert self.unread is not None and self.chunk is not None
        ids = sorted(self.unread)
        keep = set(rng.sample(ids, round(len(ids) / self.dataset.plan.chunks)))
        self.thinned = True
        for i in ids:
            if i not in keep:
                if self.fill is not None and not self.unread.is_cached(i):
                    self.fill.remove(i)
                self.unread.discard(i)

    def _has_unread(self, chunk: int) -> bool:
        return self.given_per_chunk[chunk] < self.dataset.plan.size_of(chunk)

    def _chunk_after(self, floor: int) -> int | None:
        """The next chunk to read: the oldest held chunk (planned, loading or resident)
        drawn after generation ``floor`` that has files unread by the job, else a chunk
        drawn now for it (:meth:`ChunkManager.plan_next`: the job ran ahead of the loads;
        it reads that chunk as misses, and the chunk loads next), else any chunk with
        unread files (an older resident one, or a free one as it is: progress first).
        Moving forward only keeps a job off chunks drawn before its epoch began.

        None (no chunk: :meth:`_claim_left`) for a pool its job has left already: another
        rank reads a later epoch. A chunk drawn for such a pool would be made of the files
        its epoch has left, the ones it read last; the later epoch, entering the chunks
        drawn after its start, read them first (epoch-to-epoch correlation of positions
        −0.1 to −0.45 in tests/unit/test_chunk_order.py, one job of two ranks)."""
        manager = self.dataset.manager
        if manager is None:
            return 0
        for c in manager.held():
            if manager.generation(c) > floor and self._has_unread(c):
                return c
        if self._superseded():
            return None
        c = manager.plan_next(self)
        if c is not None and self._has_unread(c):
            return c
        for c in manager.held():
            if self._has_unread(c):
                return c
        for c in range(self.dataset.plan.chunks):
            if self._has_unread(c):
                return c
        raise AssertionError("no chunk with unread files while files remain")

    def _superseded(self) -> bool:
        """Whether another rank of this job reads a later epoch already (this pool is a rank
        finishing its share of the last one)."""
        return any(pool.job == self.job and pool.epoch > self.epoch for pool in self.dataset.pools)

    def _read_left(self) -> None:
        """Read the rest of the epoch without chunks: the files not given yet, shuffled."""
        left = list(compress(range(self.dataset.count), self.given.translate(INVERT)))
        random.Random(f"left:{self.dataset.name}:{self.job}:{self.epoch}").shuffle(left)
        self._left = left
        self.chunk = self.unread = self.fill = None

    def _claim_left(self, n: int, now: float, batch: int | None) -> tuple[list[int], list[int]]:
        """Up to ``n`` of the files left (:meth:`_read_left`), in their random order: the
        cached ones as hits, the others as misses to fetch (entered in flight), as many as
        the cache can protect (:meth:`_miss_quota`; the rest go back, to come next)."""
        left, dataset = self._left, self.dataset
        assert left is not None
        # Nothing else gives while a pool reads its files left, so none of them is given yet.
        picked = [left.pop() for _ in range(min(n, len(left)))]
        hits = [i for i in picked if dataset.cached[i]]
        fetch = [i for i in picked if not dataset.cached[i]]
        if fetch:
            keep = self._miss_quota(len(fetch), bool(hits), batch)
            left.extend(reversed(fetch[keep:]))
            del fetch[keep:]
        for i in hits + fetch:
            self._mark_given(i)
        dataset.fly(fetch, now + dataset.flight_ttl)
        return hits, fetch

    def _enter(self, chunk: int) -> None:
        """Read ``chunk`` now: copy the plan's templates for its unread set, then sort the
        cached files into their region, moving whichever side is smaller: O(chunk) at C
        speed plus O(min(cached, uncached)) steps."""
        plan, cached = self.dataset.plan, self.dataset.cached
        ids = plan.ids_of(chunk)
        mask = bytes(map(cached.__getitem__, ids))
        size, hits = len(ids), mask.count(1)
        if min(hits, size - hits) * 6 > size:
            # A real mix: one pass over the chunk beats one swap per file of the minority
            # (measured: 0.4 s flat vs up to 1.1 s for 1.3M files half cached).
            unread = UnreadSet.from_mask(ids, mask, plan.count)
        else:
            unread = UnreadSet(plan.ids_of(chunk), plan.index_in_chunk())
            if hits * 2 > size:
                unread.set_all_cached()
                for i in compress(ids, mask.translate(INVERT)):
                    unread.set_cached(i, False)
            else:
                for i in compress(ids, mask):
                    unread.set_cached(i, True)
        if self.given_per_chunk[chunk]:  # a chunk entered again, or files given elsewhere
            for i in compress(ids, bytes(map(self.given.__getitem__, ids))):
                unread.discard(i)
        self.unread = unread
        self.chunk = chunk
        self.thinned = False
        if self.dataset.packing is not None:
            self.fill = FillRates(
                self.dataset.packing, unread.uncached_members(), self.dataset.flying_units
            )
        if self.dataset.manager is not None:
            self.dataset.manager.reference(self, chunk)
            self.generation = self.dataset.manager.generation(chunk)

    def _leave(self, now: float) -> None:
        """The current chunk is given out: tell the manager, move to the next unread chunk."""
        assert self.chunk is not None
        done = self.chunk
        if self.dataset.manager is not None:
            self.dataset.manager.finished(self, done, now, self._drained(done))
        self.chunk = None
        self.unread = None
        self.fill = None
        if self.remaining:
            self._enter_next(self.generation)

    def _drained(self, chunk: int) -> Drained:
        """Whether the job's reads have passed what it was given of ``chunk``, as a test for
        later (False while it cannot tell: the grace's time decides then).

        Where the dataset's mounts report opens, the reads themselves: every file given out
        of ``chunk`` (to this job or another) has been opened (mountd/coop/unopened.py).
        The window below is the guess this replaced, and it failed both ways: a rank whose
        share of the next chunk is smaller than its window cannot be given a window more
        until that chunk loads, which waits for this one's eviction, so the grace's whole
        second passed; and a batch handed to a DataLoader whose workers are the slow side
        is read long after the window says (docs/benchmark-history.md, "Grace ended by
        opens").

        Otherwise, the window: each rank that claimed was given a window more since (never,
        where no rank claimed). A sampler claims again only when the files it holds fall below
        its threshold, so a rank given ``window`` more files has read everything it held at
        this moment (docs/substitutable-reads.md "Grace"). A rank that can claim no more
        (its epoch is given out) never passes: the grace's time decides then. The
        DataLoader's own queue is not counted: its workers read a batch as soon as they are
        sent it, unless they are all busy.

        Which of the two applies is asked each time, not decided at the finish: a job's
        first chunk is given out within its first claims, before its mounts' first report
        of opens comes in (a tick later); decided then, its test was the window's, which a
        DataLoader does not pass while the next chunk waits for this one's slot, and the
        grace's whole time passed (tests/mount/test_shim_chunk_grace.py)."""
        dataset = self.dataset
        given = self.given_by_rank
        marks = [(rank, given[rank] + window) for rank, window in enumerate(self.windows) if window]

        def drained() -> bool:
            if dataset.reports_opens():
                return dataset.chunk_opened(chunk)
            return bool(marks) and all(given[rank] >= mark for rank, mark in marks)

        return drained

    # -- notifications (from DatasetState) -------------------------------------------------

    def on_moved(self, moves: Moves) -> None:
        """Files changed chunk (free chunks re-drawn): keep the per-chunk given counts."""
        given, counts = self.given, self.given_per_chunk
        for (old, new), ids in moves.items():
            n = sum(map(given.__getitem__, ids))
            counts[old] -= n
            counts[new] += n

    def on_cached(self, ids: list[int]) -> None:
        """``ids`` became cached: unread ones of the current chunk become hits."""
        unread, fill = self.unread, self.fill
        if unread is not None:
            for i in ids:
                if fill is not None and i in unread and not unread.is_cached(i):
                    fill.remove(i)
                unread.set_cached(i, True)

    def on_evicted(self, ids: list[int]) -> None:
        """``ids`` left the cache: they are misses again."""
        unread, fill = self.unread, self.fill
        if unread is not None:
            for i in ids:
                if fill is not None and unread.is_cached(i):
                    fill.add(i)
                unread.set_cached(i, False)

