"""Bringing a cache directory back to its invariants on open, after any crash.

Each crash state, and what repairs it (``recover`` runs the steps in this order):

A. **Killed mid-fill** (any time before the rename): a ``tmp/*.tmp`` file, complete or not,
   verified or not. → :func:`clear_tmp` deletes everything in ``tmp/``. Nothing else refers
   to temp files, so nothing is lost but the in-flight work.
B. **Killed between the rename and the index commit**, or the last WAL transactions lost to a
   power cut (``synchronous=NORMAL``): a file at its final name without a row. In the same
   boot the file is complete and verified by invariant (the kernel has every byte the rename
   published), so it is *adopted*: indexed with its size and its mtime as last use. After a
   reboot it is verified first (F).
C. **A row without a file**: evicted/scrubbed file whose row delete was lost with the WAL
   tail, or a file removed by hand. → the row and its dataset references are dropped.
D. **Index unreadable** (truncated, garbage, another schema version, "database disk image is
   malformed" while reading it): the file is moved aside to ``index.sqlite.corrupt`` (with its
   ``-wal``/``-shm`` removed) and a fresh index is built by adopting every store file (B for
   all). Pins, dataset references and exact last-use times are lost; they are advisory.
E. **Junk in ``store/``**: names that are not 64 lower-case hex in the right fan-out folder,
   or not regular files (nothing mountd writes; e.g. a hand copy) → deleted.
F. **Fills newer than the last durable checkpoint, after a reboot** (power cut, kernel
   crash; :mod:`.durability`): fills do not fsync, so a file renamed after the last
   checkpoint's ``syncfs`` may be empty, short or zero-filled on disk. When the index's
   recorded boot id is not this boot's (or is unknown, or the index was rebuilt), every row
   added after the checkpoint and every file to adopt is re-hashed (:func:`durability.verify_files`);
   those that do not match are deleted (file and row) before anything is served.

Access (:mod:`.access`), on every open, with the lock held: the cache directory, ``store/``,
``tmp/``, the lock and the index files get their modes first (a few ``chmod``). When the
index's ``meta.store_access`` is not the configured one (a store written by a quiverfs that
made everything private, a rebuilt index, ``--private-store`` switched on or off), every
fan-out folder and store file is given its mode by one walk, at the end of the open:
``store_access`` is set durably to ``"changing"`` first, the walk's ``chmod`` are made
durable with one ``syncfs``, and only then is the new value recorded, so a walk cut short
by a crash or a power cut is redone. Done once rather than lazily: FUSE clients and other
users open store files without asking mountd, so no later moment would catch every file.

Clean shutdown: :meth:`Cache.aclose` marks the index clean (``meta.clean = 1``) after the
last change; ``open`` marks it dirty again (fsync'd) before any change. An open that finds it
clean only sweeps ``tmp/`` and skips B–E: no crash happened, so the index matches the store.
(Files removed by hand while mountd was stopped are then found lazily: ``ensure`` checks the
file of a hit and refetches it. ``open(reconcile=True)`` forces the full reconcile.)

Speed: one ``os.scandir`` per fan-out folder (no stat for indexed files), one index scan,
Python set differences, batched SQL. Only adopted files are stat'ed.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import sqlite3
import string
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import trio

from mountd.store import access, disk, durability, layout
from mountd.store.access import SHARED, StoreModes
from mountd.store.index import Index, IndexCorrupt, batched

log = logging.getLogger("mountd.store.recovery")

_HEX = frozenset(string.hexdigits.lower()[:16])
_NAME = re.compile(f"[0-9a-f]{{{layout.HASH_HEX}}}")


@dataclass
class RecoveryReport:
    """What :func:`recover` found and did."""

    temp_removed: int = 0
    adopted: int = 0
    rows_dropped: int = 0
    junk_removed: int = 0
    #: F: files re-hashed because they were newer than the last checkpoint of another boot.
    verified: int = 0
    #: F: of those, the ones that did not match (removed, file and row).
    unsynced_dropped: int = 0
    index_rebuilt: bool = False
    #: The modes the store was walked to set (``"shared"``, ``"private"``); "" = no walk.
    access_set: str = ""
    #: Store files given their mode by that walk.
    access_changed: int = 0
    #: False when the index was clean (clean shutdown) and the store scan was skipped.
    reconciled: bool = True
    entries: int = 0
    bytes: int = 0
    seconds: float = 0.0


def clear_tmp(cache_dir: Path) -> int:
    """State A: remove everything under ``tmp/``; returns the number of entries removed."""
    removed = 0
    tmp = layout.tmp_dir(cache_dir)
    with os.scandir(tmp) as it:
        for entry in it:
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path, ignore_errors=True)
            else:
                try:
                    os.unlink(entry.path)
                except FileNotFoundError:
                    continue
            removed += 1
    return removed


def _valid_hex(name: str, length: int) -> bool:
    return len(name) == length and set(name) <= _HEX


#: Threads walking folders and stat'ing files: directory reads and inode loads wait on the
#: disk with the GIL released, so a few threads overlap their latency (the disk queue fills).
SCAN_THREADS = 16


def _drop(entry: os.DirEntry) -> None:
    log.warning("removing unexpected entry in the store: %s", entry.path)
    if entry.is_dir(follow_symlinks=False):
        shutil.rmtree(entry.path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(entry.path)


def _scan_top(path: str, top: str) -> tuple[list[bytes], int]:
    """Hashes of valid files under ``store/<top>/`` (E: removes the rest)."""
    hashes: list[bytes] = []
    junk = 0
    fromhex, match = bytes.fromhex, _NAME.fullmatch
    with os.scandir(path) as level2:
        for d2 in level2:
            if not (_valid_hex(d2.name, 2) and d2.is_dir(follow_symlinks=False)):
                _drop(d2)
                junk += 1
                continue
            prefix = top + d2.name
            with os.scandir(d2.path) as files:
                for f in files:
                    name = f.name
                    if match(name) and name.startswith(prefix) and f.is_file(follow_symlinks=False):
                        hashes.append(fromhex(name))
                    else:
                        _drop(f)
                        junk += 1
    return hashes, junk


def scan_store(cache_dir: Path) -> tuple[set[bytes], int]:
    """Every hash with a file at its final name, and the number of junk entries removed (E)."""
    found: set[bytes] = set()
    junk = 0
    tops = []
    with os.scandir(layout.store_dir(cache_dir)) as level1:
        for d1 in level1:
            if _valid_hex(d1.name, 2) and d1.is_dir(follow_symlinks=False):
                tops.append((d1.path, d1.name))
            else:
                _drop(d1)
                junk += 1
    with ThreadPoolExecutor(SCAN_THREADS, thread_name_prefix="mountd-scan") as pool:
        for hashes, bad in pool.map(lambda t: _scan_top(*t), tops):
            found.update(hashes)
            junk += bad
    return found, junk


def _stat_some(cache_dir: Path, hashes: Sequence[bytes]) -> list[tuple[bytes, int, int]]:
    rows = []
    root = str(layout.store_dir(cache_dir))
    for h in hashes:
        name = h.hex()  # the same path as layout.store_path, without Path's overhead
        try:
            st = os.stat(f"{root}/{name[0:2]}/{name[2:4]}/{name}")
        except FileNotFoundError:
            continue
        rows.append((h, st.st_size, st.st_mtime_ns))
    return rows


def stat_files(cache_dir: Path, hashes: Sequence[bytes]) -> list[tuple[bytes, int, int]]:
    """``(hash, size, mtime_ns)`` of store files to adopt (B); vanished ones are skipped."""
    step = max(256, len(hashes) // (SCAN_THREADS * 4) + 1)
    parts = [hashes[i : i + step] for i in range(0, len(hashes), step)]
    rows: list[tuple[bytes, int, int]] = []
    with ThreadPoolExecutor(SCAN_THREADS, thread_name_prefix="mountd-stat") as pool:
        for part in pool.map(lambda p: _stat_some(cache_dir, p), parts):
            rows.extend(part)
    return rows


def set_aside(index_file: Path) -> None:
    """State D: move an unusable index out of the way (keeping one copy for a post-mortem)."""
    if index_file.exists():
        os.replace(index_file, index_file.with_name(index_file.name + ".corrupt"))
    for suffix in ("-wal", "-shm"):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(str(index_file) + suffix)


async def recover(cache_dir: Path, reconcile: bool = False,
                  modes: StoreModes = SHARED) -> tuple[Index, RecoveryReport]:
    """Repair states A–E, give the store ``modes``, and return the open, consistent index
    (marked dirty: owned).

    Filesystem walks run in worker threads; SQL runs here, in the trio thread. Without
    ``reconcile`` an index left clean by a clean shutdown is trusted (only A is repaired).
    """
    start = trio.current_time()
    report = RecoveryReport()
    await trio.to_thread.run_sync(access.secure_cache_dir, cache_dir, modes)
    report.temp_removed = await trio.to_thread.run_sync(clear_tmp, cache_dir)
    index_file = layout.index_path(cache_dir)

    index: Index | None = None
    mark: tuple[int | None, str | None] = (None, None)
    try:
        index = Index.open(index_file)
        mark = index.durable_mark()
        if index.is_clean() and not reconcile:
            index.set_clean(False)
            report.reconciled = False
            await _settle_access(index, cache_dir, modes, report)
            return index, _finish(index, report, start, cache_dir)
    except (IndexCorrupt, sqlite3.DatabaseError) as exc:  # state D
        index = _discard(index, index_file, exc)

    # Scan the store in threads while this (trio) thread reads the index.
    scanned: dict[str, tuple[set[bytes], int]] = {}

    async def scan() -> None:
        scanned["store"] = await trio.to_thread.run_sync(scan_store, cache_dir)

    indexed: set[bytes] = set()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(scan)
        await trio.sleep(0)  # let the scan thread start first
        if index is not None:
            try:
                indexed = index.all_hashes()  # reads every page: corruption shows here
                index.set_clean(False)
            except sqlite3.DatabaseError as exc:  # state D
                index = _discard(index, index_file, exc)
                indexed = set()
    on_disk, report.junk_removed = scanned["store"]
    if index is None:
        await trio.to_thread.run_sync(set_aside, index_file)
        index = Index.open(index_file)
        index.set_clean(False)
        report.index_rebuilt = True

    missing = list(indexed - on_disk)  # C
    if missing:
        index.delete(missing)
        report.rows_dropped = len(missing)
    if missing or report.index_rebuilt:
        index.drop_dangling_refs()

    orphans = list(on_disk - indexed)  # B (and D)
    del on_disk, indexed
    synced_through, boot = (None, None) if report.index_rebuilt else mark
    rebooted = boot is None or boot != durability.boot_id()  # (None == None: unknown)
    for part in batched(orphans, 250_000):
        rows = await trio.to_thread.run_sync(stat_files, cache_dir, part)
        if rebooted:  # F: a file without a row may be one the power cut damaged
            rows = await _drop_unverified(cache_dir, rows, report)
        index.adopt(rows)
        report.adopted += len(rows)
    if rebooted:  # F: rows newer than the last checkpoint
        adopted = set(orphans)
        suspects = [(h, size) for h, size in index.added_since(synced_through)
                    if h not in adopted]
        bad = await _verify(cache_dir, suspects, report)
        if bad:
            index.delete(bad)
            index.drop_dangling_refs()
    await _settle_access(index, cache_dir, modes, report)
    return index, _finish(index, report, start, cache_dir)


#: ``meta`` key recording the modes every folder and file of the store has.
STORE_ACCESS = "store_access"


async def _settle_access(index: Index, cache_dir: Path, modes: StoreModes,
                         report: RecoveryReport) -> None:
    """Walk the store to give it ``modes`` unless the index says it has them (see the
    module doc, "Access")."""
    if index.get_meta(STORE_ACCESS) == modes.name:
        return
    index.set_meta(STORE_ACCESS, "changing", durable=True)
    report.access_changed = await trio.to_thread.run_sync(
        access.set_store_access, cache_dir, modes)
    report.access_set = modes.name
    await trio.to_thread.run_sync(durability.syncfs, cache_dir)
    index.set_meta(STORE_ACCESS, modes.name)


async def _verify(cache_dir: Path, items: Sequence[tuple[bytes, int | None]],
                  report: RecoveryReport) -> list[bytes]:
    """Re-hash ``items`` in worker threads; remove the files of the bad ones, and return
    them (counted in ``report``)."""
    if not items:
        return []
    bad = await trio.to_thread.run_sync(durability.verify_files, cache_dir, items)
    report.verified += len(items)
    report.unsynced_dropped += len(bad)
    for h in bad:
        log.warning("dropping %s: written after the last durable checkpoint and damaged by "
                    "the crash (its bytes do not match its hash)", h.hex())
        disk.remove(layout.store_path(cache_dir, h))
    return bad


async def _drop_unverified(cache_dir: Path, rows: list[tuple[bytes, int, int]],
                           report: RecoveryReport) -> list[tuple[bytes, int, int]]:
    """The rows of files to adopt that verify; the others' files are removed."""
    bad = set(await _verify(cache_dir, [(h, size) for h, size, _ in rows], report))
    return [row for row in rows if row[0] not in bad]


def _discard(index: Index | None, index_file: Path, exc: BaseException) -> None:
    if index is not None:
        index.conn.close()
    log.warning("index %s is unusable (%s); rebuilding it from the store", index_file, exc)
    return None


def _finish(index: Index, report: RecoveryReport, start: float, cache_dir: Path) -> RecoveryReport:
    index.seed_clock()
    report.entries, report.bytes = index.totals()
    report.seconds = trio.current_time() - start
    log.info(
        "opened %s: %d entries (%d bytes), %d temp removed, %d adopted, %d rows dropped, "
        "%d junk removed, %d verified after a reboot (%d dropped)%s%s%s in %.2fs",
        cache_dir,
        report.entries,
        report.bytes,
        report.temp_removed,
        report.adopted,
        report.rows_dropped,
        report.junk_removed,
        report.verified,
        report.unsynced_dropped,
        ", index rebuilt" if report.index_rebuilt else "",
        (f", store made {report.access_set} ({report.access_changed} files)"
         if report.access_set else ""),
        "" if report.reconciled else " (clean shutdown: store scan skipped)",
        report.seconds,
    )
    return report
