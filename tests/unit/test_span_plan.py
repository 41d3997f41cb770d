"""What a chunk fill's span takes in (mountd/store/span.py ``plan_span``): the gaps it may
cross between wanted members of a packed object."""

from __future__ import annotations

from collections.abc import Sequence

from mountd.store.span import HEADER_ROOM, Member, plan_span
from quiverfs.base.backends.base import Location

URL, KEY = "s3://bucket/packed", "chunk-000000.tar"
HEADER = 512


def _object(sizes: Sequence[int]) -> list[Member]:
    """Members of the given sizes, each after a 512-byte tar header, in one object."""
    members, offset = [], 0
    for i, size in enumerate(sizes):
        offset += HEADER
        members.append(Member(bytes([i]) * 32, size, Location(URL, KEY, offset, size)))
        offset += -(-size // HEADER) * HEADER
    return members


def _span_of(members: list[Member], requested: int, cached: set[int],
             max_gap: int = 256 * 1024) -> list[int] | None:
    wanted_hashes = {m.hash for i, m in enumerate(members) if i not in cached}
    span = plan_span(members, members[requested], wanted_hashes.__contains__, 1 << 30, max_gap)
    return None if span is None else [members.index(m) for m in span.members]


def test_a_cached_member_as_large_as_the_one_beyond_it_is_not_crossed():
    members = _object([16384] * 8)
    assert _span_of(members, 0, cached={3}) == [0, 1, 2]
    assert _span_of(members, 5, cached={3}) == [4, 5, 6, 7]
    # nothing cached: the whole object, tar headers crossed
    assert _span_of(members, 5, cached=set()) == list(range(8))


def test_a_small_cached_member_is_crossed_to_reach_a_larger_one():
    members = _object([110_000, 20_000, 110_000, 40_000])
    # 20 KB cached (and its header) to bring 110 KB: crossed (and 3 beside it joins); a
    # 40 KB member beyond a cached 110 KB one is not
    assert _span_of(members, 0, cached={1}) == [0, 2, 3]
    assert _span_of(members, 3, cached={2}) is None


def test_tiny_members_still_join_across_their_headers():
    members = _object([100] * 6)
    assert members[1].location.offset - (members[0].location.offset + 100) < HEADER_ROOM
    assert _span_of(members, 2, cached=set()) == list(range(6))


def test_the_fixed_gap_still_bounds_what_a_large_member_may_cross():
    members = _object([200_000, 50_000, 200_000])
    assert _span_of(members, 0, cached={1}) == [0, 2]
    assert _span_of(members, 0, cached={1}, max_gap=40_000) is None
