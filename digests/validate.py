"""Refusing broken and hostile digests, as SQL scans that run at SQLite's C speed.

Three levels, each including the previous one:

``check_header``   the file is a regular file (checked before opening it: a FIFO would block
                   the open forever) and a complete SQLite database of ours: magic,
                   application id, rollback-journal mode, size = page size x page count.
``check_structure`` tables and columns exactly as :mod:`digests.schema` says, no views or
                   triggers, the meta keys and their types, the format version, the sources.
``check_tree``     every directory row obeys the rules of docs/digest-format.md; no path is
                   longer than PATH_MAX; counts, total size and id ranges agree with meta; every
                   value that code reads without the per-row check (file hashes, sizes,
                   directories, all text) has its SQL type, length and valid UTF-8: one
                   cheap pass over ``files``.
``check_file_rows`` every file row obeys the rules (names, sizes, hashes, locations): one
                   scan of ``files`` evaluating every rule, the expensive part.
``check_dataset_id`` (expensive) recomputes the dataset id from the rows and runs SQLite's
                   ``quick_check``; see docs/digest-format.md for the cost.

Every problem becomes one :class:`DigestError` line naming the file; a ``sqlite3.DatabaseError``
raised by SQLite while checking means the file is corrupted.
"""

from __future__ import annotations

import os
import re
import sqlite3
import stat

from digests.canonical import compute_dataset_id
from digests.errors import DigestError
from digests.paths import (
    BAD_UTF8_SQL,
    NAME_MAX,
    NAME_PROBLEM_SQL,
    PATH_MAX,
    bad_utf8,
    name_problem,
    path_problem,
)
from digests.schema import (
    APPLICATION_ID,
    EXPECTED_COLUMNS,
    EXPECTED_INDEXES,
    FORMAT_VERSION,
    META_KEYS,
    READ_VERSIONS,
    ROOT_ID,
)
from quiverfs.base.backends import normalize_url
from quiverfs.base.errors import QuiverError

SQLITE_MAGIC = b"SQLite format 3\x00"
_HEX64 = re.compile(r"[0-9a-f]{64}")
_CREATED = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ")


def fail(path: str, reason: str) -> DigestError:
    """The one-line error for ``reason`` in digest ``path``."""
    return DigestError(f"invalid digest {path}: {reason}")


#: What ``check_header`` calls a file that is not a regular file.
_KINDS = {
    stat.S_IFIFO: "a FIFO",
    stat.S_IFSOCK: "a socket",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFDIR: "a directory",
}


def _not_regular(path: str, mode: int) -> DigestError:
    kind = _KINDS.get(stat.S_IFMT(mode), "not a regular file")
    return fail(path, f"not a regular file ({kind})")


def register_functions(conn: sqlite3.Connection) -> None:
    """Give ``conn`` the SQL functions the checks use (``bad_utf8``)."""
    conn.create_function("bad_utf8", 1, bad_utf8, deterministic=True)


def check_header(path: str) -> None:
    """Refuse files that are not complete, rollback-mode SQLite databases with our app id.

    The file type is checked with ``stat`` before anything opens it: opening a FIFO for
    reading blocks until a writer comes, and opening a device may have side effects. The
    open itself is non-blocking and checked again with ``fstat``, in case the path was
    replaced in between.
    """
    try:
        mode = os.stat(path).st_mode
        if not stat.S_ISREG(mode):
            raise _not_regular(path, mode)
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
        with open(fd, "rb") as f:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise _not_regular(path, st.st_mode)
            size = st.st_size
            header = f.read(100)
    except OSError as exc:
        raise DigestError(f"cannot read digest {path}: {exc.strerror or exc}") from exc
    if size == 0:
        raise fail(path, "empty file")
    if len(header) < 100 or not header.startswith(SQLITE_MAGIC):
        raise fail(path, "not a SQLite file (wrong magic bytes)")
    if int.from_bytes(header[68:72], "big") != APPLICATION_ID:
        raise fail(path, "not a quiverfs digest (SQLite file without the digest application id)")
    if header[18] != 1 or header[19] != 1:
        raise fail(path, "database is in WAL mode; digests are finished in rollback-journal mode")
    page_size = int.from_bytes(header[16:18], "big")
    page_size = 65536 if page_size == 1 else page_size
    change_counter = header[24:28]
    page_count = int.from_bytes(header[28:32], "big")
    if header[92:96] != change_counter or page_count == 0:
        raise fail(path, "corrupted: the header's page count is not valid")
    expected = page_size * page_count
    if size < expected:
        raise fail(path, f"truncated: {size} bytes, the header says {expected}")
    if size > expected:
        raise fail(path, f"corrupted: {size} bytes, the header says {expected}")


def check_structure(path: str, conn: sqlite3.Connection) -> tuple[dict[str, str], dict[int, str]]:
    """Check tables, indexes, meta and sources; return ``(meta, {source id: url})``."""
    objects = conn.execute(
        "SELECT type, name FROM sqlite_master WHERE name NOT LIKE 'sqlite_autoindex_%'"
    ).fetchall()
    tables = {name for kind, name in objects if kind == "table"}
    extra = [f"{kind} {name}" for kind, name in objects if kind not in ("table", "index")]
    if extra:
        raise fail(path, f"unexpected schema object {extra[0]}")
    # meta first: an unknown format version should say so, not "wrong columns".
    _check_table(path, conn, tables, "meta")
    meta = dict(conn.execute("SELECT key, value FROM meta").fetchall())
    for key in META_KEYS:
        if key not in meta:
            raise fail(path, f"meta has no {key!r}")
        if not isinstance(meta[key], str):
            raise fail(path, f"meta {key!r} is not text")
    if meta["format_version"] not in {str(v) for v in READ_VERSIONS}:
        readable = ", ".join(str(v) for v in READ_VERSIONS)
        raise fail(
            path,
            f"unknown format version {meta['format_version'][:20]!r} "
            f"(this quiverfs reads versions {readable}, writes {FORMAT_VERSION})",
        )
    for name in EXPECTED_COLUMNS:
        _check_table(path, conn, tables, name)
    unexpected = tables - set(EXPECTED_COLUMNS)
    if unexpected:
        raise fail(path, f"unexpected table {sorted(unexpected)[0]!r}")
    indexes = {
        name: tbl
        for kind, name, tbl in conn.execute(
            "SELECT type, name, tbl_name FROM sqlite_master WHERE type = 'index' "
            "AND name NOT LIKE 'sqlite_autoindex_%'"
        )
    }
    for name, (table, columns) in EXPECTED_INDEXES.items():
        if indexes.get(name) != table:
            raise fail(path, f"missing index {name}")
        cols = [row[2] for row in conn.execute(f"PRAGMA index_info({name})")]
        unique = any(r[1] == name and r[2] for r in conn.execute(f"PRAGMA index_list({table})"))
        if cols != columns or not unique:
            raise fail(path, f"index {name} is not UNIQUE on ({', '.join(columns)})")
    if set(indexes) - set(EXPECTED_INDEXES):
        raise fail(path, f"unexpected index {sorted(set(indexes) - set(EXPECTED_INDEXES))[0]!r}")
    for key in ("file_count", "dir_count", "total_bytes"):
        if not meta[key].isascii() or not meta[key].isdigit():
            raise fail(path, f"meta {key!r} is not a non-negative integer")
    if not _HEX64.fullmatch(meta["dataset_id"]):
        raise fail(path, "meta 'dataset_id' is not 64 lower-case hex digits")
    if not _CREATED.fullmatch(meta["created_at"]):
        raise fail(path, "meta 'created_at' is not YYYY-MM-DDTHH:MM:SSZ")
    sources: dict[int, str] = {}
    for source_id, url in conn.execute("SELECT id, url FROM sources"):
        if type(source_id) is not int:
            raise fail(path, f"source id {source_id!r} is not an integer")
        if not isinstance(url, str):
            raise fail(path, f"source {source_id} URL is not text")
        try:
            normal = normalize_url(url)
        except QuiverError as exc:
            raise fail(path, f"source {source_id}: {exc}") from None
        if normal != url:
            raise fail(path, f"source {source_id} URL {url!r} is not normalised ({normal!r})")
        sources[source_id] = url
    return meta, sources


def _check_table(path: str, conn: sqlite3.Connection, tables: set[str], name: str) -> None:
    if name not in tables:
        raise fail(path, f"missing table {name!r}")
    columns = [(r[1], r[2].upper(), r[3], r[5]) for r in conn.execute(f"PRAGMA table_info({name})")]
    if columns != EXPECTED_COLUMNS[name]:
        have = ", ".join(c[0] for c in columns)
        raise fail(path, f"table {name!r} has the wrong columns ({have})")


_DIR_PROBLEM = f"""coalesce(
    CASE WHEN typeof(parent) != 'integer' OR parent < 1 OR parent >= id
         THEN 'parent ' || quote(parent) || ' is not an earlier directory' END,
    CASE WHEN {BAD_UTF8_SQL.format(c="name")} THEN 'name is not valid UTF-8' END,
    {NAME_PROBLEM_SQL.format(c="name")})"""

# Byte length of every directory's relative path (the root's is -1 so that its children's
# are their name's). Validation has already checked 0 < parent < id, so the recursion ends.
_DIR_PATH_LENGTHS = """WITH RECURSIVE p(id, len) AS (
    SELECT 1, -1
    UNION ALL
    SELECT d.id, p.len + 1 + length(CAST(d.name AS BLOB)) FROM dirs d JOIN p ON d.parent = p.id
)"""

# The file-row rules that code relies on without calling file_row_problem first (mountd scans
# every name, hash and size of a digest in SQL; the mount walks directories by id): the hash
# is a 32-byte BLOB, the name not a BLOB, the directory in range; sizes are integers when
# their sum() is. Written as comparisons, which SQLite orders by type (numbers < TEXT <
# BLOB), because typeof() costs twice as much per row. A bad row is then described with the
# full rules (_FILE_PROBLEM).
_FILE_TYPES_BAD = """(hash < X'' OR length(hash) != 32 OR name >= X''
    OR dir NOT BETWEEN 1 AND :dirs)"""

#: Rows per range of the open-time pass over ``files`` (~0.5 MB of names at a time).
_CHUNK_ROWS = 16384

_FILES_CHUNK = f"""SELECT sum(size), min(CASE WHEN {_FILE_TYPES_BAD} THEN id END),
    CAST(group_concat(name, '/') AS BLOB),
    CAST(group_concat(loc_key, '/') AS BLOB)
    FROM files WHERE id >= :lo AND id < :hi"""

_FIRST_BAD_TEXT = f"""SELECT id, {BAD_UTF8_SQL.format(c="name")} FROM files
    WHERE id >= :lo AND id < :hi
    AND ({BAD_UTF8_SQL.format(c="name")} OR {BAD_UTF8_SQL.format(c="loc_key")})
    ORDER BY id LIMIT 1"""

_KEY_PROBLEM = f"""CASE
    WHEN loc_key IS NULL THEN NULL
    WHEN typeof(loc_key) != 'text' THEN 'location key is not text'
    WHEN instr(CAST(loc_key AS BLOB), X'00') > 0 THEN 'NUL byte in location key'
    WHEN length(CAST(loc_key AS BLOB)) > {PATH_MAX}
      THEN 'location key longer than {PATH_MAX} bytes'
    WHEN loc_key = '' OR instr('/' || loc_key || '/', '//') > 0
      OR instr('/' || loc_key || '/', '/./') > 0 OR instr('/' || loc_key || '/', '/../') > 0
      THEN 'location key ' || quote(loc_key) || ' is not a relative path'
END"""

_FILE_PROBLEM = f"""coalesce(
    CASE WHEN typeof(dir) != 'integer' OR dir < 1 OR dir > :dirs
         THEN 'unknown directory ' || quote(dir)
         WHEN id <= :dirs THEN 'id ' || id || ' collides with a directory id' END,
    {NAME_PROBLEM_SQL.format(c="name")},
    CASE WHEN typeof(size) != 'integer' OR size < 0 THEN 'negative or non-integer size '
              || quote(size)
         WHEN typeof(hash) != 'blob' OR length(hash) != 32
              THEN 'content hash is not 32 bytes'
         WHEN typeof(loc_source) != 'integer' OR loc_source NOT IN (SELECT id FROM sources)
              THEN 'location points to unknown source ' || quote(loc_source) END,
    {_KEY_PROBLEM},
    CASE WHEN typeof(loc_offset) != 'integer' OR loc_offset < 0
              THEN 'negative or non-integer location offset ' || quote(loc_offset)
         WHEN typeof(loc_length) != 'integer' OR loc_length != size
              THEN 'size ' || quote(size) || ' differs from location length '
              || quote(loc_length) END)"""


def check_tree(path: str, conn: sqlite3.Connection, meta: dict[str, str]) -> None:
    """Check every directory row, path lengths, the counts and totals in meta, the id ranges,
    and the types and text of every file row (what code reads without the per-row check).

    Cost grows with the number of directories, plus one cheap aggregate scan of ``files``.
    """
    dir_count = int(meta["dir_count"])
    count, low, high = conn.execute("SELECT count(*), min(id), max(id) FROM dirs").fetchone()
    if count != dir_count:
        raise fail(path, f"meta dir_count {dir_count} but {count} directories")
    if count < 1 or low != ROOT_ID or high != count:
        raise fail(path, f"directory ids are not 1..{count}")
    root = conn.execute(
        "SELECT parent IS 0 AND typeof(name) = 'text' AND name = '' FROM dirs WHERE id = ?",
        (ROOT_ID,),
    ).fetchone()
    if root != (1,):
        raise fail(path, "directory 1 is not the root (parent 0, name '')")
    row = conn.execute(
        f"SELECT id, p FROM (SELECT id, {_DIR_PROBLEM} AS p FROM dirs WHERE id > 1) "
        "WHERE p IS NOT NULL LIMIT 1"
    ).fetchone()
    if row:
        raise fail(path, f"directory {row[0]}: {row[1]}")
    row = conn.execute(
        "SELECT d.id, d.name FROM dirs d JOIN files f ON f.dir = d.parent AND f.name = d.name "
        "LIMIT 1"
    ).fetchone()
    if row:
        raise fail(path, f"{row[1]!r} (directory {row[0]}) is both a file and a directory")
    if meta["format_version"] == "1":
        # Version 1 synthesised directories from file paths only; version 2 keeps empty ones.
        row = conn.execute(
            "SELECT id FROM dirs d WHERE id > 1 AND NOT EXISTS "
            "(SELECT 1 FROM dirs c WHERE c.parent = d.id) AND NOT EXISTS "
            "(SELECT 1 FROM files f WHERE f.dir = d.id) LIMIT 1"
        ).fetchone()
        if row:
            raise fail(
                path, f"directory {row[0]} is empty (format version 1 has no empty directories)"
            )
    dir_max, long_dir = conn.execute(
        f"{_DIR_PATH_LENGTHS} SELECT max(len), min(CASE WHEN len > {PATH_MAX} THEN id END) FROM p"
    ).fetchone()
    if long_dir is not None:
        raise fail(path, f"directory {long_dir}: path longer than {PATH_MAX} bytes")

    # One pass over the files, in id ranges of _CHUNK_ROWS rows (~0.3 µs a row): the total
    # size, the first row whose types code relies on are wrong, and every name and location
    # key decoded as UTF-8. SQLite never checks
    # TEXT, and a per-row SQL function would cost ten times more, so each range's text is
    # concatenated by SQLite and decoded at once by Python; only a failing range is searched
    # row by row. The id range is checked first, so the loop covers exactly the rows.
    count, low, high = conn.execute("SELECT count(*), min(id), max(id) FROM files").fetchone()
    if count != int(meta["file_count"]):
        raise fail(path, f"meta file_count {meta['file_count']} but {count} files")
    if count and (low != dir_count + 1 or high != dir_count + count):
        raise fail(path, f"file ids are not {dir_count + 1}..{dir_count + count}")
    total = 0
    for start in range(dir_count + 1, dir_count + count + 1, _CHUNK_ROWS):
        window = {"dirs": dir_count, "lo": start, "hi": start + _CHUNK_ROWS}
        try:
            part, bad_type, names, keys = conn.execute(_FILES_CHUNK, window).fetchone()
        except sqlite3.OperationalError as exc:
            if "overflow" not in str(exc):
                raise
            raise fail(path, "file sizes overflow a 64-bit total") from None
        if type(part) is not int and bad_type is None:  # sum() is a float if a size is not an int
            (bad_type,) = conn.execute(
                "SELECT min(id) FROM files WHERE id >= :lo AND id < :hi "
                "AND typeof(size) != 'integer'",
                window,
            ).fetchone()
        if bad_type is not None:
            (problem,) = conn.execute(
                f"SELECT {_FILE_PROBLEM} FROM files WHERE id = :id",
                {"dirs": dir_count, "id": bad_type},
            ).fetchone()
            raise fail(path, f"file {bad_type}: {problem or 'a value has the wrong SQL type'}")
        try:
            names.decode("utf-8")
            if keys is not None:
                keys.decode("utf-8")
        except UnicodeDecodeError:
            row = conn.execute(_FIRST_BAD_TEXT, window).fetchone()
            if row is None:  # a BLOB key: not text at all
                raise fail(path, "a location key is not text") from None
            what = "name" if row[1] else "location key"
            raise fail(path, f"file {row[0]}: {what} is not valid UTF-8") from None
        total += part
    if total >= 1 << 63:
        raise fail(path, "file sizes overflow a 64-bit total")
    if total != int(meta["total_bytes"]):
        raise fail(path, f"meta total_bytes {meta['total_bytes']} but files sum to {total}")
    if count and dir_max + 1 + NAME_MAX > PATH_MAX:
        # Only a tree deeper than PATH_MAX - NAME_MAX bytes pays for this join; elsewhere a
        # file path can only be too long with a name over NAME_MAX, which the per-row check
        # refuses.
        row = conn.execute(
            f"{_DIR_PATH_LENGTHS} SELECT f.id FROM files f JOIN p ON p.id = f.dir "
            f"WHERE p.len + 1 + length(CAST(f.name AS BLOB)) > {PATH_MAX} LIMIT 1"
        ).fetchone()
        if row:
            raise fail(path, f"file {row[0]}: path longer than {PATH_MAX} bytes")


def check_file_rows(path: str, conn: sqlite3.Connection, meta: dict[str, str]) -> None:
    """Check every file row in SQL (one scan; ~2 s for 1.3M files on a slow 2-core machine).

    :class:`digests.digest.Digest` also checks each row it returns with :func:`file_row_problem`,
    so a mount that skips this scan still never serves a bad row.
    """
    dir_count = int(meta["dir_count"])
    (bad,) = conn.execute(
        f"SELECT min(CASE WHEN {_FILE_PROBLEM} IS NOT NULL THEN id END) FROM files",
        {"dirs": dir_count},
    ).fetchone()
    if bad is not None:
        (problem,) = conn.execute(
            f"SELECT {_FILE_PROBLEM} FROM files WHERE id = :id", {"dirs": dir_count, "id": bad}
        ).fetchone()
        raise fail(path, f"file {bad}: {problem}")


def file_row_problem(row: tuple, sources: dict[int, str], dir_count: int) -> str | None:
    """Python twin of the SQL file-row rules, for one row of ``files`` (all columns, in order).

    About 1 µs: cheap enough to run on every row a mount serves.
    """
    file_id, dir_id, name, size, content_hash, source, key, offset, length = row
    if type(dir_id) is not int or not 1 <= dir_id <= dir_count:
        return f"unknown directory {dir_id!r}"
    if type(name) is not str:
        return "name is not text"
    problem = name_problem(name)
    if problem:
        return problem
    if type(size) is not int or size < 0:
        return f"negative or non-integer size {size!r}"
    if type(content_hash) is not bytes or len(content_hash) != 32:
        return "content hash is not 32 bytes"
    if source not in sources or type(source) is not int:
        return f"location points to unknown source {source!r}"
    if key is not None and (type(key) is not str or path_problem(key)):
        return f"location key {key!r} is not a relative path"
    if type(offset) is not int or offset < 0:
        return f"negative or non-integer location offset {offset!r}"
    if type(length) is not int or length != size:
        return f"size {size!r} differs from location length {length!r}"
    return None


def check_dataset_id(path: str, conn: sqlite3.Connection, meta: dict[str, str]) -> None:
    """Run SQLite's quick_check and recompute the dataset id (seconds for a million files)."""
    (result,) = conn.execute("PRAGMA quick_check(1)").fetchone()
    if result != "ok":
        raise fail(path, f"corrupted: {result}")
    actual = compute_dataset_id(conn)
    if actual != meta["dataset_id"]:
        raise fail(
            path,
            f"dataset id in meta {meta['dataset_id'][:16]}... does not match content "
            f"{actual[:16]}...",
        )
