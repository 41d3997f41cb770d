"""A fill process: the child side of the pool in :mod:`mountd.store.fillpool`.

mountd forks its fill processes before its trio run starts; each runs :func:`child_main`: a
few threads that each receive a job on the shared socket, run it
(:mod:`mountd.store.fillwork`: read, hash, write, rename) and send its outcome back, and one
control thread for the parent's replies and cancellations. The messages both sides speak are
here, with the child's loop; the protocol is described in :mod:`mountd.store.fillpool`'s
docstring (the parent's side is the one mountd's code calls). Kept apart from the pool so the
code that runs in another process reads on its own.
"""

from __future__ import annotations

import array
import contextlib
import itertools
import os
import pickle
import queue
import socket
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from mountd.errors import CacheError
from mountd.store.fillwork import (
    BackendReader,
    BatchJob,
    FdReader,
    FillJob,
    FillStopped,
    Outcome,
    SpanJob,
    Store,
)
from quiverfs.base.backends import Backend

Job = FillJob | SpanJob | BatchJob

#: Message kinds (see :mod:`mountd.store.fillpool`'s docstring).
JOB, REPLY, CANCEL, WARM, DONE, ROOM, PACE = range(7)

#: Largest message either side receives (a job or an outcome is a few hundred bytes; the
#: bytes of a peer's file never travel in a message: they go as a descriptor).
MESSAGE_BYTES = 1 << 20


def failed_outcome(job: Job, error: BaseException) -> Outcome:
    """Every target of ``job`` failed with ``error`` (a job that never ran, or whose
    backend could not even open)."""
    members = 1 if isinstance(job, FillJob) else len(job.members)
    return Outcome([error] * members, error=error if isinstance(job, SpanJob) else None)


def child_main(sock: socket.socket, control: socket.socket, cache_dir: Path, threads: int,
                factory: Callable[[str], Backend], warm: Iterable[str]) -> None:  # pragma: no cover
    """A fill process: ``threads`` threads each receive a job, run it and answer (no hand-off
    between threads on the way); one more reads the parent's replies and cancellations.
    Returns once the parent closed its end (every thread then reads the end)."""
    child = _ChildLoop(sock, cache_dir, factory, threads)
    workers = [threading.Thread(target=child.serve, name=f"fill-{i}", daemon=True)
               for i in range(threads)]
    for url in warm:
        threading.Thread(target=child.backend, args=(url,), daemon=True).start()
    for worker in workers:
        worker.start()
    child.control(control)  # until the parent's end closes
    for worker in workers:
        worker.join()


#: Bytes of one descriptor in ``SCM_RIGHTS`` ancillary data (a C int).
_FD_SIZE = array.array("i").itemsize


def _fds_of(ancillary: list[tuple[int, int, bytes]]) -> list[int]:
    """The descriptors ``SCM_RIGHTS`` ancillary data carried."""
    fds: list[int] = []
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.extend(array.array("i", data[:len(data) - len(data) % _FD_SIZE]))
    return fds


class Helpers:
    """``threads`` threads, all started at once, that run calls handed to :meth:`submit`
    (the members of a batch beside the thread that received it).

    Not a ``ThreadPoolExecutor``: that one starts a thread for a call whenever none is idle,
    up to its bound, so a fill process's threads crept up with each burst of batches (the
    30-minute soak: 147 to 160 threads in two processes over 25 minutes, after every fault)
    and never came down. Here the count is fixed from the first batch on."""

    def __init__(self, threads: int, name: str) -> None:
        if threads < 1:
            raise ValueError("a helper pool needs a thread")
        self._calls: queue.SimpleQueue[tuple[Future, Callable[[], Any]]] = queue.SimpleQueue()
        for i in range(threads):
            threading.Thread(target=self._serve, name=f"{name}-{i}", daemon=True).start()

    def submit(self, call: Callable[[], Any]) -> Future:
        """Run ``call()`` in a helper thread; its future."""
        future: Future = Future()
        self._calls.put((future, call))
        return future

    def _serve(self) -> None:
        while True:
            future, call = self._calls.get()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = call()
            except BaseException as exc:  # noqa: BLE001 - the caller's to see, as a pool's
                future.set_exception(exc)
            else:
                future.set_result(result)


class _ChildLoop:  # pragma: no cover - runs in a fill process (tests drive it through mountd)
    """A fill process's state: its backends, its store, the jobs waiting for an answer."""

    def __init__(self, sock: socket.socket, cache_dir: Path,
                 factory: Callable[[str], Backend], threads: int = 1) -> None:
        self.sock = sock
        self.factory = factory
        self.backends: dict[str, Backend] = {}
        self.opening = threading.Lock()
        #: Held from reading a backend's counters to sending them: jobs end in several
        #: threads, and the parent keeps the last totals it got, so they must arrive in the
        #: order they were read (a stale total sent last undercounted a run's GETs)
        self.reporting = threading.Lock()
        #: asks waiting for the parent's REPLY (by ask: job id, number), and the values
        #: those brought
        self.waiting: dict[tuple[int, int], threading.Event] = {}
        self.answers: dict[tuple[int, int], object] = {}
        #: jobs whose caller was cancelled
        self.stopped: set[int] = set()
        self.store = Store(cache_dir)
        self.stopping = False
        self.threads = threads
        #: Threads that run a batch's files beside the thread that received it (made at the
        #: first batch: in this process, after the fork)
        self._helpers: Helpers | None = None
        self._asks = itertools.count()

    def serve(self) -> None:
        """One worker thread: receive a message, act on it, until the parent's end closes."""
        buffer = bytearray(MESSAGE_BYTES)
        view = memoryview(buffer)
        descriptors = socket.CMSG_SPACE(_FD_SIZE)
        sock = self.sock
        while True:
            try:
                n, ancillary, _, _ = sock.recvmsg_into([buffer], descriptors)
            except InterruptedError:
                continue
            except OSError:
                return
            if not n:
                return
            fds = _fds_of(ancillary)
            message = pickle.loads(view[:n])
            kind = message[0]
            if kind == JOB:
                self.run(message[1], message[2], fds.pop(0) if fds else None)
            elif kind == WARM:
                self.backend(message[1])
            for fd in fds:
                os.close(fd)

    def control(self, control: socket.socket) -> None:
        """The control thread: the parent's REPLY and CANCEL messages, until its end closes."""
        while True:
            try:
                data = control.recv(MESSAGE_BYTES)
            except InterruptedError:
                continue
            except OSError:
                data = b""
            if not data:
                break
            kind, about, *value = pickle.loads(data)
            if kind == CANCEL:
                self.cancel(about)
                continue
            event = self.waiting.get(about)  # about: an ask
            if event is not None:
                if value:
                    self.answers[about] = value[0]
                event.set()
        self.stopping = True
        for event in list(self.waiting.values()):
            event.set()

    def cancel(self, job_id: int) -> None:
        """The caller of job ``job_id`` was cancelled: it stops at its next read (a streamed
        file's next chunk, a batch's next file), and its asks stop waiting."""
        self.stopped.add(job_id)
        for ask, event in list(self.waiting.items()):
            if ask[0] == job_id:
                event.set()

    def backend(self, url: str) -> Backend:
        backend = self.backends.get(url)
        if backend is None:
            with self.opening:
                backend = self.backends.get(url)
                if backend is None:
                    backend = self.backends[url] = self.factory(url)
        return backend

    def run(self, job_id: int, job: Job, fd: int | None) -> None:
        url = None
        gate = _ChildGate(self, job_id)
        try:
            if isinstance(job, SpanJob):
                url = job.url
                result = self.store.fill_span(job, BackendReader(self.backend(url), job.key),
                                              gate)
            elif isinstance(job, BatchJob):
                url = job.url
                result = self.store.fill_batch(job, self.backend(url), gate,
                                               self.helpers().submit)
            elif job.source == "remote":
                url = job.target.url
                result = self.store.fill(job, BackendReader(self.backend(url),
                                                            job.target.key), gate)
            else:
                result = self.store.fill(job, FdReader(-1 if fd is None else fd,
                                                       job.target.url), gate)
        except Exception as exc:  # a backend that cannot even open: every target fails
            result = failed_outcome(job, exc)
        finally:
            if fd is not None:
                os.close(fd)
            self.stopped.discard(job_id)
        with self.reporting, contextlib.suppress(OSError):  # OSError: the parent is gone
            counters = None
            if url is not None and url in self.backends:
                backend = self.backends[url]
                c = backend.counters
                counters = (url, (dict(c.requests), c.bytes_read, c.bytes_written, c.retries,
                                  dict(c.failures)), backend.read_path())
            message = (DONE, job_id, result.results, result.gets, result.stages.values,
                       result.error, counters)
            self.sock.send(_picklable(message))

    def helpers(self) -> Helpers:
        """The threads that run batches' files side by side (as many as the jobs')."""
        with self.opening:
            if self._helpers is None:
                self._helpers = Helpers(self.threads, "fill-batch")
            return self._helpers

    def ask(self, job_id: int, kind: int, value: object) -> object:
        """Ask the parent ``(kind, (job_id, n), value)`` about job ``job_id`` and wait for
        its REPLY (or the job's CANCEL, or the end of the parent); the value the REPLY
        brought (None: none). Each ask has its own id: the files of a batch may ask at
        once."""
        ask = (job_id, next(self._asks))
        event = self.waiting[ask] = threading.Event()
        try:
            self.sock.send(pickle.dumps((kind, ask, value)))
            while not event.wait(1.0) and not self.stopping:
                pass
        except OSError:
            self.stopping = True
        finally:
            self.waiting.pop(ask, None)
        return self.answers.pop(ask, None)


class _ChildGate:  # pragma: no cover - runs in a fill process
    """The :class:`~mountd.store.fillwork.Gate` of one job in a fill process."""

    def __init__(self, loop: _ChildLoop, job_id: int) -> None:
        self.loop = loop
        self.job_id = job_id

    def room(self, need: int) -> bool:
        return self.loop.ask(self.job_id, ROOM, need) is True

    def next_read(self, nbytes: int, remote: bool) -> None:
        loop, job_id = self.loop, self.job_id
        if job_id not in loop.stopped and remote:
            loop.ask(job_id, PACE, nbytes)
        if job_id in loop.stopped or loop.stopping:
            raise FillStopped


def _picklable(message: tuple) -> bytes:
    """``message`` pickled; an error that does not pickle (an SDK's odd exception) becomes
    a :class:`CacheError` saying what it was."""
    try:
        return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:
        kind, job_id, results, gets, stages, error, counters = message

        def plain(value: Any) -> Any:
            if isinstance(value, BaseException):
                try:
                    pickle.dumps(value)
                except Exception:
                    return CacheError(f"{type(value).__name__}: {value}")
            return value

        return pickle.dumps((kind, job_id, [plain(r) for r in results], gets, stages,
                             plain(error), counters), protocol=pickle.HIGHEST_PROTOCOL)
