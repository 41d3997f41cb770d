"""Blocking file operations on the store; the cache runs them in worker threads.

The protocol for one fill:

1. create ``tmp/<hex>.<random>.tmp`` (``O_EXCL``), write the bytes at explicit offsets;
2. the caller verifies blake3 and size (before writing for one-chunk objects);
3. close the temp file, create the fan-out directories if needed;
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
import stat
from pathlib import Path

from mountd.errors import CacheDirUnsafe
from mountd.store import layout

log = logging.getLogger("mountd.store.disk")

#: Mode of the cache directory and every directory in it: mountd's user only.
PRIVATE_DIR = 0o700

#: Mode of store files (read-only: a store file is never written after its rename).
STORE_FILE = 0o400


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Make a directory's entries (a rename, a new file or subfolder) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def prepare(cache_dir: Path) -> None:
    """Create the cache directory, ``store/`` and ``tmp/`` (durably), all private (``0700``).

    The cache is private to mountd's user whoever starts it (docs/operations.md "Security"):
    a directory others can read lets them list every cached hash and read every cached file.
    An existing cache directory is checked with :func:`check_private` first.
    """
    if cache_dir.exists():
        check_private(cache_dir)
    for path in (cache_dir, layout.store_dir(cache_dir), layout.tmp_dir(cache_dir)):
        if not path.is_dir():
            path.mkdir(parents=True, exist_ok=True, mode=PRIVATE_DIR)
            os.chmod(path, PRIVATE_DIR)  # mkdir's mode passes through the umask
            fsync_dir(path.parent)


def check_private(cache_dir: Path) -> None:
    """Refuse, or make private, an existing cache directory others could reach.

    * not a directory, or owned by another user (who could change its mode and plant files
      that would be served as verified content): :class:`CacheDirUnsafe`;
    * writable by group or others: :class:`CacheDirUnsafe` as well (same reason);
    * readable or traversable by group or others (an older quiverfs made ``0755``): made
      ``0700`` with a warning, since nothing else may rely on reaching it yet.
    """
    try:
        info = os.stat(cache_dir)
    except OSError as exc:
        raise CacheDirUnsafe(f"cannot use cache directory {cache_dir}: {exc.strerror}") from None
    if not stat.S_ISDIR(info.st_mode):
        raise CacheDirUnsafe(f"cache directory {cache_dir} is not a directory")
    if info.st_uid != os.geteuid():
        raise CacheDirUnsafe(
            f"cache directory {cache_dir} belongs to uid {info.st_uid}, not to this user "
            f"(uid {os.geteuid()}): pick a directory of your own with --cache-dir")
    mode = stat.S_IMODE(info.st_mode)
    if mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise CacheDirUnsafe(
            f"cache directory {cache_dir} is writable by other users (mode {mode:04o}), who could "
            f"plant cache content: chmod 700 {cache_dir}")
    if mode & 0o077:
        os.chmod(cache_dir, PRIVATE_DIR)
        log.warning("cache directory %s was readable by other users (mode %04o); made it %04o",
                    cache_dir, mode, PRIVATE_DIR)


def is_enospc(exc: BaseException) -> bool:
    """True for "no space left on device" and "quota exceeded"."""
    return isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)


class TempFile:
    """One fill's temp file. Methods block; call them through ``trio.to_thread.run_sync``."""

    def __init__(self, cache_dir: Path, hash: bytes) -> None:
        self.cache_dir = cache_dir
        self.hash = hash
        name = f"{hash.hex()}.{secrets.token_hex(6)}{layout.TMP_SUFFIX}"
        self.path = layout.tmp_dir(cache_dir) / name
        self.fd: int | None = os.open(
            self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, STORE_FILE
        )

    def write_at(self, data: bytes | memoryview, offset: int) -> None:
        """Write all of ``data`` at ``offset`` (idempotent: a retry rewrites the same range)."""
        view = memoryview(data)
        while view:
            n = os.pwrite(self.fd, view, offset)
            view = view[n:]
            offset += n

    def commit(self, fanout: Fanout | None = None) -> Path:
        """Close and rename into the store (no fsync: see the module docstring); returns the
        final path. ``fanout`` remembers the fan-out folders known to exist."""
        os.close(self.fd)
        self.fd = None
        final = layout.store_path(self.cache_dir, self.hash)
        (fanout or Fanout()).rename_into(self.path, final)
        return final

    def discard(self) -> None:
        """Close and unlink (never raises; safe to call twice, and from the trio thread)."""
        if self.fd is not None:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = None
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        except OSError:
            pass


class Fanout:
    """The ``store/ab/cd`` folders known to exist, so a fill does not ``stat`` its folder.

    Folders are created on demand and never removed while mountd runs; if one vanished
    anyway (removed by hand), the rename fails with ENOENT and the folder is made again.
    At most 65,536 entries. Shared by fill threads: a set's ``add`` and ``in`` are atomic.
    """

    def __init__(self) -> None:
        self._known: set[str] = set()

    def rename_into(self, source: str | os.PathLike[str], final: Path) -> None:
        """``rename(source, final)``, creating ``final``'s fan-out folders when missing."""
        leaf = final.parent
        key = str(leaf)
        if key not in self._known:
            make_fanout(leaf)
            self._known.add(key)
        try:
            os.rename(source, final)
        except FileNotFoundError:
            if not os.path.exists(source):
                raise
            self._known.discard(key)
            make_fanout(leaf)
            self._known.add(key)
            os.rename(source, final)


def make_fanout(leaf: Path) -> None:
    """Create ``store/ab/cd`` (and ``store/ab``) if missing, private (``0700``)."""
    if leaf.is_dir():
        return
    for path in (leaf.parent, leaf):
        try:
            path.mkdir(mode=PRIVATE_DIR)
        except FileExistsError:
            continue
        os.chmod(path, PRIVATE_DIR)  # mkdir's mode passes through the umask


def write_file(cache_dir: Path, hash: bytes, data: bytes, fanout: Fanout | None = None) -> Path:
    """Steps 1, 3, 4 for bytes already verified in memory; the temp is removed on failure."""
    temp = TempFile(cache_dir, hash)
    try:
        temp.write_at(data, 0)
        return temp.commit(fanout)
    except BaseException:
        temp.discard()
        raise


def remove(path: Path) -> bool:
    """Unlink a store file; False if it was already gone."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True
