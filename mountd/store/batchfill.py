"""Batched fills inside the cache: files of one bucket filled by one job.

:class:`BatchFills` is the part of :class:`mountd.store.cache.Cache` that fills the files of
the prefetch queue (:meth:`~mountd.store.protection.Protection.prefetch`: a mount's
read-ahead) several at a time, and in fill processes also the readers' misses that arrive
together (:meth:`BatchFills._join_demand_batch`). It is a base class of ``Cache``, like
:class:`~mountd.store.chunkfill.ChunkFills`, and uses the cache's accounting, listed below;
every method runs in the trio thread, atomic between awaits as the cache's own.

Why: a cold pass in digest order is read-ahead's case, and there every fill used to cost
mountd's main process a task's worth of trio scheduling, a message to a fill process and
its answer, a limiter round and a wake-up: ~0.2 ms of the one interpreter that decides for
the whole machine, while the fill itself ran in a fill process (issue 34). A prefetch worker
now takes the files queued right behind the one it waited for that share its bucket, dataset
and uid, up to its share of the queue (:meth:`BatchFills._batch_share`: at most
:data:`PREFETCH_BATCH`), and fills them as one :class:`~mountd.store.fillwork.BatchJob`:
one reservation, one message each way, and a fill slot and a request slot for each file that
runs at once. What a batch keeps exactly as a fill of one file:

* **Single-flight per file.** Every file of the batch gets its own
  :class:`~mountd.store.flights.Flight` in the same trio step as the batch is formed, so a
  reader that misses any of them waits for this job (a reader may wait for the files ahead
  of its own in the batch: at most :data:`PREFETCH_BATCH` of them).
* **Verification.** Each file is verified against its own hash in the fill process; one
  that fails is dropped alone (its waiters get :class:`~quiverfs.base.errors.CorruptObject`),
  the others are stored.
* **Space, quota, protection.** Each file is protected until read (it waited for protection
  room as every prefetch does) and passes the quota check of a new flight; the batch
  reserves the sum of its sizes, charged to its uid, before the job is sent, and each
  file's share turns into use in the trio step its row is indexed.
* **Limits.** In a fill process the batch's files run side by side, one request slot each
  (and one fill slot): the first waited for, the others taken only if free now
  (:meth:`~mountd.store.fill.Filler.fill_batch`), so as many requests overlap as with a job
  per file. In mountd's own threads (``--fill-processes 0``) a batch is one thread, file
  after file, so files go in batches there only when the queue is longer than the workers
  can start one by one.
* **Counters.** One prefetch and one fill per file, one request per GET, as before.

Not batched (filled alone, as before): packed files (a chunk fill is their batch:
:mod:`mountd.store.chunkfill`), files larger than one chunk (they stream), files larger than
the cache, every fill of a cluster member (each asks the peers first), and every fill while
the remote limits pace requests (``--remote-bandwidth``, ``--remote-requests``, a latency:
the bucket is then what bounds the fills, not mountd, and each fill takes its tokens in its
turn, so a claim's misses land in the order asked).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Hashable
from os import PathLike

import trio

from mountd.stats.counters import Counters
from mountd.store.config import CacheConfig
from mountd.store.fill import Filler
from mountd.store.fillpool import Fills
from mountd.store.fillwork import FillStopped, Target
from mountd.store.flights import CacheListener, Flight
from mountd.store.index import Index
from mountd.store.limits import RemoteLimits, SourceSlots
from mountd.store.peers import PeerSource
from mountd.store.quota import Charges
from mountd.store.span import ChunkMembers
from quiverfs.base.backends.base import Location

#: Most queued files one prefetch job fills. Bounds how long a reader that joins a batched
#: file may wait behind the files ahead of it (each a fill's time), and what one worker
#: takes of the queue at once.
PREFETCH_BATCH = 8

#: One item of the prefetch queue: (hash, size, location, dataset, uid charged).
Prefetch = tuple[bytes, int, Location, str | None, int | None]


class BatchFills:
    """Batched prefetch fills of :class:`mountd.store.cache.Cache` (see the module
    docstring)."""

    # What it uses of the cache (set by Cache.__init__ and its methods).
    config: CacheConfig
    counters: Counters
    charges: Charges
    reserved: int
    peers: PeerSource | None
    _flights: dict[bytes, Flight]
    _fill_slots: SourceSlots
    _filler: Filler
    limits: RemoteLimits
    fills: Fills
    _chunk_members: ChunkMembers | None
    _fits: Callable[[int], bool]
    _reserve: Callable[..., Awaitable[None]]
    _record: Callable[[Flight, PathLike[str] | str], None]
    _tell: Callable[[str, Callable[[CacheListener], object]], None]
    _failed: Callable[[Flight, Exception], None]
    _finish: Callable[[Flight], None]
    _notify_space: Callable[[], None]
    _run_flight: Callable[[Flight], Awaitable[None]]
    _take_slot: Callable[[Flight, str], Awaitable[None]]
    _nursery: trio.Nursery | None
    _index: Index | None

    def _init_batches(self) -> None:
        #: Misses waiting for the next demand batch (:meth:`_join_demand_batch`).
        self._demand_batch: list[Flight] = []

    def _batchable(self, size: int) -> bool:
        """Whether a file of ``size`` bytes may share a job at all: no peers to ask first,
        no paced limits, and it does not stream (see the module docstring)."""
        return self.peers is None and not self.limits.paced and size <= self.config.chunk_size

    def _batch_key(self, item: Prefetch) -> Hashable | None:
        """What files must share to be filled in one batch with ``item`` (its bucket, dataset
        and uid), or None: ``item`` is filled alone (see the module docstring)."""
        hash, size, location, dataset, uid = item
        if not self._batchable(size) or not self._fits(size):
            return None
        lookup = self._chunk_members
        if lookup is not None and self.config.span_max_bytes > 0 \
                and lookup(dataset, hash, location):
            return None  # a packed file: a chunk fill brings its neighbours
        return location.url, dataset, uid

    def _batch_share(self, queued: int) -> int:
        """How many of the ``queued`` files a worker takes into one batch: in fill processes
        :data:`PREFETCH_BATCH` (a batch's files run side by side there, one request slot
        each). In mountd's threads a batch's files are read one after another, so there the
        queue is spread over the prefetch workers and files go in batches only when it is
        longer than they can start one by one: as many requests overlap as before (a
        bucket's latency, or a shared filesystem's, is hidden as well as it was)."""
        if self.fills.parallel_batches:
            return PREFETCH_BATCH
        workers = max(1, self.config.prefetch_concurrency)
        return max(1, min(PREFETCH_BATCH, -(-queued // workers)))

    def _join_demand_batch(self, flight: Flight) -> bool:
        """Put mountd's own new ``flight`` (a reader's miss) in the batch of this moment,
        which a task of the cache's nursery runs at its next turn: the misses that arrive
        before it runs (readers miss side by side, and a busy mountd reads their requests
        in bursts) go to the fill processes as one job per bucket, dataset and uid. False:
        ``flight`` is not one to batch (its bytes are supplied, it has a turn among a
        claim's fetches, the cache has peers, the remote limits pace requests, it streams,
        or fills run in mountd's threads); the caller runs it alone. A miss waits no longer
        for this: its own task would have started at the same turn."""
        if not self.fills.parallel_batches or self._nursery is None \
                or flight.source is not None or flight.turn is not None \
                or not self._batchable(flight.size):
            return False
        self._demand_batch.append(flight)
        if len(self._demand_batch) == 1:
            self._nursery.start_soon(self._run_demand_batch)
        return True

    async def _run_demand_batch(self) -> None:
        """Fill the misses :meth:`_join_demand_batch` gathered: a batch per bucket, dataset
        and uid (at most :data:`PREFETCH_BATCH` files each), the first in this task, the
        others in tasks of their own; a lone miss as a fill of its own."""
        flights, self._demand_batch = self._demand_batch, []
        groups: dict[Hashable, list[Flight]] = {}
        for flight in flights:
            groups.setdefault((flight.location.url, flight.dataset, flight.uid), []).append(flight)
        runs = [group[at:at + PREFETCH_BATCH] for group in groups.values()
                for at in range(0, len(group), PREFETCH_BATCH)]
        assert self._nursery is not None
        for later in runs[1:]:
            self._nursery.start_soon(self._run_flights, later)
        await self._run_flights(runs[0])

    async def _run_flights(self, flights: list[Flight]) -> None:
        """``flights`` in one batch, or a lone one as a fill of its own."""
        if len(flights) > 1:
            await self._fetch_batch(flights)
        else:
            await self._run_flight(flights[0])

    async def _fetch_claimed(self, batch: list[Prefetch], turn: int) -> None:
        """A claim's misses (:meth:`~mountd.store.protection.Protection.fetch_now`) as one
        batch with one turn among the claim's fetches: those still missing when it runs (a
        reader may have started one meanwhile: it is left to that flight)."""
        index = self._index
        if index is None:
            return
        wanted = [item for item in batch
                  if item[0] not in self._flights and index.size_of(item[0]) is None]
        flights = self._batch_flights(wanted)
        if not flights:
            return
        flights[0].turn = turn
        await self._run_flights(flights)

    def _batch_flights(self, batch: list[Prefetch]) -> list[Flight]:
        """A flight for each file of ``batch`` that passes the quota check of a new flight
        (one that does not is skipped, as a prefetch that fails it always was), each in
        ``_flights`` from this trio step on."""
        flights = []
        for hash, size, location, dataset, uid in batch:
            try:
                self.charges.check_size(hash, size, uid)
            except Exception:  # noqa: BLE001 - QuotaExceeded: nobody to tell, as before
                continue
            flight = Flight(hash, size, location, dataset, True, uid=uid)
            self._flights[hash] = flight
            flights.append(flight)
        return flights

    async def _fetch_batch(self, flights: list[Flight]) -> None:
        """One job for every file of ``flights`` (same bucket, dataset and uid), each stored
        (or failed) on its own flight as ``Cache._run_flight`` would, under one reservation
        for them all and a fill slot for each that may run at once (the first waited for,
        the others taken only if free now)."""
        counters = self.counters
        first = flights[0]
        url, dataset, uid = first.location.url, first.dataset, first.uid
        background = first.background  # the batch's slots: the queue's share, or any
        left = {f.hash: f for f in flights}  # flights not finished yet
        counters.fills_in_flight += len(flights)
        for flight in flights:
            if flight.prefetch:
                counters.add_prefetch(dataset)
        start = trio.current_time()
        total = sum(f.size for f in flights)
        try:
            await self._take_slot(first, url)  # in the order of its turn, when it has one
            try:
                # A fill slot for each file that may run at once (mountd/store/fill.py says
                # how many do: one request slot each), no more than run at once in a job.
                most = min(len(flights), self.fills.batch_parallel) - 1
                extra = self._fill_slots.take_more(url, most, background) \
                    if self.fills.parallel_batches else 0
                try:
                    await self._reserve(total, uid,
                                        demand=lambda: any(f.demanded() for f in flights))
                    try:
                        targets = tuple(Target.of(f.hash, f.size, f.location) for f in flights)
                        results = await self._filler.fill_batch(
                            targets, url, dataset, since=start, parallel=1 + extra,
                            background=background)
                        self._land(flights, results, start)
                        left.clear()
                        counters.fills_in_flight -= len(flights)
                        for flight in flights:
                            self._finish(flight)
                    finally:
                        self.reserved -= total
                        self.charges.unreserve(uid, total)
                        self._notify_space()
                finally:
                    self._fill_slots.give_back(url, extra, background)
            finally:
                self._fill_slots.release(url, background)
        except trio.Cancelled:
            for content in left:
                left[content].cancelled = True
            raise
        except Exception as exc:
            for flight in left.values():  # no room, or no slot: every file not settled
                self._failed(flight, exc)
        finally:
            counters.fills_in_flight -= len(left)
            for flight in left.values():
                self._finish(flight)

    def _land(self, flights: list[Flight], results: list[str | Exception], start: float) -> None:
        """Settle every file of a batch's job in the trio step its answer came in: a file
        that landed is indexed (it is at its final name already: it must be indexed or
        removed here, whatever happens to the others), one that failed fails alone, one the
        job did not reach because its caller was cancelled is marked so. The caller then
        wakes each flight's waiters. What can be said once for the batch is said once,
        since mountd's main process is what bounds a cold pass on many cores
        (docs/architecture.md "Fills"): one timing of the ``index`` stage, one ``filled``
        event to the listeners, one addition to the fill counters (the files of one job
        took the same time)."""
        wall, cpu = time.perf_counter(), time.thread_time()
        stored: list[Flight] = []
        recorded = 0
        for flight, result in zip(flights, results, strict=True):
            if isinstance(result, FillStopped):
                flight.cancelled = True
                continue
            if isinstance(result, Exception):
                self._failed(flight, result)
                continue
            recorded += 1
            try:
                self._record(flight, result)
            except Exception as exc:
                self._failed(flight, exc)
            else:
                stored.append(flight)
        if recorded:
            self.counters.stages.add("index", time.perf_counter() - wall,
                                     time.thread_time() - cpu, recorded)
        if stored:
            hashes = [flight.hash for flight in stored]
            self._tell("filled", lambda listener: listener.filled(hashes))
            self.counters.add_fill(stored[0].dataset, sum(f.size for f in stored),
                                   trio.current_time() - start, len(stored))
