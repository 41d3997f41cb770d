"""In a cluster, a claim's misses prefer files another mountd holds (a peer hit, not a bucket
GET), and exactly once per epoch still holds."""

from __future__ import annotations

from mountd.coop.service import _uncached_from
from mountd.coop.sessions import SessionRegistry

N = 400


def _claim_all(reg: SessionRegistry, n: int = 10) -> tuple[list[int], list[int]]:
    hits: list[int] = []
    fetch: list[int] = []
    while not (claim := reg.claim("d", "j", 0, n)).end_of_epoch:
        hits.extend(claim.hits)
        fetch.extend(claim.fetch)
    return hits, fetch


def test_misses_prefer_files_a_peer_holds_and_every_file_is_given_once() -> None:
    reg = SessionRegistry(idle_timeout=None)
    reg.add_dataset("d", [1000] * N, budget=10 * N * 1000, cached=range(0, N, 5))
    held = {i for i in range(N) if i % 5 and i % 3 == 0}  # 107 uncached files on peers
    reg.dataset("d").set_peer_held(range(N), [i in held for i in range(N)])
    assert reg.dataset("d").peer_held_total == len(held)
    reg.open_session("d", "j")
    hits, fetch = _claim_all(reg)
    assert sorted(hits + fetch) == list(range(N))  # exactly once
    assert set(hits) == set(range(0, N, 5))
    first = fetch[:len(held)]
    assert sum(i in held for i in first) >= 0.9 * len(held)  # peers' files go first


def test_without_peer_knowledge_misses_are_drawn_as_before() -> None:
    reg = SessionRegistry(idle_timeout=None)
    reg.add_dataset("d", [1000] * N, budget=10 * N * 1000)
    reg.open_session("d", "j")
    _, fetch = _claim_all(reg)
    assert sorted(fetch) == list(range(N))
    assert reg.dataset("d").peer_held_total == 0


def test_set_peer_held_counts_changes_only() -> None:
    reg = SessionRegistry(idle_timeout=None)
    reg.add_dataset("d", [1000] * 10, budget=10**6)
    state = reg.dataset("d")
    state.set_peer_held([1, 2, 3], [True, True, False])
    state.set_peer_held([2, 3, 4], [True, True, False])
    state.set_peer_held([1], [False])
    assert state.peer_held_total == 2 and list(state.peer_held[:5]) == [0, 0, 1, 1, 0]


def test_uncached_ids_are_taken_round_the_dataset_from_an_offset() -> None:
    cached = bytearray([1, 0, 0, 1, 0, 1, 1, 0])
    assert _uncached_from(cached, 0, 10) == [1, 2, 4, 7]
    assert _uncached_from(cached, 3, 2) == [4, 7]
    assert _uncached_from(cached, 7, 4) == [7, 1, 2, 4]
    assert _uncached_from(bytearray(5), 2, 10) == [2, 3, 4, 0, 1]
    assert _uncached_from(bytearray([1] * 6), 0, 3) == []
