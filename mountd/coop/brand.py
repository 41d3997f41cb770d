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

__all__ = ["FillRates", "unit_members", "unit_of", "units_in"]


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


class FillRates:
    """Open members per unit of one pool's current chunk (see the module docstring).

    ``open[u]`` counts the members of unit ``u`` that the pool has not been given this epoch
    and that are not cached; units with none are absent. The pool calls :meth:`add` /
    :meth:`remove` when a member enters or leaves that state.
    """

    __slots__ = ("open", "packing")

    def __init__(self, packing: Packing, open_ids: Iterable[int]) -> None:
        self.packing = packing
        self.open: dict[int, int] = {}
        for i in open_ids:
            self.add(i)

    def add(self, cid: int) -> None:
        """``cid`` became open (evicted while unread)."""
        u = unit_of(self.packing, cid)
        self.open[u] = self.open.get(u, 0) + 1

    def remove(self, cid: int) -> None:
        """``cid`` is no longer open (given, or cached)."""
        u = unit_of(self.packing, cid)
        left = self.open[u] - 1
        if left:
            self.open[u] = left
        else:
            del self.open[u]

    def best(
        self,
        rng: random.Random,
        flying: dict[int, int],
        wanted: Callable[[int], list[int]],
    ) -> tuple[int, list[int]] | None:
        """The unit with the highest fill rate and its wanted members; None when no unit
        has a wanted member (every open member is in flight).

        ``flying[u]`` is how many members of ``u`` are in the dataset's in-flight map (an
        upper bound: expired entries count until looked at); ``wanted(u)`` lists ``u``'s
        open members that are not in flight, exactly. A unit none of whose members is in
        flight needs no look: its wanted count is its open count. Units whose open count
        cannot beat the best rate so far are skipped unread. Ties go to a uniformly random
        one (reservoir sampling), which is what keeps the choice random (Brand §4.1: among
        units with the same history the fill is a random pick).

        Cost: one pass over the open units (~2,000 for a 10% chunk of 1.3M files in packed
        chunks of 64), plus a look at the members of units with files in flight.
        """
        packing = self.packing
        best_w, best_size, choice, ties = 0, 1, None, 0
        members: list[int] = []
        for u, count in self.open.items():
            size = len(packing.members_of(u)) if u >= 0 else 1
            if count * best_size < best_w * size:
                continue  # even with nothing in flight it cannot win
            if flying.get(u):
                ids = wanted(u)
                w = len(ids)
            else:
                ids, w = None, count
            if not w:
                continue
            cmp = w * best_size - best_w * size
            if cmp > 0:
                best_w, best_size, choice, ties = w, size, (u, ids), 1
            elif cmp == 0:
                ties += 1
                if rng.randrange(ties) == 0:
                    choice = (u, ids)
        if choice is None:
            return None
        u, ids = choice
        members = ids if ids is not None else wanted(u)
        return u, members
