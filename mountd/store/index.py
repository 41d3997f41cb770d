"""The SQLite index of the store: the queries the cache makes (its schema: :mod:`mountd.store.schema`).

The index is a *cache of the store*, not a source of truth: every row can be rebuilt from the
files under ``store/`` (recovery adopts files without rows and drops rows without files). That
is why ``synchronous=NORMAL`` in WAL mode is enough: a power loss may lose the last
transactions, and :mod:`mountd.store.recovery` repairs exactly that on the next open. What a rebuild
cannot restore (dataset references, pins, exact last-use times) is advisory.

Why one module of ~780 lines: :class:`Index` is every query of one database, and most of
its writes span tables in one transaction (a stored file's row, its dataset reference and
its owner; an eviction's deletes across all of them). Split by table, those transactions
would be spread over modules that each hold a piece of one commit.

Threading: every method runs in the trio thread, is synchronous and short; code between two
awaits is atomic, so a method's statements never interleave with another task's. One
exception: the group commit's rows are written and committed in a worker thread
(:meth:`Index.take_flight`, :meth:`Index.write_flight`), because SQLite's inserts and commit
were a quarter of the trio thread's CPU per fill, and that thread is what limits fills on many
cores (docs/architecture.md). While such a *flight* is out, the trio thread keeps its rows in
memory (:meth:`Index.size_of` sees them) and reads the committed tables through a second,
read-only connection; anything that needs the writing connection first waits for the flight
to land (:meth:`Index._land`), which is at most one commit's time.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from mountd.store.access import PRIVATE_FILE
from mountd.store.layout import LAYOUT_VERSION
from mountd.store.schema import SCHEMA, SCHEMA_VERSION

log = logging.getLogger("mountd.store.index")

#: Hashes whose hit recency :meth:`Index.touch` keeps in memory (~250 bytes each) before
#: the cache writes the oldest to the table.
TOUCH_MEMORY = 200_000

#: Sizes :meth:`Index.size_of` answers from memory (~200 bytes each): more than read-ahead's
#: window and the fills in flight ever ask about at once.
KNOWN_SIZES = 1 << 16

#: :meth:`Index._size_in_memory`'s answer when only the table knows.
_UNKNOWN = object()

#: Parameters per ``IN (...)`` batch (SQLite 3.32+ allows 32766; stay well below).
BATCH = 500

#: Rows of the first page :meth:`Index.least_recent` reads (later pages grow fourfold).
FIRST_LRU_PAGE = 16

#: Bytes the write-ahead log's file is cut back to when it restarts (``journal_size_limit``).
WAL_BYTES = 8 << 20


class NewRow(NamedTuple):
    """A row of a freshly stored file, as the group commit holds it."""

    hash: bytes
    size: int
    dataset: str | None
    #: The uid the entry is charged to (``owners``); None: nobody.
    uid: int | None
    #: Its ``last_use`` and ``added`` stamp (:meth:`Index.now` when the file was stored).
    stamp: int = 0
    #: Pinned before it was written (:meth:`Index.set_pinned`): written with ``pinned=1``.
    pinned: bool = False


@dataclass(slots=True)
class GroupCommit:
    """A group commit in flight: out in a worker thread (:meth:`Index.take_flight`). Not
    :class:`mountd.store.misses.Flight`, a fill in flight."""

    #: Rows written into the open group commit before the flight (committed with it).
    written: list[NewRow]
    #: Rows the flight writes, in hash order (neighbours share pages).
    new: list[NewRow]
    #: Whether the group commit was open already (its ``BEGIN`` was issued).
    opened: bool
    #: Set by the worker thread: whether the commit succeeded, and the wall and CPU seconds
    #: it spent on it.
    ok: bool = False
    wall: float = 0.0
    cpu: float = 0.0

    @property
    def rows(self) -> tuple[NewRow, ...]:
        return (*self.written, *self.new)


class IndexCorrupt(Exception):
    """The index file is unreadable or from another schema: rebuild it from the store."""


def batched(items: Sequence, n: int = BATCH) -> Iterator[Sequence]:
    for start in range(0, len(items), n):
        yield items[start : start + n]


def is_full(exc: BaseException) -> bool:
    """True for SQLite's "database or disk is full" (``SQLITE_FULL``)."""
    return getattr(exc, "sqlite_errorcode", None) == sqlite3.SQLITE_FULL


class Index:
    """The open index. Use :meth:`Index.open`; every method runs in the trio thread."""

    def __init__(self, conn: sqlite3.Connection, path: Path) -> None:
        self._conn = conn
        self.path = path
        self._clock = 0
        #: A group commit of new rows is open (see :meth:`insert`); :meth:`flush` commits it.
        self._group = False
        #: The rows in the open group commit (written into it already).
        self._group_rows: list[NewRow] = []
        #: New rows not written yet (see :meth:`insert`), by hash, in insertion order.
        self._unwritten: dict[bytes, NewRow] = {}
        #: Rows of a failed group commit that could not be inserted again either (disk full),
        #: by hash: their files exist, so :meth:`size_of` still sees them (the cache counts
        #: them), but eviction does not. The cache writes them once the disk has room
        #: (:meth:`retry_lost`), or takes them (:meth:`take_lost`) and removes the files, so
        #: accounting and index agree again.
        self._lost: dict[bytes, NewRow] = {}
        #: Rows whose files are gone but whose delete the disk had no room for (see
        #: :meth:`delete`): hidden from :meth:`size_of` and :meth:`least_recent`, deleted by
        #: :meth:`retry_deletes`.
        self.deleting: set[bytes] = set()
        #: Hashes in the store that :meth:`size_of` found in the table or :meth:`insert`
        #: indexed, the most recently learnt last, at most :data:`KNOWN_SIZES`: their size,
        #: answered without a query, and the dataset whose reference :meth:`insert` wrote
        #: with the row (None when learnt from the table). Read-ahead asks about the same files
        #: again and again (its windows overlap, and its worker asks again before each fill):
        #: the lookups were 12% of mountd's CPU in a cold pass (py-spy, mount_cold.py,
        #: 2026-11-30). The dataset spares a hit of a file just filled (read-ahead's and the
        #: sweep's files, read a moment later) a reference already there: in a cold pass those,
        #: written every second, cost ~5 µs of the trio thread a file and committed the group
        #: commit on it (2026-11-30). Forgotten wherever a hash leaves the store
        #: (:meth:`delete`, :meth:`take_lost`).
        self._known: dict[bytes, tuple[int, str | None]] = {}
        #: Recency of hits kept in memory (see :meth:`touch`): hash → (its newest hit's
        #: stamp, the dataset whose reference to it is already recorded or queued), in
        #: stamp order (oldest first).
        self._touched: dict[bytes, tuple[int, str | None]] = {}
        #: ``(dataset, hash)`` references added by hits and not written yet.
        self._touched_refs: set[tuple[str, bytes]] = set()
        #: Bytes of the pinned rows, kept up to date by :meth:`set_pinned` and :meth:`delete`
        #: (the cache sizes protection by the room pins leave: mountd/store/holds.py).
        self.pinned_bytes: int = conn.execute(
            "SELECT COALESCE(SUM(size), 0) FROM entries WHERE pinned=1").fetchone()[0]
        #: The connection that folds the log back (:meth:`fold_wal`), made at its first use.
        self._folder: sqlite3.Connection | None = None
        self._folding = threading.Lock()
        #: The group commit out in a worker thread (see the module docstring), its rows by
        #: hash, and an event set while none is out (or once it has landed: the worker
        #: thread sets it, the trio thread settles it in :meth:`_land`).
        self._flight: GroupCommit | None = None
        self._flying: dict[bytes, NewRow] = {}
        self._landed = threading.Event()
        self._landed.set()
        #: A read-only connection for lookups while a flight is out (:meth:`_reading`),
        #: made at its first use.
        self._reader: sqlite3.Connection | None = None

    @property
    def conn(self) -> sqlite3.Connection:
        """The connection, with every new row written into it first (:meth:`insert`): so
        whatever reads or writes the tables through it sees them. Waits for a flight out
        (see the module docstring) to land first."""
        self._land()
        if self._unwritten:
            self._write_new()
        return self._conn

    @property
    def pending(self) -> int:
        """Rows waiting for a group commit (not counting a flight out)."""
        return len(self._group_rows) + len(self._unwritten)

    @property
    def uncommitted(self) -> int:
        """Rows not committed yet as far as the trio thread knows: those waiting, and those
        of a flight that has not landed (its COMMIT may still be running in its thread)."""
        return self.pending + len(self._flying)

    # -- the group commit in a worker thread -----------------------------------------------

    def take_flight(self) -> GroupCommit | None:
        """Hand the group commit's rows to a flight (None when there are none): the caller
        starts :meth:`write_flight` in a worker thread in the same trio step (a task that
        needs :attr:`conn` meanwhile waits for it without yielding), then calls
        :meth:`land`. Until then the rows are looked up in memory."""
        self._land()
        if not self._unwritten and not self._group:
            return None
        flight = GroupCommit(self._group_rows, sorted(self._unwritten.values()), self._group)
        self._group_rows, self._group = [], False
        self._unwritten = {}
        self._flight = flight
        self._flying = {row.hash: row for row in flight.rows}
        self._landed.clear()
        return flight

    def write_flight(self, flight: GroupCommit) -> None:
        """Write and commit ``flight``'s rows: the one method that runs in a worker thread,
        while the trio thread leaves the writing connection alone. A failure (disk full) is
        rolled back; :meth:`land` then gives the rows to :meth:`flush`'s row-by-row path."""
        c = self._conn
        wall, cpu = time.perf_counter(), time.thread_time()
        try:
            if not flight.opened:
                c.execute("BEGIN")
            if flight.new:
                self._write_rows(c, flight.new)
            c.execute("COMMIT")
            flight.ok = True
        except sqlite3.Error:
            with contextlib.suppress(sqlite3.Error):
                c.execute("ROLLBACK")
        finally:
            flight.wall, flight.cpu = time.perf_counter() - wall, time.thread_time() - cpu
            self._landed.set()

    def land(self) -> bool:
        """Settle the flight once :meth:`write_flight` returned; False when it failed (its
        rows are waiting again, for :meth:`flush`)."""
        flight = self._flight
        self._land()
        return flight is None or flight.ok

    def _land(self) -> None:
        """Wait for a flight out to land (a commit's time at most) and settle it: its rows
        are in the table, or, when it failed, waiting again for the group commit."""
        flight = self._flight
        if flight is None:
            return
        self._landed.wait()
        self._flight, flying, self._flying = None, self._flying, {}
        if flight.ok:
            return
        unwritten, self._unwritten = self._unwritten, {}
        for row in flight.rows:
            if flying.get(row.hash) is row:  # not deleted or re-inserted meanwhile
                self._unwritten[row.hash] = row
        self._unwritten.update(unwritten)

    def _reading(self) -> sqlite3.Connection:
        """The connection for a lookup: the writing one, or while a flight is out, a
        read-only one (it sees what was committed; the flight's rows are in memory)."""
        if self._flight is None:
            return self._conn
        if self._reader is None:
            # As a URI, quoted: a cache directory may hold "?", "#" or "%".
            uri = Path(os.path.abspath(self.path)).as_uri() + "?mode=ro"
            self._reader = sqlite3.connect(uri, uri=True, isolation_level=None, timeout=5.0)
        return self._reader

    @contextlib.contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """``BEGIN`` … ``COMMIT``, rolled back if anything raises (e.g. "database or disk is
        full"), so a failed write never leaves a transaction open.

        Only new rows share a group commit: any other write commits the group first, so a
        failure can never take a delete, a pin or a mark down with it. References added by
        hits (:meth:`touch`) are written first too, so every write sees them."""
        self.write_refs()
        self.flush()
        self.conn.execute("BEGIN")
        try:
            yield self.conn
        except BaseException:
            with contextlib.suppress(sqlite3.Error):
                self.conn.execute("ROLLBACK")
            raise
        self.conn.execute("COMMIT")

    def flush(self) -> int:
        """Commit the open group commit, if any; the number of rows it held.

        Never raises for the rows: if the ``COMMIT`` fails (disk full) the group is rolled
        back and each row is inserted again on its own; a row that still fails is kept
        (:meth:`retry_lost`, :meth:`take_lost`)."""
        self._land()
        if self._unwritten:
            self._write_new()
        if not self._group:
            return 0
        rows, self._group_rows = self._group_rows, []
        self._group = False
        try:
            self._conn.execute("COMMIT")
            return len(rows)
        except sqlite3.Error:
            with contextlib.suppress(sqlite3.Error):
                self._conn.execute("ROLLBACK")
        for row in self.insert_now(rows):
            self._keep_lost(row)
        return len(rows)

    def insert_now(self, rows: Sequence[NewRow]) -> list[NewRow]:
        """Insert rows one transaction each (outside any group); those that failed."""
        failed = []
        for row in rows:
            try:
                with self.transaction() as c:
                    self._write_rows(c, [row])
            except sqlite3.Error:
                failed.append(row)
        return failed

    @property
    def lost(self) -> list[NewRow]:
        """Rows no insert could store (disk full), not written since (see ``_lost``)."""
        return list(self._lost.values())

    def retry_lost(self) -> int:
        """Insert the rows no insert could store (see ``_lost``) once more; how many still
        failed (they stay)."""
        rows, self._lost = list(self._lost.values()), {}
        failed = self.insert_now(rows)
        self.pinned_bytes += sum(r.size for r in set(rows) - set(failed) if r.pinned)
        for row in failed:
            self._lost[row.hash] = row
        return len(self._lost)

    def _keep_lost(self, row: NewRow) -> None:
        """``row`` could not be written: keep it for :meth:`retry_lost`; its pin, if it had
        one, counts again only once it is written (``pinned_bytes`` counts rows that are in
        the table or about to be)."""
        self._lost[row.hash] = row
        if row.pinned:
            self.pinned_bytes -= row.size

    def take_lost(self) -> list[NewRow]:
        """The rows no insert could store (see ``_lost``), which the index forgets."""
        lost, self._lost = list(self._lost.values()), {}
        for row in lost:
            self._known.pop(row.hash, None)
        return lost

    # -- opening -------------------------------------------------------------------------

    @classmethod
    def open(cls, path: Path) -> Index:
        """Open (creating if absent) the index at ``path``; :class:`IndexCorrupt` if unusable.

        A new index file is created ``0600`` before SQLite opens it: SQLite makes ``-wal``
        and ``-shm`` with the database file's mode, and its own default is ``0644``."""
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, PRIVATE_FILE)
            os.close(fd)
            # Not check_same_thread: the group commit is written in a worker thread, never
            # while the trio thread uses the connection (the module docstring).
            conn = sqlite3.connect(path, isolation_level=None, timeout=5.0,
                                   check_same_thread=False)
        except (OSError, sqlite3.Error) as exc:
            raise IndexCorrupt(f"cannot open {path}: {exc}") from exc
        try:
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=NORMAL")
            conn.execute("PRAGMA temp_store=MEMORY")
            conn.execute("PRAGMA cache_size=-65536")  # 64 MiB page cache
            conn.execute("PRAGMA mmap_size=268435456")
            # The WAL is folded back by the cache's checkpoints, in a worker thread
            # (:meth:`fold_wal`): SQLite's own, inside whichever commit passes 1000 pages,
            # stalled the trio thread for milliseconds (and fsynced) every few hundred fills.
            conn.execute("PRAGMA wal_autocheckpoint=0")
            # A checkpoint that falls behind (a burst of evictions, a full disk) grows the
            # log, and SQLite keeps the file at its high-water mark: a soak left a 67 MiB
            # WAL beside a 15 MiB cache. Truncated back to this when the log restarts.
            conn.execute(f"PRAGMA journal_size_limit={WAL_BYTES}")
            conn.executescript(SCHEMA)
            row = conn.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
            if row is None:
                conn.execute("BEGIN")
                conn.executemany(
                    "INSERT OR REPLACE INTO meta VALUES (?, ?)",
                    [
                        ("schema_version", str(SCHEMA_VERSION)),
                        ("layout_version", str(LAYOUT_VERSION)),
                    ],
                )
                conn.execute("COMMIT")
            elif row[0] != str(SCHEMA_VERSION):
                raise IndexCorrupt(f"{path} has schema version {row[0]}, expected {SCHEMA_VERSION}")
        except sqlite3.Error as exc:
            conn.close()
            raise IndexCorrupt(f"unusable index {path}: {exc}") from exc
        except IndexCorrupt:
            conn.close()
            raise
        return cls(conn, path)

    def is_clean(self) -> bool:
        """True when the last owner shut down cleanly (the index matches the store)."""
        row = self.conn.execute("SELECT value FROM meta WHERE key='clean'").fetchone()
        return row is not None and row[0] == "1"

    def set_clean(self, clean: bool) -> None:
        """Record (durably: one fsync'd commit) whether the index matches the store.

        Marking dirty at open must reach the disk before any store change, or a power cut
        could leave a "clean" index next to files it does not know.
        """
        self.flush()
        self.conn.execute("PRAGMA synchronous=FULL")
        try:
            self.conn.execute(
                "INSERT OR REPLACE INTO meta (key, value) VALUES ('clean', ?)",
                ("1" if clean else "0",),
            )
        finally:
            self.conn.execute("PRAGMA synchronous=NORMAL")

    def close(self) -> None:
        """Checkpoint and close (the WAL is folded back so a copy of the file is complete)."""
        self._land()
        with contextlib.suppress(sqlite3.Error):
            self.write_touches(len(self._touched))
            self.flush()
            self.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        if self._reader is not None:
            self._reader.close()
            self._reader = None
        self._conn.close()
        with self._folding:
            if self._folder is not None:
                self._folder.close()
                self._folder = None

    def fold_wal(self) -> None:
        """Copy the committed pages of the write-ahead log back into the database file
        (``PRAGMA wal_checkpoint(PASSIVE)``), so the log stays small. Blocks on the disk:
        meant for a worker thread. Uses a connection of its own (the one exception to
        "SQLite in the trio thread only"); a passive checkpoint never blocks the writer."""
        with self._folding:
            if self._folder is None:
                self._folder = sqlite3.connect(self.path, isolation_level=None, timeout=5.0,
                                               check_same_thread=False)
            self._folder.execute("PRAGMA wal_checkpoint(PASSIVE)")

    def get_meta(self, key: str) -> str | None:
        """The value of ``meta.key`` (None when unset)."""
        row = self.conn.execute("SELECT value FROM meta WHERE key=?", (key,)).fetchone()
        return None if row is None else row[0]

    def set_meta(self, key: str, value: str, *, durable: bool = False) -> None:
        """Set ``meta.key`` in one transaction, durable at once (an fsync'd commit) or at the
        next checkpoint."""
        if durable:
            self.conn.execute("PRAGMA synchronous=FULL")
        try:
            with self.transaction() as c:
                c.execute("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", (key, value))
        finally:
            if durable:
                self.conn.execute("PRAGMA synchronous=NORMAL")

    def durable_mark(self) -> tuple[int | None, str | None]:
        """``(synced_through, boot_id)`` of the last durable checkpoint (None: never made).

        Every row whose ``added`` stamp is at most ``synced_through`` had its file on the
        disk when that checkpoint's ``syncfs`` returned, during the boot ``boot_id``."""
        values = dict(self.conn.execute(
            "SELECT key, value FROM meta WHERE key IN ('synced_through', 'boot_id')"))
        through = values.get("synced_through")
        return (int(through) if through is not None else None), values.get("boot_id")

    def set_durable_mark(self, synced_through: int, boot_id: str | None) -> None:
        """Record a durable checkpoint (its commit becomes durable at the next checkpoint: the
        record on disk is only ever *older* than the truth, which errs on the side of
        verifying)."""
        with self.transaction() as c:
            c.executemany(
                "INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)",
                [("synced_through", str(synced_through)), ("boot_id", boot_id or "")],
            )

    def added_since(self, stamp: int | None) -> list[tuple[bytes, int]]:
        """``(hash, size)`` of rows added after ``stamp`` (every row when None)."""
        if stamp is None:
            return self.conn.execute("SELECT hash, size FROM entries").fetchall()
        return self.conn.execute(
            "SELECT hash, size FROM entries WHERE added > ?", (stamp,)).fetchall()

    # -- time ----------------------------------------------------------------------------

    def now(self) -> int:
        """A last-use stamp: wall-clock ns, forced strictly increasing within this run."""
        self._clock = max(time.time_ns(), self._clock + 1)
        return self._clock

    def seed_clock(self) -> None:
        """Continue after the newest stamp on disk (the wall clock may have gone back)."""
        row = self.conn.execute("SELECT MAX(last_use) FROM entries").fetchone()
        self._clock = max(self._clock, row[0] or 0)

    # -- entries -------------------------------------------------------------------------

    def size_of(self, hash: bytes) -> int | None:
        """The size of an indexed hash, or None."""
        size = self._size_in_memory(hash)
        if size is not _UNKNOWN:
            return size  # type: ignore[return-value]
        row = self._reading().execute("SELECT size FROM entries WHERE hash=?", (hash,)).fetchone()
        if row is None:
            return None
        self._remember(hash, row[0])
        return row[0]

    def _size_in_memory(self, hash: bytes) -> int | None | object:
        """What :meth:`size_of` can answer without SQLite: a row not written yet or lost,
        a row being deleted (None), a size kept in memory; :data:`_UNKNOWN` otherwise."""
        new = self._unwritten.get(hash)
        if new is not None:
            return new.size
        if self._flying:
            flying = self._flying.get(hash)
            if flying is not None:
                return flying.size
        if self._lost:
            lost = self._lost.get(hash)
            if lost is not None:
                return lost.size
        if self.deleting and hash in self.deleting:
            return None
        known = self._known.get(hash)
        return _UNKNOWN if known is None else known[0]

    def absent(self, hashes: Sequence[bytes]) -> list[bytes]:
        """Those of ``hashes`` not indexed, in their order: what :meth:`size_of` would answer
        None for, with one query for all those it does not know in memory (a prefetch
        request names dozens of files; a query each cost more than the rest of its work)."""
        unknown = []
        out: dict[bytes, bool] = {}
        for hash in hashes:
            size = self._size_in_memory(hash)
            out[hash] = size is None or size is _UNKNOWN
            if size is _UNKNOWN:
                unknown.append(hash)
        conn = self._reading()
        for at in range(0, len(unknown), BATCH):
            part = unknown[at:at + BATCH]
            marks = ",".join("?" * len(part))
            for hash, size in conn.execute(
                    f"SELECT hash, size FROM entries WHERE hash IN ({marks})", part):
                out[hash] = False
                self._remember(hash, size)
        return [hash for hash in hashes if out[hash]]

    def _remember(self, hash: bytes, size: int, dataset: str | None = None) -> None:
        known = self._known
        if len(known) >= KNOWN_SIZES:
            del known[next(iter(known))]
        known[hash] = (size, dataset)

    def insert(self, hash: bytes, size: int, dataset: str | None, uid: int | None = None) -> None:
        """Index a freshly stored file (and its dataset reference, and the uid it is charged
        to: ``owners``).

        The row is held in memory until anything else touches the tables (:attr:`conn`) or
        the group commit is flushed: then every such row is written at once, into the open
        *group commit* (one transaction that many fills share, committed by :meth:`flush`:
        the cache flushes every ``GROUP_COMMIT_DELAY``, and before every durable checkpoint;
        any other write flushes it first). :meth:`size_of` sees it at once. Writing rows one
        by one, each in a savepoint, cost ~40 µs of the trio thread a fill; a batch costs a
        fraction (2026-11-28). Durability is not lost either way (``synchronous=NORMAL``
        never made a single commit durable; the cache's checkpoints do, docs/store-layout.md
        "Durability"). A row that cannot be written (disk full) is kept (:meth:`retry_lost`)."""
        old = self._unwritten.pop(hash, None)  # re-inserted: it goes last, as its stamp says
        if old is None and self._flying:
            old = self._flying.pop(hash, None)  # its flight may still write it: no matter
        self.deleting.discard(hash)  # its new row replaces the one a delete left behind
        self._lost.pop(hash, None)
        pinned = old is not None and old.pinned
        if pinned and old.size != size:
            self.pinned_bytes += size - old.size
        self._unwritten[hash] = NewRow(hash, size, dataset, uid, self.now(), pinned)
        self._remember(hash, size, dataset)

    def _write_new(self) -> None:
        """Write every new row into the group commit (opening it): the batch in one
        savepoint, or, when that fails, row by row, a row that still fails kept (see
        ``_lost``)."""
        rows = list(self._unwritten.values())
        self._unwritten.clear()
        c = self._conn
        if not self._group:
            c.execute("BEGIN")
            self._group = True
        c.execute("SAVEPOINT rows")
        try:
            self._write_rows(c, sorted(rows))  # by hash: neighbours share pages
        except sqlite3.Error:
            with contextlib.suppress(sqlite3.Error):
                c.execute("ROLLBACK TO rows")
                c.execute("RELEASE rows")
            for row in rows:
                c.execute("SAVEPOINT row")
                try:
                    self._write_rows(c, [row])
                except sqlite3.Error:
                    with contextlib.suppress(sqlite3.Error):
                        c.execute("ROLLBACK TO row")
                        c.execute("RELEASE row")
                    self._keep_lost(row)
                    continue
                c.execute("RELEASE row")
                self._group_rows.append(row)
            return
        c.execute("RELEASE rows")
        self._group_rows.extend(rows)

    @staticmethod
    def _write_rows(c: sqlite3.Connection, rows: Sequence[NewRow]) -> None:
        c.executemany(
            "INSERT INTO entries (hash, size, last_use, added, pinned) VALUES (?, ?, ?, ?, ?) "
            "ON CONFLICT (hash) DO UPDATE SET size=excluded.size, last_use=excluded.last_use, "
            "added=excluded.added, pinned=MAX(pinned, excluded.pinned)",
            [(r.hash, r.size, r.stamp, r.stamp, int(r.pinned)) for r in rows],
        )
        refs = [(r.dataset, r.hash) for r in rows if r.dataset is not None]
        if refs:
            c.executemany("INSERT OR IGNORE INTO refs (dataset, hash) VALUES (?, ?)", refs)
        owners = [(r.hash, r.uid, r.size, r.stamp) for r in rows if r.uid is not None]
        if owners:
            c.executemany("INSERT INTO owners (hash, uid, size, stamp) VALUES (?, ?, ?, ?) "
                          "ON CONFLICT (hash) DO UPDATE SET uid=excluded.uid, size=excluded.size, "
                          "stamp=excluded.stamp", owners)

    def adopt(self, rows: Sequence[tuple[bytes, int, int]]) -> None:
        """Index files found on disk without rows: ``(hash, size, mtime_ns)`` each.

        Rows go in sorted by hash: B-tree appends instead of random inserts (measured: a
        million rows in ~10 s on a 2-core VM; dropping and rebuilding the LRU index instead
        was no faster)."""
        with self.transaction() as c:
            c.executemany(
                "INSERT OR REPLACE INTO entries (hash, size, last_use, added, pinned) "
                "VALUES (?, ?, ?, ?, 0)",
                [(h, size, mtime, mtime) for h, size, mtime in sorted(rows)],
            )

    def touch(self, hashes: Sequence[bytes], dataset: str | None) -> None:
        """Mark ``hashes`` used now (LRU) and referenced by ``dataset``; unknown hashes are
        ignored.

        Hits are the hot path (a DataLoader reading cached files reports tens of thousands
        a second), and writing ``last_use`` costs SQLite ~15 µs a row on this kind of
        machine (the row and its ``entries_lru`` key are rewritten), as much as reading the
        file. So a hit's recency stays in memory (~0.3 µs) and reaches the table only when
        it matters:

        * eviction (:meth:`least_recent`) writes the recency of the rows it meets at the
          cold end before choosing, so the order is exactly LRU;
        * past :data:`TOUCH_MEMORY` hashes the oldest are written (:meth:`write_touches`,
          called by the cache), and all of them when the index closes.

        A crash forgets the recency of hits still in memory (those files look as old as
        their last written use), never an entry. A reference a hit adds is written within
        a second (the cache calls :meth:`write_refs`), and before anything reads ``refs``
        or writes."""
        if not hashes:
            return
        stamp = self.now()
        touched = self._touched
        pop = touched.pop
        sizes = self._known
        for h in hashes:
            known = pop(h, (0, None))[1]  # re-inserted: the dict stays in stamp order
            if known is None and (stored := sizes.get(h)) is not None:
                known = stored[1]  # a file just stored: its row came with the reference
            if dataset is not None and known != dataset:
                self._touched_refs.add((dataset, h))
                known = dataset
            touched[h] = (stamp, known)

    @property
    def touches_waiting(self) -> int:
        """Hashes whose recency is in memory only (see :meth:`touch`)."""
        return len(self._touched)

    def write_touches(self, count: int) -> int:
        """Write the recency of the ``count`` least recent hits held in memory and forget
        them there; the number written. Hits are advisory: a write that fails (disk full)
        is logged and dropped, never raised."""
        touched = self._touched
        rows = []
        for h in list(itertools.islice(touched, count)):
            rows.append((touched.pop(h)[0], h))
        self._write_stamps(rows)
        return len(rows)

    def _write_stamps(self, rows: list[tuple[int, bytes]]) -> None:
        if not rows:
            return
        self.write_refs()
        self.flush()
        # Never back: a fill may have stamped the row since (INSERT OR REPLACE).
        self._write_advisory("UPDATE entries SET last_use=?1 WHERE hash=?2 AND last_use<?1",
                             sorted(rows, key=lambda row: row[1]),  # neighbours share pages
                             f"the last use of {len(rows)} cached files")

    def _write_advisory(self, sql: str, rows: list[tuple], what: str) -> None:
        """``sql`` over ``rows`` in one transaction, for what hits noted (recency,
        references): advisory, so a failure is rolled back and logged, never raised."""
        c = self.conn
        try:
            c.execute("BEGIN")
            try:
                c.executemany(sql, rows)
            except BaseException:
                with contextlib.suppress(sqlite3.Error):
                    c.execute("ROLLBACK")
                raise
            c.execute("COMMIT")
        except sqlite3.Error as exc:
            # A full disk is a moment the cache deals with (it evicts); anything else is news.
            log.log(logging.DEBUG if is_full(exc) else logging.WARNING,
                    "could not record %s: %s", what, exc)

    def write_refs(self) -> int:
        """Write the dataset references that hits added (:meth:`touch`); how many. Like
        recency they are advisory: a failed write is logged, never raised."""
        refs = self._touched_refs
        if not refs:
            return 0
        self._touched_refs = set()
        self.flush()
        self._write_advisory("INSERT OR IGNORE INTO refs (dataset, hash) "
                             "SELECT ?, hash FROM entries WHERE hash=?", sorted(refs),
                             f"{len(refs)} dataset references of cached files")
        return len(refs)

    def set_pinned(self, hashes: Sequence[bytes], pinned: bool) -> int:
        """Pin or unpin indexed hashes; returns rows changed.

        Pinning a row still held for the group commit (:meth:`insert`) marks it in memory, to
        be written pinned with its batch: a loading chunk pins every file as it lands, and a
        transaction per file (which also committed the group) made an insert and its pin
        86–111 µs of CPU against 20–21 µs (docs/store-layout.md). Only a hash with no row in
        the table yet takes that path; anything else, and every unpin, is written at once."""
        self._land()
        changed = moved = 0
        if pinned and self._unwritten:
            hashes, changed, moved = self._pin_unwritten(hashes)
        if hashes:
            c = self.conn
            with self.transaction():
                for part in batched(hashes):
                    marks = ",".join("?" * len(part))
                    moved += c.execute(
                        f"SELECT COALESCE(SUM(size), 0) FROM entries WHERE pinned!=? AND hash IN ({marks})",
                        (int(pinned), *part)).fetchone()[0]
                    changed += c.execute(
                        f"UPDATE entries SET pinned=? WHERE hash IN ({marks})", (int(pinned), *part)
                    ).rowcount
        self.pinned_bytes += moved if pinned else -moved
        return changed

    def _pin_unwritten(self, hashes: Sequence[bytes]) -> tuple[list[bytes], int, int]:
        """Mark the unwritten rows of ``hashes`` that have no row in the table yet pinned;
        ``(the other hashes, rows marked, bytes newly pinned)``."""
        rest: list[bytes] = []
        changed = moved = 0
        for hash in hashes:
            row = self._unwritten.get(hash)
            if row is None or self._conn.execute(
                    "SELECT 1 FROM entries WHERE hash=?", (hash,)).fetchone() is not None:
                rest.append(hash)
                continue
            changed += 1
            if not row.pinned:
                self._unwritten[hash] = row._replace(pinned=True)
                moved += row.size
        return rest, changed, moved

    def pinned_of(self, hashes: Sequence[bytes]) -> set[bytes]:
        """Those of ``hashes`` that are indexed and pinned."""
        out: set[bytes] = set()
        for part in batched(hashes):
            marks = ",".join("?" * len(part))
            out.update(
                row[0]
                for row in self.conn.execute(
                    f"SELECT hash FROM entries WHERE pinned=1 AND hash IN ({marks})", tuple(part)
                )
            )
        return out

    def delete(self, hashes: Sequence[bytes]) -> bool:
        """Drop entries and every reference to them (dataset references, owners); False when
        the disk had no room for it.

        On a full disk SQLite cannot grow its log for the delete ("database or disk is
        full"). The cache deletes rows right after unlinking their files, which usually gives
        the log its room, but not while someone still has an evicted file open (its blocks
        stay allocated) or another fill takes the freed space first. Such rows are kept in
        :attr:`deleting` instead: hidden from :meth:`size_of` and :meth:`least_recent`,
        replaced by a new :meth:`insert` of their hash, and deleted by :meth:`retry_deletes`
        (the cache calls it with every group commit). A crash meanwhile leaves rows without
        files, which recovery drops (docs/store-layout.md, state C). Other SQLite errors
        raise."""
        self._land()
        for h in hashes:
            self._touched.pop(h, None)
            self._lost.pop(h, None)
            self._known.pop(h, None)
        try:
            self._delete(hashes)
        except sqlite3.Error as exc:
            if not is_full(exc):
                raise
            self.deleting.update(hashes)
            return False
        if self.deleting:
            self.deleting.difference_update(hashes)
        return True

    def retry_deletes(self) -> bool:
        """Delete the rows :meth:`delete` had to leave (see there); True when none is left."""
        if not self.deleting:
            return True
        hashes = list(self.deleting)
        try:
            self._delete(hashes)
        except sqlite3.Error as exc:
            if not is_full(exc):
                raise
            return False
        self.deleting.difference_update(hashes)
        return not self.deleting

    def _delete(self, hashes: Sequence[bytes]) -> None:
        c = self.conn
        unpinned = 0
        with self.transaction():
            for part in batched(hashes):
                marks = ",".join("?" * len(part))
                # The deleted rows' pinned bytes come back with the delete (pinned is 0 or 1).
                unpinned += sum(size for (size,) in c.execute(
                    f"DELETE FROM entries WHERE hash IN ({marks}) RETURNING size * pinned",
                    tuple(part)))
                c.execute(f"DELETE FROM refs WHERE hash IN ({marks})", tuple(part))
                c.execute(f"DELETE FROM owners WHERE hash IN ({marks})", tuple(part))
        self.pinned_bytes -= unpinned

    def lru(self, limit: int, after: tuple[int, bytes] = (-1, b"")) -> list[tuple[bytes, int, int]]:
        """Up to ``limit`` evictable ``(hash, size, last_use)`` after the ``(last_use, hash)``
        cursor ``after``, oldest first (ties broken by hash, so equal stamps are not skipped),
        by the recency written to the table (see :meth:`least_recent`)."""
        stamp, hash = after
        return self.conn.execute(
            "SELECT hash, size, last_use FROM entries WHERE pinned=0 "
            "AND (last_use>? OR (last_use=? AND hash>?)) ORDER BY last_use, hash LIMIT ?",
            (stamp, stamp, hash, limit),
        ).fetchall()

    def least_recent(self, page: int = 256) -> Iterator[tuple[bytes, int]]:
        """Evictable ``(hash, size)``, least recently used first, counting the hits whose
        recency is still in memory (:meth:`touch`): rows met at the cold end that were hit
        since their ``last_use`` was written get it written now and are met again where it
        puts them. So eviction order is exact, and only hits of files about to be evicted
        cost a row write.

        Rows are read in pages that start at :data:`FIRST_LRU_PAGE` and grow fourfold up to
        ``page``: a full cache evicts about one file per fill, and reading 256 rows for it
        was 7% of mountd's CPU in a cold epoch at a 20% cache (peers.py, 2026-11-29); a
        search past many held or protected files still reaches full pages quickly."""
        touched = self._touched
        after: tuple[int, bytes] = (-1, b"")
        limit = min(FIRST_LRU_PAGE, page)
        while True:
            rows = self.lru(limit, after)
            stale = [(touched.pop(h)[0], h) for h, _, _ in rows if h in touched]
            if stale:
                self._write_stamps(stale)
                continue  # this page again: those rows moved to where their hits put them
            if not rows:
                return
            deleting = self.deleting
            for h, size, last_use in rows:
                after = (last_use, h)
                # A hit since this page was read makes it recent now; a row whose file is
                # gone already (see delete) is no victim.
                if h not in touched and h not in deleting:
                    yield h, size
            limit = min(page, limit * 4)

    def all_hashes(self) -> set[bytes]:
        """Every indexed hash (one full scan; also proves the table's pages are readable)."""
        return {row[0] for row in self.conn.execute("SELECT hash FROM entries")}

    def entries(self) -> list[tuple[bytes, int]]:
        """Every ``(hash, size)``."""
        return self.conn.execute("SELECT hash, size FROM entries").fetchall()

    def evictable(self) -> list[tuple[bytes, int]]:
        """Every unpinned ``(hash, size)``."""
        return self.conn.execute("SELECT hash, size FROM entries WHERE pinned=0").fetchall()

    def totals(self) -> tuple[int, int]:
        """``(entries, bytes)`` indexed."""
        count, total = self.conn.execute(
            "SELECT COUNT(*), COALESCE(SUM(size), 0) FROM entries"
        ).fetchone()
        return count, total

    # -- datasets ------------------------------------------------------------------------

    def refs_of(self, hashes: Sequence[bytes]) -> dict[bytes, list[str]]:
        """The datasets referencing each of ``hashes`` (absent when none)."""
        self.write_refs()
        out: dict[bytes, list[str]] = {}
        for part in batched(hashes):
            marks = ",".join("?" * len(part))
            for dataset, h in self.conn.execute(
                f"SELECT dataset, hash FROM refs WHERE hash IN ({marks})", tuple(part)
            ):
                out.setdefault(h, []).append(dataset)
        return out

    def exclusive_to(self, dataset: str) -> list[tuple[bytes, int]]:
        """Unpinned ``(hash, size)`` referenced by ``dataset`` and by no other dataset."""
        self.write_refs()
        return self.conn.execute(
            "SELECT e.hash, e.size FROM refs r JOIN entries e ON e.hash = r.hash "
            "WHERE r.dataset = ? AND e.pinned = 0 AND NOT EXISTS "
            "(SELECT 1 FROM refs o WHERE o.hash = r.hash AND o.dataset != r.dataset)",
            (dataset,),
        ).fetchall()

    def drop_refs(self, dataset: str, keep_pinned: bool = True) -> None:
        """Forget ``dataset``'s references (to pinned content too unless ``keep_pinned``)."""
        sql = "DELETE FROM refs WHERE dataset = ?"
        if keep_pinned:
            sql += " AND hash NOT IN (SELECT hash FROM entries WHERE pinned = 1)"
        self.write_refs()
        self.flush()
        self.conn.execute(sql, (dataset,))
        # A later hit must queue the reference again: nothing may remember it as written.
        for memory in (self._known, self._touched):
            for h, (first, known) in memory.items():
                if known == dataset:
                    memory[h] = (first, None)

    def drop_dangling_refs(self) -> int:
        """Delete references (and owners) of hashes that have no entry (after recovery
        dropped rows); returns the dataset references deleted."""
        self.write_refs()
        self.flush()
        self.conn.execute(
            "DELETE FROM owners WHERE NOT EXISTS (SELECT 1 FROM entries e WHERE e.hash = owners.hash)")
        return self.conn.execute(
            "DELETE FROM refs WHERE NOT EXISTS (SELECT 1 FROM entries e WHERE e.hash = refs.hash)"
        ).rowcount

    def register(self, dataset: str, info: dict) -> None:
        self.flush()
        self.conn.execute(
            "INSERT OR REPLACE INTO datasets (id, info, registered) VALUES (?, ?, ?)",
            (dataset, json.dumps(info, sort_keys=True, default=str), time.time_ns()),
        )

    def unregister(self, dataset: str) -> None:
        self.flush()
        self.conn.execute("DELETE FROM datasets WHERE id = ?", (dataset,))

    def dataset_usage(self) -> dict[str, dict]:
        """``{dataset: {"entries", "bytes", "registered", "info"}}`` for registered or referenced ones."""
        self.write_refs()
        out: dict[str, dict] = {}
        for dataset, info in self.conn.execute("SELECT id, info FROM datasets"):
            out[dataset] = {"entries": 0, "bytes": 0, "registered": True, "info": json.loads(info)}
        for dataset, count, total in self.conn.execute(
            "SELECT r.dataset, COUNT(*), COALESCE(SUM(e.size), 0) FROM refs r "
            "JOIN entries e ON e.hash = r.hash GROUP BY r.dataset"
        ):
            row = out.setdefault(dataset, {"registered": False, "info": {}})
            row["entries"], row["bytes"] = count, total
        return out

    def set_chunk(self, dataset: str, hashes: Iterable[bytes], chunk: int) -> None:
        """Record which chunk of ``dataset`` holds ``hashes`` (-1 = not chunked)."""
        self.write_refs()
        self.flush()
        self.conn.executemany(
            "UPDATE refs SET chunk = ? WHERE dataset = ? AND hash = ?",
            [(chunk, dataset, h) for h in hashes],
        )

    # -- owners: the uid each entry is charged to (mountd/store/quota.py) -------------------

    def charged(self) -> list[tuple[int, int, int]]:
        """``(uid, entries, bytes)`` charged to each uid (one scan of ``owners``)."""
        return self.conn.execute(
            "SELECT uid, COUNT(*), COALESCE(SUM(size), 0) FROM owners GROUP BY uid").fetchall()

    def owners_of(self, hashes: Sequence[bytes]) -> dict[bytes, int]:
        """The uid each of ``hashes`` is charged to (absent: charged to nobody)."""
        out: dict[bytes, int] = {}
        for part in batched(hashes):
            marks = ",".join("?" * len(part))
            out.update(self.conn.execute(
                f"SELECT hash, uid FROM owners WHERE hash IN ({marks})", tuple(part)))
        return out

    def owner_queue(self, uid: int, limit: int, after: tuple[int, bytes] = (-1, b"")
                    ) -> list[tuple[bytes, int, int, int, int]]:
        """Up to ``limit`` of the entries charged to ``uid`` after the ``(stamp, hash)`` cursor
        ``after``, by stamp: ``(hash, size, stamp, last_use, pinned)`` each (an index range
        on ``owners_queue``: a page costs its rows, whatever the uid holds). ``last_use``
        counts the hits whose recency is still in memory (:meth:`touch`)."""
        stamp, hash = after
        rows = self.conn.execute(
            "SELECT o.hash, o.size, o.stamp, e.last_use, e.pinned FROM owners o "
            "JOIN entries e ON e.hash = o.hash "
            "WHERE o.uid = ? AND (o.stamp, o.hash) > (?, ?) ORDER BY o.stamp, o.hash LIMIT ?",
            (uid, stamp, hash, limit),
        ).fetchall()
        touched = self._touched
        return [(h, size, queued, max(used, touched[h][0]) if h in touched else used, pinned)
                for h, size, queued, used, pinned in rows]

    def requeue(self, stamps: Sequence[tuple[int, bytes]]) -> None:
        """Give owners rows new queue stamps: ``(stamp, hash)`` each."""
        if not stamps:
            return
        with self.transaction() as c:
            c.executemany("UPDATE owners SET stamp = ? WHERE hash = ?", stamps)
