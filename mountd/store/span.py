"""Chunk fills: several members of one packed object fetched with one ranged GET (issue 14).

A packed dataset keeps many small files in one remote object, a *chunk* (a tar written by
``digests pack``; docs/digest-format.md). Fetching each member with its own ranged GET is
bound by the request latency: 16 KiB at 20 ms to the first byte is under 1 MB/s a request.
Brand (../shared/papers/brand-batched-random-access.txt §3) reads a chunk at a time instead.
mountd does the same on a miss: the GET covers the requested member *and* its neighbours
that are still wanted, and each member is then verified and stored by its own hash exactly
as a fill of one file would be (:meth:`mountd.store.fill.Filler.fill_span`).

Who knows what. The store knows no datasets: the session layer, which holds each dataset's
chunk map (:mod:`mountd.coop.packing`), hands the cache a :class:`ChunkMembers` lookup
(``Cache.set_chunk_members``) that names, for a file about to be fetched, every member of
its object in offset order. The cache knows what is cached and what is being filled, so it
chooses the span here (:func:`plan_span`): the smallest byte range of the object that covers
the requested member and as many of the other wanted members (not cached, not in flight) as
fit in ``max_bytes``, never crossing more than ``max_gap`` unwanted bytes to reach one more.
Without a lookup, or for a file it does not place in a chunk, a fill is the plain one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from quiverfs.base.backends.base import Location


class Member(NamedTuple):
    """One file of a packed object: its content hash, size and location (in the object)."""

    hash: bytes
    size: int
    location: Location


class ChunkMembers(Protocol):
    """Names the members of the object a file lives in (the session layer implements it)."""

    def __call__(self, dataset: str | None, hash: bytes, location: Location) -> Sequence[Member] | None:
        """Every member of ``location``'s object in offset order (the file itself included),
        or None when ``dataset`` does not place this file in a chunk (unknown dataset, loose
        file). Called in the trio thread when a fill of ``hash`` is about to start; must be
        quick and must not await."""


#: Unwanted bytes a span may always cross to reach a member, however small: the tar header
#: blocks (a pax record for a long name included) and padding between two members.
HEADER_ROOM = 4096


def crossable(gap: int, member: Member, max_gap: int) -> bool:
    """Whether a span may cross ``gap`` unwanted bytes to take in ``member``: at most
    ``max_gap``, and never more than the member brings (beyond :data:`HEADER_ROOM`). A GET's
    latency is saved by crossing, but the bytes crossed are fetched and dropped: with only
    the fixed gap, spans of 16 KiB members crossed up to sixteen cached neighbours to reach
    one, and a packed dataset at a 20% cache fetched 1.30 datasets an epoch, 0.10 of it
    cached members read again and dropped (``scripts/bench/packed_training.py``,
    2026-12-01; 1.13 with this rule, at 176 GETs an epoch against 136)."""
    return gap <= min(max_gap, max(member.size, HEADER_ROOM))


@dataclass(frozen=True)
class Span:
    """One ranged GET of a chunk fill: bytes ``[start, end)`` of ``key`` under ``url``, and
    the members inside it to store (offset order, distinct hashes; the requested one
    included). Bytes of the range outside them (tar headers, members already cached or
    being filled) are read and dropped."""

    url: str
    key: str
    start: int
    end: int
    members: tuple[Member, ...]

    @property
    def length(self) -> int:
        """Bytes the GET asks for."""
        return self.end - self.start

    @property
    def content_bytes(self) -> int:
        """Bytes of the members stored (what the fill reserves under the cap)."""
        return sum(m.size for m in self.members)


def plan_span(
    members: Sequence[Member],
    requested: Member,
    wanted: Callable[[bytes], bool],
    max_bytes: int,
    max_gap: int,
) -> Span | None:
    """The span to fetch for ``requested``, or None for a plain fill of it alone.

    ``members`` is the object's members in offset order; ``wanted(hash)`` says whether a
    member still needs a fill (not cached, not being filled). Starting from the requested
    member the span grows one wanted member at a time, always by the neighbour (left or
    right) that adds fewer bytes, while the range stays within ``max_bytes`` and the
    unwanted bytes it crosses to reach that neighbour (see :func:`crossable`) are at most
    ``max_gap`` and at most what the neighbour brings.

    None when the requested member is not among ``members`` (same key and offset), when it
    alone does not fit ``max_bytes``, or when no other member joins it: then one GET for one
    file is what the plain fill does already (and it streams large objects)."""
    loc = requested.location
    if requested.size > max_bytes:
        return None
    at = next((i for i, m in enumerate(members)
               if m.hash == requested.hash and m.location.offset == loc.offset
               and m.location.key == loc.key and m.location.url == loc.url), None)
    if at is None:
        return None
    chosen: set[bytes] = {requested.hash}

    def candidates(order: Sequence[Member]) -> list[Member]:
        out = []
        for m in order:
            if m.location.key != loc.key or m.location.url != loc.url or m.size != m.location.length:
                continue
            out.append(m)
        return out

    left = candidates(list(reversed(members[:at])))
    right = candidates(members[at + 1:])
    start, end = loc.offset, loc.offset + requested.size
    picked = [requested]
    li = ri = 0
    while True:
        while li < len(left) and (left[li].hash in chosen or not wanted(left[li].hash)):
            li += 1
        while ri < len(right) and (right[ri].hash in chosen or not wanted(right[ri].hash)):
            ri += 1
        options: list[tuple[int, str]] = []
        if li < len(left):
            m = left[li]
            first = m.location.offset
            if crossable(start - (first + m.size), m, max_gap) and end - first <= max_bytes and first <= start:
                options.append((start - first, "left"))
        if ri < len(right):
            m = right[ri]
            last = m.location.offset + m.size
            if crossable(m.location.offset - end, m, max_gap) and last - start <= max_bytes and last >= end:
                options.append((last - end, "right"))
        if not options:
            break
        # The span only grows, so a side that does not fit now never will: the loop ends
        # once neither does.
        _, side = min(options)
        if side == "left":
            m = left[li]
            start = m.location.offset
            li += 1
        else:
            m = right[ri]
            end = m.location.offset + m.size
            ri += 1
        chosen.add(m.hash)
        picked.append(m)
    if len(picked) == 1:
        return None
    picked.sort(key=lambda m: m.location.offset)
    return Span(loc.url, loc.key, start, end, tuple(picked))
