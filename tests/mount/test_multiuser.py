"""One mountd for every user of the machine, with real users and real mounts.

mountd runs as root with ``--shared``; users A and B are throwaway accounts created here.
Neither is mountd's uid, so mountd never reads a source for them: their mounts supply the
bytes they read with their own rights, and mountd verifies them (docs/operations.md
"Security"). Checked: what each user may read, that nothing unverified or unauthorised
enters the cache, hits by hash across users, admin refusals, per-uid statistics.
"""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import sqlite3
import subprocess
import tempfile
import zoneinfo  # noqa: F401  (a lazy import of the CLI; the children cannot read /root)
from collections.abc import Iterator
from pathlib import Path

import pytest

import quiverfs.cli.mount_cli  # noqa: F401
import quiverfs.mount.start  # noqa: F401  (imported before forking children that run mounts)
from mountd.rpc.client import SyncClient
from mountd.store import layout
from quiverfs.testing.users import (
    LocalUser,
    LocalUsers,
    exit_status,
    interpreter_reachable,
    run_as,
    spawn_as,
)
from tests.mount.conftest import (
    REPO,
    MountdProcess,
    UserMount,
    build_digest,
    is_mounted,
    sha,
    write_tree,
)

pytestmark = [pytest.mark.mount, pytest.mark.usefixtures("fuse")]

if os.geteuid() != 0:
    pytest.skip("creates local users and changes uids: needs root", allow_module_level=True)


def files_of(tag: str, n: int) -> dict[str, bytes]:
    return {f"c{i % 2}/{tag}-{i:02d}.bin": hashlib.sha256(f"{tag}{i}".encode()).digest() * 300
            for i in range(n)}


@pytest.fixture(scope="module")
def world(dev_fuse_for_users: None, local_users: LocalUsers) -> Iterator[dict]:
    with interpreter_reachable(REPO):
        yield from _world(local_users)


def _world(local_users: LocalUsers) -> Iterator[dict]:
    work = Path(tempfile.mkdtemp(prefix="quiverfs-multiuser-"))
    work.chmod(0o711)
    a, b = local_users.user("qfs_test_a"), local_users.user("qfs_test_b")
    for user in (a, b):  # each its own empty home (HOME of its commands)
        home = work / "homes" / user.name
        home.mkdir(parents=True)
        os.chown(home, user.uid, user.gid)
    (work / "homes").chmod(0o711)
    # A's private dataset: only A can read its files and its digest.
    a_src = work / "a-src"
    a_files = files_of("a", 8)
    write_tree(a_src, a_files)
    a_digest = work / "a.qd"
    build_digest(a_src, a_digest)
    for path in [a_src, *a_src.rglob("*"), a_digest]:
        os.chown(path, a.uid, a.gid)
        path.chmod(0o700 if path.is_dir() else 0o600)
    # The same content described for B (B may read this digest, not A's files).
    b_view = work / "b-view-of-a.qd"
    shutil.copyfile(a_digest, b_view)
    b_view.chmod(0o644)
    cache = work / "cache"
    mountd = MountdProcess(cache, "1G", "--shared").start()
    try:
        yield {"work": work, "a": a, "b": b, "a_files": a_files, "a_digest": a_digest,
               "b_view": b_view, "cache": cache}
    finally:
        mountd.stop()
        shutil.rmtree(work, ignore_errors=True)


def quiverfs_as(world: dict, user: LocalUser, argv: list[str], log: Path) -> subprocess.Popen:
    """``quiverfs ARGV`` as ``user``, in its home under the world."""
    return spawn_as(user, world["work"] / "homes" / user.name, argv, log)


def user_mount(world: dict, user: LocalUser, digest: Path, mountpoint: Path) -> UserMount:
    """``user``'s mount of ``digest`` on the world's shared cache."""
    return UserMount(user, world["work"] / "homes" / user.name, world["cache"], digest, mountpoint)


def read_as(user: LocalUser, paths: list[Path]) -> dict[str, str]:
    """Each path's bytes' sha256 as ``user`` reads them, or ``errno:NAME``."""
    def read_all() -> dict[str, str]:
        out = {}
        for path in paths:
            try:
                out[str(path)] = hashlib.sha256(path.read_bytes()).hexdigest()
            except OSError as exc:
                out[str(path)] = f"errno:{errno.errorcode[exc.errno]}"
        return out
    return run_as(user, read_all)


def digest_hashes(digest: Path) -> dict[str, bytes]:
    """Path → content hash of every file row of a digest (read as root)."""
    from digests.digest import Digest

    d = Digest.open(digest)
    try:
        return {path: content_hash for path, _size, content_hash in d.iter_canonical()}
    finally:
        d.close()



def test_a_user_cannot_mount_a_digest_it_cannot_read(world: dict):
    b = world["b"]
    mnt = world["work"] / "b-tries-a"
    mnt.mkdir()
    os.chown(mnt, b.uid, b.gid)
    log = world["work"] / "b-tries-a.log"
    proc = quiverfs_as(world, b, ["mount", "--foreground", "--cache-dir", str(world["cache"]),
                        str(world["a_digest"]), str(mnt)], log)
    assert exit_status(proc, 60) not in (None, 0)
    assert not is_mounted(mnt)
    assert "a.qd" in log.read_text() and "Traceback" not in log.read_text()


def test_users_fill_with_their_own_rights_and_share_by_hash(world: dict):
    a, b, cache = world["a"], world["b"], world["cache"]
    names = sorted(world["a_files"])
    first, rest = names[:4], names[4:]
    with SyncClient.connect(cache) as admin:
        before = admin.stats()["users"]
    with user_mount(world, a, world["a_digest"], world["work"] / "a-mnt") as am:
        got = read_as(a, [am.mountpoint / n for n in first])
        assert got == {str(am.mountpoint / n): sha(world["a_files"][n]) for n in first}
    with SyncClient.connect(cache) as admin:
        users = admin.stats()["users"]
        assert users[str(a.uid)]["supplied"] - before.get(str(a.uid), {}).get("supplied", 0) == 4
        assert admin.usage()["entries"] == 4
    with user_mount(world, b, world["b_view"], world["work"] / "b-mnt") as bm:
        # What A cached, B gets by hash; what nobody cached, B cannot make mountd read.
        got = read_as(b, [bm.mountpoint / n for n in names])
    assert {n: got[str(bm.mountpoint / n)] for n in first} == {n: sha(world["a_files"][n]) for n in first}
    assert {got[str(bm.mountpoint / n)] for n in rest} == {"errno:EACCES"}
    with SyncClient.connect(cache) as admin:
        assert admin.usage()["entries"] == 4  # nothing of B's failed reads entered the cache
        users = admin.stats()["users"]
        assert users[str(b.uid)]["supplied"] == 0
        assert users[str(b.uid)]["ensures"] >= len(rest)


def test_a_forged_digest_cannot_poison_the_cache(world: dict):
    a, b, cache, work = world["a"], world["b"], world["cache"], world["work"]
    # B's own file, and a digest that claims it holds the content of one of A's files.
    b_src = work / "b-src"
    write_tree(b_src, {"c0/evil.bin": b"not A's bytes" * 100})
    for path in [b_src, *b_src.rglob("*")]:
        os.chown(path, b.uid, b.gid)
    forged = work / "b-forged.qd"
    build_digest(b_src, forged)
    a_hashes = digest_hashes(world["a_digest"])
    victim = sorted(world["a_files"])[-1]  # not cached by the previous test
    with sqlite3.connect(forged) as db:
        db.execute("UPDATE files SET hash = ?, size = ? WHERE name = 'evil.bin'",
                   (a_hashes[victim], len(world["a_files"][victim])))
        db.execute("UPDATE meta SET value = (SELECT sum(size) FROM files) WHERE key = 'total_bytes'")
    os.chown(forged, b.uid, b.gid)
    store_file = layout.store_path(cache, a_hashes[victim])
    with user_mount(world, b, forged, work / "b-forged-mnt") as bm:
        got = read_as(b, [bm.mountpoint / "c0/evil.bin"])
    assert set(got.values()) <= {"errno:EIO", "errno:EINVAL"}  # refused: it does not verify
    assert not store_file.exists()
    with user_mount(world, a, world["a_digest"], work / "a-mnt2") as am:
        assert read_as(a, [am.mountpoint / victim]) == {str(am.mountpoint / victim): sha(world["a_files"][victim])}
    assert store_file.read_bytes() == world["a_files"][victim]


def test_other_users_cannot_run_admin_operations_and_stats_are_per_uid(world: dict):
    b, cache = world["b"], world["cache"]
    log = world["work"] / "b-admin.log"
    codes = {}
    for argv in (["evict", "--all"], ["scrub"]):
        codes[argv[0]] = exit_status(quiverfs_as(world, b, [*argv, "--cache-dir", str(cache)], log), 60)
    assert all(code not in (None, 0) for code in codes.values()), codes
    text = log.read_text()
    assert text.count("needs root or uid") == 2 and "Traceback" not in text

    def shutdown() -> str:
        with SyncClient.connect(cache) as client:
            try:
                client.shutdown()
            except Exception as exc:
                return type(exc).__name__
        return "stopped"

    assert run_as(b, shutdown) == "PermissionDenied"
    with SyncClient.connect(cache) as admin:
        assert admin.usage()["entries"] >= 4  # nothing was evicted
        users = admin.stats()["users"]
    assert users[str(b.uid)]["refused"] >= 3


def test_a_users_mount_says_so_in_one_line_when_the_shared_mountd_is_down(world: dict):
    """Root's cache dir with no mountd serving it: the user's mount cannot start one there
    (the dir is root's), and says so plainly instead of a traceback."""
    b = world["b"]
    cache = world["work"] / "cache-down"
    MountdProcess(cache, "1G", "--shared").start().stop()  # root's store, nobody serving it
    mnt = world["work"] / "b-no-mountd"
    mnt.mkdir()
    os.chown(mnt, b.uid, b.gid)
    log = world["work"] / "b-no-mountd.log"
    proc = quiverfs_as(world, b, ["mount", "--foreground", "--cache-dir", str(cache),
                                  str(world["b_view"]), str(mnt)], log)
    assert exit_status(proc, 60) not in (None, 0)
    assert not is_mounted(mnt)
    text = log.read_text()
    assert "Traceback" not in text and "internal error" not in text, text
    assert f"no mountd is serving {cache}, and uid {b.uid} may not start one there" in text, text
    assert not (cache / "mountd.log").exists() or os.stat(cache / "mountd.log").st_uid == 0
