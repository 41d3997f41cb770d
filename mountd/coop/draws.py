"""How a chunk's membership is drawn (:meth:`mountd.coop.chunks.ChunkManager.plan_next`):
the readers' needs as 0/1 masks over the compact ids, and the draw itself.

Chunks are drawn, not fixed (docs/substitutable-reads.md "Random order across epochs"): when
a chunk is planned, its files are drawn at random from the free chunks, the files every
reader still needs first. Apart from the manager's lifecycle because it is a different
concern (randomness and speed, not states): the draw runs on mountd's trio thread over up
to a whole dataset's free files, so every pass over them is at C speed (masks through big
integers and ``bytes.translate``, ``compress``, ``random`` bytes), and the Python work is
O(chunk).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from itertools import compress

from mountd.coop.plans import ChunkPlan

__all__ = [
    "INVERT",
    "NEEDED_BY_ALL",
    "NEEDED_BY_NONE",
    "NEEDED_BY_REQUESTER",
    "NEEDED_BY_SOME",
    "Needs",
    "draw",
]

#: How much the readers want a file, as the ``demand`` callback of
#: :class:`~mountd.coop.chunks.ChunkManager` rates it when a chunk is drawn: every reader still
#: has to read it in its epoch; the reader asking for the chunk has; some reader has; none has.
NEEDED_BY_ALL = 3
NEEDED_BY_REQUESTER = 2
NEEDED_BY_SOME = 1
NEEDED_BY_NONE = 0


@dataclass(frozen=True, slots=True)
class Needs:
    """Which files the readers still need in their epochs, as byte masks over the compact ids
    (1: needed), for :func:`draw` to rate files without a call per file.

    ``by_all``: every reader still needs it (:data:`NEEDED_BY_ALL`); ``by_requester``: the
    reader asking for the chunk needs it (None when the asker is not a reader); ``by_some``:
    at least one reader needs it. A file in none of them is :data:`NEEDED_BY_NONE`.
    """

    by_all: bytes
    by_requester: bytes | None
    by_some: bytes

    def rate(self, ids: Iterable[int]) -> int:
        """The rating of a unit of ``ids`` (a packed chunk): its most needed member's."""
        ids = list(ids)
        if any(map(self.by_all.__getitem__, ids)):
            return NEEDED_BY_ALL
        if self.by_requester is not None and any(map(self.by_requester.__getitem__, ids)):
            return NEEDED_BY_REQUESTER
        return NEEDED_BY_SOME if any(map(self.by_some.__getitem__, ids)) else NEEDED_BY_NONE



#: ``bytes.translate`` table that swaps 0 and 1: the complement of a 0/1 mask.
INVERT = bytes.maketrans(b"\x00\x01", b"\x01\x00")

#: Files :func:`_fill` looks at to estimate which share of a pool is eligible.
_SHARE_SAMPLE = 4096

#: ``_BELOW[t]``: the ``bytes.translate`` table that maps a byte below ``t`` to 1, others
#: to 0 (random bytes through it: a Bernoulli mask with probability ``t / 256``).
_BELOW = [bytes(int(b < t) for b in range(256)) for t in range(257)]


def _mask_or(a: bytes, b: bytes) -> bytes:
    """The 0/1 mask ``a or b`` (C speed through big integers)."""
    x = int.from_bytes(a, "little") | int.from_bytes(b, "little")
    return x.to_bytes(len(a), "little")


def _mask_and_not(a: bytes, b: bytes) -> bytes:
    """The 0/1 mask ``a and not b`` (C speed through big integers: ~1 ms per million files)."""
    n = len(a)
    x = int.from_bytes(a, "little") & ~int.from_bytes(b, "little")
    return x.to_bytes(n, "little")


def draw(
    plan: ChunkPlan, rng: random.Random, units: Sequence[int], needs: Needs | None
) -> list[int]:
    """The units (files, or packed chunks of a packed plan) a chunk drawn from ``units``
    (the free chunks' units, :meth:`ChunkPlan.units_in_chunks`) takes, up to
    ``plan.target_bytes``: those every reader needs (``needs``; None: every unit is) in
    uniformly random order, then the others as
    :meth:`~mountd.coop.chunks.ChunkManager.plan_next` describes."""
    if plan.packing is None:
        return _draw_files(plan, rng, units, needs)
    return _draw_units(plan, rng, units, needs)


def _draw_files(
    plan: ChunkPlan, rng: random.Random, units: Sequence[int], needs: Needs | None
) -> list[int]:
    """:func:`draw` for a loose plan: ``units`` are the free files."""
    if needs is None:
        return _fill(plan, rng, units, None, [], 0)[0]
    taken, got = _fill(plan, rng, units, needs.by_all, [], 0)
    if got is None:
        return taken
    tiers = [needs.by_requester] if needs.by_requester is not None else []
    tiers.append(needs.by_some)
    seen = needs.by_all
    for mask in tiers:
        fresh = _mask_and_not(mask, seen)
        taken, got = _fill(plan, rng, units, fresh, taken, got)
        if got is None:
            return taken
        seen = _mask_or(seen, fresh)
    if not taken:  # files nobody needs, only when nothing else is left
        taken = _fill(plan, rng, units, needs.by_some.translate(INVERT), [], 0)[0]
    return taken


def _fill(
    plan: ChunkPlan, rng: random.Random, pool: Sequence[int], eligible: bytes | None,
    taken: list[int], got: int,
) -> tuple[list[int], int | None]:
    """Add a uniformly random subset of the files of ``pool`` that ``eligible`` marks
    (None: all) and that fits the chunk to ``taken``: ``(taken, bytes)``, bytes None
    once the chunk is full (files were left out for lack of room, or the target was
    reached), else the eligible files were used up.

    A Bernoulli pass keeps each file with a probability a little above what fits
    (random bytes and ``compress``: C speed over the pool), the eligible ones among
    those are kept, then random picks are dropped until the rest fits; a short pass goes
    again over the files it left. Every subset of a size is as likely as any other (the
    steps treat files alike), and the Python work is the overshoot, not the pool. A
    chunk holds at least one file, however large.
    """
    target = plan.target_bytes
    sizes = plan.file_bytes
    size_of: Callable[[int], int] = (lambda _i: 1) if sizes is None else sizes.__getitem__
    while pool:
        room = target - got
        n = len(pool)
        want = room / plan.mean_bytes
        expect = want * 1.02 + 3 * math.sqrt(want) + 16
        if eligible is not None:  # the eligible share, from a sample of the pool (its
            # lower 2-sigma bound: a pass that comes out short costs another pass)
            seen = sum(eligible[pool[rng.randrange(n)]] for _ in range(_SHARE_SAMPLE))
            expect *= _SHARE_SAMPLE / max(1.0, seen - 2 * math.sqrt(seen))
        if expect >= n:
            picks, rest = list(pool), []
        else:
            mask = rng.randbytes(n).translate(_BELOW[math.ceil(expect / n * 256)])
            picks = list(compress(pool, mask))
            rest = compress(pool, mask.translate(INVERT))
        if eligible is not None:
            picks = list(compress(picks, map(eligible.__getitem__, picks)))
        total = sum(map(size_of, picks))
        dropped = False
        while total > room and (taken or len(picks) > 1):
            j = rng.randrange(len(picks))
            picks[j], picks[-1] = picks[-1], picks[j]
            total -= size_of(picks.pop())
            dropped = True
        taken.extend(picks)
        got += total
        if dropped or got >= target:
            return taken, None
        pool = list(rest)
    return taken, got


def _draw_units(
    plan: ChunkPlan, rng: random.Random, units: Sequence[int], needs: Needs | None
) -> list[int]:
    """:func:`draw` for a packed plan: ``units`` are the free chunks' packed
    chunks (and loose files as units of one), walked in a lazy Fisher–Yates order."""
    target = plan.target_bytes
    units = list(units)
    taken: list[int] = []
    got = 0
    later: dict[int, list[int]] = {}

    def take(u: int) -> bool:
        """Take ``u`` if it fits; whether the chunk has room for more."""
        nonlocal got
        b = sum(plan.bytes_of(i) for i in plan.unit_ids(u))
        if taken and got + b > target:
            return False
        taken.append(u)
        got += b
        return got < target

    n = len(units)
    for k in range(n):
        j = rng.randrange(k, n)
        units[k], units[j] = units[j], units[k]
        rating = NEEDED_BY_ALL if needs is None else needs.rate(plan.unit_ids(units[k]))
        if rating >= NEEDED_BY_ALL:
            if not take(units[k]):
                break
        else:
            later.setdefault(rating, []).append(units[k])
    else:  # walked every free unit and the chunk is not full: top up
        tiers = [later.get(NEEDED_BY_REQUESTER, []) + later.get(NEEDED_BY_SOME, [])]
        tiers.append(later.get(NEEDED_BY_NONE, []))
        for tier in tiers:
            if taken and tier is tiers[-1]:
                break  # files nobody needs only when nothing else is left
            for u in tier:
                if not take(u):
                    break
    return taken
