"""The cluster's use of Redis/Valkey: heartbeat keys, the member list, fill locks.

Keys (``<c>`` is the cluster name, ``--cluster-name``)::

    quiverfs:<c>:node:<id>     → advertised HOST:PORT    PX node_ttl, rewritten every heartbeat
    quiverfs:<c>:fill:<hash>   → id of the node fetching  SET NX PX lock_ttl; when the fetch
                                 landed: "done:<id>" PX done_ttl (late comers ask that node);
                                 deleted when it failed; taken over (compare-and-set)
                                 by a waiter when its holder left the member list

redis-py's client is blocking; every call runs in a worker thread (one at a time per
:class:`Coordinator`, under a limiter of a few), with short socket timeouts and no retries
inside the client, so an unreachable Redis costs about a second per call and the caller
decides what to do (the cluster then serves alone: :mod:`mountd.cluster.membership`).
Calls are abandoned when cancelled: the only writes are a heartbeat and a lock, both of
which expire by themselves.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

import trio

from quiverfs.base.errors import UsageError

try:  # the optional "cluster" extra: mountd without --cluster runs without it
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry
except ImportError:  # pragma: no cover - exercised only where the extra is missing
    redis = None  # type: ignore[assignment]

T = TypeVar("T")

#: Seconds a Redis call may take (connect, or one command) before it counts as failed.
REDIS_TIMEOUT = 1.0

#: Errors that mean "Redis is not answering" (not a bug of ours).
REDIS_ERRORS: tuple[type[BaseException], ...] = (
    (OSError,) if redis is None else (redis.RedisError, OSError))

#: Value prefix of a fill lock whose fetch landed: ``done:<node id>``.
DONE = "done:"

#: Deletes a lock only if it is still ours (another node may hold it after ours expired).
_RELEASE = """
if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end
return 0
"""

#: Turns our lock into "done:<us>" for ARGV[2] ms, only if it is still ours.
_FINISH = """
if redis.call('get', KEYS[1]) == ARGV[1] then
  return redis.call('set', KEYS[1], 'done:' .. ARGV[1], 'PX', ARGV[2])
end
return 0
"""

#: Gives the lock of a holder that died (ARGV[1]) to ARGV[2] for ARGV[3] ms, only if the dead
#: node still holds it: of all the waiters that saw it die, exactly one gets it.
_TAKE_OVER = """
if redis.call('get', KEYS[1]) == ARGV[1] then
  return redis.call('set', KEYS[1], ARGV[2], 'PX', ARGV[3])
end
return 0
"""


def public_url(url: str) -> str:
    """``url`` without its password, for logs and ``stats``."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)[1]
    user = parts.username or ""
    return urlunsplit(parts._replace(netloc=f"{user}:***@{netloc}"))


class Coordinator:
    """Redis calls of one cluster (see the module docstring). Methods raise one of
    :data:`REDIS_ERRORS` when Redis does not answer."""

    def __init__(self, url: str, name: str) -> None:
        if redis is None:
            raise UsageError("--cluster needs redis-py: pip install 'quiverfs[cluster]'")
        self.url = url
        self.prefix = f"quiverfs:{name}:"
        self._redis = redis.Redis.from_url(
            url, socket_timeout=REDIS_TIMEOUT, socket_connect_timeout=REDIS_TIMEOUT,
            retry=Retry(NoBackoff(), 0), decode_responses=True)
        self._limiter = trio.CapacityLimiter(4)
        self._release = self._redis.register_script(_RELEASE)
        self._finish = self._redis.register_script(_FINISH)
        self._take_over = self._redis.register_script(_TAKE_OVER)

    async def _call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        return await trio.to_thread.run_sync(
            lambda: fn(*args, **kwargs), limiter=self._limiter, abandon_on_cancel=True)

    def node_key(self, node: str) -> str:
        """The heartbeat key of ``node``."""
        return f"{self.prefix}node:{node}"

    def fill_key(self, hash: bytes) -> str:
        """The cluster-wide fill lock of ``hash``."""
        return f"{self.prefix}fill:{hash.hex()}"

    async def heartbeat(self, node: str, address: str, ttl_ms: int) -> None:
        """(Re)write ``node``'s heartbeat key, alive for ``ttl_ms``."""
        await self._call(self._redis.set, self.node_key(node), address, px=ttl_ms)

    async def leave(self, node: str) -> None:
        """Remove ``node``'s heartbeat key (a clean shutdown: peers see it go at once)."""
        await self._call(self._redis.delete, self.node_key(node))

    async def members(self) -> dict[str, str]:
        """Every live node id → its advertised address."""

        def read() -> dict[str, str]:
            keys = list(self._redis.scan_iter(match=f"{self.prefix}node:*", count=1000))
            values = self._redis.mget(keys) if keys else []
            start = len(f"{self.prefix}node:")
            return {k[start:]: v for k, v in zip(keys, values, strict=True) if v is not None}

        return await self._call(read)

    async def lock(self, hash: bytes, node: str, ttl_ms: int) -> str | None:
        """Take the fill lock of ``hash`` for ``node``: None when taken, else the lock's
        value (the id of the node fetching, or ``done:<id>`` of the node that fetched it;
        ``""`` if it went between the two calls: try again)."""
        key = self.fill_key(hash)
        if await self._call(self._redis.set, key, node, nx=True, px=ttl_ms):
            return None
        return await self._call(self._redis.get, key) or ""

    async def holder(self, hash: bytes) -> str | None:
        """The fill lock of ``hash`` now (None: nobody's; see :meth:`lock`)."""
        return await self._call(self._redis.get, self.fill_key(hash))

    async def unlock(self, hash: bytes, node: str) -> None:
        """Release ``node``'s fill lock of ``hash`` (not another node's): its fetch failed."""
        await self._call(self._release, keys=[self.fill_key(hash)], args=[node])

    async def finish(self, hash: bytes, node: str, ttl_ms: int) -> None:
        """``node``'s fetch of ``hash`` landed: its lock becomes ``done:<node>`` for
        ``ttl_ms``, so that nodes asking meanwhile fetch from it, not from the bucket."""
        await self._call(self._finish, keys=[self.fill_key(hash)], args=[node, ttl_ms])

    async def take_over(self, hash: bytes, dead: str, node: str, ttl_ms: int) -> bool:
        """Give the fill lock of ``hash`` that ``dead`` holds to ``node`` (for ``ttl_ms``),
        atomically: True for the one caller that got it, False when ``dead`` no longer holds
        it (another waiter took it over first, or it expired or was released)."""
        taken = await self._call(self._take_over, keys=[self.fill_key(hash)],
                                 args=[dead, node, ttl_ms])
        return bool(taken)

    def close(self) -> None:
        """Close the client's connections."""
        self._redis.close()
