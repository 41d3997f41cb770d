"""The peer protocol against real stores: the secret is required, content is verified."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

import blake3
import pytest
import trio

from mountd.cluster import peer, wire
from mountd.cluster.counters import ClusterCounters
from mountd.cluster.peer import PeerClient, PeerServer
from mountd.errors import PeerCorrupt, PeerError
from mountd.store.cache import Cache, CacheConfig
from mountd.store.peers import PeerFile
from mountd.store.supplied import pread_all
from tests.cluster.conftest import SECRET
from tests.mountd.conftest import Source

LIMITS = {"max_bytes": 16 << 20, "timeout": 5.0}
#: Where clients spool content above MEMORY_BYTES (none of these tests sends that much).
SPOOL = tempfile.gettempdir()


async def _open_cache(path: Path, nursery: trio.Nursery) -> Cache:
    cache = Cache(CacheConfig(cache_dir=path, cache_size=64 << 20))
    await cache.open()
    await nursery.start(cache.run)
    return cache


async def test_get_serves_cached_content_and_misses_the_rest(tmp_path: Path) -> None:
    source = Source(tmp_path / "remote")
    small, large = source.add("small", os.urandom(1000)), source.add("large", os.urandom(3 << 20))
    absent = source.add("absent", os.urandom(10))
    counters = ClusterCounters()
    async with trio.open_nursery() as nursery:
        cache = await _open_cache(tmp_path / "a", nursery)
        for obj in (small, large):
            await cache.ensure(obj.hash, obj.size, obj.location)
        server = PeerServer(cache, SECRET, counters, **LIMITS)
        port = await nursery.start(server.serve, "127.0.0.1", 0)
        client = PeerClient(SECRET, ClusterCounters(), **LIMITS, spool=SPOOL)
        address = f"127.0.0.1:{port}"
        assert (await client.get(address, small.hash, small.size)).inline == small.data
        assert (await client.get(address, large.hash, large.size)).inline == large.data  # in memory
        assert await client.get(address, absent.hash, absent.size) is None
        # One connection carried all three (kept idle between requests).
        assert len(client._idle[address]) == 1
        assert (counters.served_hits, counters.served_misses) == (2, 1)
        assert counters.served_bytes == small.size + large.size
        await client.aclose()
        await cache.aclose()
        nursery.cancel_scope.cancel()


async def test_a_wrong_secret_is_refused_both_ways(tmp_path: Path) -> None:
    source = Source(tmp_path / "remote")
    obj = source.add("f", b"secret content")
    counters = ClusterCounters()
    async with trio.open_nursery() as nursery:
        cache = await _open_cache(tmp_path / "a", nursery)
        await cache.ensure(obj.hash, obj.size, obj.location)
        port = await nursery.start(PeerServer(cache, SECRET, counters, **LIMITS).serve,
                                   "127.0.0.1", 0)
        stranger = PeerClient(b"another-secret-of-enough-length!", ClusterCounters(), **LIMITS, spool=SPOOL)
        with pytest.raises(PeerError, match="refused the cluster secret"):
            await stranger.get(f"127.0.0.1:{port}", obj.hash, obj.size)
        assert counters.auth_failures == 1 and counters.served_hits == 0
        await cache.aclose()
        nursery.cancel_scope.cancel()


async def _impostor(secret: bytes, answer: bytes, *,
                    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
    """A peer that knows the secret (or pretends to) and answers every GET with ``answer``."""

    async def handle(stream: trio.SocketStream) -> None:
        async with stream:
            if not await wire.server_handshake(stream, secret):
                return
            while op := await stream.receive_some(1):
                await wire.receive_exactly(stream, wire.HASH)
                if op == wire.OP_PUT:  # takes pushes, stores nothing
                    (size,) = wire.SIZE.unpack(await wire.receive_exactly(stream, 8))
                    await wire.receive_exactly(stream, size)
                    await stream.send_all(wire.OK)
                    continue
                await stream.send_all(wire.OK + wire.SIZE.pack(len(answer)) + answer)

    async def guarded(stream: trio.SocketStream) -> None:
        with contextlib.suppress(trio.BrokenResourceError, PeerError):
            await handle(stream)

    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    async with trio.open_nursery() as nursery:
        await nursery.start(trio.serve_listeners, guarded, listeners)
        task_status.started(listeners[0].socket.getsockname()[1])


async def test_wrong_bytes_from_a_peer_are_detected() -> None:
    good = os.urandom(500)
    h = blake3.blake3(good).digest()
    wrong = bytearray(good)
    wrong[7] ^= 1
    client = PeerClient(SECRET, ClusterCounters(), **LIMITS, spool=SPOOL)
    async with trio.open_nursery() as nursery:
        port = await nursery.start(_impostor, SECRET, bytes(wrong))
        with pytest.raises(PeerCorrupt, match="do not match"):
            await client.get(f"127.0.0.1:{port}", h, len(good))
        with pytest.raises(PeerCorrupt, match="offers 500 bytes"):
            await client.get(f"127.0.0.1:{port}", h, 499)
        await client.aclose()
        nursery.cancel_scope.cancel()


async def test_a_server_that_does_not_know_the_secret_is_not_believed() -> None:
    client = PeerClient(SECRET, ClusterCounters(), **LIMITS, spool=SPOOL)

    async def fake_handshake(stream: trio.SocketStream) -> None:
        async with stream:
            await stream.send_all(wire.MAGIC + os.urandom(wire.NONCE))
            await wire.receive_exactly(stream, wire.NONCE + wire.MAC)
            await stream.send_all(wire.OK + os.urandom(wire.MAC))  # accepts anyone

    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    async with trio.open_nursery() as nursery:
        await nursery.start(trio.serve_listeners, fake_handshake, listeners)
        port = listeners[0].socket.getsockname()[1]
        with pytest.raises(PeerError, match="does not know the cluster secret"):
            await client.get(f"127.0.0.1:{port}", b"\0" * 32, 1)
        nursery.cancel_scope.cancel()


async def test_a_push_is_verified_before_it_is_stored(tmp_path: Path) -> None:
    counters = ClusterCounters()
    data = os.urandom(2000)
    h = blake3.blake3(data).digest()
    async with trio.open_nursery() as nursery:
        cache = await _open_cache(tmp_path / "a", nursery)
        port = await nursery.start(PeerServer(cache, SECRET, counters, **LIMITS).serve,
                                   "127.0.0.1", 0)
        client = PeerClient(SECRET, ClusterCounters(), **LIMITS, spool=SPOOL)
        address = f"127.0.0.1:{port}"
        bad = _file_of(tmp_path / "bad", data[:-1] + bytes([data[-1] ^ 1]))
        good = _file_of(tmp_path / "good", data)
        assert await client.put(address, h, bad, len(data)) is False
        assert not cache.contains(h) and counters.pushes_refused == 1
        assert await client.put(address, h, good, len(data)) is True
        os.close(bad)
        os.close(good)
        assert cache.contains(h)
        assert Path(cache.store_path(h)).read_bytes() == data
        assert counters.pushes_received == 1
        # The store's counters: no remote request for a pushed file.
        assert cache.counters.snapshot()["total"]["remote_requests"]["GET"] == 0
        await client.aclose()
        await cache.aclose()
        nursery.cancel_scope.cancel()


def _file_of(path: Path, data: bytes) -> int:
    """A read-only descriptor of a new file holding ``data``."""
    path.write_bytes(data)
    return os.open(path, os.O_RDONLY)


async def test_large_files_stream_through_a_spool_file_both_ways(tmp_path: Path) -> None:
    """Above MEMORY_BYTES, a GET's content arrives in an unlinked spool file, hashed as it
    comes; a push streams from the store file; a lie is caught at the end all the same."""
    source = Source(tmp_path / "remote")
    big = source.add("big", os.urandom(peer.MEMORY_BYTES + 3 * peer.STEP + 12345))
    counters, spool = ClusterCounters(), tmp_path / "spool"
    spool.mkdir()
    async with trio.open_nursery() as nursery:
        a = await _open_cache(tmp_path / "a", nursery)
        b = await _open_cache(tmp_path / "b", nursery)
        await a.ensure(big.hash, big.size, big.location)
        server_a = PeerServer(a, SECRET, counters, **LIMITS)
        port_a = await nursery.start(server_a.serve, "127.0.0.1", 0)
        port_b = await nursery.start(PeerServer(b, SECRET, ClusterCounters(), **LIMITS).serve,
                                     "127.0.0.1", 0)
        client = PeerClient(SECRET, ClusterCounters(), **LIMITS, spool=spool)
        content = await client.get(f"127.0.0.1:{port_a}", big.hash, big.size)
        assert isinstance(content, PeerFile) and content.size == big.size
        assert os.listdir(spool) == []  # unlinked from the start: nothing to clean up
        assert pread_all(content.fd, 0, big.size) == big.data
        content.close()
        assert counters.served_bytes == big.size
        fd = os.open(a.store_path(big.hash), os.O_RDONLY)
        try:
            assert await client.put(f"127.0.0.1:{port_b}", big.hash, fd, big.size) is True
        finally:
            os.close(fd)
        assert Path(b.store_path(big.hash)).read_bytes() == big.data
        # An impostor sending a large lie: found out once the whole file has arrived.
        wrong = bytearray(big.data)
        wrong[-1] ^= 1
        liar = await nursery.start(_impostor, SECRET, bytes(wrong))
        with pytest.raises(PeerCorrupt, match="do not match"):
            await client.get(f"127.0.0.1:{liar}", big.hash, big.size)
        assert os.listdir(spool) == []
        await client.aclose()
        for cache in (a, b):
            await cache.aclose()
        nursery.cancel_scope.cancel()
