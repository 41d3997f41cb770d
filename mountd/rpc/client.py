"""Talking to mountd: an async client for FUSE processes, a blocking one for the CLI, and
starting a mountd on demand.

:class:`AsyncClient` keeps one connection; a reader task hands each response to the request
waiting on its id, so many requests (a FUSE process's misses) share the connection
concurrently. When the connection drops, waiting requests fail with
:class:`~mountd.errors.MountdUnavailable`; the next call reconnects (starting a mountd first
when the client was opened with ``start=True``), replays the mounts it had registered, and
idempotent requests that were cut off are retried once.

:func:`connect_or_start` (async) and :func:`ensure_running` (blocking) start a mountd when none
answers on the socket: ``quiverfs mountd --cache-dir DIR`` detached, its log appended to
``DIR/mountd.log``. Clients racing to do this serialise on an ``flock`` of
``DIR/mountd.start.lock``, so they start exactly one; the loser finds the winner's mountd
answering and just connects. (mountd's own lock on ``DIR/lock`` still guards against a second
mountd started by hand: that one exits with status 75.)

Errors from mountd are re-raised here as the same quiverfs error class (see
:func:`mountd.rpc.protocol.exception_from_payload`).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import itertools
import os
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

from mountd.errors import EXIT_ALREADY_RUNNING, MountdUnavailable, PermissionDenied, ProtocolError
from mountd.rpc import protocol
from mountd.rpc.fdpass import (
    DescriptorStream,
    close_all,
    receive_with_fds_blocking,
    send_frame,
    send_with_fds,
    send_with_fds_blocking,
)
from mountd.rpc.protocol import MAX_OPEN, PROTOCOL_VERSION
from mountd.store import layout
from quiverfs.backends.base import Location

#: Seconds a blocking client waits for mountd to accept and answer ``hello``.
CONNECT_TIMEOUT = 5.0

#: Seconds :func:`ensure_running` waits for a started mountd to answer.
START_TIMEOUT = 30.0


#: File in the cache directory that clients starting a mountd serialise on.
START_LOCK = "mountd.start.lock"

#: Log file of a mountd started on demand, in the cache directory.
LOG_FILE = "mountd.log"


ProgressFn = Callable[[dict[str, Any]], None]

#: What ``open`` gives for one hash: ``(descriptor, size)`` of its store file, or None (not
#: cached, or cached with another size than asked: read it through the mount).
Opened = tuple[int, int] | None

#: Descriptors a client keeps received but not yet claimed by a response (the oldest are
#: closed beyond it; a response then finds too few, a ProtocolError). Responses take theirs
#: as soon as they are parsed, so a few responses' worth is plenty.
MAX_QUEUED_FDS = 4 * MAX_OPEN


def resolve_socket(cache_dir: str | os.PathLike[str] | None) -> tuple[Path, Path]:
    """``(cache_dir, socket_path)`` with the default cache directory filled in."""
    directory = Path(cache_dir) if cache_dir is not None else layout.default_cache_dir()
    directory = directory.expanduser().absolute()
    return directory, layout.socket_path(directory)


def _location_json(location: Location | Mapping[str, Any]) -> dict[str, Any]:
    if isinstance(location, Mapping):
        return dict(location)
    return {"url": location.url, "key": location.key, "offset": location.offset,
            "length": location.length}


def ensure_args(hash: bytes, size: int, location: Location | Mapping[str, Any],
                dataset: str | None = None) -> dict[str, Any]:
    """The ``args`` of an ``ensure`` request (and of one ``prefetch`` item, without dataset)."""
    args: dict[str, Any] = {"hash": bytes(hash).hex(), "size": size, "location": _location_json(location)}
    if dataset is not None:
        args["dataset"] = dataset
    return args


def open_args(hashes: Sequence[bytes], dataset: str | None = None,
              sizes: Sequence[int] | None = None) -> dict[str, Any]:
    """The ``args`` of an ``open`` request (at most :data:`MAX_OPEN` hashes)."""
    if len(hashes) > MAX_OPEN:
        raise ValueError(f"open takes at most {MAX_OPEN} hashes per request, not {len(hashes)}")
    args: dict[str, Any] = {"hashes": [bytes(h).hex() for h in hashes]}
    if sizes is not None:
        args["sizes"] = list(sizes)
    if dataset is not None:
        args["dataset"] = dataset
    return args


def _opened(result: Any, fds: Sequence[int], hashes: Sequence[bytes]) -> list[Opened]:
    """An ``open`` answer: each hash's ``(descriptor, size)`` or None, in the order asked.
    Takes ``fds`` over: all are closed when the answer does not match them."""
    sizes = result.get("sizes") if isinstance(result, dict) else None
    if (not isinstance(sizes, list) or len(sizes) != len(hashes)
            or sum(size is not None for size in sizes) != len(fds)
            or any(size is not None and (isinstance(size, bool) or not isinstance(size, int))
                   for size in sizes)):
        close_all(fds)
        raise ProtocolError("mountd's answer to open does not match the descriptors it sent")
    given = iter(fds)
    return [None if size is None else (next(given), size) for size in sizes]


def _unavailable(path: Path, exc: OSError) -> Exception:
    """The one-line error for a failed connect to ``path``."""
    if isinstance(exc, PermissionError):
        try:
            owner = f"uid {path.stat().st_uid}"
        except OSError:
            owner = "another user"
        return PermissionDenied(
            f"cannot connect to mountd at {path}: permission denied (the socket belongs to "
            f"{owner} and is private to it; run as that user or root)"
        )
    return MountdUnavailable(
        f"no mountd is running for {path.parent} ({os.strerror(exc.errno or errno.ECONNREFUSED).lower()} "
        f"on {path}); start one with: quiverfs mountd --cache-dir {path.parent}"
    )


# -- the blocking client ------------------------------------------------------------------------


class SyncClient:
    """One blocking connection, one request at a time; for the CLI and tests.

    >>> with SyncClient.connect("/var/cache/quiverfs") as client:   # doctest: +SKIP
    ...     print(client.stats()["counters"]["total"]["hits"])
    """

    def __init__(self, sock: socket.socket, path: Path) -> None:
        self._sock = sock
        self.path = path
        self._decoder = protocol.FrameDecoder()
        self._ids = itertools.count(1)
        self._ready: list[bytes] = []
        #: descriptors received with responses (``open``), in arrival order
        self._descriptors = DescriptorStream(sock, MAX_OPEN, MAX_QUEUED_FDS)
        #: mountd's answer to ``hello`` when connected with ``handshake=True``.
        self.hello_info: dict[str, Any] = {}

    @classmethod
    def connect(
        cls, cache_dir: str | os.PathLike[str] | None = None, *, socket_path: str | os.PathLike[str] | None = None,
        timeout: float | None = CONNECT_TIMEOUT, handshake: bool = True,
    ) -> SyncClient:
        """Connect to the mountd of ``cache_dir`` (or at ``socket_path``) and say hello.

        ``timeout`` bounds the connect and the handshake; later calls wait as long as they
        take (a scrub may take hours). Raises :class:`MountdUnavailable` when nobody answers.
        """
        path = Path(socket_path) if socket_path is not None else resolve_socket(cache_dir)[1]
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        sock.settimeout(timeout)
        try:
            sock.connect(os.fspath(path))
        except OSError as exc:
            sock.close()
            raise _unavailable(path, exc) from None
        client = cls(sock, path)
        try:
            if handshake:
                client.hello_info = client.hello()
        except BaseException:
            client.close()
            raise
        sock.settimeout(None)
        return client

    def close(self) -> None:
        """Close the connection (and any descriptor received that no response claimed)."""
        self._sock.close()
        self._descriptors.close()

    def __enter__(self) -> SyncClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def send_raw(self, data: bytes) -> None:
        """Send bytes as they are (tests use this to send malformed frames)."""
        self._sock.sendall(data)

    def receive(self) -> dict[str, Any]:
        """The next message from mountd (descriptors that came with it are closed)."""
        message, fds = self._receive()
        close_all(fds)
        return message

    def _receive(self) -> tuple[dict[str, Any], tuple[int, ...]]:
        """The next message from mountd and the descriptors it carries (the caller's).

        Every message takes its own (its top-level ``fds`` says how many) from the front of
        the queue of received ones, in order (mountd/rpc/fdpass.py): they came with its
        first byte, so they are there once the message is complete. A message whose
        descriptors cannot be matched closes the connection (:class:`ProtocolError`).
        """
        while not self._ready:
            try:
                data, fds = receive_with_fds_blocking(self._sock, 65536, MAX_OPEN)
            except TimeoutError:
                raise MountdUnavailable(f"mountd at {self.path} did not answer in time") from None
            except ProtocolError:
                self.close()  # descriptors lost: the rest cannot be matched to messages
                raise
            except OSError as exc:
                raise MountdUnavailable(f"lost the connection to mountd at {self.path}: {exc}") from None
            self._descriptors.queue(fds)
            if not data:
                raise MountdUnavailable(f"mountd at {self.path} closed the connection")
            self._ready.extend(self._decoder.feed(data))
        message = protocol.decode_body(self._ready.pop(0))
        try:
            return message, self._descriptors.take(protocol.response_fds(message))
        except ProtocolError:
            self.close()
            raise

    def call(self, op: str, args: Mapping[str, Any] | None = None, *, progress: ProgressFn | None = None,
             fds: Sequence[int] = ()) -> Any:
        """Send one request (with ``fds`` attached: ops that carry descriptors) and wait for
        its answer; mountd's errors are raised here."""
        result, received = self.call_with_fds(op, args, progress=progress, fds=fds)
        close_all(received)  # none expected
        return result

    def call_with_fds(self, op: str, args: Mapping[str, Any] | None = None, *,
                      progress: ProgressFn | None = None,
                      fds: Sequence[int] = ()) -> tuple[Any, tuple[int, ...]]:
        """:meth:`call`, also giving the descriptors that came with the answer (ops with
        ``reply_fds``): the caller owns them. An error answer carries none."""
        rid = next(self._ids)
        if fds:
            args = {**(args or {}), "fds": len(fds)}
        try:
            frame = protocol.encode_frame(protocol.make_request(rid, op, args))
            if fds:
                send_with_fds_blocking(self._sock, frame, fds)
            else:
                self._sock.sendall(frame)
        except OSError as exc:
            raise MountdUnavailable(f"lost the connection to mountd at {self.path}: {exc}") from None
        while True:
            message, received = self._receive()
            if message.get("id") != rid:
                close_all(received)
                if message.get("id") is None and message.get("ok") is False:
                    raise protocol.exception_from_payload(message.get("error"))
                continue  # a late answer to something else: not ours
            if "progress" in message:
                close_all(received)
                if progress is not None:
                    progress(message["progress"])
                continue
            return _result_with(message, received)

    def notify(self, op: str, args: Mapping[str, Any] | None = None) -> None:
        """Send a request that gets no answer (``hits``, ``prefetch``)."""
        self._sock.sendall(protocol.encode_frame(protocol.make_request(None, op, args)))

    # The operations, named as in the protocol.

    def hello(self) -> dict[str, Any]:
        return self.call("hello", {"version": PROTOCOL_VERSION, "client": "quiverfs-sync"})

    def ensure(self, hash: bytes, size: int, location: Location | Mapping[str, Any],
               dataset: str | None = None) -> str:
        return _path_of(self.call("ensure", ensure_args(hash, size, location, dataset)))

    def lease(self, hash: bytes, size: int, location: Location | Mapping[str, Any],
              dataset: str | None = None) -> str | None:
        """``ensure`` for a client that supplies its own bytes: the path, or None when this
        client must :meth:`supply` them (it holds the hash's lease until it does)."""
        return self.call("ensure", ensure_args(hash, size, location, dataset)).get("path")

    def supply(self, hash: bytes, size: int, location: Location | Mapping[str, Any], fd: int,
               offset: int, dataset: str | None = None) -> str:
        """Hand mountd the content of ``hash``: ``size`` bytes at ``offset`` of descriptor
        ``fd`` (opened with this process's rights); mountd verifies them. The store path."""
        args = {**ensure_args(hash, size, location, dataset), "offset": offset}
        return self.call("supply", args, fds=[fd])["path"]

    def release(self, hashes: Sequence[bytes]) -> int:
        """Give up leases: this client will not supply these hashes."""
        return self.call("release", {"hashes": [bytes(h).hex() for h in hashes]})["released"]

    def open(self, hashes: Sequence[bytes], dataset: str | None = None,
             sizes: Sequence[int] | None = None) -> list[Opened]:
        """Descriptor hand-off: the store files of up to :data:`MAX_OPEN` hashes, opened by
        mountd (read-only, close-on-exec) and sent in one answer. For each hash, in order,
        ``(descriptor, size)`` (the caller closes the descriptor) or None: not cached, or
        cached with another size than ``sizes`` gives (read those through the mount). Each
        descriptor counts as a hit of ``dataset``: report no hit for it."""
        result, fds = self.call_with_fds("open", open_args(hashes, dataset, sizes))
        return _opened(result, fds, hashes)

    def stats(self) -> dict[str, Any]:
        return self.call("stats")

    def usage(self) -> dict[str, Any]:
        return self.call("usage")

    def ls(self) -> dict[str, Any]:
        return self.call("ls")

    def evict(self, dataset: str | None = None, *, all: bool = False) -> dict[str, int]:
        return self.call("evict", {"all": True} if all else {"dataset": dataset})

    def scrub(self, progress: ProgressFn | None = None) -> Any:
        return self.call("scrub", progress=progress)

    def shutdown(self) -> dict[str, Any]:
        return self.call("shutdown")


@contextmanager
def _opened_digest(args: Mapping[str, Any]) -> Iterator[list[int]]:
    """The registration's digest, opened with this process's rights, as the descriptor list
    to send with it: a mountd running as another user checks that the digest it is asked
    to load is one the client could open (none when it cannot be opened: mountd decides)."""
    digest = args.get("digest")
    fd = None
    if digest is not None:
        with contextlib.suppress(OSError):
            fd = os.open(digest, os.O_RDONLY | os.O_CLOEXEC)
    try:
        yield [] if fd is None else [fd]
    finally:
        if fd is not None:
            os.close(fd)


def _path_of(result: Mapping[str, Any]) -> str:
    """The ``path`` of an ``ensure`` answer; a ``supply`` answer is an error for a client
    that expected mountd to fetch (it asked without being able to supply)."""
    if "path" not in result:
        raise PermissionDenied(
            "mountd does not read sources for this user (it runs as another uid): "
            "this client must supply the bytes itself (see docs/operations.md \"Security\")")
    return result["path"]


def _result(message: Mapping[str, Any]) -> Any:
    ok = message.get("ok")
    if ok is True:
        return message.get("result")
    if ok is False:
        raise protocol.exception_from_payload(message.get("error"))
    raise ProtocolError("mountd sent a response without 'ok'")


def _result_with(message: Mapping[str, Any], received: Sequence[int]) -> tuple[Any, Sequence[int]]:
    """``(result, descriptors)`` of a response that came with ``received`` descriptors; they
    are closed when the response is an error (nobody else would)."""
    try:
        return _result(message), received
    except BaseException:
        close_all(received)
        raise


# -- starting mountd on demand --------------------------------------------------------------------


def probe(cache_dir: str | os.PathLike[str] | None = None, timeout: float = CONNECT_TIMEOUT) -> dict[str, Any] | None:
    """mountd's ``hello`` answer when one answers for ``cache_dir``, else None."""
    try:
        with SyncClient.connect(cache_dir, timeout=timeout) as client:
            return client.hello_info
    except MountdUnavailable:
        return None


def _owner_of(path: Path) -> str:
    try:
        return str(path.stat().st_uid)
    except OSError:
        return "?"


@contextmanager
def _start_lock(cache_dir: Path, deadline: float) -> Any:
    fd = os.open(cache_dir / START_LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        delay = 0.005
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise MountdUnavailable(
                        f"timed out waiting for another client starting mountd in {cache_dir}"
                    ) from None
                time.sleep(delay)
                delay = min(delay * 2, 0.1)
        yield
    finally:
        os.close(fd)  # releases the lock


def mountd_command(cache_dir: Path, options: Sequence[str] = ()) -> list[str]:
    """The command that runs mountd in the foreground for ``cache_dir``."""
    return [sys.executable, "-m", "quiverfs.cli", "mountd", "--cache-dir", os.fspath(cache_dir), *options]


def _log_tail(path: Path, lines: int = 3) -> str:
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return " | ".join(line.strip() for line in text[-lines:])


def ensure_running(
    cache_dir: str | os.PathLike[str] | None = None,
    *,
    options: Sequence[str] = (),
    timeout: float = START_TIMEOUT,
) -> dict[str, Any]:
    """Make sure a mountd answers for ``cache_dir``, starting one if needed; its ``hello``.

    ``options`` are extra ``quiverfs mountd`` flags for a mountd started here (e.g.
    ``["--cache-size", "20%"]``); a mountd already running keeps its own. Blocking: polls the
    socket with growing intervals until ``timeout``. Raises :class:`MountdUnavailable` with
    the end of the log when the started mountd exits or stays silent.
    """
    directory, _ = resolve_socket(cache_dir)
    info = probe(directory)
    if info is not None:
        return info
    deadline = time.monotonic() + timeout
    try:
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        if not os.access(directory, os.W_OK | os.X_OK):
            raise PermissionError(errno.EACCES, "not writable", os.fspath(directory))
    except PermissionError:
        # Another user's cache dir (a shared mountd's, docs/operations.md "Security"): a
        # mountd of ours cannot serve it, and starting one would only fail later.
        raise MountdUnavailable(
            f"no mountd is serving {directory}, and uid {os.geteuid()} may not start one "
            f"there (it belongs to uid {_owner_of(directory)}): start the machine's shared "
            f"mountd (docs/operations.md), or pass a --cache-dir of your own"
        ) from None
    with _start_lock(directory, deadline):
        info = probe(directory)  # someone may have started it while we waited for the lock
        if info is not None:
            return info
        log_path = directory / LOG_FILE
        log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        try:
            proc = subprocess.Popen(
                mountd_command(directory, options),
                stdin=subprocess.DEVNULL, stdout=log_fd, stderr=log_fd,
                start_new_session=True,  # detached: no signals from the starter's terminal
                close_fds=True, cwd="/",
            )
        finally:
            os.close(log_fd)
        delay = 0.01
        while True:
            info = probe(directory)
            if info is not None:
                return info
            status = proc.poll()
            if status is not None and status != EXIT_ALREADY_RUNNING:
                raise MountdUnavailable(
                    f"mountd exited with status {status} before it was ready "
                    f"(log {log_path}: {_log_tail(log_path)})"
                )
            # status 75: a mountd started by hand owns the directory and is still coming up.
            if time.monotonic() > deadline:
                raise MountdUnavailable(
                    f"mountd did not answer on {layout.socket_path(directory)} within {timeout:g}s "
                    f"(log {log_path}: {_log_tail(log_path)})"
                )
            time.sleep(delay)
            delay = min(delay * 1.5, 0.2)


# -- the async client -----------------------------------------------------------------------------


@dataclass(eq=False)
class _Waiter:
    done: trio.Event = field(default_factory=trio.Event)
    message: dict[str, Any] | None = None
    progress: ProgressFn | None = None
    #: descriptors that came with the answer: the waiting call's to close or hand on
    fds: tuple[int, ...] = ()


@dataclass(eq=False)
class _Connection:
    stream: trio.SocketStream
    waiters: dict[int, _Waiter] = field(default_factory=dict)
    send_lock: trio.Lock = field(default_factory=trio.Lock)
    alive: bool = True
    info: dict[str, Any] = field(default_factory=dict)


class _ConnectionLost(Exception):
    """The connection dropped before the answer came (the request may be retried)."""


class AsyncClient:
    """One pipelined connection to mountd, for trio code. Use :func:`open_client`.

    Every method may be called from many tasks at once. Cancellation: a cancelled call stops
    waiting; mountd still finishes the request (a fill still lands in the cache).
    """

    def __init__(self, cache_dir: str | os.PathLike[str] | None, nursery: trio.Nursery, *,
                 start: bool = False, options: Sequence[str] = (), timeout: float = START_TIMEOUT) -> None:
        self.cache_dir, self.socket_path = resolve_socket(cache_dir)
        self._nursery = nursery
        self._start = start
        self._options = list(options)
        self._timeout = timeout
        self._conn: _Connection | None = None
        self._connect_lock = trio.Lock()
        self._ids = itertools.count(1)
        self._closed = False
        #: local mount handle → register args, replayed after a reconnect
        self._registrations: dict[int, dict[str, Any]] = {}
        #: local mount handle → the id mountd gave it on the current connection
        self._server_mounts: dict[int, int] = {}
        self._next_handle = itertools.count(1)

    @property
    def info(self) -> dict[str, Any]:
        """mountd's ``hello`` answer on the current connection (empty before the first)."""
        return self._conn.info if self._conn else {}

    async def connect(self) -> None:
        """Connect now (otherwise the first call does); starts mountd if opened with start=True."""
        await self._connection()

    async def _connection(self) -> _Connection:
        conn = self._conn
        if conn is not None and conn.alive:
            return conn
        async with self._connect_lock:
            if self._closed:
                raise MountdUnavailable("the mountd client is closed")
            if self._conn is not None and self._conn.alive:
                return self._conn
            if self._start:
                await trio.to_thread.run_sync(
                    lambda: ensure_running(self.cache_dir, options=self._options, timeout=self._timeout)
                )
            try:
                stream = await trio.open_unix_socket(os.fspath(self.socket_path))
            except OSError as exc:
                raise _unavailable(self.socket_path, exc) from None
            conn = _Connection(stream)
            self._nursery.start_soon(self._reader, conn)
            try:
                conn.info = await self._call_on(
                    conn, "hello", {"version": PROTOCOL_VERSION, "client": "quiverfs-async"}, None
                )
                self._server_mounts.clear()
                for handle, args in self._registrations.items():
                    with _opened_digest(args) as fds:
                        answer = await self._call_on(conn, "register", args, None, fds)
                    self._server_mounts[handle] = answer["mount"]
            except _ConnectionLost as exc:
                raise MountdUnavailable(f"mountd at {self.socket_path} went away: {exc}") from None
            except BaseException:
                await self._kill(conn)
                raise
            self._conn = conn
            return conn

    async def _kill(self, conn: _Connection) -> None:
        """Give up a connection whose byte stream can no longer be trusted."""
        conn.alive = False
        with trio.CancelScope(shield=True):
            await conn.stream.aclose()

    async def _send(self, conn: _Connection, frame: bytes, fds: Sequence[int] = ()) -> None:
        if not fds:
            try:
                # Never leaves half a frame behind (it is cancelled before the first byte,
                # or writes the whole frame).
                await send_frame(conn.stream, conn.send_lock, frame)
                return
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
                conn.alive = False
                raise _ConnectionLost(str(exc)) from None
        async with conn.send_lock:
            try:
                await send_with_fds(conn.stream.socket, frame, fds)
            except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                conn.alive = False
                raise _ConnectionLost(str(exc)) from None
            except BaseException:
                # Cancelled (or failed) part-way through a frame: the stream may now hold half
                # a message, so nothing more can be sent on it. Requests waiting on it fail
                # (idempotent ones are retried on a new connection).
                await self._kill(conn)
                raise

    async def _reader(self, conn: _Connection) -> None:
        # Every answer takes the descriptors it announces from the queue, in order, whoever
        # waits for it (mountd/rpc/fdpass.py); those nobody waits for are closed at once.
        descriptors = DescriptorStream(conn.stream.socket, MAX_OPEN, MAX_QUEUED_FDS)
        reader = protocol.ExactReader(descriptors)
        try:
            while True:
                message = await reader.read_frame()
                if message is None:
                    break
                fds = descriptors.take(protocol.response_fds(message))
                rid = message.get("id")
                waiter = conn.waiters.get(rid) if isinstance(rid, int) else None
                if waiter is None or "progress" in message:
                    close_all(fds)
                    if waiter is not None and waiter.progress is not None:
                        waiter.progress(message["progress"])
                    continue  # else a cancelled request's answer, or an error with id null
                waiter.message = message
                waiter.fds = fds
                waiter.done.set()
        except (ProtocolError, trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass
        finally:
            descriptors.close()
            conn.alive = False
            for waiter in conn.waiters.values():
                waiter.done.set()  # message None: the connection was lost
            conn.waiters.clear()
            with trio.CancelScope(shield=True):
                await conn.stream.aclose()

    async def _exchange(self, conn: _Connection, op: str, args: Mapping[str, Any] | None,
                        progress: ProgressFn | None, fds: Sequence[int] = ()
                        ) -> tuple[dict[str, Any], tuple[int, ...]]:
        """Send one request and wait for its answer: the message and the descriptors that
        came with it (the caller's; closed here if the call ends any other way)."""
        rid = next(self._ids)
        waiter = _Waiter(progress=progress)
        conn.waiters[rid] = waiter
        if fds:
            args = {**(args or {}), "fds": len(fds)}
        delivered = False
        try:
            await self._send(conn, protocol.encode_frame(protocol.make_request(rid, op, args)), fds)
            await waiter.done.wait()
            if waiter.message is None:
                raise _ConnectionLost("mountd closed the connection")
            delivered = True
            return waiter.message, waiter.fds
        finally:
            conn.waiters.pop(rid, None)
            if not delivered:  # cancelled after the answer came, say
                close_all(waiter.fds)

    async def _call_on(self, conn: _Connection, op: str, args: Mapping[str, Any] | None,
                       progress: ProgressFn | None, fds: Sequence[int] = ()) -> Any:
        message, received = await self._exchange(conn, op, args, progress, fds)
        close_all(received)  # none expected
        return _result(message)

    async def call(self, op: str, args: Mapping[str, Any] | None = None, *,
                   progress: ProgressFn | None = None, fds: Sequence[int] = ()) -> Any:
        """Send one request and wait for its answer; mountd's errors are raised here.

        If the connection drops first, an idempotent request is retried once on a new
        connection; otherwise :class:`MountdUnavailable` is raised.
        """
        result, received = await self.call_with_fds(op, args, progress=progress, fds=fds)
        close_all(received)  # none expected
        return result

    async def call_with_fds(self, op: str, args: Mapping[str, Any] | None = None, *,
                            progress: ProgressFn | None = None,
                            fds: Sequence[int] = ()) -> tuple[Any, tuple[int, ...]]:
        """:meth:`call`, also giving the descriptors that came with the answer (ops with
        ``reply_fds``): the caller owns them. An error answer carries none."""
        operation = protocol.OPERATIONS.get(op)
        attempts = 2 if operation is not None and operation.idempotent else 1
        for attempt in range(attempts):
            conn = await self._connection()
            try:
                message, received = await self._exchange(conn, op, args, progress, fds)
            except _ConnectionLost as exc:
                if attempt + 1 == attempts:
                    raise MountdUnavailable(
                        f"lost the connection to mountd at {self.socket_path} during {op}: {exc}"
                    ) from None
                continue
            return _result_with(message, received)
        raise AssertionError("unreachable")

    async def notify(self, op: str, args: Mapping[str, Any] | None = None) -> None:
        """Send a request that gets no answer; lost if the connection drops (hits are advisory)."""
        conn = await self._connection()
        with contextlib.suppress(_ConnectionLost):
            await self._send(conn, protocol.encode_frame(protocol.make_request(None, op, args)))

    async def aclose(self) -> None:
        """Close the connection; waiting calls fail with :class:`MountdUnavailable`."""
        self._closed = True
        if self._conn is not None:
            self._conn.alive = False
            await self._conn.stream.aclose()

    # The operations, named as in the protocol.

    async def hello(self) -> dict[str, Any]:
        return await self.call("hello", {"version": PROTOCOL_VERSION, "client": "quiverfs-async"})

    async def ensure(self, hash: bytes, size: int, location: Location | Mapping[str, Any],
                     dataset: str | None = None) -> str:
        """Path of the verified store file of ``hash``, fetched by mountd if needed."""
        return _path_of(await self.call("ensure", ensure_args(hash, size, location, dataset)))

    async def lease(self, hash: bytes, size: int, location: Location | Mapping[str, Any],
                    dataset: str | None = None) -> str | None:
        """``ensure`` for a client that supplies its own bytes (``info["fills"] ==
        "client"``): the path, or None when this client must :meth:`supply` them."""
        return (await self.call("ensure", ensure_args(hash, size, location, dataset))).get("path")

    async def supply(self, hash: bytes, size: int, location: Location | Mapping[str, Any], fd: int,
                     offset: int, dataset: str | None = None) -> str:
        """Hand mountd ``size`` bytes at ``offset`` of ``fd`` as the content of ``hash``
        (verified there); the store path. The caller still owns and closes ``fd``."""
        args = {**ensure_args(hash, size, location, dataset), "offset": offset}
        return (await self.call("supply", args, fds=[fd]))["path"]

    async def release(self, hashes: Sequence[bytes]) -> int:
        """Give up leases: this client will not supply these hashes."""
        return (await self.call("release", {"hashes": [bytes(h).hex() for h in hashes]}))["released"]

    async def open(self, hashes: Sequence[bytes], dataset: str | None = None,
                   sizes: Sequence[int] | None = None) -> list[Opened]:
        """Descriptor hand-off (:meth:`SyncClient.open`): for each of up to
        :data:`MAX_OPEN` hashes, ``(descriptor, size)`` of its store file, opened by mountd,
        or None; the caller closes the descriptors. Each one counts as a hit of ``dataset``.
        Not retried after a lost connection (mountd may have counted the hits)."""
        result, fds = await self.call_with_fds("open", open_args(hashes, dataset, sizes))
        return _opened(result, fds, hashes)

    async def prefetch(self, items: Iterable[tuple[bytes, int, Location | Mapping[str, Any]]],
                       dataset: str | None = None, *, wait: bool = True) -> int | None:
        """Queue fills; the number mountd queued (None with ``wait=False``: fire and forget)."""
        args: dict[str, Any] = {"items": [ensure_args(h, s, loc) for h, s, loc in items]}
        if dataset is not None:
            args["dataset"] = dataset
        if not wait:
            await self.notify("prefetch", args)
            return None
        return (await self.call("prefetch", args))["queued"]

    async def hits(self, dataset: str | None, hashes: Sequence[bytes], nbytes: int) -> None:
        """Report reads served straight from the store (a notification: no answer awaited)."""
        args: dict[str, Any] = {"packed": b"".join(bytes(h) for h in hashes).hex(), "bytes": nbytes}
        if dataset is not None:
            args["dataset"] = dataset
        await self.notify("hits", args)

    async def register(self, dataset: str, *, digest: str | None = None, mountpoint: str | None = None,
                       pid: int | None = None, sources: Sequence[str] = ()) -> int:
        """Register a mount of ``dataset``; a handle for :meth:`unregister`.

        mountd drops the registration when this connection closes; after a reconnect this
        client registers it again by itself.
        """
        args: dict[str, Any] = {"dataset": dataset, "pid": os.getpid() if pid is None else pid,
                                "sources": list(sources)}
        if digest is not None:
            args["digest"] = digest
        if mountpoint is not None:
            args["mountpoint"] = mountpoint
        handle = next(self._next_handle)
        self._registrations[handle] = args
        try:
            with _opened_digest(args) as fds:
                answer = await self.call("register", args, fds=fds)
        except BaseException:
            del self._registrations[handle]
            raise
        self._server_mounts[handle] = answer["mount"]
        return handle

    async def unregister(self, handle: int) -> None:
        """Undo :meth:`register`."""
        self._registrations.pop(handle, None)
        server_id = self._server_mounts.pop(handle, None)
        if server_id is not None:
            await self.call("unregister", {"mount": server_id})

    async def stats(self) -> dict[str, Any]:
        return await self.call("stats")

    async def usage(self) -> dict[str, Any]:
        return await self.call("usage")

    async def ls(self) -> dict[str, Any]:
        return await self.call("ls")

    async def evict(self, dataset: str | None = None, *, all: bool = False) -> dict[str, int]:
        return await self.call("evict", {"all": True} if all else {"dataset": dataset})

    async def scrub(self, progress: ProgressFn | None = None) -> Any:
        return await self.call("scrub", progress=progress)

    async def shutdown(self) -> dict[str, Any]:
        return await self.call("shutdown")

    # Job sessions (docs/control-protocol.md). Errors are SessionError subclasses with errno.

    async def session_open(self, dataset: str, job: str, *, rank: int = 0, world_size: int = 1,
                           epoch: int = 0, seed: int = 0, lookahead: int = 10) -> dict[str, Any]:
        """Open (idempotently) ``job``'s ``rank`` session on ``dataset``; the session info."""
        return await self.call("session_open", {
            "dataset": dataset, "job": job, "rank": rank, "world_size": world_size,
            "epoch": epoch, "seed": seed, "lookahead": lookahead,
        })

    async def claim(self, dataset: str, job: str, rank: int, n: int, *,
                    epoch: int | None = None) -> dict[str, Any]:
        """Up to ``n`` compact ids: ``{"epoch", "hits", "fetch", "chunk", "remaining"}``."""
        args: dict[str, Any] = {"dataset": dataset, "job": job, "rank": rank, "n": n}
        if epoch is not None:
            args["epoch"] = epoch
        return await self.call("claim", args)

    async def next_epoch(self, dataset: str, job: str, rank: int, epoch: int | None = None) -> dict[str, Any]:
        args: dict[str, Any] = {"dataset": dataset, "job": job, "rank": rank}
        if epoch is not None:
            args["epoch"] = epoch
        return await self.call("next_epoch", args)

    async def session_close(self, dataset: str, job: str, rank: int, *, seconds: float | None = None) -> None:
        args: dict[str, Any] = {"dataset": dataset, "job": job, "rank": rank}
        if seconds is not None:
            args["seconds"] = seconds
        await self.call("session_close", args)

    async def report_batch(self, dataset: str, job: str, rank: int, seconds: float, *,
                           files: int | None = None, misses: int | None = None) -> None:
        """``files``/``misses``: the batch's files and how many its claim gave as ``fetch``
        (optional, together: the report is then classified exactly as a hit or miss sample)."""
        args: dict[str, Any] = {"dataset": dataset, "job": job, "rank": rank, "seconds": seconds}
        if files is not None:
            args["files"], args["misses"] = files, misses
        await self.call("report_batch", args)

    async def report_epoch(self, dataset: str, job: str, rank: int, epoch: int, seconds: float) -> None:
        await self.call("report_epoch", {"dataset": dataset, "job": job, "rank": rank,
                                         "epoch": epoch, "seconds": seconds})

    async def timings(self, dataset: str, job: str) -> dict[str, Any]:
        return await self.call("timings", {"dataset": dataset, "job": job})


@asynccontextmanager
async def open_client(
    cache_dir: str | os.PathLike[str] | None = None, *, start: bool = False,
    options: Sequence[str] = (), timeout: float = START_TIMEOUT,
) -> AsyncIterator[AsyncClient]:
    """An :class:`AsyncClient` connected to the mountd of ``cache_dir``, closed on exit.

    With ``start=True`` a mountd is started when none answers (see :func:`ensure_running`),
    now and on any later reconnect.
    """
    async with trio.open_nursery() as nursery:
        client = AsyncClient(cache_dir, nursery, start=start, options=options, timeout=timeout)
        try:
            await client.connect()
            yield client
        finally:
            with trio.CancelScope(shield=True):
                await client.aclose()
            nursery.cancel_scope.cancel()


def connect_or_start(
    cache_dir: str | os.PathLike[str] | None = None, *, options: Sequence[str] = (),
    timeout: float = START_TIMEOUT,
) -> Any:
    """``async with connect_or_start(DIR) as client``: connect, starting a mountd if none runs.

    Two processes racing here start exactly one mountd (they serialise on
    ``DIR/mountd.start.lock``); ``options`` are ``quiverfs mountd`` flags for a new one.
    """
    return open_client(cache_dir, start=True, options=options, timeout=timeout)
