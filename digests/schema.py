"""The canonical schema of a digest file (format version 2). docs/digest-format.md explains it.

A digest is a SQLite database that is written once and never changed. Its ids become inode
numbers in the mount, so they follow fixed rules:

* directories have ids ``1 .. dir_count`` (``1`` is the root, FUSE's ``ROOT_ID``), assigned in
  canonical pre-order (children sorted by name bytes), so a parent's id is below its child's;
* files have ids ``dir_count + 1 .. dir_count + file_count``, assigned in ``(dir, name)`` order,
  so a directory's files are one contiguous id range, in name order.

Directories come from the files' paths, plus the empty directories of the source (a
``file://`` tree's empty folders, a bucket's directory markers). Version 1 had only the
former (every directory except the root holds a file somewhere below it); version 2 allows
directories that hold nothing, and is otherwise the same, so version 1 files are still read.
"""

from __future__ import annotations

import sqlite3

#: The format version this code writes.
FORMAT_VERSION = 2

#: The format versions this code reads: 1 differs only in refusing empty directories.
READ_VERSIONS = (1, 2)

#: SQLite header ``application_id`` of a digest ("QVDG"); other SQLite files are refused early.
APPLICATION_ID = 0x51564447

#: Id of the root directory (FUSE ``ROOT_ID``).
ROOT_ID = 1

#: Keys of the ``meta`` table, every one required.
META_KEYS = ("format_version", "created_at", "dataset_id", "file_count", "dir_count", "total_bytes")

TABLES = {
    "meta": """
CREATE TABLE meta (
    -- One row per key; every value is TEXT:
    --   format_version  decimal integer: 2 (empty directories allowed) or 1 (none)
    --   created_at      UTC creation time, ISO 8601 "YYYY-MM-DDTHH:MM:SSZ" (not in the id)
    --   dataset_id      64 lower-case hex digits: see digests/canonical.py
    --   file_count      decimal, = count(*) of files
    --   dir_count       decimal, = count(*) of dirs (the root included, so >= 1)
    --   total_bytes     decimal, = sum(files.size)
    --   generator       optional, free text naming the program that wrote the file
    key   TEXT PRIMARY KEY NOT NULL,
    value TEXT NOT NULL
) WITHOUT ROWID""",
    "sources": """
CREATE TABLE sources (
    -- Where file contents can be read: one row per backend root URL.
    id  INTEGER PRIMARY KEY,   -- 1, 2, ...; referenced by files.loc_source
    url TEXT NOT NULL UNIQUE   -- normalised root URL (quiverfs.base.backends.normalize_url), no
                               -- trailing '/', never credentials: s3://bucket/prefix, file:///x
)""",
    "dirs": """
CREATE TABLE dirs (
    -- Every directory of the tree: the parents of files, and (version 2) directories that
    -- hold nothing (empty folders, bucket directory markers). Becomes the mount's inodes.
    id     INTEGER PRIMARY KEY,  -- 1 .. dir_count, 1 = root; pre-order, so parent < id
    parent INTEGER NOT NULL,     -- id of the parent directory; 0 = none (the root only)
    name   TEXT NOT NULL         -- one path component (UTF-8, no '/', no NUL, not '.'/'..',
                                 -- <= 255 bytes); '' for the root only. A directory's
                                 -- whole path is at most 4096 bytes (paths.PATH_MAX).
)""",
    "files": """
CREATE TABLE files (
    -- Every regular file. The location says where its bytes are: it may point into a larger
    -- object (a tar shard) with loc_offset > 0.
    id         INTEGER PRIMARY KEY, -- dir_count+1 .. dir_count+file_count, in (dir, name) order
    dir        INTEGER NOT NULL,    -- dirs.id of the containing directory
    name       TEXT NOT NULL,       -- one path component, same rules as dirs.name, never '';
                                    -- the whole path is at most 4096 bytes
    size       INTEGER NOT NULL,    -- bytes, >= 0
    hash       BLOB NOT NULL,       -- blake3-256 of the content: exactly 32 bytes
    loc_source INTEGER NOT NULL,    -- sources.id of the backend root holding the bytes
    loc_key    TEXT,                -- object key relative to that root; NULL = the file's own
                                    -- relative path (the common case; saves ~40 bytes a row)
    loc_offset INTEGER NOT NULL,    -- byte offset of the content inside the object, >= 0
    loc_length INTEGER NOT NULL     -- bytes to read from loc_offset; always = size
)""",
}

INDEXES = {
    # lookup(parent, name) and paged listing of subdirectories in name order.
    "dirs_by_name": "CREATE UNIQUE INDEX dirs_by_name ON dirs (parent, name)",
    # lookup(dir, name), paged listing of files in name order, and no duplicate paths.
    "files_by_name": "CREATE UNIQUE INDEX files_by_name ON files (dir, name)",
}

#: What a valid file's schema looks like, as PRAGMA table_info gives it: (name, type, notnull, pk).
EXPECTED_COLUMNS: dict[str, list[tuple[str, str, int, int]]] = {
    "meta": [("key", "TEXT", 1, 1), ("value", "TEXT", 1, 0)],
    "sources": [("id", "INTEGER", 0, 1), ("url", "TEXT", 1, 0)],
    "dirs": [("id", "INTEGER", 0, 1), ("parent", "INTEGER", 1, 0), ("name", "TEXT", 1, 0)],
    "files": [
        ("id", "INTEGER", 0, 1),
        ("dir", "INTEGER", 1, 0),
        ("name", "TEXT", 1, 0),
        ("size", "INTEGER", 1, 0),
        ("hash", "BLOB", 1, 0),
        ("loc_source", "INTEGER", 1, 0),
        ("loc_key", "TEXT", 0, 0),
        ("loc_offset", "INTEGER", 1, 0),
        ("loc_length", "INTEGER", 1, 0),
    ],
}

#: Unique indexes a valid file must have: name → (table, columns).
EXPECTED_INDEXES: dict[str, tuple[str, list[str]]] = {
    "dirs_by_name": ("dirs", ["parent", "name"]),
    "files_by_name": ("files", ["dir", "name"]),
}


def create_tables(conn: sqlite3.Connection) -> None:
    """Create the tables (not the indexes: build them after bulk inserts, see create_indexes)."""
    conn.execute(f"PRAGMA application_id = {APPLICATION_ID}")
    for ddl in TABLES.values():
        conn.execute(ddl)


def create_indexes(conn: sqlite3.Connection) -> None:
    """Create the indexes; cheaper and more compact once the rows are in."""
    for ddl in INDEXES.values():
        conn.execute(ddl)
