"""Which files of a dataset share a remote object: the *chunks* of a packed dataset.

A packed dataset (``digests pack``, or ``digests build --tar members``; docs/digest-format.md)
keeps many small files in one object, a tar *chunk*: each file's location is the chunk's key
plus an offset. Brand (../shared/papers/brand-batched-random-access.txt §3) reads such files a
chunk at a time: one ranged GET brings every member, where one GET per file would be bound by
the request latency. mountd needs, for a file it is about to fetch, the other members of its
chunk (to fetch them in the same request) and, for its claim policy, the chunks as units.

:class:`Packing` holds that map for one dataset in compact ids (``0..N-1``, digest order; see
:mod:`mountd.coop.datasets`), compact enough for 1.3M files (~12 bytes a packed file):

* ``chunk_of[cid]``: the chunk of compact id ``cid``, or ``-1`` for a loose file (the only
  file of its object);
* chunk ``k``'s members are ``members[starts[k]:starts[k + 1]]``, in offset order, and
  ``offsets[j]`` is the byte offset of ``members[j]`` in its object (~8 bytes a packed file:
  with it mountd names a chunk's members' locations without a digest read per member).

A chunk is any object (one source, one key) that two or more files of the digest point into.
Files whose ``loc_key`` is NULL name their own object (digest-format.md) and are loose.
"""

from __future__ import annotations

import sqlite3
from array import array
from collections.abc import Sequence


class Packing:
    """The chunks of one dataset (see the module docstring). Built by :func:`scan_packing`."""

    def __init__(self, chunk_of: array, starts: array, members: array,
                 offsets: array | None = None) -> None:
        self.chunk_of = chunk_of
        self.starts = starts
        self.members = members
        #: Byte offset of ``members[j]`` in its object (parallel to ``members``).
        self.offsets = offsets if offsets is not None else array("q", [0]) * len(members)

    @property
    def chunks(self) -> int:
        """How many chunks the dataset has."""
        return len(self.starts) - 1

    def chunk(self, cid: int) -> int:
        """The chunk of ``cid``, or -1 for a loose file."""
        return self.chunk_of[cid]

    def members_of(self, chunk: int) -> Sequence[int]:
        """Compact ids of chunk ``chunk``'s files, in offset order."""
        return self.members[self.starts[chunk] : self.starts[chunk + 1]]

    def member_offsets(self, chunk: int) -> Sequence[int]:
        """Byte offsets in their object of :meth:`members_of` ``chunk``, in the same order."""
        return self.offsets[self.starts[chunk] : self.starts[chunk + 1]]

    def siblings(self, cid: int) -> Sequence[int]:
        """Every file of ``cid``'s chunk in offset order (``cid`` included); ``[cid]`` when
        it is loose."""
        chunk = self.chunk_of[cid]
        return [cid] if chunk < 0 else self.members_of(chunk)


def scan_packing(conn: sqlite3.Connection, file_ids: array) -> Packing | None:
    """The :class:`Packing` of the digest open on ``conn`` whose compact ids map to digest
    file ids as ``file_ids`` (:mod:`mountd.coop.datasets`), or None when no two files share
    an object (a loose dataset costs nothing).

    One scan of the files that name an object key, sorted by object and offset (SQLite sorts
    them: the digest has no index on locations).
    """
    first = conn.execute("SELECT min(id) FROM files").fetchone()[0]
    if first is None:
        return None
    cid_of = array("i", [-1]) * len(file_ids)
    for cid, file_id in enumerate(file_ids):
        cid_of[file_id - first] = cid
    chunk_of = array("i", [-1]) * len(file_ids)
    starts = array("q", [0])
    members = array("i")
    offsets = array("q")
    group: list[int] = []
    group_offsets: list[int] = []
    current: tuple[int, str] | None = None

    def close_group() -> None:
        if len(group) > 1:
            for cid in group:
                chunk_of[cid] = len(starts) - 1
            members.extend(group)
            offsets.extend(group_offsets)
            starts.append(len(members))
        group.clear()
        group_offsets.clear()

    rows = conn.execute(
        "SELECT loc_source, loc_key, id, loc_offset FROM files WHERE loc_key IS NOT NULL "
        "ORDER BY loc_source, loc_key, loc_offset, id"
    )
    for source, key, file_id, offset in rows:
        if (source, key) != current:
            close_group()
            current = (source, key)
        group.append(cid_of[file_id - first])
        group_offsets.append(offset or 0)
    close_group()
    if not members:
        return None
    return Packing(chunk_of, starts, members, offsets)
