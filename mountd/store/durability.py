"""Durable checkpoints: one ``syncfs`` for many fills, and what recovery trusts after a crash.

A fill no longer fsyncs its file and folder (that cost ~0.7 ms of disk wait per file, and
concurrent fsyncs queue on the filesystem's journal: most of a cold fill's 16 ms). Instead the
cache takes a **checkpoint** every ``sync_interval`` seconds while fills land:

1. ``mark = index.now()`` in the trio thread: every row stamped ``added <= mark`` belongs to a
   file whose rename has already returned;
2. :func:`syncfs` of the cache's filesystem in a worker thread: data, inodes and folder
   entries of all those files reach the disk together (one journal commit, not one per file);
3. ``index.set_durable_mark(mark, boot_id())``.

After an unclean shutdown, :mod:`.recovery` compares the recorded boot id with this boot's:

* **same boot** (mountd was killed, the machine was not): the kernel still holds every byte
  that any rename published, so the store is exactly as mountd left it; nothing to verify;
* **another boot, or unknown** (a power cut, a kernel crash): rows added after the mark, and
  store files without a row, may name files whose bytes never reached the disk (zero-length,
  zero-filled, stale). :func:`verify_files` re-hashes exactly those, and recovery drops every
  one that does not match before anything is served.

So the invariant "a file at its final name hashes to its name" holds for every reader at any
time, and across power loss after recovery, at the price of re-reading at most one interval
of fills after a reboot.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from mountd.store import layout
from mountd.store.scrub import hash_file

log = logging.getLogger("mountd.store.durability")

#: Where Linux says which boot this is (a random UUID per boot).
BOOT_ID = "/proc/sys/kernel/random/boot_id"

#: Threads re-hashing suspects after a reboot (reads wait on the disk, hashing holds a core).
VERIFY_THREADS = 4

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_syncfs = getattr(_libc, "syncfs", None)


def boot_id(path: str = BOOT_ID) -> str | None:
    """This boot's id, or None where the kernel does not say (then recovery always verifies)."""
    try:
        with open(path) as f:
            return f.read().strip() or None
    except OSError:
        return None


def syncfs(directory: Path) -> None:
    """Write everything dirty on the filesystem holding ``directory`` to its disk.

    ``syncfs(2)`` flushes one filesystem (other disks are not touched); it also flushes other
    programs' dirty data on that filesystem, which is why a dedicated cache disk is
    recommended (docs/operations.md). Falls back to ``sync()`` where libc lacks it.
    """
    if _syncfs is None:
        os.sync()
        return
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        if _syncfs(fd) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"syncfs of {directory}: {os.strerror(err)}")
    finally:
        os.close(fd)


def _matches(cache_dir: Path, hash: bytes, size: int | None) -> bool:
    """True when the store file of ``hash`` exists, has ``size`` bytes (if given) and its
    content hashes to ``hash`` (an unreadable file does not match)."""
    try:
        found = hash_file(layout.store_path(cache_dir, hash))
    except OSError:
        return False
    return found is not None and found[0] == hash and (size is None or found[1] == size)


def verify_files(
    cache_dir: Path, items: Sequence[tuple[bytes, int | None]]
) -> list[bytes]:
    """The hashes among ``items`` (``(hash, size or None)``) whose store file is missing, has
    another size, or does not hash to its name. Blocking: run it in a worker thread."""
    if not items:
        return []
    with ThreadPoolExecutor(VERIFY_THREADS, thread_name_prefix="mountd-verify") as pool:
        results = pool.map(lambda item: _matches(cache_dir, *item), items)
        return [hash for (hash, _), good in zip(items, results, strict=True) if not good]
