"""Who may reach what in a cache directory (mountd/store/access.py), whoever starts mountd and
whatever the umask: the store traversable but not listable (``0711`` folders, ``0444`` files),
everything else mountd's own; ``--private-store`` keeps the store private too; an existing
store is given the configured modes once, on open.

An outside check once found ``quiverfs mountd --cache-dir DIR`` made DIR and ``store/`` 0755
and store files 0644: any local user could list every cached hash. docs/operations.md
"Security" says what is made, refused and changed. tests/mountd/test_shared_access.py checks
the same as other users, against a real mountd.
"""

from __future__ import annotations

import logging
import os
import pwd
import sqlite3
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from mountd.errors import CacheDirUnsafe
from mountd.store import layout
from mountd.store.access import check_private
from mountd.store.recovery import STORE_ACCESS

from .conftest import config, running

SOME_BYTES = b"shared content " * 100


def mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def index_files(cache_dir: Path) -> list[Path]:
    index = layout.index_path(cache_dir)
    return [index, index.with_name(index.name + "-wal"), index.with_name(index.name + "-shm")]


def store_modes(cache_dir: Path) -> tuple[set[int], set[int]]:
    """The modes found among the store's fan-out folders, and among its files."""
    dirs, files = set(), set()
    for dirpath, dirnames, filenames in os.walk(cache_dir / "store"):
        dirs.update(mode(Path(dirpath) / d) for d in dirnames)
        files.update(mode(Path(dirpath) / f) for f in filenames)
    return dirs, files


def forget_store_access(cache_dir: Path, value: str | None = None) -> None:
    """Make the index look like an older quiverfs's (no ``store_access``), or say ``value``."""
    conn = sqlite3.connect(layout.index_path(cache_dir))
    if value is None:
        conn.execute("DELETE FROM meta WHERE key=?", (STORE_ACCESS,))
    else:
        conn.execute("UPDATE meta SET value=? WHERE key=?", (value, STORE_ACCESS))
    conn.commit()
    conn.close()


async def test_a_new_cache_is_traversable_not_listable_even_under_umask_0(
        tmp_path, source, backends, open_umask) -> None:
    cache_dir = tmp_path / "srv" / "cache"
    obj = source.add("a.bin", SOME_BYTES)
    async with running(config(cache_dir), backends) as cache:
        path = Path(await cache.ensure(obj.hash, obj.size, obj.location))
        # While open: SQLite's -wal and -shm exist, with the index file's mode (not 0644).
        assert [mode(p) for p in index_files(cache_dir)] == [0o600] * 3
    assert mode(cache_dir) == 0o711
    assert mode(cache_dir / "store") == 0o711 and mode(cache_dir / "tmp") == 0o700
    assert mode(path.parent) == 0o711 and mode(path.parent.parent) == 0o711  # fan-out dirs
    assert mode(path) == 0o444 and path.read_bytes() == SOME_BYTES
    assert mode(cache_dir / "lock") == 0o600 and mode(layout.index_path(cache_dir)) == 0o600
    assert mode(tmp_path / "srv") == 0o777  # parents are not ours to change (umask 0 here)


async def test_a_private_store_stays_mountd_s_own_even_under_umask_0(
        tmp_path, source, backends, open_umask) -> None:
    cache_dir = tmp_path / "cache"
    obj = source.add("a.bin", SOME_BYTES)
    async with running(config(cache_dir, private_store=True), backends) as cache:
        path = Path(await cache.ensure(obj.hash, obj.size, obj.location))
        assert [mode(p) for p in index_files(cache_dir)] == [0o600] * 3
    assert mode(cache_dir) == 0o700
    assert mode(cache_dir / "store") == 0o700 and mode(cache_dir / "tmp") == 0o700
    assert mode(path.parent) == 0o700 and mode(path.parent.parent) == 0o700
    assert mode(path) == 0o400 and path.read_bytes() == SOME_BYTES
    assert mode(cache_dir / "lock") == 0o600


async def test_a_listable_existing_directory_is_made_traversable_only_with_a_warning(
        tmp_path, source, backends, caplog) -> None:
    cache_dir = tmp_path / "cache"
    cache_dir.mkdir()
    os.chmod(cache_dir, 0o755)
    obj = source.add("a.bin", SOME_BYTES)
    with caplog.at_level(logging.WARNING, logger="mountd.store.access"):
        async with running(config(cache_dir), backends) as cache:
            await cache.ensure(obj.hash, obj.size, obj.location)
    assert mode(cache_dir) == 0o711
    warnings = [r.getMessage() for r in caplog.records if r.name == "mountd.store.access"]
    assert warnings == [f"cache directory {cache_dir} was listable by other users (mode 0755); made it 0711"]


def test_a_traversable_directory_is_accepted_as_it_is(tmp_path) -> None:
    cache_dir = tmp_path / "cache"
    cache_dir.mkdir()
    os.chmod(cache_dir, 0o711)
    check_private(cache_dir)
    assert mode(cache_dir) == 0o711  # not "fixed" to 0700


async def test_an_older_index_readable_by_others_is_made_private(tmp_path, source, backends) -> None:
    cache_dir = tmp_path / "cache"
    obj = source.add("a.bin", SOME_BYTES)
    async with running(config(cache_dir), backends) as cache:
        await cache.ensure(obj.hash, obj.size, obj.location)
    os.chmod(layout.index_path(cache_dir), 0o644)  # SQLite's default, as an older quiverfs left it
    os.chmod(cache_dir / "lock", 0o644)
    os.chmod(cache_dir / "tmp", 0o755)
    async with running(config(cache_dir), backends):
        assert [mode(p) for p in index_files(cache_dir)] == [0o600] * 3
    assert mode(cache_dir / "lock") == 0o600 and mode(cache_dir / "tmp") == 0o700


async def test_an_old_private_store_is_made_traversable_once(tmp_path, source, backends) -> None:
    cache_dir = tmp_path / "cache"
    objs = source.many(40, 1000)
    async with running(config(cache_dir, private_store=True), backends) as cache:
        paths = [Path(await cache.ensure(o.hash, o.size, o.location)) for o in objs]
    forget_store_access(cache_dir)  # as a quiverfs before shared stores left it
    assert store_modes(cache_dir) == ({0o700}, {0o400}) and mode(cache_dir / "store") == 0o700

    async with running(config(cache_dir), backends) as cache:
        assert (cache.recovery.access_set, cache.recovery.access_changed) == ("shared", 40)
        assert not cache.recovery.reconciled  # a clean index: the walk is not a reconcile
    assert store_modes(cache_dir) == ({0o711}, {0o444})
    assert mode(cache_dir) == 0o711 and mode(cache_dir / "store") == 0o711
    assert [p.read_bytes() for p in paths] == [o.data for o in objs]

    async with running(config(cache_dir), backends) as cache:  # recorded: no second walk
        assert (cache.recovery.access_set, cache.recovery.access_changed) == ("", 0)


async def test_switching_to_a_private_store_and_back_walks_the_store(tmp_path, source, backends) -> None:
    cache_dir = tmp_path / "cache"
    objs = source.many(10, 1000)
    async with running(config(cache_dir), backends) as cache:
        for o in objs:
            await cache.ensure(o.hash, o.size, o.location)
    async with running(config(cache_dir, private_store=True), backends) as cache:
        assert (cache.recovery.access_set, cache.recovery.access_changed) == ("private", 10)
        new = source.add("new.bin", SOME_BYTES)  # a fill follows store/'s mode
        path = Path(await cache.ensure(new.hash, new.size, new.location))
    assert mode(path) == 0o400
    assert store_modes(cache_dir) == ({0o700}, {0o400})
    assert mode(cache_dir) == 0o700 and mode(cache_dir / "store") == 0o700
    async with running(config(cache_dir), backends) as cache:
        assert (cache.recovery.access_set, cache.recovery.access_changed) == ("shared", 11)
    assert store_modes(cache_dir) == ({0o711}, {0o444})


async def test_a_walk_cut_short_is_redone(tmp_path, source, backends) -> None:
    cache_dir = tmp_path / "cache"
    objs = source.many(10, 1000)
    async with running(config(cache_dir), backends) as cache:
        paths = [Path(await cache.ensure(o.hash, o.size, o.location)) for o in objs]
    # A walk to "private" that stopped half-way, then a restart with the shared store again.
    forget_store_access(cache_dir, "changing")
    for path in paths[:5]:
        os.chmod(path, 0o400)
        os.chmod(path.parent, 0o700)
    async with running(config(cache_dir), backends) as cache:
        assert cache.recovery.access_set == "shared"
    assert store_modes(cache_dir) == ({0o711}, {0o444})


@pytest.mark.parametrize("unsafe", [0o775, 0o757, 0o733])
def test_a_directory_others_can_write_is_refused(tmp_path, unsafe) -> None:
    cache_dir = tmp_path / "cache"
    cache_dir.mkdir()
    os.chmod(cache_dir, unsafe)
    with pytest.raises(CacheDirUnsafe, match=f"writable by other users \\(mode {unsafe:04o}\\)"):
        check_private(cache_dir)
    assert mode(cache_dir) == unsafe  # refused, not changed behind the operator's back


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give the directory away")
def test_a_directory_of_another_user_is_refused(tmp_path) -> None:
    cache_dir = tmp_path / "cache"
    cache_dir.mkdir(mode=0o711)
    nobody = pwd.getpwnam("nobody")
    os.chown(cache_dir, nobody.pw_uid, nobody.pw_gid)
    with pytest.raises(CacheDirUnsafe, match=f"belongs to uid {nobody.pw_uid}"):
        check_private(cache_dir)


def test_quiverfs_mountd_refuses_an_unsafe_directory_with_one_line_and_exit_5(tmp_path) -> None:
    cache_dir = tmp_path / "cache"
    cache_dir.mkdir()
    os.chmod(cache_dir, 0o777)
    done = subprocess.run(
        [sys.executable, "-m", "quiverfs.cli", "mountd", "--cache-dir", str(cache_dir),
         "--cache-size", "16M"],
        capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL, check=False)
    assert done.returncode == 5, done.stderr
    lines = [line for line in done.stderr.splitlines() if "error:" in line]
    assert len(lines) == 1 and "writable by other users (mode 0777)" in lines[0], done.stderr
    assert "Traceback" not in done.stderr
    assert os.listdir(cache_dir) == []  # nothing created in it
