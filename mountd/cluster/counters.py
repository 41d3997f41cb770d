"""What the cluster did, as plain numbers for ``quiverfs stats`` and Prometheus.

Updated from the trio thread only. Per-peer figures are keyed by the peer's node id
(its advertised ``HOST:PORT``).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class ClusterCounters:
    """The cluster's counters (see :meth:`snapshot` for their meaning)."""

    peer_hits: int = 0
    peer_bytes: int = 0
    peer_misses: int = 0
    peer_errors: Counter[str] = field(default_factory=Counter)
    peer_corrupt: Counter[str] = field(default_factory=Counter)
    bucket_turns: int = 0
    lock_waits: int = 0
    take_overs: int = 0
    pushes: int = 0
    push_errors: int = 0
    served_hits: int = 0
    served_bytes: int = 0
    served_misses: int = 0
    pushes_received: int = 0
    pushes_refused: int = 0
    auth_failures: int = 0
    redis_errors: int = 0
    membership_changes: int = 0

    def snapshot(self) -> dict:
        """JSON-ready: what this node got from peers (``peer_hits``/``peer_bytes``: files and
        bytes; ``peer_misses``: asked, not there; ``peer_errors``/``peer_corrupt``: per peer,
        failed transfers and transfers whose bytes did not verify), its turns at the bucket
        under the cluster-wide lock (``bucket_turns``) and waits for another node's
        (``lock_waits``), locks taken over from a holder that died (``take_overs``), pushes of fetched files to their owner, what it served to peers,
        refused handshakes, Redis errors and membership changes seen."""
        out = {k: v for k, v in vars(self).items() if not isinstance(v, Counter)}
        out["peer_errors"] = dict(self.peer_errors)
        out["peer_corrupt"] = dict(self.peer_corrupt)
        return out
