"""mountd.store.index and mountd.store.policy on a real SQLite file: schema, LRU order, refs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from mountd.store.index import SCHEMA, Index, IndexCorrupt
from mountd.store.policy import POLICIES, EvictionPolicy, LRUPolicy, make_policy, register_policy
from quiverfs.errors import UsageError


def h(i: int) -> bytes:
    return i.to_bytes(32, "big")


@pytest.fixture
def index(tmp_path: Path):
    idx = Index.open(tmp_path / "index.sqlite")
    yield idx
    idx.close()


def test_every_column_is_commented():
    body = re.findall(r"CREATE TABLE IF NOT EXISTS \w+ \((.*?)\) WITHOUT ROWID", SCHEMA, re.S)
    assert len(body) == 4
    for table in body:
        for line in table.strip().splitlines():
            line = line.strip()
            if line and not line.startswith(("--", "PRIMARY KEY")):
                assert "--" in line, f"uncommented column: {line}"


def test_wal_mode(index: Index):
    assert index.conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_lru_order_and_touch(index: Index):
    for i in range(5):
        index.insert(h(i), 10 * (i + 1), "ds")
    index.touch([h(0), h(2)], None)
    lru = LRUPolicy(index)
    assert [x for x, _ in lru.victims()] == [h(1), h(3), h(4), h(0), h(2)]
    index.set_pinned([h(1)], True)
    assert [x for x, _ in lru.victims()][0] == h(3)
    assert index.totals() == (5, 150)


def test_lru_pages_through_equal_stamps(index: Index):
    index.adopt([(h(i), 1, 42) for i in range(600)])  # all adopted with the same mtime
    lru = LRUPolicy(index)
    assert len(list(lru.victims())) == 600


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
