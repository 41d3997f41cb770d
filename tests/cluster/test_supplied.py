"""Misses of clients that supply their own bytes (other users' mounts) use the cluster too:
a peer's copy is served as a hit by hash, and bytes a client supplied reach the owner."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from mountd.cluster.placement import owners
from mountd.daemon import Running
from mountd.store.supplied import SuppliedBytes
from quiverfs.base.backends.base import Location
from quiverfs.testing.mountd import SampleFile, make_dataset
from quiverfs.testing.redis import RedisServer
from tests.cluster.conftest import until
from tests.cluster.test_nodes import _gets, _nodes

UID = 4242  # a user other than mountd's: charged for what its leases bring in


def _owned_by(node: Running, files: Sequence[SampleFile]) -> list[SampleFile]:
    cluster = node.server.cluster
    assert cluster is not None
    return [f for f in files if owners(f.hash, cluster.membership.members)[0] == cluster.node]



async def test_leases_are_served_from_peers_and_supplied_bytes_are_shared(
        tmp_path: Path, redis_server: RedisServer) -> None:
    url, files = make_dataset(tmp_path / "bucket", 16, size=8000)
    async with _nodes(tmp_path, redis_server.url, n=2) as (a, b):
        ca, cb = a.server.cache, b.server.cache
        ka, kb = a.server.cluster.counters, b.server.cluster.counters
        # A reads with its own authority: one bucket GET per file; B's share is pushed to B.
        for f in files:
            await ca.ensure(f.hash, f.size, Location(url, f.key, 0, f.size))
        b_owns = _owned_by(b, files)
        assert 0 < len(b_owns) < len(files)  # (placement of 16 random hashes over 2 nodes)
        await until(lambda: ka.pushes == len(b_owns))
        # A user on B, who would supply its own bytes: every lease is answered with a path,
        # B's own share from its store, the rest fetched from A now; nothing asked of it.
        for f in files:
            path = await cb.lease(f.hash, f.size, "ds", holder=object(), uid=UID)
            assert path is not None and Path(path).read_bytes() == f.data
        assert _gets([a, b]) == len(files)
        assert (kb.pushes_received, kb.peer_hits) == (len(b_owns), len(files) - len(b_owns))
        charged = cb.charges.snapshot()[UID]
        assert charged["cached_bytes"] == sum(f.size for f in files if f not in b_owns)

        # New content only a user on B can read: B's lease says "supply", the user supplies,
        # the bytes reach their owner, and a user on A gets them without supplying anything.
        private = tmp_path / "private"
        more_url, more = make_dataset(private, 6, size=5000, seed=7)
        for f in more:
            holder = object()
            assert await cb.lease(f.hash, f.size, "p", holder=holder, uid=UID) is None
            fd = os.open(private / f.key, os.O_RDONLY)
            try:
                await cb.ensure_supplied(f.hash, f.size, Location(more_url, f.key, 0, f.size),
                                         SuppliedBytes(os.dup(fd), 0, holder=holder), "p",
                                         uid=UID)
            finally:
                os.close(fd)
        a_owns = _owned_by(a, more)
        await until(lambda: kb.pushes == len(a_owns))
        hits_before = ka.peer_hits
        for f in more:
            path = await ca.lease(f.hash, f.size, "p", holder=object(), uid=UID + 1)
            assert path is not None and Path(path).read_bytes() == f.data
        assert ka.peer_hits - hits_before == len(more) - len(a_owns)
        assert _gets([a, b]) == len(files)  # mountd never read the private bucket
