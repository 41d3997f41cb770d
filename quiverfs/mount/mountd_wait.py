"""A mount's requests to mountd wait out a mountd restart instead of failing at once.

Hits need no mountd, but a miss (``ensure``) and every control request (a shim's claim,
reports, sessions) do. When mountd is killed and started again (a crash under systemd's
``Restart=on-failure``, an operator's restart, a mountd this mount started on demand), failing
those with ``EIO`` would crash every training job reading a miss at that moment: a
``DataLoader`` worker that gets ``EIO`` ends the epoch. So a request that finds mountd away
waits for it, trying the socket again with a growing interval, for up to ``--mountd-wait``
seconds (:data:`MOUNTD_WAIT`; 0: fail at once, as before), and then fails with ``EIO`` as
it did. The reader blocks meanwhile, as it would on a slow bucket; one log line says that
mountd is away and one that it answers again.

Only :class:`~mountd.errors.MountdUnavailable` is waited for (no socket, the connect
refused, the connection lost): what mountd answered, errors included, is passed on at once.
A request whose connection was lost while mountd worked on it is sent again: ``ensure`` is
idempotent, and mountd's session state died with it, so a claim sent again is refused as
unknown (``ENOENT``) and the shim opens its session again (quiverfs/client/torch.py).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import trio

from mountd.errors import MountdUnavailable

log = logging.getLogger("quiverfs.mount")

#: Seconds a request that needs mountd waits for it to answer again (``--mountd-wait``):
#: room for a supervisor's restart and mountd's recovery of its index.
MOUNTD_WAIT = 60.0

#: First and longest interval between two tries of the socket (seconds).
FIRST_RETRY, LONGEST_RETRY = 0.05, 1.0

T = TypeVar("T")


class MountdWait:
    """How long a mount's requests wait for mountd, and the outage they are waiting out
    (one per mount; trio thread only)."""

    def __init__(self, seconds: float = MOUNTD_WAIT) -> None:
        if seconds < 0:
            raise ValueError(f"the wait for mountd must be 0 or more seconds, not {seconds}")
        self.seconds = seconds
        #: when the current outage was first seen (None: mountd answers)
        self._away_since: float | None = None
        #: requests that waited in the current outage
        self._waited = 0
        #: outages waited out since the mount started, and requests that gave up
        self.outages = 0
        self.gave_up = 0

    async def call(self, attempt: Callable[[], Awaitable[T]], what: str) -> T:
        """``await attempt()``, tried again while it raises :class:`MountdUnavailable`, for up
        to :attr:`seconds` from the first failure; then that failure is raised."""
        deadline: float | None = None
        delay = FIRST_RETRY
        while True:
            try:
                result = await attempt()
            except MountdUnavailable as exc:
                now = trio.current_time()
                if deadline is None:
                    deadline = now + self.seconds
                    self._away(now, exc)
                if now >= deadline:
                    self.gave_up += 1
                    log.warning("mountd did not answer for %g s: %s failed (%s)", self.seconds, what, exc)
                    raise
                await trio.sleep(min(delay, deadline - now))
                delay = min(LONGEST_RETRY, delay * 2)
                continue
            if deadline is not None or self._away_since is not None:
                self._back()
            return result

    def _away(self, now: float, exc: MountdUnavailable) -> None:
        self._waited += 1
        if self._away_since is None:
            self._away_since = now
            if self.seconds > 0:
                log.warning("mountd is not answering (%s): reads and control requests that need "
                            "it wait up to %g s for it (--mountd-wait)", exc, self.seconds)

    def _back(self) -> None:
        if self._away_since is None:
            return
        away = trio.current_time() - self._away_since
        self.outages += 1
        log.warning("mountd answers again after %.1f s; %d requests waited for it", away, self._waited)
        self._away_since, self._waited = None, 0


class PatientSessions:
    """The control channel's :class:`~quiverfs.filesystem.control_channel.SessionClient` over mountd's
    client, waiting out a restart (:class:`MountdWait`)."""

    def __init__(self, client: Any, wait: MountdWait) -> None:
        self.client = client
        self.wait = wait

    async def call(self, op: str, args: dict[str, Any] | None = None) -> Any:
        return await self.wait.call(lambda: self.client.call(op, args), op)
