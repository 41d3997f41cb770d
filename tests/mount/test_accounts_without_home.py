"""An account without a home mounts, reads and unmounts (issue 36, "Hard conditions").

Service accounts in containers and batch systems often have no home: ``useradd --system``
gives ``/nonexistent``, which is what the throwaway user here has. Before the fallback,
``quiverfs mount`` died with ``internal error: PermissionError: ... '/nonexistent'``. Now its
state goes to a private ``0700`` folder under the temporary directory (docs/operations.md
"Where state lives"), a folder somebody else made there first is refused with one line, and
everything runs as the real user: the detached mount, the mountd it starts on demand, the
reads, ``quiverfs mounts`` and ``quiverfs umount``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
import zoneinfo  # noqa: F401  (a lazy import of the CLI; the children cannot read /root)
from collections.abc import Iterator
from pathlib import Path

import pytest

from quiverfs.testing.users import LocalUser, LocalUsers, interpreter_reachable
from tests.mount.conftest import (
    REPO,
    MountdProcess,
    build_digest,
    force_unmount,
    is_mounted,
    stop_mountd_of,
    wait_for,
    write_tree,
)

pytestmark = [pytest.mark.mount, pytest.mark.usefixtures("fuse")]

if os.geteuid() != 0:
    pytest.skip("creates a local user and changes uids: needs root", allow_module_level=True)

FILES = {"train/cat/1.jpg": b"\xff\xd8 a cat " * 500, "train/dog/2.jpg": b"\xff\xd8 a dog " * 700,
         "README": b"no home needed\n"}


@pytest.fixture(scope="module")
def world(dev_fuse_for_users: None, local_users: LocalUsers) -> Iterator[dict]:
    """A user without a home, a digest of a tree it may read, and a temporary directory of
    the module's own standing in for /tmp (so that the real one is left alone)."""
    user = local_users.user("qfs_test_nohome")
    assert not os.path.exists(Path(os.path.expanduser(f"~{user.name}")))  # /nonexistent
    work = Path(tempfile.mkdtemp(prefix="quiverfs-nohome-"))
    work.chmod(0o711)
    try:
        with interpreter_reachable(REPO):
            source = work / "source"
            write_tree(source, FILES)
            for path in [source, *source.rglob("*")]:
                path.chmod(0o755 if path.is_dir() else 0o644)
            digest = work / "data.qd"
            build_digest(source, digest)
            digest.chmod(0o644)
            temp = work / "tmp"
            temp.mkdir()
            temp.chmod(0o1777)
            yield {"user": user, "work": work, "digest": digest, "tmp": temp,
                   "private": temp / f"quiverfs-{user.uid}"}
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _env(world: dict) -> dict[str, str]:
    """The environment of a batch job's service account: no XDG variables, a $HOME that does
    not exist, and the module's temporary directory."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("XDG_")}
    env.update(HOME="/nonexistent", USER=world["user"].name, LOGNAME=world["user"].name,
               TMPDIR=str(world["tmp"]))
    return env


def quiverfs_as(world: dict, *argv: str) -> subprocess.CompletedProcess[str]:
    user: LocalUser = world["user"]
    return user.run([sys.executable, "-m", "quiverfs", *argv], env=_env(world), timeout=180)


def read_as(world: dict, path: Path) -> bytes:
    done = world["user"].run(["cat", str(path)], env=_env(world), text=False)
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.fixture
def mountpoint(world: dict, request: pytest.FixtureRequest) -> Iterator[Path]:
    """An empty directory of the user's, unmounted afterwards; the private state folder is
    removed after each test (each test starts without one)."""
    path = world["work"] / f"mnt-{request.node.name}"
    path.mkdir()
    os.chown(path, world["user"].uid, world["user"].gid)
    try:
        yield path
    finally:
        force_unmount(path)
        shutil.rmtree(world["private"], ignore_errors=True)


def _mounted_pid(line: str) -> int:
    match = re.fullmatch(r"mounted dataset [0-9a-f]{16} at (\S+) \(pid (\d+)\)\n", line)
    assert match, line
    return int(match.group(2))


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_a_detached_mount_on_the_default_cache(world: dict, mountpoint: Path) -> None:
    cache = world["private"] / "cache"
    try:
        done = quiverfs_as(world, "mount", str(world["digest"]), str(mountpoint))
        assert done.returncode == 0, done.stderr
        assert done.stderr == ""
        pid = _mounted_pid(done.stdout)
        assert is_mounted(mountpoint)
        # The state went to the private folder, as the user's, 0700.
        st = os.lstat(world["private"])
        assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (world["user"].uid, 0o700)
        assert (cache / "mountd.sock").exists() and (cache / "mount.log").exists()
        assert os.stat(cache).st_uid == world["user"].uid
        for rel, data in FILES.items():
            assert read_as(world, mountpoint / rel) == data
        # `quiverfs mounts` finds the same mountd by the same rule, and names the user's digest.
        listed = quiverfs_as(world, "mounts", "--json")
        assert listed.returncode == 0, listed.stderr
        [row] = json.loads(listed.stdout)
        assert (row["mountpoint"], row["digest"], row["pid"]) == (str(mountpoint), str(world["digest"]), pid)
        assert row["stats"]["opens"] == len(FILES)
        done = quiverfs_as(world, "umount", str(mountpoint))
        assert (done.returncode, done.stdout, done.stderr) == (0, f"unmounted {mountpoint}\n", "")
        assert not is_mounted(mountpoint)
        wait_for(lambda: _gone(pid), "the mount process to exit after the unmount", timeout=30)
    finally:
        stop_mountd_of(cache)  # started on demand by the mount, as the user


def test_a_detached_mount_on_a_shared_mountd(world: dict, mountpoint: Path) -> None:
    # The cache is root's: the mount keeps its digest copy and log in the private folder.
    cache = world["work"] / "shared-cache"
    mountd = MountdProcess(cache, "1G", "--shared").start()
    try:
        done = quiverfs_as(world, "mount", "--cache-dir", str(cache), str(world["digest"]), str(mountpoint))
        assert done.returncode == 0, done.stderr
        pid = _mounted_pid(done.stdout)
        [state] = world["private"].iterdir()
        assert state.name.startswith("mounts-")
        assert (state.stat().st_uid, stat.S_IMODE(state.stat().st_mode)) == (world["user"].uid, 0o700)
        [copy] = (state / "snapshots").iterdir()
        assert copy.read_bytes() == world["digest"].read_bytes()
        assert read_as(world, mountpoint / "train/dog/2.jpg") == FILES["train/dog/2.jpg"]
        done = quiverfs_as(world, "umount", str(mountpoint))
        assert done.returncode == 0, done.stderr
        wait_for(lambda: _gone(pid), "the mount process to exit after the unmount", timeout=30)
        assert list((state / "snapshots").iterdir()) == []  # the copy goes with the mount
    finally:
        mountd.stop()


def test_a_state_folder_made_by_someone_else_is_refused_in_one_line(world: dict, mountpoint: Path) -> None:
    world["private"].mkdir(mode=0o777)  # root's, and anyone's to write
    world["private"].chmod(0o777)
    done = quiverfs_as(world, "mount", str(world["digest"]), str(mountpoint))
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == (f"quiverfs: error: refusing {world['private']} as this user's state "
                           f"folder: it belongs to uid 0, not {world['user'].uid}; remove it, or set "
                           "XDG_CACHE_HOME (or HOME) to a directory of yours, or pass --cache-dir\n")
    assert not is_mounted(mountpoint)
    assert os.listdir(world["private"]) == []
    # The variable it names works.
    cache_home = world["work"] / "cache-home"
    cache_home.mkdir()
    os.chown(cache_home, world["user"].uid, world["user"].gid)
    env = dict(_env(world), XDG_CACHE_HOME=str(cache_home))
    done = world["user"].run([sys.executable, "-m", "quiverfs", "mount", str(world["digest"]),
                              str(mountpoint)], env=env, timeout=180)
    try:
        assert done.returncode == 0, done.stderr
        assert read_as(world, mountpoint / "README") == FILES["README"]
    finally:
        force_unmount(mountpoint)
        stop_mountd_of(cache_home / "quiverfs")
