"""The mount's tree: one digest's directories and files as inodes, attributes and listings.

Directory and file ids from the digest are the inode numbers (the root's id is 1, FUSE's root
nodeid), sizes come from the digest, every directory is ``0o555`` and every file ``0o444``,
owned by the mounting user (docs/mount.md "Tree"). The tree never changes, so answers carry
long kernel timeouts and negative lookups are cached too.

Inodes carry no state: every answer is read from the digest (indexed SQLite lookups; the last
few thousand entries are kept in a bounded cache of immutable rows), so the kernel's lookup
counts need no bookkeeping and ``FORGET`` needs no answer. That is also what lets several
processes serve one mount (quiverfs/fuse/worker.py): each has its own :class:`Tree` over its
own connection to the digest, and any of them can answer any request.

Nothing here does FUSE I/O: the methods return :class:`~quiverfs.protocol.fuse_wire.Attributes`,
entries and encoded listings, and raise :class:`FsError` with the errno to report.
"""

from __future__ import annotations

import calendar
import contextlib
import errno
import logging
import os
import stat
import time
from collections import OrderedDict

from digests.digest import ROOT_ID, Digest, Entry, FileEntry
from digests.errors import DigestError
from mountd.store import layout
from quiverfs.base.errors import FsError
from quiverfs.protocol import fuse_wire
from quiverfs.protocol.fuse_wire import Attributes

log = logging.getLogger("quiverfs.tree")

#: Seconds the kernel may keep entries, attributes and negative lookups: the tree is immutable.
TIMEOUT = 24 * 3600

#: Mode bits of every file and directory (read-only for everybody; writes fail with EROFS).
FILE_MODE = stat.S_IFREG | 0o444
DIR_MODE = stat.S_IFDIR | 0o555

#: Block size reported by ``statfs`` and a directory's ``stat``.
BLOCK_SIZE = 4096

#: Most a file's ``st_blksize`` says (:func:`io_block`): one READ of the largest size the
#: mount asks the kernel for.
MAX_IO_BLOCK = fuse_wire.MAX_READ_BYTES


def io_block(size: int) -> int:
    """A file's ``st_blksize``: its size rounded up to a power of two, from :data:`BLOCK_SIZE`
    to :data:`MAX_IO_BLOCK`.

    Why: ``st_blksize`` is the "preferred I/O size", and Python's ``open()`` sizes its buffer
    from it. With 4 KiB, PIL opening a 110 KiB JPEG read 16 bytes, then 64 KiB at a time, and
    the kernel's read-ahead, starting small, sent the mount 3.3 READs per file, each a round
    trip to a worker; with the file's own size the buffer's first fill asks for all of it,
    and one READ serves the file (measured 2026-11-30: 20 files, 66 READs against 20).
    """
    block = BLOCK_SIZE
    while block < size and block < MAX_IO_BLOCK:
        block <<= 1
    return block


#: Entries read from the digest per listing query; a READDIR buffer (one page, about 25
#: readdirplus entries) that fills up keeps the rest for the next request.
READDIR_PAGE = 128

#: Entries kept by inode for the requests that follow a LOOKUP (READ, GETATTR); ~2 MB.
RECENT_ENTRIES = 8192

#: Longest name a lookup can match (the digest refuses longer components).
NAME_MAX = 255

ROOT_INODE = ROOT_ID

#: Listing cookies (the offsets READDIR resumes from): 0 is the start, ``.`` and ``..`` have
#: their own, and a digest entry's is its id shifted past them (ids start at 1, so an entry's
#: cookie is at least 3 and a cookie below 3 never names an entry).
DOT_COOKIE = 1
DOTDOT_COOKIE = 2
COOKIE_SHIFT = 2

#: One listed name: ``(name, entry, cookie)``; ``.`` and ``..`` carry their directory entries.
Listed = tuple[bytes, Entry, int]


def _ns(timestamp: str) -> int:
    """``YYYY-MM-DDTHH:MM:SSZ`` → nanoseconds since the epoch (0 when unparsable)."""
    try:
        return calendar.timegm(time.strptime(timestamp, "%Y-%m-%dT%H:%M:%SZ")) * 10**9
    except (ValueError, OverflowError):
        return 0


class Tree:
    """One process's view of a digest as a read-only tree over one cache directory."""

    def __init__(self, digest: Digest, cache_dir: str | os.PathLike[str], *,
                 uid: int | None = None, gid: int | None = None) -> None:
        self.digest = digest
        self.cache_dir = os.fspath(cache_dir)
        self.uid = os.getuid() if uid is None else uid
        self.gid = os.getgid() if gid is None else gid
        self.mtime_ns = _ns(digest.created_at)
        #: inode → entry for the most recently used entries (immutable rows, not state). An
        #: OrderedDict: dropping a plain dict's first key in a steady stream of inserts costs
        #: ~4 µs (iteration skips the deleted slots), popitem(last=False) ~0.3 µs.
        self._recent: OrderedDict[int, Entry] = OrderedDict()
        #: (directory, cookie, entries, last) of the last listing page that did not fit
        self._spare: tuple[int, int, list[Listed], bool] = (0, 0, [], False)

    def store_path(self, content_hash: bytes) -> str:
        """Where the store keeps ``content_hash`` (:func:`mountd.store.layout.store_file`:
        a string, no ``pathlib``, as reads are the hot path)."""
        return layout.store_file(self.cache_dir, content_hash)

    # -- entries ---------------------------------------------------------------------------

    def attributes(self, entry: Entry) -> Attributes:
        if entry.is_dir:
            return Attributes(entry.id, DIR_MODE, 0, self.uid, self.gid, self.mtime_ns, BLOCK_SIZE)
        return Attributes(entry.id, FILE_MODE, entry.size, self.uid, self.gid, self.mtime_ns,  # type: ignore[union-attr]
                          io_block(entry.size))  # type: ignore[union-attr]

    def _remember(self, entry: Entry) -> None:
        recent = self._recent
        recent[entry.id] = entry
        if len(recent) > RECENT_ENTRIES:
            recent.popitem(last=False)  # the oldest

    def entry(self, inode: int) -> Entry:
        """The entry of ``inode``; ENOENT if there is none, EIO if the digest fails."""
        entry = self._recent.get(inode)
        if entry is not None:
            return entry
        try:
            entry = self.digest.entry(inode)
        except DigestError as exc:
            log.error("digest lookup of inode %d failed: %s", inode, exc)
            raise FsError(errno.EIO) from None
        if entry is None:
            raise FsError(errno.ENOENT)
        self._remember(entry)
        return entry

    def file(self, inode: int) -> FileEntry:
        """The file of ``inode``; EISDIR for a directory."""
        entry = self.entry(inode)
        if entry.is_dir:
            raise FsError(errno.EISDIR)
        return entry  # type: ignore[return-value]

    def files(self, first: int, last: int, more: int = 0) -> list[FileEntry]:
        """The files with ids ``first .. last``, in id order: from the recent entries when they
        are all there, else one range query (:meth:`Digest.files_between`) that also reads
        the ``more`` ids after ``last`` (a scan asks for those next); the entries read are
        remembered. A damaged row is left out (logged), not an error: the callers
        (read-ahead) only look ahead."""
        recent = self._recent
        known = [recent.get(inode) for inode in range(first, last + 1)]
        if all(entry is not None and not entry.is_dir for entry in known):
            return known  # type: ignore[return-value]
        try:
            entries = self.digest.files_between(first, last + more)
        except DigestError:
            entries = []
            for inode in range(first, last + 1):
                with contextlib.suppress(FsError):  # the damaged row (logged by entry())
                    entry = self.entry(inode)
                    if not entry.is_dir:
                        entries.append(entry)  # type: ignore[arg-type]
            return entries
        for entry in entries:
            self._remember(entry)
        return [entry for entry in entries if entry.id <= last] if more else entries

    def lookup(self, parent_inode: int, name: bytes) -> Entry | None:
        """The entry ``name`` in directory ``parent_inode``, or None (a cacheable ENOENT)."""
        if name == b".":
            return self.entry(parent_inode)
        if name == b"..":
            return self.entry(self.entry(parent_inode).parent or ROOT_INODE)
        if len(name) > NAME_MAX:
            return None
        try:
            entry = self.digest.lookup(parent_inode, name.decode("utf-8"))
        except UnicodeDecodeError:
            return None  # digest names are UTF-8: this name cannot be in it
        except DigestError as exc:
            log.error("digest lookup failed: %s", exc)
            raise FsError(errno.EIO) from None
        if entry is not None:
            self._remember(entry)  # the READ or GETATTR that usually follows needs no query
        return entry

    # -- listings --------------------------------------------------------------------------

    def _page(self, dir_id: int, after: int) -> list[Entry]:
        try:
            return self.digest.listdir(dir_id, after or None, READDIR_PAGE)
        except ValueError:
            raise FsError(errno.EINVAL) from None  # a cookie we never gave
        except DigestError as exc:
            log.error("digest listdir failed: %s", exc)
            raise FsError(errno.EIO) from None

    def dir_page(self, dir_inode: int, cookie: int) -> tuple[list[Listed], bool]:
        """The entries of directory ``dir_inode`` that follow ``cookie`` (0: from the start),
        as ``(name, entry, cookie)``, and whether they are the last ones.

        Every listing starts with ``.`` (cookie :data:`DOT_COOKIE`) and ``..``
        (:data:`DOTDOT_COOKIE`; the root is its own parent); each digest entry's cookie is its
        id plus :data:`COOKIE_SHIFT`, so no entry's cookie can be 1 or 2 (ids start at 1).
        What a front end could not send it gives back with :meth:`keep_rest`, and the next
        request resuming at the same cookie is served from it without a digest query.
        """
        directory = self.entry(dir_inode)
        if not directory.is_dir:
            raise FsError(errno.ENOTDIR)
        spare_dir, spare_cookie, spare, spare_last = self._spare
        if spare and spare_dir == dir_inode and spare_cookie == cookie:
            self._spare = (0, 0, [], False)
            return spare, spare_last
        out: list[Listed] = []
        if cookie < DOT_COOKIE:
            out.append((b".", directory, DOT_COOKIE))
        if cookie < DOTDOT_COOKIE:
            out.append((b"..", self.entry(directory.parent or ROOT_INODE), DOTDOT_COOKIE))
        page = self._page(dir_inode, max(cookie - COOKIE_SHIFT, 0))
        out.extend((entry.name.encode("utf-8"), entry, entry.id + COOKIE_SHIFT) for entry in page)
        return out, len(page) < READDIR_PAGE

    def keep_rest(self, dir_inode: int, cookie: int, rest: list[Listed], last: bool) -> None:
        """Keep the entries of a :meth:`dir_page` that did not fit, for the request resuming
        at ``cookie`` (the cookie of the last entry sent)."""
        self._spare = (dir_inode, cookie, rest, last)

    def listing(self, dir_inode: int, after: int, size: int, plus: bool) -> bytes:
        """Encoded directory entries following cookie ``after`` (0: from the start), at most
        ``size`` bytes (see :meth:`dir_page` for the cookies). ``b""`` at the end."""
        timeout = TIMEOUT if plus else None
        records: list[bytes] = []
        used = 0
        while True:
            page, last = self.dir_page(dir_inode, after)
            for i, (name, entry, cookie) in enumerate(page):
                record = fuse_wire.dirent(name, self.attributes(entry), cookie, timeout)
                if used + len(record) > size:
                    self.keep_rest(dir_inode, after, page[i:], last)
                    return b"".join(records)
                records.append(record)
                used += len(record)
                after = cookie
            if last:
                return b"".join(records)

    def usage(self) -> tuple[int, int]:
        """``(blocks, inodes)`` that ``statfs`` reports: the dataset's bytes in
        :data:`BLOCK_SIZE` blocks, rounded up, and its files plus directories."""
        digest = self.digest
        return -(-digest.total_bytes // BLOCK_SIZE), digest.file_count + digest.dir_count

    def statfs(self) -> bytes:
        blocks, inodes = self.usage()
        return fuse_wire.statfs_body(blocks, inodes, BLOCK_SIZE, NAME_MAX)
