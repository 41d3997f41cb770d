"""The per-user quota of a shared cache, with real users and real mounts.

mountd runs as root with ``--shared --user-quota``; users QA and QB are throwaway accounts,
each with a private dataset only it may read. Neither is mountd's uid, so their mounts supply
the bytes they read (docs/operations.md "Security") and each fill is charged to the user who
supplied it. Checked: a user reading past its quota loses its own oldest files, exactly, and
the other user's stay cached; content larger than the quota is refused with ``EDQUOT`` and
evicts nothing; ``stats`` says the same per uid.
"""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import tempfile
import zoneinfo  # noqa: F401  (a lazy import of the CLI; the children cannot read /root)
from collections.abc import Iterator
from pathlib import Path

import blake3
import pytest

import quiverfs.cli.mount_cli  # noqa: F401
import quiverfs.mount.start  # noqa: F401  (imported before forking children that run mounts)
from mountd.rpc.client import SyncClient
from mountd.store import layout
from quiverfs.testing.users import (
    LocalUser,
    LocalUsers,
    interpreter_reachable,
    run_as,
)
from tests.mount.conftest import (
    REPO,
    MountdProcess,
    UserMount,
    build_digest,
    sha,
    write_tree,
)

pytestmark = [pytest.mark.mount, pytest.mark.usefixtures("fuse")]

if os.geteuid() != 0:
    pytest.skip("creates local users and changes uids: needs root", allow_module_level=True)

SIZE = 40_000
QUOTA = 3 * SIZE


def content(tag: str, size: int) -> bytes:
    """``size`` bytes of its own for each tag (distinct hashes)."""
    block = hashlib.sha256(tag.encode()).digest()
    return (block * (size // len(block) + 1))[:size]


A_FILES = {f"a/{i}.bin": content(f"a{i}", SIZE) for i in range(6)}
A_BIG = {"big/big.bin": content("a-big", QUOTA + 1)}
B_FILES = {f"b/{i}.bin": content(f"b{i}", SIZE) for i in range(3)}


def blake(data: bytes) -> bytes:
    return blake3.blake3(data).digest()


@pytest.fixture(scope="module")
def world(dev_fuse_for_users: None, local_users: LocalUsers) -> Iterator[dict]:
    with interpreter_reachable(REPO):
        yield from _world(local_users)


def _private_dataset(work: Path, user: LocalUser, name: str, files: dict[str, bytes]) -> Path:
    """``files`` under ``work/name-src`` and their digest, both readable by ``user`` only."""
    src = work / f"{name}-src"
    write_tree(src, files)
    digest = work / f"{name}.qd"
    build_digest(src, digest)
    for path in [src, *src.rglob("*"), digest]:
        os.chown(path, user.uid, user.gid)
        path.chmod(0o700 if path.is_dir() else 0o600)
    return digest


def _world(local_users: LocalUsers) -> Iterator[dict]:
    work = Path(tempfile.mkdtemp(prefix="quiverfs-quota-"))
    work.chmod(0o711)
    a, b = local_users.user("qfs_test_qa"), local_users.user("qfs_test_qb")
    for user in (a, b):
        home = work / "homes" / user.name
        home.mkdir(parents=True)
        os.chown(home, user.uid, user.gid)
    (work / "homes").chmod(0o711)
    a_digest = _private_dataset(work, a, "a", {**A_FILES, **A_BIG})
    b_digest = _private_dataset(work, b, "b", B_FILES)
    cache = work / "cache"
    mountd = MountdProcess(cache, "1G", "--shared", "--user-quota", str(QUOTA)).start()
    try:
        yield {"work": work, "a": a, "b": b, "a_digest": a_digest, "b_digest": b_digest,
               "cache": cache}
    finally:
        mountd.stop()
        shutil.rmtree(work, ignore_errors=True)


class QuotaMount(UserMount):
    """``user``'s mount of ``digest`` at ``WORK/name`` on the world's cache, with no
    read-ahead (exactly the files read are filled, in the order read)."""

    def __init__(self, world: dict, user: LocalUser, digest: Path, name: str) -> None:
        super().__init__(user, world["work"] / "homes" / user.name, world["cache"], digest,
                         world["work"] / name, "--readahead", "0")

    def read(self, names: list[str]) -> list[str]:
        """Each file's sha256 as the user reads it through the mount, one after the other
        (or ``errno:NAME``)."""
        paths = [self.mountpoint / name for name in names]

        def read_all() -> list[str]:
            out = []
            for path in paths:
                try:
                    out.append(hashlib.sha256(path.read_bytes()).hexdigest())
                except OSError as exc:
                    out.append(f"errno:{errno.errorcode[exc.errno]}")
            return out

        return run_as(self.user, read_all)



def in_store(cache: Path, files: dict[str, bytes]) -> dict[str, bool]:
    """Which of ``files`` have their store file, holding exactly their bytes."""
    out = {}
    for name, data in files.items():
        path = layout.store_path(cache, blake(data))
        out[name] = path.exists() and path.read_bytes() == data
    return out


def user_stats(cache: Path, user: LocalUser) -> dict:
    with SyncClient.connect(cache) as admin:
        return admin.stats()["users"][str(user.uid)]


def test_a_user_past_its_quota_loses_its_own_oldest_files_and_the_others_stay(world: dict):
    a, b, cache = world["a"], world["b"], world["cache"]
    with QuotaMount(world, b, world["b_digest"], "b-mnt") as bm:
        assert bm.read(sorted(B_FILES)) == [sha(B_FILES[n]) for n in sorted(B_FILES)]
    assert in_store(cache, B_FILES) == dict.fromkeys(B_FILES, True)
    names = sorted(A_FILES)
    with QuotaMount(world, a, world["a_digest"], "a-mnt") as am:
        assert am.read(names) == [sha(A_FILES[n]) for n in names]
    # A's three oldest went for A's quota; B's files (older still) are all there.
    assert in_store(cache, A_FILES) == {n: i >= 3 for i, n in enumerate(names)}
    assert in_store(cache, B_FILES) == dict.fromkeys(B_FILES, True)
    with SyncClient.connect(cache) as admin:
        usage = admin.usage()
        users = admin.stats()["users"]
    assert (usage["entries"], usage["used_bytes"]) == (6, 6 * SIZE)
    mine = {k: users[str(a.uid)][k] for k in ("supplied", "cached_files", "cached_bytes", "quota",
                                              "quota_evicted_files", "quota_evicted_bytes")}
    assert mine == {"supplied": 6, "cached_files": 3, "cached_bytes": QUOTA, "quota": QUOTA,
                    "quota_evicted_files": 3, "quota_evicted_bytes": 3 * SIZE}
    theirs = users[str(b.uid)]
    assert (theirs["supplied"], theirs["cached_files"], theirs["cached_bytes"],
            theirs["quota_evicted_files"]) == (3, 3, 3 * SIZE, 0)
    # B reads its files again: all still cached, nothing supplied anew.
    with QuotaMount(world, b, world["b_digest"], "b-mnt2") as bm:
        assert bm.read(sorted(B_FILES)) == [sha(B_FILES[n]) for n in sorted(B_FILES)]
    assert user_stats(cache, b)["supplied"] == 3


def test_a_file_larger_than_the_quota_fails_with_edquot_and_evicts_nothing(world: dict):
    a, cache = world["a"], world["cache"]
    before = user_stats(cache, a)
    with QuotaMount(world, a, world["a_digest"], "a-big-mnt") as am:
        assert am.read(sorted(A_BIG)) == ["errno:EDQUOT"]
        # The user's other files are still served (the last three it read are cached).
        names = sorted(A_FILES)[3:]
        assert am.read(names) == [sha(A_FILES[n]) for n in names]
    assert in_store(cache, A_BIG) == dict.fromkeys(A_BIG, False)
    assert in_store(cache, A_FILES) == {n: i >= 3 for i, n in enumerate(sorted(A_FILES))}
    after = user_stats(cache, a)
    for key in ("supplied", "cached_files", "cached_bytes", "quota_evicted_files"):
        assert after[key] == before[key], key
    assert "Traceback" not in (world["work"] / "a-big-mnt.log").read_text()
