"""What the cache keeps for readers to come: pins, and files fetched ahead until they are read.

:class:`Protection` is a base class of :class:`mountd.store.cache.Cache` (like
:class:`~mountd.store.chunkfill.ChunkFills`): the cache's side of
:mod:`mountd.store.holds`. Pins (the session layer's chunks) never leave by eviction, and
size the share of the cache that protections may take (:meth:`Protection._cap_protection`);
files fetched ahead (a claim's misses, :meth:`Protection.fetch_now`, and the mounts'
prefetch queue, :meth:`Protection.prefetch`) and a claim's hits
(:meth:`Protection.protect_hits`) are protected until read, and wait (oldest
first) for that share to have room instead of evicting other protected files. Every method
runs in the trio thread, atomic between awaits as the cache's own; what it uses of the rest
of the cache is listed on the class.
"""

from __future__ import annotations

import contextlib
from collections import Counter, OrderedDict, deque
from collections.abc import Awaitable, Callable, Hashable, Iterable, Sequence

import trio

from mountd.errors import CacheClosed
from mountd.store import layout
from mountd.store.batchfill import PREFETCH_BATCH, Prefetch
from mountd.store.config import CacheConfig
from mountd.store.fillpool import Fills
from mountd.store.flights import Flight
from mountd.store.holds import HOLD_SHARE, Displaced, Holds
from mountd.store.index import Index
from mountd.store.limits import Turns
from quiverfs.base.backends.base import Location
from quiverfs.base.errors import QuiverError

#: Seconds after a dataset's mounts last reported an open (:meth:`Protection.record_opened`)
#: during which a claim's hits are protected until read (:meth:`Protection.protect_hits`).
#: A mount reports every open its readers' ``open()`` makes (quiverfs/fuse/worker.py);
#: readers that send none (``os.open``, the pyfuse3 front end) leave their hits unprotected.
OPENS_SEEN_SECONDS = 60.0

#: A prefetch waiting for protection room: (size, location, dataset, owner, trio time queued).
WaitingFetch = tuple[int, Location, str | None, Hashable, float]


class _Waiting:
    """Prefetches waiting for protection room (:meth:`Protection.fetch_now`), oldest first,
    with their bytes and their count per owner: the claims ask how much room is left once
    these start (:meth:`Protection.protect_room`) and how many files a job has coming
    (:meth:`Protection.protect_pending`), so they must not walk the queue."""

    def __init__(self) -> None:
        self._items: OrderedDict[bytes, WaitingFetch] = OrderedDict()
        self.bytes = 0
        self.by_owner: Counter[Hashable] = Counter()

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, content_hash: object) -> bool:
        return content_hash in self._items

    def add(self, content_hash: bytes, item: WaitingFetch) -> None:
        self._items[content_hash] = item
        self.bytes += item[0]
        self.by_owner[item[3]] += 1

    def pop(self, content_hash: bytes) -> None:
        size, _, _, owner, _ = self._items.pop(content_hash)
        self.bytes -= size
        self.by_owner[owner] -= 1
        if not self.by_owner[owner]:
            del self.by_owner[owner]

    def oldest(self) -> tuple[bytes, WaitingFetch]:
        return next(iter(self._items.items()))

    def owned_by(self, owner: Hashable) -> list[bytes]:
        return [h for h, item in self._items.items() if item[3] == owner]


class Protection:
    """Pins, protections and prefetches of :class:`mountd.store.cache.Cache` (see the module
    docstring)."""

    # What it uses of the cache (set by Cache.__init__ and its methods).
    config: CacheConfig
    _index: Index | None
    _nursery: trio.Nursery | None
    _flights: dict[bytes, Flight]
    _turns: Turns
    _require_open: Callable[[], Index]
    _notify_space: Callable[[], None]
    _await_fill: Callable[..., Awaitable[str]]
    _batch_key: Callable[[Prefetch], Hashable | None]
    _batch_share: Callable[[int], int]
    _batch_flights: Callable[[list[Prefetch]], list[Flight]]
    _run_flights: Callable[[list[Flight]], Awaitable[None]]
    _fetch_claimed: Callable[[list[Prefetch], int], Awaitable[None]]
    fills: Fills

    def _init_protection(self, config: CacheConfig) -> None:
        #: Files whose path was just answered, kept from eviction until their client opens
        #: them, and files fetched ahead, protected until read (mountd/store/holds.py).
        self.holds = Holds(int(config.cache_size * HOLD_SHARE),
                           protect_bytes=int(config.cache_size * config.protect_share),
                           protect_seconds=config.protect_seconds)
        self.holds.sweep_bytes = int(config.cache_size * config.sweep_share)
        #: The pinned bytes the protection cap was last sized for (:meth:`_cap_protection`).
        self._protect_cap_pinned = 0
        #: Files that will be pinned once they land (a loading chunk's: :meth:`expect_pins`),
        #: hash -> size, and their bytes: the protection cap counts them as pinned already.
        self._expected_pins: dict[bytes, int] = {}
        self._expected_bytes = 0
        #: Prefetches waiting for protection room (:meth:`fetch_now`), oldest first.
        self._waiting = _Waiting()
        #: Set and replaced whenever protections end (waiting prefetches may start).
        self._protect_changed = trio.Event()
        #: The prefetch queue (:meth:`prefetch`), oldest first, its hashes, and the workers
        #: waiting for it to have files (a worker looks at the file after the one it took:
        #: :meth:`_prefetch_worker`, so not a channel).
        self._prefetches: deque[Prefetch] = deque()
        #: queued hash -> whether a mount's bounded sweep asked for it (``renew``: its gate
        #: is the sweep's share, Holds.fits)
        self._queued: dict[bytes, bool] = {}
        self._prefetch_idle = trio.lowlevel.ParkingLot()
        #: dataset -> when its mounts last reported opens (:meth:`record_opened`)
        self._opens_seen: dict[str | None, float] = {}

    def pin(self, hashes: Sequence[bytes]) -> int:
        """Never evict these (indexed) hashes until :meth:`unpin`; returns entries pinned."""
        hashes = [layout.check_hash(h) for h in hashes]
        pinned = self._require_open().set_pinned(hashes, True)
        self._unexpect(hashes)
        self._cap_protection()
        return pinned

    def unpin(self, hashes: Sequence[bytes]) -> int:
        """Make pinned hashes evictable again (and drop them from the pins expected);
        returns entries changed."""
        hashes = [layout.check_hash(h) for h in hashes]
        changed = self._require_open().set_pinned(hashes, False)
        self._unexpect(hashes)
        self._cap_protection()
        self._notify_space()
        return changed

    def expect_pins(self, items: Iterable[tuple[bytes, int]]) -> None:
        """These files, not stored yet, will be pinned as they land (a chunk starts loading):
        the protection cap counts them as pinned from now on, until :meth:`pin` or
        :meth:`unpin` names them. Otherwise the cap grew while a chunk's slot was empty
        (the old chunk evicted, the new one not in yet), prefetches for claims filled the
        slot's room, and the chunk's own fills waited behind them: at 600 files a chunk
        then took 3 s to load instead of 0.2 s, and readers ran out of cached files."""
        for hash, size in items:
            hash = layout.check_hash(hash)
            if hash not in self._expected_pins:
                self._expected_pins[hash] = size
                self._expected_bytes += size
        self._cap_protection()

    def _unexpect(self, hashes: Iterable[bytes]) -> None:
        if self._expected_pins:
            for hash in hashes:
                self._expected_bytes -= self._expected_pins.pop(hash, 0)

    def _cap_protection(self) -> None:
        """Let protections take ``protect_share`` of the room that pinned files leave, not of
        the whole cache. With chunks pinned (80% of a small cache) a share of the whole
        cache let prefetches protect all of the rest: every read on demand then had to end
        a protection, the file it took was read on demand in turn, and so on (at 600 files,
        20% cache, four jobs: 531 of 3,104 fills in three epochs, scripts/bench/shim_vs_lru.py;
        docs/benchmarks.md). Called whenever the pinned bytes may have changed."""
        pinned = self._require_open().pinned_bytes + self._expected_bytes
        if pinned == self._protect_cap_pinned:
            return
        grew = pinned < self._protect_cap_pinned
        self._protect_cap_pinned = pinned
        room = max(0, self.config.cache_size - pinned)
        self.holds.protect_bytes = int(room * self.config.protect_share)
        self.holds.sweep_bytes = int(room * self.config.sweep_share)
        if grew:
            self._notify_protect()  # more room: waiting prefetches may start

    def fetch_now(
        self, items: Sequence[tuple[bytes, int, Location]], dataset: str | None = None,
        *, protect: bool = True, owner: Hashable = None,
    ) -> int:
        """Start fills for ``items`` at once, ahead of the prefetch queue (a claim's misses:
        the job reads them next). Returns how many fills were started; cached and in-flight
        hashes are skipped. The fills still run under the fill limiter and the remote limits,
        and count as prefetches. Needs :meth:`run` (its nursery owns the fills).

        ``protect``: each file is protected for ``owner`` from now until it is read, the
        owner releases it (:meth:`release_protection`), or ``protect_seconds`` pass
        (mountd/store/holds.py). An item the protection share has no room for *waits*
        (oldest first) and starts as reads free room; it is dropped when it waited longer
        than ``protect_seconds`` or its owner is released. ``protect=False``: started at
        once, unprotected (a chunk preload: its chunk's pin keeps it)."""
        index = self._require_open()
        if self._nursery is None:
            raise CacheClosed("fetch_now needs the cache's workers (Cache.run) to be running")
        started: set[bytes] = set()
        holds = self.holds
        now = trio.current_time()
        chosen: list[Prefetch] = []
        for hash, size, location in items:
            hash = layout.check_hash(hash)
            if hash in started or index.size_of(hash) is not None:
                continue
            if protect and hash in self._flights:
                # already coming: keep it once it lands
                holds.protect(hash, size, owner, (location, dataset))
                continue
            if hash in self._flights:
                continue
            if protect:
                if self._waiting or not holds.fits(size):
                    if hash not in self._waiting and len(self._waiting) < self.config.prefetch_queue:
                        self._waiting.add(hash, (size, location, dataset, owner, now))
                    continue
                holds.protect(hash, size, owner, (location, dataset))
            started.add(hash)
            chosen.append((hash, size, location, dataset, None))
        self._start_claimed(chosen)
        return len(started)

    def record_opened(self, dataset: str | None, hashes: Sequence[bytes]) -> None:
        """Files of ``dataset`` a reader opened (its mount saw the open, whether the kernel's
        pages or the store served the bytes): read, so their protections end. Not hits (a
        hit report counts those that reached the store) and no change of recency."""
        self._opens_seen[dataset] = trio.current_time()
        if self.holds.consumed(hashes):
            self._notify_protect()

    def reports_opens(self, dataset: str | None) -> bool:
        """Whether ``dataset``'s mounts report opens: one came within
        :data:`OPENS_SEEN_SECONDS` (:meth:`record_opened`). Only then does a file's missing
        open mean that nobody read it (a reader that sends none reads without one)."""
        seen = self._opens_seen.get(dataset)
        return seen is not None and trio.current_time() - seen <= OPENS_SEEN_SECONDS

    def protect_hits(self, items: Sequence[tuple[bytes, int, Location]],
                     dataset: str | None = None, *, owner: Hashable = None) -> int:
        """Keep a claim's hits (cached files handed to a job to read next) until they are
        read, like its misses once fetched: the same protection, for ``owner``, ended by the
        read, the owner's release or ``protect_seconds``. Only for a dataset whose mounts
        report opens (:meth:`reports_opens`): a hit is
        usually read from the kernel's pages, which only the open reveals; without it the
        protection would outlive the read and hold its room until the epoch's end. Pinned
        files (a chunk's) need none. Not gated by the protection share (nothing is fetched;
        a claim's hits are never held back), but counted in it, so the claim's misses wait
        for the room its hits leave. Returns how many were protected.

        Why: a job's DataLoader asks for more files than a small cache holds (4 workers ×
        2 batches of 64 against 400 files at a 20% cache), so the misses a new epoch's
        claims fetch made room by evicting the hits the same claims had just handed out,
        least recently used, and the loader read those on demand: its second epoch ran at
        0.77 of its first (`peers.py` (b), docs/benchmark-history.md)."""
        if not self.reports_opens(dataset):
            return 0
        index = self._require_open()
        holds = self.holds
        stored = [(h, size, location) for h, size, location in items
                  if index.size_of(h) is not None]
        if not stored:
            return 0
        pinned = index.pinned_of([h for h, _, _ in stored])
        kept = 0
        for h, size, location in stored:
            if h not in pinned:
                holds.protect(h, size, owner, (location, dataset), kept=True)
                kept += 1
        return kept

    def _start_claimed(self, items: list[Prefetch]) -> None:
        """Start the fills of a claim's misses, each with a turn in the order asked: in fill
        processes neighbours that can share a job go as one batch with one turn
        (mountd/store/batchfill.py), the others alone."""
        assert self._nursery is not None
        batch: list[Prefetch] = []
        batch_key: Hashable | None = None
        for item in items:
            key = self._batch_key(item) if self.fills.parallel_batches else None
            if key is not None and key == batch_key and len(batch) < PREFETCH_BATCH:
                batch.append(item)
                continue
            if batch:
                self._nursery.start_soon(self._fetch_claimed, batch, self._turns.ticket())
            batch, batch_key = ([item], key) if key is not None else ([], None)
            if key is None:
                # Two tasks for one hash (a second claim before this one's task ran) still
                # make one remote read: the later joins the earlier's flight (single-flight).
                self._nursery.start_soon(self._fetch_now, *item[:4], self._turns.ticket())
        if batch:
            self._nursery.start_soon(self._fetch_claimed, batch, self._turns.ticket())

    def _refetch_later(self, displaced: Sequence[Displaced]) -> int:
        """Files an on-demand miss evicted while protected (:meth:`Space._evict_protected`)
        wait for protection room again, as a claim's misses do, for one of their owners:
        their job has still to read them, and fetched again before it does they are hits
        rather than the next on-demand miss. Files protected for nobody in particular (the
        mounts' read-ahead) are let go. Returns how many wait."""
        now = trio.current_time()
        queued = 0
        for item in displaced:
            if item.source is None or not item.owners or item.hash in self._waiting \
                    or len(self._waiting) >= self.config.prefetch_queue:
                continue
            location, dataset = item.source
            self._waiting.add(item.hash, (item.size, location, dataset, next(iter(item.owners)),
                                          now))
            queued += 1
        return queued

    def protect_room(self) -> int:
        """Bytes protections may still take once the waiting prefetches have started: what
        a claim may add without its misses waiting (and then being read on demand, which
        ends other jobs' protections)."""
        return max(0, self.holds.room() - self._waiting.bytes)

    def protect_pending(self, owner: Hashable) -> int:
        """Files fetched ahead for ``owner`` and not read yet: protected now, or waiting for
        room (a job's claimed misses its readers have still to read)."""
        return self.holds.owned(owner) + self._waiting.by_owner.get(owner, 0)

    def release_protection(self, owner: Hashable) -> int:
        """``owner`` (a job's epoch pool) is gone: its protections end unless another owner
        still holds them, and its waiting prefetches are dropped. Returns protections ended."""
        if owner is not None:
            for hash in self._waiting.owned_by(owner):
                self._waiting.pop(hash)
        ended = self.holds.release(owner)
        if ended:
            self._notify_protect()
        return ended

    def _notify_protect(self) -> None:
        self._protect_changed.set()
        self._protect_changed = trio.Event()

    def _admit(self) -> int:
        """Start the waiting prefetches that fit the protection share now, oldest first
        (one that does not fit stops the rest: first come, first served). Returns how many
        started."""
        if not self._waiting or self._nursery is None:
            return 0
        index = self._require_open()
        now = trio.current_time()
        started = 0
        while self._waiting:
            hash, (size, location, dataset, owner, queued) = self._waiting.oldest()
            if index.size_of(hash) is not None or now - queued > self.holds.protect_seconds:
                self._waiting.pop(hash)  # read on demand meanwhile, or waited too long
                continue
            if hash in self._flights:
                self._waiting.pop(hash)
                self.holds.protect(hash, size, owner, (location, dataset))
                continue
            if not self.holds.fits(size):
                break
            self._waiting.pop(hash)
            self.holds.protect(hash, size, owner, (location, dataset))
            self._nursery.start_soon(self._fetch_now, hash, size, location, dataset,
                                     self._turns.ticket())
            started += 1
        return started

    async def _admitter(self) -> None:
        """Ends protections whose time is up and starts waiting prefetches as room frees."""
        while True:
            deadline = self.holds.next_protection_deadline()
            changed = self._protect_changed
            with trio.move_on_at(deadline if deadline is not None else trio.current_time() + 1.0):
                await changed.wait()
            before = self.holds.protected_bytes
            self.holds.expire()
            if self.holds.protected_bytes < before:
                self._notify_protect()
            self._admit()

    async def _fetch_now(
        self, hash: bytes, size: int, location: Location, dataset: str | None, turn: int,
    ) -> None:
        with contextlib.suppress(QuiverError):  # counted and logged by the flight
            await self._await_fill(hash, size, location, dataset, prefetch=True, turn=turn)

    def prefetch(
        self, items: Sequence[tuple[bytes, int, Location]], dataset: str | None = None,
        *, uid: int | None = None, renew: bool = False,
    ) -> int:
        """Queue fills to run in the background (``prefetch_concurrency`` at once) and return
        how many were queued: cached, in-flight and already-queued hashes are skipped, and
        items beyond the queue's capacity are dropped. Errors are counted and logged only.
        The fills are charged to ``uid`` (mountd/store/quota.py).

        ``renew``: a mount's bounded sweep keeps what its reader has yet to read this epoch
        (docs/mount.md "The sweep"): cached items are protected as if just fetched ahead (a
        protected one for another ``protect_seconds``, another while the sweep's share,
        ``SWEEP_SHARE``, has room), and the others wait for that share, not
        ``--protect-share``."""
        index = self._require_open()
        fresh: dict[bytes, tuple[int, Location]] = {}
        for hash, size, location in items:
            hash = layout.check_hash(hash)
            if hash not in self._queued and hash not in self._flights:
                fresh[hash] = (size, location)
        absent = index.absent(list(fresh))  # one index query for the lot
        if renew:
            self._renew_protection(fresh, absent)
        queue, room = self._prefetches, self.config.prefetch_queue
        queued = 0
        for hash in absent:
            if len(queue) >= room:
                break
            size, location = fresh[hash]
            queue.append((hash, size, location, dataset, uid))
            self._queued[hash] = renew
            queued += 1
        if queue:
            # As many workers as the queue has batches for (each takes its share).
            share = self._batch_share(len(queue))
            self._prefetch_idle.unpark(count=-(-len(queue) // share))
        return queued

    def _renew_protection(self, items: dict[bytes, tuple[int, Location]],
                          absent: Sequence[bytes]) -> None:
        """Protect the cached ones of ``items`` (hash → size, location) again, or anew while
        the sweep's share has room (at the size the store holds, not the one asked)."""
        index, holds, missing = self._require_open(), self.holds, set(absent)
        for hash in items:
            size = None if hash in missing else index.size_of(hash)
            if size is not None and (holds.protected(hash) or holds.fits(size, sweep=True)):
                holds.protect(hash, size)

    async def _prefetch_worker(self) -> None:
        """Fill the prefetch queue, oldest first. Each file waits for protection room
        (mountd/store/holds.py: a prefetch is protected until read), then is filled with
        the files queued right behind it that can share its job, up to its share of the
        queue (mountd/store/batchfill.py), or alone. A file that landed since it was queued
        is passed over (a landing takes its hash off ``_queued``: Misses._record), so the
        queue never asks the index."""
        queue = self._prefetches
        while True:
            if not queue:
                await self._prefetch_idle.park()
                continue
            item = queue.popleft()
            hash, size = item[0], item[1]
            sweep = self._queued.get(hash, False)
            while not self.holds.fits(size, sweep=sweep) and not self._cached_or_coming(hash):
                await self._protect_changed.wait()
            if not self._prefetch_wanted(item):
                continue
            self._queued.pop(hash, None)
            self.holds.protect(hash, size)
            key = self._batch_key(item)
            if key is None:
                # Errors are counted and logged by the flight; a prefetch has nobody to tell.
                with contextlib.suppress(QuiverError):
                    await self._await_fill(hash, size, item[2], item[3], prefetch=True,
                                           uid=item[4], absent=True)
                continue
            flights = self._batch_flights(self._batch_behind(item, key))
            if flights:
                await self._run_flights(flights)

    def _batch_behind(self, item: Prefetch, key: Hashable) -> list[Prefetch]:
        """``item`` and the files queued right behind it that share its ``key`` and fit the
        protection share, up to a worker's share of the queue, each taken off the queue and
        protected; the first that cannot join stays first in line."""
        queue = self._prefetches
        batch = [item]
        share = self._batch_share(len(queue) + 1)
        while len(batch) < share and queue:
            following = queue[0]
            if not self._prefetch_wanted(following):
                queue.popleft()
                continue
            sweep = self._queued.get(following[0], False)
            if self._batch_key(following) != key or not self.holds.fits(following[1], sweep=sweep):
                break
            queue.popleft()
            self._queued.pop(following[0], None)
            self.holds.protect(following[0], following[1])
            batch.append(following)
        return batch

    def _prefetch_wanted(self, item: Prefetch) -> bool:
        """Whether a queued prefetch still has work: its hash is still queued (not landed
        since) and nobody fills it now (then it leaves the queue)."""
        hash = item[0]
        if hash not in self._queued:
            return False
        if self._index is None or hash in self._flights:
            self._queued.pop(hash, None)
            return False
        return True

    def _cached_or_coming(self, hash: bytes) -> bool:
        index = self._index
        return index is None or hash in self._flights or index.size_of(hash) is not None
