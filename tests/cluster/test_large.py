"""Files larger than a transfer holds in memory move between nodes too (streamed through a
spool file), still one bucket fetch in the whole cluster."""

from __future__ import annotations

from pathlib import Path

from mountd.cluster import peer
from quiverfs.base.backends.base import Location
from quiverfs.testing.mountd import make_dataset
from quiverfs.testing.redis import RedisServer
from tests.cluster.test_nodes import _gets, _nodes


async def test_a_large_file_is_fetched_once_and_served_by_the_peer(
        tmp_path: Path, redis_server: RedisServer) -> None:
    size = peer.MEMORY_BYTES + 5 * peer.STEP + 777
    url, (big,) = make_dataset(tmp_path / "bucket", 1, size=size)
    location = Location(url, big.key, 0, size)
    async with _nodes(tmp_path, redis_server.url, n=2) as (a, b):
        assert Path(await a.server.cache.ensure(big.hash, size, location)).read_bytes() == big.data
        assert Path(await b.server.cache.ensure(big.hash, size, location)).read_bytes() == big.data
        # One fetch in the cluster (a fill this large is several ranged GETs, all A's).
        assert _gets([b]) == 0 and _gets([a]) >= 1
        moved = [n.server.cluster.counters for n in (a, b)]
        assert sum(c.bucket_turns for c in moved) == 1
        # B had it from A (a GET), or A had pushed it to B, its owner, first.
        assert sum(c.peer_bytes for c in moved) + sum(c.pushes for c in moved) * size >= size
        assert sum(c.peer_corrupt.total() for c in moved) == 0
        for node in (a, b):  # nothing left in the spool: the files were unlinked from the start
            assert list((node.server.cache.config.cache_dir / "tmp").iterdir()) == []
