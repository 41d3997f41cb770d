"""The async client of mountd, for trio code (the FUSE processes): one pipelined connection.

:class:`AsyncClient` keeps one connection; a reader task hands each response to the request
waiting on its id, so many requests (a FUSE process's misses) share the connection
concurrently. When the connection drops, waiting requests fail with
:class:`~mountd.errors.MountdUnavailable`; the next call reconnects (starting a mountd first
when the client was opened with ``start=True``: :func:`mountd.rpc.client.ensure_running`),
replays the mounts it had registered, and idempotent requests that were cut off are retried
once.

Errors from mountd are re-raised here as the same quiverfs error class (see
:func:`mountd.rpc.protocol.exception_from_payload`).
"""

from __future__ import annotations

import contextlib
import itertools
import os
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping, Sequence
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from typing import Any

import trio

from mountd.errors import MountdUnavailable, ProtocolError
from mountd.rpc import protocol
from mountd.rpc.calls import (
    MAX_QUEUED_FDS,
    Opened,
    ProgressFn,
    connect_error,
    ensure_args,
    open_args,
    opened_files,
    path_of,
    resolve_socket,
    result_of,
    result_with_fds,
)
from mountd.rpc.client import START_TIMEOUT, ensure_running
from mountd.rpc.fdpass import DescriptorStream, close_all, send_frame, send_with_fds
from mountd.rpc.protocol import MAX_OPEN, PROTOCOL_VERSION
from quiverfs.base.backends.base import Location


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
                raise connect_error(self.socket_path, exc) from None
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
        return result_of(message)

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
            return result_with_fds(message, received)
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
        return path_of(await self.call("ensure", ensure_args(hash, size, location, dataset)))

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
        return opened_files(result, fds, hashes)

    async def prefetch(self, items: Iterable[tuple[bytes, int, Location | Mapping[str, Any]]],
                       dataset: str | None = None, *, wait: bool = True,
                       renew: bool = False) -> int | None:
        """Queue fills; the number mountd queued (None with ``wait=False``: fire and forget).
        ``renew``: items already in the store are protected again, as if just fetched ahead."""
        args: dict[str, Any] = {"items": [ensure_args(h, s, loc) for h, s, loc in items]}
        if dataset is not None:
            args["dataset"] = dataset
        if renew:
            args["renew"] = True
        if not wait:
            await self.notify("prefetch", args)
            return None
        return (await self.call("prefetch", args))["queued"]

    async def hits(self, dataset: str | None, hashes: Sequence[bytes], nbytes: int,
                   done: Sequence[bytes] = (), opened: Sequence[bytes] = ()) -> None:
        """Report reads served straight from the store (a notification: no answer awaited).
        ``done``: files (hits or not) the reader will not read again until its next epoch;
        ``opened``: files a reader opened, whoever served their bytes (the kernel's pages,
        with no READ to count: not hits, but read as far as protections go)."""
        args: dict[str, Any] = {"packed": b"".join(bytes(h) for h in hashes).hex(), "bytes": nbytes}
        if dataset is not None:
            args["dataset"] = dataset
        if done:
            args["done"] = b"".join(bytes(h) for h in done).hex()
        if opened:
            args["opened"] = b"".join(bytes(h) for h in opened).hex()
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
                    epoch: int | None = None, batch: int | None = None) -> dict[str, Any]:
        """Up to ``n`` compact ids: ``{"epoch", "hits", "fetch", "chunk", "remaining",
        "wait"}``; ``batch``: the rank's batch size (empty claims may then say ``wait``)."""
        args: dict[str, Any] = {"dataset": dataset, "job": job, "rank": rank, "n": n}
        if epoch is not None:
            args["epoch"] = epoch
        if batch is not None:
            args["batch"] = batch
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
