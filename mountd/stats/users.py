"""What each local user asked of a shared mountd (``quiverfs stats``, per uid).

Every request is attributed to the uid the kernel reported for its connection
(``SO_PEERCRED``), so one user cannot make another's numbers move.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass
class UserCounters:
    """One uid's traffic. Counted in the trio thread only."""

    #: Requests of any kind.
    requests: int = 0
    #: ``ensure`` requests: misses of its mounts (a hit by hash or a fill).
    ensures: int = 0
    #: Fills from bytes this user supplied (read with its own rights), and their bytes.
    supplied: int = 0
    supplied_bytes: int = 0
    #: Hits its mounts and loaders served straight from the store and reported (``hits``),
    #: and the store files mountd opened for it (``open``: a descriptor handed over is a hit).
    reported_hits: int = 0
    reported_hit_bytes: int = 0
    #: ``open`` requests (descriptor hand-off), and the descriptors handed over to it.
    opens: int = 0
    opened: int = 0
    #: Requests refused for lack of rights (admin ops, a digest it could not open).
    refused: int = 0


class UserStats:
    """Counters per uid."""

    def __init__(self) -> None:
        self.by_uid: defaultdict[int, UserCounters] = defaultdict(UserCounters)

    def __getitem__(self, uid: int) -> UserCounters:
        return self.by_uid[uid]

    def snapshot(self, cached: Mapping[int, Mapping[str, Any]] | None = None
                 ) -> dict[str, dict[str, Any]]:
        """``{uid (text): counters}`` for the ``stats`` answer, each with the cache's figures
        for that uid merged in (``cached``: what is charged to it and its quota, from
        ``mountd.store.quota.Charges.snapshot``); a uid with cached content but no request
        since mountd started gets zero counters."""
        cached = cached or {}
        out: dict[str, dict[str, Any]] = {}
        for uid in sorted(set(self.by_uid) | set(cached)):
            counters = self.by_uid.get(uid) or UserCounters()
            out[str(uid)] = {**dataclasses.asdict(counters), **cached.get(uid, {})}
        return out
