"""The cache directory is private to mountd's user, whoever starts mountd and whatever the umask.

An outside check found ``quiverfs mountd --cache-dir DIR`` (the documented service way) made
DIR and ``store/`` 0755 and store files 0644: any local user could list every cached hash and
read every cached file. docs/operations.md "Security" says what is made, refused and tightened.
"""

from __future__ import annotations

import logging
import os
import pwd
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from mountd.errors import CacheDirUnsafe
from mountd.store.disk import check_private

from .conftest import config, running

SOME_BYTES = b"private content " * 100


def mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.fixture
def open_umask():
    """The widest umask a careless service unit could have."""
    old = os.umask(0)
    yield
    os.umask(old)


async def test_a_new_cache_is_private_even_under_umask_0(tmp_path, source, backends, open_umask) -> None:
    cache_dir = tmp_path / "srv" / "cache"
    obj = source.add("a.bin", SOME_BYTES)
    async with running(config(cache_dir), backends) as cache:
        path = Path(await cache.ensure(obj.hash, obj.size, obj.location))
    assert mode(cache_dir) == 0o700
    assert mode(cache_dir / "store") == 0o700 and mode(cache_dir / "tmp") == 0o700
    assert mode(path.parent) == 0o700 and mode(path.parent.parent) == 0o700  # fan-out dirs
    assert mode(path) == 0o400 and path.read_bytes() == SOME_BYTES
    assert mode(cache_dir / "lock") == 0o600
    assert mode(tmp_path / "srv") == 0o777  # parents are not ours to change (umask 0 here)


async def test_a_readable_existing_directory_is_made_private_with_a_warning(
        tmp_path, source, backends, caplog) -> None:
    cache_dir = tmp_path / "cache"
    cache_dir.mkdir()
    os.chmod(cache_dir, 0o755)
    obj = source.add("a.bin", SOME_BYTES)
    with caplog.at_level(logging.WARNING, logger="mountd.store.disk"):
        async with running(config(cache_dir), backends) as cache:
            await cache.ensure(obj.hash, obj.size, obj.location)
    assert mode(cache_dir) == 0o700
    warnings = [r.getMessage() for r in caplog.records if r.name == "mountd.store.disk"]
    assert warnings == [f"cache directory {cache_dir} was readable by other users (mode 0755); made it 0700"]


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
    cache_dir.mkdir(mode=0o700)
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
