"""The mount's worker processes as a pool: forked, watched, and replaced when one dies.

A worker that dies (killed, SIGBUS, a crash in Python) takes with it the requests it had read,
and the kernel would wait for those answers forever: the reader hangs, and so does everything
that waits for that inode or page. Two things make sure every such request is answered:

* Each worker serves on a ``/dev/fuse`` descriptor of its own (a :class:`Channel`, cloned from
  the session with ``fuse_channel.clone``; only the worker and the main process hold it). A
  request read from a descriptor can only be answered through it, and the kernel ends the
  requests of a descriptor whose last copy is closed (the reader gets ECONNABORTED). So when
  a worker dies, the main process closes its copy, and nothing the worker read stays
  unanswered. This also covers a worker killed while blocked in ``read``: the kernel may
  hand it one more request on the way out.
* Before closing it, the main process answers the request the worker was handling with
  ``EIO``, the errno every other failure of a read gives: each worker publishes the unique id
  of the request in hand in shared memory (``SharedCounters.in_flight``) before it does
  anything with it.

Then the main process logs one line, counts an error, and forks a replacement with a fresh
channel into the same slot. Requests the worker had forwarded to the main process (misses,
extended attributes) end with the channel; their answers are dropped.

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

from quiverfs.filesystem import reads
from quiverfs.fuse import channel as fuse_channel
from quiverfs.fuse import worker as fuse_worker
from quiverfs.protocol import fuse_wire

log = logging.getLogger("quiverfs.mount")

#: Most replacements in :data:`RESTART_WINDOW` seconds.
MAX_RESTARTS = 10
RESTART_WINDOW = 60.0

#: Seconds between two ``waitpid`` polls where pidfds are not available.
POLL_INTERVAL = 0.1


class Channel:
    """One worker's ``/dev/fuse`` descriptor, as the main process holds it."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.open = True

    def send(self, reply: bytes | list[bytes]) -> None:
        """Write a reply (dropped once the channel is closed: its requests ended with it)."""
        if self.open:
            # ENOENT (not logged): interrupted, or already answered (ids are never reused).
            fuse_channel.send(self.fd, reply)

    def close(self) -> None:
        """Close the main process's copy; with the worker gone, the kernel ends its requests."""
        if self.open:
            self.open = False
            os.close(self.fd)


class WorkerPool:
    """``count`` workers running ``target(slot, fd)`` (slots 1..count), each on its own clone
    of the connection ``session_fd``."""

    def __init__(self, count: int, target: Callable[[int, int], None],
                 counters: reads.SharedCounters, session_fd: int) -> None:
        self.count = count
        self.target = target
        self.counters = counters
        self.session_fd = session_fd
        self.workers: dict[int, int] = {}  # slot -> pid of the live worker in it
        self.channels: dict[int, Channel] = {}  # slot -> its channel
        self._by_pid: dict[int, Channel] = {}
        self.stopping = False
        self.gave_up = False  #: a worker died and was not replaced (too many restarts)
        self._restarts: deque[float] = deque()

    @property
    def pids(self) -> list[int]:
        """The live workers' pids."""
        return list(self.workers.values())

    def channel_of(self, pid: int) -> Channel | None:
        """The channel of the worker ``pid`` (None: not one of ours, or dead)."""
        return self._by_pid.get(pid)

    def start(self) -> None:
        """Fork the workers (every channel exists first, so each child can close the others)."""
        for slot in range(1, self.count + 1):
            self.channels[slot] = Channel(fuse_channel.clone(self.session_fd))
        for slot in range(1, self.count + 1):
            self._fork(slot)

    def _fork(self, slot: int) -> None:
        channel = self.channels[slot]
        pid = fuse_worker.fork_worker(slot, lambda s: self._child(s, channel))
        self.workers[slot] = pid
        self._by_pid[pid] = channel

    def _child(self, slot: int, channel: Channel) -> None:
        # Runs in the forked worker: hold no other worker's channel, or that worker's death
        # would not close it.
        for other in self.channels.values():
            if other is not channel and other.open:
                os.close(other.fd)
        self.target(slot, channel.fd)

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
            self._by_pid.pop(pid, None)
            if self.stopping or status == 0:
                return  # stopped by us, or the mount is gone (the worker read ENODEV)
            self._died(slot, pid, status)

    def _died(self, slot: int, pid: int, status: int) -> None:
        how = (f"killed by {signal.Signals(-status).name}" if -status in signal.valid_signals()
               else f"exit status {status}")
        in_flight = self.counters.in_flight(slot)
        unique = in_flight[0]
        in_flight[0] = 0
        channel = self.channels.pop(slot)
        answered = ""
        if unique:
            self.counters.slot(slot)[reads.ERRORS] += 1
            answered = f"; answered its request {unique} with EIO"
            channel.send(fuse_wire.error(unique, errno.EIO))
        channel.close()  # the kernel ends whatever else the worker had read
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
        self.channels[slot] = Channel(fuse_channel.clone(self.session_fd))
        self._fork(slot)
        log.warning("FUSE worker %d (pid %d) died (%s)%s; replaced by pid %d",
                    slot, pid, how, answered, self.workers[slot])

    def sweep(self) -> None:
        """Have every worker close now the kept store files that left the store (mountd
        reported evictions): :data:`~quiverfs.fuse.worker.SWEEP_SIGNAL`, which runs the
        periodic work of its timer at once (quiverfs/fuse/worker.py)."""
        for pid in self.pids:
            with suppress(ProcessLookupError):
                os.kill(pid, fuse_worker.SWEEP_SIGNAL)

    def stop(self) -> None:
        """SIGTERM every worker; none is replaced from now on."""
        self.stopping = True
        for pid in self.pids:
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)

    def close(self, timeout: float = 5.0) -> None:
        """Wait for the workers to exit (SIGTERM after ``timeout``/2, SIGKILL after
        ``timeout``), then close every channel."""
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
        self._by_pid.clear()
        for channel in self.channels.values():
            channel.close()
        self.channels.clear()


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
