"""Passthrough opens: the kernel reads a cached file from its store file itself.

Without passthrough, every first read of a file goes through the mount: the kernel sends
READs, a worker ``pread``\\ s the store file and writes the bytes back, and the kernel copies
them into the mount's page cache; on this VM a first pass over cached files runs at about a
tenth of direct reads (docs/mount.md "Measured"), the wake-ups between the reader and the
worker being most of it. With ``FUSE_PASSTHROUGH`` (Linux 6.9, ``CONFIG_FUSE_PASSTHROUGH``)
an OPEN may be answered with a *backing file*: the store file, registered with the
connection (``FUSE_DEV_IOC_BACKING_OPEN``, which needs ``CAP_SYS_ADMIN``). The kernel then
serves that open file's reads and ``mmap`` from the store file's own page cache, and no
READ reaches us. The price is one OPEN and one RELEASE per ``open()``, where without
passthrough the kernel skips both and a file whose pages it kept costs nothing at all
(quiverfs/fuse/worker.py "Zero-message opens").

**One backing file per inode while it is open.** The kernel reads the backing id of an OPEN
reply when the opening process wakes up, after our ``write`` returned, so an id must live
until that open's RELEASE; and while any open of an inode uses a backing file, another open
of it with a different one fails (``EIO`` to the user). So :class:`BackingFiles` keeps, for
each inode, one backing id and how many opens use it, in memory shared by the mount's
processes (made before they fork; 8 bytes per inode, allocated only where used) under one
lock (a POSIX record lock, which a process that dies lets go of). An OPEN of an inode that
is open already reuses its id (a hit: the backing file holds the bytes even if mountd has
evicted the store file since); the first registers the store file; the RELEASE of the last
drops the id, which lets the kernel let go of the store file, so an evicted file's blocks
stay allocated only while it is open, as with a descriptor a worker keeps.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import struct
from collections.abc import Callable

from quiverfs.fuse import channel
from quiverfs.protocol import fuse_wire as w

log = logging.getLogger("quiverfs.fuse")

#: The file handle of a passthrough open (its RELEASE drops a use of the inode's backing
#: file); other opens have 0.
PASSTHROUGH_FH = 1

_SLOT = struct.Struct("<II")  # backing id, opens using it


def available(fuse_fd: int, probe_fd: int) -> OSError | None:
    """Whether the connection of ``fuse_fd`` takes backing files (None) or why not: registers
    the open file ``probe_fd`` (any regular file on the store's filesystem) and drops it."""
    try:
        backing_id = channel.backing_open(fuse_fd, probe_fd)
    except OSError as exc:
        return exc
    channel.backing_close(fuse_fd, backing_id)
    return None


class BackingFiles:
    """The backing id of every inode open with passthrough, and its count of opens (see the
    module docstring). Made before the mount's processes fork; each uses it from one thread."""

    def __init__(self, inodes: int) -> None:
        self.inodes = inodes
        self._map = mmap.mmap(-1, max(1, inodes) * _SLOT.size)
        self._slots = memoryview(self._map).cast("I")
        #: the lock: a record lock on a file of no size (each process owns its locks)
        self._lock_fd = os.memfd_create("quiverfs-backing", os.MFD_CLOEXEC)  # forks keep it

    def open(self, fuse_fd: int, inode: int, open_store: Callable[[], int]) -> int | None:
        """The backing id for a new open of ``inode``: the one its open files use, else the
        store file ``open_store()`` opens (a descriptor, closed here once registered; it may
        raise, e.g. FileNotFoundError for a miss), registered now; None when the kernel
        refuses it (logged)."""
        slots, at = self._slots, 2 * inode
        fcntl.lockf(self._lock_fd, fcntl.LOCK_EX)
        try:
            if slots[at + 1]:
                slots[at + 1] += 1
                return slots[at]
            fd = open_store()
            try:
                backing_id = channel.backing_open(fuse_fd, fd)
            except OSError as exc:
                log.warning("the kernel refused a passthrough backing file (%s): this open is "
                            "served through the mount", exc)
                return None
            finally:
                os.close(fd)  # a registered backing file holds its own reference
            slots[at], slots[at + 1] = backing_id, 1
            return backing_id
        finally:
            fcntl.lockf(self._lock_fd, fcntl.LOCK_UN)

    def release(self, fuse_fd: int, inode: int) -> None:
        """One open of ``inode`` ended: its backing id is dropped with the last."""
        slots, at = self._slots, 2 * inode
        fcntl.lockf(self._lock_fd, fcntl.LOCK_EX)
        try:
            if not slots[at + 1]:
                return
            slots[at + 1] -= 1
            if not slots[at + 1]:
                channel.backing_close(fuse_fd, slots[at])
                slots[at] = 0
        finally:
            fcntl.lockf(self._lock_fd, fcntl.LOCK_UN)

    def open_count(self, inode: int) -> int:
        """How many opens of ``inode`` use its backing file now (for tests and stats)."""
        return self._slots[2 * inode + 1]

    def reply_open(self, fuse_fd: int, unique: int, inode: int, open_store: Callable[[], int]) -> bool:
        """Answer the OPEN ``unique`` of ``inode`` with passthrough (see :meth:`open`); True.
        When the kernel refuses the backing file, False: the OPEN is answered as a direct-I/O
        open instead, whose READs come to the mount (uncached, so they do not mix the
        kernel's cached and passthrough modes on one inode). A worker then leaves the count of
        that read to its READ at offset 0; the main process has counted its miss already, so
        such a file, refused after the mount's probe was not, counts twice."""
        backing_id = self.open(fuse_fd, inode, open_store)
        if backing_id is None:
            channel.send(fuse_fd, w.reply(unique, w.open_body(w.FOPEN_DIRECT_IO)), "OPEN")
            return False
        body = w.open_body(w.FOPEN_PASSTHROUGH, backing_id, PASSTHROUGH_FH)
        try:
            os.write(fuse_fd, w.reply(unique, body))
        except OSError as exc:
            # ENOENT: the opener is gone (interrupted): no RELEASE will come for it.
            self.release(fuse_fd, inode)
            if exc.errno not in (errno.ENOENT, errno.ENODEV):
                log.warning("cannot answer OPEN: %s", exc)
        return True
