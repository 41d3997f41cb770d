"""Cached files of a quiverfs mount read straight from the store, with the mount as fallback.

A hit through the mount costs FUSE round trips: a first pass over warm files reads at about a
tenth of the store files' own speed (docs/mount.md "Measured"). Yet a cached file is an
immutable, verified file at ``store_path(cache_dir, hash)``, and the store is traversable by
any local user who knows a hash (DESIGN.md "Many users, one cache"). :class:`DirectReader`
maps a path on a mount to its content hash with the mount's digest, opened read-only in each
process, and opens the store file itself::

    reader = DirectReader()
    with reader.open("/mnt/imagenet/train/n01440764/x.JPEG") as f:   # store file or mount
        data = f.read()

* **Mapping.** The first file read in a directory loads that directory's names, sizes and
  hashes from the digest (one index range scan); later files of it cost one dict lookup.
  An SQLite query per file would cost half as much as reading a warm 110 KiB file (its
  caches are cold after each read), which is what the direct read should approach. The
  mapping costs ~2.5 µs and ~150 bytes a file (ImageNet-like names), for the directories
  read, up to :data:`TABLE_FILES` files per mount and process; files of directories beyond
  that are looked up in the digest one by one. DataLoader workers forked from a process that
  already read (or :meth:`DirectReader.prepare`\\ d) share its mapping copy-on-write. Every
  :data:`RECHECK_SECONDS` a process asks the mount again who it is, so a mount replaced by
  another one at the same place is mapped with its own digest.
* **Fallback.** A store file that is not there (evicted, never cached) is read through the
  mount path, which fetches it through mountd, so the next read of it is direct. So is every
  file when this process cannot open the store (``EACCES``: a store that is not traversable),
  the mount's digest, or when the mount does not say where they are: each reason is logged
  once. A path on no quiverfs mount is opened as it is.
* **Hit reports.** mountd sees no request for a direct read, so its LRU recency and the hit
  counters of ``quiverfs stats`` would miss them. Each store file opened is queued as a hit
  and sent to mountd (the ``hits`` operation) by a thread of the process, every
  ``flush_hits`` hits or ``flush_seconds`` seconds, and when the reader or the process ends.
  Reports are advisory: a read never waits for mountd and never fails because it is away
  (the hits are then dropped, logged once).
* **Hand-off.** Where this process may not open the store (a ``--private-store``: its
  folders are not searchable), or when asked with ``handoff=True``, mountd opens the store
  files instead and passes their descriptors over its socket (:mod:`quiverfs.protocol.handoff`):
  :meth:`DirectReader.open_many` maps a batch of paths and asks for all of its cached files
  in one request (per 64), :meth:`DirectReader.open` is a batch of one. mountd counts what it
  hands over as hits, so those are not reported again.
* **Processes.** All state is per process, created on first use and checked against
  ``os.getpid()``: a reader can be pickled (DataLoader workers started with spawn, where it
  carries only its settings) or inherited (fork: the child opens its own digest connection,
  mountd connection and hit queue, and reuses what the parent had mapped and validated).
  A process that exits reports its last hits first, DataLoader workers included
  (``multiprocessing`` finalizers).

Torch-free; :mod:`quiverfs.torch` builds the ``ImageFolder`` loader and the dataset on it.
See docs/shim.md "Direct reads".
"""

from __future__ import annotations

import atexit
import json
import logging
import multiprocessing.util
import os
import threading
import time
import weakref
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import BinaryIO

from digests.digest import Digest
from digests.schema import ROOT_ID
from mountd.rpc.fdpass import close_all
from mountd.store import layout
from quiverfs.base.errors import QuiverError
from quiverfs.client.control_client import find_mount_root
from quiverfs.client.hit_reports import CLOSE_WAIT, FLUSH_HITS, FLUSH_SECONDS, HitReporter, log_once
from quiverfs.filesystem.fs import XATTR_STATS
from quiverfs.protocol.handoff import HandOff, can_open_store

__all__ = ["DirectReader", "MountInfo", "mount_info"]

log = logging.getLogger("quiverfs.direct")

#: Seconds between two checks that a mount is still the one whose digest maps its paths (one
#: ``getxattr`` the mount answers; a new mount takes longer than this to start, so a mount
#: replaced by another one at the same place is always noticed before a path is mapped).
RECHECK_SECONDS = 0.25
#: Files mapped in memory per mount and process (~150 bytes each); beyond, per-file queries.
TABLE_FILES = 2_000_000
#: Directories remembered per process as being on no quiverfs mount (cleared when full, and
#: every RECHECK_SECONDS, as a mount may appear there).
MAX_NOT_MOUNTED = 4096

#: This process's id (kept by _after_fork_in_child): ``os.getpid()`` is a system call, ~0.2 µs
#: that every read would pay to tell whether it runs in a new process.
_pid = os.getpid()


def _absolute(path: str | os.PathLike[str]) -> str:
    """``path`` as an absolute text path, as :meth:`DirectReader.open` takes it."""
    path = os.fspath(path)
    if not isinstance(path, str):
        path = os.fsdecode(path)
    return path if path.startswith("/") else os.path.abspath(path)


def _store_file(store: str, content_hash: bytes) -> str:
    """``layout.store_path`` as a string: pathlib costs ~10 µs a path, a third of reading a
    warm 110 KiB file; this ~0.4 µs. tests/unit/test_direct.py holds the two equal."""
    name = content_hash.hex()
    return f"{store}/{name[0:2]}/{name[2:4]}/{name}"


# -- what a mount says about itself ---------------------------------------------------------------


@dataclass(frozen=True)
class MountInfo:
    """Where a mount's store and digest are, from its ``user.quiver.stats``."""

    root: str  #: the mount point
    dataset: str  #: the dataset id
    cache_dir: str | None  #: None: a mount from before the direct loader (it does not say)
    #: the mount's private copy of its digest (readable by its owner), a name no other mount
    #: has: it tells this mount from a later one at the same place (``st_dev`` cannot: the
    #: kernel gives a new FUSE mount the device number the last one freed)
    digest: str | None


def mount_info(root: str) -> MountInfo:
    """What the quiverfs mount at ``root`` says about itself; ``OSError`` or ``ValueError``
    when it says nothing readable."""
    stats = json.loads(os.getxattr(root, XATTR_STATS))
    if not isinstance(stats, dict) or not isinstance(stats.get("dataset"), str):
        raise ValueError(f"{root}: {XATTR_STATS} names no dataset")
    return MountInfo(root, stats["dataset"], stats.get("cache_dir"), stats.get("digest"))


# -- hit reports -----------------------------------------------------------------------------------


# -- one mount, seen from one process -------------------------------------------------------------


@dataclass(slots=True)
class _Dir:
    """One directory of a mount's digest in memory: name → index into ``hashes`` (32 bytes
    each) and ``sizes``. ``names`` None: over the table's budget, asked file by file."""

    id: int
    names: dict[str, int] | None
    hashes: bytes = b""
    sizes: array | None = None
    #: 1 for each file whose store file was seen to have the row's size: a store file
    #: holds its hash's bytes for good, so one ``fstat`` per file and process is enough.
    sized: bytearray | None = None


class _MountFiles:
    """A mount's paths mapped to store files in one process: its digest (one connection per
    thread, as sqlite3 wants), its directories loaded so far (shared by the threads), the
    store and the reporter. ``usable`` False: every file of this mount is read through it."""

    def __init__(self, root: str, info: MountInfo | None = None, digest: Digest | None = None,
                 reporter: HitReporter | None = None, parent: _MountFiles | None = None) -> None:
        self.root = root
        self.prefix = root.rstrip("/") + "/"
        self.info = info
        self.usable = info is not None and info.cache_dir is not None and digest is not None
        self.dataset = info.dataset if info is not None else ""
        self.store = os.fspath(layout.store_dir(info.cache_dir)) if self.usable else ""  # type: ignore[union-attr, arg-type]
        self.reporter = reporter
        self.check_at = time.monotonic() + RECHECK_SECONDS
        self._template = digest
        self._template_thread = threading.get_ident()
        self._local = threading.local()
        #: directory (absolute path) → its files, or None when the digest has no such directory
        self.dirs: dict[str, _Dir | None] = parent.dirs if parent is not None else {}
        self.mapped = parent.mapped if parent is not None else 0  #: files held in ``dirs``
        #: set when this process asks mountd for the store files' descriptors (hand-off)
        self.handoff: HandOff | None = None

    def still_mounted(self) -> bool:
        """Whether the mount at the root is still this one (not unmounted, nor replaced by
        another dataset: this digest would then map its paths to the wrong content)."""
        self.check_at = time.monotonic() + RECHECK_SECONDS
        try:
            return mount_info(self.root) == self.info
        except (OSError, ValueError):
            return False

    def content(self, path: str) -> tuple[int, bytes, _Dir | None, int] | None:
        """``(size, hash, directory, index)`` of the file at absolute ``path`` (under the
        root), or None; ``directory`` is None when the file was asked of the digest alone."""
        directory, _, name = path.rpartition("/")
        try:
            found = self.dirs[directory]
        except KeyError:
            found = self._load(directory)
        if found is None:
            return None
        if found.names is None:
            row = self._digest().content(found.id, name)
            return None if row is None else (row[0], row[1], None, 0)
        i = found.names.get(name)
        if i is None:
            return None
        return found.sizes[i], found.hashes[32 * i:32 * i + 32], found, i  # type: ignore[index]

    def _load(self, directory: str) -> _Dir | None:
        """Map the files of ``directory`` (absolute, the root or under it), or only its id
        once the table is full."""
        digest = self._digest()
        rel = "" if directory + "/" == self.prefix else directory[len(self.prefix):]
        if rel:
            entry = digest.lookup_path(rel)
            dir_id = entry.id if entry is not None and entry.is_dir else None
        else:
            dir_id = ROOT_ID
        found = None
        if dir_id is not None:
            found = _Dir(dir_id, None)
            if self.mapped < TABLE_FILES:
                rows = digest.dir_contents(dir_id)
                found.names = {name: i for i, (name, _, _) in enumerate(rows)}
                found.hashes = b"".join(h for _, _, h in rows)
                found.sizes = array("q", (s for _, s, _ in rows))
                found.sized = bytearray(len(rows))
                self.mapped += len(rows)
        self.dirs[directory] = found
        return found

    def _digest(self) -> Digest:
        local = self._local
        digest = getattr(local, "digest", None)
        if digest is None:
            assert self._template is not None
            if threading.get_ident() == self._template_thread:
                digest = self._template
            else:  # validated already: a connection of this thread's own
                digest = self._template.reopen()
            local.digest = digest
        return digest


# -- the per-process state of a reader -------------------------------------------------------------


@dataclass(frozen=True)
class _Settings:
    digests: tuple[str, ...]
    flush_hits: int
    flush_seconds: float
    report: bool
    #: True: always hand-off; False: never; None: where the store cannot be opened
    handoff: bool | None = None


class _Process:
    """Everything a :class:`DirectReader` holds in one process (see the module docstring)."""

    def __init__(self, settings: _Settings, inherited: _Process | None) -> None:
        self.pid = _pid
        self.settings = settings
        self.lock = threading.Lock()  # held while a mount is found and its digest opened
        self.mounts: list[_MountFiles] = []
        #: the mount of the last file read from the store: DirectReader.open's shortcut
        self.last_store: _MountFiles | None = None
        self.not_mounted: set[str] = set()
        self.not_mounted_until = 0.0
        self.reporters: dict[str, HitReporter] = {}
        #: cache directory -> this process's hand-off connections to its mountd
        self.handoffs: dict[str, HandOff] = {}
        #: digests opened (validated) in this process, by path
        self.digests: dict[str, Digest] = {}
        #: a forked child's view of its parent: digests to reopen unchecked, mappings to reuse
        self.parent_digests: dict[str, Digest] = {}
        self.parent_mounts: dict[str, _MountFiles] = {}
        if inherited is not None:  # only read here: the parent's objects are the parent's
            self.parent_digests = {**inherited.parent_digests, **inherited.digests}
            self.parent_mounts = {**inherited.parent_mounts,
                                  **{m.root: m for m in inherited.mounts if m.usable}}
        #: per-thread counters (no lock on the read path); summed by counts()
        self.local = threading.local()
        self.thread_counts: list[dict[str, int]] = []

    def counter(self) -> dict[str, int]:
        """This thread's counters."""
        counts = getattr(self.local, "counts", None)
        if counts is None:
            counts = self.local.counts = {"store": 0, "mount": 0, "elsewhere": 0}
            with self.lock:
                self.thread_counts.append(counts)
        return counts

    def mount_of(self, path: str) -> _MountFiles | None:
        """The mount holding absolute ``path`` (found once per mount and process), or None."""
        for files in self.mounts:
            if path.startswith(files.prefix):
                if time.monotonic() < files.check_at or files.still_mounted():
                    return files
                with self.lock:
                    self.mounts = [m for m in self.mounts if m is not files]
                    if self.last_store is files:
                        self.last_store = None
                break
        directory = os.path.dirname(path)
        if directory in self.not_mounted and time.monotonic() < self.not_mounted_until:
            return None
        with self.lock:
            for files in self.mounts:  # found by another thread meanwhile
                if path.startswith(files.prefix):
                    return files
            root = find_mount_root(directory)
            if root is None:
                self._remember_not_mounted(directory)
                return None
            files = self._open_mount(root)
            self.mounts = [*self.mounts, files]
            return files

    def _remember_not_mounted(self, directory: str) -> None:
        now = time.monotonic()
        if now >= self.not_mounted_until or len(self.not_mounted) >= MAX_NOT_MOUNTED:
            self.not_mounted = set()
            self.not_mounted_until = now + RECHECK_SECONDS
        self.not_mounted.add(directory)

    def _open_mount(self, root: str) -> _MountFiles:
        try:
            info = mount_info(root)
        except (OSError, ValueError) as exc:
            log_once(f"info:{root}", "direct reads: %s does not say where its store is (%s); "
                      "reading through the mount", root, exc)
            return _MountFiles(root)
        if not info.cache_dir or not info.digest:
            log_once(f"info:{root}", "direct reads: the mount at %s does not say where its "
                      "store and digest are (mounted by an older quiverfs); reading through it", root)
            return _MountFiles(root)
        digest = self._digest_for(info)
        if digest is None:
            return _MountFiles(root)
        reporter = self.reporters.get(info.cache_dir)
        if reporter is None and self.settings.report:
            reporter = self.reporters[info.cache_dir] = HitReporter(
                info.cache_dir, self.settings.flush_hits, self.settings.flush_seconds)
        parent = self.parent_mounts.get(root)
        same = parent is not None and parent.info == info and parent._template is not None \
            and parent._template.path == digest.path
        files = _MountFiles(root, info, digest, reporter, parent if same else None)
        files.handoff = self._handoff_for(files)
        return files

    def _handoff_for(self, files: _MountFiles) -> HandOff | None:
        """The hand-off to read ``files``' cached files with, or None to open them from the
        store directly: with ``handoff=None``, only where this process may not search the
        store's folders (decided once per mount and process)."""
        if not files.usable or self.settings.handoff is False:
            return None
        if self.settings.handoff is None:
            if can_open_store(files.store):
                return None
            log_once(f"handoff:{files.store}", "direct reads of %s: this process may not open "
                      "its store files (%s is not traversable for it); mountd hands them over "
                      "instead", files.root, files.store)
        assert files.info is not None and files.info.cache_dir is not None
        handoff = self.handoffs.get(files.info.cache_dir)
        if handoff is None:
            handoff = self.handoffs[files.info.cache_dir] = HandOff(files.info.cache_dir)
        return handoff

    def _digest_for(self, info: MountInfo) -> Digest | None:
        """The digest of ``info``'s dataset: one the caller gave, else the mount's own copy."""
        for path in self.settings.digests:
            digest = self._open_digest(path, info.root)
            if digest is not None and digest.dataset_id == info.dataset:
                return digest
        assert info.digest is not None
        digest = self._open_digest(info.digest, info.root)
        if digest is not None and digest.dataset_id != info.dataset:
            log_once(f"digest:{info.digest}", "direct reads: digest %s is not the one of %s; "
                      "reading through the mount", info.digest, info.root)
            return None
        return digest

    def _open_digest(self, path: str, root: str) -> Digest | None:
        digest = self.digests.get(path)
        if digest is not None:
            return digest
        try:
            parent = self.parent_digests.get(path)
            digest = parent.reopen() if parent is not None else Digest.open(path)
        except (QuiverError, OSError) as exc:
            log_once(f"digest:{path}", "direct reads of %s: cannot open digest %s (%s); "
                      "reading through the mount", root, path, exc)
            return None
        self.digests[path] = digest
        return digest

    def close(self, timeout: float = CLOSE_WAIT) -> None:
        """Send the last hit reports; the digests close when their threads let them go."""
        deadline = time.monotonic() + timeout
        for reporter in list(self.reporters.values()):
            reporter.close(max(0.0, deadline - time.monotonic()))
        for handoff in list(self.handoffs.values()):
            handoff.close()


# Every process's live states, closed (their last hits reported) when that process exits.
_live: list[_Process] = []
_exit_hooked_pid = 0


def _at_exit() -> None:
    """Close this process's states (a forked child also holds its parent's: left alone)."""
    pid = os.getpid()
    for proc in [p for p in _live if p.pid == pid]:
        proc.close()


def _hook_exit() -> None:
    """Report the last hits at exit: ``atexit`` for a plain process, a ``multiprocessing``
    finalizer for its children (DataLoader workers), which leave through ``os._exit``."""
    global _exit_hooked_pid
    if _exit_hooked_pid != os.getpid():
        _exit_hooked_pid = os.getpid()
        atexit.register(_at_exit)
        multiprocessing.util.Finalize(None, _at_exit, exitpriority=10)


def _after_fork_in_child() -> None:
    """Note the child's pid; and as a fork copies a lock held by another thread as held
    forever, give each reader a new one (its per-process state is replaced anyway)."""
    global _pid
    _pid = os.getpid()
    for reader in list(_readers):
        reader._lock = threading.Lock()


_readers: weakref.WeakSet[DirectReader] = weakref.WeakSet()
os.register_at_fork(after_in_child=_after_fork_in_child)


class DirectReader:
    """Opens files of quiverfs mounts from the store when they are cached (module docstring).

    ``digests``: digest files this process may read, for mounts whose own copy it cannot
    (another user's mount: the copy is private to its owner); each is used for the mount of
    its dataset. ``flush_hits``/``flush_seconds``: a hit report is sent every so many hits or
    seconds. ``report=False`` sends none: mountd's LRU then ages files read only this way
    and ``quiverfs stats`` does not count them (for a user who cannot reach mountd's socket,
    or to measure what the reports cost). ``handoff``: ask mountd for the descriptors of
    cached files (:meth:`open_many`; mountd counts them as hits) instead of opening the
    store files: None (default) where this process may not open the store, True always,
    False never (the mount then reads them). Safe to share between threads; picklable (only
    the settings travel).
    """

    def __init__(self, *, digests: Sequence[str | os.PathLike[str]] = (),
                 flush_hits: int = FLUSH_HITS, flush_seconds: float = FLUSH_SECONDS,
                 report: bool = True, handoff: bool | None = None) -> None:
        self._settings = _Settings(tuple(os.fspath(d) for d in digests), flush_hits,
                                   flush_seconds, report, handoff)
        self._proc: _Process | None = None
        self._lock = threading.Lock()
        _readers.add(self)

    def __getstate__(self) -> dict:
        return {"settings": self._settings}

    def __setstate__(self, state: dict) -> None:
        self._settings = state["settings"]
        self._proc = None
        self._lock = threading.Lock()
        _readers.add(self)

    def _state(self) -> _Process:
        proc = self._proc
        if proc is not None and proc.pid == _pid:
            return proc
        with self._lock:
            proc = self._proc
            if proc is None or proc.pid != _pid:
                proc = self._proc = _Process(self._settings, proc)
                _live.append(proc)
                _hook_exit()
        return proc

    # -- reading ---------------------------------------------------------------------------

    def open(self, path: str | os.PathLike[str]) -> BinaryIO:
        """``path`` opened for reading in binary: its store file when the path is on a
        quiverfs mount and its content is cached, else the path itself (through the mount:
        a miss is fetched)."""
        # Every read of a DataLoader worker pays what runs here, against ~3 µs for the
        # open() and close() themselves and ~20 µs for reading a warm 110 KiB file. So a
        # file of the mount this process last read from the store, in a directory mapped
        # already, takes this path with no further calls than the store open itself
        # (~1.3 µs over a plain open(), was ~2: docs/benchmarks.md "direct_loader.py");
        # everything else takes _open.
        proc = self._proc
        if proc is not None and proc.pid == _pid and type(path) is str:
            files = proc.last_store
            if files is not None and path.startswith(files.prefix) \
                    and time.monotonic() < files.check_at:
                directory, _, name = path.rpartition("/")
                folder = files.dirs.get(directory)
                if folder is not None and folder.names is not None:
                    i = folder.names.get(name)
                    if i is not None and folder.sizes[i] > 0:  # type: ignore[index]
                        f = self._open_store(files, folder.sizes[i],  # type: ignore[index]
                                             folder.hashes[32 * i:32 * i + 32], folder, i)
                        if f is not None:
                            try:
                                proc.local.counts["store"] += 1
                            except AttributeError:  # this thread's first count
                                proc.counter()["store"] += 1
                            return f
        return self._open(path)

    def _open(self, path: str | os.PathLike[str]) -> BinaryIO:
        """:meth:`open` for a path its shortcut does not take: any path form, a first read
        of a mount or directory, a mount to check again, a store file not there."""
        if type(path) is not str or path[:1] != "/":
            path = _absolute(path)
        proc = self._proc
        if proc is None or proc.pid != _pid:
            proc = self._state()
        files = proc.mount_of(path)
        if files is None:
            proc.counter()["elsewhere"] += 1
            return open(path, "rb")
        if files.handoff is not None:
            return self.open_many([path])[0]
        if files.usable:
            found = files.content(path)
            if found is None:  # maybe a path with "//", "/./" or "..": only then normalise
                normal = os.path.normpath(path)
                if normal != path:
                    return self.open(normal)
            elif found[0] > 0:
                f = self._open_store(files, *found)
                if f is not None:
                    proc.last_store = files
                    proc.counter()["store"] += 1
                    return f
        proc.counter()["mount"] += 1
        return open(path, "rb")

    def read(self, path: str | os.PathLike[str]) -> bytes:
        """The whole content of ``path`` (as :meth:`open`)."""
        with self.open(path) as f:
            return f.read()

    def open_many(self, paths: Sequence[str | os.PathLike[str]]) -> list[BinaryIO]:
        """Each path opened as :meth:`open` would, in order; the cached files of mounts read
        by hand-off come from one ``open`` request to mountd (per 64 files and mount), the
        rest as :meth:`open` opens them. Raises what opening a path raises (through the
        mount: ``EIO`` for a damaged digest row, say), with none of the files left open."""
        proc = self._state()
        counts = proc.counter()
        out: list[BinaryIO | None] = [None] * len(paths)
        asks: dict[_MountFiles, list[tuple[int, str, int, bytes]]] = {}
        through_mount: list[tuple[int, str]] = []
        try:
            for i, raw in enumerate(paths):
                if i and not proc.handoffs:  # the first path's mount did not start hand-off
                    out[i] = self.open(raw)
                    continue
                path = _absolute(raw)
                files = proc.mount_of(path)
                if files is None or files.handoff is None:
                    out[i] = self.open(path)
                    continue
                found = files.content(path)
                normal = os.path.normpath(path)
                if found is None and normal != path:  # "//", "/./" or "..": as open() does
                    out[i] = self.open(normal)
                elif found is None or found[0] == 0:
                    through_mount.append((i, path))  # not a file of the digest, or empty
                else:
                    asks.setdefault(files, []).append((i, path, found[0], found[1]))
            for files, group in asks.items():
                assert files.handoff is not None
                opened = files.handoff.open([h for *_, h in group], [s for _, _, s, _ in group],
                                            files.dataset)
                for n, ((i, path, size, _), item) in enumerate(zip(group, opened, strict=True)):
                    if item is not None and item[1] == size:
                        try:
                            out[i] = open(item[0], "rb")  # noqa: SIM115 (the caller closes it)
                        except BaseException:
                            close_all([it[0] for it in opened[n:] if it is not None])
                            raise
                        counts["store"] += 1
                    else:  # not cached (or mountd not reached): the mount fetches it
                        if item is not None:
                            os.close(item[0])
                        through_mount.append((i, path))
            for i, path in through_mount:
                counts["mount"] += 1  # as open() counts: before opening, which may fail (EIO)
                out[i] = open(path, "rb")  # noqa: SIM115 (the caller closes it)
        except BaseException:
            for f in out:
                if f is not None:
                    f.close()
            raise
        return out  # type: ignore[return-value]

    @staticmethod
    def _open_store(files: _MountFiles, size: int, content_hash: bytes, folder: _Dir | None,
                    i: int) -> BinaryIO | None:
        """The store file of ``content_hash``, or None when it is not there, not ours to
        open, or not of the digest row's ``size`` (checked once per file of ``folder``)."""
        try:
            f = open(_store_file(files.store, content_hash), "rb")  # noqa: SIM115 (the caller closes it)
        except FileNotFoundError:
            return None  # evicted or never cached: the mount fetches it
        except OSError as exc:
            log_once(f"store:{files.store}:{exc.errno}", "direct reads of %s: cannot open its "
                      "store files (%s: is the store traversable? docs/shim.md); reading "
                      "through the mount", files.root, exc)
            return None
        if folder is None or not folder.sized[i]:  # type: ignore[index]
            if os.fstat(f.fileno()).st_size != size:
                # A row whose size is not its content's names bytes that are not its own:
                # the mount refuses it with EIO (docs/mount.md "Sizes",
                # docs/store-layout.md), so it answers this read too. ~1.5 µs, a tenth of
                # a warm 110 KiB read: once per file and process.
                f.close()
                return None
            if folder is not None:
                folder.sized[i] = 1  # type: ignore[index]
        if files.reporter is not None:
            files.reporter.add(files.dataset, content_hash, size)
        return f

    # -- mounts, reports, counts -----------------------------------------------------------

    def prepare(self, path: str | os.PathLike[str]) -> bool:
        """Find the mount holding directory ``path``, open its digest and map that directory
        now (in a DataLoader's main process, say: forked workers then reuse all of it), and
        connect this process's hit reporter to mountd; True when its files can be read
        directly."""
        full = os.path.abspath(path)
        proc = self._state()
        files = proc.mount_of(os.path.join(full, ""))
        if files is None or not files.usable:
            return False
        files.content(os.path.join(full, ""))
        if files.reporter is not None:
            files.reporter.start()
        return True

    def flush(self, timeout: float = CLOSE_WAIT) -> bool:
        """Send this process's queued hits now and wait (at most ``timeout`` seconds) for
        mountd; True when all of them were recorded."""
        proc = self._state()
        return all([r.flush(timeout) for r in list(proc.reporters.values())])

    def counts(self) -> dict[str, int]:
        """Files this process opened: ``store`` (direct hits, reported to mountd), ``mount``
        (through the mount: misses, evictions, a store or digest it cannot open, empty
        files), ``elsewhere`` (on no quiverfs mount)."""
        proc = self._state()
        total = {"store": 0, "mount": 0, "elsewhere": 0}
        with proc.lock:
            for counts in proc.thread_counts:
                for key, value in counts.items():
                    total[key] += value
        return total

    def close(self) -> None:
        """Report this process's last hits (waiting at most :data:`CLOSE_WAIT` seconds) and
        forget its state; the reader may be used again (it starts anew)."""
        with self._lock:
            proc, self._proc = self._proc, None
        if proc is not None and proc.pid == _pid:
            proc.close()
            if proc in _live:
                _live.remove(proc)
