"""Chunk fills inside the cache: the flights of one span, started and finished together.

:class:`ChunkFills` is the part of :class:`mountd.store.cache.Cache` that runs a chunk fill
(the span is chosen by :func:`mountd.store.span.plan_span`, fetched and split by
:meth:`mountd.store.fill.Filler.fill_span`). It is a base class of ``Cache`` (kept in its own
module: ``cache.py`` is long enough) and uses the cache's accounting, listed below; every
method runs in the trio thread, atomic between awaits as the cache's own.

What a chunk fill keeps exactly as a fill of one file (docs/store-layout.md "Chunk fills"):

* **Single-flight per member.** Every member the span will store gets its own
  :class:`~mountd.store.flights.Flight` in the same trio step as the span is planned, so a
  concurrent miss of any of them waits for this one GET. Members already cached or being
  filled are never in a span (they are not "wanted"), so one hash never has two flights.
* **Space and quota.** The span reserves the sum of its members' sizes (charged to the
  requester's uid, as a plain fill is) before its GET; each member's share turns into use
  in the trio step its row is indexed.
* **Spans in flight, bounded in bytes.** All spans in flight together cover at most a
  quarter of the cache (:data:`SPAN_BUDGET_SHARE`) beyond a floor each of the cache ÷ (4 ×
  ``remote_concurrency``): a span is as large as that budget still allows. Larger spans in
  a small cache evicted each other's members before they were read; a fixed share per
  request in flight, the bound before 2026-12-01, made a 20% cache of 110 KB files fetch
  2.2 members a GET where its packed chunks held 19 (``scripts/bench/peers.py`` (b)).
* **Verification.** Each member is verified against its own hash; one that fails is
  dropped alone (its waiters get :class:`~quiverfs.base.errors.CorruptObject`, EIO), its
  neighbours are stored.
* **Counters.** One GET and its bytes (``remote_requests``/``remote_bytes``), one fill per
  member stored (``bytes_from_remote``, fill latency), plus ``chunk_fills`` and
  ``chunk_members`` (members stored by chunk fills).

In a cluster (the cache has ``peers``: mountd/store/peers.py) the requested member goes
through the peers first, as a plain fill's file does: when a peer holds it, it is filled
from there and every other member of the span is filled on its own (each asking the peers
first: in a cluster that holds the dataset they are peer hits, not a GET); when the span is
this node's to fetch (its turn at the bucket, under the cluster-wide lock of the requested
member), the span's one GET runs as alone and every member stored is then pushed to its
owner, so the next miss anywhere finds it there (docs/cluster.md "Packed datasets").
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from os import PathLike

import trio

from mountd.stats.counters import Counters
from mountd.store.config import CacheConfig
from mountd.store.fill import Filler
from mountd.store.flights import Flight
from mountd.store.holds import Holds
from mountd.store.index import Index
from mountd.store.limits import SourceSlots
from mountd.store.peers import PeerSource
from mountd.store.quota import Charges
from mountd.store.span import ChunkMembers, Member, Span, plan_span

#: Share of the cache that the spans in flight may cover together (beyond each one's floor).
SPAN_BUDGET_SHARE = 0.25


class ChunkFills:
    """Chunk fills of :class:`mountd.store.cache.Cache` (see the module docstring)."""

    # What it uses of the cache (set by Cache.__init__ and its methods).
    config: CacheConfig
    counters: Counters
    charges: Charges
    reserved: int
    holds: Holds
    _flights: dict[bytes, Flight]
    _fill_slots: SourceSlots
    _filler: Filler
    _chunk_members: ChunkMembers | None
    #: Bytes the spans in flight cover (set by Cache.__init__; see "Spans in flight").
    _span_bytes: int
    #: Files a loading chunk will pin as they land (protection.py ``expect_pins``).
    _expected_pins: dict[bytes, int]
    peers: PeerSource | None
    _nursery: trio.Nursery | None
    _require_open: Callable[[], Index]
    _reserve: Callable[..., Awaitable[None]]
    _run_flight: Callable[[Flight], Awaitable[None]]
    _stored: Callable[[Flight, PathLike[str] | str], None]
    _failed: Callable[[Flight, Exception], None]
    _finish: Callable[[Flight], None]
    _notify_space: Callable[[], None]

    def set_chunk_members(self, lookup: ChunkMembers | None) -> None:
        """Fetch misses of packed files a chunk span at a time (:mod:`mountd.store.span`):
        ``lookup`` names the members of a file's object (mountd's session layer, which knows
        each dataset's chunks). None: one GET per file."""
        self._chunk_members = lookup

    def _open_span(self, flight: Flight) -> tuple[Span, list[Flight]] | None:
        """Plan a chunk fill for mountd's own new ``flight`` and open a flight for each other
        member it will store, in this trio step (so a concurrent miss of any of them joins
        it). The span and its flights, ``flight`` first; None for a plain fill."""
        lookup, cfg = self._chunk_members, self.config
        if lookup is None or flight.source is not None or cfg.span_max_bytes <= 0:
            return None
        members = lookup(flight.dataset, flight.hash, flight.location)
        if not members:
            return None
        index = self._require_open()
        limit = min(cfg.span_max_bytes, cfg.chunk_size, self._span_room())
        if cfg.user_quota is not None and flight.uid is not None:
            limit = min(limit, cfg.user_quota // 4)

        holds = self.holds
        sizes = {m.hash: m.size for m in members}

        expected = self._expected_pins

        def wanted(content: bytes) -> bool:
            # A member nobody asked for is fetched ahead: only while protection has room
            # for it (then it is protected below); past that the span covers what was
            # asked (protected by a claim, or this miss) and stops (mountd/store/holds.py).
            # A member of the loading chunk needs no room: its pin keeps it once it lands
            # (without this, a chunk load of a packed dataset in a small cache made one GET
            # a file: 4,902 GETs in 2 epochs of 2,000 files in 144 objects, peers.py (b)).
            return content not in self._flights and index.size_of(content) is None and (
                content in expected or holds.protected(content) or holds.fits(sizes[content]))

        requested = Member(flight.hash, flight.size, flight.location)
        span = plan_span(members, requested, wanted, limit, cfg.span_max_gap)
        if span is None:
            return None
        flights = [flight]
        for member in span.members:
            if member.hash != flight.hash:
                if not holds.protected(member.hash) and member.hash not in expected:
                    holds.protect(member.hash, member.size)  # brought along: keep until read
                sibling = Flight(member.hash, member.size, member.location, flight.dataset,
                                 prefetch=False, uid=flight.uid)
                self._flights[member.hash] = sibling
                flights.append(sibling)
        self._span_bytes += span.length
        return span, flights

    @property
    def span_bytes_in_flight(self) -> int:
        """Bytes the chunk fills in flight cover together (see "Spans in flight" above)."""
        return self._span_bytes

    def _span_room(self) -> int:
        """The most bytes a new span may cover (see "Spans in flight" above): what the
        budget has left, and never less than an equal share of it per request in flight.
        Memory per span is bounded like a streamed fill's chunk by the caller."""
        cfg = self.config
        budget = int(cfg.cache_size * SPAN_BUDGET_SHARE)
        floor = budget // max(1, cfg.remote_concurrency)
        return max(floor, budget - self._span_bytes)

    async def _run_span(self, span: Span, flights: list[Flight]) -> None:
        """A chunk fill, alone or in a cluster (see the module docstring); its bytes leave
        the spans' budget when it ends, whichever way."""
        try:
            await self._span_flights(span, flights)
        finally:
            self._span_bytes -= span.length

    async def _span_flights(self, span: Span, flights: list[Flight]) -> None:
        peers = self.peers
        if peers is None:
            await self._fetch_span(span, flights)
            return
        first = flights[0]
        async with peers.turn(first.hash, first.size) as content:
            if content is None:  # this node's turn at the bucket: the span's GET
                await self._fetch_span(span, flights)
                for flight in flights[1:]:  # the turn shares the requested one itself
                    if flight.path is not None and flight.error is None:
                        peers.landed(flight.hash)
                return
            first.source = content  # a peer's copy: the fill reads it, _finish closes it
        siblings = flights[1:]
        if self._nursery is not None:
            for sibling in siblings:
                self._nursery.start_soon(self._run_flight, sibling)
            siblings = []
        await self._run_flight(first)
        for sibling in siblings:
            await self._run_flight(sibling)

    async def _fetch_span(self, span: Span, flights: list[Flight]) -> None:
        """One GET for every member of ``span``, each stored (or failed) on its own flight
        as ``Cache._run_flight`` would, under one reservation for them all."""
        counters = self.counters
        first = flights[0]
        by_hash = {f.hash: f for f in flights}
        left = set(by_hash)  # flights not finished yet
        counters.fills_in_flight += len(flights)
        if first.prefetch:
            counters.add_prefetch(first.dataset)
        start = trio.current_time()
        uid, total = first.uid, span.content_bytes
        try:
            async with self._fill_slots.slot(span.url):
                await self._reserve(total, uid, demand=lambda: any(
                    f.demanded() if f is first else f.awaited for f in flights))
                try:
                    results = await self._filler.fill_span(span, first.dataset)
                    stored = 0
                    for member, result in zip(span.members, results, strict=True):
                        flight = by_hash[member.hash]
                        try:
                            if isinstance(result, Exception):
                                raise result
                            # Every member's file is at its final name already: each must
                            # be indexed or removed here, whatever happens to the others.
                            self._stored(flight, result)
                        except Exception as exc:
                            self._failed(flight, exc)
                        else:
                            counters.add_fill(flight.dataset, flight.size,
                                              trio.current_time() - start)
                            stored += 1
                        left.discard(flight.hash)
                        counters.fills_in_flight -= 1
                        self._finish(flight)
                    counters.add_chunk_fill(first.dataset, stored)
                finally:
                    self.reserved -= total
                    self.charges.unreserve(uid, total)
                    self._notify_space()
        except trio.Cancelled:
            for content in left:
                by_hash[content].cancelled = True
            raise
        except Exception as exc:
            for content in left:  # the GET failed (or no room): every member with it
                self._failed(by_hash[content], exc)
        finally:
            counters.fills_in_flight -= len(left)
            for content in left:
                self._finish(by_hash[content])
