"""Packed datasets for tests and benchmarks: files in tar chunks, and their digests.

A packed digest names each file by (chunk key, offset of its data in the tar), as ``digests
pack`` writes them (docs/digest-format.md); a loose one names each file's own object. Both
are written with :func:`digests.write.write_digest`, so a test can put the same files in a
bucket both ways and compare what mountd fetches (one ranged GET a chunk, or one a file).
"""

from __future__ import annotations

import io
import os
import tarfile
from collections.abc import Sequence
from dataclasses import dataclass

import blake3

from digests.write import NewFile, write_digest


@dataclass(frozen=True)
class PackedFile:
    """One file of a packed dataset: where its bytes sit in which chunk object."""

    path: str
    data: bytes
    hash: bytes
    key: str
    offset: int


def tar_chunk(members: Sequence[tuple[str, bytes]]) -> tuple[bytes, list[int]]:
    """A tar (ustar) of ``members`` (name, bytes) and the offset of each member's data."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    raw = buf.getvalue()
    with tarfile.open(fileobj=io.BytesIO(raw), mode="r") as tar:
        offsets = {m.name: m.offset_data for m in tar.getmembers()}
    return raw, [offsets[name] for name, _ in members]


def pack(files: Sequence[tuple[str, bytes]], per_chunk: int,
         prefix: str = "chunks/") -> tuple[dict[str, bytes], list[PackedFile]]:
    """Split ``files`` into tar chunks of ``per_chunk`` members, in order: the objects to
    upload (key → bytes) and every file's place."""
    objects: dict[str, bytes] = {}
    placed: list[PackedFile] = []
    for n, first in enumerate(range(0, len(files), per_chunk)):
        group = files[first : first + per_chunk]
        key = f"{prefix}chunk-{n:05d}.tar"
        objects[key], offsets = tar_chunk(group)
        for (path, data), offset in zip(group, offsets, strict=True):
            placed.append(PackedFile(path, data, blake3.blake3(data).digest(), key, offset))
    return objects, placed


def packed_digest(out: str | os.PathLike[str], url: str, placed: Sequence[PackedFile]) -> str:
    """Write the digest of a packed dataset at ``url``; its dataset id."""
    return write_digest(
        out, [NewFile(p.path, len(p.data), p.hash, 0, p.key, p.offset) for p in placed], [url])


def loose_digest(out: str | os.PathLike[str], url: str, files: Sequence[tuple[str, bytes]]) -> str:
    """Write the digest of the same files stored one object each (key = path) at ``url``."""
    return write_digest(
        out, [NewFile(path, len(data), blake3.blake3(data).digest(), 0, None, 0)
              for path, data in files], [url])
