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

Misses of clients that supply their own bytes (other users' mounts, docs/operations.md
"Security") consult peers too, through :meth:`PeerSource.find`: a peer's copy is content the
hash names, verified, as good as a local hit (the hash is the capability), so the client
need not fetch it; bytes a client supplied are handed to :meth:`PeerSource.landed` once
stored, so the cluster finds them. Neither takes the cluster-wide lock: a client's fetch is
its own, with its own rights. Chunk fills of packed objects never consult peers
(docs/cluster.md "What is not done yet").
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

    async def find(self, hash: bytes, size: int) -> bytes | None:
        """Bytes of ``hash`` (``size`` long, verified) if a peer holds it, else None; no
        lock, no bucket. Never raises for a peer's failure."""
        ...

    def landed(self, hash: bytes) -> None:
        """``hash`` was just stored from bytes a client supplied: share it (in the
        background; never raises)."""
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
