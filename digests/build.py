"""``digests build``: list a source, hash every object in parallel, write a digest.

Work goes into ``OUT.partial``, a SQLite file committed in batches (every 500 objects or 2 s),
so an interrupted build loses at most one batch. Rerunning the same command resumes: the
source is listed again and objects whose key, size and version (ETag, generation or mtime)
match a row of the partial are not read again. At the end the digest is written to a fresh
file, fsynced and renamed to ``OUT`` (see digests/write.py), and the partial is removed.

Crash states: only ``OUT.partial`` (resume by rerunning), ``OUT.tmp-PID`` (a finalisation
that died: deleted by the next run once that process is gone), ``OUT`` complete (the partial may still
exist if the process died between the rename and the unlink; rerunning rebuilds ``OUT``
from it without reading any object).
"""

from __future__ import annotations

import os
import sqlite3
import time
from dataclasses import dataclass, field

import blake3
import trio

from digests.paths import path_problem
from digests.progress import Progress
from digests.write import write_digest
from quiverfs.backends import (
    DIRECTORY,
    EXTERNAL_LINK,
    Backend,
    BackendOptions,
    ObjectInfo,
    RemoteSettings,
    normalize_url,
    open_backend,
)
from quiverfs.backends.base import DEFAULT_CHUNK
from quiverfs.errors import CorruptObject, NotFound, UsageError, first_error

#: Hash buffers at least this big in a worker thread; smaller ones inline (17 µs per 110 KiB).
THREAD_HASH_BYTES = 1 << 20
#: Commit the partial file after this many hashed objects or seconds, whichever comes first.
BATCH_OBJECTS = 500
BATCH_SECONDS = 2.0
#: Attempts at hashing an object that changes while being read.
CHANGE_ATTEMPTS = 3
#: Invalid keys kept as examples for the report.
EXAMPLES = 5

PARTIAL_SCHEMA = """
CREATE TABLE IF NOT EXISTS build (key TEXT PRIMARY KEY, value TEXT) WITHOUT ROWID;
-- Objects hashed so far, by any run of this build. version '' = the store gives none.
CREATE TABLE IF NOT EXISTS hashed (
    key TEXT PRIMARY KEY, size INTEGER NOT NULL, version TEXT NOT NULL, hash BLOB NOT NULL
) WITHOUT ROWID;
-- The current run's listing (emptied at the start of every run).
CREATE TABLE IF NOT EXISTS listing (key TEXT PRIMARY KEY) WITHOUT ROWID;
-- Directories the current run's listing named (markers, empty folders), emptied likewise.
CREATE TABLE IF NOT EXISTS dirs (key TEXT PRIMARY KEY) WITHOUT ROWID;
"""


@dataclass
class BuildResult:
    """What a build did; ``skipped`` holds ``(key, reason)`` examples of skipped objects.

    ``markers`` counts the directories the listing named (bucket directory markers, empty
    ``file://`` directories), ``empty_dirs`` those of them the digest holds with nothing in
    them, ``external_links`` the ``file://`` links out of the root that were skipped (they
    are also in ``skipped_count``).
    """

    out: str
    dataset_id: str = ""
    files: int = 0
    total_bytes: int = 0
    hashed_files: int = 0
    hashed_bytes: int = 0
    reused_files: int = 0
    markers: int = 0
    empty_dirs: int = 0
    external_links: int = 0
    skipped_count: int = 0
    skipped: list[tuple[str, str]] = field(default_factory=list)


async def build(
    source: str | Backend,
    out: str | os.PathLike[str],
    *,
    location: str | None = None,
    workers: int = 16,
    progress: Progress | None = None,
    settings: RemoteSettings | None = None,
    options: BackendOptions | None = None,
    follow_external_links: bool = False,
) -> BuildResult:
    """Build the digest of every object under ``source`` into ``out``; resume if interrupted.

    ``source`` is a URL (opened with ``settings``/``options``, closed at the end) or an open
    :class:`Backend` (left open). ``location`` is the URL recorded as the files' source in
    the digest (default: the source URL), e.g. hash ``file:///data/imagenet`` but record
    ``s3://bucket/imagenet``; keys stay relative and identical.

    Directory markers (zero-byte keys ending in ``/``, Azure folder blobs, empty ``file://``
    directories) become directories of the digest, never files; empty ones are kept.

    Skipped, with a warning through ``progress``: keys that are not valid relative paths (see
    digests/paths.py), keys that are also a directory of other keys or markers, objects
    deleted after being listed, and ``file://`` symbolic links whose target leaves the source
    root (``/etc/passwd``, ``../../x``) unless ``follow_external_links``.

    Raises :class:`UsageError` when ``OUT.partial`` belongs to another source or location,
    :class:`CorruptObject` when an object keeps changing while it is hashed.

    Cancellation: hashed objects are committed to the partial before the cancellation goes on.
    """
    if workers < 1:
        raise UsageError(f"--workers must be at least 1: {workers}")
    out = os.fspath(out)
    progress = progress or Progress()
    owned = not isinstance(source, Backend)
    backend = open_backend(source, options, settings) if owned else source
    try:
        location_url = normalize_url(location) if location else backend.url
        return await _build(backend, out, location_url, workers, progress, follow_external_links)
    finally:
        if owned:
            await backend.aclose()


async def _build(
    backend: Backend,
    out: str,
    location_url: str,
    workers: int,
    progress: Progress,
    follow_external_links: bool,
) -> BuildResult:
    result = BuildResult(out=out)
    partial = out + ".partial"
    parent = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(parent):
        raise UsageError(f"output directory does not exist: {parent}")
    _remove_stale_tmp(out)
    # SQLite is used from the trio thread only: code between two awaits is atomic, so the
    # lister and the workers never interleave inside a statement or a commit.
    db = sqlite3.connect(partial)
    try:
        db.executescript(PARTIAL_SCHEMA)
        _claim_partial(db, partial, backend.url, location_url)
        db.execute("DELETE FROM listing")
        db.execute("DELETE FROM dirs")
        db.commit()
        await _list_and_hash(db, backend, workers, progress, result, follow_external_links)
        db.commit()
    finally:
        db.commit()
        db.close()
    await trio.to_thread.run_sync(_finalize, partial, out, location_url, result, progress)
    os.unlink(partial)
    return result


def _remove_stale_tmp(out: str) -> None:
    """Delete ``OUT.tmp-PID`` files left by finalisations whose process is gone."""
    directory = os.path.dirname(os.path.abspath(out))
    prefix = os.path.basename(out) + ".tmp-"
    for name in os.listdir(directory):
        if not name.startswith(prefix) or not name[len(prefix) :].isdigit():
            continue
        try:
            os.kill(int(name[len(prefix) :]), 0)
        except ProcessLookupError:
            os.unlink(os.path.join(directory, name))
        except PermissionError:
            pass  # alive, someone else's


def _claim_partial(db: sqlite3.Connection, partial: str, source: str, location: str) -> None:
    wanted = {"source": source, "location": location}
    have = dict(db.execute("SELECT key, value FROM build"))
    if not have:
        db.executemany("INSERT INTO build VALUES (?, ?)", wanted.items())
        db.commit()
    elif have != wanted:
        raise UsageError(
            f"{partial} belongs to another build ({have.get('source')} recorded as "
            f"{have.get('location')}); rerun that command, or delete the file to start over"
        )


async def _list_and_hash(
    db: sqlite3.Connection,
    backend: Backend,
    workers: int,
    progress: Progress,
    result: BuildResult,
    follow_external_links: bool,
) -> None:
    pending = 0
    last_commit = time.monotonic()

    def skip(key: str, reason: str) -> None:
        result.skipped_count += 1
        if len(result.skipped) < EXAMPLES:
            result.skipped.append((key, reason))
            progress.note(f"skipping {key!r}: {reason}")

    async def lister(send: trio.MemorySendChannel[ObjectInfo]) -> None:
        async with send:
            async for info in backend.list():
                if info.kind == DIRECTORY:
                    result.markers += 1
                    if info.key:  # "" is the source root itself
                        problem = path_problem(info.key)
                        if problem:
                            skip(info.key + "/", problem)
                        else:
                            db.execute("INSERT OR IGNORE INTO dirs VALUES (?)", (info.key,))
                    continue
                if info.kind == EXTERNAL_LINK and not follow_external_links:
                    result.external_links += 1
                    skip(info.key, "symbolic link to a target outside the source root "
                         "(--follow-external-links includes it)")
                    continue
                problem = path_problem(info.key)
                if problem:
                    skip(info.key, problem)
                    continue
                db.execute("INSERT OR IGNORE INTO listing VALUES (?)", (info.key,))
                progress.add_total(1, info.size)
                row = db.execute(
                    "SELECT size, version FROM hashed WHERE key = ?", (info.key,)
                ).fetchone()
                if row == (info.size, info.version):
                    result.reused_files += 1
                    progress.advance(1, info.size)
                    continue
                await send.send(info)
            progress.totals_known()

    async def worker(recv: trio.MemoryReceiveChannel[ObjectInfo]) -> None:
        nonlocal pending, last_commit
        async with recv:
            async for info in recv:
                try:
                    size, version, digest = await hash_object(backend, info)
                except NotFound:
                    db.execute("DELETE FROM listing WHERE key = ?", (info.key,))
                    skip(info.key, "deleted while the build ran")
                    continue
                db.execute(
                    "INSERT OR REPLACE INTO hashed VALUES (?, ?, ?, ?)",
                    (info.key, size, version, digest),
                )
                result.hashed_files += 1
                result.hashed_bytes += size
                progress.advance(1, size)
                pending += 1
                if pending >= BATCH_OBJECTS or time.monotonic() - last_commit > BATCH_SECONDS:
                    db.commit()
                    pending, last_commit = 0, time.monotonic()

    send, recv = trio.open_memory_channel[ObjectInfo](workers)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lister, send)
            for _ in range(workers):
                nursery.start_soon(worker, recv.clone())
            await recv.aclose()
    except BaseExceptionGroup as group:
        raise first_error(group) from None


async def hash_object(backend: Backend, info: ObjectInfo) -> tuple[int, str, bytes]:
    """``(size, version, blake3)`` of one object, never of a half-changed one.

    A small object is read with one GET of ``size + 1`` bytes, so growth shows as an extra
    byte; a large one in :data:`DEFAULT_CHUNK` ranges, then a 1-byte read past the end and a
    HEAD (when the store has versions) confirm it did not change. A change means a fresh
    stat and another attempt; :class:`CorruptObject` after :data:`CHANGE_ATTEMPTS`.
    """
    for _ in range(CHANGE_ATTEMPTS):
        hasher = blake3.blake3()
        if info.size < DEFAULT_CHUNK:
            data = await backend.read_range(info.key, 0, info.size + 1)
            if len(data) == info.size:
                await _update(hasher, data)
                return info.size, info.version, hasher.digest()
        else:
            seen = 0
            async for chunk in backend.iter_chunks(info.key, info.size, DEFAULT_CHUNK):
                seen += len(chunk)
                await _update(hasher, chunk)
            if seen == info.size and not await backend.read_range(info.key, info.size, 1):
                now = await backend.stat(info.key) if info.version else info
                if (now.size, now.version) == (info.size, info.version):
                    return info.size, info.version, hasher.digest()
        info = await backend.stat(info.key)
    raise CorruptObject(
        f"object keeps changing while it is hashed ({CHANGE_ATTEMPTS} attempts)",
        url=backend.url,
        key=info.key,
    )


async def _update(hasher: blake3.blake3, data: bytes) -> None:
    if len(data) >= THREAD_HASH_BYTES:
        await trio.to_thread.run_sync(hasher.update, data)
    else:
        hasher.update(data)


def _finalize(
    partial: str, out: str, location_url: str, result: BuildResult, progress: Progress
) -> None:
    """Write ``out`` from the listed, hashed objects of ``partial`` (in a worker thread)."""
    db = sqlite3.connect(partial)
    try:
        # A key that is also the directory of other keys or markers ("a" and "a/b", "a" and
        # marker "a/") cannot be both in a file tree: the directory wins, the object is
        # skipped. '0' sorts right after '/'.
        clashes = db.execute(
            "SELECT l.key FROM listing l WHERE EXISTS (SELECT 1 FROM listing m "
            "WHERE m.key > l.key || '/' AND m.key < l.key || '0') OR EXISTS (SELECT 1 FROM "
            "dirs d WHERE d.key = l.key OR (d.key > l.key || '/' AND d.key < l.key || '0'))"
        ).fetchall()
        for (key,) in clashes:
            db.execute("DELETE FROM listing WHERE key = ?", (key,))
            result.skipped_count += 1
            if len(result.skipped) < EXAMPLES:
                result.skipped.append((key, "is also a directory of other keys"))
                progress.note(f"skipping {key!r}: is also a directory of other keys")
        db.commit()
        rows = db.execute(
            "SELECT h.key, h.size, h.hash FROM listing l JOIN hashed h ON h.key = l.key"
        )
        dirs = [key for (key,) in db.execute("SELECT key FROM dirs")]
        result.dataset_id = write_digest(out, rows, [location_url], dirs=dirs)
        result.files, result.total_bytes = db.execute(
            "SELECT count(*), coalesce(sum(h.size), 0) FROM listing l JOIN hashed h "
            "ON h.key = l.key"
        ).fetchone()
        (result.empty_dirs,) = db.execute(
            "SELECT count(*) FROM dirs d WHERE NOT EXISTS (SELECT 1 FROM listing l "
            "WHERE l.key > d.key || '/' AND l.key < d.key || '0') AND NOT EXISTS (SELECT 1 "
            "FROM dirs e WHERE e.key > d.key || '/' AND e.key < d.key || '0')"
        ).fetchone()
    finally:
        db.close()
