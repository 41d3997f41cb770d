"""A mount's private copy of its digest: what the mount serves, whatever happens to the file.

SQLite memory-maps the digest in the mount's main process, in every worker and in mountd. A
user who truncates or rewrites the file under a running mount would kill them with SIGBUS
(the mapped pages are gone), and the requests they held would never be answered. So a mount
copies the digest into ``CACHE_DIR/snapshots/`` first, validates the copy (the copy is what
is served, so that is what must be valid), serves and registers the copy with mountd, and
removes it at unmount. Nobody but the mount knows the copy's name, the file is ``0600`` in a
``0700`` directory, and builds replace digests by renaming over the old name, so the user's
own file stays theirs to change.

Crash states: a mount killed before it unmounts leaves its copy behind. Every copy is
``flock``-ed by the process that made it, from before its first byte is written until that
process and its workers (which inherit the descriptor) are all gone; :func:`remove_stale`
(run by every mount before it takes its own copy) deletes each copy whose lock it can take.

Cost: one copy of the file in the kernel (``copy_file_range``; a reflink where the file
system can) and the copy's disk space for the life of the mount.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import secrets
import stat
from pathlib import Path

from digests import validate
from digests.digest import Digest
from quiverfs.base.errors import QuiverError, UsageError

log = logging.getLogger("quiverfs.mount")

#: Directory of the copies, inside the cache directory.
SNAPSHOT_DIR = "snapshots"

#: Bytes asked of one ``copy_file_range`` call.
_CHUNK = 1 << 30


class Snapshot:
    """A locked, private copy of a digest file. Use :meth:`take`; :meth:`remove` at unmount."""

    def __init__(self, path: Path, fd: int, original: Path) -> None:
        self.path = path
        self.original = original
        self._fd = fd  # holds the flock for as long as this process (or a fork of it) lives

    @classmethod
    def take(cls, original: Path, cache_dir: Path) -> Snapshot:
        """Copy ``original`` into ``cache_dir/snapshots/``.

        Raises :class:`UsageError` (one line) when ``original`` is missing, not a regular
        file, unreadable or changed while being copied, and when the copy cannot be written.
        Stale copies of dead mounts are removed first.
        """
        directory = cache_dir / SNAPSHOT_DIR
        try:
            directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        except OSError as exc:
            raise UsageError(f"cannot create {directory}: {os.strerror(exc.errno or errno.EIO)}") from None
        remove_stale(directory)
        source = _open_source(original)
        try:
            before = os.fstat(source)
            snapshot = cls._create(directory, original)
            try:
                _copy(source, snapshot._fd)
                after = os.fstat(source)
                if _identity(before) != _identity(after) or os.fstat(snapshot._fd).st_size != after.st_size:
                    raise UsageError(f"digest {original} changed while it was being read; mount again")
            except OSError as exc:
                snapshot.remove()
                raise UsageError(f"cannot copy digest {original} to {directory}: "
                                 f"{os.strerror(exc.errno or errno.EIO)}") from None
            except BaseException:
                snapshot.remove()
                raise
        finally:
            os.close(source)
        return snapshot

    @classmethod
    def _create(cls, directory: Path, original: Path) -> Snapshot:
        while True:
            path = directory / f"{os.getpid()}-{secrets.token_hex(6)}.qd"
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            fcntl.flock(fd, fcntl.LOCK_EX)
            # remove_stale of another mount may have taken the lock (and the name) between our
            # open and our flock: then the name is no longer this file, so try another.
            try:
                same = os.stat(path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                return cls(path, fd, original)
            os.close(fd)

    def open(self) -> Digest:
        """Open and validate the copy (structure check, as a mount always did); errors name
        the original file, since the copy holds the same bytes."""
        try:
            return Digest.open(self.path)
        except QuiverError as exc:
            message = str(exc).replace(os.fspath(self.path), os.fspath(self.original))
            try:
                error = type(exc)(message)
            except TypeError:
                error = QuiverError(message)
                error.exit_code = exc.exit_code
            raise error from None

    def remove(self) -> None:
        """Delete the copy and release its lock (mountd may keep reading a copy it opened)."""
        if self._fd < 0:
            return
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("cannot remove the digest copy %s: %s", self.path, exc)
        os.close(self._fd)
        self._fd = -1


def remove_stale(directory: Path) -> int:
    """Delete the copies in ``directory`` whose mount is gone (their lock is free); how many."""
    removed = 0
    try:
        names = os.listdir(directory)
    except OSError:
        return 0
    for name in names:
        path = directory / name
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            continue  # a live mount holds it
        try:
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                os.unlink(path)
                removed += 1
                log.info("removed %s, the digest copy of a mount that ended without unmounting", path)
        except OSError:
            pass
        finally:
            os.close(fd)
    return removed


def _open_source(original: Path) -> int:
    # O_NONBLOCK: opening a FIFO for reading must not wait for a writer; the type check
    # below then refuses it.
    try:
        fd = os.open(original, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise UsageError(f"no such digest file: {original}") from None
    except OSError as exc:
        raise UsageError(f"cannot open digest {original}: {os.strerror(exc.errno or errno.EIO)}") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        if stat.S_ISDIR(mode):
            raise UsageError(f"digest path is a directory: {original}")
        validate.check_header(os.fspath(original))  # the digest's own refusal (exit 4), as Digest.open
        raise UsageError(f"digest {original} is not a regular file")  # replaced in between
    os.set_blocking(fd, True)
    return fd


def _identity(st: os.stat_result) -> tuple[int, int, int, int]:
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def _copy(source: int, target: int) -> None:
    """Copy all of ``source`` to ``target`` in the kernel (both at offset 0)."""
    try:
        while os.copy_file_range(source, target, _CHUNK):
            pass
        return
    except OSError as exc:
        # EXDEV: across file systems on older kernels; the others: no support here.
        if exc.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
            raise
    os.lseek(source, 0, os.SEEK_SET)
    os.lseek(target, 0, os.SEEK_SET)
    os.ftruncate(target, 0)
    while block := os.read(source, 1 << 20):
        view = memoryview(block)
        while view:
            view = view[os.write(target, view):]
