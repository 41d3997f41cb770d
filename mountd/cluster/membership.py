"""Who is in the cluster: heartbeat keys with a TTL, read back every heartbeat.

Every ``heartbeat`` seconds a node rewrites its key (alive for ``node_ttl``) and lists the
keys of all nodes. A node that stops (killed, cut off) disappears from everyone's list once
its key expires, within ``node_ttl`` seconds; a clean shutdown deletes the key at once. A
join is seen at the next heartbeat. Polling, not pub/sub: one ``SET`` and one ``SCAN`` +
``MGET`` a second per node is nothing for Redis, and a missed pub/sub message would leave a
view wrong until the next one, where a poll repairs itself.

Redis unreachable: the node keeps serving, alone (the member list shrinks to itself, so
placement sends nothing to peers and every miss goes to the bucket), says so in the log and
in ``quiverfs stats`` (``cluster.connected``), and rejoins at the first heartbeat that
reaches Redis again. Peers' views may differ for a heartbeat or two; that costs at most a
duplicate fetch, never a wrong byte (content is verified by hash wherever it comes from).
"""

from __future__ import annotations

import contextlib
import logging

import trio

from mountd.cluster.coordinator import REDIS_ERRORS, Coordinator, public_url
from mountd.cluster.counters import ClusterCounters

log = logging.getLogger("mountd.cluster.membership")


class Membership:
    """This node's heartbeat and its view of the live members (see the module docstring)."""

    def __init__(self, coordinator: Coordinator, node: str, address: str,
                 counters: ClusterCounters, *, heartbeat: float, node_ttl: float) -> None:
        self.coordinator = coordinator
        self.node = node
        self.address = address
        self.counters = counters
        self.heartbeat = heartbeat
        self.node_ttl = node_ttl
        #: Live node id → advertised address; always holds this node.
        self.addresses: dict[str, str] = {node: address}
        #: Whether the last Redis call succeeded (False: serving alone).
        self.connected = False
        #: Set and replaced whenever the member list changes (tests and waiters).
        self.changed = trio.Event()
        self._said_alone = False

    @property
    def members(self) -> frozenset[str]:
        """Ids of the live members, this node included."""
        return frozenset(self.addresses)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Heartbeat until cancelled (then leave the cluster, if Redis answers)."""
        try:
            await self.beat()
            task_status.started()
            while True:
                await trio.sleep(self.heartbeat)
                await self.beat()
        finally:
            if self.connected:
                with trio.move_on_after(1.0) as scope:
                    scope.shield = True
                    with contextlib.suppress(*REDIS_ERRORS):  # the key expires by itself
                        await self.coordinator.leave(self.node)

    async def beat(self) -> None:
        """One heartbeat: write this node's key, read everyone's."""
        try:
            await self.coordinator.heartbeat(self.node, self.address, int(self.node_ttl * 1000))
            seen = await self.coordinator.members()
        except REDIS_ERRORS as exc:
            self.lost(exc)
            return
        if not self.connected:
            log.info("cluster: %s reached at %s; node %s %s", "Redis",
                     public_url(self.coordinator.url), self.node,
                     "rejoined" if self._said_alone else "joined")
            self.connected = True
            self._said_alone = False
        seen[self.node] = self.address
        self._update(seen)

    def lost(self, exc: BaseException) -> None:
        """Redis did not answer (here or in a fill's lock call): serve alone until it does."""
        self.counters.redis_errors += 1
        if self.connected or not self._said_alone:
            log.warning("cluster: Redis at %s unreachable (%s); serving alone until it is back",
                        public_url(self.coordinator.url), exc or type(exc).__name__)
            self._said_alone = True
        self.connected = False
        self._update({self.node: self.address})

    def _update(self, seen: dict[str, str]) -> None:
        if seen == self.addresses:
            return
        joined = sorted(set(seen) - set(self.addresses))
        left = sorted(set(self.addresses) - set(seen))
        if joined or left:
            log.info("cluster: %d members%s%s", len(seen),
                     f"; joined {', '.join(joined)}" if joined else "",
                     f"; left {', '.join(left)}" if left else "")
        self.addresses = seen
        self.counters.membership_changes += 1
        self.changed.set()
        self.changed = trio.Event()
