"""mountd.store.index and mountd.store.policy on a real SQLite file: schema, LRU order, refs;
and the group commit written in a worker thread (``Index.take_flight``), with real threads:
while a flight is out its rows are looked up in memory, the committed rows through a
read-only connection, anything that needs the writing connection waits for it to land, and
a failed flight gives its rows back to the group commit."""

from __future__ import annotations

import re
import sqlite3
import threading
import time
from pathlib import Path

import pytest
import trio

from mountd.stats.counters import Counters
from mountd.store.commits import Commits
from mountd.store.index import BATCH, FIRST_LRU_PAGE, WAL_BYTES, Index, IndexCorrupt
from mountd.store.policy import POLICIES, EvictionPolicy, LRUPolicy, make_policy, register_policy
from mountd.store.schema import SCHEMA
from quiverfs.base.errors import UsageError


def h(i: int) -> bytes:
    return i.to_bytes(32, "big")


@pytest.fixture
def index(tmp_path: Path):
    idx = Index.open(tmp_path / "index.sqlite")
    yield idx
    idx.close()


def test_every_column_is_commented():
    body = re.findall(r"CREATE TABLE IF NOT EXISTS \w+ \((.*?)\) WITHOUT ROWID", SCHEMA, re.S)
    assert len(body) == 5
    for table in body:
        for line in table.strip().splitlines():
            line = line.strip()
            if line and not line.startswith(("--", "PRIMARY KEY")):
                assert "--" in line, f"uncommented column: {line}"


def test_wal_mode(index: Index):
    assert index.conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_a_write_ahead_log_that_grew_is_cut_back_when_it_restarts(index: Index, tmp_path: Path):
    """A checkpoint that falls behind grows the WAL; once folded, the next write restarts it
    and SQLite truncates the file to ``WAL_BYTES`` rather than keeping its high-water mark."""
    wal = tmp_path / "index.sqlite-wal"
    for n in range(3_000):  # one commit each, none folded back: the log only grows
        index.insert(h(n), 4096, "ds")
        index.flush()
    grown = wal.stat().st_size
    assert grown > 2 * WAL_BYTES
    index.fold_wal()
    index.insert(h(10**6), 4096, "ds")
    index.flush()
    assert wal.stat().st_size <= WAL_BYTES
    assert index.size_of(h(2_999)) == 4096 and index.size_of(h(10**6)) == 4096


def test_lru_order_and_touch(index: Index):
    for i in range(5):
        index.insert(h(i), 10 * (i + 1), "ds")
    index.touch([h(0), h(2)], None)
    lru = LRUPolicy(index)
    assert [x for x, _ in lru.victims()] == [h(1), h(3), h(4), h(0), h(2)]
    index.set_pinned([h(1)], True)
    assert [x for x, _ in lru.victims()][0] == h(3)
    assert index.totals() == (5, 150)


def test_files_a_reader_is_done_with_go_first_newest_first(index: Index):
    # A shuffled reader's epochs over a larger dataset (docs/mount.md "The sweep"): what it
    # read this epoch goes before what it read last epoch and will read again.
    for i in range(6):
        index.insert(h(i), 10, "ds")
    lru = LRUPolicy(index)
    lru.on_read_done([(h(4), 10), (h(1), 10), (h(3), 10)])
    assert [x for x, _ in lru.victims()] == [h(3), h(1), h(4), h(0), h(2), h(5)]
    lru.on_read_done([(h(1), 10)])  # read again: the newest
    lru.on_access([h(3)])  # anyone's access: an ordinary file again
    index.touch([h(3)], None)
    index.set_pinned([h(4)], True)  # never offered, done or not
    lru.on_remove([h(0)])
    assert [x for x, _ in lru.victims()][:2] == [h(1), h(0)]
    assert h(4) not in [x for x, _ in lru.victims()]
    assert list(lru.done) == [h(4), h(1)]


def _stored_pins(index: Index) -> dict[bytes, int]:
    return dict(index.conn.execute("SELECT hash, pinned FROM entries").fetchall())


def test_a_row_pinned_before_it_is_written_is_written_pinned_with_its_batch(index: Index):
    """A loading chunk pins each file as it lands: the pin rides on the row's group commit
    instead of a transaction of its own, and counts in ``pinned_bytes`` at once."""
    index.insert(h(0), 10, "ds")
    index.flush()
    index.insert(h(1), 20, "ds")
    index.insert(h(2), 40, "ds")
    assert index.set_pinned([h(1)], True) == 1
    assert index.pending == 2  # nothing written: both rows still wait for the group commit
    assert index.pinned_bytes == 20
    assert index.set_pinned([h(1)], True) == 1 and index.pinned_bytes == 20  # counted once
    assert [x for x, _ in LRUPolicy(index).victims()] == [h(0), h(2)]
    assert _stored_pins(index) == {h(0): 0, h(1): 1, h(2): 0}
    assert index.pinned_bytes == 20


def test_pins_of_written_and_unwritten_rows_together(index: Index):
    index.insert(h(0), 10, "ds")
    index.flush()
    index.insert(h(1), 20, "ds")
    assert index.set_pinned([h(0), h(1), h(9)], True) == 2  # h(9) is not indexed
    assert _stored_pins(index) == {h(0): 1, h(1): 1} and index.pinned_bytes == 30
    assert index.set_pinned([h(0), h(1)], False) == 2
    assert _stored_pins(index) == {h(0): 0, h(1): 0} and index.pinned_bytes == 0


def test_an_unwritten_pinned_row_unpinned_before_its_batch(index: Index):
    index.insert(h(1), 20, "ds")
    index.set_pinned([h(1)], True)
    assert index.set_pinned([h(1)], False) == 1
    assert _stored_pins(index) == {h(1): 0} and index.pinned_bytes == 0


def test_a_row_left_by_a_delete_is_pinned_in_the_table(index: Index):
    """A row a delete could not remove yet is replaced by a new insert of its hash; a pin
    then goes through the table, so the old row's own pin is not counted twice."""
    index.insert(h(1), 20, "ds")
    index.set_pinned([h(1)], True)
    index.flush()
    index.deleting.add(h(1))  # as a delete on a full disk leaves it
    index.insert(h(1), 20, "ds")
    assert index.set_pinned([h(1)], True) == 1
    assert _stored_pins(index) == {h(1): 1} and index.pinned_bytes == 20
    assert index.delete([h(1)]) is True and index.pinned_bytes == 0


def test_a_pinned_row_inserted_again_keeps_its_pin(index: Index):
    index.insert(h(1), 20, "ds")
    index.set_pinned([h(1)], True)
    index.insert(h(1), 20, "ds")
    assert _stored_pins(index) == {h(1): 1} and index.pinned_bytes == 20
    assert index.delete([h(1)]) is True and index.pinned_bytes == 0


def _stored_last_use(index: Index, hash: bytes) -> int:
    return index.conn.execute("SELECT last_use FROM entries WHERE hash=?", (hash,)).fetchone()[0]


def test_hits_are_noted_in_memory_and_written_once(index: Index):
    for i in range(3):
        index.insert(h(i), 1, "ds")
    before = _stored_last_use(index, h(0))
    index.touch([h(0)], "other")
    index.touch([h(0), h(1)], None)
    assert index.touches_waiting == 2
    assert _stored_last_use(index, h(0)) == before  # no SQLite work per hit
    assert index.write_touches(1) == 1  # the least recent: h(0), hit twice, written once
    assert index.touches_waiting == 1
    assert _stored_last_use(index, h(0)) > _stored_last_use(index, h(2))
    assert _stored_last_use(index, h(1)) < _stored_last_use(index, h(2))  # still in memory
    assert index.refs_of([h(0)]) == {h(0): ["ds", "other"]}


def test_eviction_order_counts_hits_in_memory_and_writes_only_the_cold_end(index: Index):
    for i in range(600):  # more than a page of LRUPolicy
        index.insert(h(i), 1, None)
    index.touch([h(0), h(5)], None)
    index.touch([h(3)], None)
    index.touch([h(599)], None)
    lru = LRUPolicy(index)
    victims = lru.victims()
    assert [next(victims)[0] for _ in range(3)] == [h(1), h(2), h(4)]
    # Meeting h(0) and h(3) at the cold end wrote their recency; h(599) was never met.
    assert index.touches_waiting == 1
    order = [x for x, _ in lru.victims()]
    assert order[-4:] == [h(0), h(5), h(3), h(599)]
    assert len(order) == 600
    assert index.touches_waiting == 0


def test_a_hit_while_eviction_walks_makes_the_file_recent(index: Index):
    for i in range(3):
        index.insert(h(i), 1, None)
    victims = LRUPolicy(index).victims()
    assert next(victims)[0] == h(0)
    index.touch([h(1)], None)
    assert [x for x, _ in victims] == [h(2)]


@pytest.mark.parametrize("reader", ["refs_of", "exclusive_to", "dataset_usage", "write"])
def test_every_reader_of_refs_sees_references_hits_added(index: Index, reader: str):
    for i in range(3):
        index.insert(h(i), 1, "a")
    index.touch([h(0)], "b")
    if reader == "refs_of":
        assert index.refs_of([h(0)]) == {h(0): ["a", "b"]}
    elif reader == "exclusive_to":
        assert sorted(index.exclusive_to("a")) == [(h(1), 1), (h(2), 1)]
    elif reader == "dataset_usage":
        assert index.dataset_usage()["b"]["entries"] == 1
    else:
        index.flush()  # h(2) written: its pin is a write of the table
        index.set_pinned([h(2)], True)  # any other write writes them first
        assert index.conn.execute("SELECT COUNT(*) FROM refs WHERE dataset='b'").fetchone()[0] == 1


def test_a_reference_is_queued_once_per_dataset(index: Index):
    index.insert(h(0), 1, "a")
    index.touch([h(0)], "b")
    assert index.write_refs() == 1
    index.touch([h(0)], "b")
    assert index.write_refs() == 0  # already recorded: repeated hits cost no SQLite work


def _refs(index: Index) -> set[tuple[str, bytes]]:
    return set(index.conn.execute("SELECT dataset, hash FROM refs"))


def test_a_hit_of_a_file_just_stored_queues_no_reference(index: Index):
    """A cold pass reads the files read-ahead just stored: their rows came with their
    dataset's reference, so the hit queues nothing (no write, no commit on the trio thread);
    another dataset's hit still does, and so does a hit after the references were dropped."""
    index.insert(h(0), 1, "a")
    index.insert(h(1), 1, None)
    index.flush()
    index.touch([h(0)], "a")
    assert index.write_refs() == 0
    index.touch([h(1)], "a")  # stored for no dataset: "a"'s reference is news
    index.touch([h(0)], "b")
    assert index.write_refs() == 2
    assert _refs(index) == {("a", h(0)), ("a", h(1)), ("b", h(0))}
    index.insert(h(2), 1, "a")  # stored, never hit before its reference is dropped
    index.flush()
    index.drop_refs("a", keep_pinned=False)
    assert _refs(index) == {("b", h(0))}
    index.touch([h(0), h(1), h(2)], "a")
    assert index.write_refs() == 3
    assert _refs(index) == {("a", h(0)), ("a", h(1)), ("a", h(2)), ("b", h(0))}


def test_a_noted_hit_never_moves_a_newer_fill_back(index: Index):
    index.insert(h(0), 1, None)
    index.touch([h(0)], None)
    index.insert(h(0), 1, None)  # stored again (a refill), stamped after the hit
    refilled = _stored_last_use(index, h(0))
    index.write_touches(1)
    assert _stored_last_use(index, h(0)) == refilled


def test_hits_of_deleted_entries_are_dropped(index: Index):
    index.insert(h(0), 1, "a")
    index.touch([h(0)], "b")
    index.delete([h(0)])
    assert index.touches_waiting == 0
    assert index.size_of(h(0)) is None
    assert index.refs_of([h(0)]) == {}


def test_close_writes_noted_hits(tmp_path: Path):
    idx = Index.open(tmp_path / "index.sqlite")
    idx.insert(h(0), 1, None)
    idx.insert(h(1), 1, None)
    idx.touch([h(0)], "b")
    idx.close()
    idx = Index.open(tmp_path / "index.sqlite")
    try:
        assert [row[0] for row in idx.lru(10)] == [h(1), h(0)]
        assert idx.refs_of([h(0)]) == {h(0): ["b"]}
    finally:
        idx.close()


def test_lru_pages_through_equal_stamps(index: Index):
    index.adopt([(h(i), 1, 42) for i in range(600)])  # all adopted with the same mtime
    lru = LRUPolicy(index)
    assert len(list(lru.victims())) == 600


def test_lru_reads_a_small_page_first_and_larger_ones_as_the_search_goes_on(index: Index):
    """One eviction per fill needs one victim: the first page is small, later ones grow to
    the policy's page, and every row still comes once, oldest first."""
    index.adopt([(h(i), 1, i) for i in range(600)])
    asked: list[int] = []
    real_lru = index.lru

    def counting_lru(limit: int, after=(-1, b"")):
        asked.append(limit)
        return real_lru(limit, after)

    index.lru = counting_lru  # type: ignore[method-assign]
    victims = LRUPolicy(index).victims()
    assert next(victims) == (h(0), 1)
    assert asked == [FIRST_LRU_PAGE]
    rest = list(victims)
    assert [v for v, _ in rest] == [h(i) for i in range(1, 600)]
    assert asked[:4] == [FIRST_LRU_PAGE, 4 * FIRST_LRU_PAGE, 16 * FIRST_LRU_PAGE, LRUPolicy.page]
    assert max(asked) == LRUPolicy.page


def test_refs_exclusive_and_dangling(index: Index):
    index.insert(h(1), 1, "a")
    index.insert(h(2), 1, "a")
    index.touch([h(2)], "b")
    assert index.exclusive_to("a") == [(h(1), 1)]
    assert index.refs_of([h(2)]) == {h(2): ["a", "b"]}
    index.conn.execute("DELETE FROM entries WHERE hash=?", (h(1),))
    assert index.drop_dangling_refs() == 1
    assert index.dataset_usage()["a"]["entries"] == 1


def test_failed_transaction_rolls_back(index: Index):
    with pytest.raises(RuntimeError), index.transaction() as c:
        c.execute("INSERT INTO entries VALUES (?, 1, 1, 1, 0)", (h(9),))
        raise RuntimeError("boom")
    assert index.size_of(h(9)) is None
    index.insert(h(9), 3, None)  # no transaction left open
    assert index.size_of(h(9)) == 3


def test_garbage_file_is_reported_corrupt(tmp_path: Path):
    path = tmp_path / "index.sqlite"
    path.write_bytes(b"not a database at all" * 100)
    with pytest.raises(IndexCorrupt):
        Index.open(path)


def test_policy_registry(index: Index):
    assert isinstance(make_policy("lru", index), LRUPolicy)
    with pytest.raises(UsageError, match="unknown eviction policy"):
        make_policy("nope", index)

    @register_policy
    class Biggest(EvictionPolicy):
        name = "biggest-test"

        def victims(self):
            return iter(sorted(self.index.evictable(), key=lambda r: -r[1]))

    try:
        index.insert(h(1), 5, None)
        index.insert(h(2), 50, None)
        assert next(make_policy("biggest-test", index).victims()) == (h(2), 50)
    finally:
        POLICIES.pop("biggest-test")


def test_absent_answers_as_size_of_does_with_one_query_for_the_unknown(index: Index):
    """``absent`` (a prefetch request's lookup) agrees with ``size_of`` for rows written,
    rows waiting for their batch, rows being deleted and hashes never seen, across more
    unknown hashes than one query takes, in the order asked."""
    written = [h(i) for i in range(10)]
    for i, content in enumerate(written):
        index.insert(content, 100 + i, "ds")
    index.flush()
    index._known.clear()  # the written rows must come from SQLite
    waiting = [h(100 + i) for i in range(3)]
    for content in waiting:
        index.insert(content, 5, "ds")
    index.delete([written[0]])
    never = [h(1000 + i) for i in range(BATCH + 7)]
    asked = [never[0], *written, never[1], *waiting, *never[2:]]
    statements: list[str] = []
    index._conn.set_trace_callback(statements.append)
    try:
        got = index.absent(asked)
    finally:
        index._conn.set_trace_callback(None)
    assert got == [never[0], written[0], never[1], *never[2:]]
    assert got == [content for content in asked if index.size_of(content) is None]
    assert sum("SELECT hash, size FROM entries" in s for s in statements) == 2  # BATCH + 16
    assert index.size_of(written[5]) == 105


# -- the group commit in a worker thread ----------------------------------------------------


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
    # Not waiting any more, but not committed either until the flight lands (a process
    # killed now loses them: tests/mountd/durability_worker.py waits on uncommitted).
    assert index.pending == 0 and index.uncommitted == 2
    thread = threading.Thread(target=index.write_flight, args=(flight,))
    thread.start()
    thread.join()
    assert index.land() and index.uncommitted == 0
    assert committed(index) == {h(1): (10, 0), h(2): (20, 0), h(3): (30, 0)}
    with sqlite3.connect(index.path) as other:
        assert other.execute("SELECT COUNT(*) FROM refs").fetchone()[0] == 2
        assert other.execute("SELECT COUNT(*) FROM owners").fetchone()[0] == 2
    assert index.take_flight() is None  # nothing left to commit


@pytest.mark.parametrize("folder", ["plain", "odd ?#% name"])
def test_rows_out_on_a_flight_are_found_without_waiting_for_it(tmp_path: Path, folder: str):
    (tmp_path / folder).mkdir()
    index = Index.open(tmp_path / folder / "index.sqlite")
    try:
        _lookups_during_a_flight(index)
    finally:
        index.close()


def _lookups_during_a_flight(index: Index) -> None:
    index.insert(h(1), 10, "ds")
    index.flush()
    index._known.clear()  # h(1) must come from the table
    index.insert(h(2), 20, "ds")
    flight = index.take_flight()
    assert flight is not None
    try:
        # The flight has not started: a lookup through the writing connection would wait
        # for it forever.
        assert index.size_of(h(2)) == 20
        assert index.size_of(h(1)) == 10
        assert index.size_of(h(9)) is None
        assert index.absent([h(9), h(1), h(2), h(8)]) == [h(9), h(8)]
    finally:
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
        self.counters = Counters()
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
    # The commit's time shows as the "commit" stage of quiverfs stats, one row observed.
    commit = commits.counters.snapshot()["fill_stages"]["stages"]["commit"]
    assert commit["count"] == 1 and commit["wall_s"] > 0 and commit["cpu_s"] > 0


async def test_a_flight_lands_even_when_no_thread_can_be_started(
        index: Index, monkeypatch: pytest.MonkeyPatch):
    """Nothing may be left waiting for a flight that never flew: without a thread the
    committer writes it itself, and the failure still shows."""
    commits = _Commits(index)
    index.insert(h(1), 10, "ds")

    def no_thread(*_args, **_kwargs):
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(trio.lowlevel, "start_thread_soon", no_thread)
    with pytest.raises(RuntimeError, match="new thread"):
        await commits._commit_index()
    assert index.land()
    assert committed(index) == {h(1): (10, 0)}
