"""Dataset chunks and their lifecycle: striped partitions and co-ordinated eviction (Quiver §5.1).

A dataset that does not fit the cache is split into ``K`` chunks, each a uniform sample of the
dataset, and the cache holds two of them: jobs read the *current* chunk while the *next* one
loads in the background; the older chunk is *marked* once the next is fully loaded and evicted
``grace`` seconds after the last job that referenced it finished it (a job reads the files it
was given up to a look-ahead window later), or a configurable time after the first job
finished it (a straggler must not block the third chunk for ever). docs/substitutable-reads.md
draws the state machine.

Everything here is pure decision logic. :class:`ChunkManager` never does I/O: :meth:`tick`
returns :data:`Action` values (:class:`Preload`, :class:`Evict`, :class:`ChunkReady`) and the
caller performs them, then reports the outcome through :meth:`ChunkManager.on_cached` /
:meth:`on_evicted` / :meth:`on_failed`. Files are *compact ids* ``0..N-1`` in the digest's
order; sizes are bytes per compact id. All methods run in one thread (mountd's trio thread):
code between two calls is atomic.
"""

from __future__ import annotations

import enum
import math
import random
from array import array
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from itertools import compress, filterfalse, groupby

from mountd.coop.brand import unit_members, units_in
from mountd.coop.packing import Packing

__all__ = [
    "Action",
    "ChunkManager",
    "ChunkPlan",
    "ChunkReady",
    "ChunkState",
    "DEFAULT_GRACE",
    "Evict",
    "INVERT",
    "NEEDED_BY_ALL",
    "NEEDED_BY_NONE",
    "NEEDED_BY_REQUESTER",
    "NEEDED_BY_SOME",
    "Mode",
    "Moves",
    "Needs",
    "Preload",
    "choose_mode",
    "plan_chunks",
    "plan_packed_chunks",
]

#: Default chunk size as a fraction of the dataset (Quiver's 10%).
DEFAULT_FRACTION = 0.1
#: Seconds a marked chunk stays after its last holder finished it (:class:`ChunkManager`'s
#: ``grace``; docs/substitutable-reads.md, "Grace"). Set by measurement (docs/benchmarks.md).
DEFAULT_GRACE = 1.0
#: Below this fraction of the dataset per chunk, randomness within a chunk is too poor to train
#: on (Quiver §7.2 validates 10%); such a dataset is not chunked ("off").
MIN_FRACTION = 0.01

#: How much the readers want a file, as the ``demand`` callback of :class:`ChunkManager`
#: rates it when a chunk is drawn (:meth:`ChunkManager.plan_next`): every reader still has to
#: read it in its epoch; the reader asking for the chunk has; some reader has; none has.
NEEDED_BY_ALL = 3
NEEDED_BY_REQUESTER = 2
NEEDED_BY_SOME = 1
NEEDED_BY_NONE = 0

#: Files that changed chunk when free chunks were re-drawn: ``(old chunk, new chunk)`` -> the
#: ids that moved that way. Grouped so that a listener updates its per-chunk counts with one
#: C-speed count per pair (``sum(map(mask.__getitem__, ids))``), not a Python step per file:
#: a draw moves a whole chunk's worth of files (130,000 at 1.3M files and 10% chunks).
Moves = dict[tuple[int, int], list[int]]


@dataclass(frozen=True, slots=True)
class Needs:
    """Which files the readers still need in their epochs, as byte masks over the compact ids
    (1: needed), for :meth:`ChunkManager.plan_next` to rate files without a call per file.

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


#: Files :meth:`ChunkManager._fill` looks at to estimate which share of a pool is eligible.
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


class Mode(enum.StrEnum):
    """How mountd manages one dataset's residency in the cache."""

    #: The dataset fits the budget: no chunks; claims and misses range over the whole dataset.
    FULL = "full"
    #: Two chunks resident, co-ordinated eviction (:class:`ChunkManager`).
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
        #: :meth:`ChunkManager.plan_next` may hold: see :meth:`set_sizes`.
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
        are unions of whole packed chunks (:func:`mountd.coop.brand.plan_packed_chunks`),
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
        time one is planned (:meth:`ChunkManager.plan_next`)."""
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


class ChunkState(enum.StrEnum):
    """Where one chunk is in its lifecycle."""

    IDLE = "idle"  # not resident (never loaded, or evicted)
    LOADING = "loading"  # the next chunk: preload in progress
    LOADED = "loaded"  # resident; the newest loaded chunk is the one new jobs start on
    MARKED = "marked"  # resident, marked for eviction: a newer chunk is fully loaded

    @property
    def pinned(self) -> bool:
        """Whether mountd keeps the chunk's files pinned in the cache: loading or resident
        (:class:`mountd.coop.service.CoopService` pins them as they land)."""
        return self in (ChunkState.LOADING, ChunkState.LOADED, ChunkState.MARKED)


@dataclass(frozen=True)
class Preload:
    """Start loading ``chunk``: fetch ``ids`` (its uncached files, random order) in background."""

    dataset: str
    chunk: int
    ids: tuple[int, ...]


@dataclass(frozen=True)
class ChunkReady:
    """``chunk`` is fully loaded (cached or failed): new jobs now start on it."""

    dataset: str
    chunk: int


@dataclass(frozen=True)
class Evict:
    """Evict ``chunk``: remove ``ids`` (its files cached now) unless other datasets hold them.

    ``forced`` when the timeout after the first finished job expired with jobs still on it.
    ``members``: every file the chunk held when it was evicted (cached or not); the chunk
    may be re-drawn at once (:meth:`ChunkManager.plan_next`), so read this, not the plan.
    """

    dataset: str
    chunk: int
    ids: tuple[int, ...]
    forced: bool = False
    members: tuple[int, ...] = field(default=(), compare=False)


Action = Preload | ChunkReady | Evict


@dataclass
class _Chunk:
    state: ChunkState = ChunkState.IDLE
    cached: int = 0  # files of this chunk in the cache now
    failed: set[int] = field(default_factory=set)  # preload failures while loading
    refs: set[object] = field(default_factory=set)  # holders reading it, not finished yet
    first_done: float | None = None  # when the first holder finished it (this residency)
    last_done: float | None = None  # when a holder last finished it (this residency)


class ChunkManager:
    """The chunk lifecycle of one chunked dataset; decisions come back from :meth:`tick`.

    *Holders* are the readers of the dataset: any hashable object, in practice one per job and
    epoch (:class:`mountd.coop.claims.EpochPool`). A holder :meth:`attach`\\ es, :meth:`reference`\\ s
    the chunk it reads, reports :meth:`finished` when it has been given every file of it, and
    :meth:`detach`\\ es when it goes away (which releases its references).

    ``grace``: seconds a marked chunk stays resident after its last holder finished it, so
    that the files a job was given last are still cached when it reads them (its sampler and
    DataLoader read up to a window behind its claims); the chunk stays MARKED meanwhile and
    the next preload waits. ``evict_timeout`` still forces the eviction that long after the
    *first* holder finished it, grace or not.

    **Chunks are drawn, not fixed** (docs/substitutable-reads.md "Random order across
    epochs"). The plan's chunks are containers: a chunk's membership is drawn afresh when it
    is *planned* (:meth:`plan_next`: to be loaded next, or because a reader ran out of
    chunks), uniformly at random among the files of the *free* chunks (idle, not planned, no
    reader on them: nothing resident or referenced ever moves), preferring the files every
    reader still needs in its epoch (``demand``), then those the asking reader needs, then
    those any reader needs; files nobody needs are drawn only when nothing else is left.
    Chunks load in the order they were planned; each planning has a *generation* number
    (:meth:`generation`), which readers use to move only forward. ``on_moved`` is told every
    file that changed chunk (``(id, old, new)``), for the readers' per-chunk counts.

    Invariants (checked by tests): at most two chunks resident (LOADED or MARKED), at most one
    LOADING, and resident + loading <= ``slots``. ``slots=2`` is the paper's double buffering:
    the third chunk loads once the marked one is evicted. ``slots=3`` (a budget of three
    chunks) preloads it while the marked one drains; a loaded chunk then waits, still counted
    as loading, until no chunk is marked, so that at most two are ever resident.
    """

    def __init__(
        self,
        dataset: str,
        plan: ChunkPlan,
        is_cached: Callable[[int], bool],
        *,
        evict_timeout: float = 600.0,
        grace: float = DEFAULT_GRACE,
        seed: int = 0,
        slots: int = 2,
        demand: Callable[[object | None], Needs] | None = None,
        on_moved: Callable[[Moves], None] | None = None,
    ) -> None:
        if plan.chunks < 3:
            raise ValueError("a chunked dataset needs at least 3 chunks")
        if evict_timeout < 0:
            raise ValueError("evict_timeout must be >= 0")
        if not grace >= 0:  # also refuses NaN
            raise ValueError("grace must be >= 0")
        if slots not in (2, 3):
            raise ValueError("slots must be 2 or 3")
        self.slots = slots
        self.dataset = dataset
        self.plan = plan
        self.evict_timeout = evict_timeout
        self.grace = grace
        self._is_cached = is_cached
        self._rng = random.Random(f"preload:{dataset}:{seed}")
        self._draw_rng = random.Random(f"draw:{dataset}:{seed}")
        self._demand = demand
        self._on_moved = on_moved
        self._chunks = [_Chunk() for _ in range(plan.chunks)]
        #: Generation of each chunk's current membership (0: never planned).
        self._gen = [0] * plan.chunks
        self._generations = 0
        #: Chunks planned (membership drawn, frozen) and not loading yet, in load order.
        self.planned: list[int] = []
        self._last_planned = -1
        self._holders: set[object] = set()
        self.loading: int | None = None
        self._order: list[int] = []  # the loading chunk's uncached ids, shuffled
        self._cursor = 0  # next_preload's position in _order
        #: The newest fully loaded chunk (None before the first one is loaded).
        self.newest: int | None = None
        #: A reader entered or finished a chunk since the newest became the newest.
        self._read_since_ready = False
        for file_id in range(plan.count):
            if is_cached(file_id):
                self._chunks[plan.chunk_of(file_id)].cached += 1

    # -- queries ---------------------------------------------------------------------------

    def state(self, chunk: int) -> ChunkState:
        """``chunk``'s lifecycle state."""
        return self._chunks[chunk].state

    def states(self) -> list[ChunkState]:
        """Every chunk's state, by chunk index."""
        return [c.state for c in self._chunks]

    def resident(self) -> list[int]:
        """Chunks LOADED or MARKED."""
        return [i for i, c in enumerate(self._chunks) if c.state in _RESIDENT]

    def cached_count(self, chunk: int) -> int:
        """Files of ``chunk`` cached now (as reported)."""
        return self._chunks[chunk].cached

    def refs(self, chunk: int) -> frozenset[object]:
        """Holders that referenced ``chunk`` and have not finished it."""
        return frozenset(self._chunks[chunk].refs)

    def entry_chunk(self) -> int:
        """The chunk a new reader starts on: the newest loaded, else the loading one, else the
        next to load (Quiver: "all new jobs will now get hits only from the latest chunk")."""
        if self.newest is not None:
            return self.newest
        if self.loading is not None:
            return self.loading
        return self._next_to_load()

    def generation(self, chunk: int) -> int:
        """When ``chunk``'s membership was drawn: plannings are numbered 1, 2, … (0: never);
        chunks load in generation order."""
        return self._gen[chunk]

    @property
    def generations(self) -> int:
        """Plannings so far: the generation of the newest drawn chunk (0: none yet)."""
        return self._generations

    def is_free(self, chunk: int) -> bool:
        """Whether ``chunk`` may be re-drawn: idle, not planned, no reader on it."""
        c = self._chunks[chunk]
        return c.state is ChunkState.IDLE and not c.refs and chunk not in self.planned

    def held(self) -> list[int]:
        """The chunks that are not free (planned, loading, resident, or read), oldest
        generation first."""
        return sorted((c for c in range(self.plan.chunks) if not self.is_free(c)),
                      key=self._gen.__getitem__)

    def plan_next(self, requester: object | None = None) -> int | None:
        """Draw the membership of a free chunk and queue it to load next; the chunk, or None
        when no chunk is free.

        The draw takes the free chunks' units (files, or whole packed chunks of a packed
        plan) in uniformly random order among those every reader still needs
        (:data:`NEEDED_BY_ALL` in ``demand``'s :class:`Needs`) until the chunk holds
        ``plan.target_bytes`` (it stops at the first unit that does not fit); if they run
        out first, it tops up with the units the asking reader needs
        (:data:`NEEDED_BY_REQUESTER`), then those some reader needs (:data:`NEEDED_BY_SOME`),
        each in random order, and with :data:`NEEDED_BY_NONE` ones only when nothing else
        was taken. The chosen container keeps the drawn units; the units it held go to the
        free chunks the drawn ones came from (so chunk sizes stay near the plan's). No
        position is preferred: which files land together is decided afresh at each
        planning, so a file is as likely to be early in an epoch as late, whatever it was
        before.

        Cost: this runs on mountd's trio thread, so every step over the free files is a
        C-speed pass (masks, ``compress``, one ``random.sample``); the Python work is
        O(chunk). About 0.1 s for a 130,000-file chunk of a 1.3M-file dataset.
        """
        plan = self.plan
        free = [c for c in range(plan.chunks) if self.is_free(c)]
        if not free:
            return None
        needs = self._demand(requester) if self._demand is not None else None
        units = plan.units_in_chunks(free)
        if plan.packing is None:
            taken = self._draw_files(units, needs)
        else:
            taken = self._draw_units(units, needs)
        # The container: the next free one after the last planned, cyclically (its index
        # means nothing: the membership is what was drawn).
        last = self.planned[-1] if self.planned else self._last_planned
        chunk = min(free, key=lambda c: (c - last - 1) % plan.chunks)
        self._last_planned = chunk
        self._reassign(chunk, free, taken)
        self._generations += 1
        self._gen[chunk] = self._generations
        self.planned.append(chunk)
        return chunk

    def _draw_files(self, units: Sequence[int], needs: Needs | None) -> list[int]:
        """:meth:`plan_next`'s draw for a loose plan: ``units`` are the free files."""
        if needs is None:
            return self._fill(units, None, [], 0)[0]
        taken, got = self._fill(units, needs.by_all, [], 0)
        if got is None:
            return taken
        tiers = [needs.by_requester] if needs.by_requester is not None else []
        tiers.append(needs.by_some)
        seen = needs.by_all
        for mask in tiers:
            fresh = _mask_and_not(mask, seen)
            taken, got = self._fill(units, fresh, taken, got)
            if got is None:
                return taken
            seen = _mask_or(seen, fresh)
        if not taken:  # files nobody needs, only when nothing else is left
            taken = self._fill(units, needs.by_some.translate(INVERT), [], 0)[0]
        return taken

    def _fill(
        self, pool: Sequence[int], eligible: bytes | None, taken: list[int], got: int
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
        plan, rng, target = self.plan, self._draw_rng, self.plan.target_bytes
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

    def _draw_units(self, units: Sequence[int], needs: Needs | None) -> list[int]:
        """:meth:`plan_next`'s draw for a packed plan: ``units`` are the free chunks' packed
        chunks (and loose files as units of one), walked in a lazy Fisher–Yates order."""
        plan, rng, target = self.plan, self._draw_rng, self.plan.target_bytes
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

    def _reassign(self, chunk: int, free: list[int], taken: list[int]) -> None:
        """``chunk`` gets the ``taken`` units; the units it gives up fill the places they
        left in the other free chunks (extra ones go to the smallest)."""
        plan = self.plan
        if not taken:
            return
        others = [d for d in free if d != chunk]
        if plan.packing is None:
            self._moved(plan.move_into(chunk, taken, others))
            return
        taken_set = set(taken)
        groups: dict[int, list[int]] = {chunk: list(taken)}
        holes: list[int] = []  # a donor chunk once per unit it gave
        for d in others:
            units = plan.units_of(d)
            kept = [u for u in units if u not in taken_set]
            if len(kept) != len(units):
                holes.extend([d] * (len(units) - len(kept)))
                groups[d] = kept
        back = [u for u in plan.units_of(chunk) if u not in taken_set]
        if not others:
            groups[chunk].extend(back)  # the only free chunk keeps what it had
            back = []
        for k, u in enumerate(back):
            if k < len(holes):
                d = holes[k]
            else:  # drew fewer units than it gave up (larger files): to the smallest
                d = min(others, key=lambda c: len(groups[c]) if c in groups else plan.size_of(c))
            if d not in groups:
                groups[d] = plan.units_of(d)
            groups[d].append(u)
        self._moved(plan.reassign(
            {c: [i for u in us for i in plan.unit_ids(u)] for c, us in groups.items()}
        ))

    def _moved(self, moves: Moves) -> None:
        """Files changed chunk: per-chunk cached counts, then the readers (``on_moved``)."""
        if not moves:
            return
        for (old, new), ids in moves.items():
            n = sum(map(bool, map(self._is_cached, ids)))
            self._chunks[old].cached -= n
            self._chunks[new].cached += n
        if self._on_moved is not None:
            self._on_moved(moves)

    def next_preload(self, limit: int) -> list[int]:
        """The next ``limit`` files to preload for the loading chunk (pull model).

        Walks the :class:`Preload` order, skipping files cached (by a job's miss) or failed
        meanwhile; past the end it starts again with the files still missing (preloads the
        cache dropped, or still in progress: a repeat is harmless, fills are single-flight), at
        most one new round per call. Empty when nothing is loading or all is in. A caller
        following DELI's "50/50" rule (§V-D) pulls a window of half its preload budget
        whenever the previous window is half done.
        """
        out: list[int] = []
        if self.loading is None:
            return out
        failed = self._chunks[self.loading].failed
        wrapped = False
        while len(out) < limit:
            if self._cursor >= len(self._order):
                if wrapped:
                    break
                wrapped = True
                self._order = [i for i in self._order if not self._is_cached(i) and i not in failed]
                self._cursor = 0
                if not self._order:
                    break
            i = self._order[self._cursor]
            self._cursor += 1
            if not self._is_cached(i) and i not in failed:
                out.append(i)
        return out

    def preload_remaining(self, limit: int | None = None) -> list[int]:
        """Files of the loading chunk neither cached nor failed yet (to re-issue preloads that
        the cache dropped or that are still queued), at most ``limit``."""
        if self.loading is None:
            return []
        chunk = self._chunks[self.loading]
        out = []
        for start, stop in self.plan.ranges_of(self.loading):
            for i in range(start, stop):
                if not self._is_cached(i) and i not in chunk.failed:
                    out.append(i)
                    if limit is not None and len(out) >= limit:
                        return out
        return out

    # -- readers ---------------------------------------------------------------------------

    def attach(self, holder: object) -> None:
        """A reader exists; preloading runs only while some reader is attached."""
        self._holders.add(holder)

    def detach(self, holder: object) -> None:
        """A reader went away: drop its references (it will not finish them)."""
        self._holders.discard(holder)
        for chunk in self._chunks:
            chunk.refs.discard(holder)

    def reference(self, holder: object, chunk: int) -> None:
        """``holder`` reads ``chunk`` now (Algorithm 1's ``informServers``)."""
        self._holders.add(holder)
        self._chunks[chunk].refs.add(holder)
        self._read_since_ready = True

    def detach_chunk(self, holder: object, chunk: int) -> None:
        """``holder`` leaves ``chunk`` without having read from it (not a finish)."""
        self._chunks[chunk].refs.discard(holder)

    def finished(self, holder: object, chunk: int, now: float) -> None:
        """``holder`` was given every file of ``chunk`` (``informServersDoneUsingChunk``)."""
        c = self._chunks[chunk]
        c.refs.discard(holder)
        self._read_since_ready = True
        if c.state is not ChunkState.IDLE:
            if c.first_done is None:
                c.first_done = now
            c.last_done = now

    # -- cache notifications -----------------------------------------------------------------

    def on_cached(self, ids: Iterable[int]) -> None:
        """``ids`` became cached (each reported once: only ids that were not cached)."""
        for i in ids:
            chunk = self._chunks[self.plan.chunk_of(i)]
            chunk.cached += 1
            chunk.failed.discard(i)  # a later fetch (a job's miss) succeeded after all

    def on_evicted(self, ids: Iterable[int]) -> None:
        """``ids`` left the cache (each reported once: only ids that were cached)."""
        for i in ids:
            self._chunks[self.plan.chunk_of(i)].cached -= 1

    def on_failed(self, ids: Iterable[int]) -> None:
        """Preloads of ``ids`` failed for good; the loading chunk completes without them."""
        if self.loading is None:
            return
        chunk = self._chunks[self.loading]
        for i in ids:
            if self.plan.chunk_of(i) == self.loading and not self._is_cached(i):
                chunk.failed.add(i)

    # -- decisions ---------------------------------------------------------------------------

    def tick(self, now: float) -> list[Action]:
        """Advance the lifecycle; the actions to perform, in order.

        1. A marked chunk no holder still reads is evicted once ``grace`` has passed since
           its last holder finished it; so is one whose first finisher finished
           ``evict_timeout`` ago, holders or not (``forced``).
        2. The loading chunk, once every file is cached or failed (and no chunk is marked),
           becomes the newest (:class:`ChunkReady`) and the previous newest is marked for
           eviction — evicted at once (step 1 again) if no holder reads it.
        3. While a reader is attached and a slot is free, the next chunk starts loading
           (after the first, only while readers read: :meth:`_reading`).
        """
        actions: list[Action] = []
        self._evict_marked(now, actions)
        if self._promote(actions):
            self._evict_marked(now, actions)
        busy = len(self.resident()) + (self.loading is not None)
        if self.loading is None and self._holders and busy < self.slots and self._reading():
            if not self.planned:
                self.plan_next()
            if not self.planned:
                return actions  # nothing free to draw from
            index = self.planned.pop(0)
            chunk = self._chunks[index]
            chunk.state = ChunkState.LOADING
            chunk.failed.clear()
            chunk.first_done = chunk.last_done = None
            self.loading = index
            ids = self.plan.preload_order(index, self._rng, lambda i: not self._is_cached(i))
            self._order, self._cursor = ids, 0
            actions.append(Preload(self.dataset, index, tuple(ids)))
        return actions

    def release_planned(self) -> list[int]:
        """Planned chunks no reader is on go back to the free ones (re-drawn when planned
        again); the chunks released.

        For a job's next epoch (:meth:`mountd.coop.claims.EpochPool._start`): the chunks
        planned while it read its last epoch were drawn from the files it had not read yet
        then, in the order it went on to read them. Kept, the new epoch would read them in
        that order again, and a file read early in one epoch would be read early in the next
        (measured: epoch-to-epoch correlation of positions up to +0.7 with one job that ran
        ahead of the loads).
        """
        released = [c for c in self.planned if not self._chunks[c].refs]
        if released:
            self.planned = [c for c in self.planned if self._chunks[c].refs]
        return released

    def _promote(self, actions: list[Action]) -> bool:
        if self.loading is None:
            return False
        chunk = self._chunks[self.loading]
        if chunk.cached + len(chunk.failed) < self.plan.size_of(self.loading):
            return False
        if any(c.state is ChunkState.MARKED for c in self._chunks):
            return False  # slots=3: wait, or three chunks would be resident
        if self.newest is not None:
            self._chunks[self.newest].state = ChunkState.MARKED
        chunk.state = ChunkState.LOADED
        chunk.failed.clear()
        self._order, self._cursor = [], 0
        self.newest, self.loading = self.loading, None
        self._read_since_ready = False
        actions.append(ChunkReady(self.dataset, self.newest))
        return True

    def _reading(self) -> bool:
        """Whether the next chunk may load: before the first, always (a job's first chunk is
        ready when it starts reading); after, while a reader is on some chunk or has entered
        or finished one since the newest became the newest. Otherwise the next chunk's
        arrival would mark the newest and evict it unread, and the one after would do the
        same to it: a session opened but not claiming yet made mountd load and evict chunk
        after chunk."""
        return (self.newest is None or self._read_since_ready
                or any(c.refs for c in self._chunks))

    def _evict_marked(self, now: float, actions: list[Action]) -> None:
        for index, chunk in enumerate(self._chunks):
            if chunk.state is not ChunkState.MARKED:
                continue
            forced = chunk.first_done is not None and now - chunk.first_done >= self.evict_timeout
            if not forced and (chunk.refs or self._in_grace(chunk, now)):
                continue
            members = tuple(self.plan.ids_of(index))
            ids = tuple(i for i in members if self._is_cached(i))
            actions.append(Evict(self.dataset, index, ids, forced=bool(chunk.refs), members=members))
            chunk.state = ChunkState.IDLE
            # A straggler keeps its reference (it reads the chunk as misses now), so that the
            # chunk is not re-drawn under it; it goes when the straggler finishes or leaves.
            chunk.first_done = chunk.last_done = None

    def _in_grace(self, chunk: _Chunk, now: float) -> bool:
        """Whether ``chunk``'s last holder finished it less than ``grace`` ago: its last given
        files may still be unread (a chunk whose holders all went away has no grace)."""
        return chunk.last_done is not None and now - chunk.last_done < self.grace

    def grace_deadline(self) -> float | None:
        """The earliest clock at which a marked chunk's grace ends (None: none pending), so
        that the caller can tick then instead of up to a tick interval later."""
        ends = [
            c.last_done + self.grace
            for c in self._chunks
            if c.state is ChunkState.MARKED and not c.refs and c.last_done is not None
        ]
        return min(ends, default=None)

    def _next_to_load(self) -> int:
        """The chunk to load next: the first planned one, else the first free one (its
        membership is drawn when it is planned)."""
        if self.planned:
            return self.planned[0]
        return next((c for c in range(self.plan.chunks) if self.is_free(c)), 0)


_RESIDENT = (ChunkState.LOADED, ChunkState.MARKED)
