"""The unread files of one job's current chunk, cached ones apart: :class:`UnreadSet`.

What makes a claim O(n), never O(N) (:mod:`mountd.coop.claims`): an
:class:`~mountd.coop.claims.EpochPool` keeps one for the chunk it reads, built when it enters
the chunk and kept current in O(1) per cache notification, and samples hits and misses from
it in O(1) each.
"""

from __future__ import annotations

import random
from array import array
from collections.abc import Iterator
from itertools import compress

from mountd.coop.draws import INVERT

__all__ = ["UnreadSet"]


class UnreadSet:
    """The unread files of one chunk, split into cached and uncached: O(1) everything.

    A sparse set (Briggs & Torczon) in two regions: ``_members[:_split]`` are the cached
    unread files, ``_members[_split:]`` the uncached ones; ``_pos[id]`` is an id's index in
    ``_members``, meaningful only when ``_members[_pos[id]] == id`` — so ``_pos`` needs no
    initialisation and both arrays start as memcpy copies of the plan's templates. Moving a file
    between regions or removing it is a swap; sampling a region is one ``randrange``.
    """

    __slots__ = ("_members", "_pos", "_split")

    def __init__(self, members: array, pos: array) -> None:
        """``members``: the set's ids (owned from now on); ``pos``: an index with
        ``pos[members[k]] == k`` for every ``k`` (owned too). Everything starts uncached."""
        self._members = members
        self._pos = pos
        self._split = 0

    @classmethod
    def from_mask(cls, ids: array, mask: bytes, capacity: int) -> UnreadSet:
        """``ids`` with ``mask[k]`` (0/1) telling whether ``ids[k]`` is cached: built in one
        pass, O(len(ids)) whatever the mix (ids < ``capacity``)."""
        members = array("i", compress(ids, mask))
        split = len(members)
        members.extend(compress(ids, mask.translate(INVERT)))
        pos = array("i", bytes(4 * capacity))
        for k, i in enumerate(members):
            pos[i] = k
        out = cls(members, pos)
        out._split = split
        return out

    def __len__(self) -> int:
        return len(self._members)

    def __contains__(self, file_id: int) -> bool:
        k = self._pos[file_id]
        return 0 <= k < len(self._members) and self._members[k] == file_id

    def __iter__(self) -> Iterator[int]:
        return iter(self._members)

    @property
    def cached(self) -> int:
        """How many members are cached."""
        return self._split

    def is_cached(self, file_id: int) -> bool:
        """Whether ``file_id`` is a member in the cached region."""
        return file_id in self and self._pos[file_id] < self._split

    def _swap(self, a: int, b: int) -> None:
        members, pos = self._members, self._pos
        x, y = members[a], members[b]
        members[a], members[b] = y, x
        pos[x], pos[y] = b, a

    def set_cached(self, file_id: int, cached: bool) -> None:
        """Move a member to the cached or uncached region (no-op for non-members)."""
        if file_id not in self:
            return
        k = self._pos[file_id]
        if cached and k >= self._split:
            self._swap(k, self._split)
            self._split += 1
        elif not cached and k < self._split:
            self._split -= 1
            self._swap(k, self._split)

    def set_all_cached(self) -> None:
        """Declare every member cached (then mark the exceptions uncached)."""
        self._split = len(self._members)

    def discard(self, file_id: int) -> None:
        """Remove ``file_id`` if it is a member (it was given out)."""
        if file_id not in self:
            return
        self.set_cached(file_id, False)
        self._swap(self._pos[file_id], len(self._members) - 1)
        self._members.pop()

    def uncached_members(self) -> array:
        """The uncached members (a copy)."""
        return self._members[self._split :]

    def sample_cached(self, rng: random.Random) -> int:
        """A uniformly random cached member (there must be one)."""
        return self._members[rng.randrange(self._split)]

    def sample_uncached(self, rng: random.Random) -> int:
        """A uniformly random uncached member (there must be one)."""
        return self._members[rng.randrange(self._split, len(self._members))]
