"""Hostile and broken digests are refused with one line and exit code 4, never a traceback."""

from __future__ import annotations

import os
import re
import shutil
import socket
import sqlite3
import subprocess
import sys
from pathlib import Path

import blake3
import pytest
import trio

from digests import digest as digest_module
from digests.digest import Digest
from digests.errors import DigestError
from digests.write import NewFile, write_digest
from mountd.coop.datasets import load_view

DIGESTS_BIN = Path(sys.executable).with_name("digests")


def h(data: bytes) -> bytes:
    return blake3.blake3(data).digest()


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("good") / "good.qd"
    files = [NewFile(f"train/c{i % 7}/f{i:04d}.jpg", i, h(str(i).encode())) for i in range(400)]
    files.append(NewFile("top.txt", 3, h(b"top")))
    write_digest(path, files, ["s3://bucket/ds"])
    return path


@pytest.fixture
def copy(good, tmp_path) -> Path:
    path = tmp_path / "bad.qd"
    shutil.copy(good, path)
    return path


def assert_refused(digest_cli, path, expected: str, *, command=("inspect",)) -> None:
    code, out, err = digest_cli(*command, path)
    assert code == 4, (code, out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("digests: error: invalid digest"), err
    assert expected in lines[0], err
    assert "Traceback" not in err + out


FILE = "(SELECT max(id) FROM files)"

# (tampering SQL, expected fragment of the message)
ROW_CASES = {
    "absolute_name": ([f"UPDATE files SET name = '/etc' WHERE id = {FILE}"], "'/' inside a name"),
    "dotdot_file": (
        [f"UPDATE files SET name = '..' WHERE id = {FILE}"],
        "path component '..' is not allowed",
    ),
    "dot_dir": (["UPDATE dirs SET name = '.' WHERE id = 2"], "path component '.' is not allowed"),
    "empty_name": ([f"UPDATE files SET name = '' WHERE id = {FILE}"], "empty path component"),
    "nul_name": ([f"UPDATE files SET name = 'a' || char(0) || 'b' WHERE id = {FILE}"], "NUL byte"),
    "long_name": (
        [f"UPDATE files SET name = printf('%.300c', 'x') WHERE id = {FILE}"],
        "longer than 255",
    ),
    "file_and_dir": (
        ["UPDATE files SET name = 'train' WHERE name = 'top.txt'"],
        "both a file and a directory",
    ),
    "short_hash": (
        [f"UPDATE files SET hash = zeroblob(31) WHERE id = {FILE}"],
        "content hash is not 32 bytes",
    ),
    "text_hash": (
        [f"UPDATE files SET hash = hex(hash) WHERE id = {FILE}"],
        "content hash is not 32 bytes",
    ),
    "negative_size": (
        [f"UPDATE files SET size = -5, loc_length = -5 WHERE id = {FILE}"],
        "negative or non-integer size",
    ),
    "length_mismatch": (
        [f"UPDATE files SET loc_length = size + 1 WHERE id = {FILE}"],
        "differs from location length",
    ),
    "negative_offset": (
        [f"UPDATE files SET loc_offset = -1 WHERE id = {FILE}"],
        "negative or non-integer location offset",
    ),
    "unknown_source": ([f"UPDATE files SET loc_source = 9 WHERE id = {FILE}"], "unknown source 9"),
    "absolute_key": (
        [f"UPDATE files SET loc_key = '/etc/passwd' WHERE id = {FILE}"],
        "is not a relative path",
    ),
    "dotdot_key": (
        [f"UPDATE files SET loc_key = '../other/x' WHERE id = {FILE}"],
        "is not a relative path",
    ),
    "unknown_dir": ([f"UPDATE files SET dir = 999 WHERE id = {FILE}"], "unknown directory 999"),
    "dir_cycle": (["UPDATE dirs SET parent = 5 WHERE id = 3"], "is not an earlier directory"),
    "unknown_version": (
        ["UPDATE meta SET value = '3' WHERE key = 'format_version'"],
        "unknown format version '3'",
    ),
    "missing_meta": (["DELETE FROM meta WHERE key = 'dataset_id'"], "meta has no 'dataset_id'"),
    "bad_id_meta": (
        ["UPDATE meta SET value = 'xyz' WHERE key = 'dataset_id'"],
        "dataset_id' is not 64",
    ),
    "wrong_count": (["UPDATE meta SET value = '7' WHERE key = 'file_count'"], "meta file_count 7"),
    "missing_table": (["DROP TABLE sources"], "missing table 'sources'"),
    "missing_column": (
        ["ALTER TABLE files DROP COLUMN loc_key"],
        "table 'files' has the wrong columns",
    ),
    "missing_index": (["DROP INDEX files_by_name"], "missing index files_by_name"),
    "non_unique_index": (
        ["DROP INDEX files_by_name", "CREATE INDEX files_by_name ON files (dir, name)"],
        "is not UNIQUE",
    ),
    "duplicate_path": (
        [
            "DROP INDEX files_by_name",
            "INSERT INTO files SELECT max(id) + 1, dir, name, size, hash, loc_source, loc_key, "
            "loc_offset, loc_length FROM files",
        ],
        "missing index files_by_name",
    ),
    "trigger": (
        ["CREATE TRIGGER t AFTER INSERT ON meta BEGIN SELECT 1; END"],
        "unexpected schema object trigger t",
    ),
    "bad_source_url": (["UPDATE sources SET url = 'ftp://x/y'"], "unknown URL scheme 'ftp'"),
}


@pytest.mark.parametrize("case", sorted(ROW_CASES))
def test_row_rules(case, copy, tamper, digest_cli):
    sql, expected = ROW_CASES[case]
    tamper(copy, *sql, fix_meta=case != "wrong_count")
    assert_refused(digest_cli, copy, expected)


def test_empty_directory_refused_in_version_1(copy, tamper, digest_cli):
    tamper(
        copy,
        "INSERT INTO dirs (id, parent, name) VALUES ((SELECT max(id) FROM dirs) + 1, 1, 'zzz')",
        "UPDATE files SET id = id + 1000",
        "UPDATE meta SET value = CAST(value + 1 AS TEXT) WHERE key = 'dir_count'",
        "UPDATE meta SET value = '1' WHERE key = 'format_version'",
    )
    assert_refused(digest_cli, copy, "directory 10 is empty (format version 1")


def test_row_problem_found_lazily_with_structure_check(copy, tamper):
    tamper(copy, f"UPDATE files SET name = '..' WHERE id = {FILE}")
    with Digest.open(copy, check="structure") as d:
        (bad_id,) = sqlite3.connect(copy).execute(f"SELECT {FILE}").fetchone()
        with pytest.raises(DigestError, match="is not allowed"):
            d.entry(bad_id)
        assert d.lookup_path("top.txt").size == 3  # good rows still served


def test_dataset_id_mismatch_found_by_check(copy, tamper, digest_cli):
    tamper(copy, f"UPDATE files SET hash = zeroblob(32) WHERE id = {FILE}")
    code, out, _ = digest_cli("inspect", copy)
    assert code == 0 and "dataset id" in out  # cheap open trusts meta (documented)
    assert_refused(digest_cli, copy, "does not match content", command=("inspect", "--check"))


def test_truncated(copy, digest_cli):
    data = copy.read_bytes()
    copy.write_bytes(data[: len(data) - 4096])
    assert_refused(digest_cli, copy, "truncated")


def test_trailing_garbage(copy, digest_cli):
    with open(copy, "ab") as f:
        f.write(b"x" * 100)
    assert_refused(digest_cli, copy, "corrupted")


def test_corrupted_pages(copy, digest_cli):
    data = bytearray(copy.read_bytes())
    for page in range(1, len(data) // 4096):
        data[page * 4096 : page * 4096 + 100] = b"\xa5" * 100
    copy.write_bytes(bytes(data))
    assert_refused(digest_cli, copy, "corrupted")


def test_not_sqlite(tmp_path, digest_cli):
    path = tmp_path / "notes.qd"
    path.write_text("hello, I am not a database\n" * 10)
    assert_refused(digest_cli, path, "not a SQLite file")


def test_empty_file(tmp_path, digest_cli):
    path = tmp_path / "empty.qd"
    path.write_bytes(b"")
    assert_refused(digest_cli, path, "empty file")


def test_other_sqlite_database(tmp_path, digest_cli):
    path = tmp_path / "other.db"
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE t (x)")
    conn.commit()
    conn.close()
    assert_refused(digest_cli, path, "not a quiverfs digest")


def test_wal_mode(copy, digest_cli):
    conn = sqlite3.connect(copy)
    conn.execute("PRAGMA journal_mode = WAL")
    conn.close()
    assert_refused(digest_cli, copy, "WAL mode")


def test_missing_file_is_usage_error(tmp_path, digest_cli):
    code, _, err = digest_cli("inspect", tmp_path / "nope.qd")
    assert (
        code == 2 and err.strip() == f"digests: error: no such digest file: {tmp_path / 'nope.qd'}"
    )


@pytest.mark.parametrize("command", [("verify",), ("diff", "{good}"), ("inspect", "--json")])
def test_every_command_refuses(command, copy, good, tamper, digest_cli):
    tamper(copy, f"UPDATE files SET loc_offset = -1 WHERE id = {FILE}")
    args = [a.format(good=good) for a in command]
    assert_refused(digest_cli, copy, "location offset", command=args)


def test_console_script_one_line(copy, tamper):
    """The installed console script, in a real process: one line, exit 4."""
    tamper(copy, f"UPDATE files SET name = '..' WHERE id = {FILE}")
    proc = subprocess.run(
        [DIGESTS_BIN, "inspect", copy], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 4
    assert len(proc.stderr.strip().splitlines()) == 1
    assert "Traceback" not in proc.stderr and "is not allowed" in proc.stderr


# -- hostile digests that the cheap open (check="structure") must refuse ------------------------
# The mount and mountd open with check="structure", then read rows without the per-row check
# (mountd scans every hash and size in SQL; Python's sqlite3 fails on text it cannot decode),
# so these are refused by every open, not only by the CLI's row scan.

STRUCTURE_CASES = {
    "utf8_file_name": (
        [f"UPDATE files SET name = CAST(X'66ff6f' AS TEXT) WHERE id = {FILE}"],
        "name is not valid UTF-8",
    ),
    "utf8_surrogate_name": (
        [f"UPDATE files SET name = CAST(X'61eda080' AS TEXT) WHERE id = {FILE}"],
        "name is not valid UTF-8",
    ),
    "utf8_after_nul": (
        [f"UPDATE files SET name = CAST(X'6100ff' AS TEXT) WHERE id = {FILE}"],
        "name is not valid UTF-8",
    ),
    "utf8_dir_name": (
        ["UPDATE dirs SET name = CAST(X'c3' AS TEXT) WHERE id = 2"],
        "directory 2: name is not valid UTF-8",
    ),
    "utf8_location_key": (
        [f"UPDATE files SET loc_key = CAST(X'782f80' AS TEXT) WHERE id = {FILE}"],
        "location key is not valid UTF-8",
    ),
    "utf8_source_url": (
        ["UPDATE sources SET url = CAST(X'66696c653a2f2f2f78ff' AS TEXT)"],
        "text that is not valid UTF-8",
    ),
    "utf8_meta": (
        ["UPDATE meta SET value = CAST(X'ff' AS TEXT) WHERE key = 'generator'"],
        "text that is not valid UTF-8",
    ),
    "text_hash": (
        [f"UPDATE files SET hash = hex(hash) WHERE id = {FILE}"],
        "content hash is not 32 bytes",
    ),
    "text_hash_of_32_characters": (
        [f"UPDATE files SET hash = substr(hex(hash), 1, 32) WHERE id = {FILE}"],
        "content hash is not 32 bytes",
    ),
    "text_size": (
        [f"UPDATE files SET size = 'big', loc_length = 'big' WHERE id = {FILE}"],
        "negative or non-integer size 'big'",
    ),
    "text_directory": (
        [f"UPDATE files SET dir = 'train' WHERE id = {FILE}"],
        "unknown directory 'train'",
    ),
    "blob_name": (
        [f"UPDATE files SET name = CAST(name AS BLOB) WHERE id = {FILE}"],
        "name is not text",
    ),
    "blob_name_not_utf8": (
        [f"UPDATE files SET name = X'ff' WHERE id = {FILE}"],
        "name is not text",
    ),
    "blob_key_not_utf8": (
        [f"UPDATE files SET loc_key = X'ff' WHERE id = {FILE}"],
        "a location key is not text",
    ),
}


@pytest.mark.parametrize("case", sorted(STRUCTURE_CASES))
def test_cheap_open_refuses(case, copy, tamper, digest_cli):
    sql, expected = STRUCTURE_CASES[case]
    tamper(copy, *sql, fix_meta=case != "text_size")  # a text size makes sum() a float
    with pytest.raises(DigestError, match="invalid digest .*" + re.escape(expected)):
        Digest.open(copy, check="structure").close()
    assert_refused(digest_cli, copy, expected)


def test_mountd_registration_refuses_undecodable_names(copy, tamper):
    """mountd's dataset loading opens through Digest.open: one DigestError, no traceback."""
    tamper(copy, "UPDATE dirs SET name = CAST(X'74ff' AS TEXT) WHERE id = 2")
    (dataset,) = sqlite3.connect(copy).execute(
        "SELECT value FROM meta WHERE key = 'dataset_id'"
    ).fetchone()
    with pytest.raises(DigestError, match="directory 2: name is not valid UTF-8"):
        trio.run(load_view, dataset, copy)


def _deep_chain(depth: int, name: str = "d") -> list[str]:
    """SQL adding directories ``name/name/...`` ``depth`` deep below the root, moving the last
    file into the deepest one (file ids move past the new directory ids)."""
    return [
        "UPDATE files SET id = id + 100000",
        f"WITH RECURSIVE c(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM c WHERE i < {depth}) "
        "INSERT INTO dirs (id, parent, name) SELECT (SELECT max(id) FROM dirs) + i, "
        f"CASE WHEN i = 1 THEN 1 ELSE (SELECT max(id) FROM dirs) + i - 1 END, '{name}' FROM c",
        "UPDATE meta SET value = (SELECT count(*) FROM dirs) WHERE key = 'dir_count'",
        "UPDATE files SET id = (SELECT count(*) FROM dirs) + 1 + id - (SELECT min(id) FROM files)",
        f"UPDATE files SET dir = (SELECT max(id) FROM dirs) WHERE id = {FILE}",
    ]


@pytest.mark.parametrize("depth", [2049, 10_000])
def test_too_deep_directory_refused(depth, copy, tamper, digest_cli):
    tamper(copy, *_deep_chain(depth))
    # 'd/' * 2048 + 'd' is 4097 bytes: the 2049th level is the first too long.
    with pytest.raises(DigestError, match=r"directory \d+: path longer than 4096 bytes"):
        Digest.open(copy, check="structure").close()
    assert_refused(digest_cli, copy, "path longer than 4096 bytes")


def test_too_long_file_path_refused(copy, tamper, digest_cli):
    # A directory path of 3999 bytes is allowed; a 97-byte name below it is not.
    tamper(copy, *_deep_chain(20, "x" * 199), f"UPDATE files SET name = printf('%.97c', 'f') "
           f"WHERE id = {FILE}")
    with pytest.raises(DigestError, match=r"file \d+: path longer than 4096 bytes"):
        Digest.open(copy, check="structure").close()
    assert_refused(digest_cli, copy, "path longer than 4096 bytes")


def test_path_of_exactly_4096_bytes_is_served(copy, tamper):
    tamper(copy, *_deep_chain(20, "x" * 199), f"UPDATE files SET name = printf('%.96c', 'f') "
           f"WHERE id = {FILE}")
    with Digest.open(copy, check="rows") as d:
        (file_id,) = sqlite3.connect(copy).execute(f"SELECT {FILE}").fetchone()
        entry = d.entry(file_id)
        assert len(entry.path.encode()) == 4096
        assert d.lookup_path(entry.path) == entry


def test_directory_path_cache_is_bounded(copy, tamper, monkeypatch):
    """A deep tree cannot make a process hold depth² bytes of cached paths."""
    tamper(copy, *_deep_chain(2000))
    monkeypatch.setattr(digest_module, "DIR_PATH_CACHE_BYTES", 50_000)
    with Digest.open(copy) as d:
        deepest = d.dir_count
        for dir_id in (deepest, deepest - 1, deepest // 2, deepest):
            depth = dir_id - (deepest - 2000)
            assert d.dir_path(dir_id) == "/".join(["d"] * depth)
            assert d._dir_paths_bytes <= 50_000
            overhead = digest_module._CACHE_ENTRY_OVERHEAD
            assert sum(len(p) + overhead for p in d._dir_paths.values()) == d._dir_paths_bytes
        assert d.lookup_path("/".join(["d"] * 2000)).id == deepest


# -- files that are not regular files: refused before anything opens them ----------------------


def test_fifo_refused_without_blocking(tmp_path):
    fifo = tmp_path / "fifo.qd"
    os.mkfifo(fifo)
    # In a subprocess with a deadline: a regression would block in open() forever.
    proc = subprocess.run(
        [DIGESTS_BIN, "inspect", fifo], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 4, proc
    assert proc.stderr.strip() == f"digests: error: invalid digest {fifo}: not a regular file (a FIFO)"


def test_socket_and_device_refused(tmp_path, digest_cli):
    sock_path = tmp_path / "sock.qd"
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(sock_path))
        assert_refused(digest_cli, sock_path, "not a regular file (a socket)")
    assert_refused(digest_cli, "/dev/null", "not a regular file (a character device)")


def test_directory_is_usage_error(tmp_path, digest_cli):
    code, _, err = digest_cli("inspect", tmp_path)
    assert code == 2 and err.strip() == f"digests: error: digest path is a directory: {tmp_path}"
