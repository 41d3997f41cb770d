"""The index's group commit and the durable checkpointer, the part of the cache that writes.

:class:`Commits` is a base class of :class:`mountd.store.cache.Cache` (like
:class:`~mountd.store.chunkfill.ChunkFills`): the cache's background writers, kept apart
from the fills that give them rows (:mod:`mountd.store.misses`) and from the eviction they
ask for room (:mod:`mountd.store.space`). Every method runs in the trio thread, atomic
between awaits as the cache's own; what it uses of the rest of the cache is listed on the
class.

* **Group commit.** A fill's row is inserted into the index in the trio step its file is
  stored (``Cache._record``), visible to lookups at once, and written to SQLite with the
  rows of :data:`GROUP_COMMIT_DELAY` seconds (or :data:`GROUP_COMMIT_ROWS` rows) by
  :meth:`Commits._committer`, in a worker thread (``Index.take_flight``): the inserts and
  the commit take none of the trio thread's time, which is what limits fills on many
  cores. A row a full disk kept out of SQLite stays with the index
  (its file is there and counted) until room is made for it, or its file is removed
  (:meth:`Commits._flush_index`): no file stays long in the store, counted in ``used`` and
  unknown to the index.
* **Hits' recency.** :meth:`Commits._toucher` writes the dataset references hits add, and
  bounds the recency held in memory (``Index.touch``).
* **Durable checkpoints** (:mod:`mountd.store.durability`): one ``syncfs`` for every fill
  landed in ``sync_interval`` seconds (:meth:`Commits.checkpoint`), and the mark recovery
  trusts after a crash.
"""

from __future__ import annotations

import contextlib
import logging
import sqlite3
import time
from collections.abc import Callable
from functools import partial

import trio

from mountd.stats.counters import Counters
from mountd.store import disk, durability
from mountd.store.config import CacheConfig
from mountd.store.index import TOUCH_MEMORY, Index
from mountd.store.space import DISK_HEADROOM, DISK_SETTLE, DISK_WAIT

# The cache's log: every part of Cache logs as "mountd.store.cache".
log = logging.getLogger("mountd.store.cache")


#: Seconds a new index row waits for others to share its commit (group commit). A commit
#: writes every page its rows touched (random hashes: a leaf page each, and the recency
#: index's), so a larger group costs less per row: 77 µs a row at 5 ms, ~20 µs at 50 ms,
#: 2,400 fills/s (2026-11-28). Rows are visible to mountd at once either way; a crash
#: loses only what recovery adopts again from the store.
GROUP_COMMIT_DELAY = 0.05

#: Rows after which the group commit is written at once (without waiting for the delay).
GROUP_COMMIT_ROWS = 512

#: Rows waiting (while a commit is out in its worker thread) past which a fill commits them
#: in the trio thread itself: the group commit's back-pressure, should SQLite fall behind.
GROUP_COMMIT_BACKLOG = 8 * GROUP_COMMIT_ROWS

#: Seconds between writes of the dataset references hits add (``Index.touch``), and checks
#: that the recency of hits held in memory stays under ``TOUCH_MEMORY`` hashes.
TOUCH_INTERVAL = 1.0

#: Rows of hit recency written per trio step when the memory bound is passed (~15 µs each).
TOUCH_WRITE_STEP = 2048


class Commits:
    """The group commit and the checkpointer of :class:`mountd.store.cache.Cache` (see the
    module docstring)."""

    # What it uses of the cache (set by Cache.__init__ and its methods).
    config: CacheConfig
    _index: Index | None
    _nursery: trio.Nursery | None
    _cache_dir: str
    _dirty: bool
    _free_disk: Callable[[int], int]
    _remove: Callable[..., tuple[int, int]]
    counters: Counters

    def _init_commits(self) -> None:
        #: Set when a row waits in the index's group commit (the committer flushes it).
        self._rows_waiting = trio.Event()
        #: Set when :data:`GROUP_COMMIT_ROWS` rows wait: the committer goes at once.
        self._rows_full = trio.Event()
        #: Set when a fill landed since the last durable checkpoint.
        self._unsynced = trio.Event()
        self._boot_id = durability.boot_id()
        #: Durable checkpoints taken, and the seconds the last one's syncfs took.
        self.checkpoints = 0
        self.last_sync_seconds = 0.0
        #: Since when (monotonic) the index holds rows no commit could store, and when it
        #: may next evict for them (:meth:`_flush_index`).
        self._lost_since: float | None = None
        self._index_room_at = 0.0

    def _flush_index(self) -> None:
        """Commit the index's group commit, and settle rows no commit could store.

        A failed group commit (disk full) is retried row by row by the index; rows that
        still fail stay with it (visible to lookups: their files are there and counted), and
        are written once the disk has room: this evicts for it (at most every
        :data:`DISK_SETTLE` seconds) and the committer tries again with its next round.
        Rows still unwritten after :data:`DISK_WAIT` seconds, or when the cache is not
        running, have their files removed (and their accounting), so that no file is in
        the store for long, counted in ``used``, and unknown to the index and its
        eviction."""
        index = self._index
        if index is None:
            return
        self._retry_deletes(index)
        index.flush()
        self._settle_lost(index)

    async def _commit_index(self) -> None:
        """:meth:`_flush_index`, with the rows written and committed in a worker thread
        (``Index.take_flight``): the committer's way. Never cancelled half-way: a flight
        taken is always written, so the index never waits for one that was not."""
        index = self._index
        if index is None:
            return
        self._retry_deletes(index)
        flight = index.take_flight()
        if flight is not None:
            # The thread starts in this trio step, not after an await: another task may
            # wait for the flight to land (Index.conn) without yielding, and it must land.
            landed = trio.Event()
            token = trio.lowlevel.current_trio_token()

            def tell(_: object) -> None:
                with contextlib.suppress(trio.RunFinishedError):
                    token.run_sync_soon(landed.set)

            try:
                trio.lowlevel.start_thread_soon(partial(index.write_flight, flight), tell)
            except BaseException:
                index.write_flight(flight)  # no thread to be had: here, so that it lands
                raise
            with trio.CancelScope(shield=True):
                await landed.wait()
            self.counters.stages.add("commit", flight.wall, flight.cpu, len(flight.rows))
            if self._index is not index:
                return  # closed meanwhile: close() landed it
            if not index.land():
                index.flush()  # the rows again, one by one: those that fail are kept
        self._settle_lost(index)

    def _retry_deletes(self, index: Index) -> None:
        try:
            index.retry_deletes()  # rows of evicted files a full disk kept (Index.delete)
        except sqlite3.Error:
            log.exception("could not drop %d evicted rows from the index", len(index.deleting))
            index.deleting.clear()  # left to the next open (rows without files: state C)
            self._dirty = True

    def _settle_lost(self, index: Index) -> None:
        """Rows no commit could store (disk full): evict for them, retry, or drop them with
        their files (see :meth:`_flush_index`)."""
        lost = index.lost
        if not lost:
            self._lost_since = None
            return
        now = time.monotonic()
        if self._lost_since is None:
            self._lost_since = now
            log.debug("could not index %d new files (disk full?); evicting and retrying",
                      len(lost))
        if now >= self._index_room_at:
            self._index_room_at = now + DISK_SETTLE
            free = disk.space(self._cache_dir)[1]
            want = max(sum(row.size for row in lost), DISK_HEADROOM)
            if free < want:
                self._free_disk(want - free)
        if not index.retry_lost():
            self._lost_since = None
            return
        if self._nursery is not None and now - self._lost_since < DISK_WAIT:
            self._rows_waiting.set()  # the committer tries again
            return
        failed = index.take_lost()
        self._lost_since = None
        log.warning("dropping %d new files the index could not store (disk full?)", len(failed))
        self._remove([(row.hash, row.size) for row in failed], reason="unindexed",
                     owners={row.hash: row.uid for row in failed if row.uid is not None})

    async def _committer(self) -> None:
        """Commit the group commit :data:`GROUP_COMMIT_DELAY` after its first row, or once
        :data:`GROUP_COMMIT_ROWS` rows wait (see Index.insert), in a worker thread."""
        while True:
            await self._rows_waiting.wait()
            self._rows_waiting = trio.Event()
            with trio.move_on_after(GROUP_COMMIT_DELAY):
                await self._rows_full.wait()
            self._rows_full = trio.Event()
            await self._commit_index()

    async def _toucher(self) -> None:
        """Every :data:`TOUCH_INTERVAL`, write the dataset references hits added, and the
        recency of the oldest hits once the index holds more than ``TOUCH_MEMORY`` in
        memory (``Index.touch``), a few thousand rows a trio step."""
        while True:
            await trio.sleep(TOUCH_INTERVAL)
            index = self._index
            if index is None:
                continue
            index.write_refs()
            while index is self._index and index.touches_waiting > TOUCH_MEMORY:
                index.write_touches(min(TOUCH_WRITE_STEP, index.touches_waiting - TOUCH_MEMORY * 3 // 4))
                await trio.sleep(0)

    async def _checkpointer(self) -> None:
        """A durable checkpoint ``sync_interval`` seconds after the first fill that needs one."""
        while True:
            await self._unsynced.wait()
            await trio.sleep(self.config.sync_interval)
            await self.checkpoint()

    async def checkpoint(self) -> bool:
        """A durable checkpoint now: make every fill landed so far durable with one
        ``syncfs``, and record it (``synced_through``, the boot id) in the index; False
        (logged, retried at the next interval) if the sync fails. The cache takes one
        ``sync_interval`` after a fill lands, at open and at close."""
        index = self._index
        if index is None:
            return False
        self._unsynced = trio.Event()  # fills from now on wait for the next checkpoint
        mark = index.now()  # every row stamped up to here is renamed into place already
        self._flush_index()
        start = trio.current_time()
        try:
            # Never abandoned: the mark is written only after the sync really returned.
            await trio.to_thread.run_sync(durability.syncfs, self.config.cache_dir)
        except OSError as exc:
            log.warning("durable checkpoint failed (%s); trying again later", exc)
            self._unsynced.set()
            return False
        try:
            # The index's log is folded back here, off the trio thread (Index.fold_wal).
            await trio.to_thread.run_sync(index.fold_wal)
        except sqlite3.Error as exc:
            log.warning("could not fold the index's log back (%s); trying again later", exc)
        if self._index is not index:
            return False
        self.last_sync_seconds = trio.current_time() - start
        try:
            index.set_durable_mark(mark, self._boot_id)
        except sqlite3.Error:
            log.exception("could not record the durable checkpoint")
            return False
        self.checkpoints += 1
        return True
