"""A dataset's compact-id view: ids ``0..N-1`` in digest order → hash, size, location.

mountd's session layer (:mod:`mountd.coop.service`) speaks compact ids with the
:class:`~mountd.coop.sessions.SessionRegistry`; the cache speaks content hashes. A
:class:`DatasetView` translates both ways and stays lean for 1.3M files (~66 bytes a file, no
object per file):

* ``hashes``: one ``bytes`` of ``32 × N`` (the blake3 of id ``i`` at ``32i``),
* ``sizes`` and ``file_ids`` (the digest's row id, for locations): ``array('q')``,
* ``slots``: an open-addressing hash table (``array('i')``, a power of two ≥ 2N, linear
  probing on the hash's first 8 bytes — blake3 is uniform) of ids, so ``hash → ids`` costs a
  probe or two (one hash may back several ids: content addressing).

Locations are looked up on demand through the :class:`~digests.digest.Digest` (one indexed
read per claimed miss or preload, ~40 µs), not stored.

Loading (:func:`load_view`) opens the digest (validated, in the trio thread: its connection
belongs to that thread) and scans it in canonical order with :func:`digests.canonical.
iter_canonical` on a private read-only connection in a worker thread (~2 µs a file, plus
~1 µs to build the table): mountd keeps serving meanwhile.
"""

from __future__ import annotations

import os
import sqlite3
from array import array
from collections.abc import Iterable, Iterator
from urllib.parse import quote

import trio

from digests.canonical import iter_canonical
from digests.digest import Digest
from mountd.coop.packing import Packing, scan_packing
from mountd.store.span import Member
from quiverfs.base.backends.base import Location
from quiverfs.base.errors import UsageError

HASH = 32


class DatasetView:
    """Compact ids of one digest (see the module docstring). Built by :func:`load_view`."""

    def __init__(
        self, dataset: str, digest: Digest, hashes: bytes, sizes: array, file_ids: array,
        slots: array, packing: Packing | None = None,
    ) -> None:
        self.dataset = dataset
        self.digest = digest
        self.hashes = hashes
        self.sizes = sizes
        self.file_ids = file_ids
        self.slots = slots
        #: The chunks of a packed dataset (files sharing one remote object), None if loose.
        self.packing = packing
        self._mask = len(slots) - 1
        self.count = len(sizes)

    def hash_of(self, cid: int) -> bytes:
        """Content hash of compact id ``cid``."""
        return self.hashes[HASH * cid : HASH * cid + HASH]

    def hashes_of(self, ids: Iterable[int]) -> list[bytes]:
        """Content hashes of ``ids``."""
        return [self.hashes[HASH * i : HASH * i + HASH] for i in ids]

    def ids_of(self, content_hash: bytes) -> list[int]:
        """Every compact id whose content is ``content_hash`` (usually zero or one)."""
        hashes, slots, mask = self.hashes, self.slots, self._mask
        slot = int.from_bytes(content_hash[:8], "little") & mask
        out = []
        while (cid := slots[slot]) >= 0:
            if hashes[HASH * cid : HASH * cid + HASH] == content_hash:
                out.append(cid)
            slot = (slot + 1) & mask
        return out

    def item(self, cid: int) -> tuple[bytes, int, Location]:
        """``(hash, size, location)`` of ``cid``, as :meth:`mountd.store.cache.Cache.fetch_now`
        and :meth:`~mountd.store.cache.Cache.prefetch` take them."""
        entry = self.digest.entry(self.file_ids[cid])
        if entry is None or entry.is_dir:
            raise UsageError(f"digest of {self.dataset} has no file {self.file_ids[cid]}")
        loc = entry.location
        return entry.hash, entry.size, loc

    def items(self, ids: Iterable[int]) -> list[tuple[bytes, int, Location]]:
        """:meth:`item` of each id."""
        return [self.item(i) for i in ids]

    def chunk_members(self, content_hash: bytes, location: Location) -> list[Member] | None:
        """The members of the packed chunk that holds ``content_hash`` at ``location``, in
        offset order (:class:`mountd.store.span.ChunkMembers`), or None: a loose dataset or
        file, or no chunk with that content at that offset.

        Locations come from the packing's offsets and ``location``'s object (every member
        shares it), so this reads the digest only when one content sits at this offset in
        two chunks (duplicates), to tell which object ``location`` names."""
        packing = self.packing
        if packing is None:
            return None
        matches: list[tuple[int, int]] = []  # (compact id, chunk) at this offset
        for cid in self.ids_of(content_hash):
            chunk = packing.chunk(cid)
            if chunk < 0:
                continue
            at = list(packing.members_of(chunk)).index(cid)
            if packing.member_offsets(chunk)[at] == location.offset:
                matches.append((cid, chunk))
        if len(matches) > 1:  # one content at this offset of two chunks: which object is it?
            matches = [(cid, chunk) for cid, chunk in matches if self._in_object(cid, location)]
        if len(matches) != 1:
            return None
        chunk = matches[0][1]
        sizes = self.sizes
        return [Member(self.hash_of(m), sizes[m], Location(location.url, location.key, off, sizes[m]))
                for m, off in zip(packing.members_of(chunk), packing.member_offsets(chunk), strict=True)]

    def _in_object(self, cid: int, location: Location) -> bool:
        """Whether the digest places ``cid`` in ``location``'s object (one digest read)."""
        entry = self.digest.entry(self.file_ids[cid])
        return entry is not None and entry.location is not None and entry.location.key == location.key

    def cached_ids(self, present: set[bytes] | frozenset[bytes]) -> Iterator[int]:
        """Ids whose content is in ``present`` (the store's hashes)."""
        hashes = self.hashes
        for i in range(self.count):
            if hashes[HASH * i : HASH * i + HASH] in present:
                yield i

    def close(self) -> None:
        """Close the digest."""
        self.digest.close()


def _hash_table(hashes: bytes, count: int) -> array:
    """Open addressing: ids in slots ``hash[:8] & mask``, linear probing; -1 = empty."""
    size = 1
    while size < 2 * count:
        size <<= 1
    mask = size - 1
    slots = array("i", [-1]) * size
    for cid in range(count):
        slot = int.from_bytes(hashes[HASH * cid : HASH * cid + 8], "little") & mask
        while slots[slot] >= 0:
            slot = (slot + 1) & mask
        slots[slot] = cid
    return slots


def _scan(path: str) -> tuple[bytes, array, array, array, Packing | None]:
    """``(hashes, sizes, file_ids, slots, packing)`` of the digest at ``path`` in canonical
    order (a worker thread: its own read-only connection)."""
    uri = f"file:{quote(os.path.abspath(path))}?mode=ro&immutable=1"
    conn = sqlite3.connect(uri, uri=True)
    try:
        hashes = bytearray()
        sizes = array("q")
        file_ids = array("q")
        for _path, file_id, size, content_hash in iter_canonical(conn):
            hashes += content_hash
            sizes.append(size)
            file_ids.append(file_id)
        packing = scan_packing(conn, file_ids)
    finally:
        conn.close()
    frozen = bytes(hashes)
    return frozen, sizes, file_ids, _hash_table(frozen, len(sizes)), packing


async def load_view(dataset: str, digest_path: str | os.PathLike[str]) -> DatasetView:
    """Open ``digest_path`` and build the view of ``dataset`` (its dataset id must match).

    Raises :class:`UsageError` (no such file, another dataset) or
    :class:`~digests.errors.DigestError` (invalid digest).
    """
    digest = Digest.open(digest_path)  # structure check only: ~0.9 s for 1.3M files
    try:
        if digest.dataset_id != dataset:
            raise UsageError(
                f"digest {os.fspath(digest_path)} holds dataset {digest.dataset_id}, not {dataset}"
            )
        hashes, sizes, file_ids, slots, packing = await trio.to_thread.run_sync(
            _scan, digest.path
        )
        if len(sizes) != digest.file_count:
            raise UsageError(f"digest {digest.path}: scanned {len(sizes)} of {digest.file_count} files")
    except BaseException:
        digest.close()
        raise
    return DatasetView(dataset, digest, hashes, sizes, file_ids, slots, packing)
