"""``digests build``: list a source, hash every object in parallel, write a digest.

With ``tar="members"`` every ``.tar`` object is a shard whose members become the files
(digests/tar.py reads them); other objects stay files of their own. The tree is then what
extracting every shard in place, in key order, over the other objects would give: a member's
path is the shard's directory joined to its name, a later member of the same path wins (within
a shard: the later one in the tar; across shards: the shard whose key sorts last, in byte
order), and a member replaces an object of the same path. Every such replacement is counted
and reported (``BuildResult.shadowed``), never an error and never two files of one path.

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
from digests.tar import (
    ShardScan,
    compressed_refusal,
    compressed_suffix,
    is_shard_key,
    scan_shard,
)
from digests.write import write_digest
from quiverfs.base.backends import (
    DIRECTORY,
    EXTERNAL_LINK,
    Backend,
    BackendOptions,
    ObjectInfo,
    RemoteSettings,
    normalize_url,
    open_backend,
)
from quiverfs.base.backends.base import DEFAULT_CHUNK
from quiverfs.base.errors import CorruptObject, NotFound, UsageError, first_error

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
-- --tar members: shards read so far, by any run; a row is written with its members, in one
-- transaction, once the whole shard was read. duplicates = members replaced inside it.
CREATE TABLE IF NOT EXISTS shards (
    key TEXT PRIMARY KEY, size INTEGER NOT NULL, version TEXT NOT NULL,
    duplicates INTEGER NOT NULL
) WITHOUT ROWID;
-- Their members (one per path; is_dir = a directory entry: offset, size 0, hash NULL).
CREATE TABLE IF NOT EXISTS members (
    shard TEXT NOT NULL, path TEXT NOT NULL, is_dir INTEGER NOT NULL, offset INTEGER NOT NULL,
    size INTEGER NOT NULL, hash BLOB, PRIMARY KEY (shard, path)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS members_by_path ON members (path, shard);
-- Members a shard holds that cannot be files (links, devices, invalid names), with why.
CREATE TABLE IF NOT EXISTS shard_skips (shard TEXT NOT NULL, name TEXT NOT NULL,
    reason TEXT NOT NULL);
-- The current run's listed shards (emptied at the start of every run).
CREATE TABLE IF NOT EXISTS shard_listing (key TEXT PRIMARY KEY) WITHOUT ROWID;
"""

#: ``tar`` modes: ``shards`` (a .tar object is one file, like any object) and ``members``.
TAR_MODES = ("shards", "members")


@dataclass
class BuildResult:
    """What a build did; ``skipped`` holds ``(key, reason)`` examples of skipped objects.

    ``markers`` counts the directories the listing named (bucket directory markers, empty
    ``file://`` directories), ``empty_dirs`` those of them the digest holds with nothing in
    them, ``external_links`` the ``file://`` links out of the root that were skipped (they
    are also in ``skipped_count``).

    With ``tar="members"``: ``shards`` is the number of tar shards listed, ``members`` the
    digest's files that come from them (``files - members`` are plain objects);
    ``scanned_shards``/``scanned_bytes`` were read by this run, ``reused_shards`` came from
    the partial; ``shadowed`` counts files replaced by a later member of the same path (in
    the same shard, a later shard, or over a plain object), ``shadowed_examples`` names a few.
    ``hashed_*`` and ``reused_files`` count plain objects only.
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
    tar: str = "shards"
    shards: int = 0
    members: int = 0
    scanned_shards: int = 0
    scanned_bytes: int = 0
    reused_shards: int = 0
    shadowed: int = 0
    shadowed_examples: list[str] = field(default_factory=list)


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
    tar: str = "shards",
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

    ``tar="members"`` reads every ``.tar`` object as a shard and makes its members the files
    (see the module docstring and digests/tar.py); members that cannot be files (links,
    devices, invalid names) are skipped with a warning like keys. ``"shards"`` (the default)
    keeps every object a file.

    Raises :class:`UsageError` when ``OUT.partial`` belongs to another source, location or
    tar mode, or (members) for a compressed shard; :class:`CorruptObject` when an object
    keeps changing while it is hashed, or (members) a shard is not a readable tar.

    Cancellation: hashed objects are committed to the partial before the cancellation goes on.
    """
    if workers < 1:
        raise UsageError(f"--workers must be at least 1: {workers}")
    if tar not in TAR_MODES:
        raise UsageError(f"--tar must be one of {', '.join(TAR_MODES)}: {tar!r}")
    out = os.fspath(out)
    progress = progress or Progress()
    owned = not isinstance(source, Backend)
    backend = open_backend(source, options, settings) if owned else source
    try:
        location_url = normalize_url(location) if location else backend.url
        return await _build(
            backend, out, location_url, workers, progress, follow_external_links, tar
        )
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
    tar: str,
) -> BuildResult:
    result = BuildResult(out=out, tar=tar)
    partial = out + ".partial"
    parent = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(parent):
        raise UsageError(f"output directory does not exist: {parent}")
    _remove_stale_tmp(out)
    fresh = not os.path.exists(partial)
    # SQLite is used from the trio thread only: code between two awaits is atomic, so the
    # lister and the workers never interleave inside a statement or a commit.
    db = sqlite3.connect(partial)
    try:
        db.executescript(PARTIAL_SCHEMA)
        _claim_partial(db, partial, backend.url, location_url, tar)
        db.execute("DELETE FROM listing")
        db.execute("DELETE FROM dirs")
        db.execute("DELETE FROM shard_listing")
        db.commit()
        await _list_and_hash(db, backend, workers, progress, result, follow_external_links)
        db.commit()
    except BaseException:
        db.commit()
        useless = fresh and not _holds_work(db)
        db.close()
        if useless:  # nothing a rerun would reuse (a missing source, say): leave no partial
            os.unlink(partial)
        raise
    db.close()
    await trio.to_thread.run_sync(_finalize, partial, out, location_url, result, progress)
    os.unlink(partial)
    return result


def _holds_work(db: sqlite3.Connection) -> bool:
    """Whether a partial holds anything a rerun would reuse (hashed files or scanned shards)."""
    return any(db.execute(f"SELECT 1 FROM {table} LIMIT 1").fetchone()
               for table in ("hashed", "shards"))


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


def _claim_partial(
    db: sqlite3.Connection, partial: str, source: str, location: str, tar: str
) -> None:
    wanted = {"source": source, "location": location}
    if tar != "shards":
        # Only recorded when not the default, so partials of earlier versions still resume.
        wanted["tar"] = tar
    have = dict(db.execute("SELECT key, value FROM build"))
    if not have:
        db.executemany("INSERT INTO build VALUES (?, ?)", wanted.items())
        db.commit()
    elif have != wanted:
        raise UsageError(
            f"{partial} belongs to another build ({have.get('source')} recorded as "
            f"{have.get('location')}, --tar {have.get('tar', 'shards')}); rerun that "
            "command, or delete the file to start over"
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
    members_mode = result.tar == "members"

    def skip(key: str, reason: str) -> None:
        result.skipped_count += 1
        if len(result.skipped) < EXAMPLES:
            result.skipped.append((key, reason))
            progress.note(f"skipping {key!r}: {reason}")

    def shard_report(key: str) -> None:
        """Warn about what shard ``key`` held that the digest will not (again on a resume)."""
        for name, reason in db.execute(
            "SELECT name, reason FROM shard_skips WHERE shard = ? ORDER BY rowid", (key,)
        ):
            skip(f"{key}:{name}", f"tar member: {reason}")

    def committed() -> None:
        nonlocal pending, last_commit
        pending += 1
        if pending >= BATCH_OBJECTS or time.monotonic() - last_commit > BATCH_SECONDS:
            db.commit()
            pending, last_commit = 0, time.monotonic()

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
                if members_mode and is_shard_key(info.key):
                    db.execute("INSERT OR IGNORE INTO shard_listing VALUES (?)", (info.key,))
                    progress.add_total(1, info.size)
                    row = db.execute(
                        "SELECT size, version FROM shards WHERE key = ?", (info.key,)
                    ).fetchone()
                    if row == (info.size, info.version):
                        result.reused_shards += 1
                        shard_report(info.key)
                        progress.advance(1, info.size)
                        continue
                    await send.send(info)
                    continue
                if members_mode and (suffix := compressed_suffix(info.key)):
                    raise compressed_refusal(info.key, suffix)
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

    async def hash_one(info: ObjectInfo) -> None:
        try:
            size, version, digest = await hash_object(backend, info)
        except NotFound:
            db.execute("DELETE FROM listing WHERE key = ?", (info.key,))
            skip(info.key, "deleted while the build ran")
            return
        db.execute(
            "INSERT OR REPLACE INTO hashed VALUES (?, ?, ?, ?)",
            (info.key, size, version, digest),
        )
        result.hashed_files += 1
        result.hashed_bytes += size
        progress.advance(1, size)
        committed()

    async def scan_one(info: ObjectInfo) -> None:
        try:
            info, scan = await read_shard(backend, info)
        except NotFound:
            db.execute("DELETE FROM shard_listing WHERE key = ?", (info.key,))
            skip(info.key, "deleted while the build ran")
            return
        # One shard's rows between two awaits: atomic, and committed together.
        db.execute("DELETE FROM members WHERE shard = ?", (info.key,))
        db.execute("DELETE FROM shard_skips WHERE shard = ?", (info.key,))
        db.executemany(
            "INSERT INTO members VALUES (?, ?, ?, ?, ?, ?)",
            ((info.key, m.path, m.is_dir, m.offset, m.size, m.hash)
             for m in scan.members.values()),
        )
        db.executemany(
            "INSERT INTO shard_skips VALUES (?, ?, ?)",
            ((info.key, name, reason) for name, reason in scan.skipped),
        )
        db.execute(
            "INSERT OR REPLACE INTO shards VALUES (?, ?, ?, ?)",
            (info.key, info.size, info.version, scan.duplicates),
        )
        for path in scan.duplicate_examples:
            progress.note(
                f"{info.key}: member {path!r} appears more than once; the last one is kept "
                "(as extracting the tar would)"
            )
        shard_report(info.key)
        result.scanned_shards += 1
        result.scanned_bytes += info.size
        progress.advance(1, info.size)
        committed()

    async def worker(recv: trio.MemoryReceiveChannel[ObjectInfo]) -> None:
        async with recv:
            async for info in recv:
                if members_mode and is_shard_key(info.key):
                    await scan_one(info)
                else:
                    await hash_one(info)

    send, recv = trio.open_memory_channel[ObjectInfo](workers)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lister, send)
            for _ in range(workers):
                nursery.start_soon(worker, recv.clone())
            await recv.aclose()
    except BaseExceptionGroup as group:
        raise first_error(group) from None


def _prefix(key: str) -> str:
    """The directory of ``key``: where its members land (``""`` at the root)."""
    return key.rpartition("/")[0]


async def read_shard(backend: Backend, info: ObjectInfo) -> tuple[ObjectInfo, ShardScan]:
    """The members of shard ``info``, read in one consistent state; and the info they match.

    Like :func:`hash_object`: reads ask for one byte past the listed size at the end, a shard
    that was not read to its end (the tar's end marker came first) or is large is confirmed
    with a 1-byte read past its end and a HEAD (when the store has versions); a change means
    a fresh stat and another read (:class:`CorruptObject` after :data:`CHANGE_ATTEMPTS`).
    """
    for _ in range(CHANGE_ATTEMPTS):
        scan = await scan_shard(backend, info, _prefix(info.key), DEFAULT_CHUNK)
        if not scan.changed:
            if scan.read_to_end and info.size < DEFAULT_CHUNK:
                return info, scan
            if not scan.read_to_end and await backend.read_range(info.key, info.size, 1):
                info = await backend.stat(info.key)
                continue
            now = await backend.stat(info.key) if info.version else info
            if (now.size, now.version) == (info.size, info.version):
                return info, scan
        info = await backend.stat(info.key)
    raise CorruptObject(
        f"shard keeps changing while it is read ({CHANGE_ATTEMPTS} attempts)",
        url=backend.url,
        key=info.key,
    )


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
    """Write ``out`` from the listed objects and shard members of ``partial`` (in a thread).

    The tree is assembled in two temporary tables: ``entries`` (path → size, hash, location
    key and offset; key NULL = the object of that path) and ``tree_dirs``. Plain objects go in
    first, then the members of the listed shards over them (:func:`_add_members`), then a
    path that is also a directory loses its file.
    """
    db = sqlite3.connect(partial)
    try:
        db.execute(
            "CREATE TEMP TABLE entries (path TEXT PRIMARY KEY, size INTEGER NOT NULL, "
            "hash BLOB NOT NULL, key TEXT, off INTEGER NOT NULL) WITHOUT ROWID"
        )
        db.execute("CREATE TEMP TABLE tree_dirs (path TEXT PRIMARY KEY) WITHOUT ROWID")
        db.execute(
            "INSERT INTO temp.entries SELECT h.key, h.size, h.hash, NULL, 0 FROM listing l "
            "JOIN hashed h ON h.key = l.key"
        )
        db.execute("INSERT INTO temp.tree_dirs SELECT key FROM dirs")
        _add_members(db, result, progress)
        # A path that is also the directory of other paths or of a marker ("a" and "a/b",
        # "a" and marker "a/") cannot be both in a file tree: the directory wins, the file
        # is skipped. '0' sorts right after '/'.
        clashes = db.execute(
            "SELECT l.path FROM temp.entries l WHERE EXISTS (SELECT 1 FROM temp.entries m "
            "WHERE m.path > l.path || '/' AND m.path < l.path || '0') OR EXISTS (SELECT 1 "
            "FROM temp.tree_dirs d WHERE d.path = l.path OR (d.path > l.path || '/' AND "
            "d.path < l.path || '0'))"
        ).fetchall()
        for (path,) in clashes:
            db.execute("DELETE FROM temp.entries WHERE path = ?", (path,))
            result.skipped_count += 1
            if len(result.skipped) < EXAMPLES:
                result.skipped.append((path, "is also a directory of other keys"))
                progress.note(f"skipping {path!r}: is also a directory of other keys")
        rows = db.execute("SELECT path, size, hash, 0, key, off FROM temp.entries")
        dirs = [path for (path,) in db.execute("SELECT path FROM temp.tree_dirs")]
        result.dataset_id = write_digest(out, rows, [location_url], dirs=dirs)
        result.files, result.total_bytes, result.members = db.execute(
            "SELECT count(*), coalesce(sum(size), 0), count(key) FROM temp.entries"
        ).fetchone()
        (result.shards,) = db.execute("SELECT count(*) FROM shard_listing").fetchone()
        (result.empty_dirs,) = db.execute(
            "SELECT count(*) FROM temp.tree_dirs d WHERE NOT EXISTS (SELECT 1 FROM "
            "temp.entries l WHERE l.path > d.path || '/' AND l.path < d.path || '0') AND NOT "
            "EXISTS (SELECT 1 FROM temp.tree_dirs e WHERE e.path > d.path || '/' AND "
            "e.path < d.path || '0')"
        ).fetchone()
    finally:
        db.close()


def _add_members(db: sqlite3.Connection, result: BuildResult, progress: Progress) -> None:
    """Put the members of the listed shards into ``temp.entries`` and ``temp.tree_dirs``.

    Extraction semantics, so that one path is one file whatever the shards hold: of the
    members of one path the one in the shard whose key sorts last (byte order) wins, and a
    member replaces a plain object of the same path. Each replaced file is counted in
    ``result.shadowed`` (with the replacements inside one shard, counted when it was read).
    """
    db.execute(
        "CREATE TEMP TABLE live AS SELECT m.* FROM members m JOIN shard_listing s "
        "ON s.key = m.shard"
    )
    db.execute("INSERT OR IGNORE INTO temp.tree_dirs SELECT path FROM temp.live WHERE is_dir")
    (inside,) = db.execute(
        "SELECT coalesce(sum(duplicates), 0) FROM shards s JOIN shard_listing l ON l.key = s.key"
    ).fetchone()
    (across,) = db.execute(
        "SELECT count(*) - count(DISTINCT path) FROM temp.live WHERE NOT is_dir"
    ).fetchone()
    for (path,) in db.execute(
        "SELECT path FROM temp.live WHERE NOT is_dir GROUP BY path HAVING count(*) > 1 "
        "LIMIT ?", (EXAMPLES,)
    ).fetchall():
        _shadow_example(result, progress, path, "is a member of several shards; the one of "
                        "the shard whose key sorts last is kept")
    (over_plain,) = db.execute(
        "SELECT count(*) FROM temp.entries e WHERE EXISTS (SELECT 1 FROM temp.live m "
        "WHERE m.path = e.path AND NOT m.is_dir)"
    ).fetchone()
    for (path,) in db.execute(
        "SELECT path FROM temp.entries e WHERE EXISTS (SELECT 1 FROM temp.live m "
        "WHERE m.path = e.path AND NOT m.is_dir) LIMIT ?", (EXAMPLES,)
    ).fetchall():
        _shadow_example(result, progress, path, "is both an object and a tar member; the "
                        "member is kept")
    # SQLite takes the bare columns of a max() aggregate from the row holding the maximum.
    db.execute(
        "INSERT OR REPLACE INTO temp.entries SELECT path, size, hash, max(shard), offset "
        "FROM temp.live WHERE NOT is_dir GROUP BY path"
    )
    db.execute("DROP TABLE temp.live")
    result.shadowed = inside + across + over_plain


def _shadow_example(result: BuildResult, progress: Progress, path: str, why: str) -> None:
    if len(result.shadowed_examples) < EXAMPLES:
        result.shadowed_examples.append(path)
        progress.note(f"{path!r} {why}")
