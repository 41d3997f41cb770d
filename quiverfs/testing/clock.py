"""A clock a test moves by hand, for code that takes a ``clock`` callable (mountd's session
registry, its token buckets): time passes only when the test says so."""

from __future__ import annotations

__all__ = ["FakeClock"]


class FakeClock:
    """Returns :attr:`now` (seconds), which the test sets; starts at ``now``."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now
