"""Blocking file operations on the store; the cache runs them in worker threads.

The protocol for one fill:

1. create ``tmp/<hex>.<random>.tmp`` (``O_EXCL``), write the bytes at explicit offsets;
2. the caller verifies blake3 and size (before writing for one-chunk objects);
3. give it the store's file mode (``0444``, or ``0400`` in a private store; see
   :mod:`.access`), close it, create the fan-out directories if needed;
4. ``rename`` it to ``store/ab/cd/<hex>``; only then is it indexed.

No step fsyncs. A file at its final name is complete and verified *for every process on the
machine* the moment the rename returns (the page cache holds it); what a power cut may take
away is made durable for many fills at once by the cache's checkpoints (:mod:`.durability`:
one ``syncfs`` per interval), and recovery after a reboot verifies every entry newer than the
last checkpoint before serving it (docs/store-layout.md "Durability"). A crash before the
rename leaves a temp file (wiped on open) or nothing.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import secrets
from pathlib import Path

from mountd.store import layout
from mountd.store.access import PRIVATE_DIR, StoreModes, check_private

log = logging.getLogger("mountd.store.disk")

#: Mode of a temp file while it is written (in the private ``tmp/``); :meth:`TempFile.commit`
#: gives it the store's file mode (:class:`~mountd.store.access.StoreModes`) before the rename.
TEMP_FILE = 0o400


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Make a directory's entries (a rename, a new file or subfolder) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def prepare(cache_dir: Path) -> None:
    """Create the cache directory, ``store/`` and ``tmp/`` (durably) where missing.

    New folders are made private (``0700``, whatever the umask); the modes the store is
    served with are set once the directory's lock is held (:mod:`mountd.store.access`,
    docs/operations.md "Security"), so a second mountd that fails to take the lock changes
    nothing. An existing cache directory is checked with
    :func:`~mountd.store.access.check_private` first.
    """
    if cache_dir.exists():
        check_private(cache_dir)
    for path in (cache_dir, layout.store_dir(cache_dir), layout.tmp_dir(cache_dir)):
        if not path.is_dir():
            path.mkdir(parents=True, exist_ok=True, mode=PRIVATE_DIR)
            os.chmod(path, PRIVATE_DIR)  # mkdir's mode passes through the umask
            fsync_dir(path.parent)


def is_enospc(exc: BaseException) -> bool:
    """True for "no space left on device" and "quota exceeded"."""
    return isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)


def space(path: str | os.PathLike[str]) -> tuple[int, int]:
    """``(size, free)`` in bytes of the filesystem holding ``path``, as this process may use
    it: blocks reserved for root (ext4's 5 %) count only when it runs as root. One
    ``statvfs`` (a microsecond or two: cheap enough for the trio thread)."""
    st = os.statvfs(path)
    reserved = 0 if os.geteuid() == 0 else st.f_bfree - st.f_bavail
    return (st.f_blocks - reserved) * st.f_frsize, (st.f_bfree - reserved) * st.f_frsize


class TempFile:
    """One fill's temp file. Methods block (a fill process's thread, or mountd's worker
    thread). Paths are kept as strings: a fill is a few system calls, and ``pathlib`` cost a
    sixth of a 110 KiB fill's CPU (2026-11-28)."""

    def __init__(self, cache_dir: str | os.PathLike[str], hash: bytes) -> None:
        self.cache_dir = os.fspath(cache_dir)
        self.hash = hash
        name = hash.hex()
        self.path = f"{self.cache_dir}/{layout.TMP}/{name}.{secrets.token_hex(6)}{layout.TMP_SUFFIX}"
        self.final = layout.store_file(self.cache_dir, hash)
        self.fd: int | None = os.open(
            self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, TEMP_FILE
        )

    def write_at(self, data: bytes | memoryview, offset: int) -> None:
        """Write all of ``data`` at ``offset`` (idempotent: a retry rewrites the same range)."""
        n = os.pwrite(self.fd, data, offset)
        if n < len(data):  # short writes happen only near a full disk
            view = memoryview(data)[n:]
            offset += n
            while view:
                n = os.pwrite(self.fd, view, offset)
                view = view[n:]
                offset += n

    def truncate(self, size: int) -> None:
        """Cut the file to ``size`` bytes: what a write that met a full disk left beyond it
        is given back while the fill waits for room (the retry writes it again)."""
        with contextlib.suppress(OSError):
            os.ftruncate(self.fd, size)

    def commit(self, fanout: Fanout | None = None) -> str:
        """Give the file the store's file mode, close it and rename it into the store (no
        fsync: see the module docstring); returns the final path. ``fanout`` remembers the
        fan-out folders known to exist and the store's modes. Called again after the rename
        failed (a full disk had no room for a new fan-out folder), it renames again."""
        fanout = fanout or Fanout()
        if self.fd is not None:
            # Explicit, whatever the umask; before the rename, so a file at its final name
            # always has its final mode.
            os.fchmod(self.fd, fanout.modes(self.cache_dir).files)
            os.close(self.fd)
            self.fd = None
        fanout.rename_into(self.path, self.final, self.cache_dir)
        return self.final

    def discard(self) -> None:
        """Close and unlink (never raises; safe to call twice, and from the trio thread)."""
        if self.fd is not None:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = None
        with contextlib.suppress(OSError):
            os.unlink(self.path)


class Fanout:
    """The ``store/ab/cd`` folders known to exist, so a fill does not ``stat`` its folder,
    and the store's modes.

    Folders are created on demand and never removed while mountd runs; if one vanished
    anyway (removed by hand), the rename fails with ENOENT and the folder is made again.
    At most 65,536 entries. Shared by fill threads: a set's ``add`` and ``in`` are atomic.

    The modes are those ``store/``'s own mode stands for (:meth:`StoreModes.of_store`), read
    at the first fill unless given: the cache sets ``store/``'s mode from its configuration
    when it opens, before any fill (:mod:`mountd.store.access`).
    """

    def __init__(self, modes: StoreModes | None = None) -> None:
        self._known: set[str] = set()
        self._modes = modes

    def modes(self, cache_dir: str | os.PathLike[str]) -> StoreModes:
        """The store's modes (of ``cache_dir``'s ``store/``)."""
        if self._modes is None:
            # Two fill threads may both read it the first time: the same answer, no harm.
            self._modes = StoreModes.of_store(layout.store_dir(cache_dir))
        return self._modes

    def rename_into(self, source: str, final: str, cache_dir: str | os.PathLike[str]) -> None:
        """``rename(source, final)``, creating ``final``'s fan-out folders when missing."""
        leaf = final[:final.rindex("/")]
        if leaf not in self._known:
            make_fanout(leaf, self.modes(cache_dir).dirs)
            self._known.add(leaf)
        try:
            os.rename(source, final)
        except FileNotFoundError:
            if not os.path.exists(source):
                raise
            self._known.discard(leaf)
            make_fanout(leaf, self.modes(cache_dir).dirs)
            self._known.add(leaf)
            os.rename(source, final)


def make_fanout(leaf: str | os.PathLike[str], mode: int) -> None:
    """Create ``store/ab/cd`` (and ``store/ab``) with ``mode`` (the store's) if missing.

    Tries the leaf first: on a store in use its parent exists (1 of 256), so one ``mkdir``
    usually does."""
    leaf = os.fspath(leaf)
    for path in (leaf, os.path.dirname(leaf), leaf):
        try:
            os.mkdir(path, mode & PRIVATE_DIR)  # others get in only once the mode is exact
        except FileExistsError:
            if path == leaf:
                return
            continue
        except FileNotFoundError:
            continue  # the parent is missing: made next, then the leaf again
        os.chmod(path, mode)  # mkdir's mode passes through the umask
        if path == leaf:
            return


def remove(path: Path) -> bool:
    """Unlink a store file; False if it was already gone."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True
