"""Who each cached entry is charged to, and the optional per-user quota over those charges.

One mountd serves every user of the machine (docs/operations.md "Security"), so one user's
job can fill the whole shared cache and push everybody else's content out. ``--user-quota``
(:attr:`mountd.store.config.CacheConfig.user_quota`) caps the bytes charged to each uid:

* **Charging.** An entry is charged to the uid whose request filled it: the requester of a
  fill mountd read itself (``ensure``, ``prefetch``), or the user who supplied the bytes
  (``supply``). The charge is persisted with the entry (the index's ``owners`` table, deleted
  with it) and summed per uid in memory (:class:`Charges`, rebuilt from the table on open).
  Hits, by the same user or another, never move a charge: content that A fetched and B reads
  stays A's. Fills mountd starts for job sessions on its own (a claim's fetches, a chunk's
  preload; only for datasets mountd reads itself) and files recovery adopts are charged to
  nobody and count against no quota.
* **Eviction.** Before a fill for uid U reserves its bytes, U's charged bytes plus U's fills
  in flight plus the new fill must fit in the quota; if they do not, U's own entries are
  evicted first, least recently used first (:func:`owned_victims`); only then is room made
  cache-wide by the eviction policy, as without a quota. Pinned entries and fills in flight
  are never evicted: when only U's own fills in flight stand in the way, the fill waits for
  them; when the rest of U's charge is pinned, it fails with :class:`QuotaExceeded`.
* **Content larger than the quota** fails at once with :class:`QuotaExceeded` (``EDQUOT``),
  before anything is evicted or read: filling it would need every one of the user's entries
  gone and still leave the user over its quota. Another user's fill of the same content is
  still a hit for this user (a hit needs only the hash).

Everything here runs in the trio thread, between awaits (see :mod:`mountd.store.cache`).
"""

from __future__ import annotations

import contextlib
import heapq
import sqlite3
from collections import defaultdict
from collections.abc import Container, Iterable, Iterator, Mapping, Sequence
from typing import Any

from mountd.errors import QuotaExceeded
from mountd.store.index import Index

#: Rows of a uid's eviction queue read by a walk's first page (a fill usually needs one
#: victim; measured on a million entries: 30 µs for 1 row, 50 µs for 8, 260 µs for 64) ...
FIRST_PAGE = 8

#: ... and at most, as pages double.
LAST_PAGE = 512


class Charges:
    """Bytes and entries charged to each uid, the bytes of its fills in flight, and the
    quota (None: no quota; the charges are still kept, for ``stats``)."""

    def __init__(self, quota: int | None) -> None:
        self.quota = quota
        self.files: defaultdict[int, int] = defaultdict(int)
        self.bytes: defaultdict[int, int] = defaultdict(int)
        #: Bytes reserved by each uid's fills in flight (not charged yet).
        self.reserved: defaultdict[int, int] = defaultdict(int)
        #: Entries, and their bytes, evicted to keep each uid within its quota.
        self.quota_evicted_files: defaultdict[int, int] = defaultdict(int)
        self.quota_evicted_bytes: defaultdict[int, int] = defaultdict(int)

    def load(self, totals: Iterable[tuple[int, int, int]]) -> None:
        """Start from ``(uid, entries, bytes)`` totals (:meth:`Index.charged`)."""
        self.files.clear()
        self.bytes.clear()
        for uid, files, nbytes in totals:
            self.files[uid], self.bytes[uid] = files, nbytes

    def charge(self, uid: int | None, size: int) -> None:
        """An entry of ``size`` bytes was stored for ``uid`` (None: charged to nobody)."""
        if uid is not None:
            self.files[uid] += 1
            self.bytes[uid] += size

    def uncharge(self, owners: Mapping[bytes, int], victims: Sequence[tuple[bytes, int]]) -> None:
        """``victims`` (``(hash, size)``) left the store; ``owners`` says whose each was."""
        for hash, size in victims:
            uid = owners.get(hash)
            if uid is not None:
                self.files[uid] -= 1
                self.bytes[uid] -= size
                if not self.files[uid]:
                    del self.files[uid], self.bytes[uid]

    def reserve(self, uid: int | None, size: int) -> None:
        """A fill for ``uid`` reserved ``size`` bytes."""
        if uid is not None:
            self.reserved[uid] += size

    def unreserve(self, uid: int | None, size: int) -> None:
        """That fill ended (its bytes are charged now, or it failed)."""
        if uid is not None:
            self.reserved[uid] -= size
            if not self.reserved[uid]:
                del self.reserved[uid]

    def over(self, uid: int | None, size: int) -> int:
        """Bytes by which a new fill of ``size`` for ``uid`` would put it over its quota
        (counting its fills in flight); <= 0 when it fits, or there is no quota."""
        if self.quota is None or uid is None:
            return 0
        return self.bytes.get(uid, 0) + self.reserved.get(uid, 0) + size - self.quota

    def check_size(self, hash: bytes, size: int, uid: int | None) -> None:
        """:class:`QuotaExceeded` when content of ``size`` bytes can never fit ``uid``'s quota."""
        if self.quota is not None and uid is not None and size > self.quota:
            raise QuotaExceeded(
                f"object {hash.hex()} ({size} bytes) is larger than the per-user quota of the "
                f"cache ({self.quota} bytes, uid {uid}); ask for a larger --user-quota")

    def pinned_error(self, uid: int, size: int) -> QuotaExceeded:
        """The error for a fill that cannot fit because the rest of ``uid``'s charge is pinned."""
        return QuotaExceeded(
            f"cannot make room for {size} bytes within uid {uid}'s quota of {self.quota} bytes: "
            f"its {self.bytes.get(uid, 0)} cached bytes are pinned; unpin datasets or ask for "
            "a larger --user-quota")

    def quota_evicted(self, uid: int, files: int, nbytes: int) -> None:
        """Count entries evicted to keep ``uid`` within its quota."""
        self.quota_evicted_files[uid] += files
        self.quota_evicted_bytes[uid] += nbytes

    def snapshot(self, also: Iterable[int] = ()) -> dict[int, dict[str, Any]]:
        """Per uid charged, or that had entries evicted for its quota, or in ``also``:
        ``cached_files``, ``cached_bytes``, ``quota`` (bytes, or None),
        ``quota_evicted_files``, ``quota_evicted_bytes`` (``stats`` → ``users``)."""
        uids = set(self.files) | set(self.quota_evicted_files) | set(also)
        return {uid: {"cached_files": self.files.get(uid, 0),
                      "cached_bytes": self.bytes.get(uid, 0),
                      "quota": self.quota,
                      "quota_evicted_files": self.quota_evicted_files.get(uid, 0),
                      "quota_evicted_bytes": self.quota_evicted_bytes.get(uid, 0)}
                for uid in sorted(uids)}


def owned_victims(index: Index, uid: int, page: int = FIRST_PAGE) -> Iterator[tuple[bytes, int]]:
    """The evictable entries charged to ``uid``, least recently used first: ``(hash, size)``.

    Each uid's entries form a queue in the index (``owners`` by ``stamp``), whose stamps are
    lazily updated last-use times: a stamp is set to the entry's ``last_use`` when it is
    stored, and hits move only the entry's last use (``entries.last_use``, or the stamp of a
    hit the index still holds in memory: :meth:`Index.touch`), so the queue costs the hit
    path nothing. Since a stamp is never newer than its entry's last use, the head of the
    queue is the least recently used entry of the uid once its stamp equals its last use.
    Walking the queue, an entry used since it was queued is re-queued at its last use (a
    heap merges it back in, in order, if the walk gets that far), and a pinned one behind
    everything (as if used now) and skipped. A walk reads each row once, in pages that start at ``page`` rows (a fill
    usually needs one victim) and double; each hit costs at most one re-queue. The re-queues
    are written once, when the walk ends or is closed (use :func:`contextlib.closing`): they
    only spare later walks the same work, so losing them is harmless.

    Synchronous: nothing may change the index between two steps of the walk (the caller
    runs it between awaits). The caller stops when it has freed enough.
    """
    after: tuple[int, bytes] = (-1, b"")
    #: Entries used since they were queued: ``(last_use, hash, size)``, yielded in order.
    used: list[tuple[int, bytes, int]] = []
    moved: list[tuple[int, bytes]] = []  # (new stamp, hash) to write
    try:
        while True:
            rows = index.owner_queue(uid, page, after)
            page = min(page * 2, LAST_PAGE)
            for hash, size, stamp, last_use, pinned in rows:
                after = (stamp, hash)
                while used and used[0][:2] < (stamp, hash):
                    _, h, s = heapq.heappop(used)
                    yield h, s
                if pinned:
                    moved.append((index.now(), hash))
                elif last_use > stamp:
                    moved.append((last_use, hash))
                    heapq.heappush(used, (last_use, hash, size))
                else:
                    yield hash, size
            if not rows:
                while used:
                    _, h, s = heapq.heappop(used)
                    yield h, s
                return
    finally:
        with contextlib.suppress(sqlite3.Error):  # disk full: a later walk re-queues them
            index.requeue(moved)


def own_victims(index: Index, uid: int, need: int, busy: Container[bytes]
                ) -> list[tuple[bytes, int]]:
    """``(hash, size)`` of ``uid``'s entries to evict, least recently used first, to free
    ``need`` bytes (fewer when too few are evictable); ``busy`` hashes (fills in flight) are
    skipped."""
    victims: list[tuple[bytes, int]] = []
    freed = 0
    with contextlib.closing(owned_victims(index, uid)) as walk:
        for hash, size in walk:
            if freed >= need:
                break
            if hash not in busy:  # a fill in flight (cannot happen for indexed rows; be safe)
                victims.append((hash, size))
                freed += size
    return victims
