"""The pyfuse3 front end: the same tree, misses and xattrs, served through libfuse.

``quiverfs mount --frontend pyfuse3`` (docs/mount.md "Front ends"). The native front end
(quiverfs/fuse/worker.py) speaks the kernel protocol itself from several processes; this one lets
libfuse do it, in the mount's main process, with every handler on the trio loop. It is the portable
fallback -- for a kernel older than the native front end's minimum (FUSE 7.29, Linux 5.1) or an
environment that refuses it -- and the reference the native protocol code is tested against
(tests/mount/test_frontends_differential.py): every answer comes from the same objects,
:class:`~quiverfs.filesystem.tree.Tree` for the tree and
:class:`~quiverfs.filesystem.fs.QuiverOperations` for reads (hits and misses), extended attributes
and the control channel, so the two front ends can only differ in how they speak FUSE.

pyfuse3 is an optional dependency (the ``pyfuse3`` extra: it builds against libfuse3-dev);
without it this module still imports, and :func:`require` says how to install it.

Lookup counts (pyfuse3's "Lookup Counts"): the tree holds no per-inode state, every inode is
answerable from the digest at any time, so lookups and listings need no counting and
``forget`` has nothing to drop. Open files and directories carry their inode as the handle:
pyfuse3's ``read`` and ``readdir`` get only the handle.

Concurrency: pyfuse3 runs each request as a trio task in this thread, like the main
process's own tasks; the digest was opened here. Code between two ``await``\\ s is atomic,
which is what keeps :meth:`Tree.dir_page`'s leftover page consistent.
"""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager

from digests.digest import Entry
from quiverfs.base.errors import FsError, UsageError, errno_for
from quiverfs.filesystem.fs import QuiverOperations
from quiverfs.filesystem.tree import BLOCK_SIZE, NAME_MAX, TIMEOUT

try:
    import pyfuse3
except ImportError:  # the optional extra is not installed: see require()
    pyfuse3 = None

log = logging.getLogger("quiverfs.fuse")

MISSING = ("--frontend pyfuse3 needs the pyfuse3 package, which is not installed: "
           "pip install 'quiverfs[pyfuse3]' (it builds against libfuse3-dev)")


def require() -> None:
    """Raise :class:`UsageError` (one line: how to install it) when pyfuse3 is missing."""
    if pyfuse3 is None:
        raise UsageError(MISSING)


@contextmanager
def _as_fuse_errors(what: str, inode: int) -> Iterator[None]:
    """Turn what a handler raises into the errno the native front end would answer."""
    try:
        yield
    except FsError as exc:
        raise pyfuse3.FUSEError(exc.errno) from None
    except Exception as exc:
        # The one mapping (quiverfs.base.errors.errno_for), as QuiverOperations.answer does for the
        # native front end; a failed read has been counted where it failed.
        log.warning("FUSE %s on inode %d failed: %s", what, inode, exc)
        raise pyfuse3.FUSEError(errno_for(exc)) from None


_Base = pyfuse3.Operations if pyfuse3 is not None else object


class Pyfuse3Operations(_Base):  # type: ignore[misc,valid-type]
    """pyfuse3's ``Operations`` over a mount's :class:`QuiverOperations` and its tree."""

    # The tree answers "." and ".." lookups (the kernel sends them for NFS exports).
    supports_dot_lookup = True
    enable_writeback_cache = False
    enable_acl = False

    def __init__(self, ops: QuiverOperations) -> None:
        super().__init__()
        self.ops = ops
        self.tree = ops.tree

    def _attributes(self, entry: Entry) -> pyfuse3.EntryAttributes:
        """What :meth:`Tree.attributes` says, in pyfuse3's type, with the tree's timeouts."""
        attributes = self.tree.attributes(entry)
        out = pyfuse3.EntryAttributes()
        out.st_ino = attributes.ino
        out.generation = 0
        out.entry_timeout = out.attr_timeout = TIMEOUT
        out.st_mode = attributes.mode
        out.st_nlink = 1
        out.st_uid, out.st_gid = attributes.uid, attributes.gid
        out.st_rdev = 0
        out.st_size = attributes.size
        out.st_blksize = attributes.blksize
        out.st_blocks = (attributes.size + 511) // 512
        out.st_atime_ns = out.st_mtime_ns = out.st_ctime_ns = attributes.mtime_ns
        return out

    # -- the tree --------------------------------------------------------------------------

    async def lookup(self, parent_inode: int, name: bytes, ctx=None) -> pyfuse3.EntryAttributes:
        with _as_fuse_errors("lookup", parent_inode):
            entry = self.tree.lookup(parent_inode, name)
            if entry is None:
                # A negative entry the kernel caches, as the native front end answers.
                negative = pyfuse3.EntryAttributes()
                negative.st_ino = 0
                negative.entry_timeout = TIMEOUT
                return negative
            return self._attributes(entry)

    async def forget(self, inode_list) -> None:
        """Nothing to forget: inodes carry no state (see the module docstring)."""

    async def getattr(self, inode: int, ctx=None) -> pyfuse3.EntryAttributes:
        with _as_fuse_errors("getattr", inode):
            return self._attributes(self.tree.entry(inode))

    async def opendir(self, inode: int, ctx=None) -> int:
        with _as_fuse_errors("opendir", inode):
            if not self.tree.entry(inode).is_dir:
                raise FsError(errno.ENOTDIR)
        return inode  # the handle is the inode: readdir gets only the handle

    async def readdir(self, fh: int, start_id: int, token) -> None:
        """Entries after cookie ``start_id``, with the same names, order and cookies as the
        native front end (:meth:`Tree.dir_page`); what does not fit is kept for the next call.

        pyfuse3 asks that ``.`` and ``..`` not count as lookups: nothing here counts.
        """
        tree = self.tree
        cookie = start_id
        with _as_fuse_errors("readdir", fh):
            while True:
                page, last = tree.dir_page(fh, cookie)
                for i, (name, entry, next_cookie) in enumerate(page):
                    if not pyfuse3.readdir_reply(token, name, self._attributes(entry), next_cookie):
                        tree.keep_rest(fh, cookie, page[i:], last)
                        return
                    cookie = next_cookie
                if last:
                    return

    async def releasedir(self, fh: int) -> None:
        pass

    async def statfs(self, ctx=None) -> pyfuse3.StatvfsData:
        with _as_fuse_errors("statfs", 1):
            blocks, inodes = self.tree.usage()
        out = pyfuse3.StatvfsData()
        out.f_bsize = out.f_frsize = BLOCK_SIZE
        out.f_blocks = blocks
        out.f_bfree = out.f_bavail = 0
        out.f_files = inodes
        out.f_ffree = out.f_favail = 0
        out.f_namemax = NAME_MAX
        return out

    async def readlink(self, inode: int, ctx=None) -> bytes:
        raise pyfuse3.FUSEError(errno.EINVAL)  # there are no symbolic links

    # -- reads -----------------------------------------------------------------------------

    async def open(self, inode: int, flags: int, ctx=None) -> pyfuse3.FileInfo:
        with _as_fuse_errors("open", inode):
            self.tree.file(inode)  # ENOENT, EISDIR
        # The content never changes: the kernel may keep its pages across opens.
        return pyfuse3.FileInfo(fh=inode, keep_cache=True)

    async def read(self, fh: int, off: int, size: int) -> bytes:
        with _as_fuse_errors("read", fh):
            return await self.ops.read(fh, off, size)

    async def flush(self, fh: int) -> None:
        pass

    async def release(self, fh: int) -> None:
        pass

    # -- extended attributes and the control channel ---------------------------------------

    async def getxattr(self, inode: int, name: bytes, ctx=None) -> bytes:
        with _as_fuse_errors("getxattr", inode):
            return await self.ops.getxattr(inode, name)

    async def listxattr(self, inode: int, ctx=None) -> list[bytes]:
        with _as_fuse_errors("listxattr", inode):
            return self.ops.listxattr(inode)

    # -- changes: the tree is read-only ----------------------------------------------------

    async def _read_only(self, *args, **kwargs):
        """Every change fails with EROFS (the mount is ``ro``: the VFS refuses most first)."""
        raise pyfuse3.FUSEError(errno.EROFS)

    setattr = mknod = mkdir = unlink = rmdir = symlink = rename = link = _read_only
    create = write = fsync = fsyncdir = setxattr = removexattr = _read_only


# -- serving ---------------------------------------------------------------------------------


class Session:
    """One pyfuse3 mount: :meth:`open` mounts, :meth:`serve` answers until the connection
    ends (an unmount), :meth:`close` lets go of it. pyfuse3 holds one session per process."""

    def __init__(self, ops: QuiverOperations) -> None:
        require()
        self.operations = Pyfuse3Operations(ops)
        self._open = False

    def open(self, mountpoint: str | os.PathLike[str], options: set[str]) -> None:
        """Mount at ``mountpoint`` with libfuse mount ``options`` (pyfuse3 raises
        :class:`RuntimeError` when libfuse cannot mount)."""
        pyfuse3.init(self.operations, os.fspath(mountpoint), set(options))
        self._open = True

    async def serve(self) -> None:
        """Answer requests until the kernel ends the connection (unmounted)."""
        await pyfuse3.main()

    def close(self) -> None:
        """Release the session (the caller unmounts first, lazily, as the native mount does)."""
        if self._open:
            self._open = False
            pyfuse3.close(unmount=False)

    @staticmethod
    def invalidate(inodes: list[int]) -> None:
        """Drop the kernel's pages and attributes of ``inodes`` (files mountd evicted).

        Call it from a thread: the kernel waits for READs of those pages in flight, which
        this process's trio thread may be the one to answer."""
        for inode in inodes:
            try:
                pyfuse3.invalidate_inode(inode)
            except OSError as exc:
                # ENOENT: the kernel no longer has that inode; ENODEV/ENOTCONN: unmounted.
                if exc.errno in (errno.ENODEV, errno.ENOTCONN):
                    return
                if exc.errno != errno.ENOENT:
                    log.debug("cannot invalidate inode %d: %s", inode, exc)
