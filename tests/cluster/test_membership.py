"""Membership through a real redis-server: joins, leaves, expiry, Redis lost and back."""

from __future__ import annotations

import trio

from mountd.cluster.coordinator import Coordinator
from mountd.cluster.counters import ClusterCounters
from mountd.cluster.membership import Membership
from quiverfs.testing.redis import RedisServer
from tests.cluster.conftest import until

#: Fast clocks so the tests take a moment: beat every 0.05 s, gone after 0.4 s of silence.
BEAT, TTL = 0.05, 0.4
#: Deadline for a change to be seen (generous: the machine is shared).
SEEN = 20.0


def _node(url: str, name: str, cluster: str = "t") -> Membership:
    return Membership(Coordinator(url, cluster), name, name, ClusterCounters(),
                      heartbeat=BEAT, node_ttl=TTL)



async def test_nodes_see_each_other_join_and_leave(redis_server: RedisServer) -> None:
    a, b = _node(redis_server.url, "a:1"), _node(redis_server.url, "b:1")
    other = _node(redis_server.url, "x:1", cluster="other")  # another cluster, same Redis
    async with trio.open_nursery() as nursery:
        await nursery.start(a.run)
        await nursery.start(other.run)
        assert a.connected and a.members == {"a:1"}
        b_scope = trio.CancelScope()

        async def run_b() -> None:
            with b_scope:
                await b.run()

        nursery.start_soon(run_b)
        await until(lambda: a.members == {"a:1", "b:1"}, "b joins", timeout=SEEN)
        await until(lambda: b.members == {"a:1", "b:1"}, "b sees a", timeout=SEEN)
        assert a.addresses["b:1"] == "b:1"
        b_scope.cancel()  # a clean stop deletes b's key
        await until(lambda: a.members == {"a:1"}, "b leaves", timeout=SEEN)
        assert other.members == {"x:1"}
        nursery.cancel_scope.cancel()


async def test_a_silent_node_expires(redis_server: RedisServer) -> None:
    a, dead = _node(redis_server.url, "a:1"), _node(redis_server.url, "dead:1")
    await dead.beat()  # one heartbeat, then silence (as kill -9)
    async with trio.open_nursery() as nursery:
        await nursery.start(a.run)
        assert a.members == {"a:1", "dead:1"}
        await until(lambda: a.members == {"a:1"}, "dead expires", timeout=SEEN)
        nursery.cancel_scope.cancel()


async def test_redis_killed_and_restarted_alone_then_rejoined(redis_server: RedisServer) -> None:
    a, b = _node(redis_server.url, "a:1"), _node(redis_server.url, "b:1")
    async with trio.open_nursery() as nursery:
        await nursery.start(a.run)
        await nursery.start(b.run)
        await until(lambda: a.members == {"a:1", "b:1"} == b.members, "both in", timeout=SEEN)
        redis_server.kill()
        await until(lambda: not a.connected and not b.connected, "both alone", timeout=SEEN)
        assert a.members == {"a:1"} and b.members == {"b:1"}
        assert a.counters.redis_errors >= 1
        redis_server.start()  # empty: every key is gone
        await until(lambda: a.connected and b.connected, "both back", timeout=SEEN)
        await until(lambda: a.members == {"a:1", "b:1"} == b.members, "membership recovers", timeout=SEEN)
        nursery.cancel_scope.cancel()
