"""Blocking file operations on the store; the cache runs them in worker threads.

The durability protocol for one fill (CernVM-FS style):

1. create ``tmp/<hex>.<random>.tmp`` (``O_EXCL``), write the bytes at explicit offsets;
2. the caller verifies blake3 and size (before writing for one-chunk objects);
3. ``fsync`` the temp file, close it;
4. create the fan-out directories if needed (fsyncing their parents);
5. ``rename`` it to ``store/ab/cd/<hex>`` and ``fsync`` that directory.

After step 5 returns, the file at its final name is complete, verified and durable; only then
is it indexed. A crash anywhere before leaves a temp file (wiped on open) or nothing.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
from pathlib import Path

from mountd import layout


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Make a directory's entries (a rename, a new file or subfolder) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def prepare(cache_dir: Path) -> None:
    """Create the cache directory, ``store/`` and ``tmp/`` (durably)."""
    for path in (cache_dir, layout.store_dir(cache_dir), layout.tmp_dir(cache_dir)):
        if not path.is_dir():
            path.mkdir(parents=True, exist_ok=True)
            fsync_dir(path.parent)


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
            self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644
        )

    def write_at(self, data: bytes | memoryview, offset: int) -> None:
        """Write all of ``data`` at ``offset`` (idempotent: a retry rewrites the same range)."""
        view = memoryview(data)
        while view:
            n = os.pwrite(self.fd, view, offset)
            view = view[n:]
            offset += n

    def commit(self) -> Path:
        """fsync, close, rename into the store, fsync the directory; returns the final path."""
        os.fsync(self.fd)
        os.close(self.fd)
        self.fd = None
        final = layout.store_path(self.cache_dir, self.hash)
        make_fanout(final.parent)
        os.rename(self.path, final)
        fsync_dir(final.parent)
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


def make_fanout(leaf: Path) -> None:
    """Create ``store/ab/cd`` (and ``store/ab``) if missing, fsyncing each new entry's parent."""
    if leaf.is_dir():
        return
    for path in (leaf.parent, leaf):
        try:
            path.mkdir()
        except FileExistsError:
            continue
        fsync_dir(path.parent)


def write_file(cache_dir: Path, hash: bytes, data: bytes) -> Path:
    """Steps 1, 3, 4, 5 for bytes already verified in memory; the temp is removed on failure."""
    temp = TempFile(cache_dir, hash)
    try:
        temp.write_at(data, 0)
        return temp.commit()
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
