"""The filesystem: a read-only ``pyfuse3.Operations`` serving one digest's tree.

The tree is the digest's (docs/mount.md "Tree"): directory and file ids from the digest are the
inode numbers (the root's id is 1 = ``pyfuse3.ROOT_INODE``), sizes come from the digest, every
directory is ``0o555`` and every file ``0o444``, owned by the mounting user. The tree never
changes, so entries and attributes are given long kernel timeouts and negative lookups are
cached too.

Inodes carry no state here: every answer is read from the digest (indexed SQLite lookups; the
last few thousand entries are kept in a bounded cache of immutable rows), so the kernel's
lookup counts need no bookkeeping and ``forget`` is a no-op. Directory handles
keep only a small read-ahead page for ``readdir``; file handles are the store file's own
descriptor.

Reads (docs/mount.md "Reads"):

* **hit** -- ``open`` finds the content-addressed store file (``mountd.layout.store_path``)
  and returns its descriptor as the FUSE file handle, with ``keep_cache`` (content never
  changes); ``read`` is one inline ``os.pread`` on it. No RPC, no thread hop. Hits are queued
  and reported to mountd in batches by the mount's background task (:meth:`take_hits`).
* **miss** -- ``open`` awaits the fetcher (mountd's ``ensure``: fetch, verify, store) and then
  opens the store file. Other requests keep being served meanwhile.

Errors from anywhere below become an errno in one place, :func:`errno_for`.

Concurrency: every handler runs in the trio thread of the FUSE process; code between two
``await``\\ s is atomic, which is what keeps the counters and the hit queue consistent. The
:class:`~digests.digest.Digest` must have been opened in that thread.
"""

from __future__ import annotations

import errno
import itertools
import json
import logging
import math
import os
import stat
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Protocol

import pyfuse3

from digests.digest import Digest, Entry, FileEntry
from digests.errors import DigestError
from mountd import layout
from mountd.errors import CacheFull
from mountd.protocol import PermissionDenied

log = logging.getLogger("quiverfs.fs")

#: Seconds the kernel may keep entries, attributes and negative lookups: the tree is immutable.
TIMEOUT = 24 * 3600.0

#: Mode bits of every file and directory (read-only for everybody; writes fail with EROFS).
FILE_MODE = stat.S_IFREG | 0o444
DIR_MODE = stat.S_IFDIR | 0o555

#: Block size reported by ``stat`` and ``statfs``.
BLOCK_SIZE = 4096

#: Entries read from the digest per ``listdir`` call; a readdir buffer (one page, about 25
#: readdirplus entries) that fills up keeps the rest of the page for the next call.
READDIR_PAGE = 128

#: Entries kept by inode for the requests that follow a LOOKUP (OPEN, GETATTR); ~2 MB.
RECENT_ENTRIES = 8192

#: Longest name a lookup can match (the digest refuses longer components).
NAME_MAX = 255

XATTR_HASH = b"user.quiver.hash"
XATTR_CACHED = b"user.quiver.cached"
XATTR_DATASET = b"user.quiver.dataset"
XATTR_STATS = b"user.quiver.stats"

#: ensure() + open() attempts for a miss whose store file is evicted before we open it.
ENSURE_ATTEMPTS = 3

#: Names on the root that are requests over the control channel (see quiverfs/control.py).
CONTROL_PREFIX = b"user.quiver.ctl."

FILE_XATTRS = (XATTR_HASH, XATTR_CACHED)
ROOT_XATTRS = (XATTR_DATASET, XATTR_STATS)


# -- errors -----------------------------------------------------------------------------------


def errno_for(exc: BaseException) -> int:
    """The errno a failed read or open reports for ``exc`` (the one mapping; docs/mount.md).

    Every file in the mount exists because the digest says so, so a remote ``NotFound`` is
    data loss at the source, not a missing name: ``EIO``, like every other remote or cache
    failure (``CorruptObject``, ``AccessDenied``, ``TemporaryFailure`` after mountd's
    retries, mountd unavailable). Two exceptions carry information a reader can act on:
    the cache being full (``ENOSPC``) and mountd refusing this user (``EACCES``).
    """
    if isinstance(exc, pyfuse3.FUSEError):
        return exc.errno
    if isinstance(exc, CacheFull):
        return errno.ENOSPC
    if isinstance(exc, PermissionDenied):
        return errno.EACCES
    # NotFound, CorruptObject, AccessDenied, MountdUnavailable, DigestError, an OSError on a
    # store file, or a bug: the read fails cleanly, the mount keeps serving.
    return errno.EIO


def fuse_error(exc: BaseException) -> pyfuse3.FUSEError:
    """``FUSEError`` for ``exc`` (see :func:`errno_for`)."""
    return exc if isinstance(exc, pyfuse3.FUSEError) else pyfuse3.FUSEError(errno_for(exc))


def _erofs() -> pyfuse3.FUSEError:
    return pyfuse3.FUSEError(errno.EROFS)


# -- what the operations need from outside ----------------------------------------------------


class Fetcher(Protocol):
    """Fills the store with a file's content and says where it is (mountd's ``ensure``)."""

    async def ensure(self, entry: FileEntry) -> str:
        """Path of the verified store file holding ``entry``'s content."""
        ...


@dataclass
class MountCounters:
    """This mount's counters, shown as ``user.quiver.stats`` on the root.

    ``opens``: successful opens of files; ``hits``/``misses``: opens served from the store
    directly / through mountd (empty files are neither); ``reads``: READ requests served
    (later opens of a file whose pages the kernel kept need none); ``bytes``: bytes those
    reads returned; ``errors``: opens and reads that failed with an I/O errno.
    """

    opens: int = 0
    reads: int = 0
    hits: int = 0
    misses: int = 0
    bytes: int = 0
    errors: int = 0

    def to_json(self) -> dict[str, int]:
        return asdict(self)


@dataclass
class _DirHandle:
    dir_id: int
    #: entries already read from the digest that did not fit the previous readdir buffer,
    #: and the offset cookie that precedes them
    spare: list[Entry] = field(default_factory=list)
    spare_after: int = -1


def _ns(timestamp: str) -> int:
    """``YYYY-MM-DDTHH:MM:SSZ`` → nanoseconds since the epoch (0 when unparsable)."""
    try:
        return int(time.mktime(time.strptime(timestamp, "%Y-%m-%dT%H:%M:%SZ")) - time.timezone) * 10**9
    except (ValueError, OverflowError):
        return 0


class QuiverOperations(pyfuse3.Operations):
    """The read-only filesystem of one digest over one cache directory.

    ``fetcher`` is awaited on a miss; ``uid``/``gid`` own every entry; ``extra_stats``
    (optional) adds fields to ``user.quiver.stats`` (the mount adds its pid, mountpoint and
    mountd state).
    """

    supports_dot_lookup = True
    enable_writeback_cache = False
    enable_acl = False

    def __init__(
        self,
        digest: Digest,
        cache_dir: str | os.PathLike[str],
        fetcher: Fetcher,
        *,
        uid: int | None = None,
        gid: int | None = None,
        extra_stats: Callable[[], dict] | None = None,
    ) -> None:
        super().__init__()
        self.digest = digest
        self.dataset_id = digest.dataset_id
        self.cache_dir = os.fspath(cache_dir)
        self.fetcher = fetcher
        self.uid = os.getuid() if uid is None else uid
        self.gid = os.getgid() if gid is None else gid
        self.counters = MountCounters()
        self._extra_stats = extra_stats
        self._mtime_ns = _ns(digest.created_at)
        self._dirs: dict[int, _DirHandle] = {}
        #: inode → entry for the most recently used entries (a bounded cache of immutable
        #: rows, not per-inode state: nothing depends on the kernel's lookup counts)
        self._recent: dict[int, Entry] = {}
        self._dir_handles = itertools.count(1)
        # Empty files need no store file: they all read from one descriptor of /dev/null.
        self._null_fd = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        self._pending_hashes: list[bytes] = []
        self._pending_bytes = 0
        # The store path of a hash, as a plain string: open() is the hot path and pathlib
        # costs ~10 µs a call. Checked against the layout contract so the two cannot drift.
        self._store_prefix = os.path.join(self.cache_dir, layout.STORE, "")
        probe = bytes(range(layout.HASH_BYTES))
        if self._store_path(probe) != os.fspath(layout.store_path(self.cache_dir, probe)):
            raise AssertionError("quiverfs.fs and mountd.layout disagree on store paths")

    def _store_path(self, content_hash: bytes) -> str:
        name = content_hash.hex()
        return f"{self._store_prefix}{name[0:2]}/{name[2:4]}/{name}"

    def close(self) -> None:
        """Release what the operations hold (not the digest: its owner closes it)."""
        if self._null_fd >= 0:
            os.close(self._null_fd)
            self._null_fd = -1

    # -- hit reports -----------------------------------------------------------------------

    def take_hits(self) -> tuple[list[bytes], int]:
        """The hashes opened from the store since the last call and their bytes; clears them."""
        hashes, nbytes = self._pending_hashes, self._pending_bytes
        self._pending_hashes, self._pending_bytes = [], 0
        return hashes, nbytes

    def stats(self) -> dict:
        """``user.quiver.stats`` as a dict."""
        out: dict = {"dataset": self.dataset_id, **self.counters.to_json()}
        if self._extra_stats is not None:
            out.update(self._extra_stats())
        return out

    # -- attributes ------------------------------------------------------------------------

    def _attr(self, entry: Entry) -> pyfuse3.EntryAttributes:
        attr = pyfuse3.EntryAttributes()
        attr.st_ino = entry.id
        attr.generation = 0
        attr.entry_timeout = TIMEOUT
        attr.attr_timeout = TIMEOUT
        if entry.is_dir:
            attr.st_mode = DIR_MODE
            attr.st_size = 0
            # 1 = "subdirectory count unknown" (as btrfs does), so no tool takes the
            # nlink-2 shortcut; computing the real count would cost a query per getattr.
            attr.st_nlink = 1
        else:
            attr.st_mode = FILE_MODE
            attr.st_size = entry.size
            attr.st_nlink = 1
            attr.st_blocks = math.ceil(entry.size / 512)
        attr.st_uid = self.uid
        attr.st_gid = self.gid
        attr.st_blksize = BLOCK_SIZE
        attr.st_atime_ns = attr.st_mtime_ns = attr.st_ctime_ns = self._mtime_ns
        return attr

    def _remember(self, entry: Entry) -> None:
        recent = self._recent
        recent[entry.id] = entry
        if len(recent) > RECENT_ENTRIES:
            del recent[next(iter(recent))]  # the oldest (dicts keep insertion order)

    def _entry(self, inode: int) -> Entry:
        entry = self._recent.get(inode)
        if entry is not None:
            return entry
        try:
            entry = self.digest.entry(inode)
        except DigestError as exc:
            log.error("digest lookup of inode %d failed: %s", inode, exc)
            raise pyfuse3.FUSEError(errno.EIO) from None
        if entry is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        self._remember(entry)
        return entry

    def _file(self, inode: int) -> FileEntry:
        entry = self._entry(inode)
        if entry.is_dir:
            raise pyfuse3.FUSEError(errno.EISDIR)
        return entry  # type: ignore[return-value]

    # -- the tree --------------------------------------------------------------------------

    async def lookup(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext = None) -> pyfuse3.EntryAttributes:
        if name == b".":
            return self._attr(self._entry(parent_inode))
        if name == b"..":
            parent = self._entry(parent_inode)
            return self._attr(self._entry(parent.parent or pyfuse3.ROOT_INODE))
        entry = None
        if len(name) <= NAME_MAX:
            try:
                entry = self.digest.lookup(parent_inode, name.decode("utf-8"))
            except UnicodeDecodeError:
                entry = None  # digest names are UTF-8: this name cannot be in it
            except DigestError as exc:
                log.error("digest lookup failed: %s", exc)
                raise pyfuse3.FUSEError(errno.EIO) from None
        if entry is None:
            # st_ino 0: a negative entry the kernel caches for entry_timeout (ENOENT to callers).
            negative = pyfuse3.EntryAttributes()
            negative.st_ino = 0
            negative.entry_timeout = TIMEOUT
            return negative
        self._remember(entry)  # the OPEN or GETATTR that usually follows needs no query
        return self._attr(entry)

    async def forget(self, inode_list) -> None:
        """Nothing to do: inodes hold no state (every answer comes from the digest)."""

    async def getattr(self, inode: int, ctx: pyfuse3.RequestContext = None) -> pyfuse3.EntryAttributes:
        return self._attr(self._entry(inode))

    async def opendir(self, inode: int, ctx: pyfuse3.RequestContext = None) -> int:
        entry = self._entry(inode)
        if not entry.is_dir:
            raise pyfuse3.FUSEError(errno.ENOTDIR)
        fh = next(self._dir_handles)
        self._dirs[fh] = _DirHandle(entry.id)
        return fh

    async def readdir(self, fh: int, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        """Page through ``Digest.listdir``; the offset cookie is the last entry id returned."""
        handle = self._dirs.get(fh)
        if handle is None:
            raise pyfuse3.FUSEError(errno.EBADF)
        after = start_id
        while True:
            from_spare = bool(handle.spare) and handle.spare_after == after
            if from_spare:
                page, handle.spare = handle.spare, []
            else:
                try:
                    page = self.digest.listdir(handle.dir_id, after or None, READDIR_PAGE)
                except ValueError:
                    raise pyfuse3.FUSEError(errno.EINVAL) from None  # a cookie we never gave
                except DigestError as exc:
                    log.error("digest listdir failed: %s", exc)
                    raise pyfuse3.FUSEError(errno.EIO) from None
            if not page:
                return
            for i, entry in enumerate(page):
                if not pyfuse3.readdir_reply(token, entry.name.encode("utf-8"), self._attr(entry), entry.id):
                    handle.spare, handle.spare_after = page[i:], after
                    return
                after = entry.id
            if not from_spare and len(page) < READDIR_PAGE:
                return  # the directory's last page (the next call gets an empty page: EOF)

    async def releasedir(self, fh: int) -> None:
        self._dirs.pop(fh, None)

    async def statfs(self, ctx: pyfuse3.RequestContext = None) -> pyfuse3.StatvfsData:
        out = pyfuse3.StatvfsData()
        out.f_bsize = BLOCK_SIZE
        out.f_frsize = BLOCK_SIZE
        out.f_blocks = math.ceil(self.digest.total_bytes / BLOCK_SIZE)
        out.f_bfree = out.f_bavail = 0
        out.f_files = self.digest.file_count + self.digest.dir_count
        out.f_ffree = out.f_favail = 0
        out.f_namemax = NAME_MAX
        return out

    # -- reads -----------------------------------------------------------------------------

    async def open(self, inode: int, flags: int, ctx: pyfuse3.RequestContext = None) -> pyfuse3.FileInfo:
        if flags & os.O_ACCMODE != os.O_RDONLY or flags & (os.O_TRUNC | os.O_APPEND):
            raise _erofs()
        entry = self._file(inode)
        counters = self.counters
        if entry.size == 0:
            counters.opens += 1
            return pyfuse3.FileInfo(fh=self._null_fd, keep_cache=True)
        try:
            fd = os.open(self._store_path(entry.hash), os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            fd = await self._open_miss(entry)
        except OSError as exc:
            counters.errors += 1
            log.warning("cannot open the store file of %s: %s", entry.path, exc)
            raise fuse_error(exc) from None
        else:
            counters.hits += 1
            self._pending_hashes.append(entry.hash)
            self._pending_bytes += entry.size
        counters.opens += 1
        return pyfuse3.FileInfo(fh=fd, keep_cache=True)

    async def _open_miss(self, entry: FileEntry) -> int:
        """Ask mountd for ``entry``'s content, then open the store file it names.

        mountd may evict the file between answering ``ensure`` and our ``open`` (another
        job's chunk eviction or LRU pressure on a full cache); the store file is then simply
        gone, so ask again, a bounded number of times, rather than fail the read.
        """
        self.counters.misses += 1
        error: Exception | None = None
        for _ in range(ENSURE_ATTEMPTS):
            try:
                path = await self.fetcher.ensure(entry)
                return os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError as exc:
                error = exc  # evicted before we opened it: ask again
            except Exception as exc:
                error = exc
                break
        self.counters.errors += 1
        log.warning("cannot read %s: %s", entry.path, error)
        raise fuse_error(error) from None

    async def read(self, fh: int, off: int, size: int) -> bytes:
        try:
            data = os.pread(fh, size, off)
        except OSError as exc:
            self.counters.errors += 1
            log.warning("read of file handle %d failed: %s", fh, exc)
            raise fuse_error(exc) from None
        counters = self.counters
        counters.reads += 1
        counters.bytes += len(data)
        return data

    async def release(self, fh: int) -> None:
        if fh != self._null_fd:
            os.close(fh)

    # flush stays pyfuse3's ENOSYS: the kernel then stops sending FLUSH on every close().

    # -- extended attributes ---------------------------------------------------------------

    def _xattr_names(self, entry: Entry) -> tuple[bytes, ...]:
        if entry.is_dir:
            return ROOT_XATTRS if entry.id == pyfuse3.ROOT_INODE else ()
        return FILE_XATTRS

    async def getxattr(self, inode: int, name: bytes, ctx: pyfuse3.RequestContext = None) -> bytes:
        if inode == pyfuse3.ROOT_INODE and name.startswith(CONTROL_PREFIX):
            # The control channel (quiverfs/control.py, docs/control-protocol.md): the name is
            # the request, the value the response; it never lists its names.
            from quiverfs.control import control_for

            return await control_for(self).getxattr(name)
        entry = self._entry(inode)
        if name not in self._xattr_names(entry):
            raise pyfuse3.FUSEError(errno.ENODATA)
        if name == XATTR_HASH:
            return entry.hash.hex().encode()  # type: ignore[union-attr]
        if name == XATTR_CACHED:
            if entry.size == 0:  # type: ignore[union-attr]
                return b"1"
            cached = os.path.exists(self._store_path(entry.hash))  # type: ignore[union-attr]
            return b"1" if cached else b"0"
        if name == XATTR_DATASET:
            return self.dataset_id.encode()
        return json.dumps(self.stats(), sort_keys=True).encode()  # XATTR_STATS

    async def listxattr(self, inode: int, ctx: pyfuse3.RequestContext = None) -> list[bytes]:
        return list(self._xattr_names(self._entry(inode)))

    async def setxattr(self, inode: int, name: bytes, value: bytes, ctx: pyfuse3.RequestContext = None) -> None:
        raise _erofs()

    async def removexattr(self, inode: int, name: bytes, ctx: pyfuse3.RequestContext = None) -> None:
        raise _erofs()

    # -- everything that would change the tree: EROFS --------------------------------------

    async def setattr(self, inode, attr, fields, fh, ctx) -> pyfuse3.EntryAttributes:
        raise _erofs()

    async def mknod(self, parent_inode, name, mode, rdev, ctx) -> pyfuse3.EntryAttributes:
        raise _erofs()

    async def mkdir(self, parent_inode, name, mode, ctx) -> pyfuse3.EntryAttributes:
        raise _erofs()

    async def unlink(self, parent_inode, name, ctx) -> None:
        raise _erofs()

    async def rmdir(self, parent_inode, name, ctx) -> None:
        raise _erofs()

    async def symlink(self, parent_inode, name, target, ctx) -> pyfuse3.EntryAttributes:
        raise _erofs()

    async def rename(self, parent_inode_old, name_old, parent_inode_new, name_new, flags, ctx) -> None:
        raise _erofs()

    async def link(self, inode, new_parent_inode, new_name, ctx) -> pyfuse3.EntryAttributes:
        raise _erofs()

    async def create(self, parent_inode, name, mode, flags, ctx) -> tuple[pyfuse3.FileInfo, pyfuse3.EntryAttributes]:
        raise _erofs()

    async def write(self, fh, off, buf) -> int:
        raise _erofs()
