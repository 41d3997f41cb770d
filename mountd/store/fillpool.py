"""Where fills run: a pool of fill processes, or mountd's own threads.

A fill's data movement (read, blake3, write, rename: :mod:`mountd.store.fillwork`) costs
~0.2 ms of CPU for a 110 KiB file, most of it Python around system calls. In mountd's one
interpreter that capped every cold read on the machine at about one core's worth of fills
(~1,000 files/s whatever the cores, docs/architecture.md "Fills"). So mountd forks **fill
processes** when it starts (:class:`ProcessFills`, ``--fill-processes``, one per core by
default): each runs jobs in a few threads with backends of its own, and the main process only
decides (single-flight, reservations, quotas, limits, holds, the index) and sends the job.

The seam is :class:`Fills`: ``run(job)`` returns the job's :class:`~mountd.store.fillwork.Outcome`.
:class:`ThreadFills` runs the same :mod:`~mountd.store.fillwork` steps in mountd's worker
threads (``--fill-processes 0``, and the cache's unit tests, whose fault-injecting backends
live in the test's process).

The pool's protocol (one ``SOCK_SEQPACKET`` socket pair per child; each message a pickled
tuple, so it only ever carries our own types between a parent and the children it forked):

* parent → child ``(JOB, id, job)``, with the job's descriptor attached (``SCM_RIGHTS``) when
  it reads bytes a client supplied; a job is one file (``FillJob``), a chunk fill
  (``SpanJob``) or several files of one bucket (``BatchJob``, side by side in the child);
  ``(REPLY, ask, value)``: the answer to a request of the job (``ROOM``: True when the room
  is there, False when it could not be made; ``PACE``: None); ``(CANCEL, id)``: the job's
  caller was cancelled (a streamed job stops before its next chunk, a batch before its next
  file); ``(WARM, url)``;
* child → parent ``(DONE, id, results, gets, stages, error, counters)`` where ``counters`` is
  the child's running totals for the job's backend (the parent keeps the latest of each child
  and adds them up for ``quiverfs stats``); ``(ROOM, ask, bytes)``: the disk is full, make
  this much room, then ``REPLY`` (the child then writes once more, or fails the file when
  the answer is False); ``(PACE, ask, bytes)``: the next chunk of a streamed remote object
  is due, ``REPLY`` once the remote limits allow it.
  ``ask`` is ``(job id, n)``, one per request: the files of a batch may ask at once.

Guarantees kept across the process boundary:

* **Nothing visible before it is verified.** The child renames a file into the store only
  after its size and blake3 matched; the parent indexes what the child reports.
* **Cancellation never leaves a partial or an unaccounted file.** A job, once sent, is
  waited for even by a cancelled caller (as a thread that writes is never abandoned), so
  what it landed is indexed; a temp file of a failed or killed job is removed by the child
  or, after a crash, by recovery (``tmp/`` is wiped on open).
* **A child that dies** fails the jobs it had with :class:`~mountd.errors.CacheError` (their
  waiters retry or report it) and is replaced; a file it renamed before dying is complete
  and verified, and the next fill of that hash finds the name taken by the same bytes.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import os
import pickle
import signal
import socket
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import outcome
import trio

from mountd.errors import CacheError
from mountd.store.fillchild import (
    CANCEL,
    DONE,
    JOB,
    MESSAGE_BYTES,
    PACE,
    REPLY,
    ROOM,
    WARM,
    Job,
    child_main,
    failed_outcome,
)
from mountd.store.fillwork import (
    BackendReader,
    BatchJob,
    BytesReader,
    FdReader,
    FillJob,
    FillStopped,
    Outcome,
    SpanJob,
    StageTimes,
    Store,
)
from quiverfs.base.backends import Backend
from quiverfs.base.backends.base import RemoteCounters
from quiverfs.base.forking import close_inherited, fork_child

log = logging.getLogger("mountd.store.fillpool")

#: Socket buffer of each pair, both ways: room for hundreds of jobs in flight.
SOCKET_BUFFER = 4 << 20

#: Seconds :meth:`ProcessFills.close` gives the children to finish the fills in hand.
STOP_SECONDS = 5.0

#: Children replaced within :data:`RESTART_WINDOW` seconds before the pool gives up on one slot.
MAX_RESTARTS = 10
RESTART_WINDOW = 60.0


class Fills(Protocol):
    """Runs the data movement of fills (see the module docstring)."""

    #: Whether the fills read through the cache's own backends (mountd's threads), so that
    #: the cache should open them ahead of the first fill; fill processes open their own.
    uses_cache_backends: bool

    #: Whether a batch's files run side by side (``BatchJob.parallel``): in a fill process,
    #: yes; in mountd's threads, one after another (a batch is one thread there).
    parallel_batches: bool

    #: The most files of one batch that run at once: a batch takes no more slots than
    #: this (mountd/store/batchfill.py), since a slot beyond it would be held and unused.
    batch_parallel: int

    async def run(self, job: Job, fd: int | None = None) -> Outcome:
        """Run ``job`` (``fd``: the descriptor a ``"fd"`` job reads, still owned by the
        caller) and return its outcome; never raises for what the job met (that is in the
        outcome). Once started, waited for even when the caller is cancelled."""
        ...

    def warm(self, urls: Iterable[str]) -> None:
        """Open the backends of ``urls`` ahead of their first fill (in the background)."""
        ...

    def remote_counters(self) -> dict[str, tuple[RemoteCounters, str | None]]:
        """The fills' requests by backend URL, and how each backend reads (``stats``)."""
        ...

    def attach(self, room: Callable[[int], Awaitable[bool]],
               pace: Callable[[int], Awaitable[None]]) -> None:
        """The cache's side of the jobs' gate (:class:`~mountd.store.fillwork.Gate`):
        ``room(bytes)`` frees disk space when a fill meets a full disk (False: it could
        not), ``pace(bytes)`` waits for the remote limits before the next chunk of a
        streamed object (both run in the trio thread)."""
        ...

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
                    ) -> None:
        """Serve the executor's background work until cancelled (fill processes: their
        answers; :meth:`run` needs it running)."""
        ...

    def close(self) -> None:
        """Stop (idempotent)."""
        ...


# -- in mountd's own threads -------------------------------------------------------------------


class ThreadFills:
    """:class:`Fills` in mountd's worker threads, with the cache's own backends (its
    ``backend(url)`` opener, which the cache counts for ``stats``)."""

    uses_cache_backends = True
    parallel_batches = False
    batch_parallel = 1

    def __init__(self, cache_dir: Path, backend: Callable[[str], Awaitable[Backend]],
                 io_threads: int) -> None:
        self._backend = backend
        self._io = trio.CapacityLimiter(io_threads)
        self._store = Store(cache_dir)
        self._gate = _ThreadGate()

    async def run(self, job: Job, fd: int | None = None) -> Outcome:
        store, gate = self._store, self._gate
        if isinstance(job, BatchJob):
            backend = await self._backend(job.url)
            return await trio.to_thread.run_sync(store.fill_batch, job, backend, gate,
                                                 limiter=backend.limiter)
        if isinstance(job, SpanJob):
            backend = await self._backend(job.url)
            reader = BackendReader(backend, job.key)
            return await trio.to_thread.run_sync(store.fill_span, job, reader, gate,
                                                 limiter=backend.limiter)
        limiter = self._io
        if job.source == "remote":
            backend = await self._backend(job.target.url)
            reader: Any = BackendReader(backend, job.target.key)
            limiter = backend.limiter
        elif job.source == "fd":
            assert fd is not None
            reader = FdReader(fd, job.target.url)
        else:
            reader = BytesReader(job.data)
        return await trio.to_thread.run_sync(store.fill, job, reader, gate, limiter=limiter)

    def warm(self, urls: Iterable[str]) -> None:
        """Nothing: the cache opens its own backends ahead (it owns them)."""

    def remote_counters(self) -> dict[str, tuple[RemoteCounters, str | None]]:
        return {}  # the cache's own backends count these fills

    def attach(self, room: Callable[[int], Awaitable[bool]],
               pace: Callable[[int], Awaitable[None]]) -> None:
        self._gate.room_fn, self._gate.pace_fn = room, pace

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
                    ) -> None:
        task_status.started()  # nothing in the background: jobs run in the callers' threads

    def close(self) -> None:
        pass


class _ThreadGate:
    """The :class:`~mountd.store.fillwork.Gate` of jobs in mountd's worker threads: calls
    back into the trio thread, and stops a job whose caller was cancelled."""

    def __init__(self) -> None:
        self.room_fn: Callable[[int], Awaitable[bool]] | None = None
        self.pace_fn: Callable[[int], Awaitable[None]] | None = None

    def room(self, need: int) -> bool:
        if self.room_fn is None:
            return False
        return trio.from_thread.run(self.room_fn, need)

    def next_read(self, nbytes: int, remote: bool) -> None:
        try:
            trio.from_thread.check_cancelled()
            if remote and self.pace_fn is not None:
                trio.from_thread.run(self.pace_fn, nbytes)
        except trio.Cancelled:
            raise FillStopped from None


# -- in fill processes ---------------------------------------------------------------------------


@dataclass(eq=False)
class _Child:
    """One fill process, as the parent sees it."""

    slot: int
    pid: int
    #: jobs out, answers and requests back
    sock: socket.socket
    #: replies and cancellations out (read by the child's control thread)
    control: socket.socket
    #: jobs sent and not answered: id -> (waiting task, job)
    jobs: dict[int, tuple[trio.lowlevel.Task, Job]] = field(default_factory=dict)
    #: the latest running totals of its backends, as it sent them: url -> (totals, read path)
    counters: dict[str, tuple[tuple, str | None]] = field(default_factory=dict)
    dead: bool = False
    #: Whether a reader task still answers its jobs (:meth:`ProcessFills._read`): once it
    #: has stopped (mountd closing), a job sent is failed at once instead of waiting for
    #: an answer nobody would deliver.
    answered: bool = True


class ProcessFills:
    """:class:`Fills` in ``processes`` forked fill processes, ``threads`` fills at once in
    each. Fork them with :meth:`start` as early as possible (mountd does it before its trio
    run starts: a child forked from a process without threads inherits no lock held by one);
    :meth:`serve` reads their answers; :meth:`close` stops them.

    ``factory(url)`` opens a backend in a child (default:
    :func:`quiverfs.base.backends.open_backend` with ``threads`` connections)."""

    #: Each fill process opens its own backends (:meth:`warm`); the cache's are needed only
    #: for the rare ``stat`` of an object larger than the cache, and open when it comes.
    uses_cache_backends = False
    parallel_batches = True

    def __init__(self, cache_dir: Path, processes: int, threads: int,
                 factory: Callable[[str], Backend]) -> None:
        if processes < 1 or threads < 1:
            raise ValueError("a fill pool needs at least one process and one thread")
        self.cache_dir = Path(cache_dir)
        self.processes = processes
        self.threads = threads
        #: A batch runs in the thread that received it and the child's ``threads`` helpers
        #: (fillchild.py): with 16 processes of 3 threads, a batch of 8 used to hold 8
        #: request slots while 4 of its files ran, and a cold pass on 16 cores had 8 files
        #: in flight where its 16 slots allowed 16.
        self.batch_parallel = threads + 1
        self._factory = factory
        self._children: list[_Child] = []
        self._ids = itertools.count(1)
        self._room: Callable[[int], Awaitable[bool]] | None = None
        self._pace: Callable[[int], Awaitable[None]] | None = None
        self._nursery: trio.Nursery | None = None
        self._restarts: list[float] = []
        self._warm: set[str] = set()
        #: Totals of children that died, so ``stats`` never goes backwards.
        self._dead_counters: dict[str, RemoteCounters] = {}
        self._closed = False

    @staticmethod
    def threads_for(processes: int, fill_concurrency: int) -> int:
        """Threads per process so that ``processes`` of them run ``fill_concurrency`` fills."""
        return max(1, math.ceil(fill_concurrency / max(1, processes)))

    # -- the children ----------------------------------------------------------------------------

    def start(self) -> None:
        """Fork every child (idempotent)."""
        while len(self._children) < self.processes:
            self._children.append(self._fork(len(self._children)))

    def _fork(self, slot: int) -> _Child:
        ours, theirs = _pair()
        control, child_control = _pair()

        def target() -> None:
            close_inherited([theirs.fileno(), child_control.fileno()])
            child_main(theirs, child_control, self.cache_dir, self.threads, self._factory,
                        self._warm)

        pid = fork_child(target, f"fill process {slot}", f"mountd-fill{slot}")
        theirs.close()
        child_control.close()
        ours.setblocking(False)
        control.setblocking(False)
        log.debug("fill process %d started (pid %d, %d threads)", slot, pid, self.threads)
        return _Child(slot, pid, ours, control)

    @property
    def pids(self) -> list[int]:
        """The children's pids (tests, and the bench's CPU accounting)."""
        return [child.pid for child in self._children if not child.dead]

    def close(self) -> None:
        """Close the sockets (each child exits when it reads the end, once its fills in hand
        are done) and reap the children, killing those that take longer than
        :data:`STOP_SECONDS`."""
        if self._closed:
            return
        self._closed = True
        for child in self._children:
            if not child.dead:
                with contextlib.suppress(RuntimeError):  # outside trio: nobody waits on it
                    trio.lowlevel.notify_closing(child.sock)
                child.sock.close()
                child.control.close()
        deadline = time.monotonic() + STOP_SECONDS
        for child in self._children:
            _reap(child.pid, max(0.0, deadline - time.monotonic()))

    # -- running jobs ------------------------------------------------------------------------------

    async def run(self, job: Job, fd: int | None = None) -> Outcome:
        if self._closed:
            return failed_outcome(job, CacheError("mountd's fill processes are stopped"))
        owned = -1
        if isinstance(job, FillJob) and job.source == "bytes":
            # A peer's bytes travel as a descriptor, never in a message.
            owned = fd = _memfd(job.data)
            job = FillJob(job.target, "fd", 0, b"", job.chunk_size)
        try:
            child = min((c for c in self._children if not c.dead), key=lambda c: len(c.jobs),
                        default=None)
            if child is None:
                return failed_outcome(job, CacheError("mountd has no fill process left"))
            job_id = next(self._ids)
            message = pickle.dumps((JOB, job_id, job), protocol=pickle.HIGHEST_PROTOCOL)
            try:
                await _send(child.sock, message, () if fd is None else (fd,))
            except OSError as exc:  # the child is gone: its reader replaces it
                return failed_outcome(job, CacheError(f"cannot reach a fill process: {exc}"))
        finally:
            if owned >= 0:
                os.close(owned)  # the child has its own copy now (or never will)
        if not child.answered or child.dead:
            # Its reader stopped (mountd is closing) after this job was sent: nobody would
            # wake this task, and cancelling it is refused below (shutdown hung on it).
            return failed_outcome(job, CacheError("mountd stopped before the fill ended"))
        task = trio.lowlevel.current_task()
        child.jobs[job_id] = (task, job)

        def abort(_: object) -> trio.lowlevel.Abort:
            # Not abortable: the child is working on it, and what it lands must be indexed
            # (a thread that writes is never abandoned either). A streamed job is told to
            # stop before its next chunk; its answer then comes soon.
            with contextlib.suppress(OSError):
                child.control.send(pickle.dumps((CANCEL, job_id)))
            return trio.lowlevel.Abort.FAILED

        return await trio.lowlevel.wait_task_rescheduled(abort)

    def warm(self, urls: Iterable[str]) -> None:
        for url in urls:
            if url in self._warm:
                continue
            self._warm.add(url)
            message = pickle.dumps((WARM, url))
            for child in self._children:
                if not child.dead:
                    with contextlib.suppress(OSError):  # it will open the backend at its first fill instead
                        child.sock.send(message)

    def remote_counters(self) -> dict[str, tuple[RemoteCounters, str | None]]:
        parts: dict[str, list[RemoteCounters]] = {url: [dead] for url, dead
                                                  in self._dead_counters.items()}
        paths: dict[str, str | None] = {}
        for child in self._children:
            for url, (totals, path) in child.counters.items():
                parts.setdefault(url, []).append(_counters_of(totals))
                paths[url] = path or paths.get(url)
        return {url: (RemoteCounters.total(counters), paths.get(url))
                for url, counters in parts.items()}

    # -- answers -------------------------------------------------------------------------------------

    def attach(self, room: Callable[[int], Awaitable[bool]],
               pace: Callable[[int], Awaitable[None]]) -> None:
        self._room, self._pace = room, pace

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
                    ) -> None:
        self.start()
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            for child in self._children:
                nursery.start_soon(self._read, child)
            task_status.started()
            await trio.sleep_forever()

    async def _read(self, child: _Child) -> None:
        """Handle ``child``'s messages until it dies or this task is cancelled; then (the
        cache is closing) stop its jobs and wait up to :data:`STOP_SECONDS` for their
        answers, shielded: every waiter must be woken, and what landed indexed."""
        buffer = bytearray(MESSAGE_BYTES)
        try:
            while not await self._receive(child, buffer):
                pass
        except trio.Cancelled:
            with trio.CancelScope(shield=True):
                for job_id in list(child.jobs):
                    with contextlib.suppress(OSError):
                        child.control.send(pickle.dumps((CANCEL, job_id)))
                with trio.move_on_after(STOP_SECONDS):
                    while child.jobs and not await self._receive(child, buffer):
                        pass
                self._fail_jobs(child, CacheError("mountd stopped before the fill ended"))
                child.answered = False
            raise

    async def _receive(self, child: _Child, buffer: bytearray) -> bool:
        """Wait for ``child``'s socket, then handle every message waiting there; True once
        the child is gone."""
        sock = child.sock
        try:
            await trio.lowlevel.wait_readable(sock)
        except (trio.ClosedResourceError, OSError):
            return True  # closed by close()
        view = memoryview(buffer)
        while True:
            try:
                n = sock.recv_into(buffer)
            except BlockingIOError:
                return False
            except OSError:
                n = 0
            if not n:
                self._died(child)
                return True
            message = pickle.loads(view[:n])
            kind = message[0]
            if kind == DONE:
                self._done(child, message)
            elif kind == ROOM:
                if self._nursery is None or child.dead or self._room is None:
                    self._reply(child, message[1], False)
                else:
                    self._nursery.start_soon(self._make_room, child, message[1], message[2])
            elif kind == PACE:
                if self._nursery is None or child.dead:
                    self._reply(child, message[1])
                else:
                    self._nursery.start_soon(self._paced, child, message[1], message[2])

    def _done(self, child: _Child, message: tuple) -> None:
        _, job_id, results, gets, stages, error, counters = message
        if counters is not None:
            url, totals, path = counters
            child.counters[url] = (totals, path)  # plain values: RemoteCounters when asked
        task, _ = child.jobs.pop(job_id)
        trio.lowlevel.reschedule(task, outcome.Value(
            Outcome(results, gets, StageTimes(stages), error)))

    async def _make_room(self, child: _Child, ask: object, need: int) -> None:
        assert self._room is not None
        made = False
        try:
            made = await self._room(need)
        except Exception:
            log.exception("could not make room for a fill")
        finally:
            self._reply(child, ask, made)  # cancelled (closing): the job fails

    async def _paced(self, child: _Child, ask: object, nbytes: int) -> None:
        if self._pace is not None:
            await self._pace(nbytes)
        self._reply(child, ask)

    def _reply(self, child: _Child, ask: object, value: object = None) -> None:
        if not child.dead:
            with contextlib.suppress(OSError):  # gone: its jobs fail when its end is read
                child.control.send(pickle.dumps((REPLY, ask, value)))

    def _fail_jobs(self, child: _Child, error: BaseException) -> None:
        """Wake every waiter of ``child``'s jobs with ``error``."""
        for task, job in child.jobs.values():
            trio.lowlevel.reschedule(task, outcome.Value(failed_outcome(job, error)))
        child.jobs.clear()

    def _died(self, child: _Child) -> None:
        """A child's end closed: fail its jobs, keep its totals, replace it."""
        child.dead = True
        child.sock.close()
        child.control.close()
        _reap(child.pid)
        if not self._closed:
            log.error("fill process %d (pid %d) died with %d fills in hand; replacing it",
                      child.slot, child.pid, len(child.jobs))
        self._fail_jobs(child, CacheError(
            f"the fill process that had this fill died (pid {child.pid})"))
        if self._closed:
            return
        for url, (totals, _) in child.counters.items():
            self._dead_counters[url] = RemoteCounters.total(
                [_counters_of(totals), *([self._dead_counters[url]]
                                         if url in self._dead_counters else [])])
        now = trio.current_time()
        self._restarts = [t for t in self._restarts if now - t < RESTART_WINDOW] + [now]
        if len(self._restarts) > MAX_RESTARTS * self.processes:
            log.error("fill processes keep dying; slot %d is not replaced", child.slot)
            return
        replacement = self._fork(child.slot)
        self._children[self._children.index(child)] = replacement
        if self._nursery is not None:
            self._nursery.start_soon(self._read, replacement)


def _pair() -> tuple[socket.socket, socket.socket]:
    """A ``SOCK_SEQPACKET`` pair with room for hundreds of messages each way."""
    pair = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    for sock in pair:
        for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            with contextlib.suppress(OSError):  # the system's maximum then
                sock.setsockopt(socket.SOL_SOCKET, option, SOCKET_BUFFER)
    return pair


async def _send(sock: socket.socket, message: bytes, fds: tuple[int, ...]) -> None:
    """Send one message (with ``fds``) on a non-blocking socket, waiting while it is full."""
    while True:
        try:
            if fds:
                socket.send_fds(sock, [message], list(fds))
            else:
                sock.send(message)
            return
        except BlockingIOError:
            await trio.lowlevel.wait_writable(sock)


def _counters_of(totals: tuple) -> RemoteCounters:
    """A child's running totals of one backend, as it sends them, as :class:`RemoteCounters`."""
    requests, bytes_read, bytes_written, retries, failures = totals
    counters = RemoteCounters(bytes_read=bytes_read, bytes_written=bytes_written,
                              retries=retries)
    counters.requests.update(requests)
    counters.failures.update(failures)
    return counters


def _memfd(data: bytes) -> int:
    fd = os.memfd_create("quiverfs-peer-bytes", os.MFD_CLOEXEC)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    except BaseException:
        os.close(fd)
        raise
    return fd


def _reap(pid: int, timeout: float = 0.0) -> None:
    """Wait up to ``timeout`` seconds for child ``pid`` to exit, then kill it."""
    deadline = time.monotonic() + timeout
    try:
        while os.waitpid(pid, os.WNOHANG) == (0, 0):
            if time.monotonic() >= deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                return
            time.sleep(0.01)
    except (ChildProcessError, ProcessLookupError):
        pass
