"""Three mountds on one machine forming a cluster through a real redis-server.

Each node is a whole mountd (:func:`mountd.daemon.serve`: its cache directory, its socket,
its peer port on loopback) in this process; reads go through each node's cache as the
socket's ``ensure`` does. Counted: remote GETs of every node (the bucket is a ``file://``
directory), peer hits, bytes right everywhere.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

import redis
import trio

from mountd.cluster import wire
from mountd.cluster.config import ClusterConfig
from mountd.daemon import DaemonConfig, Running, serve
from mountd.errors import PeerError
from mountd.store.cache import CacheConfig
from quiverfs.base.backends.base import Location
from quiverfs.testing.emulators import free_port
from quiverfs.testing.mountd import SampleFile, make_dataset
from quiverfs.testing.redis import RedisServer
from tests.cluster.conftest import SECRET, until
from tests.cluster.test_peer import _impostor

SEEN = 30.0


def _config(root: Path, i: int, url: str, **cluster: Any) -> DaemonConfig:
    options = {"name": "t", "heartbeat": 0.1, "node_ttl": 1.0, "peer_timeout": 5.0, **cluster}
    return DaemonConfig(
        cache=CacheConfig(cache_dir=root / f"n{i}", cache_size=64 << 20),
        cluster=ClusterConfig(redis_url=url, advertise=f"127.0.0.1:{free_port()}",
                              secret=SECRET, **options))


@asynccontextmanager
async def _nodes(root: Path, url: str, n: int = 3, others: int = 0,
                 **cluster: Any) -> AsyncIterator[list[Running]]:
    """``n`` nodes, ready once each sees the ``n`` (and ``others`` members already there)."""
    async with trio.open_nursery() as nursery:
        running = [await nursery.start(partial(serve, _config(root, i, url, **cluster),
                                               handle_signals=False))
                   for i in range(n)]
        await until(lambda: all(len(_cluster(r).members) == n + others for r in running), timeout=SEEN)
        yield running
        nursery.cancel_scope.cancel()


def _cluster(node: Running):
    assert node.server.cluster is not None
    return node.server.cluster.membership



def _gets(nodes: list[Running]) -> int:
    return sum(n.server.cache.counters.snapshot()["total"]["remote_requests"]["GET"]
               for n in nodes)


async def _read_all(nodes: list[Running], url: str, files: list[SampleFile]) -> None:
    """Every node reads every file, all at once, each in its own random order; checks bytes."""

    async def read(node: Running, order: list[SampleFile]) -> None:
        for f in order:
            path = await node.server.cache.ensure(f.hash, f.size, Location(url, f.key, 0, f.size))
            assert Path(path).read_bytes() == f.data

    async with trio.open_nursery() as nursery:
        for node in nodes:
            for lane in range(4):  # a few readers per node, as a DataLoader's workers
                order = files[lane::4]
                random.shuffle(order)
                nursery.start_soon(read, node, order)


async def test_three_nodes_read_identical_bytes_with_one_bucket_fetch_per_file(
        tmp_path: Path, redis_server: RedisServer) -> None:
    url, files = make_dataset(tmp_path / "bucket", 60, size=20_000)
    async with _nodes(tmp_path, redis_server.url) as nodes:
        await _read_all(nodes, url, files)
        assert _gets(nodes) == len(files)
        snaps = [n.server.cluster.snapshot() for n in nodes]
        assert all(s["connected"] and len(s["members"]) == 3 for s in snaps)
        assert sum(s["peer_hits"] for s in snaps) >= len(files)
        assert sum(s["peer_bytes"] for s in snaps) == 20_000 * sum(s["peer_hits"] for s in snaps)
        assert all(not s["peer_errors"] and not s["peer_corrupt"] for s in snaps)
        # The stats answer carries the cluster's part.
        assert nodes[0].server.stats_snapshot()["cluster"]["node"] == snaps[0]["node"]
        # Again: every node has every file now; nothing more from the bucket.
        await _read_all(nodes, url, files)
        assert _gets(nodes) == len(files)


async def test_a_peer_serving_wrong_bytes_is_detected_and_skipped(
        tmp_path: Path, redis_server: RedisServer) -> None:
    url, files = make_dataset(tmp_path / "bucket", 30, size=5_000)
    async with trio.open_nursery() as outer:
        port = await outer.start(_impostor, SECRET, b"\0" * 5_000)
        impostor = f"127.0.0.1:{port}"
        # It joins the cluster as any node would (its heartbeat key, kept alive meanwhile).
        r = redis.Redis.from_url(redis_server.url)
        r.set(f"quiverfs:t:node:{impostor}", impostor, px=600_000)
        async with _nodes(tmp_path, redis_server.url, n=2, others=1) as nodes:
            await _read_all(nodes, url, files)
            snaps = [n.server.cluster.snapshot() for n in nodes]
            assert sum(s["peer_corrupt"].get(impostor, 0) for s in snaps) >= 1
            assert all(n.server.cache.counters.snapshot()["total"]["verify_failures"] == 0
                       for n in nodes)
        r.close()
        outer.cancel_scope.cancel()


async def test_reads_go_on_while_redis_is_down_and_the_cluster_recovers(
        tmp_path: Path, redis_server: RedisServer) -> None:
    url, files = make_dataset(tmp_path / "bucket", 40, size=4_000)
    first, second = files[:20], files[20:]
    async with _nodes(tmp_path, redis_server.url) as nodes:
        redis_server.kill()
        await until(lambda: not any(_cluster(n).connected for n in nodes), timeout=SEEN)
        await _read_all(nodes, url, first)  # alone: each node from the bucket, bytes right
        assert all(n.server.stats_snapshot()["cluster"]["connected"] is False for n in nodes)
        redis_server.start()
        await until(lambda: all(_cluster(n).connected and len(_cluster(n).members) == 3
                                 for n in nodes), timeout=SEEN)
        before = _gets(nodes)
        await _read_all(nodes, url, second)
        assert _gets(nodes) - before == len(second)


async def test_a_stopped_node_costs_no_reader_an_error(
        tmp_path: Path, redis_server: RedisServer) -> None:
    url, files = make_dataset(tmp_path / "bucket", 40, size=4_000)
    async with trio.open_nursery() as nursery:
        scopes = [trio.CancelScope() for _ in range(3)]
        running: list[Running] = []

        async def node(i: int, task_status: trio.TaskStatus[Running]) -> None:
            with scopes[i]:
                await serve(_config(tmp_path, i, redis_server.url), handle_signals=False,
                            task_status=task_status)

        for i in range(3):
            running.append(await nursery.start(node, i))
        await until(lambda: all(len(_cluster(r).members) == 3 for r in running), timeout=SEEN)
        await _read_all(running, url, files[:20])
        scopes[2].cancel()  # one node goes (its share of the hashes moves)
        live = running[:2]
        await _read_all(live, url, files)  # every byte right on the others
        await until(lambda: all(len(_cluster(r).members) == 2 for r in live), timeout=SEEN)
        nursery.cancel_scope.cancel()


async def test_a_lock_held_by_a_node_that_is_gone_blocks_nobody(
        tmp_path: Path, redis_server: RedisServer) -> None:
    url, files = make_dataset(tmp_path / "bucket", 5, size=2_000)
    r = redis.Redis.from_url(redis_server.url)
    for f in files:  # locks of a fetcher that died (no heartbeat), alive for ten minutes
        r.set(f"quiverfs:t:fill:{f.hash.hex()}", "127.0.0.1:9", px=600_000)
    async with _nodes(tmp_path, redis_server.url, n=2) as nodes:
        # A hang guard, not a timing check: waiting for the locks' expiry would take 10 min.
        with trio.fail_after(120):
            await _read_all(nodes, url, files)
        snaps = [n.server.cluster.snapshot() for n in nodes]
        assert sum(s["lock_waits"] for s in snaps) >= len(files)
        # Exactly one waiter took each dead lock over (compare-and-set) and fetched it; the
        # other node waited for that one: one bucket GET per file across the cluster.
        assert sum(s["take_overs"] for s in snaps) == len(files)
        assert _gets(nodes) == len(files)
    r.close()


async def _hanging(*, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
    """A member that knows the secret, takes a request, and never answers. A node that
    gives up on it may reset the connection at any point, the handshake included: that is
    the node's timeout doing its job, not the member failing (it once failed this test
    with ``Connection reset by peer`` in the handshake's read; a clean close there is a
    ``PeerError``)."""

    async def handle(stream: trio.SocketStream) -> None:
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError, PeerError):
            async with stream:
                if await wire.server_handshake(stream, SECRET):
                    await trio.sleep_forever()

    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    async with trio.open_nursery() as nursery:
        await nursery.start(trio.serve_listeners, handle, listeners)
        task_status.started(listeners[0].socket.getsockname()[1])


async def test_a_peer_that_hangs_costs_a_retry_not_an_error(
        tmp_path: Path, redis_server: RedisServer) -> None:
    url, files = make_dataset(tmp_path / "bucket", 20, size=3_000)
    async with trio.open_nursery() as outer:
        hung = f"127.0.0.1:{await outer.start(_hanging)}"
        r = redis.Redis.from_url(redis_server.url)
        r.set(f"quiverfs:t:node:{hung}", hung, px=600_000)
        async with _nodes(tmp_path, redis_server.url, n=2, others=1, peer_timeout=0.5) as nodes:
            await _read_all(nodes, url, files)
            snaps = [n.server.cluster.snapshot() for n in nodes]
            assert sum(s["peer_errors"].get(hung, 0) for s in snaps) >= 1
        r.close()
        outer.cancel_scope.cancel()
