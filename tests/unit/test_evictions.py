"""mountd's eviction journal: numbered removals a mount can follow, with loss detected."""

from __future__ import annotations

from mountd.store.evictions import EvictionJournal


def _h(i: int) -> bytes:
    return i.to_bytes(32, "big")


def test_a_first_request_learns_where_the_journal_stands() -> None:
    journal = EvictionJournal()
    journal.removed([_h(1), _h(2)])
    answer = journal.since(None)
    assert answer == {"journal": journal.id, "seq": 2, "hashes": [], "complete": True}


def test_removals_come_in_order_once() -> None:
    journal = EvictionJournal()
    start = journal.since(None)
    journal.removed([_h(1), _h(2)])
    journal.removed([_h(3)])
    answer = journal.since(start["seq"], start["journal"])
    assert answer["hashes"] == [_h(i).hex() for i in (1, 2, 3)] and answer["complete"]
    assert answer["seq"] == 3
    assert journal.since(3, journal.id)["hashes"] == []


def test_answers_are_paged() -> None:
    journal = EvictionJournal()
    journal.removed([_h(i) for i in range(10)])
    first = journal.since(0, journal.id, limit=4)
    assert first["hashes"] == [_h(i).hex() for i in range(4)] and first["seq"] == 4
    rest = journal.since(first["seq"], journal.id, limit=100)
    assert rest["hashes"] == [_h(i).hex() for i in range(4, 10)] and rest["seq"] == 10


def test_falling_behind_the_ring_is_reported() -> None:
    journal = EvictionJournal(capacity=4)
    journal.removed([_h(i) for i in range(10)])
    answer = journal.since(2, journal.id)
    assert not answer["complete"]
    assert answer["hashes"] == [_h(i).hex() for i in range(6, 10)] and answer["seq"] == 10


def test_another_run_or_a_future_seq_restarts_from_the_newest() -> None:
    journal = EvictionJournal()
    journal.removed([_h(1)])
    for seq, name in ((0, "someone-else"), (99, journal.id)):
        answer = journal.since(seq, name)
        assert answer == {"journal": journal.id, "seq": 1, "hashes": [], "complete": False}


def test_a_question_without_news_waits_for_the_next_removal() -> None:
    journal = EvictionJournal()
    start = journal.since(None)
    changed = journal.changed(start["seq"], start["journal"])
    assert changed is not None and not changed.is_set()
    assert journal.changed(start["seq"], start["journal"]) is changed  # one event for all
    journal.removed([])
    assert not changed.is_set()
    journal.removed([_h(1)])
    assert changed.is_set()
    assert journal.since(start["seq"], start["journal"])["hashes"] == [_h(1).hex()]
    # News now, another run's journal, or a first question: nothing to wait for.
    assert journal.changed(start["seq"], start["journal"]) is None
    assert journal.changed(1, "another run") is None
    assert journal.changed(None) is None
