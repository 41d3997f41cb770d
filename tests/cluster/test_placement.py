"""Rendezvous placement: the same answer everywhere, balanced, and minimal movement."""

from __future__ import annotations

from collections import Counter

import blake3

from mountd.cluster.placement import owner, owners

NODES = [f"10.0.0.{i}:7070" for i in range(1, 6)]
HASHES = [blake3.blake3(i.to_bytes(4, "big")).digest() for i in range(20_000)]


def test_owner_is_the_first_of_the_order_and_independent_of_member_order() -> None:
    for h in HASHES[:500]:
        order = owners(h, NODES)
        assert sorted(order) == sorted(NODES)
        assert owner(h, NODES) == order[0] == owner(h, list(reversed(NODES)))
        assert owners(h, list(reversed(NODES))) == order


def test_no_members_no_owner() -> None:
    assert owner(HASHES[0], []) is None
    assert owners(HASHES[0], []) == []


def test_shares_are_balanced() -> None:
    counts = Counter(owner(h, NODES) for h in HASHES)
    fair = len(HASHES) / len(NODES)
    assert set(counts) == set(NODES)
    assert all(abs(n - fair) < 0.06 * fair for n in counts.values()), counts


def test_only_the_departed_nodes_share_moves_and_it_spreads_over_the_rest() -> None:
    gone = NODES[2]
    rest = [n for n in NODES if n != gone]
    before = {h: owner(h, NODES) for h in HASHES}
    after = {h: owner(h, rest) for h in HASHES}
    moved = [h for h in HASHES if before[h] != after[h]]
    assert moved and all(before[h] == gone for h in moved)
    assert len(moved) == sum(1 for h in HASHES if before[h] == gone)
    # ... each to its second choice, and evenly over the others.
    assert all(after[h] == owners(h, NODES)[1] for h in moved)
    spread = Counter(after[h] for h in moved)
    assert set(spread) == set(rest)
    fair = len(moved) / len(rest)
    assert all(abs(n - fair) < 0.15 * fair for n in spread.values()), spread


def test_a_joining_node_takes_its_share_from_everyone_and_nothing_else_moves() -> None:
    new = "10.0.0.9:7070"
    before = {h: owner(h, NODES) for h in HASHES}
    after = {h: owner(h, [*NODES, new]) for h in HASHES}
    moved = [h for h in HASHES if before[h] != after[h]]
    assert all(after[h] == new for h in moved)
    fair = len(HASHES) / (len(NODES) + 1)
    assert abs(len(moved) - fair) < 0.06 * fair
    assert set(Counter(before[h] for h in moved)) == set(NODES)
