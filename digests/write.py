"""Writing a digest file from rows: ids, directories, indexes, meta, then an atomic rename.

Used by ``digests build`` (from its partial file), by the benchmark and by tests. The output
appears at its final name only when complete: rows go to ``OUT.tmp-PID``, which is fsynced
and renamed over ``OUT``, and the directory is fsynced.
"""

from __future__ import annotations

import os
import sqlite3
import time
from collections.abc import Iterable
from dataclasses import dataclass

from digests.canonical import compute_dataset_id
from digests.errors import DigestError
from digests.paths import components_key, path_problem
from digests.schema import FORMAT_VERSION, ROOT_ID, create_indexes, create_tables
from quiverfs.base.version import __version__


@dataclass(frozen=True, slots=True)
class NewFile:
    """One file to write. ``source`` indexes the ``sources`` list given to :func:`write_digest`
    (0-based); ``key=None`` means the object key is ``path`` itself."""

    path: str
    size: int
    hash: bytes
    source: int = 0
    key: str | None = None
    offset: int = 0


def write_digest(
    out: str | os.PathLike[str],
    files: Iterable[NewFile | tuple],
    sources: list[str],
    *,
    dirs: Iterable[str] = (),
    created_at: float | None = None,
) -> str:
    """Write a complete digest of ``files`` to ``out`` atomically; return its dataset id.

    ``files`` may come in any order (tuples are taken as :class:`NewFile` fields). ``dirs``
    names directories that exist even if no file is below them (empty folders, bucket
    directory markers); naming one that files already imply changes nothing. Raises
    :class:`DigestError` for an invalid path, a duplicate path, or a path that is both a file
    and a directory; ``out`` is then left untouched.
    """
    out = os.fspath(out)
    tmp = f"{out}.tmp-{os.getpid()}"
    if os.path.exists(tmp):
        os.unlink(tmp)
    conn = sqlite3.connect(tmp, isolation_level=None)
    try:
        dataset_id = _fill(conn, files, sources, dirs, created_at)
        conn.close()
        _fsync_path(tmp)
        os.replace(tmp, out)
        _fsync_path(os.path.dirname(os.path.abspath(out)))
        return dataset_id
    except BaseException:
        conn.close()
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _fill(
    conn: sqlite3.Connection,
    files: Iterable,
    sources: list[str],
    dirs: Iterable[str],
    created_at: float | None,
) -> str:
    # A scratch file: durability comes from the fsync + rename at the end, not the journal.
    conn.execute("PRAGMA journal_mode = OFF")
    conn.execute("PRAGMA synchronous = OFF")
    conn.execute("PRAGMA temp_store = FILE")
    conn.execute("BEGIN")
    create_tables(conn)
    conn.executemany("INSERT INTO sources (id, url) VALUES (?, ?)", enumerate(sources, 1))
    conn.execute(
        "CREATE TEMP TABLE staging (dir TEXT NOT NULL, name TEXT NOT NULL, size INTEGER, "
        "hash BLOB, source INTEGER, key TEXT, off INTEGER)"
    )
    dir_paths: set[str] = {""}

    def rows():
        for item in files:
            f = item if isinstance(item, NewFile) else NewFile(*item)
            problem = path_problem(f.path)
            if problem:
                raise DigestError(f"cannot write digest: {f.path!r}: {problem}")
            parent, _, name = f.path.rpartition("/")
            if parent not in dir_paths:
                dir_paths.add(parent)
            yield parent, name, f.size, f.hash, f.source + 1, f.key, f.offset

    conn.executemany("INSERT INTO staging VALUES (?, ?, ?, ?, ?, ?, ?)", rows())
    for path in dirs:
        problem = path_problem(path)
        if problem:
            raise DigestError(f"cannot write digest: directory {path!r}: {problem}")
        dir_paths.add(path)

    # Every ancestor is a directory; pre-order with sorted children = component order.
    for path in list(dir_paths):
        while path:
            path = path.rpartition("/")[0]
            dir_paths.add(path)
    ordered = sorted(dir_paths, key=components_key)
    ids = {path: i for i, path in enumerate(ordered, ROOT_ID)}
    conn.executemany(
        "INSERT INTO dirs (id, parent, name) VALUES (?, ?, ?)",
        ((ids[p], ids[p.rpartition("/")[0]] if p else 0, p.rpartition("/")[2]) for p in ordered),
    )
    conn.execute("CREATE TEMP TABLE dirmap (path TEXT PRIMARY KEY, id INTEGER) WITHOUT ROWID")
    conn.executemany("INSERT INTO temp.dirmap VALUES (?, ?)", ids.items())
    dir_count = len(ordered)
    conn.execute(
        "INSERT INTO files (id, dir, name, size, hash, loc_source, loc_key, loc_offset, loc_length) "
        "SELECT ? + row_number() OVER (ORDER BY m.id, s.name), m.id, s.name, s.size, s.hash, "
        "s.source, s.key, s.off, s.size FROM staging s JOIN temp.dirmap m ON m.path = s.dir "
        "ORDER BY m.id, s.name",
        (dir_count,),
    )
    conn.execute("DROP TABLE temp.staging")
    try:
        create_indexes(conn)
    except sqlite3.IntegrityError:
        row = conn.execute(
            "SELECT dir, name FROM files GROUP BY dir, name HAVING count(*) > 1 LIMIT 1"
        ).fetchone()
        raise DigestError(f"cannot write digest: duplicate path {_path(conn, *row)!r}") from None
    row = conn.execute(
        "SELECT f.dir, f.name FROM dirs d JOIN files f ON f.dir = d.parent AND f.name = d.name"
    ).fetchone()
    if row:
        raise DigestError(
            f"cannot write digest: {_path(conn, *row)!r} is both a file and a directory"
        )
    count, total = conn.execute("SELECT count(*), coalesce(sum(size), 0) FROM files").fetchone()
    dataset_id = compute_dataset_id(conn)
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(created_at))
    meta = {
        "format_version": str(FORMAT_VERSION),
        "created_at": stamp,
        "dataset_id": dataset_id,
        "file_count": str(count),
        "dir_count": str(dir_count),
        "total_bytes": str(total),
        "generator": f"quiverfs {__version__}",
    }
    conn.executemany("INSERT INTO meta (key, value) VALUES (?, ?)", meta.items())
    conn.execute("COMMIT")
    return dataset_id


def _path(conn: sqlite3.Connection, dir_id: int, name: str) -> str:
    (prefix,) = conn.execute("SELECT path FROM temp.dirmap WHERE id = ?", (dir_id,)).fetchone()
    return f"{prefix}/{name}" if prefix else name


def _fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
