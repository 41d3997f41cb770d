"""The processes that serve a mount's FUSE requests: the hot path, in parallel.

A mount's process (quiverfs/mount/serve.py) answers the kernel's INIT and then forks a few workers
that all read requests from the same connection, each through a descriptor of its own
(quiverfs/fuse/worker_pool.py); the kernel hands each request to exactly one blocked reader. A
worker answers everything that needs only the digest and the store, synchronously and inline:
LOOKUP, GETATTR, READDIR(PLUS), STATFS and every READ of a file whose store file exists (one
``os.pread``, no RPC, no thread hop; the store files are read through quiverfs/filesystem/reads.py,
the READ path it shares with the main process). The rest goes to the mount's main process over a
``SOCK_SEQPACKET`` socket, as the raw request, and the main process answers it on that worker's
descriptor: READs of files not in the store (a miss: mountd's ``ensure``), and the extended
attributes (the control channel keeps its state there).

Why several processes: one Python process serving FUSE tops out far below what the kernel can
take (docs/mount.md "Why not libfuse"), and the tree holds no per-inode state, so any process
can answer any request.

Zero-message opens: OPEN and OPENDIR are answered ENOSYS once, which tells the kernel (since
Linux 4.19/5.1) to stop sending OPEN, RELEASE, OPENDIR and RELEASEDIR at all and to keep file
pages and directory listings cached (``FOPEN_KEEP_CACHE``/``FOPEN_CACHE_DIR``): the content
never changes. A second read of a file whose pages the kernel kept never reaches us. FLUSH is
answered ENOSYS for the same reason, and IOCTL with ENOTTY (Python's ``open()`` asks
whether every file is a terminal). A mount with passthrough (``--passthrough``,
quiverfs/fuse/passthrough.py) answers every OPEN instead: a cached file's with its store file
as the backing file the kernel reads by itself (counted here as a hit), a missing one's in
the main process once fetched.

Counters live in a shared memory block, one slot per process (quiverfs/filesystem/reads.py); hit
reports for mountd are batched and sent to the main process every :data:`FLUSH_INTERVAL` (files
mountd handed over, which it counted already, go as ``SERVED``, not as hits: the messages are
quiverfs/protocol/worker_messages.py), and kept store files that mountd evicted are closed as often
(both from a timer signal, which is also what interrupts a worker blocked in ``read`` while
the mount is idle). When mountd
reports evictions the main process signals the workers (:data:`SWEEP_SIGNAL`, the same
handler), so that evicted files are closed at once rather than at the next tick
(quiverfs/fuse/worker_pool.py).

Odd requests: FORGET, BATCH_FORGET and INTERRUPT get no reply (the kernel expects none; there
is no per-inode state to forget, and an interrupted request is simply answered when done); an
opcode we do not know gets ``ENOSYS``, and the worker goes on serving.
"""

from __future__ import annotations

import errno
import logging
import os
import signal
import socket
import struct
from collections.abc import Callable
from functools import partial

from digests.digest import FileEntry
from quiverfs.base.errors import CorruptObject, FsError
from quiverfs.base.forking import fork_child
from quiverfs.filesystem.reads import ERRORS, StoreReads
from quiverfs.filesystem.tree import TIMEOUT, Tree
from quiverfs.fuse import channel as fuse_channel
from quiverfs.fuse.passthrough import PASSTHROUGH_FH, BackingFiles
from quiverfs.protocol import fuse_wire as w
from quiverfs.protocol.worker_messages import FORWARD, HIT_RECORD, HITS, OPENED, SERVED

log = logging.getLogger("quiverfs.fuse")

#: Seconds between a worker's hit reports to the main process (and sweeps of its kept store
#: files, quiverfs/filesystem/reads.py).
FLUSH_INTERVAL = 0.25

#: Hit reports sent at once when this many are pending, whatever the time.
FLUSH_BATCH = 512

#: Opens sent at once when this many are pending: they end protections that hold room for
#: the next files (a DataLoader worker opens a file every few milliseconds), so sooner.
OPEN_BATCH = 16

#: The signal the main process sends the workers when mountd has evicted files they may
#: hold open: it runs their periodic work (:meth:`Worker.tick`) now, as their timer's
#: ``SIGALRM`` does. Its default action is to be ignored, so a worker forked a moment ago,
#: which has not set its handler yet, is not killed by it (``SIGALRM`` would kill it).
SWEEP_SIGNAL = signal.SIGURG

_UNIQUE = struct.Struct("<Q")  # a request's unique id, at offset 8 of its header


class Worker:
    """One serving process: reads requests from ``fuse_fd`` and answers or forwards them.

    ``kept_bytes``: most bytes of store files it keeps open (its share of the mount's,
    quiverfs/filesystem/reads.py :func:`~quiverfs.filesystem.reads.kept_bytes`; None: the
    default); ``marks``: the mount's shared marks of misses counted past offset 0
    (:meth:`~quiverfs.filesystem.reads.SharedCounters.misses_past_start`); ``backing``: the
    mount's passthrough backing files, when it answers OPEN with passthrough opens
    (quiverfs/fuse/passthrough.py)."""

    def __init__(self, fuse_fd: int, tree: Tree, main: socket.socket, counters: memoryview,
                 in_flight: memoryview | None = None, kept_bytes: int | None = None,
                 marks: memoryview | None = None, backing: BackingFiles | None = None,
                 report_opens: memoryview | None = None) -> None:
        self.fd = fuse_fd
        #: the mount's passthrough backing files: OPEN answered with the store file as the
        #: backing file (quiverfs/fuse/passthrough.py); None: no passthrough
        self.backing = backing
        self.tree = tree
        self.main = main
        self.counters = counters
        self.reads = StoreReads(tree, counters, max_bytes=kept_bytes, marks=marks)
        self.in_flight = in_flight  # see SharedCounters.in_flight (quiverfs/filesystem/reads.py)
        self._pending: list[bytes] = []
        self._pending_bytes = 0
        self._served: list[bytes] = []  # records of handed-over files (SERVED)
        self._served_bytes = 0
        self._opened: list[bytes] = []  # records of files opened (OPENED)
        #: the main process's switch for open reports (SharedCounters.report_opens); None:
        #: always report
        self._report_opens = report_opens
        self._in_read = False
        self._tick_due = False

    # -- the loop ----------------------------------------------------------------------------

    def run(self) -> None:
        """Serve until the connection ends (unmounted: ENODEV)."""
        signal.signal(signal.SIGALRM, self._on_timer)
        signal.signal(SWEEP_SIGNAL, self._on_timer)
        signal.setitimer(signal.ITIMER_REAL, FLUSH_INTERVAL, FLUSH_INTERVAL)
        fd, read, handle, send = self.fd, os.read, self.handle, fuse_channel.send
        in_flight = self.in_flight if self.in_flight is not None else [0]
        unique_of = _UNIQUE.unpack_from
        try:
            while True:
                self._in_read = True
                try:
                    request = read(fd, w.REQUEST_BUFFER)
                except OSError as exc:
                    self._in_read = False
                    if exc.errno == errno.ENODEV:
                        return
                    if exc.errno in (errno.EINTR, errno.EAGAIN, errno.ENOENT):
                        continue  # ENOENT: the request was interrupted before we read it
                    raise
                # Published first, so that the main process can answer it if we die.
                in_flight[0] = unique_of(request, 8)[0]
                self._in_read = False
                out = handle(request)
                if out is not None and not send(fd, out):
                    return  # unmounted
                in_flight[0] = 0
                if self._tick_due:
                    self.tick()
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            self.flush()
            self.reads.close()

    def _on_timer(self, signum: int, frame: object) -> None:
        # Only work while the loop is parked in read(): otherwise it may be touching the
        # pending list or the kept files, so ask it to when it is done with the request.
        if self._in_read:
            self.tick()
        else:
            self._tick_due = True

    def tick(self) -> None:
        """The periodic work: send hit reports, close kept store files mountd evicted."""
        self.flush()
        self.reads.sweep()

    def flush(self) -> None:
        """Send the pending hit reports to the main process."""
        self._tick_due = False
        if self._pending:
            records, nbytes = self._pending, self._pending_bytes
            self._pending, self._pending_bytes = [], 0
            self._send(HITS, records, nbytes)
        if self._served:
            records, nbytes = self._served, self._served_bytes
            self._served, self._served_bytes = [], 0
            self._send(SERVED, records, nbytes)
        if self._opened:
            records, self._opened = self._opened, []
            self._send(OPENED, records, 0)

    def _send(self, kind: bytes, records: list[bytes], nbytes: int) -> None:
        try:
            self.main.send(kind + struct.pack("<Q", nbytes) + b"".join(records))
        except OSError as exc:
            log.debug("dropped %d hit reports: %s", len(records), exc)

    # -- requests ----------------------------------------------------------------------------

    def handle(self, request: bytes) -> bytes | list[bytes] | None:
        """The reply to ``request`` (None: forwarded, or nothing to answer)."""
        _, opcode, unique, nodeid = w.parse_header(request)
        try:
            if opcode == w.READ:
                return self._read(request, unique, nodeid)
            if opcode == w.LOOKUP:
                entry = self.tree.lookup(nodeid, w.cstring(request, w.HEADER_SIZE))
                attributes = None if entry is None else self.tree.attributes(entry)
                return w.reply(unique, w.entry_body(attributes, TIMEOUT))
            if opcode == w.IOCTL:
                if self._report_opens is None or self._report_opens[0]:
                    self._note_open(nodeid)
                return w.error(unique, errno.ENOTTY)
            if opcode == w.GETATTR:
                return w.reply(unique, w.attr_body(self.tree.attributes(self.tree.entry(nodeid)), TIMEOUT))
            if opcode == w.READDIRPLUS or opcode == w.READDIR:
                _, offset, size = w.READ_IN.unpack_from(request, w.HEADER_SIZE)
                return w.reply(unique, self.tree.listing(nodeid, offset, size, opcode == w.READDIRPLUS))
            if opcode in w.NO_REPLY:
                return None
            if self.backing is not None and opcode in (w.OPEN, w.RELEASE):
                return self._passthrough(request, opcode, unique, nodeid)
            if opcode in (w.OPEN, w.OPENDIR, w.FLUSH, w.ACCESS):
                return w.error(unique, errno.ENOSYS)  # see the module docstring
            if opcode in (w.GETXATTR, w.LISTXATTR):
                return self._forward(request, unique)
            if opcode == w.STATFS:
                return w.reply(unique, self.tree.statfs())
            if opcode in (w.RELEASE, w.RELEASEDIR, w.DESTROY):
                return w.reply(unique)
            if opcode in w.MUTATING:
                return w.error(unique, errno.EROFS)
            if opcode == w.READLINK:
                return w.error(unique, errno.EINVAL)
            return w.error(unique, errno.ENOSYS)
        except FsError as exc:
            return w.error(unique, exc.errno)
        except Exception:
            log.exception("FUSE %s failed", w.opcode_name(opcode))
            self.counters[ERRORS] += 1
            return w.error(unique, errno.EIO)

    def _read(self, request: bytes, unique: int, inode: int) -> list[bytes] | bytes | None:
        _, offset, size = w.READ_IN.unpack_from(request, w.HEADER_SIZE)
        reads = self.reads
        # A READ at offset 0 starts a read of the file: look in the store again (mountd may
        # have evicted it), so a kept descriptor only serves the READs that follow.
        fd = reads.kept(inode) if offset else None
        if fd is None:
            entry = self.tree.file(inode)
            if entry.size == 0:
                reads.empty_read()
                return w.reply(unique)
            try:
                fd = reads.open(entry)
            except (FileNotFoundError, CorruptObject):
                # A miss: the main process asks mountd. A store file whose size is not the
                # entry's goes there too, so that it fails (EIO), is logged and is remembered
                # for the kernel's retry exactly like a fetch of that row failing.
                return self._forward(request, unique)
            except OSError:
                return w.error(unique, errno.EIO)  # counted and logged by reads.open
            if offset == 0 and reads.first_read(inode, hit=True):
                self._hit(entry, reads.handed(inode))  # handed: mountd counted it already
        try:
            data = reads.read(inode, fd, offset, size)
        except OSError as exc:
            log.warning("read of inode %d failed: %s", inode, exc)
            return w.error(unique, errno.EIO)
        return [w.OUT_HEADER.pack(w.OUT_HEADER.size + len(data), 0, unique), data]

    def _passthrough(self, request: bytes, opcode: int, unique: int, inode: int) -> bytes | None:
        """OPEN and RELEASE of a mount with passthrough (quiverfs/fuse/passthrough.py)."""
        if opcode == w.OPEN:
            return self._open(request, unique, inode)
        assert self.backing is not None
        if w.RELEASE_IN.unpack_from(request, w.HEADER_SIZE)[0] == PASSTHROUGH_FH:
            self.backing.release(self.fd, inode)
        return w.reply(unique)

    def _open(self, request: bytes, unique: int, inode: int) -> bytes | None:
        """A passthrough OPEN: the store file handed to the kernel and counted as a file
        read (a hit), or forwarded to the main process (a miss, or a store file of the
        wrong size, which fails there); an empty file is an ordinary open (its READ answers
        nothing here)."""
        entry = self.tree.file(inode)
        if entry.size == 0:
            return w.reply(unique, w.open_body(w.FOPEN_KEEP_CACHE))
        reads = self.reads
        handed = False

        def open_store() -> int:
            nonlocal handed
            fd, handed = reads.open_unkept(entry)
            return fd

        assert self.backing is not None
        try:
            with_backing = self.backing.reply_open(self.fd, unique, inode, open_store)
        except (FileNotFoundError, CorruptObject):
            return self._forward(request, unique)
        except OSError:
            return w.error(unique, errno.EIO)  # counted and logged by reads.open_unkept
        # Without a backing file (the kernel refused it) the READ at offset 0 counts the file.
        if with_backing and reads.first_read(inode, hit=True):
            self._hit(entry, handed)
        return None

    def _hit(self, entry: FileEntry, handed: bool) -> None:
        """Queue a hit of ``entry`` for mountd (a handed-over file, which mountd counted, as
        served)."""
        record = HIT_RECORD.pack(entry.hash, entry.id)
        if handed:
            self._served.append(record)
            self._served_bytes += entry.size
        else:
            self._pending.append(record)
            self._pending_bytes += entry.size
        if len(self._pending) + len(self._served) >= FLUSH_BATCH:
            self._tick_due = True

    def _note_open(self, inode: int) -> None:
        """Queue an open of ``inode`` for mountd: the ``FUSE_IOCTL`` that Python's ``open()``
        sends for every file (it asks whether the file is a terminal) reaches us even when
        the kernel's pages will answer every READ, which then never do. A file opened was
        read, as far as what mountd protects for its reader goes (mountd/store/holds.py).
        Directories and empty files are not reported. Only while the main process asks
        (a sampler reads through the mount, whose claims' hits mountd keeps until opened):
        a plain reader's warm pass, one IOCTL per file and nothing else, ran 15% slower
        with every open reported (``mount_hits.py``, 2026-12-02)."""
        try:
            entry = self.tree.entry(inode)
        except FsError:
            return
        if isinstance(entry, FileEntry) and entry.size:
            self._opened.append(HIT_RECORD.pack(entry.hash, entry.id))
            if len(self._opened) >= OPEN_BATCH:
                self._tick_due = True

    def _forward(self, request: bytes, unique: int) -> bytes | None:
        try:
            self.main.send(FORWARD + request)
        except OSError as exc:
            log.warning("cannot reach the mount's main process: %s", exc)
            return w.error(unique, errno.EIO)
        return None


# -- starting workers ---------------------------------------------------------------------------


def fork_worker(slot: int, target: Callable[[int], None]) -> int:
    """Fork one process running ``target(slot)``; its pid (quiverfs/base/forking.py: it leaves
    the parent's trio run behind and exits when the parent dies)."""
    return fork_child(partial(target, slot), f"FUSE worker {slot}", f"quiverfs-fuse{slot}")


def default_workers() -> int:
    """Workers for this machine: one per core, at least 2, at most 4."""
    return max(2, min(4, len(os.sched_getaffinity(0))))
