"""The mount's main process side of serving: misses, extended attributes, counters.

The FUSE requests of a mount are read by worker processes (quiverfs/fuse/worker.py), which answer
the hot path themselves: the tree (quiverfs/filesystem/tree.py) and every READ of a file already in
the store. What needs mountd or state shared by the whole mount comes here, as the raw request, and
is answered on the same ``/dev/fuse`` descriptor (docs/mount.md "Reads"):

* **miss** -- a READ of a file whose store file does not exist: await the fetcher (mountd's
  ``ensure``: fetch, verify, store), open the store file and read (through
  quiverfs/filesystem/reads.py, the READ path the workers use too). Other requests keep being served
  meanwhile, by the workers and by the other tasks here. A worker also forwards a READ whose
  store file's size is not the entry's: it fails here like a failed fetch (logged once,
  remembered for the kernel's retry).
* **extended attributes** -- ``user.quiver.hash``/``user.quiver.cached`` on files,
  ``user.quiver.dataset``/``user.quiver.stats`` on the root, and the control channel
  (quiverfs/protocol/control.py), whose replay and paging state must be the mount's, not a worker's.
* **read-ahead** -- every file read here and every hit the workers report goes to the scan
  detector (quiverfs/filesystem/readahead.py); the files it names are sent to mountd as ``prefetch``
  notifications by :meth:`QuiverOperations.send_prefetches`, off the read path. The one
  place that knows every read, so the one place that can see a scan.

Errors from anywhere below become an errno in one place, :func:`quiverfs.base.errors.errno_for`.

Concurrency: every handler here runs in the trio thread of the mount's main process; code
between two ``await``\\ s is atomic. The :class:`~digests.digest.Digest` must have been opened
in that thread.
"""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import trio

from digests.digest import Digest, FileEntry
from quiverfs.base.errors import CorruptObject, FsError, errno_for
from quiverfs.filesystem.control_channel import ControlChannel, SessionClient
from quiverfs.filesystem.readahead import ReadAhead, window_bytes
from quiverfs.filesystem.reads import COUNTERS, ERRORS, SharedCounters, StoreReads
from quiverfs.filesystem.sweep import Sweep
from quiverfs.filesystem.tree import ROOT_INODE, Tree
from quiverfs.protocol import fuse_wire as w
from quiverfs.protocol.control import CONTROL_PREFIX  # names on the root that are control requests
from quiverfs.protocol.worker_messages import HIT_RECORD

log = logging.getLogger("quiverfs.fs")

XATTR_HASH = b"user.quiver.hash"
XATTR_CACHED = b"user.quiver.cached"
XATTR_DATASET = b"user.quiver.dataset"
XATTR_STATS = b"user.quiver.stats"

#: ensure() + open() attempts for a miss whose store file is evicted before we open it.
ENSURE_ATTEMPTS = 3

FILE_XATTRS = (XATTR_HASH, XATTR_CACHED)
ROOT_XATTRS = (XATTR_DATASET, XATTR_STATS)

#: Store files the main process keeps open by inode (the READs of a large missed file).
OPEN_FILES = 16

#: Failed fetches remembered at most.
REMEMBERED = 1024

#: Files remembered as read from the mount, for dropping their pages from the kernel when
#: mountd evicts them (~100 bytes each). More files than the kernel keeps pages of.
SERVED_FILES = 1 << 20

#: Seconds a failed fetch answers for its file without asking mountd again: when a READ
#: fails, the kernel retries the same page at once, and that retry should neither ask
#: mountd a second time nor count a second error.
FAILURE_MEMORY = 0.5

#: Most items in one ``prefetch`` notification (well under the protocol's MAX_ITEMS).
PREFETCH_BATCH = 10_000

#: Share of what mountd lets a sweep's files fetched ahead take (its ``sweep_share`` of the
#: cache) that a bounded sweep may hold asked for and not read: the rest stays for read-ahead.
BOUNDED_SHARE = 0.9

#: A bounded sweep renews mountd's protection of what it asked for and was not read yet this
#: many times per ``protect_seconds``, while its reader reads (docs/mount.md "The sweep").
RENEWALS = 3

#: Seconds after a control request (a sampler reading this mount in an order mountd planned)
#: in which a bounded sweep asks for nothing: the sampler's claims fetch ahead for it.
SAMPLER_QUIET_SECONDS = 60.0

#: Seconds after a sweep starts over in which the workers' hit reports are not shown to it:
#: they may be reads of the epoch that just ended (a worker reports every FLUSH_INTERVAL,
#: 0.25 s), and marking those files read would keep the new sweep from asking for them.
REPORT_LAG_SECONDS = 1.0

#: Files read from the digest past those read-ahead asks the size of: a scan's window moves a
#: file or two per file read, so a range query (~6 µs of its own, beside each row's) is made
#: once per 64 files rather than per file (``add_hits`` in order, 100,000-file digest).
SIZES_AHEAD = 64


# -- what the main process needs from outside -------------------------------------------------


class Fetcher(Protocol):
    """Fills the store with a file's content and says where it is (mountd's ``ensure``)."""

    async def ensure(self, entry: FileEntry) -> str:
        """Path of the verified store file holding ``entry``'s content."""
        ...


@dataclass(frozen=True, slots=True)
class KeepTerms:
    """How mountd keeps files fetched ahead until they are read (its ``hello``): the share of
    the cache they may take, and the seconds one stays protected unread (unless renewed)."""

    share: float
    seconds: float


class Prefetcher(Protocol):
    """Asks for files to be filled in the background (mountd's ``prefetch``): read-ahead."""

    async def cache_bytes(self) -> int | None:
        """The size of the cache the files go to (None: unknown); never raises."""
        ...

    async def keep_terms(self) -> KeepTerms | None:
        """How mountd keeps what it fetched ahead for us (None: it does not: a mount that
        supplies its own fills); never raises."""
        ...

    async def prefetch(self, entries: Sequence[FileEntry], *, renew: bool = False) -> None:
        """Queue fills of ``entries``; returns without waiting for them, and never raises
        (read-ahead is advisory: nothing is lost if mountd is away). ``renew``: entries
        already in the store are protected (again) as if just fetched ahead."""
        ...


@dataclass
class MountCounters:
    """The meaning of this mount's counters, shown as ``user.quiver.stats`` on the root.

    ``opens``: store files opened to serve reads (a file's first READ in a serving process;
    later reads of pages the kernel kept never reach the mount); ``hits``/``misses``: of
    those, files found in the store / fetched through mountd first (empty files are
    neither); ``reads``: READ requests served; ``bytes``: bytes those reads returned;
    ``errors``: reads that failed with an I/O errno.
    """

    opens: int = 0
    reads: int = 0
    hits: int = 0
    misses: int = 0
    bytes: int = 0
    errors: int = 0


assert tuple(MountCounters.__dataclass_fields__) == COUNTERS, "counter layouts disagree"


@dataclass(frozen=True, slots=True)
class StoreFileOpen:
    """The answer to a passthrough OPEN of ``inode``: its store file open at ``fd``, for the
    front end to register with the kernel as the open's backing file, and to close
    (quiverfs/fuse/passthrough.py)."""

    unique: int
    inode: int
    fd: int


class QuiverOperations:
    """What a mount's main process answers: misses and extended attributes of one digest.

    ``fetcher`` is awaited on a miss; ``sessions`` (mountd's client, or None for a mount without a
    session layer) serves the control channel; ``counters`` holds every serving process's counters
    (slot 0 is ours); ``extra_stats`` (optional) adds fields to ``user.quiver.stats`` (the mount
    adds its pid, mountpoint and mountd state). With a ``prefetcher`` and ``readahead`` > 0, scans
    in digest order are read ahead by up to that many files (and an eighth of the cache), once
    :meth:`send_prefetches` runs and has learnt the cache's size (quiverfs/filesystem/readahead.py);
    with ``sweep`` > 0, the files of the dataset are fetched ahead of reads that are not a
    scan, up to ``sweep`` times what was read, and for a dataset larger than the cache up to a
    share of it at a time (quiverfs/filesystem/sweep.py).
    ``kept_bytes``: most bytes of store files this process keeps open (its share of the mount's:
    :func:`quiverfs.filesystem.reads.kept_bytes`; None: the default).
    """

    def __init__(
        self,
        digest: Digest,
        cache_dir: str | os.PathLike[str],
        fetcher: Fetcher,
        counters: SharedCounters,
        *,
        sessions: SessionClient | None = None,
        uid: int | None = None,
        gid: int | None = None,
        extra_stats: Callable[[], dict] | None = None,
        prefetcher: Prefetcher | None = None,
        readahead: int = 0,
        sweep: int = 0,
        kept_bytes: int | None = None,
    ) -> None:
        self.digest = digest
        self.dataset_id = digest.dataset_id
        self.cache_dir = os.fspath(cache_dir)
        self.fetcher = fetcher
        self.control = ControlChannel(sessions, self.dataset_id, digest)
        self.tree = Tree(digest, cache_dir, uid=uid, gid=gid)
        self.shared = counters
        #: the workers' switch for open reports (:meth:`refresh_open_reports`)
        self._report_opens = counters.report_opens()
        self.counters = counters.slot(0)
        self._extra_stats = extra_stats
        self.reads = StoreReads(self.tree, self.counters, max_files=OPEN_FILES,
                                max_bytes=kept_bytes, marks=counters.misses_past_start())
        #: inode → set when the fetch in progress for it ends
        self._fetching: dict[int, trio.Event] = {}
        #: inode → (when, errno) of a recent failed fetch (see FAILURE_MEMORY)
        self._failed: dict[int, tuple[float, int]] = {}
        self._pending_hashes: list[bytes] = []
        self._pending_bytes = 0
        #: hash → inodes read from the mount with that content (see mountd/store/evictions.py)
        self._served: dict[bytes, tuple[int, ...]] = {}
        #: the scan detector, made by send_prefetches (None: read-ahead off, or not yet)
        self.readahead: ReadAhead | None = None
        #: the sweep of shuffled reads, made by send_prefetches (None: off, or not yet)
        self.sweep: Sweep | None = None
        self._readahead_files = readahead
        self._sweep_factor = sweep
        self._prefetcher = prefetcher
        #: file ids read-ahead and the sweep named, not yet sent to mountd (ascending runs)
        self._to_prefetch: list[int] = []
        self._to_sweep: list[int] = []
        self._prefetch_wanted = trio.Event()
        #: files sent to mountd for read-ahead so far, and their bytes; the same for the sweep
        self._prefetched = 0
        self._prefetched_bytes = 0
        self._swept = 0
        self._swept_bytes = 0
        #: a bounded sweep's renewals: seconds between them (None: none), when the next is
        #: due (trio time), the sweep's first reads at the last one, and files renewed so far
        self._renew_every: float | None = None
        self._renew_at = math.inf
        self._renewed_reads = 0
        self._renewed = 0
        #: when the sweep last started over (trio time; see REPORT_LAG_SECONDS)
        self._sweep_started = -math.inf
        #: inodes whose pages the kernel is to drop (a bounded sweep's new epoch)
        self._to_invalidate: list[int] = []
        #: hashes read for this epoch, for mountd to evict first (a bounded sweep's reader)
        self._pending_done: list[bytes] = []
        #: Files the workers saw opened since the last report (:meth:`add_opened`).
        self._pending_opened: list[bytes] = []

    def close(self) -> None:
        """Release what the operations hold (not the digest: its owner closes it)."""
        self.reads.close()

    # -- hit reports -----------------------------------------------------------------------

    def add_hits(self, message: bytes, *, report: bool = True) -> None:
        """Queue a worker's hit report (``u64 bytes``, then a hash + inode record per file).

        ``report=False``: files whose descriptor mountd handed over (it counted those hits
        itself): remembered for eviction notices and read-ahead, not reported to mountd."""
        (nbytes,) = struct.unpack_from("<Q", message)
        if report:
            self._pending_bytes += nbytes
        readahead = self.readahead
        records = list(HIT_RECORD.iter_unpack(message[8:]))
        for content_hash, inode in records:
            if report:
                self._pending_hashes.append(content_hash)
            self._served_from(content_hash, inode)
            if readahead is not None and readahead.sequential:
                self._read_ahead(readahead.reported(inode))
        sweep = self.sweep
        if sweep is not None and trio.current_time() - self._sweep_started > REPORT_LAG_SECONDS:
            sweep.read_many([inode for _, inode in records], nbytes)
            if self._epoch_reads():
                self._pending_done.extend(content_hash for content_hash, _ in records)
            if readahead is None or not readahead.sequential:
                self._sweep_ahead(sweep)

    def add_opened(self, message: bytes) -> None:
        """Queue a worker's report of files opened (``u64 0``, then hash + inode records):
        sent to mountd with the hits (:meth:`take_opened`), for the protections they end."""
        self._pending_opened.extend(h for h, _ in HIT_RECORD.iter_unpack(message[8:]))

    def refresh_open_reports(self) -> bool:
        """Have the workers report opens (:meth:`add_opened`) while a sampler uses the
        control channel (its claims' hits are what mountd keeps until they are opened), and
        not otherwise; whether they do now."""
        wanted = self.control.used_within(SAMPLER_QUIET_SECONDS)
        self._report_opens[0] = int(wanted)
        return wanted

    def take_opened(self) -> list[bytes]:
        """The hashes of the files opened since the last call; clears them."""
        opened, self._pending_opened = self._pending_opened, []
        return opened

    def _epoch_reads(self) -> bool:
        """Whether the reads here are one shuffled reader's epochs over a dataset larger than
        the cache, each file once: a bounded sweep runs, no sampler (which mountd plans for)
        uses the control channel, and the reads look like one reader's
        (:attr:`Sweep.one_reader`). Several jobs reading through this mount each read every
        file: what one read, the others read later in their epochs, so it is not done with,
        and a share of the cache kept for files nobody read yet would be taken from the
        files one of them read and the others are about to (``shim_vs_lru.py``'s LRU run, 4
        jobs: 4.08 datasets an epoch with the sweep, 3.39 without)."""
        sweep = self.sweep
        return self._renew_every is not None and sweep is not None and sweep.one_reader \
            and not self.control.used_within(SAMPLER_QUIET_SECONDS)

    def _served_from(self, content_hash: bytes, inode: int) -> None:
        """Remember that the kernel may now keep ``inode``'s pages, read from ``content_hash``."""
        served = self._served
        inodes = served.get(content_hash)
        if inodes is None:
            served[content_hash] = (inode,)
            if len(served) > SERVED_FILES:
                del served[next(iter(served))]  # long ago: the kernel has most likely dropped it
        elif inode not in inodes:
            served[content_hash] = (*inodes, inode)

    def evicted(self, hashes: list[bytes]) -> list[int]:
        """The inodes served from ``hashes``, which mountd has just evicted (and forgets them).

        Also closes the store files kept open here that left the store (these hashes, and
        any other whose file is gone: mountd's report is the main process's sweep)."""
        self.reads.forget(hashes)
        self.reads.sweep()
        served = self._served
        return [inode for h in hashes for inode in served.pop(h, ())]

    def take_read_done(self) -> list[bytes]:
        """The hashes read for this epoch since the last call (:meth:`_epoch_reads`): mountd's
        policy evicts them first (``done`` of its ``hits``); clears them."""
        done, self._pending_done = self._pending_done, []
        return done

    def take_hits(self) -> tuple[list[bytes], int]:
        """The hashes opened from the store since the last call and their bytes; clears them."""
        hashes, nbytes = self._pending_hashes, self._pending_bytes
        self._pending_hashes, self._pending_bytes = [], 0
        return hashes, nbytes

    def stats(self) -> dict:
        """``user.quiver.stats`` as a dict (docs/mount.md "Extended attributes")."""
        readahead = self.readahead
        files, nbytes = readahead.windows() if readahead is not None else (0, 0)
        out: dict = {"dataset": self.dataset_id, **self.shared.totals(),
                     "readahead": readahead.window if readahead is not None else 0,
                     "readahead_cap_bytes": readahead.max_bytes if readahead is not None else 0,
                     "readahead_window_files": files, "readahead_window_bytes": nbytes,
                     "readahead_files": self._prefetched,
                     "readahead_bytes": self._prefetched_bytes,
                     "sweep": self._sweep_factor if self._prefetcher is not None else 0,
                     "sweep_running": self.sweep is not None,
                     "sweep_files": self._swept, "sweep_bytes": self._swept_bytes,
                     "sweep_restarts": self.sweep.restarts if self.sweep is not None else 0,
                     **self._sweep_bound_stats()}
        if self._extra_stats is not None:
            out.update(self._extra_stats())
        return out

    def _sweep_bound_stats(self) -> dict:
        """A bounded sweep's fields of ``user.quiver.stats`` (zeros when unbounded or off)."""
        sweep = self.sweep
        bounded = sweep is not None and sweep.bound_bytes is not None
        return {"sweep_bound_bytes": sweep.bound_bytes if bounded else 0,
                "sweep_unread_bytes": sweep.outstanding_bytes if bounded else 0,
                "sweep_renewed": self._renewed}

    # -- forwarded requests ----------------------------------------------------------------

    async def answer(self, request: bytes) -> bytes | list[bytes] | StoreFileOpen:
        """The reply to a request a worker forwarded (a missed READ or passthrough OPEN, an
        xattr request); an OPEN's is a :class:`StoreFileOpen` for the front end to send."""
        _, opcode, unique, nodeid = w.parse_header(request)
        try:
            if opcode == w.OPEN:
                reader = w.IN_HEADER.unpack_from(request)[6]
                return await self.open_store_file(unique, nodeid, reader)
            if opcode == w.READ:
                _, offset, size = w.READ_IN.unpack_from(request, w.HEADER_SIZE)
                reader = w.IN_HEADER.unpack_from(request)[6]  # the reading process's pid
                data = await self.read(nodeid, offset, size, reader)
                return [w.OUT_HEADER.pack(w.OUT_HEADER.size + len(data), 0, unique), data]
            if opcode == w.GETXATTR:
                (asked,) = w.GETXATTR_IN.unpack_from(request, w.HEADER_SIZE)[:1]
                name = w.cstring(request, w.HEADER_SIZE + w.GETXATTR_IN.size)
                value = await self.getxattr(nodeid, name)
            elif opcode == w.LISTXATTR:
                (asked,) = w.GETXATTR_IN.unpack_from(request, w.HEADER_SIZE)[:1]
                value = b"".join(name + b"\0" for name in self.listxattr(nodeid))
            else:
                return w.error(unique, errno.ENOSYS)
        except Exception as exc:
            if not isinstance(exc, FsError):
                log.warning("FUSE %s of inode %d failed: %s", w.opcode_name(opcode), nodeid, exc)
            return w.error(unique, errno_for(exc))
        body = w.xattr_body(value, asked)
        return w.error(unique, body) if isinstance(body, int) else w.reply(unique, body)

    async def read(self, inode: int, offset: int, size: int, reader: int = 0) -> bytes:
        """Bytes of ``inode`` at ``offset``, fetching the file through mountd if needed.

        A worker forwards a READ when the store file did not exist; by now another request
        may have fetched it (then it is a hit), or may be fetching it (then we wait for that
        fetch instead of asking mountd again). A file's READ at offset 0 counts it as read
        (see :class:`MountCounters`) and is shown to read-ahead, as read by process
        ``reader`` (0: unknown), before any fetch: the files after it can be on their way
        while this one is.
        """
        reads = self.reads
        # A READ at offset 0 starts a read of the file: look in the store again (it may have
        # been evicted since), so a kept descriptor only serves the READs that follow.
        fd = reads.kept(inode) if offset else None
        if fd is None:
            entry = self.tree.file(inode)
            if entry.size == 0:
                return b""
            if offset == 0:
                self._observe(entry, reader)
            fd, hit = await self._open(entry, offset, reader)
            if offset == 0:
                self._first_read(entry, hit, reads.handed(inode))
        # No await since _open returned: the descriptor is still open.
        return reads.read(inode, fd, offset, size)

    async def open_store_file(self, unique: int, inode: int, reader: int = 0) -> bytes | StoreFileOpen:
        """A passthrough OPEN of ``inode`` (quiverfs/fuse/passthrough.py) that a worker found
        missing: fetched through mountd like a missed READ at offset 0 (shown to read-ahead and
        the sweep, counted), then its store file handed over in a :class:`StoreFileOpen`; a
        fetch that fails opens the file without passthrough, whose READs then fail here."""
        entry = self.tree.file(inode)
        if entry.size == 0:
            return w.reply(unique, w.open_body(w.FOPEN_KEEP_CACHE))
        self._observe(entry, reader)
        try:
            fd, hit = await self._open(entry)
        except FsError:
            # Counted, logged and remembered by _open. The open itself succeeds, without a
            # backing file, so the error shows where it does without passthrough: at the
            # READs, which come here (a direct-I/O open: no page cache to mix with others').
            return w.reply(unique, w.open_body(w.FOPEN_DIRECT_IO))
        self._first_read(entry, hit, self.reads.handed(inode))
        opened = StoreFileOpen(unique, inode, os.dup(fd))
        self.reads.release(inode)  # its READs go to the store file, not here
        return opened

    def _first_read(self, entry: FileEntry, hit: bool, handed: bool) -> None:
        """Count a read of ``entry`` served here (offset 0, or a passthrough open) and
        remember what served it. A hit is reported to mountd like a worker's (the pyfuse3
        front end's every hit), unless mountd handed the descriptor over (it counted that
        hit itself) or the read was counted already (quiverfs/filesystem/reads.py)."""
        self._served_from(entry.hash, entry.id)
        if self._epoch_reads():
            self._pending_done.append(entry.hash)
        if self.reads.first_read(entry.id, hit) and hit and not handed:
            self._pending_hashes.append(entry.hash)
            self._pending_bytes += entry.size

    async def _open(self, entry: FileEntry, offset: int = 0, reader: int = 0) -> tuple[int, bool]:
        """A descriptor of ``entry``'s store file, kept open for the READs that follow, and
        whether the file was in the store already (a hit).

        A fetch for a READ past ``offset`` 0 counts the file's read as a miss here, and is
        shown to read-ahead and the sweep here, as read by ``reader``: the READ at offset 0
        of the same read may reach a worker once the file landed, and counts nothing then
        (quiverfs/filesystem/reads.py)."""
        waited = False
        while True:
            failed = self._failed.get(entry.id)
            if failed is not None and trio.current_time() - failed[0] < FAILURE_MEMORY:
                raise FsError(failed[1])  # the kernel retrying the page we just failed
            fetching = self._fetching.get(entry.id)
            if fetching is None:
                break
            await fetching.wait()  # then: its failure above, or the store file below
            waited = True
        try:
            return self.reads.open(entry), not waited
        except FileNotFoundError:
            pass
        except CorruptObject as exc:
            raise self._failure(entry, exc) from None
        done = self._fetching[entry.id] = trio.Event()
        past_start = offset != 0
        if past_start:
            self._observe(entry, reader)
            self.reads.miss_past_start(entry.id)
        try:
            return await self._open_miss(entry), False
        except BaseException:
            if past_start:
                self.reads.miss_failed(entry.id)
            raise
        finally:
            del self._fetching[entry.id]
            done.set()

    def _failure(self, entry: FileEntry, error: Exception) -> FsError:
        """Count and log a failed read of ``entry``, and remember it for the kernel's retry."""
        self.counters[ERRORS] += 1
        log.warning("cannot read %s: %s", entry.path, error)
        code = errno_for(error)
        self._failed[entry.id] = (trio.current_time(), code)
        if len(self._failed) > REMEMBERED:
            del self._failed[next(iter(self._failed))]
        return FsError(code)

    async def _open_miss(self, entry: FileEntry) -> int:
        """Ask mountd for ``entry``'s content, then open the store file it names.

        mountd may evict the file between answering ``ensure`` and our ``open`` (another
        job's chunk eviction or LRU pressure on a full cache); the store file is then simply
        gone, so ask again, a bounded number of times, rather than fail the read.
        """
        error: Exception | None = None
        for _ in range(ENSURE_ATTEMPTS):
            try:
                path = await self.fetcher.ensure(entry)
                return self.reads.open(entry, path)  # checks the size, as a hit does
            except FileNotFoundError as exc:
                error = exc  # evicted before we opened it: ask again
            except Exception as exc:
                error = exc
                break
        raise self._failure(entry, error) from None

    # -- read-ahead --------------------------------------------------------------------------

    def _observe(self, entry: FileEntry, reader: int) -> None:
        """Show a first read of ``entry`` that came here (a miss, as a rule) to read-ahead
        and the sweep, and queue what they name."""
        readahead, sweep = self.readahead, self.sweep
        if readahead is not None:
            self._read_ahead(readahead.observe(entry.id, reader))
        if sweep is not None:
            if sweep.lost(entry.id) and not os.path.exists(self.tree.store_path(entry.hash)):
                # A file read before is missing: the cache lost files (a new epoch of a
                # dataset larger than the cache, as a rule).
                log.info("the sweep starts over: %s was read before and is not in the store",
                         entry.path)
                sweep.start_over()
                self._sweep_started = trio.current_time()
                if self._epoch_reads():
                    self._forget_served()
            sweep.read(entry.id, entry.size)
            if readahead is None or not readahead.sequential:
                self._sweep_ahead(sweep)

    def _forget_served(self) -> None:
        """Have the kernel drop the pages of every file served so far (sent by
        :meth:`send_prefetches`): a bounded sweep's new epoch, in which each read must reach
        the mount. A read the kernel answers from its pages is seen by neither the sweep nor
        mountd, so a file the sweep asked mountd to keep would stay asked for and kept,
        unread as far as they know, all epoch long: room lost to the files that need it."""
        self._to_invalidate.extend(inode for inodes in self._served.values() for inode in inodes)
        self._served.clear()
        self._prefetch_wanted.set()

    def _read_ahead(self, ids: list[int]) -> None:
        """Queue the file ids the detector named for :meth:`send_prefetches`."""
        if ids:
            self._to_prefetch.extend(ids)
            self._prefetch_wanted.set()

    def _sweep_ahead(self, sweep: Sweep) -> None:
        """Queue the file ids the sweep names now for :meth:`send_prefetches` (none from a
        bounded sweep while a sampler uses the control channel: mountd plans its reads)."""
        if sweep.bound_bytes is not None and not self._epoch_reads():
            return
        ids = sweep.step()
        if ids:
            self._to_sweep.extend(ids)
            self._prefetch_wanted.set()

    async def send_prefetches(self, invalidate: Callable[[list[int]], None] | None = None) -> None:
        """Send the files read-ahead and the sweep name to mountd, as they come, and renew a
        bounded sweep's protections while its reader reads (runs until cancelled).
        ``invalidate`` drops the kernel's pages of inodes (from a thread: see
        :meth:`_forget_served`; None: a bounded sweep does not run).

        What gathers while one notification is sent goes in the next, so a burst of reads
        costs a few notifications, not one each. Files already in the store and empty files
        are left out here, off the read path (one ``stat`` each): a scan over cached files
        costs mountd nothing. A bounded sweep sends the files in the store too, to be
        protected until read (its reader reads each once this epoch).
        """
        prefetcher, digest = self._prefetcher, self.digest
        if prefetcher is None or not digest.file_count:
            return
        if self._readahead_files <= 0 and self._sweep_factor <= 0:
            return
        # The window's cap in bytes and whether the dataset fits depend on the cache's size,
        # so both start once that is known (reads before are not shown to them). File ids are
        # inode numbers, dir_count + 1 .. dir_count + file_count.
        cache_bytes = await prefetcher.cache_bytes()
        first, last = digest.dir_count + 1, digest.dir_count + digest.file_count
        if self._readahead_files > 0:
            self.readahead = ReadAhead(first, last, self._sizes, self._readahead_files,
                                       window_bytes(cache_bytes))
        if self._sweep_factor > 0 and cache_bytes is not None:
            self.sweep = await self._new_sweep(prefetcher, first, last, cache_bytes,
                                               bounded=invalidate is not None)
        while True:
            with trio.move_on_at(self._renew_at):
                await self._prefetch_wanted.wait()
            self._prefetch_wanted = trio.Event()
            stale, self._to_invalidate = self._to_invalidate, []
            if stale and invalidate is not None:
                await trio.to_thread.run_sync(invalidate, stale)
            ids, self._to_prefetch = self._to_prefetch, []
            swept, self._to_sweep = self._to_sweep, []
            for batch in self._to_send(ids):
                self._prefetched += len(batch)
                self._prefetched_bytes += sum(entry.size for entry in batch)
                await prefetcher.prefetch(batch)
            bounded = self._renew_every is not None
            for batch in self._to_send(swept, keep_cached=bounded):
                self._swept += len(batch)
                self._swept_bytes += sum(entry.size for entry in batch)
                await prefetcher.prefetch(batch, renew=bounded)
            if trio.current_time() >= self._renew_at:
                await self._renew(prefetcher)

    async def _new_sweep(self, prefetcher: Prefetcher, first: int, last: int,
                         cache_bytes: int, *, bounded: bool) -> Sweep | None:
        """The sweep for this dataset and cache: unbounded when the dataset fits; else, if
        ``bounded`` may run, bounded to a share of what mountd keeps fetched ahead, with
        renewals (None when mountd keeps nothing for us)."""
        if self.digest.total_bytes <= cache_bytes:
            return Sweep(first, last, self._sizes, self._sweep_factor)
        terms = await prefetcher.keep_terms() if bounded else None
        if terms is None or terms.seconds <= 0:
            return None
        bound = max(1, int(cache_bytes * terms.share * BOUNDED_SHARE))
        self._renew_every = terms.seconds / RENEWALS
        self._renew_at = trio.current_time() + self._renew_every
        return Sweep(first, last, self._sizes, self._sweep_factor, bound_bytes=bound)

    async def _renew(self, prefetcher: Prefetcher) -> None:
        """Ask mountd again for what the bounded sweep asked for and was not read yet, so that
        it stays protected (and what left the store comes back), if its reader read since the
        last renewal: a reader that stops lets them go when mountd's time is up."""
        sweep, every = self.sweep, self._renew_every
        assert sweep is not None and every is not None
        self._renew_at = trio.current_time() + every
        if sweep.reads_seen == self._renewed_reads or not self._epoch_reads():
            return
        self._renewed_reads = sweep.reads_seen
        for batch in self._to_send(sweep.outstanding(), keep_cached=True):
            self._renewed += len(batch)
            await prefetcher.prefetch(batch, renew=True)

    def _to_send(self, ids: list[int], keep_cached: bool = False) -> list[list[FileEntry]]:
        """The entries of ``ids`` that are not empty and (unless ``keep_cached``) not in the
        store, in notifications of at most :data:`PREFETCH_BATCH`."""
        entries = [entry for entry in self._entries(ids)
                   if entry.size and (keep_cached
                                      or not os.path.exists(self.tree.store_path(entry.hash)))]
        return [entries[start:start + PREFETCH_BATCH]
                for start in range(0, len(entries), PREFETCH_BATCH)]

    def _entries(self, ids: list[int]) -> list[FileEntry]:
        """The file entries of ``ids``, one tree range per run of consecutive ids (read-ahead
        asked the tree about their sizes just before, so these are usually remembered
        entries, not queries; a damaged row is left out, and logged when it is read)."""
        out: list[FileEntry] = []
        i = 0
        while i < len(ids):
            j = i + 1
            while j < len(ids) and ids[j] == ids[j - 1] + 1:
                j += 1
            out.extend(self.tree.files(ids[i], ids[j - 1]))
            i = j
        return out

    def _sizes(self, first: int, last: int) -> list[int]:
        """The sizes of the files ``first .. last`` for read-ahead
        (:data:`quiverfs.filesystem.readahead.Sizes`): one range of the tree, whose entries the
        notification then finds remembered. A damaged row counts as empty (it is never sent)."""
        entries = self.tree.files(first, last, SIZES_AHEAD)
        if len(entries) == last - first + 1:
            return [entry.size for entry in entries]
        sizes = {entry.id: entry.size for entry in entries}
        return [sizes.get(file_id, 0) for file_id in range(first, last + 1)]

    # -- extended attributes ---------------------------------------------------------------

    def _xattr_names(self, inode: int) -> tuple[bytes, ...]:
        entry = self.tree.entry(inode)
        if entry.is_dir:
            return ROOT_XATTRS if entry.id == ROOT_INODE else ()
        return FILE_XATTRS

    async def getxattr(self, inode: int, name: bytes) -> bytes:
        if inode == ROOT_INODE and name.startswith(CONTROL_PREFIX):
            # The control channel (quiverfs/protocol/control.py, docs/control-protocol.md): the name
            # is the request, the value the response; it never lists its names. A sampler is
            # here: the workers report opens from now on, not from the next report tick,
            # so that mountd counts the opens of the first files its claims give out.
            self._report_opens[0] = 1
            return await self.control.getxattr(name)
        if name not in self._xattr_names(inode):
            raise FsError(errno.ENODATA)
        if name == XATTR_HASH:
            return self.tree.file(inode).hash.hex().encode()
        if name == XATTR_CACHED:
            entry = self.tree.file(inode)
            if entry.size == 0:
                return b"1"
            return b"1" if os.path.exists(self.tree.store_path(entry.hash)) else b"0"
        if name == XATTR_DATASET:
            return self.dataset_id.encode()
        return json.dumps(self.stats(), sort_keys=True).encode()  # XATTR_STATS

    def listxattr(self, inode: int) -> list[bytes]:
        return list(self._xattr_names(inode))
