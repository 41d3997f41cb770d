"""A job's sessions and its epoch pools, as :class:`~mountd.coop.sessions.SessionRegistry`
keeps them: :class:`Job`, :class:`Session`, and :class:`SessionInfo` (what a client is told).

A session is one rank of a job on a dataset; every rank of a job shares the job's epoch
pools (:class:`~mountd.coop.claims.EpochPool`), one per live epoch, so that each file goes to
one claim of the job per epoch. Apart from the registry because this is the bookkeeping of
one job (which epochs may still start, which pools are finished with), where the registry
validates requests and ties jobs, datasets and timings together.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping
from dataclasses import dataclass, field

from mountd.coop.claims import EpochPool
from mountd.coop.dataset_state import DatasetState
from mountd.coop.plans import Mode
from mountd.coop.requests import LIVE_EPOCHS
from mountd.errors import StaleEpoch

__all__ = [
    "OUT_OF_PHASE", "Job", "Session", "SessionInfo", "fold_phase", "session_rng", "widest_phase",
]

#: Jobs further apart than this share of an epoch are out of phase in ``quiverfs stats``:
#: chunks they share tie each job's order to the other's (docs/substitutable-reads.md,
#: "Jobs out of phase"; 0.1 apart gives an epoch-to-epoch r of about +0.1).
OUT_OF_PHASE = 0.1


@dataclass(frozen=True)
class SessionInfo:
    """An open session, as reported to the client."""

    dataset: str
    job: str
    rank: int
    world_size: int
    epoch: int
    seed: int
    lookahead: int
    files: int  # files in the dataset
    quota: int  # files this rank gets per epoch, at most
    mode: Mode


def session_rng(seed: int, job: str, epoch: int, rank: int) -> random.Random:
    """The generator of one rank's claims in one epoch."""
    # The job id is mixed in so that two jobs with the same (default) seed still draw
    # different misses: co-operation must not depend on users picking distinct seeds.
    return random.Random(f"claim:{seed}:{job}:{epoch}:{rank}")


def fold_phase(difference: float) -> float:
    """A difference of two positions in epochs (``3.25 - 1.9``) as a phase: the part of an
    epoch between them, folded into [-0.5, 0.5) (``0.35``; ``0.6`` apart is ``-0.4``)."""
    return difference - math.floor(difference + 0.5)


def widest_phase(positions: Mapping[str, float]) -> tuple[str, str, float] | None:
    """The two jobs furthest apart in phase, from their positions in epochs
    (:meth:`SessionRegistry.positions`), and that distance (0 to 0.5 of an epoch); None for
    fewer than two jobs."""
    widest = None
    jobs = sorted(positions)
    for k, a in enumerate(jobs):
        for b in jobs[k + 1:]:
            apart = abs(fold_phase(positions[a] - positions[b]))
            if widest is None or apart > widest[2]:
                widest = (a, b, apart)
    return widest


@dataclass
class Session:
    """One rank's session: its parameters, its epoch and the generator of its claims."""

    rank: int
    seed: int
    lookahead: int
    epoch: int
    rng: random.Random


@dataclass
class Job:
    """One job on one dataset: its ranks' sessions and its live epoch pools."""

    dataset: str
    job: str
    world_size: int
    scope: bytearray | None = None  # the job's files (EpochPool.scope); None: all
    sessions: dict[int, Session] = field(default_factory=dict)
    pools: dict[int, EpochPool] = field(default_factory=dict)
    seen: float = 0.0  # clock of the last accepted request from any rank

    def check_epoch(self, current: int | None, epoch: int) -> None:
        """Refuse moving a session (on ``current``, None for a new one) to ``epoch``."""
        if current is not None and epoch < current:
            raise StaleEpoch(f"epoch {epoch} is behind this rank's epoch {current}")
        if epoch not in self.pools and self.pools and epoch < max(self.pools):
            # A pool is only ever created for an epoch newer than every live one: an older
            # epoch was given out already (or dropped) and cannot start again.
            raise StaleEpoch(f"epoch {epoch} of job {self.job} is over: start a later one")
        if epoch == current and epoch not in self.pools:
            raise StaleEpoch(f"epoch {epoch} of job {self.job} was dropped: start a later one")

    def move(self, session: Session, epoch: int, state: DatasetState) -> None:
        """Put ``session`` on ``epoch`` (already validated), creating its pool on ``state``
        (the job's dataset) if needed; at most :data:`LIVE_EPOCHS` pools stay."""
        if epoch not in self.pools:
            # The new epoch starts after the chunk the previous one is on (order across epochs).
            after = self.pools[max(self.pools)].generation if self.pools else None
            self.pools[epoch] = EpochPool(
                state, self.job, epoch, self.world_size, self.scope, after=after
            )
            while len(self.pools) > LIVE_EPOCHS:
                oldest = min(self.pools)
                self.pools.pop(oldest).close()
        if session.epoch != epoch:
            session.epoch = epoch
            session.rng = session_rng(session.seed, self.job, epoch, session.rank)
        self.drop_unused_pools()

    def drop_unused_pools(self) -> None:
        """Pools no session is on are finished with (a session never goes back)."""
        used = {s.epoch for s in self.sessions.values()}
        for epoch in [e for e in self.pools if e not in used]:
            self.pools.pop(epoch).close()

    def info(self, state: DatasetState, session: Session, mode: Mode) -> SessionInfo:
        """``session`` as reported to the client (``state``: the job's dataset, in ``mode``)."""
        pool = self.pools.get(session.epoch)
        quota = pool.quota if pool is not None else -(-state.count // self.world_size)
        return SessionInfo(
            dataset=state.name,
            job=self.job,
            rank=session.rank,
            world_size=self.world_size,
            epoch=session.epoch,
            seed=session.seed,
            lookahead=session.lookahead,
            files=state.count,
            quota=quota,
            mode=mode,
        )
