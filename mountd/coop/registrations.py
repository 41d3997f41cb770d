"""What a dataset was registered with, and how a mode becomes its chunk plan: :class:`Registration`.

:meth:`~mountd.coop.sessions.SessionRegistry.add_dataset` keeps each dataset's registration
so that the allocation (:mod:`mountd.coop.benefit`) can plan it again in another mode or
budget at any time (:meth:`~mountd.coop.sessions.SessionRegistry.set_mode`); this module is
that registration and the pure steps from it: the plan of a mode within a budget, what the
mode charges the cache, and the dataset as the allocator sees it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from mountd.coop.benefit import DatasetDemand, JobBenefit, lean_chunk_bytes
from mountd.coop.packing import Packing
from mountd.coop.plans import MIN_FRACTION, ChunkPlan, Mode, plan_chunks, plan_packed_chunks

__all__ = ["ModeChange", "Registration", "too_few_to_chunk"]

log = logging.getLogger(__name__)


def too_few_to_chunk(count: int, packing: Packing | None) -> bool:
    """Whether a dataset of ``count`` files (``packing``: its packed chunks) has fewer than
    three units to make chunks of (a chunked plan needs three: :class:`ChunkPlan`): asked
    to be ``chunked``, it is ``full`` instead."""
    return count < 3 or (
        packing is not None and packing.chunks + packing.chunk_of.count(-1) < 3)


@dataclass(frozen=True)
class ModeChange:
    """A dataset's mode changed by :meth:`~mountd.coop.sessions.SessionRegistry.allocate`;
    ``released``: ids of the chunks the old mode held (pinned: unpin unless something else
    holds them)."""

    dataset: str
    old: Mode
    new: Mode
    budget: int
    released: tuple[int, ...]


@dataclass
class Registration:
    """What :meth:`~mountd.coop.sessions.SessionRegistry.add_dataset` was given, to plan the
    dataset again."""

    sizes: Sequence[int]
    total: int
    fraction: float
    max_chunk_bytes: int | None
    seed: int
    packing: Packing | None
    fixed: bool  # mode given explicitly: the allocator leaves it
    budget: int | None
    #: the mode given explicitly (None: chosen); kept apart from the mode in force, which a
    #: shared budget may turn ``off`` (a manual ``chunked`` with no room left)
    asked: Mode | None = None

    def chunk_bytes(self) -> int:
        """One chunk as the dataset wants it: ``min(fraction × total, max_chunk_bytes)``."""
        chunk = self.fraction * self.total
        if self.max_chunk_bytes is not None:
            chunk = min(chunk, self.max_chunk_bytes)
        return int(chunk)

    def charge(self, mode: Mode, slots: int) -> int:
        """Cache bytes the dataset holds in ``mode``: the whole dataset when ``full``, its
        ``slots`` chunks when ``chunked``, nothing otherwise."""
        if mode is Mode.FULL:
            return self.total
        if mode is Mode.CHUNKED:
            return min(self.budget or 0, slots * self.chunk_bytes())
        return 0

    def demand(self, name: str, mode: Mode, jobs: Sequence[JobBenefit],
               max_pinned: int | None = None) -> DatasetDemand:
        """The dataset ``name`` (in ``mode`` now, read by ``jobs``) as
        :func:`mountd.coop.benefit.allocate` sees it: sizes, its jobs' measured times, its
        manual mode if it was registered with one, and the most its chunks may pin."""
        chunk, floor = self.chunk_bytes(), int(MIN_FRACTION * self.total)
        return DatasetDemand(
            name, self.total, chunk, floor,
            tuple(sorted(jobs, key=lambda j: j.job)),
            (self.asked or mode) if self.fixed else None,
            # Packed: chunks are unions of whole packed chunks, which a lean target could
            # undercut (the dataset then goes off: ``plan``); they keep their size.
            lean_chunk_bytes(self.total, len(self.sizes), chunk, floor) if self.packing is None else 0,
            max_pinned,
        )

    def plan(self, dataset: str, chosen: Mode, budget: int | None,
             slots: int) -> tuple[Mode, ChunkPlan]:
        """The plan of ``chosen`` within ``budget`` for ``slots`` chunk slots (and the mode it
        really gets: ``off`` when packed chunks are too large for the chunk slots)."""
        sizes, packing, fraction = self.sizes, self.packing, self.fraction
        max_chunk_bytes, seed = self.max_chunk_bytes, self.seed
        if chosen is Mode.CHUNKED and packing is not None:
            assert budget is not None
            plan = plan_packed_chunks(
                sizes,
                packing,
                budget,
                fraction=fraction,
                max_chunk_bytes=max_chunk_bytes,
                seed=seed,
                slots=slots,
            )
            largest = plan.target_bytes  # its largest chunk's bytes (set_sizes summed them)
            if largest * slots > budget:
                # Packed chunks too big for the budget: chunks made of whole ones cannot
                # have their slots resident at once (pins would fill the cache and every
                # other fill would fail). No chunk management, then: claims still prefer
                # what is cached, and the cache's own policy evicts.
                log.info("dataset %s: its packed chunks are too large for %d chunk slots in "
                         "%d bytes (largest chunk %d bytes): mode off", dataset,
                         slots, budget, largest)
                chosen, plan = Mode.OFF, ChunkPlan.whole(len(sizes))
        elif chosen is Mode.CHUNKED:
            assert budget is not None
            plan = plan_chunks(
                sizes,
                budget,
                fraction=fraction,
                max_chunk_bytes=max_chunk_bytes,
                seed=seed,
                slots=slots,
            )
        else:
            plan = ChunkPlan.whole(len(sizes))
        return chosen, plan
