"""What a node keeps: under eviction pressure a node evicts the files other nodes own first.

Three whole mountds (:func:`mountd.daemon.serve`) through a real redis-server, as in
test_nodes.py; node 0's cache holds 20 files. It reads 10 files it owns, then 30 it does
not: plain LRU would have evicted its own 10 first; with the cluster it keeps them, and the
others' files went (they are on their owners, pushed there by node 0's fetches).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path

import trio

from mountd.cluster.config import ClusterConfig
from mountd.cluster.placement import owner
from mountd.daemon import DaemonConfig, Running, serve
from mountd.store.cache import CacheConfig
from mountd.store.policy import keep_last
from quiverfs.base.backends.base import Location
from quiverfs.testing.emulators import free_port
from quiverfs.testing.mountd import make_dataset
from quiverfs.testing.redis import RedisServer
from tests.cluster.conftest import SECRET, until
from tests.cluster.test_nodes import SEEN, _cluster, _gets

SIZE = 10_000


def _configs(root: Path, url: str, small: int) -> list[DaemonConfig]:
    """Three nodes; node 0's cache holds ``small`` bytes, the others' 64 MiB."""
    return [
        DaemonConfig(
            cache=CacheConfig(cache_dir=root / f"n{i}", cache_size=small if i == 0 else 64 << 20),
            cluster=ClusterConfig(
                redis_url=url,
                advertise=f"127.0.0.1:{free_port()}",
                secret=SECRET,
                name="keep",
                heartbeat=0.1,
                node_ttl=1.0,
                peer_timeout=5.0,
            ),
        )
        for i in range(3)
    ]


@asynccontextmanager
async def _started(configs: list[DaemonConfig]) -> AsyncIterator[list[Running]]:
    async with trio.open_nursery() as nursery:
        nodes = [await nursery.start(partial(serve, c, handle_signals=False)) for c in configs]
        await until(lambda: all(len(_cluster(n).members) == len(nodes) for n in nodes), timeout=SEEN)
        yield nodes
        nursery.cancel_scope.cancel()


def test_keep_last_puts_kept_entries_after_the_others_in_order() -> None:
    victims = [(bytes([i]), i) for i in range(10)]
    kept = {bytes([i]) for i in (0, 3, 4, 8)}
    order = list(keep_last(iter(victims), kept.__contains__))
    assert [h[0] for h, _, _ in order] == [1, 2, 5, 6, 7, 9, 0, 3, 4, 8]
    assert [k for _, _, k in order] == [False] * 6 + [True] * 4
    # Past the look-ahead, the oldest kept entry comes out in its turn.
    bounded = list(keep_last(iter(victims), kept.__contains__, lookahead=2))
    assert [h[0] for h, _, _ in bounded] == [1, 2, 0, 5, 6, 7, 3, 9, 4, 8]


async def test_a_node_evicts_files_others_own_before_its_own(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    configs = _configs(tmp_path, redis_server.url, small=20 * SIZE)
    ids = [c.cluster.advertise for c in configs]
    url, files = make_dataset(tmp_path / "bucket", 150, size=SIZE)
    mine = [f for f in files if owner(f.hash, ids) == ids[0]][:10]
    theirs = [f for f in files if owner(f.hash, ids) != ids[0]][:30]
    assert len(mine) == 10 and len(theirs) == 30
    async with _started(configs) as nodes:
        cache = nodes[0].server.cache
        for f in mine + theirs:  # its own first: the least recently used at the end
            path = await cache.ensure(f.hash, f.size, Location(url, f.key, 0, f.size))
            assert Path(path).read_bytes() == f.data
        assert cache.used <= 20 * SIZE
        assert [f.key for f in mine if cache.contains(f.hash)] == [f.key for f in mine]
        held = [f for f in theirs if cache.contains(f.hash)]
        assert len(held) == 10 and cache.entries == 20
        assert held == theirs[-10:]  # among the others' files, LRU order as before
        snap = cache.counters.snapshot()["total"]
        assert snap["evicted_files"] == 20
        # The others' files are on their owners (pushed there in the background after each
        # fetch), all of them, byte-identical.
        await until(
            lambda: sum(n.server.cluster.counters.pushes_received for n in nodes[1:]) == 30,
            timeout=SEEN)
        for f in theirs:
            holder = nodes[ids.index(owner(f.hash, ids))].server.cache
            assert Path(holder.store_path(f.hash)).read_bytes() == f.data
        assert _gets(nodes) == 40
        # Node 0 reads the others' files again: from their owners, never the bucket; its
        # own files still stay.
        for f in theirs[:10]:
            path = await cache.ensure(f.hash, f.size, Location(url, f.key, 0, f.size))
            assert Path(path).read_bytes() == f.data
        assert _gets(nodes) == 40
        assert all(cache.contains(f.hash) for f in mine)
