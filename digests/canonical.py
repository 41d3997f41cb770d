"""The canonical content of a digest and its dataset id.

Canonical content is the list of files, each as (relative path, size, blake3 hash), in
canonical order: paths compared component by component as UTF-8 byte strings (Python:
``sorted(paths, key=lambda p: p.encode().split(b"/"))``). Locations, sources, ids and the
creation time are not part of it, so the same data gives the same id wherever it is stored.

``dataset_id = blake3(DOMAIN || record || record || ...)`` as 64 lower-case hex digits, where
``record = utf8(path) || 0x00 || size as 8-byte big-endian unsigned || hash (32 bytes)``.
Paths never contain NUL, so the encoding is unambiguous.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterable, Iterator

import blake3

from digests.schema import ROOT_ID

#: Domain separation prefix of the dataset id hash (format version 1).
DOMAIN = b"quiverfs-dataset-v1\n"

_FILES = "SELECT id, name, size, hash FROM files WHERE dir = ?"


def iter_canonical(conn: sqlite3.Connection) -> Iterator[tuple[str, int, int, bytes]]:
    """``(path, file id, size, hash)`` for every file of a digest, in canonical order.

    Streams: at any time it holds one directory's subdirectory list and a stack as deep as
    the tree, never all files. Pre-order over directories; inside one directory, the files
    that sort between two subdirectories come out between them, which is exactly component
    order. Assumes a digest that passed structural validation (no name is both a file and a
    directory in one parent).
    """
    # Stack items: ("dir", dir_id, prefix) or ("files", dir_id, prefix, low, high), where the
    # files wanted have low < name < high (None = unbounded).
    stack: list[tuple] = [("dir", ROOT_ID, "")]
    while stack:
        item = stack.pop()
        if item[0] == "dir":
            _, dir_id, prefix = item
            subdirs = conn.execute(
                "SELECT id, name FROM dirs WHERE parent = ? ORDER BY name", (dir_id,)
            ).fetchall()
            names = [None] + [name for _, name in subdirs] + [None]
            todo: list[tuple] = []
            for i, (sub_id, sub_name) in enumerate(subdirs):
                todo.append(("files", dir_id, prefix, names[i], sub_name))
                todo.append(("dir", sub_id, f"{prefix}{sub_name}/"))
            todo.append(("files", dir_id, prefix, names[-2], None))
            stack.extend(reversed(todo))
            continue
        _, dir_id, prefix, low, high = item
        sql, args = _FILES, [dir_id]
        if low is not None:
            sql += " AND name > ?"
            args.append(low)
        if high is not None:
            sql += " AND name < ?"
            args.append(high)
        for file_id, name, size, digest in conn.execute(sql + " ORDER BY name", args):
            yield prefix + name, file_id, size, digest


def record(path: str, size: int, content_hash: bytes) -> bytes:
    """The canonical record of one file (see the module docstring)."""
    return path.encode("utf-8") + b"\0" + size.to_bytes(8, "big") + content_hash


def dataset_id_of(files: Iterable[tuple[str, int, bytes]]) -> str:
    """The dataset id of ``(path, size, hash)`` triples already in canonical order."""
    hasher = blake3.blake3(DOMAIN)
    batch: list[bytes] = []
    for path, size, content_hash in files:
        batch.append(record(path, size, content_hash))
        if len(batch) >= 4096:
            hasher.update(b"".join(batch))
            batch.clear()
    hasher.update(b"".join(batch))
    return hasher.hexdigest()


def compute_dataset_id(conn: sqlite3.Connection) -> str:
    """Recompute the dataset id of an open digest from its rows (about 1.5 µs a file)."""
    return dataset_id_of((path, size, h) for path, _, size, h in iter_canonical(conn))
