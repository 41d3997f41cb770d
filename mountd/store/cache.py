"""The mountd cache: one shared, verified, content-addressed store per machine.

:class:`Cache` ties the pieces together: the directory lock, recovery on open
(:mod:`mountd.store.recovery`), the index (:mod:`mountd.store.index`), single-flight fills
(:mod:`mountd.store.fill`) under the shared remote limits (:mod:`mountd.store.limits`), space accounting
with a pluggable eviction policy (:mod:`mountd.store.policy`) and a per-user quota
(:mod:`mountd.store.quota`), scrub and counters. A miss of a file packed with others in one
remote object fetches the wanted members together (chunk fills: :mod:`mountd.store.span`,
:mod:`mountd.store.chunkfill`).

Lifetime (one nursery owns it)::

    cache = Cache(CacheConfig(cache_dir=..., cache_size=parse_size("100G", ...)))
    await cache.open()
    async with trio.open_nursery() as nursery:
        await nursery.start(cache.run)
        path = await cache.ensure(hash, size, Location("s3://b/p", "shard-0.tar", 512, size))
        ...
        await cache.aclose()

Invariants (everything below runs in the trio thread; code between two awaits is atomic):

* ``used`` = sum of indexed sizes; ``reserved`` = sizes of fills in flight. A fill reserves its
  size before it fetches, so ``used + reserved <= cache_size`` always holds: the store never
  exceeds the cap, even counting temp files (the cap is exceeded by nothing in flight).
* A row is inserted in the same trio step as the fill's reservation becomes ``used``; a row
  is deleted in the same step as its file is unlinked. Hence the index and the accounting
  never disagree while mountd runs.
* Deliberate blocking calls in the trio thread: eviction's ``unlink`` (it must happen in the
  same step as the row delete, or a refill of the same hash could be renamed into place and
  then unlinked by a late eviction), the ``stat`` of a hit in :meth:`Cache.ensure`, and the
  temp-file cleanup of a failed fill (so cancellation cannot skip it). Each is microseconds.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import sqlite3
import time
from collections.abc import Callable, Iterable, Sequence
from functools import partial

import trio

from mountd.errors import CacheClosed, CacheError, CacheFull, CacheLocked, PrefetchNoRoom
from mountd.stats.counters import Counters
from mountd.store import disk, layout
from mountd.store.chunkfill import ChunkFills
from mountd.store.commits import GROUP_COMMIT_ROWS, Commits
from mountd.store.config import CacheConfig
from mountd.store.fill import Filler
from mountd.store.fillpool import Fills, ThreadFills
from mountd.store.flights import CacheListener, Flight
from mountd.store.index import Index
from mountd.store.limits import RemoteLimits, Turns, take
from mountd.store.peers import PEER_URL, PeerContent, PeerSource, fill_through
from mountd.store.policy import EvictionPolicy, make_policy
from mountd.store.protection import Protection
from mountd.store.recovery import RecoveryReport, recover
from mountd.store.scrub import ScrubReport, scrub
from mountd.store.space import Space
from mountd.store.span import ChunkMembers
from mountd.store.supplied import SuppliedBytes
from quiverfs.backends import Backend, normalize_url, open_backend
from quiverfs.backends.base import BackendOptions, Location, RemoteCounters
from quiverfs.errors import CorruptObject, QuiverError

__all__ = [
    "Cache",
    "CacheListener",
    "CacheClosed",
    "CacheConfig",
    "CacheError",
    "CacheFull",
    "CacheLocked",
    "Location",
    "RecoveryReport",
    "ScrubReport",
    "SuppliedBytes",
]

log = logging.getLogger("mountd.store.cache")

#: Seconds a client may hold a lease (it was told to supply a hash's bytes) before mountd
#: gives the hash to the next requester.
LEASE_SECONDS = 60.0


class Cache(ChunkFills, Space, Protection, Commits):
    """The store, its index and the fills that populate it. See the module docstring."""

    def __init__(
        self, config: CacheConfig, backend_factory: Callable[[str], Backend] | None = None,
        fills: Fills | None = None,
    ) -> None:
        self.config = config
        self.counters = Counters()
        self.limits = RemoteLimits(
            config.remote_bandwidth,
            config.remote_requests,
            config.remote_concurrency,
            config.burst_seconds,
            config.remote_latency,
        )
        self.recovery: RecoveryReport | None = None
        # The SDK's pool and thread limit are sized to the remote concurrency: a smaller pool
        # would queue fills that the limits allow.
        options = BackendOptions(concurrency=config.remote_concurrency)
        self._factory = backend_factory or (lambda url: open_backend(url, options))
        self._backends: dict[str, Backend] = {}
        #: Backends being opened (in a worker thread: a cloud SDK's import and client take a
        #: few hundred ms), by key; set when the opening ends, whichever way.
        self._opening: dict[str, trio.Event] = {}
        self._index: Index | None = None
        self._policy: EvictionPolicy | None = None
        self._lock_fd: int | None = None
        self._flights: dict[bytes, Flight] = {}
        #: Files a fill just landed whose waiting readers have not had their path yet
        #: (:meth:`_wait_flight`): never evicted, and no fill waits for them beyond a step.
        self._landing: dict[bytes, Flight] = {}
        self._fill_limiter = trio.CapacityLimiter(config.fill_concurrency)
        #: The order in which fills started together take a fill slot (a claim's fetches).
        self._turns = Turns()
        self._chunk_members: ChunkMembers | None = None
        #: Other caches asked before the bucket (mountd/store/peers.py); None: none.
        self.peers: PeerSource | None = None
        #: Where the data movement of fills runs (mountd/store/fillpool.py): the fill
        #: processes mountd forked, or (by default, and in unit tests) mountd's own threads.
        self.fills: Fills = fills or ThreadFills(config.cache_dir, self._backend,
                                                 config.io_threads)
        self.fills.attach(self._room_for_fill, self.limits.pace)
        self._filler = Filler(self.limits, self.counters, self.fills, config.chunk_size)
        self._cache_dir = os.fspath(config.cache_dir)
        self._nursery: trio.Nursery | None = None
        self._run_done: trio.Event | None = None
        self._closed = False
        #: An index write failed while running (rows may disagree with the store): the next
        #: open must reconcile, so aclose does not mark the index clean.
        self._dirty = False
        self._listeners: list[CacheListener] = []
        self._init_protection(config)  # holds, pins' share, prefetches (protection.py)
        self._init_space(config)  # used, reserved, quota charges, full disk (space.py)
        self._init_commits()  # group commit, checkpoints (commits.py)

    # -- lifetime ----------------------------------------------------------------------------

    async def open(self, *, reconcile: bool = False) -> None:
        """Take the directory lock, recover from any crash (see :mod:`mountd.store.recovery`), load
        the accounting. Raises :class:`CacheLocked` if another mountd owns the directory.

        After a clean shutdown the store scan is skipped unless ``reconcile`` is true."""
        cache_dir = self.config.cache_dir
        await trio.to_thread.run_sync(disk.prepare, cache_dir)
        self._lock()
        try:
            self._index, self.recovery = await recover(cache_dir, reconcile,
                                                       self.config.store_modes)
        except BaseException:
            self._unlock()
            raise
        self._policy = make_policy(self.config.policy, self._index)
        self.charges.load(self._index.charged())
        self._disk_size = disk.space(cache_dir)[0]
        if self._disk_size < self.config.cache_size:
            log.warning("the filesystem holding %s has %d bytes, less than the cache size (%d): "
                        "the disk bounds the cache (a full disk evicts)", cache_dir,
                        self._disk_size, self.config.cache_size)
        self.entries, self.used = self.recovery.entries, self.recovery.bytes
        self._cap_protection()  # pins survive restarts
        if self.used > self.config.cache_size:
            # The cap was lowered since the last run: shrink now.
            self._evict_until(self.used - self.config.cache_size)
        for uid in list(self.charges.bytes):  # the quota was lowered (or set) since then
            if (over := self.charges.over(uid, 0)) > 0:
                self._evict_own(uid, over)
        # Everything found is durable from here on (it is on disk, or the kernel has it and
        # this syncfs writes it), so the next crash only has to doubt what is filled next.
        await self.checkpoint()

    def _lock(self) -> None:
        path = layout.lock_path(self.config.cache_dir)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            owner = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise CacheLocked(
                    f"cache directory {self.config.cache_dir} is in use by another mountd "
                    f"(pid {owner}); stop it or pick another --cache-dir"
                ) from None
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._lock_fd = fd

    def _unlock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # closing the only descriptor releases the flock
            self._lock_fd = None

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Background workers: the prefetch queue, and the home of fills (so a cancelled
        requester does not cancel a fill others wait for). Start with ``nursery.start``;
        returns when :meth:`aclose` is called."""
        self._require_open()
        self._run_done = trio.Event()
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                for _ in range(self.config.prefetch_concurrency):
                    nursery.start_soon(self._prefetch_worker)
                nursery.start_soon(self._committer)
                nursery.start_soon(self._checkpointer)
                nursery.start_soon(self._toucher)
                nursery.start_soon(self._admitter)
                await nursery.start(self.fills.serve)
                task_status.started()
                await trio.sleep_forever()
        finally:
            self._nursery = None
            self._run_done.set()

    async def aclose(self) -> None:
        """Stop workers (fills in flight are cancelled; their temp files removed), close the
        backends and the index, release the directory lock. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for flight in [f for f in self._flights.values() if not f.started]:
            self._give_up(flight)  # leases nobody will supply now
        if self._nursery is not None:
            self._nursery.cancel_scope.cancel()
        if self._run_done is not None:
            with trio.CancelScope(shield=True):
                await self._run_done.wait()
        backends, self._backends = list(self._backends.values()), {}
        for backend in backends:
            with trio.CancelScope(shield=True):
                try:
                    await backend.aclose()
                except Exception:  # closing must go on for the others
                    log.exception("closing backend %s failed", backend.url)
        if self._index is not None:
            # Clean only if nothing is in flight, no index write was lost while running, and
            # the last checkpoint made everything durable.
            with trio.CancelScope(shield=True):
                synced = await self.checkpoint()
            if not self._flights and not self._dirty and not self._index.deleting and synced:
                try:
                    self._index.set_clean(True)
                except sqlite3.Error:
                    log.exception("could not mark the index clean")
            self._index.close()
            self._index = None
        self._unlock()


    def _require_open(self) -> Index:
        if self._index is None or self._closed:
            raise CacheClosed("the cache is not open (call open() first, or it was closed)")
        return self._index

    @property
    def index(self) -> Index:
        """The open index (trio thread only)."""
        return self._require_open()

    # -- lookups -------------------------------------------------------------------------------

    def store_path(self, hash: bytes) -> str:
        """Final path of ``hash`` in the store (exists or not); see :func:`layout.store_path`
        (the same name, made without ``pathlib``: this runs for every miss)."""
        return layout.store_file(self._cache_dir, hash)

    def contains(self, hash: bytes) -> bool:
        """True when ``hash`` is indexed (its file is complete and verified)."""
        return self._require_open().size_of(layout.check_hash(hash)) is not None

    def open_cached(self, hashes: Sequence[bytes], sizes: Sequence[int | None],
                    dataset: str | None = None) -> list[tuple[int, int] | None]:
        """Descriptor hand-off (the ``open`` operation): for each hash, its store file opened
        read-only and close-on-exec, with its size, or None when it is not cached, or is
        cached with another size than ``sizes`` asks (the caller's digest row is wrong: the
        mount answers it with EIO). The caller owns the descriptors; none is left open when
        this raises.

        What is opened counts as hits of ``dataset`` exactly as :meth:`record_hits` counts
        the reads clients report (LRU recency, references, counters): a client that got a
        descriptor reports nothing. A row whose file is gone is dropped, as :meth:`_hit`
        does (the client's mount fetches it again).

        The opens run in the trio thread: like :meth:`_hit`'s stat they touch folder entries
        and inodes of recently used files, in the kernel's caches (a few µs each), where a
        thread hop would cost ~160 µs.
        """
        index = self._require_open()
        opened: list[tuple[int, int] | None] = []
        hits: list[bytes] = []
        nbytes = 0
        try:
            for hash, want in zip(hashes, sizes, strict=True):
                hash = layout.check_hash(hash)
                stored = index.size_of(hash)
                if stored is None or want not in (None, stored):
                    opened.append(None)
                    continue
                fd = self._open_entry(hash, stored)
                opened.append(None if fd is None else (fd, stored))
                if fd is not None:
                    hits.append(hash)
                    nbytes += stored
            if hits:
                self.record_hits(dataset, hits, nbytes)
        except BaseException:
            for item in opened:
                if item is not None:
                    os.close(item[0])
            raise
        return opened

    def _open_entry(self, hash: bytes, size: int) -> int | None:
        """The store file of an indexed ``hash`` opened for a client, or None when it is not
        there (its row is dropped) or is not of its row's ``size``, or cannot be opened."""
        path = self.store_path(hash)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            log.warning("indexed file %s is missing; dropping its row", path)
            self._drop_entries([hash], reason="missing")
            return None
        except OSError as exc:  # EMFILE, say: the client reads through its mount instead
            log.warning("cannot open %s to hand it over: %s", path, exc)
            return None
        try:
            # A file changed behind our back is not handed out (scrub will deal with it).
            if os.fstat(fd).st_size == size:
                return fd
            log.warning("store file %s is not of its indexed size %d; not handed over", path, size)
        except OSError as exc:
            log.warning("cannot stat %s to hand it over: %s", path, exc)
        os.close(fd)
        return None

    # -- fills --------------------------------------------------------------------------------

    async def _backend(self, url: str) -> Backend:
        """The backend for ``url``, opened once and kept.

        Opened in a worker thread: the first ``s3://`` backend imports boto3 and builds a
        client (~0.5 s of CPU), which in mountd's trio thread would stall every read of the
        machine. Fills that need a backend being opened wait for that opening; if it fails,
        each tries again (and fails with its own error)."""
        try:
            key = normalize_url(url)
        except QuiverError:
            key = url
        while (backend := self._backends.get(key)) is None:
            opening = self._opening.get(key)
            if opening is not None:
                await opening.wait()
                continue
            self._opening[key] = opening = trio.Event()
            try:
                backend = await trio.to_thread.run_sync(self._factory, url)
                if self._closed:  # closed while it opened: nobody would close it
                    with trio.CancelScope(shield=True):
                        await backend.aclose()
                    raise CacheClosed("the cache closed while a backend opened")
                self._backends[key] = backend
            finally:
                del self._opening[key]
                opening.set()
        return backend

    def warm_backends(self, urls: Iterable[str]) -> None:
        """Open the backends of ``urls`` now, in the background (a dataset was registered):
        its first miss then does not wait for an SDK's import and client. Errors are left
        for the first fill to meet and report."""
        if self._nursery is None:
            return
        urls = list(urls)
        self.fills.warm(urls)
        for url in urls:
            self._nursery.start_soon(self._warm_backend, url)

    async def _warm_backend(self, url: str) -> None:
        try:
            await self._backend(url)
        except Exception as exc:
            log.debug("could not open the backend of %s ahead of its first fill: %s", url, exc)

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
        packed object (:meth:`ChunkFills._open_span`), else alone; in the cache's nursery when
        :meth:`run` is running (so a cancelled requester does not cancel it for the others),
        else, or when the caller is a task of that nursery already (``inline``: the
        prefetches), in the caller."""
        opened = self._open_span(flight)
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
            await self._take_slot(flight)
            try:
                await self._reserve(flight.size, uid, demand=flight.demanded)
                try:
                    if flight.source is None and self.peers is not None:
                        path = await fill_through(self.peers, self._filler, flight)
                    else:
                        path = await self._filler.fill(
                            flight.source, flight.hash, flight.size, flight.location,
                            flight.dataset, since=start)
                    self._stored(flight, path)
                    if self.peers is not None and flight.source is not None \
                            and not isinstance(flight.source, PeerContent):
                        self.peers.landed(flight.hash)  # a client's bytes: share them
                finally:
                    self.reserved -= flight.size
                    self.charges.unreserve(uid, flight.size)
                    self._notify_space()
            finally:
                self._fill_limiter.release()
            counters.add_fill(flight.dataset, flight.size, trio.current_time() - start)
        except trio.Cancelled:
            flight.cancelled = True
            raise
        except Exception as exc:
            self._failed(flight, exc)
        finally:
            counters.fills_in_flight -= 1
            self._finish(flight)

    async def _take_slot(self, flight: Flight) -> None:
        """A fill slot for ``flight``: in the order of its ticket when it has one (a claim's
        fetches: :class:`~mountd.store.limits.Turns`). From the slot on, a fill reaches the
        remote limits without waiting unless it must wait for room or tokens, so the order
        of the slots is the order of the bandwidth."""
        turn = flight.turn
        if turn is None:
            await take(self._fill_limiter)
            return
        await self._turns.arrive(turn)
        try:
            await take(self._fill_limiter)
        finally:
            self._turns.leave(turn)

    def _stored(self, flight: Flight, path: os.PathLike[str] | str) -> None:
        """The file of ``flight`` is at its final name: index it in this same trio step as
        its reservation turns into use (no await in between; the caller releases the
        reservation). Timed as the ``index`` stage of ``fill_stages``."""
        wall, cpu = time.perf_counter(), time.thread_time()
        try:
            self._record(flight, path)
        finally:
            self.counters.stages.add("index", time.perf_counter() - wall,
                                     time.thread_time() - cpu)

    def _record(self, flight: Flight, path: os.PathLike[str] | str) -> None:
        """:meth:`_stored`'s work."""
        # The row is written with the next batch; a row SQLite cannot store (disk full) is
        # settled by _flush_index, which evicts and retries, or removes the file.
        self._require_open().insert(flight.hash, flight.size, flight.dataset, flight.uid)
        self._unsynced.set()
        self.used += flight.size
        self.entries += 1
        self.charges.charge(flight.uid, flight.size)
        assert self._policy is not None
        self._policy.on_insert(flight.hash, flight.size)
        if flight.awaited and flight.waiting:
            self._landing[flight.hash] = flight  # until its readers have the path
        self._tell("filled", lambda listener: listener.filled(flight.hash))
        if self._nursery is None or self.index.pending >= GROUP_COMMIT_ROWS:
            self._flush_index()
        else:
            self._rows_waiting.set()
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

    # -- listeners ------------------------------------------------------------------------------

    def add_listener(self, listener: CacheListener) -> None:
        """Tell ``listener`` of every fill, removal and failed fill from now on."""
        self._listeners.append(listener)

    def remove_listener(self, listener: CacheListener) -> None:
        """Stop telling ``listener``."""
        with contextlib.suppress(ValueError):
            self._listeners.remove(listener)

    def _tell(self, event: str, call: Callable[[CacheListener], object]) -> None:
        """``call(listener)`` for every listener (``event`` names it in the log)."""
        for listener in self._listeners:
            try:
                call(listener)
            except Exception:  # a listener bug must not break a fill or an eviction
                log.exception("cache listener %r failed on %s", listener, event)

    # -- hits ----------------------------------------------------------------------------------

    def record_hits(self, dataset: str | None, hashes: Sequence[bytes], nbytes: int) -> None:
        """Hits that clients served from the store without an RPC: refresh their last use
        (LRU), add ``dataset`` references, and count ``len(hashes)`` hits of ``nbytes``.

        ``hashes`` are 32-byte ``bytes`` checked by the caller (the RPC layer checks what
        clients send, :func:`mountd.rpc.protocol.check_packed_hashes`): a DataLoader reports
        tens of thousands a second, and checking each again cost a quarter of mountd's time
        per hit (py-spy, 2026-11-23). A hash the index does not hold is ignored."""
        index = self._require_open()
        index.touch(hashes, dataset)
        assert self._policy is not None
        self._policy.on_access(hashes)
        self.counters.add_hits(dataset, len(hashes), nbytes)
        if self.holds.consumed(hashes):  # read: no longer protected
            self._notify_protect()

    # -- datasets and reports ------------------------------------------------------------------

    def register_dataset(self, dataset_id: str, info: dict) -> None:
        """Make a dataset known (``info`` is stored as JSON and shown by :meth:`usage`)."""
        self._require_open().register(dataset_id, info)

    def unregister_dataset(self, dataset_id: str) -> None:
        """Forget a dataset's registration; its content stays cached (and referenced) until
        evicted, so a returning dataset finds it."""
        self._require_open().unregister(dataset_id)

    async def scrub(self, progress: Callable[[int, int], object] | None = None) -> ScrubReport:
        """Re-hash every entry; remove files whose bytes do not match (and rows whose file
        is gone). ``progress(done, total)`` is called after each entry."""
        index = self._require_open()
        return await scrub(index.entries(), self.config.cache_dir, self.config.io_threads,
                           self._drop_entries, progress)

    def usage(self) -> dict:
        """``{"used_bytes", "cap_bytes", "reserved_bytes", "entries", "fills_in_flight", "held",
        "protection" (files fetched ahead: mountd/store/holds.py, and prefetches waiting),
        "datasets": {id: {"entries", "bytes", "registered", "info"}}}`` (bytes of content;
        a file shared by datasets counts in each)."""
        index = self._require_open()
        return {
            "cache_dir": str(self.config.cache_dir),
            "used_bytes": self.used,
            "cap_bytes": self.config.cache_size,
            "reserved_bytes": self.reserved,
            "entries": self.entries,
            "fills_in_flight": self.counters.fills_in_flight,
            "held": self.holds.count(),
            "protection": {**self.holds.snapshot(), "waiting": len(self._waiting)},
            "policy": self.config.policy,
            "datasets": index.dataset_usage(),
        }

    def backend_counters(self) -> dict[str, dict]:
        """Each backend opened so far (``stats``' ``sources``): its requests by kind, bytes
        read, retries, failures by class, and how its reads go (:meth:`Backend.read_path`)."""
        sources: dict[str, tuple[list[RemoteCounters], str | None]] = {
            url: ([b.counters], b.read_path()) for url, b in self._backends.items()}
        for url, (counters, path) in self.fills.remote_counters().items():
            parts, own = sources.get(url, ([], None))
            sources[url] = (parts + [counters], path or own)
        out = {}
        for url, (parts, path) in sources.items():
            total = RemoteCounters.total(parts)
            out[url] = {"requests": dict(total.requests), "bytes_read": total.bytes_read,
                        "retries": total.retries, "failures": dict(total.failures),
                        "reads": path}
        return out
