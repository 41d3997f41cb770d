"""The index's group commit written in a worker thread (``Index.take_flight``): real SQLite,
real threads. While a flight is out its rows are looked up in memory, the committed rows
through a read-only connection, and anything that needs the writing connection waits for
it to land; a failed flight gives its rows back to the group commit."""

from __future__ import annotations

import sqlite3
import threading
import time
from pathlib import Path

import pytest
import trio

from mountd.store.commits import Commits
from mountd.store.index import Index


def h(i: int) -> bytes:
    return i.to_bytes(32, "big")


@pytest.fixture
def index(tmp_path: Path):
    idx = Index.open(tmp_path / "index.sqlite")
    yield idx
    idx.close()


def committed(index: Index) -> dict[bytes, tuple[int, int]]:
    """``hash → (size, pinned)`` as another connection sees the table (committed rows)."""
    with sqlite3.connect(index.path) as other:
        return {row[0]: (row[1], row[2])
                for row in other.execute("SELECT hash, size, pinned FROM entries")}


def test_a_flight_commits_its_rows_in_a_worker_thread(index: Index):
    index.insert(h(1), 10, "ds", uid=7)
    index.flush()
    index.insert(h(2), 20, "ds", uid=7)
    index.insert(h(3), 30, None)
    flight = index.take_flight()
    assert flight is not None and [row.hash for row in flight.new] == [h(2), h(3)]
    assert index.pending == 0
    thread = threading.Thread(target=index.write_flight, args=(flight,))
    thread.start()
    thread.join()
    assert index.land()
    assert committed(index) == {h(1): (10, 0), h(2): (20, 0), h(3): (30, 0)}
    with sqlite3.connect(index.path) as other:
        assert other.execute("SELECT COUNT(*) FROM refs").fetchone()[0] == 2
        assert other.execute("SELECT COUNT(*) FROM owners").fetchone()[0] == 2
    assert index.take_flight() is None  # nothing left to commit


def test_rows_out_on_a_flight_are_found_without_waiting_for_it(index: Index):
    index.insert(h(1), 10, "ds")
    index.flush()
    index._known.clear()  # h(1) must come from the table
    index.insert(h(2), 20, "ds")
    flight = index.take_flight()
    assert flight is not None
    # The flight has not started: a lookup through the writing connection would wait forever.
    assert index.size_of(h(2)) == 20
    assert index.size_of(h(1)) == 10
    assert index.size_of(h(9)) is None
    assert index.absent([h(9), h(1), h(2), h(8)]) == [h(9), h(8)]
    index.write_flight(flight)
    assert index.land()
    assert index.size_of(h(2)) == 20


def test_the_writing_connection_waits_for_the_flight_to_land(index: Index):
    index.insert(h(1), 10, "ds")
    flight = index.take_flight()
    timer = threading.Timer(0.3, index.write_flight, args=(flight,))
    start = time.monotonic()
    timer.start()
    count = index.conn.execute("SELECT COUNT(*) FROM entries").fetchone()[0]
    assert count == 1  # it saw the flight's row: it waited for the commit
    assert time.monotonic() - start >= 0.25
    timer.join()


def _fail_once(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Make the next ``_write_rows`` raise "database or disk is full"; the calls made."""
    real = Index._write_rows
    calls: list[int] = []

    def write_rows(c: sqlite3.Connection, rows) -> None:
        calls.append(len(rows))
        if len(calls) == 1:
            raise sqlite3.OperationalError("database or disk is full")
        real(c, rows)

    monkeypatch.setattr(Index, "_write_rows", staticmethod(write_rows))
    return calls


def test_a_failed_flight_gives_its_rows_back_to_the_group_commit(
        index: Index, monkeypatch: pytest.MonkeyPatch):
    index.insert(h(1), 10, "ds")
    index.insert(h(2), 20, "ds")
    flight = index.take_flight()
    calls = _fail_once(monkeypatch)
    index.write_flight(flight)
    assert not index.land()
    assert committed(index) == {}
    assert index.pending == 2 and index.size_of(h(1)) == 10
    assert index.flush() == 2
    assert committed(index) == {h(1): (10, 0), h(2): (20, 0)}
    assert calls == [2, 2]


def test_a_row_filled_again_during_a_failed_flight_keeps_its_new_stamp(
        index: Index, monkeypatch: pytest.MonkeyPatch):
    index.insert(h(1), 10, "ds")
    flight = index.take_flight()
    old_stamp = flight.new[0].stamp
    index.insert(h(1), 10, "ds")  # stored again (e.g. evicted and filled) while out
    _fail_once(monkeypatch)
    index.write_flight(flight)
    assert not index.land()
    index.flush()
    with sqlite3.connect(index.path) as other:
        (stamp,) = other.execute("SELECT last_use FROM entries WHERE hash=?", (h(1),)).fetchone()
    assert stamp > old_stamp


def test_pins_and_deletes_during_a_flight_apply_after_it(index: Index):
    index.insert(h(1), 10, "ds")
    index.insert(h(2), 20, "ds")
    flight = index.take_flight()
    threading.Timer(0.1, index.write_flight, args=(flight,)).start()
    assert index.set_pinned([h(1)], True) == 1  # waited for the flight: the row was there
    assert index.delete([h(2)])
    assert committed(index) == {h(1): (10, 1)}
    assert index.pinned_bytes == 10
    assert index.size_of(h(2)) is None


class _Commits(Commits):
    """The cache's committer around one index, nothing else of the cache."""

    def __init__(self, index: Index) -> None:
        self._index = index
        self._nursery = None
        self._dirty = False
        self._init_commits()


async def test_a_flight_starts_before_its_committer_yields(index: Index):
    """Another task may need the writing connection right after the committer took a
    flight, and waits for it without yielding: the flight's thread must already be on its
    way, or the trio thread waits forever (seen: a chunk's pin while a batch landed)."""
    commits = _Commits(index)
    index.insert(h(1), 10, "ds")
    taken: list[object] = []
    take = index.take_flight

    def take_flight():
        taken.append(flight := take())
        return flight

    index.take_flight = take_flight  # type: ignore[method-assign]
    async with trio.open_nursery() as nursery:
        nursery.start_soon(commits._commit_index)
        with trio.fail_after(5):
            while not taken:  # until the committer took the flight and reached an await
                await trio.sleep(0)
        assert taken[0] is not None
        # Blocking the trio thread, as Index.conn does: the flight lands all the same.
        assert index._landed.wait(timeout=10)
        assert index.set_pinned([h(1)], True) == 1
    assert committed(index) == {h(1): (10, 1)}
