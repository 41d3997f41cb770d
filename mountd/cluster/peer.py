"""Moving content between mountds: the peer server (serves this node's store by hash) and
the client (asks other nodes, pushes a fetched file to its owner). Protocol: :mod:`wire`.

The server answers only clients that pass the cluster-secret handshake. A ``GET`` is served
from the store as a hit (it refreshes the file's recency: peers' demand keeps it cached); a
``PUT`` is verified against its hash and stored like bytes a client supplied
(:meth:`mountd.store.cache.Cache.ensure_supplied`, charged to nobody).

With peer TLS (:mod:`mountd.cluster.tls`) both ends wrap the connection before the secret's
handshake; a peer whose certificate the cluster CA did not sign never reaches it.

The client keeps idle connections per peer, so a transfer costs one round trip after the
first. Every transfer runs under a deadline (``peer_timeout``, plus a second per
:data:`SLOWEST_RATE` bytes of content): a peer that hangs costs that much, then the caller
tries the next source. Whoever receives content checks it against the hash before anyone
uses it; wrong bytes are :class:`~mountd.errors.PeerCorrupt`. Content up to
:data:`MEMORY_BYTES` is held in memory; larger files are streamed through an unlinked spool
file in the cache's ``tmp/`` (hashed as they arrive) and sent from the store file in steps,
so a transfer's memory stays bounded whatever the file's size.
"""

from __future__ import annotations

import contextlib
import logging
import os
import ssl
from collections.abc import Awaitable, Callable, Iterable
from typing import TypeVar

import blake3
import trio

from mountd.cluster import wire
from mountd.cluster.config import split_address
from mountd.cluster.counters import ClusterCounters
from mountd.errors import PeerCorrupt, PeerError
from mountd.store import layout
from mountd.store.cache import Cache
from mountd.store.peers import PEER_URL, PeerBytes, PeerContent, PeerFile, spool_file
from quiverfs.base.backends.base import Location
from quiverfs.base.errors import QuiverError

log = logging.getLogger("mountd.cluster.peer")

T = TypeVar("T")

#: Seconds a server waits for the next request on an idle connection before closing it.
IDLE_SECONDS = 120.0
#: Content at least this large is hashed in a worker thread.
THREAD_HASH_BYTES = 1 << 20
#: Content larger than this is received into a spool file, not memory.
MEMORY_BYTES = 8 << 20
#: Bytes sent or written per step while streaming content.
STEP = 1 << 20
#: Slowest transfer rate a peer may have (bytes/s) before its deadline ends it: a transfer
#: of ``size`` bytes gets ``peer_timeout + size / SLOWEST_RATE`` seconds.
SLOWEST_RATE = 8 << 20


async def content_hash(data: bytes) -> bytes:
    """blake3 of ``data`` (in a worker thread when large)."""
    if len(data) < THREAD_HASH_BYTES:
        return blake3.blake3(data).digest()
    return await trio.to_thread.run_sync(
        lambda: blake3.blake3(data, max_threads=blake3.blake3.AUTO).digest())


def deadline(timeout: float, size: int) -> float:
    """Seconds a transfer of ``size`` bytes may take (see :data:`SLOWEST_RATE`)."""
    return timeout + size / SLOWEST_RATE


async def receive_content(stream: trio.abc.ReceiveStream, hash: bytes, size: int,
                          spool: str | os.PathLike[str], sender: str) -> PeerContent:
    """``size`` bytes of ``hash`` from ``stream``, checked: in memory, or (above
    :data:`MEMORY_BYTES`) in a spool file in ``spool``, hashed as it arrives.
    :class:`PeerCorrupt` when they do not match ``hash``."""
    if size <= MEMORY_BYTES:
        data = await wire.receive_exactly(stream, size)
        if await content_hash(data) != hash:
            raise PeerCorrupt(f"peer {sender} sent bytes that do not match {hash.hex()}")
        return PeerBytes(data)
    fd = await trio.to_thread.run_sync(spool_file, spool)
    try:
        hasher = blake3.blake3()
        buffered, left = bytearray(), size
        while left:
            data = await stream.receive_some(min(wire.RECEIVE_STEP, left))
            if not data:
                raise PeerError(f"peer {sender} closed the connection after "
                                f"{size - left} of {size} bytes")
            buffered += data
            left -= len(data)
            if len(buffered) >= STEP or not left:
                chunk, buffered = bytes(buffered), bytearray()
                await trio.to_thread.run_sync(_write_and_hash, fd, chunk, hasher)
        if hasher.digest() != hash:
            raise PeerCorrupt(f"peer {sender} sent bytes that do not match {hash.hex()}")
    except BaseException:
        os.close(fd)
        raise
    return PeerFile(fd, size)


def _write_and_hash(fd: int, chunk: bytes, hasher: blake3.blake3) -> None:
    hasher.update(chunk)
    view = memoryview(chunk)
    while view:
        view = view[os.write(fd, view):]


async def send_file(stream: trio.abc.SendStream, fd: int, size: int) -> None:
    """``size`` bytes of ``fd`` from offset 0 to ``stream``, a step at a time."""
    offset = 0
    while offset < size:
        chunk = await trio.to_thread.run_sync(os.pread, fd, min(STEP, size - offset), offset)
        if not chunk:
            raise PeerError(f"a stored file shrank while being sent ({offset} of {size} bytes)")
        await stream.send_all(chunk)
        offset += len(chunk)


def pack_bits(flags: Iterable[bool]) -> bytes:
    """``flags`` as a bitmap, bit ``i`` (least significant first) of byte ``i // 8``."""
    out = bytearray()
    for i, flag in enumerate(flags):
        if i % 8 == 0:
            out.append(0)
        if flag:
            out[-1] |= 1 << (i % 8)
    return bytes(out)


def unpack_bits(data: bytes, count: int) -> list[bool]:
    """The first ``count`` flags of a :func:`pack_bits` bitmap."""
    return [bool(data[i // 8] >> (i % 8) & 1) for i in range(count)]


class PeerServer:
    """Serves ``cache`` to authenticated peers (see the module docstring)."""

    def __init__(self, cache: Cache, secret: bytes, counters: ClusterCounters, *,
                 max_bytes: int, timeout: float, tls: ssl.SSLContext | None = None) -> None:
        self.cache = cache
        self.secret = secret
        self.counters = counters
        self.max_bytes = max_bytes
        self.timeout = timeout
        self.tls = tls
        self.spool = layout.tmp_dir(cache.config.cache_dir)

    async def serve(self, host: str, port: int, *,
                    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        """Listen on ``host:port`` (0: any free port); ``task_status`` gets the bound port."""
        listeners = await trio.open_tcp_listeners(port, host=host)
        bound = listeners[0].socket.getsockname()[1]
        async with trio.open_nursery() as nursery:
            await nursery.start(trio.serve_listeners, self._handle, listeners)
            task_status.started(bound)

    async def _handle(self, raw: trio.SocketStream) -> None:
        remote = _remote(raw)
        stream: trio.abc.Stream = raw
        try:
            async with stream:
                if self.tls is not None:
                    stream = trio.SSLStream(raw, self.tls, server_side=True)
                    try:
                        with trio.fail_after(self.timeout):
                            await stream.do_handshake()
                    except (trio.BrokenResourceError, trio.TooSlowError) as exc:
                        # No certificate from the cluster CA, or no TLS at all (a plain
                        # client waits for the secret's handshake until the deadline).
                        self.counters.auth_failures += 1
                        log.warning("peer %s failed the TLS handshake: %s", remote,
                                    exc.__cause__ or exc or "timed out")
                        return
                with trio.fail_after(self.timeout):
                    accepted = await wire.server_handshake(stream, self.secret)
                if not accepted:
                    self.counters.auth_failures += 1
                    log.warning("peer %s failed the cluster-secret handshake", remote)
                    return
                while True:
                    op = b""  # idle too long: close
                    with trio.move_on_after(IDLE_SECONDS):
                        op = await stream.receive_some(1)
                    if not op:
                        return
                    if op == wire.OP_GET:
                        await self._get(stream)
                    elif op == wire.OP_PUT:
                        await self._put(stream, remote)
                    elif op == wire.OP_HAS:
                        await self._has(stream)
                    else:
                        raise PeerError(f"unknown peer request {op!r}")
        except (PeerError, trio.TooSlowError, trio.BrokenResourceError, OSError) as exc:
            log.info("peer connection from %s ended: %s", remote, exc or type(exc).__name__)
        except trio.ClosedResourceError:
            pass

    async def _get(self, stream: trio.abc.Stream) -> None:
        with trio.fail_after(self.timeout):
            hash = await wire.receive_exactly(stream, wire.HASH)
        (opened,) = self.cache.open_cached([hash], [None])
        if opened is not None and opened[1] > self.max_bytes:
            os.close(opened[0])
            opened = None
        if opened is None:
            self.counters.served_misses += 1
            with trio.fail_after(self.timeout):
                await stream.send_all(wire.NO)
            return
        fd, size = opened
        try:
            with trio.fail_after(deadline(self.timeout, size)):
                await stream.send_all(wire.OK + wire.SIZE.pack(size))
                await send_file(stream, fd, size)
        finally:
            os.close(fd)
        self.counters.served_hits += 1
        self.counters.served_bytes += size

    async def _has(self, stream: trio.abc.Stream) -> None:
        """Which of the asked hashes this node stores (claims prefer peers' hits to misses)."""
        with trio.fail_after(self.timeout):
            (count,) = wire.COUNT.unpack(await wire.receive_exactly(stream, wire.COUNT.size))
            if count > wire.MAX_HAS:
                raise PeerError(f"a peer asked about {count} hashes, over {wire.MAX_HAS}")
            hashes = await wire.receive_exactly(stream, wire.HASH * count)
            await stream.send_all(wire.OK + pack_bits(
                self.cache.contains(hashes[i:i + wire.HASH])
                for i in range(0, len(hashes), wire.HASH)))

    async def _put(self, stream: trio.abc.Stream, remote: str) -> None:
        with trio.fail_after(self.timeout):
            hash = await wire.receive_exactly(stream, wire.HASH)
            (size,) = wire.SIZE.unpack(await wire.receive_exactly(stream, wire.SIZE.size))
        if size > self.max_bytes:
            raise PeerError(f"a peer pushed {size} bytes, over the limit of {self.max_bytes}")
        peer = remote.rpartition(":")[0]  # its host (the port is an ephemeral one)
        with trio.fail_after(deadline(self.timeout, size)):
            try:
                content = await receive_content(stream, hash, size, self.spool, peer)
            except PeerCorrupt:
                self.counters.peer_corrupt[peer] += 1
                self.counters.pushes_refused += 1
                log.warning("peer %s pushed bytes that do not match %s; dropped", peer, hash.hex())
                await stream.send_all(wire.NO)
                return
            location = Location(PEER_URL + peer, hash.hex(), 0, size)
            try:
                await self.cache.ensure_supplied(hash, size, location, content)
            except QuiverError as exc:
                self.counters.pushes_refused += 1
                log.info("not storing %s pushed by %s: %s", hash.hex(), peer, exc)
                await stream.send_all(wire.NO)
                return
            self.counters.pushes_received += 1
            await stream.send_all(wire.OK)


class PeerClient:
    """Asks peers for content and pushes content to them (see the module docstring)."""

    def __init__(self, secret: bytes, counters: ClusterCounters, *, max_bytes: int,
                 timeout: float, spool: str | os.PathLike[str],
                 tls: ssl.SSLContext | None = None) -> None:
        self.secret = secret
        self.spool = spool
        self.counters = counters
        self.max_bytes = max_bytes
        self.timeout = timeout
        self.tls = tls
        self._idle: dict[str, list[trio.abc.Stream]] = {}

    async def get(self, address: str, hash: bytes, size: int) -> PeerContent | None:
        """The content of ``hash`` from the peer at ``address`` (checked: ``size`` bytes whose
        blake3 is ``hash``), or None when it does not hold it. :class:`PeerCorrupt` when it
        sent anything else, :class:`PeerError` when it failed. The caller closes it."""

        async def ask(stream: trio.abc.Stream) -> PeerContent | None:
            await stream.send_all(wire.OP_GET + hash)
            if await wire.receive_exactly(stream, 1) != wire.OK:
                return None
            (length,) = wire.SIZE.unpack(await wire.receive_exactly(stream, wire.SIZE.size))
            if length != size:
                raise PeerCorrupt(f"peer {address} offers {length} bytes for {hash.hex()}, "
                                  f"not {size}")
            return await receive_content(stream, hash, length, self.spool, address)

        return await self._call(address, ask, size)

    async def put(self, address: str, hash: bytes, fd: int, size: int) -> bool:
        """Push ``size`` bytes of ``fd`` (the content of ``hash``) to the peer at ``address``;
        True when it stored it (or had it). :class:`PeerError` when it failed."""

        async def push(stream: trio.abc.Stream) -> bool:
            await stream.send_all(wire.OP_PUT + hash + wire.SIZE.pack(size))
            await send_file(stream, fd, size)
            return await wire.receive_exactly(stream, 1) == wire.OK

        return await self._call(address, push, size)

    async def has(self, address: str, hashes: list[bytes]) -> list[bool]:
        """Which of ``hashes`` (at most :data:`wire.MAX_HAS`) the peer at ``address``
        stores now. :class:`PeerError` when it failed."""

        async def ask(stream: trio.abc.Stream) -> list[bool]:
            await stream.send_all(wire.OP_HAS + wire.COUNT.pack(len(hashes)) + b"".join(hashes))
            if await wire.receive_exactly(stream, 1) != wire.OK:
                raise PeerError(f"peer {address} refused a HAS request")
            return unpack_bits(await wire.receive_exactly(stream, (len(hashes) + 7) // 8),
                               len(hashes))

        return await self._call(address, ask, wire.HASH * len(hashes))

    async def _call(self, address: str, request: Callable[[trio.abc.Stream], Awaitable[T]],
                    size: int) -> T:
        """``request`` (moving ``size`` bytes of content) on a connection to ``address`` (an
        idle one, else a new one), within the deadline; an idle connection the peer has
        closed meanwhile is replaced once."""
        idle = self._idle.setdefault(address, [])
        for pooled in (True, False):
            if pooled and not idle:
                continue
            stream = None
            try:
                with trio.fail_after(deadline(self.timeout, size)):
                    stream = idle.pop() if pooled else await self._connect(address)
                    result = await request(stream)
            except PeerCorrupt:
                if stream is not None:
                    await trio.aclose_forcefully(stream)
                raise
            except (PeerError, OSError, trio.TooSlowError, trio.BrokenResourceError) as exc:
                if stream is not None:
                    await trio.aclose_forcefully(stream)
                if pooled and not isinstance(exc, trio.TooSlowError):
                    continue  # the peer closed an idle connection: try a fresh one
                if isinstance(exc, PeerError):
                    raise
                raise PeerError(f"peer {address}: {exc or type(exc).__name__}") from exc
            idle.append(stream)
            return result
        raise AssertionError("unreachable")

    async def _connect(self, address: str) -> trio.abc.Stream:
        host, port = split_address(address, "peer address")
        stream: trio.abc.Stream = await trio.open_tcp_stream(host, port)
        try:
            if self.tls is not None:  # the certificate must name the advertised host
                stream = trio.SSLStream(stream, self.tls, server_hostname=host)
                await stream.do_handshake()
            await wire.client_handshake(stream, self.secret)
        except BaseException:
            await trio.aclose_forcefully(stream)
            raise
        return stream

    async def aclose(self) -> None:
        """Close every idle connection."""
        pools, self._idle = self._idle, {}
        for streams in pools.values():
            for stream in streams:
                with contextlib.suppress(Exception):
                    await trio.aclose_forcefully(stream)


def _remote(stream: trio.SocketStream) -> str:
    with contextlib.suppress(OSError):
        host, port = stream.socket.getpeername()[:2]
        return f"{host}:{port}"
    return "?"
