"""The mount's worker processes as a pool: forked, watched, and replaced when one dies.

A worker that dies (killed, SIGBUS, a crash in Python) takes with it the request it was
handling, and the kernel would wait for that answer forever: the reader hangs, and so does
everything that waits for that inode. Each worker publishes the unique id of the request in
hand in shared memory (``SharedCounters.in_flight``, before it does anything with it); when a worker dies, the main process answers that request with ``EIO`` on the
shared ``/dev/fuse`` descriptor, logs one line, counts an error and forks a replacement into
the same slot. Answering a request that was already answered is harmless: the kernel
refuses the second answer with ENOENT (request ids are never reused on a connection).

Left open: a worker killed in the few bytecodes between its ``read`` returning and the
publication of the id leaves that one request unanswered (until the mount is unmounted).
A SIGBUS or a Python crash always happens after it.

Restarts are bounded (:data:`MAX_RESTARTS` in :data:`RESTART_WINDOW` seconds): a worker that
cannot live (its digest copy destroyed, say) is not forked forever. Its slot is then retired;
when no worker is left, :meth:`WorkerPool.watch` returns and the mount ends, which is better
than a mount that takes requests and never answers them.

Death is noticed through a pidfd per worker (Linux >= 5.3), polled with ``waitpid`` where
there are none.
"""

from __future__ import annotations

import errno
import logging
import os
import signal
import time
from collections import deque
from collections.abc import Callable
from contextlib import suppress

import trio

from quiverfs import fuse_wire, fuse_worker

log = logging.getLogger("quiverfs.mount")

#: Most replacements in :data:`RESTART_WINDOW` seconds.
MAX_RESTARTS = 10
RESTART_WINDOW = 60.0

#: Seconds between two ``waitpid`` polls where pidfds are not available.
POLL_INTERVAL = 0.1


class WorkerPool:
    """``count`` workers running ``target(slot)`` (slots 1..count) on ``fuse_fd``."""

    def __init__(self, count: int, target: Callable[[int], None],
                 counters: fuse_worker.SharedCounters, fuse_fd: int) -> None:
        self.count = count
        self.target = target
        self.counters = counters
        self.fuse_fd = fuse_fd
        self.workers: dict[int, int] = {}  # slot -> pid of the live worker in it
        self.stopping = False
        self.gave_up = False  #: a worker died and was not replaced (too many restarts)
        self._restarts: deque[float] = deque()

    @property
    def pids(self) -> list[int]:
        """The live workers' pids."""
        return list(self.workers.values())

    def start(self) -> None:
        """Fork the workers."""
        for slot in range(1, self.count + 1):
            self.workers[slot] = fuse_worker.fork_worker(slot, self.target)

    async def watch(self) -> None:
        """Replace workers that die, until none is left (the mount ended, or they could not
        be kept alive)."""
        async with trio.open_nursery() as nursery:
            for slot in list(self.workers):
                nursery.start_soon(self._watch_slot, slot)

    async def _watch_slot(self, slot: int) -> None:
        while slot in self.workers:
            pid = self.workers[slot]
            status = await _wait_exit(pid)
            del self.workers[slot]
            if self.stopping or status == 0:
                return  # stopped by us, or the mount is gone (the worker read ENODEV)
            self._died(slot, pid, status)

    def _died(self, slot: int, pid: int, status: int) -> None:
        how = f"killed by {signal.Signals(-status).name}" if status < 0 and -status in signal.valid_signals() \
            else f"exit status {status}"
        in_flight = self.counters.in_flight(slot)
        unique = in_flight[0]
        in_flight[0] = 0
        answered = ""
        if unique:
            self.counters.slot(slot)[fuse_worker.ERRORS] += 1
            answered = f"; answered its request {unique} with EIO"
            _answer_eio(self.fuse_fd, unique)
        now = time.monotonic()
        while self._restarts and now - self._restarts[0] > RESTART_WINDOW:
            self._restarts.popleft()
        if len(self._restarts) >= MAX_RESTARTS:
            self.gave_up = True
            log.error("FUSE worker %d (pid %d) died (%s)%s; not replaced: %d restarts in %gs "
                      "(%d workers left)", slot, pid, how, answered, len(self._restarts),
                      RESTART_WINDOW, len(self.workers))
            return
        self._restarts.append(now)
        self.workers[slot] = fuse_worker.fork_worker(slot, self.target)
        log.warning("FUSE worker %d (pid %d) died (%s)%s; replaced by pid %d",
                    slot, pid, how, answered, self.workers[slot])

    def stop(self) -> None:
        """SIGTERM every worker; none is replaced from now on."""
        self.stopping = True
        for pid in self.pids:
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)

    def reap(self, timeout: float = 5.0) -> None:
        """Wait for the workers to exit (SIGTERM after ``timeout``/2, SIGKILL after ``timeout``)."""
        self.stopping = True
        deadline = time.monotonic() + timeout
        alive = set(self.pids)
        signalled = killed = False
        while alive:
            for pid in list(alive):
                with suppress(ChildProcessError):
                    done, _ = os.waitpid(pid, os.WNOHANG)
                    if not done:
                        continue
                alive.discard(pid)
            if not alive:
                break
            left = deadline - time.monotonic()
            if left < timeout / 2 and not signalled:
                signalled = True
                for pid in alive:
                    with suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGTERM)
            if left < 0 and not killed:
                killed = True
                for pid in alive:
                    with suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
            time.sleep(0.01)
        self.workers.clear()


async def _wait_exit(pid: int) -> int:
    """Wait for child ``pid`` to exit and reap it; its exit code (negative: killed by a signal)."""
    try:
        pidfd = os.pidfd_open(pid)
    except OSError:
        pidfd = -1  # no pidfds (Linux < 5.3), or it is already gone: poll
    try:
        while True:
            if pidfd >= 0:
                await trio.lowlevel.wait_readable(pidfd)
            try:
                done, status = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                return 0  # reaped elsewhere
            if done:
                return os.waitstatus_to_exitcode(status)
            if pidfd < 0:
                await trio.sleep(POLL_INTERVAL)
    finally:
        if pidfd >= 0:
            os.close(pidfd)


def _answer_eio(fuse_fd: int, unique: int) -> None:
    try:
        os.write(fuse_fd, fuse_wire.error(unique, errno.EIO))
    except OSError as exc:
        # ENOENT: already answered (or interrupted); ENODEV: unmounted.
        if exc.errno not in (errno.ENOENT, errno.ENODEV):
            log.warning("cannot answer request %d of a dead worker: %s", unique, exc)
