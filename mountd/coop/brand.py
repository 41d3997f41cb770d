"""Brand's access policy for packed datasets: fetch units and their fill rates.

A packed dataset (:class:`mountd.coop.packing.Packing`) keeps many small files per remote tar
object, its *packed chunk*; mountd fetches a miss's packed chunk with one ranged GET and
stores every member. Brand (../shared/papers/brand-batched-random-access.txt §3.3) makes
that GET pay off by choosing, on a miss, the packed chunk with the highest *fill rate* —
the share of its members the reader still wants — and by never evicting a member it brought
in before the reader consumed it. Here the *unit* of fetching is a packed chunk (unit
``k >= 0``: chunk ``k`` of the packing) or a loose file (unit ``~cid < 0``: a unit of one).

:class:`FillRates` is one epoch pool's count, per unit of its current Quiver chunk, of the
members it has not been given and that are not cached (``open`` members), kept current in
O(1) per give and cache notification; :meth:`FillRates.best` picks the unit with the highest
fill rate ``wanted / size``, where ``wanted`` also leaves out members some job is fetching
already (co-operative misses, Quiver §5.2), ties broken at random. The claim that uses it
lives in :mod:`mountd.coop.claims`; docs/substitutable-reads.md "Packed datasets (Brand)"
has the whole policy.

Everything runs in mountd's trio thread; a method call is atomic.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Sequence

from mountd.coop.packing import Packing

__all__ = ["FillRates", "unit_members", "unit_of", "unit_size", "units_in"]


def unit_of(packing: Packing, cid: int) -> int:
    """The fetch unit of ``cid``: its packed chunk, or ``~cid`` (negative) when loose."""
    chunk = packing.chunk_of[cid]
    return chunk if chunk >= 0 else ~cid


def unit_members(packing: Packing, unit: int) -> Sequence[int]:
    """The files of ``unit``, in offset order."""
    return packing.members_of(unit) if unit >= 0 else (~unit,)


def units_in(packing: Packing, ids: Iterable[int]) -> list[int]:
    """The distinct units of ``ids``, in order of first appearance."""
    seen: dict[int, None] = {}
    for i in ids:
        seen.setdefault(unit_of(packing, i), None)
    return list(seen)


def unit_size(packing: Packing, unit: int) -> int:
    """How many files ``unit`` holds."""
    return packing.starts[unit + 1] - packing.starts[unit] if unit >= 0 else 1


class FillRates:
    """Open members per unit of one pool's current chunk (see the module docstring).

    ``open[u]`` counts the members of unit ``u`` that the pool has not been given this epoch
    and that are not cached; units with none are absent. The pool calls :meth:`add` /
    :meth:`remove` when a member enters or leaves that state, and the dataset calls
    :meth:`set_flying` when a unit gets its first member in flight or loses its last.

    Units with nothing in flight (*clean*) sit in buckets keyed by ``(open, size)``, so their
    fill rate is known without looking at them; the others (*flying*: few at a time, the
    units some claim is fetching) are looked at member by member when a choice is made.
    """

    __slots__ = ("_buckets", "_flying", "_where", "open", "packing")

    def __init__(self, packing: Packing, open_ids: Iterable[int], flying: Iterable[int]) -> None:
        self.packing = packing
        self.open: dict[int, int] = {}
        self._flying = set(flying)
        #: (open, size) -> clean units with those counts; unit -> its index in that list
        self._buckets: dict[tuple[int, int], list[int]] = {}
        self._where: dict[int, int] = {}
        for i in open_ids:
            u = unit_of(packing, i)
            self.open[u] = self.open.get(u, 0) + 1
        for u in self.open:
            self._file(u)

    def _file(self, u: int) -> None:
        count = self.open.get(u)
        if count and u not in self._flying:
            bucket = self._buckets.setdefault((count, unit_size(self.packing, u)), [])
            self._where[u] = len(bucket)
            bucket.append(u)

    def _unfile(self, u: int) -> None:
        k = self._where.pop(u, None)
        if k is None:
            return
        key = (self.open[u], unit_size(self.packing, u))
        bucket = self._buckets[key]
        last = bucket.pop()
        if last != u:
            bucket[k] = last
            self._where[last] = k
        elif not bucket:
            del self._buckets[key]

    def add(self, cid: int) -> None:
        """``cid`` became open (evicted while unread)."""
        u = unit_of(self.packing, cid)
        self._unfile(u)
        self.open[u] = self.open.get(u, 0) + 1
        self._file(u)

    def remove(self, cid: int) -> None:
        """``cid`` is no longer open (given, or cached)."""
        u = unit_of(self.packing, cid)
        self._unfile(u)
        left = self.open[u] - 1
        if left:
            self.open[u] = left
            self._file(u)
        else:
            del self.open[u]

    def set_flying(self, unit: int, flying: bool) -> None:
        """``unit`` has members in flight now (``flying``) or none any more."""
        self._unfile(unit)
        if flying:
            self._flying.add(unit)
        else:
            self._flying.discard(unit)
            self._file(unit)

    def best(
        self, rng: random.Random, wanted: Callable[[int], list[int]]
    ) -> tuple[int, list[int]] | None:
        """The unit with the highest fill rate and its wanted members; None when no unit
        has a wanted member (every open member is in flight).

        ``wanted(u)`` lists ``u``'s open members that are not in flight. A clean unit's
        rate is ``open / size``; a flying unit's is ``len(wanted(u)) / size``, looked at
        only when it could beat the best clean one. Ties go to a uniformly random unit,
        which is what keeps the choice random (Brand §4.1: among units with the same
        history, the fill is a random pick).

        Cost: the distinct ``(open, size)`` pairs (at most the pack size for equal packs)
        plus the members of the flying units, whatever the size of the chunk.
        """
        best_w, best_size = 0, 1
        for w, size in self._buckets:
            if w * best_size > best_w * size:
                best_w, best_size = w, size
        tied: list[tuple[int, list[int]]] = []
        packing = self.packing
        # A copy: looking at a member may find its flight expired, which files the unit
        # among the clean ones (set_flying) while this loop runs.
        for u in list(self._flying):
            count = self.open.get(u)
            if not count:
                continue
            size = unit_size(packing, u)
            if count * best_size < best_w * size:
                continue  # even with nothing in flight it cannot win
            ids = wanted(u)
            cmp = len(ids) * best_size - best_w * size
            if not ids or cmp < 0:
                continue
            if cmp > 0:
                best_w, best_size, tied = len(ids), size, []
            tied.append((u, ids))
        if not best_w:
            return None
        filed = {u for u, _ in tied if u in self._where}  # expired while looked at
        tied = [t for t in tied if t[0] not in filed]
        clean = [b for (w, size), b in self._buckets.items() if w * best_size == best_w * size]
        r = rng.randrange(sum(map(len, clean)) + len(tied))
        for bucket in clean:
            if r < len(bucket):
                u = bucket[r]
                return u, wanted(u)
            r -= len(bucket)
        return tied[r]
