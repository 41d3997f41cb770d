"""The store's seam to other caches: a :class:`PeerSource` a fill consults before the bucket.

The store knows nothing of clusters (mountd/cluster/ sits above it); mountd's daemon hands
the cache a ``PeerSource`` (its attribute :attr:`mountd.store.cache.Cache.peers`). For a fill
with mountd's own authority, the cache enters :meth:`PeerSource.turn` around the fetch:

* the turn yields **bytes** a peer sent, already checked against the hash by the source:
  the fill stores them as it stores bytes a client supplied (:class:`PeerBytes`), verified
  once more, counted as no remote request;
* or it yields **None**: fetch from the bucket now. The source may hold a cluster-wide
  "this node fetches it" lock while the turn lasts; leaving the turn (normally or with an
  error) tells it the fetch is over, and whether the file landed.

Fills of bytes a client supplied, and chunk fills of packed objects, never consult peers
(docs/cluster.md "What is not done yet").

The source also says what this node **keeps** (:meth:`PeerSource.keeps`): the hashes the
cluster places here. The cache's eviction passes over them while it can evict others
(:meth:`mountd.store.cache.Cache._evict_until`), so that the caches together hold the
dataset once instead of every node holding the same most recent files (docs/cluster.md
"What a node keeps").
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Protocol, TypeVar

from mountd.store.fill import Filler
from mountd.store.flights import Flight
from mountd.store.supplied import SuppliedBytes
from quiverfs.backends import Backend

T = TypeVar("T")

#: URL shown in errors about bytes a peer sent.
PEER_URL = "peer://"


class PeerSource(Protocol):
    """Other caches that may hold a hash (see the module docstring)."""

    def turn(self, hash: bytes, size: int) -> AbstractAsyncContextManager[bytes | None]:
        """Bytes of ``hash`` (``size`` long, verified) from a peer, or None: fetch from the
        bucket while the turn lasts. Never raises for a peer's or the coordinator's failure
        (those fall back to the bucket)."""
        ...

    def keeps(self, hash: bytes) -> bool:
        """Whether this node is where the cluster keeps ``hash`` (its owner): its cache
        evicts such files only after every other evictable file. Cheap (called for each
        victim the eviction considers); always True when the node is alone."""
        ...


class PeerBytes(SuppliedBytes):
    """Content a peer sent, held in memory, read by a fill like bytes a client supplied (no
    remote limits, no request counted, verified like any fill)."""

    url = PEER_URL

    def __init__(self, data: bytes) -> None:
        super().__init__(-1, 0)
        self.data = data

    def _pread(self, offset: int, length: int) -> bytes:
        return self.data[offset : offset + length]

    def close(self) -> None:
        """Drop the bytes."""
        self.data = b""


async def fill_through(peers: PeerSource, filler: Filler, backend: Callable[[str], Backend],
                       flight: Flight) -> Path:
    """The fill of ``flight`` (mountd's own authority) with ``peers`` asked first: their bytes
    if they have them, else the bucket's within the source's turn."""
    async with peers.turn(flight.hash, flight.size) as data:
        source: Backend | SuppliedBytes
        source = backend(flight.location.url) if data is None else PeerBytes(data)
        return await filler.fill(source, flight.hash, flight.size, flight.location,
                                 flight.dataset)
