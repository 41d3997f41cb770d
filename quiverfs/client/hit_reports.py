"""Hits read straight from the store, reported to mountd in batches by a thread of the process.

A direct read (:mod:`quiverfs.client.direct`) never asks mountd for anything, so mountd's LRU
recency and the hit counters of ``quiverfs stats`` would not see it. Each store file opened
is noted here and sent as one ``hits`` request per dataset every :data:`FLUSH_HITS` hits or
:data:`FLUSH_SECONDS` seconds (docs/mountd-protocol.md, ``hits`` with ``packed``).

Every read pays for :meth:`HitReporter.add`, so a hit is kept the way the request carries
it: its 32 hash bytes appended to the dataset's ``bytearray`` and its size to an
``array('q')``. Both appends are one C call each under the GIL, so the reading thread never
takes a lock, and the sender takes what has accumulated as a prefix (copy, then delete that
many bytes) with no loop over hits. That keeps the reporter's share of a warm 110 KiB read
to ~0.3 µs in the reader and a C-speed ``hex()`` in the sender; a queue of per-hit tuples
cost a few µs a hit, measured in scripts/bench/direct_loader.py.

Reports are advisory: a read never waits for mountd, and hits are dropped (counted, logged
once) while mountd is away, slow, or when more than :data:`MAX_QUEUED` are waiting.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from array import array

from mountd.rpc.client import SyncClient
from quiverfs.base.errors import QuiverError

__all__ = ["HitReporter"]

log = logging.getLogger("quiverfs.direct")

#: Hits noted before the reporter thread is woken to send them.
FLUSH_HITS = 1024
#: Seconds between two reports while hits come in slower than FLUSH_HITS.
FLUSH_SECONDS = 1.0
#: Hashes per ``hits`` message (mountd takes at most 100,000 items in one).
REPORT_BATCH = 50_000
#: Hits kept at most per dataset while mountd does not answer; more are dropped.
MAX_QUEUED = 200_000
#: Seconds to connect to mountd; seconds after a failure before it is tried again (reports
#: in between are dropped rather than delaying anything).
CONNECT_TIMEOUT = 1.0
RETRY_SECONDS = 5.0
#: Seconds ``close()`` (and a process's exit) waits for its last report to be answered.
CLOSE_WAIT = 2.0

HASH = 32

_logged: set[str] = set()


def log_once(key: str, message: str, *args: object) -> None:
    """Warn about ``key`` once per process: a fallback that holds for one file holds for
    the next thousand, and a log line per read would bury the job's own output."""
    if key not in _logged:
        _logged.add(key)
        log.warning(message, *args)


class _Pending:
    """One dataset's hits not yet sent: hashes back to back, and their sizes."""

    __slots__ = ("hashes", "sizes")

    def __init__(self) -> None:
        self.hashes = bytearray()
        self.sizes = array("q")

    def take(self) -> tuple[bytes, int, int]:
        """``(hashes, hits, bytes)`` noted so far, removed from here. Safe against
        :meth:`HitReporter.add` in other threads: only the prefix copied is deleted, so a hit
        noted in between stays for the next report (its hash or its size may go one report
        apart from the other; the totals stay exact)."""
        hashes = bytes(self.hashes)
        del self.hashes[: len(hashes)]
        count = len(self.sizes)
        nbytes = sum(self.sizes[:count])
        del self.sizes[:count]
        return hashes, len(hashes) // HASH, nbytes

    def drop_over(self, limit: int) -> int:
        """Forget the newest hits beyond ``limit``; how many went."""
        over = len(self.hashes) // HASH - limit
        if over <= 0:
            return 0
        del self.hashes[limit * HASH :]
        del self.sizes[limit:]
        return over


class HitReporter:
    """Hits read from one cache's store, batched and sent to its mountd by a thread of their own.

    :meth:`add` appends (no lock: a read never waits for mountd); the thread sends every
    ``every`` hits or ``seconds`` seconds, as requests whose answer says mountd recorded
    them, so :meth:`flush` knows when they arrived. When mountd is away or slow, hits are
    dropped and counted, never kept as a backlog: they are advisory (LRU recency,
    statistics), and the mount drops its own the same way.
    """

    def __init__(self, cache_dir: str, every: int = FLUSH_HITS, seconds: float = FLUSH_SECONDS) -> None:
        self.cache_dir = cache_dir
        self._limit = max(1, every) * HASH
        self._seconds = seconds
        self._pending: dict[str, _Pending] = {}
        self._wake = threading.Event()
        self._lock = threading.Lock()  # starting the thread, and the flush generations
        self._flushed = threading.Condition(self._lock)
        self._asked = 0  #: flushes asked for so far
        self._done = 0  #: the last flush generation the thread finished
        self._thread: threading.Thread | None = None
        self._closing = False
        self.reported = 0  #: hits mountd said it recorded
        self.dropped = 0  #: hits lost: mountd away or refusing them, or too many queued
        self._client: SyncClient | None = None
        self._retry_at = 0.0

    def add(self, dataset: str, content_hash: bytes, size: int) -> None:
        """Note one hit (a store file opened for ``dataset``). Every read pays this, so it
        is two appends and a length check; the rest waits for every ``every`` hits."""
        pending = self._pending.get(dataset)
        if pending is None:
            pending = self._pending.setdefault(dataset, _Pending())
        pending.hashes += content_hash
        pending.sizes.append(size)
        if len(pending.hashes) >= self._limit or self._thread is None:
            self._poke(pending)

    def start(self) -> None:
        """Start the thread and its connection to mountd now, before the first hit (a
        reader that knows it will read, e.g. :meth:`~quiverfs.client.direct.DirectReader.prepare`,
        keeps the connection's set-up out of its reads)."""
        self._start()
        self._wake.set()

    def _poke(self, pending: _Pending) -> None:
        """Start the thread, drop what is over :data:`MAX_QUEUED` (everything after close),
        and wake the thread to send the rest."""
        if self._thread is None:
            self._start()
        self.dropped += pending.drop_over(0 if self._closing else MAX_QUEUED)
        if len(pending.hashes) >= self._limit and not self._wake.is_set():
            self._wake.set()

    def flush(self, timeout: float = CLOSE_WAIT) -> bool:
        """Send what is noted and wait (at most ``timeout`` seconds) for mountd's answer;
        True when every hit noted before the call was recorded by mountd."""
        thread = self._thread
        if thread is None or not thread.is_alive():
            return not any(p.hashes for p in self._pending.values())  # never started, or closed
        dropped = self.dropped
        with self._lock:
            self._asked += 1
            generation = self._asked
        self._wake.set()
        with self._flushed:
            done = self._flushed.wait_for(lambda: self._done >= generation, timeout)
        return done and self.dropped == dropped

    def close(self, timeout: float = CLOSE_WAIT) -> None:
        """Send the last hits (waiting at most ``timeout`` seconds) and stop the thread."""
        self._closing = True
        thread = self._thread
        if thread is not None:
            self._wake.set()
            thread.join(timeout)

    def _start(self) -> None:
        with self._lock:
            if self._thread is None:
                thread = threading.Thread(target=self._run, name=f"quiverfs-hits-{os.getpid()}",
                                          daemon=True)
                thread.start()
                self._thread = thread

    # -- the reporter's thread ---------------------------------------------------------------

    def _run(self) -> None:
        self._connect()
        while True:
            self._wake.wait(self._seconds)
            self._wake.clear()
            closing = self._closing  # read before draining: what close() waits for is drained
            with self._lock:
                generation = self._asked  # every hit noted before these flushes is drained now
            self._drain()
            with self._flushed:
                self._done = generation
                self._flushed.notify_all()
            if closing:
                self._disconnect()
                return

    def _drain(self) -> None:
        """Send every dataset's hits noted so far."""
        for dataset, pending in list(self._pending.items()):
            hashes, count, nbytes = pending.take()
            if count:
                recorded = self._send(dataset, hashes, nbytes)
                self.reported += recorded
                self.dropped += count - recorded

    def _send(self, dataset: str, hashes: bytes, nbytes: int) -> int:
        """Report ``hashes`` of ``dataset``; how many mountd recorded (0 when it is away)."""
        recorded = 0
        step = REPORT_BATCH * HASH
        for start in range(0, len(hashes), step):
            part = hashes[start : start + step]
            client = self._connect()
            if client is None:
                break
            # The bytes go with the first part: the totals stay exact, a split is rare.
            args = {"packed": part.hex(), "bytes": nbytes if start == 0 else 0, "dataset": dataset}
            try:
                recorded += int(client.call("hits", args)["recorded"])
            except (QuiverError, OSError, KeyError, TypeError, ValueError) as exc:
                self._failed(exc)
        return recorded

    def _connect(self) -> SyncClient | None:
        if self._client is None and time.monotonic() >= self._retry_at:
            try:
                self._client = SyncClient.connect(self.cache_dir, timeout=CONNECT_TIMEOUT)
            except (QuiverError, OSError) as exc:
                self._failed(exc)
        return self._client

    def _failed(self, exc: BaseException) -> None:
        log_once(f"mountd:{self.cache_dir}",
                 "direct reads: hit reports to mountd of %s are dropped while it does not take "
                 "them (%s); reads go on", self.cache_dir, exc)
        self._disconnect()
        self._retry_at = time.monotonic() + RETRY_SECONDS

    def _disconnect(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None
