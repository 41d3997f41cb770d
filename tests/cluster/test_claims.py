"""Claims in a cluster: a job's misses prefer the files another node holds (peer hits) over
files no node has (bucket GETs); the peers are asked what they hold in the background."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import trio

from mountd.cluster.placement import owner
from mountd.coop import service as coop_service
from mountd.rpc.async_client import open_client
from quiverfs.base.backends.base import Location
from quiverfs.testing.packed import loose_digest
from quiverfs.testing.redis import RedisServer
from tests.cluster.test_nodes import _gets, _nodes

N = 80


async def test_misses_go_to_what_the_peers_hold_first(
        tmp_path: Path, redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(coop_service, "PEER_ASK_SECONDS", 0.05)
    bucket = tmp_path / "bucket"
    bucket.mkdir()
    files = [(f"f{i:03d}.bin", os.urandom(3000)) for i in range(N)]
    for name, data in files:
        (bucket / name).write_bytes(data)
    url = "file://" + os.fspath(bucket)
    digest = tmp_path / "d.digest"
    dataset = loose_digest(digest, url, files)
    async with _nodes(tmp_path, redis_server.url, n=2) as (a, b), \
            open_client(b.server.cache.config.cache_dir) as client:
        await client.register(dataset, digest=str(digest))
        view = await b.server.coop.ensure_view(dataset)
        view_hashes = view.hashes_of(range(N))
        # Node A reads a third of the files; what B owns is pushed to B, the rest stays
        # on A: those are B's candidates for peer hits.
        for cid in range(0, N, 3):
            h, size, loc = view.item(cid)
            await a.server.cache.ensure(h, size, Location(url, loc.key, 0, size))
        b_node = b.server.cluster.node
        members = b.server.cluster.membership.members
        on_a = {cid for cid in range(0, N, 3) if owner(view_hashes[cid], members) != b_node}
        assert on_a
        pushed = (N + 2) // 3 - len(on_a)  # B's own share of them, pushed by A
        with trio.fail_after(20):
            while b.server.cluster.counters.pushes_received < pushed:
                await trio.sleep(0.02)
        # The widest look-ahead: a claim may pass over 1,000 draws per miss, so that the
        # preference is a certainty here, not a likelihood.
        await client.session_open(dataset, "job", seed=3, lookahead=1000)
        state = b.server.coop.registry.dataset(dataset)
        with trio.fail_after(20):
            while state.peer_held_total < len(on_a):
                await trio.sleep(0.02)
        assert {i for i in range(N) if state.peer_held[i]} == on_a
        gets_before = _gets([b])
        # Hits (B's own share, pushed by A) come first, then the misses.
        claim = await client.claim(dataset, "job", 0, pushed + len(on_a))
        assert len(claim["hits"]) == pushed == state.cached_total
        assert set(claim["fetch"]) == on_a  # every miss is one a peer holds
        for cid in claim["fetch"]:  # read them: peer hits, not bucket GETs
            h, size, loc = view.item(cid)
            path = await b.server.cache.ensure(h, size, Location(url, loc.key, 0, size))
            assert Path(path).read_bytes() == files[cid][1]
        assert _gets([b]) == gets_before
        assert b.server.cluster.counters.peer_hits >= len(on_a)
