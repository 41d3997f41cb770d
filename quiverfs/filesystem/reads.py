"""The one READ path of a mount's serving processes: store descriptors, sizes and counters.

Every process that serves a mount reads store files: a worker (quiverfs/fuse/worker.py) for hits,
the main process (quiverfs/filesystem/fs.py) for misses. Both do it through a :class:`StoreReads`,
so what a READ does to the disk and to the counters is written once:

* **Sizes are checked.** A store file is named by its content hash, and the content fixes its
  size; a digest row whose size disagrees with that (a damaged or forged digest) names bytes
  that are not its own. :meth:`StoreReads.open` compares the store file's size (one
  ``fstat``) with the entry's and refuses a mismatch with :class:`CorruptObject`, so a warm
  cache answers such a row as a cold one does (mountd's fill refuses the same bytes): ``EIO``.
* **Kept descriptors never pin evicted disk.** The READs of a large file follow each other, so
  a process keeps the store files it is reading open, by inode. An open descriptor keeps an
  evicted (unlinked) file's blocks allocated, outside mountd's cap, so what is kept is
  bounded: a file is closed once a READ reaches its end (the kernel keeps the pages it read);
  a process keeps at most :data:`OPEN_FILES` files and ``max_bytes`` bytes of them, its share
  of :data:`KEPT_SHARE` of the cache (:func:`kept_bytes`: all of a mount's processes
  together keep at most that), and a file larger than its share is closed after each READ;
  and :meth:`StoreReads.sweep` closes every kept file that has left the store
  (``st_nlink`` 0), which each process runs when mountd reports evictions and on its
  periodic timer. A READ that then needs a closed file reopens it from the store, or finds
  it gone (a miss, fetched again).
* **A store closed to this process is read by hand-off.** With ``mountd --private-store``
  only mountd's user may open store files; another user's mount gets ``EACCES``. Then
  :meth:`StoreReads.open` asks mountd for the descriptor (the ``open`` operation, through one
  :class:`~quiverfs.protocol.handoff.HandOff` per process, quiverfs/protocol/handoff.py) and goes on
  with it as with a store file it opened (size check, kept). mountd counts a descriptor it hands
  over as a hit of the dataset, so such a file is not reported to mountd again
  (:meth:`StoreReads.handed`); the mount's own counters count it as any hit. What mountd does not
  hand over (not cached) is a miss, fetched through mountd and then handed over.
* **Counters** (:data:`COUNTERS`) live in shared memory, one slot per process (a single writer
  each), so the main process can sum them at any time (``user.quiver.stats``).
* **A file read is counted once, where it missed.** The kernel reads a file larger than one
  READ with several READs at once, and any of the mount's processes may take each. When a
  READ past offset 0 misses, the main process fetches the file for it, and the READ at
  offset 0 of the same read may then reach a worker after the fetch landed: that worker
  would count a hit (and report one to mountd) for a file that was a miss. So the process
  that fetches for a READ past offset 0 counts the miss there and marks the inode in a
  shared byte per inode (:meth:`StoreReads.miss_past_start`) *before* it asks mountd, so no
  process can find the fetched file without seeing the mark; the READ at offset 0, in
  whichever process, clears the mark and counts nothing (:meth:`StoreReads.first_read`).
"""

from __future__ import annotations

import logging
import mmap
import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass

from digests.digest import FileEntry
from quiverfs.base.errors import CorruptObject
from quiverfs.filesystem.tree import Tree
from quiverfs.protocol.handoff import HandOff

log = logging.getLogger("quiverfs.reads")

#: Most store files one process keeps open.
OPEN_FILES = 64

#: Share of the cache's size that the store files a mount's serving processes keep open add
#: up to at most, all of them together (:func:`kept_bytes`). Evicted files stay allocated
#: while a descriptor is open, so this bounds how far a mount can push the disk past
#: mountd's cap until it closes them (at once when mountd reports the eviction; at its
#: next sweep otherwise): on a disk no larger than the cap, that is the room a fill may
#: have to wait for. Usually nothing is kept at all (finished files are closed at once).
KEPT_SHARE = 0.05

#: Most bytes of store files one process keeps open when the cache's size is unknown.
KEPT_BYTES = 16 << 20

#: Counter slots: what ``user.quiver.stats`` shows (see quiverfs.filesystem.fs.MountCounters).
COUNTERS = ("opens", "reads", "hits", "misses", "bytes", "errors")
OPENS, READS, HITS, MISSES, BYTES, ERRORS = range(len(COUNTERS))


class SharedCounters:
    """``slots`` rows of :data:`COUNTERS` (u64) in anonymous shared memory, made before fork,
    then one u64 per slot: the unique id of the request that slot's worker is handling (0:
    none), which the main process answers if the worker dies (quiverfs/fuse/worker_pool.py),
    then one u64 the main process sets while the workers are to report opens
    (:meth:`report_opens`), then one byte per inode below ``inodes``: the marks of misses
    counted past offset 0 (see the module docstring; pages of it are only allocated where an
    inode is marked)."""

    def __init__(self, slots: int, inodes: int = 0) -> None:
        self.slots = slots
        self.inodes = inodes
        self._width = 8 * len(COUNTERS)
        self._map = mmap.mmap(-1, (self._width + 8) * slots + 8 + inodes)

    def misses_past_start(self) -> memoryview | None:
        """The shared mark bytes, indexed by inode (None when made without ``inodes``: each
        process then keeps its own, which serves a mount of one process)."""
        if not self.inodes:
            return None
        start = (self._width + 8) * self.slots + 8
        return memoryview(self._map)[start:start + self.inodes]

    def report_opens(self) -> memoryview:
        """One u64, non-zero while the workers are to report each open of a file to the main
        process (quiverfs/fuse/worker.py: a sampler reads through the mount, and mountd keeps
        its claims' hits until they are opened); the main process writes it."""
        start = (self._width + 8) * self.slots
        return memoryview(self._map)[start:start + 8].cast("Q")

    def in_flight(self, index: int) -> memoryview:
        """Slot ``index``'s request in hand, as a writable array of one u64 (its worker writes
        it; the main process only after that worker died)."""
        start = self._width * self.slots + 8 * index
        return memoryview(self._map)[start:start + 8].cast("Q")

    def slot(self, index: int) -> memoryview:
        """Row ``index`` as a writable array of u64 (only its owner writes it)."""
        start = index * self._width
        return memoryview(self._map)[start:start + self._width].cast("Q")

    def totals(self) -> dict[str, int]:
        sums = [0] * len(COUNTERS)
        for index in range(self.slots):
            for i, value in enumerate(struct.unpack_from(f"<{len(COUNTERS)}Q", self._map, index * self._width)):
                sums[i] += value
        return dict(zip(COUNTERS, sums, strict=True))


def kept_bytes(cache_size: int | None, processes: int) -> int:
    """Most bytes of store files each of a mount's ``processes`` serving processes keeps open
    (their sizes summed): an equal part of :data:`KEPT_SHARE` of ``cache_size`` (what
    mountd's store holds: its ``hello``'s ``capacity``), or :data:`KEPT_BYTES` when that is
    unknown."""
    if not cache_size or cache_size <= 0:
        return KEPT_BYTES
    return int(cache_size * KEPT_SHARE) // max(1, processes)


@dataclass(slots=True)
class _Kept:
    fd: int
    hash: bytes
    size: int
    handed: bool = False  #: handed over by mountd, which counted it as a hit


class StoreReads:
    """Store files one serving process reads, kept open by inode, and its counters.

    Not thread-safe: one per process, used from its serving thread (a worker's signal
    handler only calls :meth:`sweep` while the worker is parked in ``read``).
    """

    def __init__(self, tree: Tree, counters: memoryview, *, max_files: int | None = None,
                 max_bytes: int | None = None, marks: memoryview | None = None) -> None:
        self.tree = tree
        self.counters = counters
        #: inode -> 1 while a miss past offset 0 is counted and its offset-0 READ is not seen
        #: (:meth:`SharedCounters.misses_past_start`; a private array when None)
        self._marks = marks if marks is not None else memoryview(
            bytearray(tree.digest.dir_count + tree.digest.file_count + 1))
        self.max_files = OPEN_FILES if max_files is None else max_files
        self.max_bytes = KEPT_BYTES if max_bytes is None else max_bytes
        #: inode -> kept store file, oldest first
        self._kept: dict[int, _Kept] = {}
        self._kept_bytes = 0
        #: asks mountd for the descriptors of a store closed to this process; made at the
        #: first ``EACCES`` (after a worker's fork: its connections are its own)
        self._handoff: HandOff | None = None

    # -- descriptors ----------------------------------------------------------------------------

    def kept(self, inode: int) -> int | None:
        """The descriptor kept for ``inode``, or None."""
        kept = self._kept.get(inode)
        return None if kept is None else kept.fd

    def kept_files(self) -> dict[int, int]:
        """inode -> descriptor of every kept file, oldest first (for tests and reports)."""
        return {inode: kept.fd for inode, kept in self._kept.items()}

    def handed(self, inode: int) -> bool:
        """Whether ``inode``'s kept descriptor was handed over by mountd, which counted it as
        a hit of the dataset already: the caller must not report that read to mountd again."""
        kept = self._kept.get(inode)
        return kept is not None and kept.handed

    def open(self, entry: FileEntry, path: str | None = None) -> int:
        """Open ``entry``'s store file (or ``path``, the store file mountd named), check its
        size, and keep it open for the READs that follow; its descriptor.

        When this process may not open the store (``EACCES``: a private store), mountd is
        asked to hand the descriptor over (see the module docstring, and :meth:`handed`).

        Raises :class:`FileNotFoundError` when the store lacks the content (a miss; on a
        closed store: mountd did not hand it over), :class:`CorruptObject` when the store
        file's size is not the entry's (the caller logs it: the worker forwards the READ so
        that the main process logs it once), and other :class:`OSError`\\ s (counted as errors
        and logged here; a ``PermissionError`` when mountd does not hand over the file it has
        just named in ``path``).
        """
        fd, handed = self.open_unkept(entry, path)
        self._keep(entry.id, _Kept(fd, entry.hash, entry.size, handed))
        return fd

    def open_unkept(self, entry: FileEntry, path: str | None = None) -> tuple[int, bool]:
        """:meth:`open` without keeping the descriptor: it is the caller's to close (a
        passthrough open hands it to the kernel, quiverfs/fuse/passthrough.py); also whether
        mountd handed it over (:meth:`handed`)."""
        handed = False
        try:
            fd = os.open(path or self.tree.store_path(entry.hash), os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            raise
        except PermissionError as exc:
            got = self._hand_off(entry)
            if got is None:
                if path is None:
                    # A closed store hides misses behind EACCES: mountd did not have it (or
                    # did not answer), so fetch it through mountd, then ask again.
                    raise FileNotFoundError(exc.errno, exc.strerror, exc.filename) from exc
                self.counters[ERRORS] += 1
                log.warning("cannot open the store file of %s, and mountd did not hand it "
                            "over: %s", entry.path, exc)
                raise
            fd, handed = got, True
        except OSError as exc:
            self.counters[ERRORS] += 1
            log.warning("cannot open the store file of %s: %s", entry.path, exc)
            raise
        try:
            size = os.fstat(fd).st_size
        except OSError as exc:
            os.close(fd)
            self.counters[ERRORS] += 1
            log.warning("cannot stat the store file of %s: %s", entry.path, exc)
            raise
        if size != entry.size:
            os.close(fd)
            raise CorruptObject(
                f"the digest gives {entry.path} {entry.size} bytes but its content "
                f"{entry.hash.hex()} has {size}: the digest is damaged")
        return fd, handed

    def _hand_off(self, entry: FileEntry) -> int | None:
        """The descriptor of ``entry``'s store file, opened by mountd (counted there as a hit
        of the dataset), or None: not cached, another size, or mountd not answering.

        A blocking request to the local mountd (one per file; the main process makes it from
        its trio thread, as it makes this process's other store opens)."""
        handoff = self._handoff
        if handoff is None:
            log.info("this process may not open the store of %s: asking mountd for the "
                     "descriptors of its files (hand-off)", self.tree.cache_dir)
            handoff = self._handoff = HandOff(self.tree.cache_dir, "the mount's store reads",
                                              "fetching them through mountd")
        (got,) = handoff.open([entry.hash], [entry.size], self.tree.digest.dataset_id)
        return None if got is None else got[0]

    def _keep(self, inode: int, kept: _Kept) -> None:
        self._close(inode)
        files = self._kept
        files[inode] = kept
        self._kept_bytes += kept.size
        # A file larger than the share is closed after the READ it was opened for (read):
        # nothing makes room for it. The new file is the newest: it stays until then.
        passing = kept.size if kept.size > self.max_bytes else 0
        while len(files) > 1 and (len(files) > self.max_files
                                  or self._kept_bytes - passing > self.max_bytes):
            self._close(next(iter(files)))

    def release(self, inode: int) -> None:
        """Close ``inode``'s kept file, if any (its READs will not come here)."""
        self._close(inode)

    def _close(self, inode: int) -> None:
        kept = self._kept.pop(inode, None)
        if kept is not None:
            self._kept_bytes -= kept.size
            os.close(kept.fd)

    def forget(self, hashes: Iterable[bytes]) -> int:
        """Close the kept files whose content is one of ``hashes`` (mountd evicted them);
        how many were closed."""
        gone = set(hashes)
        if not gone:
            return 0
        inodes = [inode for inode, kept in self._kept.items() if kept.hash in gone]
        for inode in inodes:
            self._close(inode)
        return len(inodes)

    def sweep(self) -> int:
        """Close the kept files that have left the store (no name left: ``st_nlink`` 0);
        how many were closed. One ``fstat`` per kept file."""
        gone = []
        for inode, kept in self._kept.items():
            try:
                if os.fstat(kept.fd).st_nlink == 0:
                    gone.append(inode)
            except OSError:
                gone.append(inode)
        for inode in gone:
            self._close(inode)
        return len(gone)

    def close(self) -> None:
        """Close every kept file (and the connections to mountd that hand-off made)."""
        for inode in list(self._kept):
            self._close(inode)
        if self._handoff is not None:
            self._handoff.close()

    # -- reading and counting ---------------------------------------------------------------------

    def first_read(self, inode: int, hit: bool) -> bool:
        """Count a file's first READ (offset 0) in this process, found in the store or not,
        unless a READ past offset 0 of the same read counted it as a miss already
        (:meth:`miss_past_start`); whether it counted (a hit that did not count is not a hit
        to report to mountd either).

        The kernel asks for offset 0 once per time it reads the file into its page cache, so
        this counts files read, not requests (see quiverfs.filesystem.fs.MountCounters).
        """
        marks = self._marks
        if marks[inode]:
            marks[inode] = 0
            return False
        counters = self.counters
        counters[OPENS] += 1
        counters[HITS if hit else MISSES] += 1
        return True

    def miss_past_start(self, inode: int) -> None:
        """Count a read of ``inode`` that missed at a READ past offset 0, about to be
        fetched, and mark it so that its READ at offset 0 counts nothing (see the module
        docstring). Call it before asking mountd: a process that finds the fetched file
        must see the mark."""
        self._marks[inode] = 1
        counters = self.counters
        counters[OPENS] += 1
        counters[MISSES] += 1

    def miss_failed(self, inode: int) -> None:
        """The fetch :meth:`miss_past_start` was for failed: the kernel's next read of the
        file starts afresh at offset 0 and counts as any read."""
        self._marks[inode] = 0

    def read(self, inode: int, fd: int, offset: int, size: int) -> bytes:
        """``size`` bytes at ``offset`` of the store file ``fd`` (inode ``inode``), counted;
        a kept file is closed once a READ reaches its end, and a file larger than this
        process's share of kept bytes after every READ. An OSError is counted (the caller
        logs it)."""
        counters = self.counters
        kept = self._kept.get(inode)
        if kept is not None and kept.fd != fd:
            kept = None
        try:
            data = os.pread(fd, size, offset)
        except OSError:
            counters[ERRORS] += 1
            if kept is not None and kept.size > self.max_bytes:
                self._close(inode)
            raise
        counters[READS] += 1
        counters[BYTES] += len(data)
        if kept is not None and (offset + len(data) >= kept.size or kept.size > self.max_bytes):
            # The kernel keeps what it read; a later READ of this file reopens it.
            self._close(inode)
        return data

    def empty_read(self) -> None:
        """Count a READ of an empty file (no store file: nothing to open)."""
        self.counters[READS] += 1
