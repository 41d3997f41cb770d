"""The cluster seen from one mountd: what its store's misses ask before the bucket.

:class:`Cluster` is the :class:`mountd.store.peers.PeerSource` mountd's daemon hands the
cache. A miss of hash ``h`` that the local store could not serve (docs/cluster.md "Miss
path"):

1. **Owners.** Ask the first :data:`CANDIDATES` members in ``h``'s rendezvous order
   (:mod:`mountd.cluster.placement`), skipping this node and peers that failed in the last
   :data:`SUSPECT_SECONDS`. A hit: the bytes, checked against ``h``, are the fill.
2. **Cluster-wide single-flight.** Take ``quiverfs:<c>:fill:<h>`` with ``SET NX PX``. Taken:
   this node fetches from the bucket (the turn yields None). Afterwards, in the background,
   it turns the lock into ``done:<node>`` for :data:`DONE_TTL_MS` (released outright if the
   fetch failed) and pushes the file to ``h``'s owner if that is another node, so the next
   miss anywhere finds it there ("stored on its owner").
3. **Someone else fetches.** Poll the lock until it says ``done:<node>`` (then ask that
   node) or goes (the fetch failed, or the lock expired after ``lock_ttl``), or its holder
   leaves the member list (it died): then one waiter takes its lock over (compare-and-set,
   counted as ``take_overs``) and fetches, the others wait for that one. Still nothing:
   back to 1. After :data:`ROUNDS` rounds, the bucket.

A miss whose client supplies its own bytes (another user's mount) asks only step 1
(:meth:`Cluster.find`): the client's fetch uses its own rights, not a cluster-wide turn; once
its bytes are stored they are pushed to the owner (:meth:`Cluster.landed`) like a fetch's.

Whatever fails on the way (a peer down, hung, lying; Redis gone) costs a retry on the next
source, never an error to the reader: the turn's last resort is always the bucket.
The lock is marked done before the push, so an owner that waits on the lock for a hash
this node is pushing to it never waits on itself (its own fill of ``h`` is in flight, and
the push joins that fill).
"""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import trio

from mountd.cluster import wire
from mountd.cluster.config import ClusterConfig
from mountd.cluster.coordinator import DONE, REDIS_ERRORS, Coordinator, public_url
from mountd.cluster.counters import ClusterCounters
from mountd.cluster.membership import Membership
from mountd.cluster.peer import PeerClient, PeerServer
from mountd.cluster.placement import owner, owners
from mountd.errors import PeerCorrupt, PeerError
from mountd.store import layout
from mountd.store.cache import Cache
from mountd.store.peers import PeerContent

log = logging.getLogger("mountd.cluster")

#: Owners asked before the bucket: the owner, and its successor (which held the hash
#: before the owner joined).
CANDIDATES = 2
#: Seconds a peer that failed a transfer is skipped.
SUSPECT_SECONDS = 5.0
#: Rounds of "ask the owners, try the lock, wait for the holder" before the bucket.
ROUNDS = 3
#: Milliseconds a landed fetch's lock says "done:<node>": nodes missing the hash meanwhile
#: ask that node (its push to the owner may still be on its way).
DONE_TTL_MS = 30_000
#: Seconds between polls of a lock another node holds (first, then the most).
POLL_FIRST, POLL_MOST = 0.02, 0.25
#: What :meth:`Cluster._wait_unlocked` answers when this node took a dead holder's lock.
TAKEN = "taken"


class Cluster:
    """This node's part in the cluster (see the module docstring). Start :meth:`run` in a
    nursery (``nursery.start``), then hand it to the cache as its ``peers``."""

    def __init__(self, config: ClusterConfig, cache: Cache) -> None:
        self.config = config
        self.cache = cache
        self.node = config.advertise
        self.counters = ClusterCounters()
        self.coordinator = Coordinator(config.redis_url, config.name)
        self.membership = Membership(self.coordinator, self.node, config.advertise,
                                     self.counters, heartbeat=config.heartbeat,
                                     node_ttl=config.node_ttl)
        limits = {"max_bytes": config.peer_max_bytes, "timeout": config.peer_timeout}
        tls = config.tls
        self.server = PeerServer(cache, config.secret, self.counters, **limits,
                                 tls=None if tls is None else tls.server_context())
        self.client = PeerClient(config.secret, self.counters, **limits,
                                 spool=layout.tmp_dir(cache.config.cache_dir),
                                 tls=None if tls is None else tls.client_context())
        self._suspects: dict[str, float] = {}
        self._nursery: trio.Nursery | None = None
        #: The peer server's port once listening (the advertised one, or the one bound for 0).
        self.port: int | None = None

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve peers, keep the heartbeat, run pushes; until cancelled."""
        try:
            async with trio.open_nursery() as nursery:
                self.port = await nursery.start(
                    self.server.serve, self.config.listen_host or self.config.host,
                    self.config.port)
                await nursery.start(self.membership.run)
                self._nursery = nursery
                log.info("cluster %s: node %s, peers served on port %d, Redis %s (%s)",
                         self.config.name, self.node, self.port,
                         public_url(self.config.redis_url),
                         "connected" if self.membership.connected else "unreachable: alone")
                task_status.started()
                await trio.sleep_forever()
        finally:
            self._nursery = None
            with trio.CancelScope(shield=True):
                await self.client.aclose()
            self.coordinator.close()

    # -- the miss path (PeerSource) --------------------------------------------------------------

    @asynccontextmanager
    async def turn(self, hash: bytes, size: int) -> AsyncIterator[PeerContent | None]:
        """Content of ``hash`` from a peer, or None: fetch from the bucket now (the cluster-wide
        lock is ours while the turn lasts, when Redis answers). See the module docstring."""
        if not self._peers_take(size):
            yield None
            return
        tried: set[str] = set()
        for _ in range(ROUNDS):
            content = await self._ask_owners(hash, size, tried)
            if content is not None:
                yield content
                return
            if not self.membership.connected:
                break
            try:
                holder = await self.coordinator.lock(hash, self.node, self.config.lock_ttl_ms)
            except REDIS_ERRORS as exc:
                self.membership.lost(exc)
                break
            if holder is None:
                async with self._bucket_turn(hash):
                    yield None
                return
            if not holder.startswith(DONE):
                self.counters.lock_waits += 1
                holder = await self._wait_unlocked(hash, holder)
                if holder is TAKEN:  # its holder died; the lock is ours now
                    async with self._bucket_turn(hash):
                        yield None
                    return
            fetcher = holder[len(DONE):] if holder and holder.startswith(DONE) else None
            if fetcher is not None and fetcher != self.node and fetcher not in tried:
                tried.add(fetcher)
                content = await self._ask(fetcher, hash, size)
                if content is not None:
                    yield content
                    return
            tried.clear()  # the owners may have it now
        self.counters.bucket_turns += 1
        yield None

    async def find(self, hash: bytes, size: int) -> PeerContent | None:
        """The owners' copy of ``hash`` for a miss whose client supplies its own bytes (no
        lock: its fetch is its own); None when they do not have it."""
        if not self._peers_take(size):
            return None
        return await self._ask_owners(hash, size, set())

    def _peers_take(self, size: int) -> bool:
        """Whether content of ``size`` bytes may move between peers now (running, and not
        over ``peer_max_bytes``)."""
        return size <= self.config.peer_max_bytes and self._nursery is not None

    def landed(self, hash: bytes) -> None:
        """A client's bytes for ``hash`` were stored here: push them to the owner."""
        if self._nursery is not None:
            self._nursery.start_soon(self._push_to_owner, hash)

    @asynccontextmanager
    async def _bucket_turn(self, hash: bytes) -> AsyncIterator[None]:
        """This node holds the lock of ``hash`` and fetches it; afterwards, in the background:
        mark the lock done (or release it), then push the stored file to its owner."""
        self.counters.bucket_turns += 1
        landed = False
        try:
            yield
            landed = True
        finally:
            if self._nursery is not None:
                self._nursery.start_soon(self._after_fetch, hash, landed)

    async def _after_fetch(self, hash: bytes, landed: bool) -> None:
        try:
            if landed:
                await self.coordinator.finish(hash, self.node, DONE_TTL_MS)
            else:
                await self.coordinator.unlock(hash, self.node)
        except REDIS_ERRORS as exc:
            self.membership.lost(exc)  # the lock expires by itself
        if landed:
            await self._push_to_owner(hash)

    async def _push_to_owner(self, hash: bytes) -> None:
        """Send the file of ``hash`` stored here to its owner (unless that is this node), so
        the next miss anywhere finds it there."""
        node = owner(hash, self.membership.members) or self.node
        if node == self.node:
            return
        address = self.membership.addresses.get(node)
        opened = await self._open_stored(hash)
        if address is None or opened is None:
            return
        fd, size = opened
        try:
            stored = await self.client.put(address, hash, fd, size)
        except PeerError as exc:
            self._failed(node, exc)
            self.counters.push_errors += 1
            return
        finally:
            os.close(fd)
        if stored:
            self.counters.pushes += 1
        else:
            self.counters.push_errors += 1

    async def _open_stored(self, hash: bytes) -> tuple[int, int] | None:
        """The file this node just stored, opened by its final name (it is complete and
        verified there), and its size; None if eviction took it meanwhile."""
        path = self.cache.store_path(hash)
        try:
            return await trio.to_thread.run_sync(_open_file, path)
        except OSError:
            return None

    async def _ask_owners(self, hash: bytes, size: int,
                          tried: set[str]) -> PeerContent | None:
        for node in owners(hash, self.membership.members)[:CANDIDATES]:
            if node == self.node or node in tried:
                continue
            tried.add(node)
            content = await self._ask(node, hash, size)
            if content is not None:
                return content
        return None

    async def _ask(self, node: str, hash: bytes, size: int) -> PeerContent | None:
        """``hash`` from ``node`` (checked), or None: it lacks it, failed, or is suspect."""
        address = self._address_of(node)
        if address is None:
            return None
        try:
            content = await self.client.get(address, hash, size)
        except PeerCorrupt as exc:
            self.counters.peer_corrupt[node] += 1
            self._failed(node, exc)
            return None
        except PeerError as exc:
            self._failed(node, exc)
            return None
        if content is None:
            self.counters.peer_misses += 1
            return None
        self.counters.peer_hits += 1
        self.counters.peer_bytes += content.size
        return content

    def _address_of(self, node: str) -> str | None:
        """Where to reach ``node``; None when it is not a member or failed a transfer in
        the last :data:`SUSPECT_SECONDS`."""
        if self._suspects.get(node, 0.0) > trio.current_time():
            return None
        return self.membership.addresses.get(node)

    def _failed(self, node: str, exc: BaseException) -> None:
        self.counters.peer_errors[node] += 1
        self._suspects[node] = trio.current_time() + SUSPECT_SECONDS
        log.warning("cluster: peer %s failed (%s); skipping it for %.0f s", node, exc,
                    SUSPECT_SECONDS)

    async def _wait_unlocked(self, hash: bytes, holder: str) -> str | None:
        """Until the fetch of ``hash`` by ``holder`` is over: the lock's ``done:<id>`` value;
        :data:`TAKEN` when ``holder`` is no longer a member (it died: its lock would block
        everyone until it expires) and this node took its lock over (of all the waiters,
        exactly one does: :meth:`Coordinator.take_over`; the others go on waiting for that
        one); or None: released after a failure, expired, Redis stopped answering, or the
        lock's whole lifetime passed."""
        pause = POLL_FIRST
        with trio.move_on_after(self.config.lock_ttl_ms / 1000):
            while True:
                if self.membership.connected and holder not in self.membership.members:
                    try:
                        taken = await self.coordinator.take_over(
                            hash, holder, self.node, self.config.lock_ttl_ms)
                    except REDIS_ERRORS as exc:
                        self.membership.lost(exc)
                        return None
                    if taken:
                        self.counters.take_overs += 1
                        log.info("cluster: %s died fetching %s; this node fetches it", holder,
                                 hash.hex())
                        return TAKEN
                await trio.sleep(pause)
                pause = min(pause * 2, POLL_MOST)
                try:
                    value = await self.coordinator.holder(hash)
                except REDIS_ERRORS as exc:
                    self.membership.lost(exc)
                    return None
                if value is None or value.startswith(DONE):
                    return value
                holder = value
        return None

    # -- what the peers hold (claims prefer peer hits to misses) -----------------------------

    async def held_elsewhere(self, hashes: list[bytes]) -> list[bool]:
        """For each of ``hashes``, whether its owner (another live member) stores it now:
        one HAS request per owner and :data:`wire.MAX_HAS` hashes. A peer that fails or is
        suspect answers "no" for its share (the claim then treats those as misses)."""
        held = [False] * len(hashes)
        members = self.membership.members
        if len(members) < 2 or self._nursery is None:
            return held
        # ~2 µs a hash per member: off the trio thread (16,384 hashes × 4 members: ~40 ms)
        by_owner = await trio.to_thread.run_sync(_by_owner, hashes, list(members), self.node)
        for node, indexes in by_owner.items():
            address = self._address_of(node)
            if address is None:
                continue
            for start in range(0, len(indexes), wire.MAX_HAS):
                part = indexes[start:start + wire.MAX_HAS]
                try:
                    answer = await self.client.has(address, [hashes[i] for i in part])
                except PeerError as exc:
                    self._failed(node, exc)
                    break
                for i, there in zip(part, answer, strict=True):
                    held[i] = there
        return held

    # -- what this node keeps (PeerSource) ---------------------------------------------------

    def keeps(self, hash: bytes) -> bool:
        """Whether this node owns ``hash`` among the members it sees now (alone: every hash):
        its cache evicts such files last, so that the caches together hold each file at
        least once, on its owner, where every miss asks first (docs/cluster.md "What a node
        keeps")."""
        return owner(hash, self.membership.members) == self.node

    # -- reports ------------------------------------------------------------------------------

    def snapshot(self) -> dict:
        """``stats`` → ``cluster``: this node, Redis, the members, and the counters
        (:meth:`ClusterCounters.snapshot`)."""
        return {
            "name": self.config.name,
            "node": self.node,
            "redis": public_url(self.config.redis_url),
            "tls": self.config.tls is not None,
            "connected": self.membership.connected,
            "members": sorted(self.membership.members),
            **self.counters.snapshot(),
        }


def _by_owner(hashes: list[bytes], members: list[str], node: str) -> dict[str, list[int]]:
    """The indexes of ``hashes`` by owner among ``members``, those ``node`` owns left out."""
    out: dict[str, list[int]] = {}
    for i, content in enumerate(hashes):
        holder = owner(content, members)
        if holder is not None and holder != node:
            out.setdefault(holder, []).append(i)
    return out


def _open_file(path: str) -> tuple[int, int]:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    return fd, os.fstat(fd).st_size
