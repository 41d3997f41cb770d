"""Timing reports of jobs: a small ring of recent mini-batch times plus epoch and session times.

Kept per job by :class:`mountd.coop.sessions.SessionRegistry` for the benefit-aware policy that a
later issue adds (Quiver §5.3: benefit = time per mini-batch missing / hitting the cache).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

__all__ = ["JobTimings", "TimingSummary"]


@dataclass(frozen=True)
class TimingSummary:
    """What a job reported (kept for the benefit-aware policy, Quiver §5.3)."""

    batches: int  # mini-batch reports ever
    recent: tuple[float, ...]  # the last ``ring`` mini-batch times, oldest first
    mean: float | None  # of ``recent``
    median: float | None  # of ``recent``
    epochs: tuple[tuple[int, int, float], ...]  # recent (epoch, rank, seconds)
    closed: int  # sessions closed
    session_seconds: tuple[float, ...]  # run times reported at close, recent ones


@dataclass
class JobTimings:
    """One job's reports; ``ring`` recent mini-batch times are kept."""

    ring: int
    batches: int = 0
    recent: deque = field(init=False)
    epochs: deque = field(default_factory=lambda: deque(maxlen=64))
    closed: int = 0
    session_seconds: deque = field(default_factory=lambda: deque(maxlen=64))

    def __post_init__(self) -> None:
        self.recent = deque(maxlen=self.ring)

    def summary(self) -> TimingSummary:
        recent = tuple(self.recent)
        ordered = sorted(recent)
        median = None
        if ordered:
            mid = len(ordered) // 2
            median = ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2
        return TimingSummary(
            batches=self.batches,
            recent=recent,
            mean=sum(recent) / len(recent) if recent else None,
            median=median,
            epochs=tuple(self.epochs),
            closed=self.closed,
            session_seconds=tuple(self.session_seconds),
        )
