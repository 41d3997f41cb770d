"""How a dataset is cut into chunks: its residency mode and its :class:`ChunkPlan` (Quiver §5.1).

:func:`choose_mode` says whether a dataset of some size is kept whole, chunked or not
managed within a budget; :func:`plan_chunks` (striped partitions of a loose dataset) and
:func:`plan_packed_chunks` (unions of whole packed chunks, Brand) make the plan, whose
chunks :class:`mountd.coop.chunks.ChunkManager` then loads and evicts and re-draws as
epochs go (:mod:`mountd.coop.draws`). Pure: no I/O, no clock. Files are *compact ids*
``0..N-1`` in the digest's order; sizes are bytes per compact id.
"""

from __future__ import annotations

import enum
import math
import random
from array import array
from collections.abc import Callable, Iterable, Sequence
from itertools import filterfalse, groupby

from mountd.coop.brand import unit_members, units_in
from mountd.coop.packing import Packing

__all__ = [
    "DEFAULT_FRACTION",
    "MIN_FRACTION",
    "ChunkPlan",
    "Mode",
    "Moves",
    "choose_mode",
    "plan_chunks",
    "plan_packed_chunks",
]

#: Default chunk size as a fraction of the dataset (Quiver's 10%).
DEFAULT_FRACTION = 0.1
#: Below this fraction of the dataset per chunk, randomness within a chunk is too poor to train
#: on (Quiver §7.2 validates 10%); such a dataset is not chunked ("off").
MIN_FRACTION = 0.01

#: Files that changed chunk when free chunks were re-drawn: ``(old chunk, new chunk)`` -> the
#: ids that moved that way. Grouped so that a listener updates its per-chunk counts with one
#: C-speed count per pair (``sum(map(mask.__getitem__, ids))``), not a Python step per file:
#: a draw moves a whole chunk's worth of files (130,000 at 1.3M files and 10% chunks).
Moves = dict[tuple[int, int], list[int]]


class Mode(enum.StrEnum):
    """How mountd manages one dataset's residency in the cache."""

    #: The dataset fits the budget: no chunks; claims and misses range over the whole dataset.
    FULL = "full"
    #: Two chunks resident, co-ordinated eviction (:class:`mountd.coop.chunks.ChunkManager`).
    CHUNKED = "chunked"
    #: No chunk management; the cache's own policy (LRU) decides. Named for comparisons.
    LRU = "lru"
    #: Not managed (does not fit and chunks would be too small). Claims still prefer hits.
    OFF = "off"

    @property
    def holds_cache(self) -> bool:
        """Whether the mode keeps the dataset (``full``) or its chunks (``chunked``) cached
        for it: what the allocation charges, and where a job's later natural misses are
        prefetched or co-operative rather than fetches from the bucket."""
        return self in (Mode.FULL, Mode.CHUNKED)


def _chunk_bytes(
    total: int, budget: int, fraction: float, max_chunk_bytes: int | None, slots: int
) -> float:
    if slots not in (2, 3):
        raise ValueError("slots must be 2 or 3")
    bound = budget / slots if max_chunk_bytes is None else min(max_chunk_bytes, budget / slots)
    return min(fraction * total, bound)


def choose_mode(
    total_bytes: int,
    budget: int,
    *,
    fraction: float = DEFAULT_FRACTION,
    max_chunk_bytes: int | None = None,
    min_fraction: float = MIN_FRACTION,
    slots: int = 2,
) -> Mode:
    """The mode for a dataset of ``total_bytes`` given ``budget`` cache bytes for it.

    ``FULL`` when it fits; else ``CHUNKED`` when a chunk of ``min(fraction × total,
    max_chunk_bytes, budget / slots)`` bytes (``slots`` chunks must fit: 2, or 3 to preload
    the next chunk while the marked one drains) is still at least ``min_fraction`` of
    the dataset; else ``OFF``. Pure: a later, benefit-aware policy calls it with each dataset's
    share of the budget (Quiver §5.3).
    """
    if total_bytes < 0 or budget < 0:
        raise ValueError("sizes must be non-negative")
    if total_bytes <= budget:
        return Mode.FULL
    if budget == 0:
        return Mode.OFF
    chunk = _chunk_bytes(total_bytes, budget, fraction, max_chunk_bytes, slots)
    return Mode.CHUNKED if chunk >= min_fraction * total_bytes else Mode.OFF


class ChunkPlan:
    """Compact ids ``0..count-1`` split into ``chunks`` striped partitions (Quiver §5.1).

    The ids are cut into ``partitions × chunks`` contiguous *stripe units* of near-equal size
    (they differ by at most one file); partition ``p`` is units ``p·K .. p·K+K-1`` (a contiguous
    ``1/P`` of the dataset) and chunk ``c`` takes one unit of every partition, the one a seeded
    permutation of ``0..K-1`` deals it in that partition. So every chunk holds a contiguous run
    from each ``1/P`` of the id range (a stratified, uniform sample even when the digest order
    is sorted by, say, sequence length), runs stay contiguous for homogeneous mini-batches, and
    chunk sizes differ by at most ``P`` files.
    """

    def __init__(
        self, count: int, chunks: int = 1, *, partitions: int | None = None, seed: int = 0
    ) -> None:
        if count < 1:
            raise ValueError("a dataset has at least one file")
        if not 1 <= chunks <= count:
            raise ValueError(f"chunks must be in 1..{count}, got {chunks}")
        parts = chunks if partitions is None else partitions
        # A unit holds at least one file where possible.
        self.partitions = max(1, min(parts, count // chunks))
        self.count = count
        self.chunks = chunks
        self.seed = seed
        #: The packed chunks (remote objects) every plan chunk is a union of: see
        #: :meth:`from_groups`; None for a striped plan.
        self.packing: Packing | None = None
        #: Bytes per id (None: every file counts 1) and the most bytes a chunk drawn by
        #: :meth:`mountd.coop.chunks.ChunkManager.plan_next` may hold: see :meth:`set_sizes`.
        self.file_bytes: array | None = None
        self.target_bytes = 0
        #: Mean bytes per id (1 without sizes): how many files a draw samples at once.
        self.mean_bytes = 1.0
        units = self.partitions * chunks
        rng = random.Random(f"chunks:{seed}:{count}:{chunks}")
        ranges: list[list[tuple[int, int]]] = [[] for _ in range(chunks)]
        for p in range(self.partitions):
            deal = list(range(chunks))
            if chunks > 1:
                rng.shuffle(deal)
            for j, c in enumerate(deal):
                u = p * chunks + j
                ranges[c].append((u * count // units, (u + 1) * count // units))
        self._build(ranges)
        self.target_bytes = max(self._sizes)

    @classmethod
    def from_groups(
        cls, count: int, groups: Sequence[Iterable[int]], *, seed: int = 0,
        packing: Packing | None = None,
    ) -> ChunkPlan:
        """A plan whose chunk ``c`` is exactly the ids of ``groups[c]`` (a partition of
        ``0..count-1`` into non-empty groups): the plan of a packed dataset, whose chunks
        are unions of whole packed chunks (:func:`plan_packed_chunks`),
        with that ``packing`` kept so that preloads go a packed chunk at a time."""
        if count < 1:
            raise ValueError("a dataset has at least one file")
        chunk_of = array("i", [-1]) * count
        index = array("i", bytes(4 * count))
        ranges: list[list[tuple[int, int]]] = []
        templates: list[array] = []
        for c, group in enumerate(groups):
            ids = array("i", sorted(group))
            if not ids:
                raise ValueError("a chunk holds at least one file")
            if ids[0] < 0 or ids[-1] >= count:
                raise ValueError(f"ids must be in 0..{count - 1}")
            runs: list[tuple[int, int]] = []
            start = prev = ids[0]
            for k, i in enumerate(ids):
                if chunk_of[i] >= 0:
                    raise ValueError(f"id {i} is in two groups")
                chunk_of[i] = c
                index[i] = k
                if i > prev + 1:  # coalesce runs of consecutive ids
                    runs.append((start, prev + 1))
                    start = i
                prev = i
            runs.append((start, prev + 1))
            ranges.append(runs)
            templates.append(ids)
        if -1 in chunk_of:
            raise ValueError(f"the groups must partition 0..{count - 1}")
        plan = cls.__new__(cls)
        plan.count, plan.chunks, plan.seed = count, len(ranges), seed
        plan.partitions = 1
        plan.packing = packing
        plan._ranges, plan._chunk_of, plan._index, plan._ids = ranges, chunk_of, index, templates
        plan._sizes = [len(ids) for ids in templates]
        plan.file_bytes = None
        plan.mean_bytes = 1.0
        plan.target_bytes = max(plan._sizes)
        return plan

    def set_sizes(self, sizes: Sequence[int]) -> None:
        """Give the files' bytes: chunks drawn later hold at most as many bytes as the
        largest chunk of this plan (which the planner fitted to ``budget / slots``)."""
        if len(sizes) != self.count:
            raise ValueError(f"{len(sizes)} sizes for {self.count} files")
        self.file_bytes = array("q", sizes)
        self.mean_bytes = max(1.0, sum(self.file_bytes) / self.count)
        self.target_bytes = max(self.chunk_bytes(c) for c in range(self.chunks))

    def bytes_of(self, file_id: int) -> int:
        """Bytes of ``file_id`` (1 when the plan has no sizes)."""
        return 1 if self.file_bytes is None else self.file_bytes[file_id]

    def chunk_bytes(self, chunk: int) -> int:
        """Bytes of ``chunk`` (its file count when the plan has no sizes)."""
        if self.file_bytes is None:
            return self._sizes[chunk]
        return sum(map(self.file_bytes.__getitem__, self._ids[chunk]))

    def units_in_chunks(self, chunks: Iterable[int]) -> Sequence[int]:
        """The draw units of ``chunks`` together (for a loose plan one memcpy per chunk)."""
        if self.packing is None:
            out = array("i")
            for c in chunks:
                out.extend(self._ids[c])
            return out
        return [u for c in chunks for u in self.units_of(c)]

    def units_of(self, chunk: int) -> list[int]:
        """The draw units of ``chunk``: its ids, or for a packed plan its packed chunks
        (and loose files as units of one, :mod:`mountd.coop.brand`), which move whole."""
        if self.packing is None:
            return list(self._ids[chunk])
        return units_in(self.packing, self._ids[chunk])

    def unit_ids(self, unit: int) -> Sequence[int]:
        """The ids of draw unit ``unit`` (see :meth:`units_of`)."""
        return (unit,) if self.packing is None else unit_members(self.packing, unit)

    def count_in(self, chunk: int, bitmap: bytes | bytearray) -> int:
        """How many ids of ``chunk`` are set (1) in ``bitmap`` (C speed)."""
        return sum(map(bitmap.__getitem__, self._ids[chunk]))

    def reassign(self, groups: dict[int, Iterable[int]]) -> Moves:
        """Give each chunk ``c`` of ``groups`` exactly the ids ``groups[c]``; the groups must
        partition the ids those chunks hold now (files move between them, none enters or
        leaves). Returns the :data:`Moves`. How a packed plan's chunks are re-drawn every
        time one is planned (:meth:`mountd.coop.chunks.ChunkManager.plan_next`)."""
        new = {c: array("i", sorted(ids)) for c, ids in groups.items()}
        before = sorted(i for c in new for i in self._ids[c])
        after = sorted(i for ids in new.values() for i in ids)
        if before != after:
            raise ValueError("a reassignment must partition the ids its chunks hold")
        moves: Moves = {}
        chunk_of = self._chunk_of
        for c, ids in new.items():
            for i in ids:
                if chunk_of[i] != c:
                    moves.setdefault((chunk_of[i], c), []).append(i)
        for c, ids in new.items():
            self._set_chunk(c, ids)
        return moves

    def move_into(self, chunk: int, ids: Sequence[int], spill: Sequence[int]) -> Moves:
        """Loose plans: ``chunk`` holds exactly ``ids`` (its own files or files of the
        ``spill`` chunks) from now on; each file it gives up takes the place of one it drew,
        in that file's chunk, and the rest go to the smallest ``spill`` chunk. O(len(ids))
        array stores (swaps), where :meth:`reassign` rebuilds every chunk it touches; the
        set work is C speed. Returns the :data:`Moves`."""
        if self.packing is not None:
            raise ValueError("move_into moves single files: use reassign for a packed plan")
        chunk_of, index, templates = self._chunk_of, self._index, self._ids
        wanted = set(ids)
        out = list(filterfalse(wanted.__contains__, templates[chunk]))
        incoming = list(filterfalse(set(templates[chunk]).__contains__, ids))
        if not spill:
            if incoming:
                raise ValueError("files can only come from the spill chunks")
            return {}
        spill_set = set(spill)
        moves: Moves = {}
        incoming.sort(key=chunk_of.__getitem__)  # grouped by donor chunk
        given_up = 0
        for d, members in groupby(incoming, key=chunk_of.__getitem__):
            if d not in spill_set:
                raise ValueError(f"a file is in chunk {d}, not a spill chunk")
            drawn = moves[d, chunk] = list(members)
            back = out[given_up:given_up + len(drawn)]
            given_up += len(back)
            if back:
                moves[chunk, d] = back
            arr = templates[d]
            for i, v in zip(drawn, back, strict=False):  # the file given up takes its place
                pos = index[i]
                arr[pos] = v
                index[v] = pos
                chunk_of[v] = d
            for i in drawn[len(back):]:  # drew more than it gives up: d's last file fills in
                last = arr.pop()
                if last != i:
                    pos = index[i]
                    arr[pos] = last
                    index[last] = pos
            self._sizes[d] = len(arr)
            self._ranges[d] = None
        for v in out[given_up:]:  # gives up more than it drew
            d = min(spill, key=lambda c: len(templates[c]))
            index[v], chunk_of[v] = len(templates[d]), d
            templates[d].append(v)
            moves.setdefault((chunk, d), []).append(v)
            self._sizes[d] = len(templates[d])
            self._ranges[d] = None
        self._set_chunk(chunk, array("i", sorted(wanted)))
        return moves

    def _set_chunk(self, chunk: int, ids: array) -> None:
        """``chunk`` holds exactly ``ids`` (increasing) now: templates, index, runs."""
        chunk_of, index = self._chunk_of, self._index
        for k, i in enumerate(ids):
            chunk_of[i] = chunk
            index[i] = k
        self._ids[chunk] = ids
        self._ranges[chunk] = None  # computed when asked (ranges_of)
        self._sizes[chunk] = len(ids)

    def _build(self, ranges: list[list[tuple[int, int]]]) -> None:
        """Index the chunks' id ranges: chunk of each id, sizes, the per-chunk templates."""
        count = self.count
        self._ranges = ranges
        self._chunk_of = array("i", bytes(4 * count))
        for c, r in enumerate(ranges):
            r.sort()
            if c:
                for start, stop in r:
                    self._chunk_of[start:stop] = array("i", [c]) * (stop - start)
        self._sizes = [sum(b - a for a, b in r) for r in ranges]
        # Built once per plan, copied (memcpy) whenever a job enters a chunk: the chunk's ids
        # in order, and each id's index in its chunk's list.
        self._ids = []
        self._index = array("i", bytes(4 * count))
        for r in ranges:
            ids = array("i")
            for start, stop in r:
                self._index[start:stop] = array("i", range(len(ids), len(ids) + stop - start))
                ids.extend(range(start, stop))
            self._ids.append(ids)

    @classmethod
    def whole(cls, count: int) -> ChunkPlan:
        """One chunk holding the whole dataset (modes full, lru, off)."""
        return cls(count, 1)

    def chunk_of(self, file_id: int) -> int:
        """The chunk holding ``file_id``."""
        return self._chunk_of[file_id]

    def size_of(self, chunk: int) -> int:
        """Files in ``chunk``."""
        return self._sizes[chunk]

    def ranges_of(self, chunk: int) -> list[tuple[int, int]]:
        """``chunk``'s ids as ``[start, stop)`` runs of consecutive ids, in id order (its
        stripe units until it is re-drawn)."""
        runs = self._ranges[chunk]
        if runs is None:
            runs = self._ranges[chunk] = _runs(sorted(self._ids[chunk]))
        return list(runs)

    def ids_of(self, chunk: int) -> array:
        """``chunk``'s ids: a new ``array('i')`` (a memcpy); in increasing order until the
        chunk is re-drawn or gives files to a re-drawn one (then in no particular order)."""
        return self._ids[chunk][:]

    def index_in_chunk(self) -> array:
        """A new ``array('i')``: for each id, its index in ``ids_of(chunk_of(id))``."""
        return self._index[:]

    def preload_order(
        self, chunk: int, rng: random.Random, wanted: Callable[[int], bool]
    ) -> list[int]:
        """The ``wanted`` ids of ``chunk`` in the order a preload fetches them: random (a
        partly done preload is a random subset of the chunk), a packed chunk at a time for
        a packed plan (its members together, in offset order: one ranged GET each)."""
        if self.packing is None:
            ids = [i for i in self._ids[chunk] if wanted(i)]
            rng.shuffle(ids)
            return ids
        units = units_in(self.packing, self._ids[chunk])
        rng.shuffle(units)
        return [i for u in units for i in unit_members(self.packing, u) if wanted(i)]


def _runs(ids: Sequence[int]) -> list[tuple[int, int]]:
    """Increasing ``ids`` as ``[start, stop)`` runs of consecutive ids."""
    runs: list[tuple[int, int]] = []
    for i in ids:
        if runs and runs[-1][1] == i:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs


def plan_chunks(
    sizes: Sequence[int],
    budget: int,
    *,
    fraction: float = DEFAULT_FRACTION,
    max_chunk_bytes: int | None = None,
    partitions: int | None = None,
    seed: int = 0,
    slots: int = 2,
) -> ChunkPlan:
    """A striped :class:`ChunkPlan` whose chunks (in bytes) fit twice in ``budget``.

    The target chunk is ``min(fraction × total, max_chunk_bytes, budget / slots)`` bytes; the count
    of chunks grows until the largest actual chunk (file sizes vary) is within the target, and
    is at least 3 so that the next chunk to load is never the marked one.
    """
    total = sum(sizes)
    target = max(1.0, _chunk_bytes(total, budget, fraction, max_chunk_bytes, slots))
    n = len(sizes)
    k = min(n, max(3, math.ceil(total / target)))
    while True:
        plan = ChunkPlan(n, k, partitions=partitions, seed=seed)
        biggest = max(
            sum(sum(sizes[a:b]) for a, b in plan.ranges_of(c)) for c in range(plan.chunks)
        )
        if biggest <= target or k >= n:
            plan.set_sizes(sizes)
            return plan
        k = min(n, max(k + 1, math.ceil(k * biggest / target)))


def plan_packed_chunks(
    sizes: Sequence[int],
    packing: Packing,
    budget: int,
    *,
    fraction: float = DEFAULT_FRACTION,
    max_chunk_bytes: int | None = None,
    seed: int = 0,
    slots: int = 2,
) -> ChunkPlan:
    """The :class:`ChunkPlan` of a packed dataset: every chunk a union of whole packed chunks.

    Brand's mapping (../shared/papers/brand-batched-random-access.txt §3.2) made a Quiver
    budget: the *units* (packed chunks, and loose files as units of one) are shuffled with
    a seeded generator and the shuffled sequence is cut into ``K`` runs of near-equal bytes,
    so a chunk's preload is a set of whole packed chunks (one ranged GET each) and every
    chunk is a uniform random sample of the dataset at packed-chunk granularity (a uniform
    sample of files too when the packing itself was shuffled, as ``digests pack`` does:
    Brand §4). ``K`` is chosen as :func:`plan_chunks` does (at least 3, grown until the
    largest chunk fits ``min(fraction × total, max_chunk_bytes, budget / slots)``); a
    chunk exceeds the byte average by less than one unit.
    """
    n = len(sizes)
    if len(packing.chunk_of) != n:
        raise ValueError(f"the packing covers {len(packing.chunk_of)} files, the dataset {n}")
    units = list(range(packing.chunks)) + [~i for i, c in enumerate(packing.chunk_of) if c < 0]
    unit_bytes = [sum(sizes[i] for i in unit_members(packing, u)) for u in units]
    order = list(range(len(units)))
    random.Random(f"packed-chunks:{seed}:{n}:{len(units)}").shuffle(order)
    total = sum(unit_bytes)
    target = max(1.0, _chunk_bytes(total, budget, fraction, max_chunk_bytes, slots))
    k = min(len(units), max(3, math.ceil(total / target)))
    while True:
        groups = _cut(order, unit_bytes, k)
        biggest = max(sum(unit_bytes[j] for j in g) for g in groups)
        if biggest <= target or k >= len(units):
            break
        k = min(len(units), max(k + 1, math.ceil(k * biggest / target)))
    members = [[i for j in g for i in unit_members(packing, units[j])] for g in groups]
    plan = ChunkPlan.from_groups(n, members, seed=seed, packing=packing)
    plan.set_sizes(sizes)
    return plan


def _cut(order: list[int], unit_bytes: list[int], k: int) -> list[list[int]]:
    """``order`` cut into ``k`` non-empty runs of near-equal bytes: a unit goes to the run
    its bytes' midpoint falls in, each run holding at least one unit."""
    total = sum(unit_bytes) or 1
    groups: list[list[int]] = [[] for _ in range(k)]
    c, done = 0, 0
    for j, u in enumerate(order):
        b = unit_bytes[u]
        if groups[c] and c < k - 1 and (
            (done + b / 2) * k >= (c + 1) * total or len(order) - j <= k - 1 - c
        ):
            c += 1
        groups[c].append(u)
        done += b
    return groups
