"""Misses: the flights that answer for a hash, and the fills that store it.

:class:`Misses` is a base class of :class:`mountd.store.cache.Cache` (like
:class:`~mountd.store.chunkfill.ChunkFills`): how a request for a path (``ensure``,
``ensure_supplied``, ``lease``) becomes a hit, or joins or starts the one
:class:`~mountd.store.flights.Flight` of its hash, and how that flight's fill
(:class:`~mountd.store.fill.Filler`, under the fill slots and the remote limits) is stored,
failed or cancelled. This is the hot path of every fill: the cache's other parts meet it in
:meth:`Misses._run_flight` (a reservation: :mod:`mountd.store.space`) and
:meth:`Misses._record` (a row for the group commit: :mod:`mountd.store.commits`). Every
method runs in the trio thread, atomic between awaits as the cache's own; what it uses of the
rest of the cache is listed on the class.

Invariants it keeps:

* A row is inserted in the same trio step as the fill's reservation becomes ``used``
  (:meth:`Misses._stored`), as a row is deleted in the same step as its file is unlinked
  (:mod:`mountd.store.space`). Hence the index and the accounting never disagree while
  mountd runs.
* Single-flight: one flight per hash at a time (``_flights``), so concurrent misses of one
  hash make one remote read; a waiter never hears another authority's failure
  (:meth:`~mountd.store.flights.Flight.fills_for`).
* A file a fill landed for waiting readers is not evicted before they have its path
  (``_landing``, :meth:`Misses._wait_flight`).
* The ``stat`` of a hit (:meth:`Misses._hit`) is a deliberate blocking call in the trio
  thread (microseconds).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Awaitable, Callable, Iterable
from functools import partial

import trio

from mountd.errors import CacheClosed, CacheError, CacheFull, PrefetchNoRoom
from mountd.stats.counters import Counters
from mountd.store import layout
from mountd.store.commits import GROUP_COMMIT_BACKLOG, GROUP_COMMIT_ROWS
from mountd.store.config import CacheConfig
from mountd.store.fill import Filler
from mountd.store.fillpool import Fills, ThreadFills
from mountd.store.flights import CacheListener, Flight
from mountd.store.holds import Holds
from mountd.store.index import Index
from mountd.store.limits import RemoteLimits, SourceSlots, Turns
from mountd.store.peers import PEER_URL, PeerContent, PeerSource, fill_through
from mountd.store.policy import EvictionPolicy
from mountd.store.quota import Charges
from mountd.store.span import ChunkMembers, Span
from mountd.store.supplied import SuppliedBytes
from quiverfs.base.backends import Backend
from quiverfs.base.backends.base import Location
from quiverfs.base.errors import CorruptObject, QuiverError

# The cache's log: every part of Cache logs as "mountd.store.cache".
log = logging.getLogger("mountd.store.cache")


#: Seconds a client may hold a lease (it was told to supply a hash's bytes) before mountd
#: gives the hash to the next requester.
LEASE_SECONDS = 60.0


class Misses:
    """Flights and fills of :class:`mountd.store.cache.Cache` (see the module docstring)."""

    # What it uses of the cache (set by Cache.__init__ and its methods).
    config: CacheConfig
    counters: Counters
    limits: RemoteLimits
    holds: Holds
    charges: Charges
    used: int
    reserved: int
    entries: int
    index: Index
    _index: Index | None
    _policy: EvictionPolicy | None
    _nursery: trio.Nursery | None
    _cache_dir: str
    _disk_size: int | None
    _unsynced: trio.Event
    _rows_waiting: trio.Event
    _rows_full: trio.Event
    _require_open: Callable[[], Index]
    _backend: Callable[[str], Awaitable[Backend]]
    store_path: Callable[[bytes], str]
    _reserve: Callable[..., Awaitable[None]]
    _room_for_fill: Callable[[int], Awaitable[bool]]
    _notify_space: Callable[[], None]
    _notify_protect: Callable[[], None]
    _drop_entries: Callable[..., None]
    _flush_index: Callable[[], None]
    _tell: Callable[[str, Callable[[CacheListener], object]], None]
    _open_span: Callable[[Flight], tuple[Span, list[Flight]] | None]
    _run_span: Callable[[Span, list[Flight]], Awaitable[None]]
    _queued: dict[bytes, bool]
    _join_demand_batch: Callable[[Flight], bool]

    def _init_misses(self, config: CacheConfig, fills: Fills | None) -> None:
        self._flights: dict[bytes, Flight] = {}
        #: Files a fill just landed whose waiting readers have not had their path yet
        #: (:meth:`_wait_flight`): never evicted, and no fill waits for them beyond a step.
        self._landing: dict[bytes, Flight] = {}
        #: Fills at once: ``fill_concurrency`` per source, a quarter more in all, so one
        #: bucket whose fills hang leaves slots to the others (mountd/store/limits.py).
        self._fill_slots = SourceSlots(config.fill_concurrency)
        #: The order in which fills started together take a fill slot (a claim's fetches).
        self._turns = Turns()
        self._chunk_members: ChunkMembers | None = None
        self._span_bytes = 0  # bytes the chunk fills in flight cover (chunkfill.py)
        #: Other caches asked before the bucket (mountd/store/peers.py); None: none.
        self.peers: PeerSource | None = None
        #: Where the data movement of fills runs (mountd/store/fillpool.py): the fill
        #: processes mountd forked, or (by default, and in unit tests) mountd's own threads.
        self.fills: Fills = fills or ThreadFills(config.cache_dir, self._backend,
                                                 config.io_threads)
        self.fills.attach(self._room_for_fill, self.limits.pace)
        self._filler = Filler(self.limits, self.counters, self.fills, config.chunk_size)

    async def ensure(
        self, hash: bytes, size: int, location: Location, dataset: str | None = None,
        *, uid: int | None = None,
    ) -> str:
        """Path of the verified store file for ``hash``, fetching it from ``location`` if needed
        (a fill is charged to ``uid``, within its quota: mountd/store/quota.py).

        Concurrent calls for one hash share one fill (one remote read); all get its path or
        its error. Raises :class:`CorruptObject` (bytes do not match ``hash``/``size``; nothing
        is cached; or the store holds ``hash`` with another size: the content fixes its size,
        so the caller's row is wrong, warm cache or cold), :class:`CacheFull` (larger than the cache, everything else pinned, or no
        disk; :class:`QuotaExceeded` for ``uid``'s quota), backend errors (``NotFound``, ``AccessDenied``, ...), :class:`CacheClosed`.

        Cancellation: cancelling a caller never leaves a partial file. With :meth:`run`
        started the fill goes on for the other waiters; without it the caller runs the fill
        itself and the other waiters start over.
        """
        hash = layout.check_hash(hash)
        path = self._hit(hash, size, dataset)
        if path is None:
            self.counters.add_miss(dataset)
            path = await self._await_fill(hash, size, location, dataset, prefetch=False, uid=uid)
        self._answered(hash, size)
        return path

    def _answered(self, hash: bytes, size: int) -> None:
        """A path is answered: the file counts as read (its protection ends) and is held
        until its client opened it. Every answer (``ensure``, ``ensure_supplied``, ``lease``)
        does this: an open descriptor survives an unlink, so answer -> open is the only
        window in which an eviction can fail a reader (mountd/store/holds.py)."""
        if self.holds.consumed((hash,)):
            self._notify_protect()
        self.holds.hold(hash, size)

    def _hit(self, hash: bytes, size: int, dataset: str | None) -> str | None:
        """The store path of an indexed ``hash`` (counted as a hit), else None."""
        index = self._require_open()
        stored = index.size_of(hash)
        if stored is None:
            return None
        if stored != size:
            raise self._size_mismatch(hash, stored, size, dataset)
        path = self.store_path(hash)
        # Clients call ensure() when they did not find the file, so check it is really
        # there (a row without a file: removed behind our back). One stat, no thread.
        if os.path.exists(path):
            index.touch([hash], dataset)
            assert self._policy is not None
            self._policy.on_access([hash])
            self.counters.add_hits(dataset, 1, size)
            return path
        log.warning("indexed file %s is missing; refetching it", path)
        self._drop_entries([hash], reason="missing")
        return None

    def _landed(self, hash: bytes, size: int, dataset: str | None) -> str | None:
        """The path of ``hash`` once a fill landed it (referenced by ``dataset``), else None;
        unlike :meth:`_hit` not counted (the caller's miss already was)."""
        index = self._require_open()
        stored = index.size_of(hash)
        if stored is None:
            return None
        if stored != size:
            raise self._size_mismatch(hash, stored, size, dataset)
        index.touch([hash], dataset)
        return self.store_path(hash)

    async def ensure_supplied(
        self, hash: bytes, size: int, location: Location, source: SuppliedBytes,
        dataset: str | None = None, *, uid: int | None = None, counted: bool = False,
    ) -> str:
        """Path of the verified store file for ``hash``, filled from bytes a client supplied
        (:mod:`mountd.store.supplied`) when it is not cached: mountd's own authority is never
        used; a fill is charged to ``uid``, the supplier. Takes ``source`` over: it is closed
        when this returns, or by the fill it started.

        A fill of the same hash already in flight (anyone's) is waited for; if it fails or is
        given up, this caller fills from its own bytes instead, and never hears why the other
        failed. The caller's own lease (it was told to supply, :meth:`lease`) is filled now.
        Errors are those of :meth:`ensure` for the caller's own bytes; ``source`` not holding
        ``size`` bytes matching ``hash`` is :class:`CorruptObject`. ``counted``: the
        caller has counted this request's hit or miss already."""
        hash = layout.check_hash(hash)
        try:
            path = None if counted else self._hit(hash, size, dataset)
            if path is None:
                if not counted:
                    self.counters.add_miss(dataset)
                path = await self._await_fill(hash, size, location, dataset, prefetch=False,
                                              source=source, uid=uid)
            self._answered(hash, size)
            return path
        finally:
            if not source.adopted:
                source.close()

    async def lease(self, hash: bytes, size: int, dataset: str | None, holder: object,
                    *, uid: int | None = None) -> str | None:
        """Path of ``hash`` when it is cached (or once a fill in flight lands), else None:
        the caller must supply the bytes (:meth:`ensure_supplied`) with its own rights.

        A None answer leases the hash to ``holder``: others asking for it wait until the
        holder supplies it, gives it up (:meth:`release`), or :data:`LEASE_SECONDS` pass;
        then the next of them is asked to supply. Co-operative single-flight across users
        without lending anyone mountd's authority. Content that can never fit ``uid``'s quota
        is :class:`QuotaExceeded` at once (the holder's supply is charged to its uid)."""
        hash = layout.check_hash(hash)
        path = self._hit(hash, size, dataset)
        if path is not None:
            self._answered(hash, size)
            return path
        self.counters.add_miss(dataset)
        path = await self._from_peers(hash, size, dataset, uid)
        if path is not None:
            self._answered(hash, size)
            return path
        while True:
            path = self._landed(hash, size, dataset)
            if path is not None:
                self._answered(hash, size)
                return path
            flight = self._flights.get(hash)
            if flight is None:
                if not self._fits(size):
                    raise self._larger_than_cache(hash, size)
                self.charges.check_size(hash, size, uid)
                flight = Flight(hash, size, Location("", "", 0, size), dataset, prefetch=False,
                                 lease=holder, started=False, uid=uid)
                self._flights[hash] = flight
                if self._nursery is not None:
                    self._nursery.start_soon(self._expire_lease, flight)
                return None
            if flight.lease is holder and not flight.started:
                return None  # asked again before supplying: still ours
            flight.awaited = True
            await self._wait_flight(flight)
            if flight.path is not None and flight.error is None and not flight.cancelled:
                if dataset is not None and dataset != flight.dataset:
                    self.index.touch([hash], dataset)
                self._answered(hash, size)
                return flight.path
            # Failed or given up by someone else: ask again (never their error).

    async def _from_peers(self, hash: bytes, size: int, dataset: str | None,
                          uid: int | None) -> str | None:
        """A lease's miss served by a peer's copy (mountd/store/peers.py): the path once
        stored, charged to ``uid`` like bytes it supplied; None when no peer has it, a fill
        is already in flight here (joining it is the lease loop's job), or storing it
        failed (then the client supplies, and hears its own error if any)."""
        if self.peers is None or hash in self._flights or not self._fits(size):
            return None
        content = await self.peers.find(hash, size)
        if content is None:
            return None
        location = Location(PEER_URL, hash.hex(), 0, size)
        try:
            return await self.ensure_supplied(hash, size, location, content, dataset,
                                              uid=uid, counted=True)
        except QuiverError as exc:
            log.info("a peer's copy of %s was not stored: %s", hash.hex(), exc)
            return None

    def release(self, holder: object, hashes: Iterable[bytes] | None = None) -> int:
        """Give up ``holder``'s leases that have not started (of ``hashes``, or all: its
        connection closed); waiters are asked to supply instead. Returns how many went."""
        wanted = None if hashes is None else {layout.check_hash(h) for h in hashes}
        gone = [f for f in self._flights.values()
                if f.lease is holder and not f.started and (wanted is None or f.hash in wanted)]
        for flight in gone:
            self._give_up(flight)
        return len(gone)

    def _give_up(self, flight: Flight) -> None:
        flight.cancelled = True
        if self._flights.get(flight.hash) is flight:
            del self._flights[flight.hash]
        flight.done.set()

    async def _expire_lease(self, flight: Flight) -> None:
        await trio.sleep(LEASE_SECONDS)
        if not flight.started and not flight.done.is_set():
            log.warning("lease of %s not supplied within %.0f s; asking the next requester",
                        flight.hash.hex(), LEASE_SECONDS)
            self._give_up(flight)

    async def _await_fill(
        self, hash: bytes, size: int, location: Location, dataset: str | None, prefetch: bool,
        source: SuppliedBytes | None = None, uid: int | None = None, absent: bool = False,
        turn: int | None = None,
    ) -> str:
        """Join or start the flight of ``hash``: with mountd's authority (``source`` None) or
        from ``source``, charged to ``uid``. A flight of another authority that fails is not
        this caller's failure: it looks again and fills with its own (see
        :meth:`Flight.fills_for`). ``absent``: the caller has just seen the index lack
        ``hash``, with no await since (one index lookup saved per prefetch). ``turn``: the
        fill's ticket in the order of a claim's fetches (:class:`Turns`), for the flight it
        starts (one that joins another's flight never takes limits: its ticket is unused)."""
        while True:
            path = None if absent else self._landed(hash, size, dataset)  # filled meanwhile?
            absent = False
            if path is not None:
                return path
            flight = self._flights.get(hash)
            if flight is not None and source is not None and flight.lease is not None \
                    and flight.lease is source.holder and not flight.started:
                # Our own lease: fill it now, from our bytes.
                flight.lease, flight.source, flight.started = None, source, True
                flight.uid = uid
                source.adopted = True
                self._start(flight)
            elif flight is not None and flight.size != size:
                # Another caller fills this hash with another size: at most one of the two
                # is the content's. Let that fill decide, then look again.
                await flight.done.wait()
                continue
            if flight is None:
                if not self._fits(size):
                    if source is not None:
                        raise self._larger_than_cache(hash, size)
                    raise await self._too_large(hash, size, location, dataset)
                self.charges.check_size(hash, size, uid)
                flight = Flight(hash, size, location, dataset, prefetch, source=source, uid=uid,
                                turn=turn)
                if source is not None:
                    source.adopted = True
                self._flights[hash] = flight
                # A prefetch runs in a task of the cache's own nursery: it fills inline.
                await self._launch(flight, inline=prefetch)
            if not prefetch:
                flight.awaited = True  # a reader waits: its fill may end protections for room
            await self._wait_flight(flight)
            if flight.cancelled:
                if source is not None and flight.source is source:
                    raise CacheClosed("the fill of the supplied bytes was cancelled")
                continue
            if flight.error is not None and not flight.fills_for(source):
                continue  # someone else's failure: try with our own authority
            if flight.error is not None:
                # The same error object for every waiter (the fill's traceback is in the log);
                # reset its traceback so fifty waiters do not stack fifty tracebacks.
                raise flight.error.with_traceback(None)
            assert flight.path is not None
            if dataset is not None and dataset != flight.dataset:
                self.index.touch([hash], dataset)
            return flight.path

    async def _wait_flight(self, flight: Flight) -> None:
        """Wait for ``flight`` to end. A file it landed stays in :attr:`_landing` until the
        last of its waiters is back here: they answer its path (and hold it) in the same
        trio step, so a fill running between the landing and that step cannot evict it.
        Without this, a small cache whose older files were all held or protected evicted
        the newest file before its reader got the path, and that reader filled it again."""
        flight.waiting += 1
        try:
            await flight.done.wait()
        finally:
            flight.waiting -= 1
            if not flight.waiting and self._landing.get(flight.hash) is flight:
                del self._landing[flight.hash]
                self._notify_space()

    def _size_mismatch(self, hash: bytes, stored: int, size: int, dataset: str | None) -> CorruptObject:
        """The error for asking ``size`` bytes of ``hash`` when its verified content has
        ``stored``: counted as a verify failure and logged once (a fill of that row would
        have failed verification the same way)."""
        self.counters.add_verify_failure(dataset)
        error = CorruptObject(
            f"the store holds {hash.hex()} as {stored} bytes, but {size} were asked: "
            "the digest row is damaged")
        log.warning("verify failure: %s", error)
        return error

    @property
    def capacity(self) -> int:
        """Bytes the store can hold at most: the cap, or the filesystem holding the store
        when that is smaller (known once open)."""
        if self._disk_size is None:
            return self.config.cache_size
        return min(self.config.cache_size, self._disk_size)

    def _fits(self, size: int) -> bool:
        """Whether content of ``size`` bytes can be cached at all: not larger than the cache,
        nor than the filesystem holding it."""
        return size <= self.capacity

    async def _too_large(self, hash: bytes, size: int, location: Location,
                         dataset: str | None) -> QuiverError:
        """The error for content larger than the whole cache (or its disk: :meth:`_fits`),
        which cannot be filled.

        One ``stat`` of the object first: when the object cannot even hold ``size`` bytes at
        its offset, the digest row lies about the size, and the answer is the one a warm cache
        gives for a lying row (:class:`CorruptObject`, a verify failure: EIO), not "raise
        --cache-size". Otherwise :class:`CacheFull` (ENOSPC)."""
        info = await (await self._backend(location.url)).stat(location.key)
        if location.offset + size > info.size:
            self.counters.add_verify_failure(dataset)
            error = CorruptObject(
                f"{hash.hex()} is said to be {size} bytes at offset {location.offset}, but the "
                f"object holds {info.size}: the digest row is damaged",
                url=location.url, key=location.key)
            log.warning("verify failure: %s", error)
            return error
        self.counters.add_fill_error(dataset)
        return self._larger_than_cache(hash, size)

    def _larger_than_cache(self, hash: bytes, size: int) -> CacheFull:
        """The error for content :meth:`_fits` refuses; one log line when the disk is what
        refuses it (the cap is the operator's choice; a disk smaller than it is news)."""
        if size > self.config.cache_size:
            return CacheFull(
                f"object {hash.hex()} ({size} bytes) is larger than the whole cache "
                f"({self.config.cache_size} bytes); raise --cache-size")
        error = CacheFull(
            f"no space left on the device holding {self._cache_dir} for object {hash.hex()} "
            f"({size} bytes): it is larger than the whole filesystem ({self._disk_size} "
            "bytes); give the cache a larger disk")
        log.warning("%s", error)
        return error

    def _start(self, flight: Flight) -> None:
        assert self._nursery is not None
        self._nursery.start_soon(self._run_flight, flight)

    async def _launch(self, flight: Flight, *, inline: bool = False) -> None:
        """Run the new ``flight``: as a chunk fill with its siblings when it is a member of a
        packed object (:meth:`ChunkFills._open_span`), with the other misses of this moment
        in one batch (:meth:`BatchFills._join_demand_batch`), else alone; in the cache's
        nursery when :meth:`run` is running (so a cancelled requester does not cancel it for
        the others), else, or when the caller is a task of that nursery already
        (``inline``: the prefetches), in the caller."""
        opened = self._open_span(flight)
        if opened is None and not inline and self._join_demand_batch(flight):
            return
        run = self._run_flight if opened is None else partial(self._run_span, *opened)
        args = (flight,) if opened is None else ()
        if self._nursery is not None and not inline:
            self._nursery.start_soon(run, *args)
        else:
            await run(*args)

    async def _run_flight(self, flight: Flight) -> None:
        counters = self.counters
        counters.fills_in_flight += 1
        if flight.prefetch:
            counters.add_prefetch(flight.dataset)
        start = trio.current_time()
        uid = flight.uid  # fixed once the fill runs: its reservation and its charge
        try:
            source = flight.slot_source
            await self._take_slot(flight, source)
            try:
                await self._reserve(flight.size, uid, demand=flight.demanded)
                try:
                    if flight.source is None and self.peers is not None:
                        path = await fill_through(self.peers, self._filler, flight)
                    else:
                        path = await self._filler.fill(
                            flight.source, flight.hash, flight.size, flight.location,
                            flight.dataset, since=start, background=flight.background)
                    self._stored(flight, path)
                    if self.peers is not None and flight.source is not None \
                            and not isinstance(flight.source, PeerContent):
                        self.peers.landed(flight.hash)  # a client's bytes: share them
                finally:
                    self.reserved -= flight.size
                    self.charges.unreserve(uid, flight.size)
                    self._notify_space()
            finally:
                self._fill_slots.release(source, flight.background)
            counters.add_fill(flight.dataset, flight.size, trio.current_time() - start)
        except trio.Cancelled:
            flight.cancelled = True
            raise
        except Exception as exc:
            self._failed(flight, exc)
        finally:
            counters.fills_in_flight -= 1
            self._finish(flight)

    async def _take_slot(self, flight: Flight, source: str) -> None:
        """A fill slot for ``flight``: in the order of its ticket when it has one (a claim's
        fetches: :class:`~mountd.store.limits.Turns`). From the slot on, a fill reaches the
        remote limits without waiting unless it must wait for room or tokens, so the order
        of the slots is the order of the bandwidth."""
        turn = flight.turn
        if turn is None:
            await self._fill_slots.take(source, flight.background)
            return
        await self._turns.arrive(turn)
        try:
            await self._fill_slots.take(source)
        finally:
            self._turns.leave(turn)

    def _stored(self, flight: Flight, path: os.PathLike[str] | str) -> None:
        """The file of ``flight`` is at its final name: index it in this same trio step as
        its reservation turns into use (no await in between; the caller releases the
        reservation). Timed as the ``index`` stage of ``fill_stages``. (The files of a
        batch are recorded together: :meth:`BatchFills._land`.)"""
        wall, cpu = time.perf_counter(), time.thread_time()
        try:
            self._record(flight, path)
        finally:
            self.counters.stages.add("index", time.perf_counter() - wall,
                                     time.thread_time() - cpu)
        self._tell("filled", lambda listener: listener.filled((flight.hash,)))

    def _record(self, flight: Flight, path: os.PathLike[str] | str) -> None:
        """:meth:`_stored`'s work, but for telling the listeners (the caller tells them,
        once for every file it recorded)."""
        # The row is written with the next batch; a row SQLite cannot store (disk full) is
        # settled by _flush_index, which evicts and retries, or removes the file.
        # Not _require_open(): a fill that lands while the cache closes (its job was sent
        # before, and is waited for) is indexed too; aclose closes the index only once every
        # fill is over. Refused, the file stayed at its final name with no row, and the index
        # was then marked clean: a file never adopted, never counted.
        index = self._index
        if index is None:
            raise CacheClosed("the cache is not open (call open() first, or it was closed)")
        index.insert(flight.hash, flight.size, flight.dataset, flight.uid)
        self._queued.pop(flight.hash, None)  # landed: a prefetch queued for it has no work left
        self._unsynced.set()
        self.used += flight.size
        self.entries += 1
        self.charges.charge(flight.uid, flight.size)
        assert self._policy is not None
        self._policy.on_insert(flight.hash, flight.size)
        if flight.awaited and flight.waiting:
            self._landing[flight.hash] = flight  # until its readers have the path
        if self._nursery is None or index.pending >= GROUP_COMMIT_BACKLOG:
            self._flush_index()  # no committer, or it fell far behind
        else:
            self._rows_waiting.set()
            if index.pending >= GROUP_COMMIT_ROWS:
                self._rows_full.set()
        flight.path = str(path)

    def _failed(self, flight: Flight, exc: Exception) -> None:
        """``flight`` failed for good: counted and logged once, its waiters get ``exc``."""
        counters = self.counters
        if isinstance(exc, CorruptObject):
            counters.add_verify_failure(flight.dataset)
            log.warning("verify failure: %s", exc)  # once per event, with the location
            flight.error = exc
        elif isinstance(exc, PrefetchNoRoom):
            # Nobody waits for it: dropped, not an error (a reader fetches it on demand).
            counters.add_prefetch_dropped(flight.dataset)
            log.debug("prefetch of %s dropped: %s", flight.hash.hex(), exc)
            flight.error = exc
        elif isinstance(exc, QuiverError):
            counters.add_fill_error(flight.dataset)
            log.warning("fill of %s failed: %s", flight.hash.hex(), exc)
            flight.error = exc
        else:
            counters.add_fill_error(flight.dataset)
            log.error("fill of %s failed unexpectedly", flight.hash.hex(), exc_info=exc)
            error = CacheError(f"fill of {flight.hash.hex()} failed: {type(exc).__name__}: {exc}")
            error.__cause__ = exc
            flight.error = error
        self._tell("fill_failed", lambda listener: listener.fill_failed(flight.hash))

    def _finish(self, flight: Flight) -> None:
        """``flight`` is over (stored, failed or cancelled): wake its waiters."""
        if self._flights.get(flight.hash) is flight:
            del self._flights[flight.hash]
        if flight.source is not None:
            flight.source.close()
        if (flight.error is not None or flight.cancelled) and \
                self.holds.forget((flight.hash,), "removed"):
            self._notify_protect()  # nothing to keep: its share is free for the next
        flight.done.set()
