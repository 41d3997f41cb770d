"""Chunk fills of packed objects in a cluster: the node whose turn it is fetches a span with
one GET and shares every member it brought; another node's misses of the same members are
peer hits, not GETs."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from mountd.daemon import Running
from mountd.store.span import Member
from quiverfs.base.backends.base import Location
from quiverfs.testing.packed import PackedFile, pack
from quiverfs.testing.redis import RedisServer
from tests.cluster.test_nodes import _gets, _nodes

SIZE = 4000
PER_CHUNK = 8


def _lookup(url: str, placed: Sequence[PackedFile]):
    """What mountd's session layer names to the cache for a packed dataset: every member of
    a file's object, in offset order."""
    by_key: dict[str, list[Member]] = {}
    for p in placed:
        by_key.setdefault(p.key, []).append(
            Member(p.hash, len(p.data), Location(url, p.key, p.offset, len(p.data))))

    def members(dataset: str | None, hash: bytes, location: Location) -> list[Member] | None:
        return by_key.get(location.key)

    return members


async def _read(node: Running, url: str, placed: Sequence[PackedFile]) -> None:
    for p in placed:
        location = Location(url, p.key, p.offset, len(p.data))
        path = await node.server.cache.ensure(p.hash, len(p.data), location, "packed")
        assert Path(path).read_bytes() == p.data


async def test_a_span_is_fetched_once_and_its_members_served_to_the_other_node(
        tmp_path: Path, redis_server: RedisServer) -> None:
    files = [(f"f{i:03d}", os.urandom(SIZE)) for i in range(4 * PER_CHUNK)]
    objects, placed = pack(files, PER_CHUNK)
    bucket = tmp_path / "bucket"
    for key, data in objects.items():
        (bucket / key).parent.mkdir(parents=True, exist_ok=True)
        (bucket / key).write_bytes(data)
    url = "file://" + os.fspath(bucket)
    async with _nodes(tmp_path, redis_server.url, n=2) as (a, b):
        for node in (a, b):
            node.server.cache.set_chunk_members(_lookup(url, placed))
        await _read(a, url, placed)
        spans = _gets([a])
        assert spans == len(objects)  # one span GET per object: the chunk fill as alone
        await _read(b, url, placed)
        assert _gets([a, b]) == spans  # B's misses were served by A (or pushed to B)
        kb = b.server.cluster.counters
        assert kb.peer_hits + kb.pushes_received >= len(placed) // 2
        assert b.server.cache.counters.snapshot()["total"]["remote_requests"]["GET"] == 0
