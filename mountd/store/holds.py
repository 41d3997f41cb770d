"""Short holds on files whose path mountd just answered: the client opens them next.

``ensure`` answers with a store path; the client (a mount, a loader) opens it one round trip
later. On a busy cache, in between, other fills make room: a chunk fill stores dozens of
members at once, and when pinned chunks take most of the cache, the few unpinned entries are
the newest ones, the very file just answered among them. Measured: with packed 64-file
chunks, a cache of 20% and four jobs, readers met the file gone three times in a row and
failed with EIO (scripts/bench/packed_training.py, 2026-11-23).

So for :data:`HOLD_SECONDS` after an answer, policy eviction (LRU, making room) skips that
file. Co-ordinated chunk eviction does not: it removes exactly a chunk that every job has
finished, and a straggler that still reads one of its files meets ENOENT and asks again,
which refetches it once (the mount retries, quiverfs/fs.py). A hold is not a pin (the index's ``pinned`` column, owned by the
session layer): it lives in memory only and expires by itself. Eviction passes over a held
entry to the next one in the policy's order; a reservation that cannot make room without
held entries waits for the hold of the first of them (in the policy's order) to end, then
evicts it, instead of failing with ``CacheFull``. Holds are few (one per ``ensure`` answered in the last seconds).
"""

from __future__ import annotations

import trio

#: Seconds an answered file is kept from eviction (its client opens it within milliseconds;
#: this covers a machine so loaded that the client's next step waits that long).
HOLD_SECONDS = 0.5
#: Share of the cache that holds may keep at most: past it the oldest holds end early, so
#: fills can always make room and a small cache under a storm of misses is not throttled to
#: one cache's worth of fills per HOLD_SECONDS.
HOLD_SHARE = 0.5


class Holds:
    """Hashes kept from eviction until their deadline (trio time). Insertion order is
    expiry order: every hold lasts :data:`HOLD_SECONDS`, and a renewed one moves to the end."""

    def __init__(self, max_bytes: int, seconds: float = HOLD_SECONDS) -> None:
        self.seconds = seconds
        self.max_bytes = max_bytes
        #: hash -> (trio time its hold ends, bytes), oldest first
        self._held: dict[bytes, tuple[float, int]] = {}
        self._bytes = 0

    def hold(self, content_hash: bytes, size: int) -> None:
        """Keep ``content_hash`` (``size`` bytes) from eviction for the next :attr:`seconds`,
        ending the oldest holds early when more than :attr:`max_bytes` would be held."""
        self._drop(content_hash)
        self._held[content_hash] = (trio.current_time() + self.seconds, size)
        self._bytes += size
        while self._bytes > self.max_bytes and self._held:
            self._drop(next(iter(self._held)))

    def _drop(self, content_hash: bytes) -> None:
        held = self._held.pop(content_hash, None)
        if held is not None:
            self._bytes -= held[1]

    def __contains__(self, content_hash: object) -> bool:
        return self.deadline(content_hash) is not None  # type: ignore[arg-type]

    def count(self) -> int:
        """How many hashes are held now (``usage``'s ``held``)."""
        self.expire()
        return len(self._held)

    def expire(self) -> None:
        """Forget the holds whose time is up."""
        now = trio.current_time()
        held = self._held
        while held:
            first = next(iter(held))
            if held[first][0] > now:
                return
            self._drop(first)

    def deadline(self, content_hash: bytes | None) -> float | None:
        """When the hold of ``content_hash`` ends (trio time), None when it is not held."""
        held = self._held.get(content_hash) if content_hash is not None else None
        return held[0] if held is not None and held[0] > trio.current_time() else None
