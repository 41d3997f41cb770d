"""The store's seam to other caches: a :class:`PeerSource` a fill consults before the bucket.

The store knows nothing of clusters (mountd/cluster/ sits above it); mountd's daemon hands
the cache a ``PeerSource`` (its attribute :attr:`mountd.store.cache.Cache.peers`). For a fill
with mountd's own authority, the cache enters :meth:`PeerSource.turn` around the fetch:

* the turn yields **content** a peer sent, already checked against the hash by the source:
  the fill stores it as it stores bytes a client supplied (a :class:`PeerContent`: in memory,
  or for a large file an unlinked spool file in the cache's ``tmp/``), verified once more,
  counted as no remote request;
* or it yields **None**: fetch from the bucket now. The source may hold a cluster-wide
  "this node fetches it" lock while the turn lasts; leaving the turn (normally or with an
  error) tells it the fetch is over, and whether the file landed.

Misses of clients that supply their own bytes (other users' mounts, docs/operations.md
"Security") consult peers too, through :meth:`PeerSource.find`: a peer's copy is content the
hash names, verified, as good as a local hit (the hash is the capability), so the client
need not fetch it; bytes a client supplied are handed to :meth:`PeerSource.landed` once
stored, so the cluster finds them. Neither takes the cluster-wide lock: a client's fetch is
its own, with its own rights. A chunk fill of packed objects takes the turn of the member
it was asked for (mountd/store/chunkfill.py) and shares the others it brought.

The source also says what this node **keeps** (:meth:`PeerSource.keeps`): the hashes the
cluster places here. The cache's eviction passes over them while it can evict others
(:meth:`mountd.store.cache.Cache._evict_until`), so that the caches together hold the
dataset once instead of every node holding the same most recent files (docs/cluster.md
"What a node keeps").
"""

from __future__ import annotations

import os
import tempfile
from contextlib import AbstractAsyncContextManager
from typing import Protocol, TypeVar

from mountd.store.fill import Filler
from mountd.store.flights import Flight
from mountd.store.supplied import SuppliedBytes

T = TypeVar("T")

#: URL shown in errors about bytes a peer sent.
PEER_URL = "peer://"


class PeerSource(Protocol):
    """Other caches that may hold a hash (see the module docstring)."""

    def turn(self, hash: bytes, size: int) -> AbstractAsyncContextManager[PeerContent | None]:
        """Content of ``hash`` (``size`` long, verified) from a peer, or None: fetch from the
        bucket while the turn lasts. Never raises for a peer's or the coordinator's failure
        (those fall back to the bucket)."""
        ...

    async def find(self, hash: bytes, size: int) -> PeerContent | None:
        """Content of ``hash`` (``size`` long, verified) if a peer holds it, else None; no
        lock, no bucket. Never raises for a peer's failure."""
        ...

    def keeps(self, hash: bytes) -> bool:
        """Whether this node is where the cluster keeps ``hash`` (its owner): its cache
        evicts such files only after every other evictable file. Cheap (called for each
        victim the eviction considers); always True when the node is alone."""
        ...

    def landed(self, hash: bytes) -> None:
        """``hash`` was just stored from a source other than a turn (bytes a client
        supplied, a member a chunk fill brought along): share it (in the background;
        never raises)."""
        ...


class PeerContent(SuppliedBytes):
    """Content a peer sent, read by a fill like bytes a client supplied (no remote limits,
    no request counted, verified like any fill). ``size``: how many bytes."""

    url = PEER_URL
    size: int


class PeerBytes(PeerContent):
    """A peer's content held in memory (small files)."""

    def __init__(self, data: bytes) -> None:
        super().__init__(-1, 0)
        self.inline = data
        self.size = len(data)

    def close(self) -> None:
        """Drop the bytes."""
        self.inline = b""


class PeerFile(PeerContent):
    """A peer's content in an unlinked spool file (large files: never held in memory);
    closing it frees the space."""

    def __init__(self, fd: int, size: int) -> None:
        super().__init__(fd, 0)
        self.size = size


def spool_file(directory: str | os.PathLike[str]) -> int:
    """A new, empty, unlinked read-write file in ``directory`` (``O_TMPFILE`` where the
    filesystem has it): nothing to clean up after a crash, its space freed on close."""
    try:
        return os.open(directory, os.O_TMPFILE | os.O_RDWR, 0o600)
    except OSError:  # no O_TMPFILE here: create, then unlink at once
        fd, name = tempfile.mkstemp(dir=directory, suffix=".peer")
        os.unlink(name)
        return fd


async def fill_through(peers: PeerSource, filler: Filler, flight: Flight) -> str:
    """The fill of ``flight`` (mountd's own authority) with ``peers`` asked first: their bytes
    if they have them, else the bucket's within the source's turn."""
    async with peers.turn(flight.hash, flight.size) as content:
        try:
            return await filler.fill(content, flight.hash, flight.size, flight.location,
                                     flight.dataset)
        finally:
            if content is not None:
                content.close()
