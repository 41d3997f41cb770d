"""A journal of the content that left the store, for mounts to forget what the kernel kept.

A mount lets the kernel keep every file's pages (the content never changes, docs/mount.md
"Zero-message opens"), so without help a file that mountd evicted would go on being read from
the kernel's page cache: the mount would in effect cache more than the budget says, and a
benchmark of a 20 % cache would measure RAM instead. Each mount therefore asks mountd which
hashes left the store since it last asked (:meth:`EvictionJournal.since`, the ``evictions``
operation) and tells the kernel to drop those files' pages (``FUSE_NOTIFY_INVAL_INODE``). The
next read of such a file then reaches the mount again and is a miss, as it should be.

The same answer closes the store files the mount's processes still hold open: an evicted
file's blocks stay allocated while a descriptor is open, outside mountd's cap (and on a disk
smaller than the cap, in the way of the fill that evicted it). So the question waits for the
answer (:meth:`EvictionJournal.changed`, the request's ``wait_ms``): mountd answers the moment it
evicts, and the mount asks again a moment later, so a burst of evictions costs a few answers.

The journal is a bounded ring: a mount that falls further behind than :data:`JOURNAL_ENTRIES`
evictions is told so (``complete: false``) and starts again from the newest entry. Each mountd
start has a new journal id, so a mount that reconnects to a restarted mountd does the same.
"""

from __future__ import annotations

import secrets
from collections import deque
from collections.abc import Sequence
from itertools import islice

import trio

#: Evictions remembered (32 bytes each: 8 MiB).
JOURNAL_ENTRIES = 1 << 18

#: Most hashes one answer carries (the rest come with the next request).
MAX_ANSWER = 20_000


class EvictionJournal:
    """A :class:`mountd.store.cache.CacheListener` that numbers every hash removed from the store."""

    def __init__(self, capacity: int = JOURNAL_ENTRIES) -> None:
        self.id = secrets.token_hex(8)
        self._ring: deque[bytes] = deque(maxlen=capacity)
        self._next = 0  #: sequence number of the next removal
        #: Set at the next removal, for whoever waits for one (None: nobody waits).
        self._grew: trio.Event | None = None

    # -- CacheListener ---------------------------------------------------------------------

    def filled(self, hashes: Sequence[bytes]) -> None:
        pass

    def removed(self, hashes: Sequence[bytes]) -> None:
        self._ring.extend(hashes)
        self._next += len(hashes)
        if self._grew is not None and hashes:
            self._grew.set()
            self._grew = None

    def fill_failed(self, hash: bytes) -> None:
        pass

    # -- reading ----------------------------------------------------------------------------

    @property
    def newest(self) -> int:
        """The sequence number the next removal will get."""
        return self._next

    def changed(self, seq: int | None, journal: str | None = None) -> trio.Event | None:
        """What to wait on before :meth:`since` has news for ``(seq, journal)``: an event set
        at the next removal, or None when it has news now (or the question is not this
        journal's: its answer says where the journal stands)."""
        if seq is None or journal != self.id or seq != self._next:
            return None
        if self._grew is None:
            self._grew = trio.Event()
        return self._grew

    def since(self, seq: int | None, journal: str | None = None, limit: int = MAX_ANSWER) -> dict:
        """Removals numbered ``seq`` and later, at most ``limit``.

        Returns ``{"journal", "seq", "hashes", "complete"}``: ``seq`` is what to ask for next;
        ``complete`` is false when removals between ``seq`` and the oldest remembered one
        were forgotten, or ``journal`` names another mountd run (or ``seq`` is None: a
        first request, which only learns where the journal stands).
        """
        oldest = self._next - len(self._ring)
        if seq is None or journal != self.id or seq > self._next:
            return {"journal": self.id, "seq": self._next, "hashes": [], "complete": seq is None}
        complete = seq >= oldest
        start = max(seq, oldest)
        count = min(limit, self._next - start)
        first = start - oldest
        # One walk of the ring (indexing a deque in the middle walks it on every access).
        hashes = [h.hex() for h in islice(self._ring, first, first + count)]
        return {"journal": self.id, "seq": start + count, "hashes": hashes, "complete": complete}
