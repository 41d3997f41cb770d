"""Reading a digest: ``Digest.open(path)`` validates it and answers the mount's questions.

>>> with Digest.open("imagenet.qd") as d:                       # doctest: +SKIP
...     entry = d.lookup_path("train/n01440764/n01440764_10026.JPEG")
...     page = d.listdir(ROOT_ID, after=None, limit=1000)

Thread-safety: a :class:`Digest` wraps one ``sqlite3`` connection and must be used from the
thread that opened it (sqlite3's ``check_same_thread``). A process that needs the digest in
several threads opens one :class:`Digest` per thread; the file is immutable, so they never
disagree. Nothing here blocks for long: every call is one or two indexed B-tree searches
(plus a few more for an uncached directory path), so calling it from the trio thread is fine.

Memory: rows are read on demand; the only cache is directory id → path for the directories
actually touched, bounded by :data:`DIR_PATH_CACHE_BYTES` (paths are at most 4096 bytes, so a
deep tree cannot make it grow with the square of its depth).
"""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar
from urllib.parse import quote

import blake3

from digests import validate
from digests.canonical import empty_dir_paths, iter_canonical
from digests.errors import DigestError
from digests.paths import path_problem
from digests.schema import ROOT_ID
from quiverfs.base.backends.base import Location
from quiverfs.base.errors import UsageError

#: Validation levels of :meth:`Digest.open`, cheapest first.
CHECKS = ("structure", "rows", "full")

#: Bytes of the file SQLite may memory-map once validated (lookups then avoid read() calls).
DEFAULT_MMAP = 1 << 30

#: Budget of the directory path cache, in bytes of path plus a per-entry overhead: ~40,000
#: ImageNet-like directories. Past it the oldest entries go (a miss costs one indexed read per
#: uncached ancestor).
DIR_PATH_CACHE_BYTES = 4 << 20
_CACHE_ENTRY_OVERHEAD = 100

_FILE_COLUMNS = "id, dir, name, size, hash, loc_source, loc_key, loc_offset, loc_length"


@dataclass(frozen=True, slots=True)
class DirEntry:
    """A directory: ``id`` is its inode number (1 = root), ``parent`` 0 for the root."""

    is_dir: ClassVar[bool] = True
    id: int
    parent: int
    name: str
    path: str  #: relative path, ``""`` for the root


@dataclass(frozen=True, slots=True)
class FileEntry:
    """A regular file: ``id`` is its inode number; ``hash`` the 32-byte blake3 of its content."""

    is_dir: ClassVar[bool] = False
    id: int
    parent: int
    name: str
    path: str  #: relative POSIX path
    size: int
    hash: bytes
    location: Location


Entry = FileEntry | DirEntry


def _identity(path: str) -> tuple[int, int, int, int]:
    """What tells one digest file from another at the same path (builds rename over it)."""
    st = os.stat(path)
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def _db_error(path: str, exc: sqlite3.Error) -> DigestError:
    if "decode to UTF-8" in str(exc):  # Python's sqlite3 met TEXT bytes it cannot decode
        return DigestError(f"invalid digest {path}: text that is not valid UTF-8")
    return DigestError(f"invalid digest {path}: corrupted ({exc})")


class Digest:
    """One open, validated digest. Use :meth:`open`; close with :meth:`close` or ``with``."""

    def __init__(
        self, path: str, conn: sqlite3.Connection, meta: dict[str, str], sources: dict[int, str]
    ) -> None:
        self.path = path
        self._conn = conn
        self._meta = meta
        self._sources = sources
        self._dir_count = int(meta["dir_count"])
        #: directory id → relative path, oldest first (dicts keep insertion order); the root
        #: is not in it. Bounded by DIR_PATH_CACHE_BYTES, counted in ``_dir_paths_bytes``.
        self._dir_paths: dict[int, str] = {}
        self._dir_paths_bytes = 0
        self._identity = _identity(path)

    # -- opening -------------------------------------------------------------------------

    @classmethod
    def open(
        cls,
        path: str | os.PathLike[str],
        *,
        check: str = "structure",
        validated_cache: str | os.PathLike[str] | None = None,
        mmap_size: int = DEFAULT_MMAP,
    ) -> Digest:
        """Open and validate the digest at ``path`` read-only.

        ``check`` picks how much is checked up front (costs for 1.3M files in
        docs/digest-format.md):

        ``"structure"``  (default) file type, header, schema, meta, sources, every
                         directory row, path lengths, counts, total size, id ranges, and in
                         every file row the SQL types and UTF-8 text that code reads without
                         the per-row check (~0.9 s). Every file row is still checked in
                         Python when it is returned, so a bad row is refused when touched
                         instead of at open. What the mount needs (<= 2 s).
        ``"rows"``       also every file row, in one SQL scan (~2.3 s); the CLI's default.
        ``"full"``       also SQLite's quick_check and the recomputed dataset id (~5 s).

        With ``validated_cache`` (a directory the caller owns), a file whose content (blake3
        of the whole file, ~0.1 s) already passed ``"full"`` is not scanned again, and one
        that passes ``"full"`` here is remembered (``"rows"`` then costs no scan either).

        Raises :class:`UsageError` when the file cannot be opened and :class:`DigestError`
        when it is not a valid digest.
        """
        if check not in CHECKS:
            raise ValueError(f"check must be one of {', '.join(CHECKS)}: {check!r}")
        path = os.fspath(path)
        if not os.path.exists(path):
            raise UsageError(f"no such digest file: {path}")
        if os.path.isdir(path):
            raise UsageError(f"digest path is a directory: {path}")
        validate.check_header(path)  # before any open: refuses FIFOs, sockets, devices
        # immutable=1: digests are never modified in place (builds rename a new file over
        # the old name, and an open file keeps its inode), so SQLite may skip locking and
        # change detection. check_header has already refused WAL files.
        uri = f"file:{quote(os.path.abspath(path))}?mode=ro&immutable=1"
        try:
            conn = sqlite3.connect(uri, uri=True)
        except sqlite3.Error as exc:
            raise _db_error(path, exc) from None
        try:
            # Validate with plain reads and a small page cache so the scans do not inflate
            # RSS; map the file only afterwards, for the lookups.
            conn.execute("PRAGMA mmap_size = 0")
            validate.register_functions(conn)
            meta, sources = validate.check_structure(path, conn)
            validate.check_tree(path, conn, meta)
            marker = None
            if validated_cache is not None and check != "structure":
                marker = Path(validated_cache) / f"{_file_hash(path)}.ok"
                if marker.exists() and marker.read_text().strip() == meta["dataset_id"]:
                    check = "structure"  # this exact content passed "full" before
            if check in ("rows", "full"):
                validate.check_file_rows(path, conn, meta)
            if check == "full":
                validate.check_dataset_id(path, conn, meta)
                if marker is not None:
                    marker.parent.mkdir(parents=True, exist_ok=True)
                    tmp = marker.with_suffix(f".tmp{os.getpid()}")
                    tmp.write_text(meta["dataset_id"] + "\n")
                    tmp.rename(marker)
            conn.execute(f"PRAGMA mmap_size = {int(mmap_size)}")
        except sqlite3.Error as exc:
            conn.close()
            raise _db_error(path, exc) from None
        except BaseException:
            conn.close()
            raise
        return cls(path, conn, meta, sources)

    def reopen(self, *, mmap_size: int = DEFAULT_MMAP) -> Digest:
        """A second, independent connection to this already validated digest, without
        checking it again: for another process (a SQLite connection must not cross a fork)
        or thread. Raises :class:`DigestError` if the file at :attr:`path` is no longer the
        one that was validated (replaced since)."""
        if _identity(self.path) != self._identity:
            raise DigestError(f"digest {self.path} was replaced after it was opened")
        uri = f"file:{quote(os.path.abspath(self.path))}?mode=ro&immutable=1"
        try:
            conn = sqlite3.connect(uri, uri=True)
            conn.execute(f"PRAGMA mmap_size = {int(mmap_size)}")
        except sqlite3.Error as exc:
            raise _db_error(self.path, exc) from None
        return Digest(self.path, conn, dict(self._meta), dict(self._sources))

    def close(self) -> None:
        """Close the connection; the object is unusable afterwards."""
        self._conn.close()

    def __enter__(self) -> Digest:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- what the digest says about itself -------------------------------------------------

    @property
    def dataset_id(self) -> str:
        """64 hex digits identifying the canonical content (see digests/canonical.py)."""
        return self._meta["dataset_id"]

    @property
    def format_version(self) -> int:
        return int(self._meta["format_version"])

    @property
    def created_at(self) -> str:
        """UTC creation time, ``YYYY-MM-DDTHH:MM:SSZ``."""
        return self._meta["created_at"]

    @property
    def sources(self) -> dict[int, str]:
        """Source id → backend root URL."""
        return dict(self._sources)

    @property
    def file_count(self) -> int:
        return int(self._meta["file_count"])

    @property
    def dir_count(self) -> int:
        """Directories, the root included."""
        return self._dir_count

    @property
    def total_bytes(self) -> int:
        return int(self._meta["total_bytes"])

    @property
    def meta(self) -> dict[str, str]:
        """The whole meta table."""
        return dict(self._meta)

    # -- lookups ---------------------------------------------------------------------------

    def entry(self, entry_id: int) -> Entry | None:
        """The directory or file with inode number ``entry_id``, or ``None``."""
        try:
            if entry_id <= self._dir_count:
                row = self._conn.execute(
                    "SELECT id, parent, name FROM dirs WHERE id = ?", (entry_id,)
                ).fetchone()
                return self._dir(row) if row else None
            row = self._conn.execute(
                f"SELECT {_FILE_COLUMNS} FROM files WHERE id = ?", (entry_id,)
            ).fetchone()
            return self._file(row) if row else None
        except sqlite3.Error as exc:
            raise _db_error(self.path, exc) from None

    def files_between(self, first_id: int, last_id: int) -> list[FileEntry]:
        """The files with ids ``first_id .. last_id``, in id order (digest order: see
        digests/schema.py): one primary-key range scan. The mount's read-ahead asks for the
        files that follow the one being read this way."""
        try:
            rows = self._conn.execute(
                f"SELECT {_FILE_COLUMNS} FROM files WHERE id BETWEEN ? AND ? ORDER BY id",
                (first_id, last_id),
            ).fetchall()
        except sqlite3.Error as exc:
            raise _db_error(self.path, exc) from None
        return [self._file(row) for row in rows]

    def lookup(self, parent_id: int, name: str) -> Entry | None:
        """The entry called ``name`` in directory ``parent_id``, or ``None``."""
        if "\0" in name or not name.isprintable() and _unencodable(name):
            return None
        try:
            row = self._conn.execute(
                f"SELECT {_FILE_COLUMNS} FROM files WHERE dir = ? AND name = ?", (parent_id, name)
            ).fetchone()
            if row:
                return self._file(row)
            row = self._conn.execute(
                "SELECT id, parent, name FROM dirs WHERE parent = ? AND name = ?",
                (parent_id, name),
            ).fetchone()
            return self._dir(row) if row else None
        except sqlite3.Error as exc:
            raise _db_error(self.path, exc) from None

    def content(self, parent_id: int, name: str) -> tuple[int, bytes] | None:
        """``(size, hash)`` of the file called ``name`` in directory ``parent_id``, or ``None``
        (no such file, or a row whose size or hash is malformed).

        For hot paths that open content by hash and need nothing else (the direct loader,
        quiverfs/client/direct.py): one indexed read and no :class:`Location`. Only the two columns
        it returns are checked; :meth:`lookup` checks the whole row.
        """
        if "\0" in name or not name.isprintable() and _unencodable(name):
            return None
        try:
            row = self._conn.execute(
                "SELECT size, hash FROM files WHERE dir = ? AND name = ?", (parent_id, name)
            ).fetchone()
        except sqlite3.Error as exc:
            raise _db_error(self.path, exc) from None
        return row if row is not None and _content_ok(row[0], row[1]) else None

    def dir_contents(self, dir_id: int) -> list[tuple[str, int, bytes]]:
        """``(name, size, hash)`` of every file directly in directory ``dir_id``, in name
        order: one index range scan, for a caller that keeps a directory's mapping in memory
        (the direct loader). Rows whose size or hash is malformed are left out (their files
        then read through the mount, which reports the damaged row)."""
        try:
            rows = self._conn.execute(
                "SELECT name, size, hash FROM files WHERE dir = ? ORDER BY id", (dir_id,)
            ).fetchall()
        except sqlite3.Error as exc:
            raise _db_error(self.path, exc) from None
        return [row for row in rows if type(row[0]) is str and _content_ok(row[1], row[2])]

    def lookup_path(self, path: str) -> Entry | None:
        """The entry at relative POSIX ``path`` (``""`` = root), or ``None`` (also for invalid paths)."""
        if path in ("", "/"):
            return self.entry(ROOT_ID)
        path = path.strip("/")
        if path_problem(path):
            return None
        *dirs, last = path.split("/")
        parent = ROOT_ID
        try:
            for name in dirs:
                row = self._conn.execute(
                    "SELECT id FROM dirs WHERE parent = ? AND name = ?", (parent, name)
                ).fetchone()
                if row is None:
                    return None
                parent = row[0]
        except sqlite3.Error as exc:
            raise _db_error(self.path, exc) from None
        return self.lookup(parent, last)

    def listdir(self, dir_id: int, after: int | None = None, limit: int = 1024) -> list[Entry]:
        """Up to ``limit`` entries of directory ``dir_id`` following entry id ``after``.

        Order: subdirectories by name, then files by name (which is also ascending id order).
        Page with ``after=page[-1].id`` until a page comes back empty; each page costs one
        index range scan, so a million-entry directory pages as fast as a small one.
        ``after`` is what FUSE ``readdir`` carries as its offset. Raises ``ValueError`` if
        ``after`` is not an entry of ``dir_id``.
        """
        if limit <= 0:
            return []
        out: list[Entry] = []
        try:
            conn = self._conn
            if after is None or after <= self._dir_count:
                args: tuple = (dir_id,)
                sql = "SELECT id, parent, name FROM dirs WHERE parent = ?"
                if after is not None:
                    row = conn.execute(
                        "SELECT parent, name FROM dirs WHERE id = ?", (after,)
                    ).fetchone()
                    if row is None or row[0] != dir_id:
                        raise ValueError(f"entry {after} is not in directory {dir_id}")
                    sql += " AND name > ?"
                    args = (dir_id, row[1])
                rows = conn.execute(sql + " ORDER BY name LIMIT ?", (*args, limit)).fetchall()
                out.extend(self._dir(row) for row in rows)
                after_name = None
            else:
                row = conn.execute("SELECT dir, name FROM files WHERE id = ?", (after,)).fetchone()
                if row is None or row[0] != dir_id:
                    raise ValueError(f"entry {after} is not in directory {dir_id}")
                after_name = row[1]
            if len(out) < limit:
                sql = f"SELECT {_FILE_COLUMNS} FROM files WHERE dir = ?"
                args = (dir_id,)
                if after_name is not None:
                    sql += " AND name > ?"
                    args = (dir_id, after_name)
                rows = conn.execute(
                    sql + " ORDER BY name LIMIT ?", (*args, limit - len(out))
                ).fetchall()
                out.extend(self._file(row) for row in rows)
        except sqlite3.Error as exc:
            raise _db_error(self.path, exc) from None
        return out

    def iter_files(self) -> Iterator[FileEntry]:
        """Every file in canonical path order (component-wise by UTF-8 bytes), streaming."""
        conn = self._conn
        try:
            for _path, file_id, _size, _hash in iter_canonical(conn):
                row = conn.execute(
                    f"SELECT {_FILE_COLUMNS} FROM files WHERE id = ?", (file_id,)
                ).fetchone()
                yield self._file(row)
        except sqlite3.Error as exc:
            raise _db_error(self.path, exc) from None

    def iter_canonical(self) -> Iterator[tuple[str, int, bytes]]:
        """``(path, size, hash)`` of every file in canonical order (cheaper than iter_files)."""
        try:
            for path, _id, size, content_hash in iter_canonical(self._conn):
                yield path, size, content_hash
        except sqlite3.Error as exc:
            raise _db_error(self.path, exc) from None

    def largest_files(self, n: int = 10) -> list[FileEntry]:
        """The ``n`` largest files (one scan of the files table)."""
        try:
            rows = self._conn.execute(
                f"SELECT {_FILE_COLUMNS} FROM files ORDER BY size DESC, id LIMIT ?", (n,)
            ).fetchall()
        except sqlite3.Error as exc:
            raise _db_error(self.path, exc) from None
        return [self._file(row) for row in rows]

    def largest_dirs(self, n: int = 10) -> list[tuple[DirEntry, int]]:
        """The ``n`` directories holding the most files directly, with their file counts."""
        try:
            rows = self._conn.execute(
                "SELECT dir, count(*) AS c FROM files GROUP BY dir ORDER BY c DESC, dir LIMIT ?",
                (n,),
            ).fetchall()
        except sqlite3.Error as exc:
            raise _db_error(self.path, exc) from None
        return [(self.entry(dir_id), count) for dir_id, count in rows]  # type: ignore[misc]

    def empty_dirs(self) -> list[str]:
        """Paths of the directories that hold nothing, in canonical order (format 2 only)."""
        try:
            return empty_dir_paths(self._conn)
        except sqlite3.Error as exc:
            raise _db_error(self.path, exc) from None

    # -- rows to entries -----------------------------------------------------------------

    def dir_path(self, dir_id: int) -> str:
        """Relative path of directory ``dir_id`` (``""`` for the root); cached, bounded."""
        if dir_id == ROOT_ID:
            return ""
        paths = self._dir_paths
        cached = paths.get(dir_id)
        if cached is not None:
            return cached
        chain: list[tuple[int, str]] = []
        walk = dir_id
        result = ""
        while walk != ROOT_ID:
            cached = paths.get(walk)
            if cached is not None:
                result = cached
                break
            row = self._conn.execute(
                "SELECT parent, name FROM dirs WHERE id = ?", (walk,)
            ).fetchone()
            # Validation guarantees 0 < parent < id, so this walk ends at the root.
            if row is None or len(chain) > self._dir_count:
                raise DigestError(f"invalid digest {self.path}: no directory {walk}")
            chain.append((walk, row[1]))
            walk = row[0]
        for node, name in reversed(chain):
            result = f"{result}/{name}" if result else name
            self._remember_dir_path(node, result)
        return result

    def _remember_dir_path(self, dir_id: int, path: str) -> None:
        """Cache ``path``; past the byte budget, forget the oldest entries (ancestors of a
        deep walk are inserted first, so they go first)."""
        paths = self._dir_paths
        paths[dir_id] = path
        self._dir_paths_bytes += len(path) + _CACHE_ENTRY_OVERHEAD
        while self._dir_paths_bytes > DIR_PATH_CACHE_BYTES and len(paths) > 1:
            oldest = next(iter(paths))
            self._dir_paths_bytes -= len(paths.pop(oldest)) + _CACHE_ENTRY_OVERHEAD

    def _dir(self, row: tuple) -> DirEntry:
        dir_id, parent, name = row
        return DirEntry(dir_id, parent, name, self.dir_path(dir_id) if dir_id != ROOT_ID else "")

    def _file(self, row: tuple) -> FileEntry:
        problem = validate.file_row_problem(row, self._sources, self._dir_count)
        if problem:
            raise DigestError(f"invalid digest {self.path}: file {row[0]}: {problem}")
        file_id, parent, name, size, content_hash, source, key, offset, length = row
        prefix = self.dir_path(parent)
        path = f"{prefix}/{name}" if prefix else name
        location = Location(self._sources[source], path if key is None else key, offset, length)
        return FileEntry(file_id, parent, name, path, size, content_hash, location)


def _file_hash(path: str) -> str:
    hasher = blake3.blake3(max_threads=blake3.blake3.AUTO)
    hasher.update_mmap(path)
    return hasher.hexdigest()


def _content_ok(size: object, content_hash: object) -> bool:
    """Whether a row's size and hash have the types and lengths the format says."""
    return type(size) is int and size >= 0 and type(content_hash) is bytes and len(content_hash) == 32


def _unencodable(name: str) -> bool:
    """True for names with lone surrogates (undecodable bytes), which no digest can hold."""
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False
