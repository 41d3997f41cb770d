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

``Cache`` is one object made of parts, each a base class in its own module (one state, one
trio thread; a part lists on its class what it uses of the others): this module holds its
lifetime, lookups and hits, backends, listeners and reports;

* :class:`~mountd.store.misses.Misses`: flights and their fills, from a miss to its answer;
* :class:`~mountd.store.chunkfill.ChunkFills`: the fills of a packed object's members together;
* :class:`~mountd.store.batchfill.BatchFills`: queued prefetches of one bucket in one job;
* :class:`~mountd.store.space.Space`: reservations, eviction, room on a full disk;
* :class:`~mountd.store.protection.Protection`: pins, and files fetched ahead until read;
* :class:`~mountd.store.commits.Commits`: the index's group commit and durable checkpoints.

Invariants (everything below runs in the trio thread; code between two awaits is atomic),
each told in full next to the code that keeps it:

* ``used`` = sum of indexed sizes; ``reserved`` = sizes of fills in flight. A fill reserves its
  size before it fetches, so ``used + reserved <= cache_size`` always holds
  (:mod:`mountd.store.space`).
* A row is inserted in the same trio step as the fill's reservation becomes ``used``
  (:mod:`mountd.store.misses`); a row is deleted in the same step as its file is unlinked
  (:mod:`mountd.store.space`). Hence the index and the accounting never disagree while
  mountd runs.
* Deliberate blocking calls in the trio thread: eviction's ``unlink``
  (:mod:`mountd.store.space`), the ``stat`` of a hit in :meth:`Cache.ensure`
  (:mod:`mountd.store.misses`), and the temp-file cleanup of a failed fill (so cancellation
  cannot skip it). Each is microseconds.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import sqlite3
from collections.abc import Callable, Iterable, Sequence

import trio

from mountd.errors import CacheClosed, CacheError, CacheFull, CacheLocked
from mountd.stats.counters import Counters
from mountd.store import disk, layout
from mountd.store.batchfill import BatchFills
from mountd.store.chunkfill import ChunkFills
from mountd.store.commits import Commits
from mountd.store.config import CacheConfig
from mountd.store.fillpool import Fills
from mountd.store.flights import CacheListener
from mountd.store.index import Index
from mountd.store.limits import RemoteLimits
from mountd.store.misses import Misses
from mountd.store.policy import EvictionPolicy, make_policy
from mountd.store.protection import Protection
from mountd.store.recovery import RecoveryReport, recover
from mountd.store.scrub import ScrubReport, scrub
from mountd.store.space import Space
from mountd.store.supplied import SuppliedBytes
from quiverfs.base.backends import Backend, normalize_url, open_backend
from quiverfs.base.backends.base import BackendOptions, Location, RemoteCounters
from quiverfs.base.errors import QuiverError

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


class Cache(Misses, ChunkFills, BatchFills, Space, Protection, Commits):
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
        self._cache_dir = os.fspath(config.cache_dir)
        self._nursery: trio.Nursery | None = None
        self._run_done: trio.Event | None = None
        self._closed = False
        #: An index write failed while running (rows may disagree with the store): the next
        #: open must reconcile, so aclose does not mark the index clean.
        self._dirty = False
        self._listeners: list[CacheListener] = []
        self._init_protection(config)  # holds, pins' share, prefetches (protection.py)
        self._init_misses(config, fills)  # flights, fill slots, fills (misses.py)
        self._init_batches()  # misses of one moment in one job (batchfill.py)
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

    def record_read_done(self, hashes: Sequence[bytes]) -> None:
        """Files a reader read and will not read again until its next epoch (a mount's
        bounded sweep): its eviction policy may let them go first (``LRUPolicy``). Hashes
        the index does not hold are ignored."""
        index = self._require_open()
        assert self._policy is not None
        sizes = ((h, index.size_of(h)) for h in hashes)
        self._policy.on_read_done([(h, size) for h, size in sizes if size is not None])

    # -- backends ------------------------------------------------------------------------------

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
        for the first fill to meet and report.

        Where the fills run (:attr:`Fills.uses_cache_backends`): fill processes open theirs,
        and the cache's own opens only when one is needed. Opening it anyway cost mountd's
        main process ~1 s of CPU per S3 dataset (boto3's import and client) in the first
        seconds of a cold pass, 0.3 ms a fill of a 2,000-file pass (mount_cold.py, 2026-11-29)."""
        if self._nursery is None:
            return
        urls = list(urls)
        self.fills.warm(urls)
        if not self.fills.uses_cache_backends:
            return
        for url in urls:
            self._nursery.start_soon(self._warm_backend, url)

    async def _warm_backend(self, url: str) -> None:
        try:
            await self._backend(url)
        except Exception as exc:
            log.debug("could not open the backend of %s ahead of its first fill: %s", url, exc)

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
