"""One mountd, many local users: what another user can and cannot do, checked as real throwaway
users (quiverfs/testing/users.py) against a real mountd run by root.

* The store is traversable but not listable: others read a store file whose hash they know,
  list nothing, and open none of mountd's own files (``tmp/``, the index, the lock, the log).
* The socket admits mountd's user only by default; ``--socket-group G`` admits G's members,
  ``--shared`` every user.
* ``--private-store`` keeps others out of store files, even when the socket admits them.
* A store from a quiverfs that made everything private is opened up on the next start.
"""

from __future__ import annotations

import grp
import os
import shutil
import sqlite3
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from mountd.rpc import protocol
from mountd.rpc.client import SyncClient, ensure_running
from mountd.store import layout
from mountd.store.recovery import STORE_ACCESS
from quiverfs.testing.mountd import SampleFile, location, make_dataset, running_mountd, wait_until
from quiverfs.testing.users import LocalGroup, LocalUser, LocalUsers, traversable_tmpdir

EACCES = {"errno": "EACCES"}


@dataclass(frozen=True)
class Users:
    """``outsider`` is in no group of ours; ``member`` is in ``group``."""

    outsider: LocalUser
    member: LocalUser
    group: LocalGroup


@pytest.fixture(scope="module")
def users(local_users: LocalUsers) -> Users:
    group = local_users.group("qfs_test_socket")
    return Users(outsider=local_users.user("qfs_test_other"),
                 member=local_users.user("qfs_test_member", groups=[group]), group=group)


@pytest.fixture(scope="module")
def workdir() -> Iterator[Path]:
    path = traversable_tmpdir("quiverfs-shared-access-")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def dataset(workdir: Path) -> tuple[str, list[SampleFile]]:
    return make_dataset(workdir / "remote", 4, size=3000)


def fill(cache_dir: Path, url: str, f: SampleFile) -> Path:
    """Have mountd fetch ``f``; its store file."""
    with SyncClient.connect(cache_dir) as client:
        path = Path(client.ensure(f.hash, f.size, location(url, f)))
    assert path == layout.store_path(cache_dir, f.hash)
    return path


def hello(user: LocalUser, cache_dir: Path) -> dict:
    """``hello`` over the socket as ``user``: ``{"ok": response}`` or ``{"errno": ...}``."""
    [result] = user.probe(["hello", str(layout.socket_path(cache_dir)), protocol.PROTOCOL_VERSION])
    return result


def mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.fixture(scope="module")
def default(workdir, dataset):
    """mountd with no access options: shared store, socket 0600."""
    with running_mountd(workdir / "default") as daemon:
        yield daemon


def test_others_cannot_list_the_store(default, dataset, users) -> None:
    url, files = dataset
    path = fill(default.cache_dir, url, files[0])
    fanout, top = path.parent, path.parent.parent
    results = users.outsider.probe(*(["listdir", str(p)] for p in (
        default.cache_dir, default.cache_dir / "store", top, fanout)))
    assert results == [EACCES] * 4
    # The same listings work for mountd's user, so the refusal is the modes' doing.
    assert path.name in os.listdir(fanout) and top.name in os.listdir(default.cache_dir / "store")
    assert [mode(p) for p in (default.cache_dir, default.cache_dir / "store", top, fanout)] == [0o711] * 4


def test_others_read_a_store_file_whose_hash_they_know(default, dataset, users) -> None:
    url, files = dataset
    path = fill(default.cache_dir, url, files[1])
    assert mode(path) == 0o444
    assert users.outsider.probe(["read", str(path)]) == [{"ok": files[1].data.hex()}]
    # A hash not cached is just missing, whoever asks.
    missing = layout.store_path(default.cache_dir, bytes(32))
    assert users.outsider.probe(["read", str(missing)]) == [{"errno": "ENOENT"}]


def test_others_cannot_open_mountd_s_own_files(default, dataset, users) -> None:
    url, files = dataset
    fill(default.cache_dir, url, files[2])
    index = layout.index_path(default.cache_dir)
    own = [index, index.with_name(index.name + "-wal"), index.with_name(index.name + "-shm"),
           layout.lock_path(default.cache_dir)]
    assert all(p.exists() for p in own)  # -wal and -shm exist while mountd runs
    tmp = layout.tmp_dir(default.cache_dir)
    results = users.outsider.probe(["listdir", str(tmp)], *(["open", str(p)] for p in own))
    assert results == [EACCES] * 5
    assert [mode(p) for p in own] == [0o600] * 4 and mode(tmp) == 0o700


def test_the_default_socket_refuses_other_users(default, users) -> None:
    st = os.stat(default.socket_path)
    assert stat.S_IMODE(st.st_mode) == 0o600
    assert hello(users.outsider, default.cache_dir) == EACCES
    assert hello(users.member, default.cache_dir) == EACCES
    with SyncClient.connect(default.cache_dir) as client:  # mountd's own user: welcome
        assert client.hello_info["socket"] == {"mode": "0600", "group": None, "shared": False}
        assert client.hello_info["store_access"] == "shared"


def test_a_socket_group_admits_its_members_only(workdir, users) -> None:
    with running_mountd(workdir / "group", "--socket-group", users.group.name) as daemon:
        st = os.stat(daemon.socket_path)
        assert (stat.S_IMODE(st.st_mode), st.st_gid) == (0o660, users.group.gid)
        answer = hello(users.member, daemon.cache_dir)
        assert answer["ok"]["ok"] is True, answer
        info = answer["ok"]["result"]
        assert info["peer"]["uid"] == users.member.uid and info["admin"] is False
        assert info["socket"] == {"mode": "0660", "group": users.group.name, "shared": False}
        assert hello(users.outsider, daemon.cache_dir) == EACCES


def test_shared_admits_every_user(workdir, dataset, users) -> None:
    url, files = dataset
    with running_mountd(workdir / "shared", "--shared") as daemon:
        assert mode(daemon.socket_path) == 0o666
        path = fill(daemon.cache_dir, url, files[0])
        answer = hello(users.outsider, daemon.cache_dir)
        assert answer["ok"]["ok"] is True, answer
        info = answer["ok"]["result"]
        assert info["peer"]["uid"] == users.outsider.uid and info["socket"]["shared"] is True
        assert users.outsider.probe(["read", str(path)]) == [{"ok": files[0].data.hex()}]


def test_a_private_store_keeps_others_out_of_store_files(workdir, dataset, users) -> None:
    url, files = dataset
    # --shared too: the cache directory must then be traversable (to reach the socket), and
    # the store's own modes are what keeps others out.
    with running_mountd(workdir / "private", "--private-store", "--shared") as daemon:
        path = fill(daemon.cache_dir, url, files[0])
        assert (mode(daemon.cache_dir), mode(daemon.cache_dir / "store")) == (0o711, 0o700)
        assert (mode(path.parent), mode(path)) == (0o700, 0o400)
        answer = hello(users.outsider, daemon.cache_dir)
        assert answer["ok"]["result"]["store_access"] == "private"
        assert users.outsider.probe(["read", str(path)], ["listdir", str(daemon.cache_dir / "store")]) \
            == [EACCES, EACCES]


def test_an_old_private_cache_is_opened_up_on_the_next_start(workdir, dataset, users) -> None:
    url, files = dataset
    cache_dir = workdir / "old"
    with running_mountd(cache_dir, "--private-store") as daemon:
        paths = [fill(daemon.cache_dir, url, f) for f in files]
    # What a quiverfs before shared stores left: everything private, no store_access record.
    conn = sqlite3.connect(layout.index_path(cache_dir))
    conn.execute("DELETE FROM meta WHERE key=?", (STORE_ACCESS,))
    conn.commit()
    conn.close()
    os.chmod(cache_dir, 0o700)
    assert users.outsider.probe(["read", str(paths[0])]) == [EACCES]

    with running_mountd(cache_dir) as daemon:
        assert "store made shared (4 files)" in daemon.log()
        results = users.outsider.probe(*(["read", str(p)] for p in paths))
        assert results == [{"ok": f.data.hex()} for f in files]
        assert users.outsider.probe(["listdir", str(cache_dir / "store")]) == [EACCES]


def test_a_mountd_started_on_demand_keeps_its_log_private(workdir, dataset, users) -> None:
    url, files = dataset
    cache_dir = workdir / "on-demand"
    info = ensure_running(cache_dir, options=["--cache-size", "64M"])
    try:
        path = fill(cache_dir, url, files[3])
        log = cache_dir / "mountd.log"
        assert mode(log) == 0o600 and mode(cache_dir / "mountd.start.lock") == 0o600
        results = users.outsider.probe(["open", str(log)], ["open", str(cache_dir / "mountd.start.lock")],
                                       ["read", str(path)], ["listdir", str(cache_dir)])
        assert results == [EACCES, EACCES, {"ok": files[3].data.hex()}, EACCES]
        assert hello(users.outsider, cache_dir) == EACCES
    finally:
        with SyncClient.connect(cache_dir) as client:
            client.shutdown()
        # It removes its socket on the way out (it is not our child: no wait()).
        wait_until(lambda: not layout.socket_path(cache_dir).exists(), 30,
                   f"the on-demand mountd (pid {info['pid']}) to stop")


def test_the_group_fixture_is_real(users) -> None:
    """The tests above mean something only if the accounts are what they claim."""
    assert users.group.gid in users.member.groups and users.group.gid not in users.outsider.groups
    assert users.member.name in grp.getgrgid(users.group.gid).gr_mem
    out = users.member.run(["id", "-G"])
    assert out.returncode == 0 and str(users.group.gid) in out.stdout.split()
