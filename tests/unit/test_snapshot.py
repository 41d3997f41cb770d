"""A mount's private copy of its digest (quiverfs/filesystem/snapshot.py), without mounting: the
copy is the file's bytes, locked while alive and removed after; what is not a regular file is
refused at once; errors name the user's file; copies of dead mounts are cleaned up."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

import blake3
import pytest

from digests.errors import DigestError
from digests.write import NewFile, write_digest
from quiverfs.base.errors import UsageError
from quiverfs.filesystem.snapshot import SNAPSHOT_DIR, Snapshot, remove_stale


@pytest.fixture
def digest(tmp_path: Path) -> Path:
    path = tmp_path / "d.qd"
    data = {"a/x": b"x" * 10, "b": b"bee"}
    write_digest(path, [NewFile(p, len(d), blake3.blake3(d).digest()) for p, d in data.items()],
                 ["file:///src"])
    return path


def _locked(path: Path) -> bool:
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def test_the_copy_is_served_and_removed(tmp_path, digest) -> None:
    cache = tmp_path / "cache"
    snapshot = Snapshot.take(digest, cache)
    try:
        assert snapshot.path.parent == cache / SNAPSHOT_DIR
        assert (cache / SNAPSHOT_DIR).stat().st_mode & 0o777 == 0o700
        assert snapshot.path.stat().st_mode & 0o777 == 0o600
        assert snapshot.path.read_bytes() == digest.read_bytes()
        assert _locked(snapshot.path)
        os.truncate(digest, 0)  # the user's file may change now: the copy is what is open
        with snapshot.open() as opened:
            assert opened.path == os.fspath(snapshot.path)
            assert opened.file_count == 2
            assert opened.lookup_path("a/x").size == 10
    finally:
        snapshot.remove()
    assert not snapshot.path.exists()
    snapshot.remove()  # twice is fine


def test_an_invalid_digest_is_reported_under_its_own_name(tmp_path) -> None:
    bad = tmp_path / "bad.qd"
    bad.write_bytes(b"SQLite format 3\x00" + b"\x00" * 200)
    snapshot = Snapshot.take(bad, tmp_path / "cache")
    try:
        with pytest.raises(DigestError) as caught:
            snapshot.open()
        assert str(bad) in str(caught.value) and SNAPSHOT_DIR not in str(caught.value)
        assert caught.value.exit_code == 4
    finally:
        snapshot.remove()


def test_what_is_not_a_regular_file_is_refused_at_once(tmp_path) -> None:
    fifo = tmp_path / "fifo.qd"
    os.mkfifo(fifo)
    cache = tmp_path / "cache"
    with pytest.raises(DigestError, match=r"not a regular file \(a FIFO\)"):
        Snapshot.take(fifo, cache)  # no writer: opening it must not wait for one
    with pytest.raises(UsageError, match="digest path is a directory"):
        Snapshot.take(tmp_path, cache)
    with pytest.raises(UsageError, match="no such digest file"):
        Snapshot.take(tmp_path / "missing.qd", cache)
    assert os.listdir(cache / SNAPSHOT_DIR) == []


def test_copies_of_dead_mounts_are_removed(tmp_path, digest) -> None:
    directory = tmp_path / "cache" / SNAPSHOT_DIR
    directory.mkdir(parents=True)
    (directory / "1-dead.qd").write_bytes(b"stale")
    alive = Snapshot.take(digest, tmp_path / "cache")
    try:
        assert not (directory / "1-dead.qd").exists()  # taking a copy sweeps first
        (directory / "2-dead.qd").write_bytes(b"stale")
        assert remove_stale(directory) == 1
        assert sorted(os.listdir(directory)) == [alive.path.name]  # the live one is locked
    finally:
        alive.remove()
