"""The cache's single-flight records, and who hears of the store's changes.

A :class:`Flight` is one fill in progress: every ``ensure()`` of its hash waits on it, so
concurrent misses of one hash make one remote read. A chunk fill (:mod:`mountd.store.span`)
opens one flight per member it will store, all at once, so a concurrent miss of any of them
waits for that one GET instead of starting another.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import trio

from mountd.store.supplied import SuppliedBytes
from quiverfs.base.backends.base import Location


class CacheListener(Protocol):
    """Told of every change to the store's content (mountd's session layer, tests).

    Called in the trio thread, in the same step as the change; must not await or raise
    (an exception is logged and ignored: a listener can never break a fill or an eviction).
    """

    def filled(self, hashes: Sequence[bytes]) -> None:
        """``hashes`` are now in the store (a fill landed, or the files of one batch: told
        once per job, as ``removed`` is once per eviction)."""

    def removed(self, hashes: Sequence[bytes]) -> None:
        """``hashes`` left the store (eviction, scrub, ``evict``, missing file)."""

    def fill_failed(self, hash: bytes) -> None:
        """A fill of ``hash`` failed for good (not: cancelled)."""


@dataclass(eq=False)
class Flight:
    """One fill in progress; every ensure() of the same hash waits on it (single-flight).

    Whose authority fills it (docs/operations.md "Security"): ``source`` None means mountd's
    own, reading ``location``; otherwise the bytes a client supplied. ``lease`` is set on a
    flight that waits for a client to supply the bytes (:meth:`Cache.lease`): it has not
    started, and belongs to that client until it supplies, releases, or the lease expires."""

    hash: bytes
    size: int
    location: Location
    dataset: str | None
    prefetch: bool
    source: SuppliedBytes | None = None
    lease: object | None = None
    done: trio.Event = field(default_factory=trio.Event)
    path: str | None = None
    error: BaseException | None = None
    #: The task running the fill was cancelled (or its lease given up): waiters start a new
    #: flight.
    cancelled: bool = False
    #: Whether the fill itself has started (a lease waits for its bytes until then).
    started: bool = True
    #: The uid the entry is charged to once stored (mountd/store/quota.py): the requester of
    #: a fill mountd reads, the supplier of supplied bytes; None: nobody.
    uid: int | None = None
    #: A reader waits for it (``ensure``, ``ensure_supplied``, ``lease``), or it was started
    #: for one: its fill may end protections to make room (mountd/store/holds.py).
    awaited: bool = False
    #: Callers waiting on ``done`` right now: a landed file is kept from eviction until the
    #: last of them has its path (``Cache._landing``).
    waiting: int = 0
    #: Its ticket in the order a claim's fetches take the remote limits
    #: (:class:`mountd.store.limits.Turns`); None: no order to keep (a chunk fill takes its
    #: limits out of any order).
    turn: int | None = None

    @property
    def slot_source(self) -> str:
        """Whose fill slots it takes (:class:`mountd.store.limits.SourceSlots`): its
        bucket's URL, or ``"supplied"`` for bytes a client or a peer hands over (they wait
        on no bucket)."""
        return self.location.url if self.source is None else "supplied"

    @property
    def background(self) -> bool:
        """A fill of the prefetch queue (read-ahead, the sweep), not a claim's fetch: it
        takes slots only within the share background work may hold, so the rest stay free
        for readers' misses (:class:`mountd.store.limits.SourceSlots`). Fixed once it runs
        (``prefetch`` never changes; ``turn`` is set before)."""
        return self.prefetch and self.turn is None

    def demanded(self) -> bool:
        """Whether a reader waits for this fill (not a prefetch nobody waits for yet)."""
        return self.awaited or not self.prefetch

    def fills_for(self, source: SuppliedBytes | None) -> bool:
        """Whether a failure of this flight is the failure of a caller with ``source``: the
        same authority (mountd's own, or this very supply). Anyone else's failure is never
        passed on: the caller tries with its own rights (no one learns from another's)."""
        return self.source is source and self.lease is None
