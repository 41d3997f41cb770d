"""mountd.store.quota on a real index: the per-uid eviction queue's order, and the charges."""

from __future__ import annotations

from pathlib import Path

import pytest

from mountd.errors import QuotaExceeded
from mountd.store.index import Index
from mountd.store.quota import Charges, own_victims, owned_victims


def h(i: int) -> bytes:
    return i.to_bytes(32, "big")


@pytest.fixture
def index(tmp_path: Path):
    idx = Index.open(tmp_path / "index.sqlite")
    yield idx
    idx.close()


@pytest.mark.parametrize("page", [1, 2, 3, 64])
def test_the_queue_gives_a_users_entries_least_recently_used_first(index: Index, page: int):
    for i in range(1, 9):  # filled in this order; odd ones are uid 7's, even ones uid 8's
        index.insert(h(i), 10 * i, "ds", 7 if i % 2 else 8)
    index.flush()
    index.touch([h(3)], None)  # 3 is now uid 7's newest by use
    index.touch([h(1)], None)  # ... and then 1
    index.set_pinned([h(5)], True)
    order = [hash for hash, _ in owned_victims(index, 7, page)]
    assert order == [h(7), h(3), h(1)]  # 5 is pinned; 7 was used last of all at its fill
    assert [size for _, size in owned_victims(index, 7, page)] == [70, 30, 10]  # re-queued: same
    assert [hash for hash, _ in owned_victims(index, 8, page)] == [h(2), h(4), h(6), h(8)]
    assert list(owned_victims(index, 9, page)) == []


def test_a_walk_reads_each_row_once_and_a_later_walk_finds_the_requeued_order(index: Index):
    for i in range(1, 6):
        index.insert(h(i), 1, None, 7)
    index.flush()
    index.touch([h(1), h(2)], None)
    first = list(owned_victims(index, 7, page=2))
    assert first == [(h(3), 1), (h(4), 1), (h(5), 1), (h(1), 1), (h(2), 1)]
    index.write_touches(index.touches_waiting)  # the hits' recency, from memory to the table
    stamps = dict(index.conn.execute("SELECT hash, stamp FROM owners"))
    uses = dict(index.conn.execute("SELECT hash, last_use FROM entries"))
    assert stamps == uses  # the walk moved 1 and 2 to where their use put them
    assert list(owned_victims(index, 7, page=2)) == first


def test_own_victims_stops_at_the_need_and_skips_busy_hashes(index: Index):
    for i in range(1, 6):
        index.insert(h(i), 100, None, 7)
    index.flush()
    assert own_victims(index, 7, 150, busy=set()) == [(h(1), 100), (h(2), 100)]
    assert own_victims(index, 7, 150, busy={h(1)}) == [(h(2), 100), (h(3), 100)]
    assert own_victims(index, 7, 10_000, busy=set()) == [(h(i), 100) for i in range(1, 6)]


def test_deleted_entries_leave_the_queue_and_the_totals(index: Index):
    index.insert(h(1), 100, None, 7)
    index.insert(h(2), 200, None, 7)
    index.insert(h(3), 300, None, 8)
    index.insert(h(4), 400, None, None)  # charged to nobody
    index.flush()
    assert sorted(index.charged()) == [(7, 2, 300), (8, 1, 300)]
    assert index.owners_of([h(1), h(3), h(4)]) == {h(1): 7, h(3): 8}
    index.delete([h(1), h(3)])
    assert index.charged() == [(7, 1, 200)]
    assert list(owned_victims(index, 7)) == [(h(2), 200)]
    assert list(owned_victims(index, 8)) == []


def test_charges_count_fills_in_flight_against_the_quota():
    charges = Charges(quota=1000)
    charges.load([(7, 2, 600)])
    assert charges.over(7, 400) == 0
    charges.reserve(7, 300)
    assert charges.over(7, 400) == 300
    assert charges.over(None, 10**9) == 0  # nobody has no quota
    charges.unreserve(7, 300)
    charges.charge(7, 300)
    assert (charges.files[7], charges.bytes[7]) == (3, 900)
    # h(4) is nobody's: not taken off anyone's charge.
    charges.uncharge({h(1): 7, h(2): 7, h(3): 7}, [(h(1), 400), (h(2), 200), (h(3), 300), (h(4), 5)])
    assert charges.snapshot() == {}
    with pytest.raises(QuotaExceeded, match="1001 bytes"):
        charges.check_size(h(1), 1001, 7)
    charges.check_size(h(1), 1001, None)
    Charges(quota=None).check_size(h(1), 10**12, 7)
