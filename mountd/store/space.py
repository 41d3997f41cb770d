"""Space: reservations under the cap and the quota, eviction, and room on a full disk.

:class:`Space` is a base class of :class:`mountd.store.cache.Cache` (like
:class:`~mountd.store.chunkfill.ChunkFills`): the accounting of the store's bytes and
everything that removes files from it (eviction by policy, by quota, of protected files for a
reader, of whole datasets or exact hashes, of files scrub found bad). Every method runs in
the trio thread, atomic between awaits as the cache's own; what it uses of the rest of the
cache is listed on the class.

Invariants it keeps:

* ``used`` = sum of indexed sizes; ``reserved`` = sizes of fills in flight. A fill reserves
  its size (:meth:`Space._reserve`) before it fetches, so ``used + reserved <= cache_size``
  always holds: the store never exceeds the cap, even counting temp files (the cap is
  exceeded by nothing in flight).
* A row is deleted in the same trio step as its file is unlinked (:meth:`Space._remove`), as
  a row is inserted in the same step as its fill's reservation becomes ``used``
  (:mod:`mountd.store.misses`). Hence the index and the accounting never disagree while
  mountd runs.
* Eviction's ``unlink`` is a deliberate blocking call in the trio thread (microseconds): it
  must happen in the same step as the row delete, or a refill of the same hash could be
  renamed into place and then unlinked by a late eviction.

On a full disk (a disk smaller than the cap, or shared), a fill that meets it waits here for
room (:meth:`Space._room_for_fill`), one at a time, while new fills wait to start.
"""

from __future__ import annotations

import logging
import sqlite3
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence

import trio

from mountd.errors import CacheFull, PrefetchNoRoom
from mountd.stats.counters import Counters
from mountd.store import disk, layout
from mountd.store.config import CacheConfig
from mountd.store.flights import CacheListener, Flight
from mountd.store.holds import Displaced, Holds
from mountd.store.index import Index
from mountd.store.peers import PeerSource
from mountd.store.policy import EvictionPolicy, keep_last
from mountd.store.quota import Charges, own_victims

# The cache's log: every part of Cache logs as "mountd.store.cache".
log = logging.getLogger("mountd.store.cache")


#: Seconds a fill that met a full disk waits for room (:meth:`Cache._room_for_fill`) before
#: it fails with ``CacheFull``.
DISK_WAIT = 5.0

#: Seconds the blocks of files evicted for a full disk get to come back before more is
#: evicted: a reader may still have an evicted file open (mountd tells the mounts at once,
#: and they close it within milliseconds; docs/mount.md "Kept descriptors").
DISK_SETTLE = 0.25

#: Seconds a file still protected when its chunk is evicted stays protected at most (it was
#: given to a job whose DataLoader has not read it yet: a few seconds of reading at most, and
#: a read that the kernel's page cache answered for another job is never reported, so the
#: protection must not last until its pool closes).
KEPT_PAST_CHUNK_SECONDS = 5.0

#: Seconds between two looks at the disk's free space while a fill waits for room.
DISK_POLL = 0.005

#: Free bytes a fill that met a full disk has made beyond its own need (at most a 32nd of
#: the disk): the index's next group commit grows SQLite's log, and rows it cannot write
#: wait for room, then have their files dropped (:meth:`Cache._flush_index`).
DISK_HEADROOM = 1 << 20

#: Seconds between two warnings that the disk, not the cap, bounds the cache.
DISK_FULL_LOG = 60.0


class Space:
    """Space accounting and eviction of :class:`mountd.store.cache.Cache` (see the module
    docstring)."""

    # What it uses of the cache (set by Cache.__init__ and its methods).
    config: CacheConfig
    counters: Counters
    holds: Holds
    peers: PeerSource | None
    _policy: EvictionPolicy | None
    _cache_dir: str
    _dirty: bool
    _flights: dict[bytes, Flight]
    _landing: dict[bytes, Flight]
    _require_open: Callable[[], Index]
    _flush_index: Callable[[], None]
    _notify_protect: Callable[[], None]
    _refetch_later: Callable[[Sequence[Displaced]], int]
    _cap_protection: Callable[[], None]
    _tell: Callable[[str, Callable[[CacheListener], object]], None]

    def _init_space(self, config: CacheConfig) -> None:
        self.used = 0
        self.reserved = 0
        self.entries = 0
        #: Bytes charged to each uid, and the per-user quota (mountd/store/quota.py).
        self.charges = Charges(config.user_quota)
        #: Set and replaced whenever space is released or a fill ends (waiters for room).
        self._space_changed = trio.Event()
        self._first_held: bytes | None = None  # the first held victim the last eviction met
        #: Bytes of the filesystem holding the store (read at open; None before): content
        #: larger than that is refused before anything is read or evicted.
        self._disk_size: int | None = None
        #: When a full disk was last logged (trio time; see :data:`DISK_FULL_LOG`).
        self._disk_full_logged: float | None = None
        #: Fills waiting for room on a full disk (:meth:`_room_for_fill`); new fills wait
        #: until none is left (:attr:`_disk_clear`), or they would take the room it makes.
        self._disk_waits = 0
        self._disk_clear = trio.Event()
        #: Fills that met a full disk make their room one at a time, first come first served
        #: (a lock is fair in trio): side by side, each took the room another made.
        self._disk_turns = trio.Lock()
        #: Files the session layer keeps across epochs (:meth:`set_retained`); None: none.
        self._retained: Callable[[bytes], bool] | None = None

    def set_retained(self, retained: Callable[[bytes], bool] | None) -> None:
        """Have eviction by policy take the files ``retained(hash)`` names only after every
        other evictable file (None: no such files). mountd's session layer names the files a
        chunked dataset keeps across epochs (mountd/coop/service.py ``_retain``): they are not
        pinned, so that room for prefetches stays, but in plain LRU order they were the
        first to go, being the files the current epoch had not read yet, and a file that one
        read had just fetched outlived them (test_coop.py, 2026-11-30: 86–263 of them
        evicted over three epochs of a 20 kB allowance of 1 kB files). Must be cheap: it is
        called for each victim an eviction considers (:meth:`_retained_last`)."""
        self._retained = retained

    def _retained_last(self, victims: Iterator[tuple[bytes, int]]) -> Iterator[tuple[bytes, int]]:
        """``victims`` with the files kept across epochs (:meth:`set_retained`) after all the
        others (:func:`keep_last`). Each one met is marked used now (``Index.touch``, in
        memory), so that the next eviction finds it at the recent end rather than reads past
        it again: one stamp written per kept file per turn of the cache, not a scan of every
        kept file per fill."""
        retained, index = self._retained, self._require_open()
        assert retained is not None

        def kept(content_hash: bytes) -> bool:
            if not retained(content_hash):
                return False
            index.touch((content_hash,), None)
            return True

        for content_hash, size, _ in keep_last(victims, kept):
            yield content_hash, size

    def _notify_space(self) -> None:
        self._space_changed.set()
        self._space_changed = trio.Event()

    async def _reserve(self, size: int, uid: int | None = None,
                       demand: Callable[[], bool] | None = None) -> None:
        """Reserve ``size`` bytes under the cap and within ``uid``'s quota, evicting: ``uid``'s
        own entries first while it would be over its quota (mountd/store/quota.py), then by
        policy. Waits for fills in flight when only they stand in the way (``uid``'s own, for
        its quota); :class:`CacheFull` when pinned entries leave no room
        (:class:`QuotaExceeded` when they are ``uid``'s).

        Protected files (fetched ahead, not read yet: mountd/store/holds.py) are passed over.
        When ``demand()`` says a reader waits (None: always), the newest protections end and
        their files go (to be fetched again as room frees) rather than the reader wait or
        fail; a prefetch nobody waits for
        fails with :class:`CacheFull` instead (it is never retried; a reader that comes later
        fills the file on demand)."""
        cap = self.config.cache_size
        charges = self.charges
        while self._disk_waits:
            # A fill waits for room on a full disk: starting more fills now would take the
            # room it makes (a large file among many small ones never got its turn).
            await self._disk_clear.wait()
        while True:
            own = charges.over(uid, size)
            over = self.used + self.reserved + size - cap
            if own > 0 or over > 0:
                self._flush_index()  # settles rows the index lost before choosing victims
            if own > 0:
                assert uid is not None  # no quota is over for nobody
                self._evict_own(uid, own)
                own = charges.over(uid, size)
                over = self.used + self.reserved + size - cap
            if over > 0:
                self._evict_until(over)
                over = self.used + self.reserved + size - cap
            if over > 0 and (demand is None or demand()):
                self._evict_protected(over)
                over = self.used + self.reserved + size - cap
            if own <= 0 and over <= 0:
                self.reserved += size
                charges.reserve(uid, size)
                return
            if (charges.reserved.get(uid, 0) > 0) if own > 0 else \
                    (self.reserved > 0 or self._landing):
                # Fills in flight hold the space, or files landed a moment ago wait for their
                # readers' answers; once those are done the files are evictable.
                await self._space_changed.wait()
                continue
            if self._first_held is not None:
                # A file just answered stands first in the policy's order: evictable once
                # its hold ends (waiting for that one keeps the order the policy's). Its
                # hold may have ended since it was met: then simply try again.
                expiry = self.holds.deadline(self._first_held)
                if expiry is not None:
                    await trio.sleep_until(expiry)
                continue
            if own > 0:
                assert uid is not None
                raise charges.pinned_error(uid, size)
            if self.holds.protected_bytes and demand is not None and not demand():
                raise PrefetchNoRoom(
                    f"no room to prefetch {size} bytes: the rest of the cache is pinned or "
                    f"protected ({self.holds.protected_bytes} bytes fetched ahead or kept for "
                    "their readers, not read yet)")
            pinned = self._require_open().pinned_bytes
            raise CacheFull(
                f"cannot make room for {size} bytes: the cache holds {self.used} of {cap} "
                f"bytes, {pinned} pinned and {self.holds.protected_bytes} protected until read, "
                "none evictable; unpin datasets or raise --cache-size"
            )

    def _evict_own(self, uid: int, need: int) -> None:
        """Evict ``uid``'s own entries, least recently used first, until ``need`` bytes are
        freed (or none of its entries is evictable): its quota (mountd/store/quota.py)."""
        victims = own_victims(self._require_open(), uid, need, self._flights)
        self.charges.quota_evicted(uid, *self._remove(victims, reason="evict"))

    def _evict_until(self, need: int, *, holds: bool = True) -> tuple[int, int]:
        """Evict by policy until ``need`` bytes are freed (or nothing evictable is left);
        files just answered and files protected (mountd/store/holds.py) are skipped unless
        ``holds`` is False (a full disk); files landed for readers not answered yet
        (:attr:`_landing`, one trio step) always are. Files this node keeps for the cluster
        (:meth:`PeerSource.keeps`) go last (:func:`keep_last`): a held file it does not keep
        is waited for rather than one it keeps evicted. Files kept across epochs
        (:meth:`set_retained`) go after the others of their group, but are not waited for:
        a reader's miss costs more now than a kept file's miss next epoch."""
        assert self._policy is not None
        victims: list[tuple[bytes, int]] = []
        freed = 0
        held = self.holds if holds else ()
        self.holds.expire()
        protected = self.holds.protected if holds and self.holds.protected_bytes else None
        self._first_held = None
        keeps = None if self.peers is None else self.peers.keeps
        candidates = self._policy.victims()
        if self._retained is not None:
            candidates = self._retained_last(candidates)
        order = ((h, s, False) for h, s in candidates) if keeps is None else \
            keep_last(candidates, keeps)
        held_other = False
        for hash, size, kept in order:
            if freed >= need:
                break
            if kept and held_other:
                # A file this node does not keep is only held for a moment: wait for it
                # (the caller does) rather than evict one the cluster keeps here.
                break
            if hash in self._flights:
                continue  # being refilled right now (cannot happen for indexed rows; be safe)
            if hash in self._landing:
                continue  # landed for readers who have not had its path yet
            if hash in held:
                if self._first_held is None:
                    self._first_held = hash
                held_other = held_other or not kept
                continue  # answered a moment ago: its client is about to open it
            if protected is not None and protected(hash):
                continue  # fetched ahead for a job that has not read it yet
            victims.append((hash, size))
            freed += size
        return self._remove(victims, reason="evict")

    def _evict_protected(self, need: int) -> tuple[int, int]:
        """A reader's fill finds only protected files in its way: end the newest
        protections (counted as ``ended["demand"]``) and evict those files, never a pinned
        one, one in flight, one landed for readers not answered yet, or one just answered.
        A reader never waits for a prefetch's reader, and never gets ``CacheFull`` for
        protection's sake.

        The newest, and fetched again later: a displaced file is still to be read by the
        job it was fetched for. Evicting the oldest (the next to be read) made its reader
        miss on demand a moment later, which ended the next protection, and so on: a chain
        of one on-demand miss per file read that ran for whole epochs once it started
        (docs/store-layout.md "Holds and protection"). The newest protection's reader comes
        last, and the file waits (:meth:`_refetch_later`) for room that reads free, as any
        prefetch does, so it is fetched again before its reader without taking anyone's
        room."""
        if not self.holds.protected_bytes:
            return 0, 0
        index = self._require_open()
        candidates: list[tuple[bytes, int]] = []
        for hash, size in self.holds.newest_protected():
            if hash in self._flights or hash in self.holds or hash in self._landing \
                    or index.size_of(hash) is None:
                continue  # not stored yet (its fill is queued or running), or just answered
            candidates.append((hash, size))
        pinned = index.pinned_of([h for h, _ in candidates]) if candidates else set()
        victims: list[tuple[bytes, int]] = []
        freed = 0
        for hash, size in candidates:
            if freed >= need:
                break
            if hash not in pinned:
                victims.append((hash, size))
                freed += size
        if not victims:
            return 0, 0
        displaced = self.holds.displace([h for h, _ in victims])
        log.info("a reader needed room: ended %d protections of files fetched ahead "
                 "(%d bytes), to be fetched again as room frees", len(victims), freed)
        removed = self._remove(victims, reason="evict")
        self._refetch_later(displaced)
        self._notify_protect()
        return removed

    def _free_disk(self, need: int) -> int:
        """The disk is full (the disk is smaller than the cap, or shared with others): evict
        ``need`` bytes beyond the accounting, by policy, files nobody was just answered
        first, then those too; returns bytes evicted. What a reader still has open keeps
        its blocks until it is closed: :meth:`_room_for_fill` watches the disk for that."""
        freed = self._evict_until(need)[1]
        if freed < need:
            freed += self._evict_until(need - freed, holds=False)[1]
        return freed

    async def _room_for_fill(self, need: int) -> bool:
        """A fill met a full disk (mountd/store/fillwork.py): have ``need`` bytes free on
        it; True once they are (the fill writes again), False when they could not be made
        within :data:`DISK_WAIT` seconds (the fill fails with ``CacheFull``).

        Evicting is not enough: an evicted file whose descriptor a reader (a mount, a
        loader) still holds keeps its blocks until it is closed, so this looks at the
        filesystem's free space, evicts only what is still missing, and gives what it
        evicted :data:`DISK_SETTLE` seconds to come back before evicting more (mountd
        tells the mounts what it evicted at once: docs/mountd-protocol.md ``evictions``).
        It aims at :data:`DISK_HEADROOM` more than ``need`` (the index needs room too),
        and settles for ``need`` once nothing is left to evict. Fills not started yet wait
        meanwhile (:meth:`_reserve`); those running end or meet the same wall, and then
        wait for their turn (one fill makes its room at a time, each for up to
        :data:`DISK_WAIT` seconds), holding none of the bytes their failed write left
        (mountd/store/fillwork.py)."""
        self._disk_waits += 1
        try:
            async with self._disk_turns:
                return await self._make_disk_room(need)
        finally:
            self._disk_waits -= 1
            if not self._disk_waits:
                self._disk_clear.set()
                self._disk_clear = trio.Event()

    async def _make_disk_room(self, need: int) -> bool:
        """:meth:`_room_for_fill`'s work."""
        start = now = trio.current_time()
        deadline, settle = start + DISK_WAIT, start + DISK_SETTLE
        want = need + min(DISK_HEADROOM, (self._disk_size or 0) // 32)
        evicted = total = 0  # bytes evicted whose blocks have not come back; all evicted
        while True:
            free = disk.space(self._cache_dir)[1]
            if free >= want:
                break
            exhausted = False
            if evicted < want - free:
                freed = self._free_disk(want - free - evicted)
                exhausted = not freed
                evicted += freed
                total += freed
            if exhausted and free >= need:
                break  # nothing more to evict: the fill's own need will do
            now = trio.current_time()
            if now >= deadline:
                log.warning("disk full: no room for a %d-byte fill after %.1f s (%d bytes "
                            "free, %d evicted: the rest is held by files still open, "
                            "pinned, or not the cache's)", need, now - start, free, total)
                return False
            if now >= settle:
                evicted, settle = 0, now + DISK_SETTLE  # still held open: evict more
            await trio.sleep(DISK_POLL)
        now = trio.current_time()
        last = self._disk_full_logged
        if last is None or now - last >= DISK_FULL_LOG:
            self._disk_full_logged = now
            log.warning("the disk holding the cache is full (smaller than the cache size, or "
                        "shared): evicting beyond the cap (%d bytes for a %d-byte fill, "
                        "%.3f s); logged once a minute", total, need, now - start)
        else:
            log.debug("disk full: evicted %d bytes for a %d-byte fill", total, need)
        return True

    def _remove(self, victims: Sequence[tuple[bytes, int]], reason: str,
                owners: Mapping[bytes, int] | None = None) -> tuple[int, int]:
        """Unlink files, then delete their rows, in one trio step; count evictions, and take
        each file off the charge of its uid (``owners``: whose each is, when the index does
        not know; by default the index says).

        Files go first: on a full disk the row delete itself needs space (SQLite's WAL), which
        the unlinks provide. A crash in between leaves rows without files (recovery state C).
        """
        index = self._require_open()
        if index.deleting:  # gone already, their rows waiting for room (Index.delete)
            victims = [v for v in victims if v[0] not in index.deleting]
        if not victims:
            return 0, 0
        hashes = [h for h, _ in victims]
        refs = index.refs_of(hashes) if reason == "evict" else {}
        if owners is None:
            owners = index.owners_of(hashes) if self.charges.files else {}
        self.charges.uncharge(owners, victims)
        if self.holds.forget(hashes, "removed"):
            self._notify_protect()  # gone from the store: their share is free again
        files = nbytes = 0
        for hash, size in victims:
            disk.remove(layout.store_path(self.config.cache_dir, hash))
            files += 1
            nbytes += size
            if reason == "evict":
                self.counters.add_eviction(refs.get(hash, []), 1, size)
        self.used -= nbytes
        self.entries -= files
        assert self._policy is not None
        self._policy.on_remove(hashes)
        self._notify_space()
        self._tell("removed", lambda listener: listener.removed(hashes))
        try:
            if not index.delete(hashes):
                # A full disk: the files are gone (and accounted), the rows wait for room.
                log.debug("no room on the disk to drop %d rows; retried with the next "
                          "group commit", len(hashes))
        except sqlite3.Error:
            # Rows without files are harmless here (contains() may say yes until the next
            # open repairs state C; the FUSE client then falls back to ensure()).
            log.exception("could not drop %d evicted rows from the index", len(hashes))
            self._dirty = True
        self._cap_protection()
        return files, nbytes

    def _drop_entries(self, hashes: Sequence[bytes], reason: str) -> None:
        """Scrub found these bad or missing: remove them (never evictions in the counters)."""
        index = self._require_open()
        victims = [(h, s) for h in hashes if (s := index.size_of(h)) is not None]
        self._remove(victims, reason=reason)
        self.counters.scrub_removed += len(victims)

    def evict(self, dataset: str | None = None) -> tuple[int, int]:
        """Remove unpinned content of ``dataset`` (``None``: of every dataset, i.e. all
        unpinned entries); returns ``(files, bytes)`` removed. Content that another dataset
        also references stays (only this dataset's reference to it is dropped)."""
        index = self._require_open()
        if dataset is None:
            victims = [(h, s) for h, s in index.evictable() if h not in self._flights]
            return self._remove(victims, reason="evict")
        victims = index.exclusive_to(dataset)
        result = self._remove(victims, reason="evict")
        index.drop_refs(dataset)
        return result

    def evict_hashes(
        self, hashes: Iterable[bytes], *, keep: Callable[[bytes], bool] | None = None
    ) -> tuple[int, int]:
        """Remove exactly these hashes from the store (a chunk's co-ordinated eviction);
        returns ``(files, bytes)`` removed.

        Skipped: hashes not indexed, pinned ones (unpin first), ones being filled right now,
        protected ones (fetched ahead for a job that has not read them yet: kept until read,
        released or :data:`KEPT_PAST_CHUNK_SECONDS` from now, then left to the policy like
        any file), and those for which ``keep(hash)`` is true (the caller's "still held by
        another resident chunk or dataset"). Listeners hear ``removed`` for what went.

        Why protected files stay: a chunk is evicted once its jobs were *given* all of it
        and its grace passed, but a DataLoader reads up to ``workers x prefetch_factor``
        batches behind its sampler. With 4 workers of 64-image batches that is ~2 s of
        reading; the 1 s grace removed 130-380 given files a run before they were read, and
        each was fetched again on demand (``peers.py`` (b), 2026-11-29).
        """
        index = self._require_open()
        victims: list[tuple[bytes, int]] = []
        seen: set[bytes] = set()
        protected = self.holds.protected
        kept: list[bytes] = []
        for hash in hashes:
            hash = layout.check_hash(hash)
            if hash in seen or hash in self._flights:
                continue
            seen.add(hash)
            if protected(hash):
                kept.append(hash)
                continue
            if keep is not None and keep(hash):
                continue
            size = index.size_of(hash)
            if size is not None:
                victims.append((hash, size))
        if kept:
            self.holds.shorten(kept, KEPT_PAST_CHUNK_SECONDS)
            self._notify_protect()  # the admitter wakes at the new deadlines
        if not victims:
            return 0, 0
        pinned = index.pinned_of([h for h, _ in victims])
        return self._remove([(h, s) for h, s in victims if h not in pinned], reason="evict")
