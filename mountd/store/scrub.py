"""Scrub: re-hash every store file and remove the ones whose bytes no longer match.

Bit rot, a bad disk, or someone editing a file in place breaks the store's invariant without
any crash; only re-reading finds it. Hashing runs in worker threads (``io_threads`` at once);
removals happen in the trio thread, where the index lives.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import blake3
import trio

from mountd.store import layout

#: What scrub calls to remove entries: ``drop(hashes, reason)`` (Cache._drop_entries).
DropEntries = Callable[..., object]

log = logging.getLogger("mountd.store.scrub")

READ_CHUNK = 4 * 1024 * 1024


@dataclass
class ScrubReport:
    """Counts from one scrub: every entry is exactly one of ok, bad or missing."""

    checked: int = 0
    ok: int = 0
    #: Files whose size or blake3 did not match their name (removed).
    bad: int = 0
    #: Indexed files that were gone (rows removed).
    missing: int = 0
    bytes_checked: int = 0
    removed_bytes: int = 0
    seconds: float = 0.0

    def as_dict(self) -> dict:
        return asdict(self)


def hash_file(path: Path) -> tuple[bytes, int] | None:
    """``(blake3, size)`` of a file, or None if it does not exist (blocking)."""
    hasher = blake3.blake3()
    size = 0
    try:
        with open(path, "rb", buffering=0) as f:
            while chunk := f.read(READ_CHUNK):
                hasher.update(chunk)
                size += len(chunk)
    except FileNotFoundError:
        return None
    return hasher.digest(), size


async def scrub(
    entries: Sequence[tuple[bytes, int]],
    cache_dir: Path,
    io_threads: int,
    drop: DropEntries,
    progress: Callable[[int, int], object] | None = None,
) -> ScrubReport:
    """Check ``entries`` (``(hash, size)``, as indexed when the scrub starts), hashing at most
    ``io_threads`` files at once; ``drop([hash], reason=...)`` removes a bad or missing one;
    ``progress(done, total)`` after each. Handed what it needs by :meth:`Cache.scrub`."""
    start = trio.current_time()
    report = ScrubReport()
    total = len(entries)
    limiter = trio.CapacityLimiter(io_threads)

    slots = trio.Semaphore(io_threads)

    async def check(hash: bytes, size: int) -> None:
        try:
            await check_one(hash, size)
        finally:
            slots.release()

    async def check_one(hash: bytes, size: int) -> None:
        path = layout.store_path(cache_dir, hash)
        result = await trio.to_thread.run_sync(hash_file, path, limiter=limiter)
        report.checked += 1
        if result is None:
            report.missing += 1
            drop([hash], reason="missing")
        elif result != (hash, size):
            report.bad += 1
            report.removed_bytes += result[1]
            report.bytes_checked += result[1]
            log.warning("scrub: %s does not match its hash; removing it", path)
            drop([hash], reason="bad")
        else:
            report.ok += 1
            report.bytes_checked += size
        if progress is not None:
            progress(report.checked, total)

    async with trio.open_nursery() as nursery:
        for hash, size in entries:
            await slots.acquire()  # bounded: at most io_threads checks alive at once
            nursery.start_soon(check, hash, size)
    report.seconds = trio.current_time() - start
    return report
