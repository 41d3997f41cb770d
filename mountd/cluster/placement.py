"""Where a content hash lives in the cluster: rendezvous (highest-random-weight) hashing.

Every node computes the same answer locally from the same member list, with no
coordination: for a hash ``h`` each member ``m`` gets the weight ``blake3(m ‖ h)`` (first 8
bytes, big-endian), and the owners are the members in falling weight. When a member leaves,
only the hashes it owned move (each to its own second choice, spread over the others); when
one joins, it takes about ``1/n`` of the hashes, from every other member evenly. Nothing
else moves, unlike ``hash mod n``.

Members are named by their node id (their advertised ``HOST:PORT``), so a node that restarts
with the same address owns the same hashes, which its cache directory may still hold.
"""

from __future__ import annotations

from collections.abc import Iterable

import blake3


def weight(member: str, content_hash: bytes) -> int:
    """The rendezvous weight of ``member`` for ``content_hash`` (a 64-bit integer)."""
    h = blake3.blake3(member.encode() + b"\0" + content_hash).digest(length=8)
    return int.from_bytes(h, "big")


def owners(content_hash: bytes, members: Iterable[str]) -> list[str]:
    """``members`` in order of preference for ``content_hash``: the owner first, then the
    node that takes over if it leaves, and so on (ties, which need a 64-bit collision, fall
    to the smaller name)."""
    return sorted(set(members), key=lambda m: (-weight(m, content_hash), m))


def owner(content_hash: bytes, members: Iterable[str]) -> str | None:
    """The owner of ``content_hash`` among ``members`` (None when there are none)."""
    best: tuple[int, str] | None = None
    for member in members:
        key = (weight(member, content_hash), member)
        if best is None or key[0] > best[0] or (key[0] == best[0] and key[1] < best[1]):
            best = key
    return None if best is None else best[1]
