"""A shim's timing reports to mountd, sent off the training loop by a thread of the process.

A report (``batch`` after each mini-batch, ``epoch`` after each epoch; docs/control-protocol.md)
is a control-channel request: a ``getxattr`` through the mount that its main process answers,
about 1.2 ms on the 2-core VM. The sampler runs in the DataLoader's main process, inside the
training loop's wait for its next batch, so each report sent there was data wait: 0.115 s
of a DELI job's 0.40 s (`papers.py --sections deli`, 94 reports of 16-file batches).
:class:`TimingReports` queues them for one thread, which sends them in order.

Reports are advisory, as before: one the mount refuses or cannot take is dropped, and so is
a report queued while :data:`MAX_QUEUED` wait. The queue and its thread belong to the
process that made them; a forked child that reports starts its own.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from collections import deque
from typing import Any

from quiverfs.client.control_client import ControlClient

__all__ = ["CLOSE_WAIT", "MAX_QUEUED", "TimingReports"]

log = logging.getLogger("quiverfs.shim")

#: Reports kept at most while the thread is behind; more are dropped.
MAX_QUEUED = 10_000
#: Seconds :meth:`TimingReports.flush` waits by default (the sampler's close).
CLOSE_WAIT = 2.0

_READS = ("files", "misses")


class TimingReports:
    """The reports of one rank of one job on the mount behind ``control``."""

    def __init__(self, control: ControlClient, job: str, rank: int) -> None:
        self.control = control
        self.job = job
        self.rank = rank
        #: False once the mount refused a batch report's files/misses (a mount older than
        #: them: EINVAL); later reports carry the time alone
        self.send_reads = True
        #: Reports dropped because too many were waiting
        self.dropped = 0
        self._pid = -1
        self._reset()

    def _reset(self) -> None:
        """New queue, lock and (later) thread for this process: a fork copies neither a
        thread nor, safely, a lock another thread held."""
        self._pid = os.getpid()
        self._queue: deque[tuple[str, dict[str, Any]]] = deque()
        self._cond = threading.Condition()
        self._busy = False
        self._thread: threading.Thread | None = None

    def send(self, op: str, **args: Any) -> int | None:
        """Send one report now; the errno when the mount refused it (None: recorded). A
        batch report's ``files``/``misses`` are left out once the mount has refused them."""
        if op == "batch" and args.get("files") is not None:
            if self.send_reads:
                refused = self._request(op, args)
                if refused != errno.EINVAL:
                    return refused
                self.send_reads = False
            args = {k: v for k, v in args.items() if k not in _READS}
        return self._request(op, args)

    def put(self, op: str, **args: Any) -> None:
        """Queue one report for the thread (started at the first)."""
        if self._pid != os.getpid():
            self._reset()
        with self._cond:
            if len(self._queue) >= MAX_QUEUED:
                self.dropped += 1
                return
            self._queue.append((op, args))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="quiverfs-timing-reports",
                                                daemon=True)
                self._thread.start()
            self._cond.notify()

    def flush(self, timeout: float = CLOSE_WAIT) -> bool:
        """Wait up to ``timeout`` seconds until every queued report was sent; whether they
        were."""
        if self._pid != os.getpid():
            return True  # nothing of this process's was queued
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._queue or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def _run(self) -> None:
        cond = self._cond
        while True:
            with cond:
                while not self._queue:
                    cond.wait()
                op, args = self._queue.popleft()
                self._busy = True
            try:
                self.send(op, **args)
            except Exception:  # advisory: a report never takes the thread down
                log.debug("a %s report failed", op, exc_info=True)
            finally:
                with cond:
                    self._busy = False
                    cond.notify_all()

    def _request(self, op: str, args: dict[str, Any]) -> int | None:
        try:
            self.control.request(op, job=self.job, rank=self.rank, **args)
        except OSError as exc:
            return exc.errno
        return None
