"""One mount of a varied tree: every byte, the listing, attributes, xattrs and errnos."""

from __future__ import annotations

import errno
import json
import os
import random
import stat
import subprocess
from pathlib import Path

import blake3
import pytest

from digests.digest import Digest
from tests.mount.conftest import (
    MountdProcess,
    MountProcess,
    build_digest,
    drop_pages,
    file_hash,
    quiverfs_cmd,
    write_tree,
)

pytestmark = pytest.mark.mount

BIG = "big/one hundred MB.bin"
MANY = "flat"  # a directory with more entries than one readdir buffer holds
MANY_COUNT = 3000


def _files() -> dict[str, bytes]:
    rng = random.Random(42)
    files = {
        "README.txt": b"a small dataset\n",
        "empty": b"",
        "nested/deeper/deepest/leaf.bin": rng.randbytes(110 * 1024),
        "nested/deeper/sibling.bin": rng.randbytes(5000),
        "nested/empty inside": b"",
        "ünïcödé/naïve café ☕.txt": "grüße\n".encode(),
        "with space/a file with spaces.dat": rng.randbytes(131073),
        "dup/a": b"same bytes twice",
        "dup/b": b"same bytes twice",
        BIG: rng.randbytes(100 * 1024 * 1024),
    }
    for i in range(MANY_COUNT):
        files[f"{MANY}/item_{i:05d}.txt"] = f"item {i}\n".encode()
    return files


@pytest.fixture(scope="module")
def tree(fuse, module_tmp: Path):
    """The source directory, its digest, a mountd and the mount (module scope)."""
    source = module_tmp / "source"
    files = _files()
    write_tree(source, files)
    digest = module_tmp / "tree.qd"
    dataset = build_digest(source, digest)
    cache = module_tmp / "cache"
    mountd = MountdProcess(cache).start()
    try:
        with MountProcess(digest, module_tmp / "mnt", cache) as mount:
            yield {"source": source, "files": files, "digest": digest, "dataset": dataset,
                   "mnt": mount.mountpoint, "cache": cache, "mount": mount}
    finally:
        mountd.stop()


def test_cached_xattr_is_0_before_the_first_read(tree) -> None:
    # First in the module: no other test has read this file yet.
    path = tree["mnt"] / "with space/a file with spaces.dat"
    assert os.getxattr(path, "user.quiver.cached") == b"0"
    assert path.read_bytes() == tree["files"]["with space/a file with spaces.dat"]
    assert os.getxattr(path, "user.quiver.cached") == b"1"


def test_every_byte_matches_the_source(tree) -> None:
    mnt, source = tree["mnt"], tree["source"]
    for rel, data in tree["files"].items():
        if rel == BIG:
            continue
        assert (mnt / rel).read_bytes() == data, rel
    assert file_hash(mnt / BIG) == file_hash(source / BIG) == blake3.blake3(tree["files"][BIG]).digest()


def test_random_offsets_of_the_big_file(tree) -> None:
    data = tree["files"][BIG]
    rng = random.Random(1)
    fd = os.open(tree["mnt"] / BIG, os.O_RDONLY)
    try:
        for _ in range(200):
            off = rng.randrange(len(data))
            size = rng.choice([1, 4096, 100_000, 1 << 20])
            assert os.pread(fd, size, off) == data[off:off + size]
        assert os.pread(fd, 10, len(data)) == b""
    finally:
        os.close(fd)


def test_walk_equals_the_digest_listing(tree) -> None:
    mnt = tree["mnt"]
    seen_files, seen_dirs = set(), set()
    for dirpath, dirnames, filenames in os.walk(mnt):
        rel = os.path.relpath(dirpath, mnt)
        prefix = "" if rel == "." else rel + "/"
        seen_dirs.update(prefix + d for d in dirnames)
        seen_files.update(prefix + f for f in filenames)
    with Digest.open(tree["digest"]) as digest:
        expected = {path for path, _size, _hash in digest.iter_canonical()}
    assert seen_files == expected == set(tree["files"])
    expected_dirs = {p.rsplit("/", 1)[0] for p in expected if "/" in p}
    for d in list(expected_dirs):
        while "/" in d:
            d = d.rsplit("/", 1)[0]
            expected_dirs.add(d)
    assert seen_dirs == expected_dirs


def test_a_big_directory_lists_in_order_without_duplicates(tree) -> None:
    names = os.listdir(tree["mnt"] / MANY)
    assert len(names) == MANY_COUNT
    assert names == sorted(names)  # the digest's name order, across many readdir calls
    with os.scandir(tree["mnt"] / MANY) as it:
        sizes = {e.name: e.stat().st_size for e in it}
    assert sizes == {f"item_{i:05d}.txt": len(f"item {i}\n") for i in range(MANY_COUNT)}


def test_sizes_modes_owner_and_stable_inodes(tree) -> None:
    mnt = tree["mnt"]
    root = os.stat(mnt)
    assert root.st_ino == 1 and stat.S_ISDIR(root.st_mode) and stat.S_IMODE(root.st_mode) == 0o555
    with Digest.open(tree["digest"]) as digest:
        for rel, data in tree["files"].items():
            if rel.startswith(MANY + "/") and not rel.endswith("00.txt"):
                continue
            st = os.stat(mnt / rel)
            assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o444, rel
            assert st.st_size == len(data), rel
            assert (st.st_uid, st.st_gid) == (os.getuid(), os.getgid())
            assert st.st_ino == digest.lookup_path(rel).id, rel
        sub = os.stat(mnt / "nested/deeper")
        assert stat.S_ISDIR(sub.st_mode) and stat.S_IMODE(sub.st_mode) == 0o555
        assert sub.st_ino == digest.lookup_path("nested/deeper").id


def test_xattrs(tree) -> None:
    mnt = tree["mnt"]
    leaf = mnt / "nested/deeper/deepest/leaf.bin"
    assert sorted(os.listxattr(leaf)) == ["user.quiver.cached", "user.quiver.hash"]
    assert os.getxattr(leaf, "user.quiver.hash").decode() == blake3.blake3(
        tree["files"]["nested/deeper/deepest/leaf.bin"]).hexdigest()
    leaf.read_bytes()
    assert os.getxattr(leaf, "user.quiver.cached") == b"1"
    assert sorted(os.listxattr(mnt)) == ["user.quiver.dataset", "user.quiver.stats"]
    assert os.getxattr(mnt, "user.quiver.dataset").decode() == tree["dataset"]
    stats = json.loads(os.getxattr(mnt, "user.quiver.stats"))
    assert {"opens", "reads", "hits", "misses", "bytes", "errors"} <= set(stats)
    assert stats["opens"] >= 1 and stats["errors"] == 0
    assert os.listxattr(mnt / "nested") == []
    for path, name in ((leaf, "user.nope"), (mnt, "user.quiver.hash"), (mnt / "nested", "user.quiver.stats")):
        with pytest.raises(OSError) as info:
            os.getxattr(path, name)
        assert info.value.errno == errno.ENODATA



def test_hits_and_misses_are_counted(tree) -> None:
    """A file counts when the kernel reads it from the mount: not on open (opens never reach
    the mount), and not when its pages are still in the kernel's cache."""
    mnt = tree["mnt"]
    path = mnt / "nested/deeper/sibling.bin"
    data = tree["files"]["nested/deeper/sibling.bin"]

    def stats() -> dict:
        return json.loads(os.getxattr(mnt, "user.quiver.stats"))

    def delta(before: dict, after: dict) -> dict:
        return {k: after[k] - before[k] for k in ("opens", "hits", "misses", "errors")}

    drop_pages(path)  # earlier tests may have read it
    was_cached = os.getxattr(path, "user.quiver.cached") == b"1"
    before = stats()
    assert path.read_bytes() == data  # a hit or a miss, depending on the store
    first = stats()
    assert delta(before, first) == {"opens": 1, "hits": int(was_cached), "misses": int(not was_cached),
                                    "errors": 0}
    for _ in range(3):
        fd = os.open(path, os.O_RDONLY)  # opens alone never reach the mount
        os.close(fd)
    assert path.read_bytes() == data  # pages kept by the kernel (keep_cache): nothing new
    assert delta(first, stats()) == {"opens": 0, "hits": 0, "misses": 0, "errors": 0}
    drop_pages(path)
    assert path.read_bytes() == data  # read from the store again: a hit
    assert delta(first, stats()) == {"opens": 1, "hits": 1, "misses": 0, "errors": 0}


@pytest.mark.parametrize(
    "operation",
    [
        lambda m: os.open(m / "new-file", os.O_WRONLY | os.O_CREAT, 0o644),
        lambda m: os.open(m / "README.txt", os.O_RDWR),
        lambda m: os.open(m / "README.txt", os.O_WRONLY | os.O_APPEND),
        lambda m: os.mkdir(m / "new-dir"),
        lambda m: os.rename(m / "README.txt", m / "moved.txt"),
        lambda m: os.unlink(m / "README.txt"),
        lambda m: os.rmdir(m / "nested"),
        lambda m: os.symlink("README.txt", m / "link"),
        lambda m: os.chmod(m / "README.txt", 0o644),
        lambda m: os.truncate(m / "README.txt", 0),
        lambda m: os.setxattr(m / "README.txt", "user.quiver.hash", b"00"),
        lambda m: os.removexattr(m / "README.txt", "user.quiver.hash"),
    ],
    ids=["create", "open-rw", "open-append", "mkdir", "rename", "unlink", "rmdir", "symlink",
         "chmod", "truncate", "setxattr", "removexattr"],
)
def test_changes_fail_with_erofs(tree, operation) -> None:
    with pytest.raises(OSError) as info:
        operation(tree["mnt"])
    assert info.value.errno == errno.EROFS
    assert (tree["mnt"] / "README.txt").read_bytes() == tree["files"]["README.txt"]


def test_unknown_names_are_enoent(tree) -> None:
    mnt = tree["mnt"]
    for rel in ("nope", "nested/nope", "nested/deeper/deepest/leaf.bin.bak", "ünïcödé/NAÏVE CAFÉ ☕.txt"):
        with pytest.raises(FileNotFoundError):
            os.stat(mnt / rel)
    with pytest.raises(NotADirectoryError):
        os.listdir(mnt / "README.txt")


def test_statfs(tree) -> None:
    st = os.statvfs(tree["mnt"])
    total = sum(len(d) for d in tree["files"].values())
    assert st.f_bsize == st.f_frsize == 4096
    assert st.f_blocks == -(-total // 4096)
    assert st.f_bfree == st.f_bavail == 0
    with Digest.open(tree["digest"]) as digest:
        assert st.f_files == digest.file_count + digest.dir_count
    assert st.f_namemax == 255
    assert st.f_flag & os.ST_RDONLY


def test_the_mount_is_registered_with_mountd(tree) -> None:
    from mountd.rpc.client import SyncClient
    from quiverfs.cli.mount_cli import mount_stats

    with SyncClient.connect(tree["cache"]) as client:
        mounts = client.ls()["mounts"]
    mine = [m for m in mounts if m["mountpoint"] == str(tree["mnt"])]
    assert len(mine) == 1 and mine[0]["dataset"] == tree["dataset"]
    [row] = mount_stats(mine)
    assert row["stats_error"] is None and row["stats"]["dataset"] == tree["dataset"]


def test_mounts_command_shows_this_mounts_counters(tree) -> None:
    result = subprocess.run(quiverfs_cmd("mounts", "--json", "--cache-dir", str(tree["cache"])),
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    [row] = json.loads(result.stdout)
    assert row["mountpoint"] == str(tree["mnt"]) and row["stats_error"] is None
    assert row["stats"] == json.loads(os.getxattr(tree["mnt"], "user.quiver.stats"))


def test_mounts_command_shows_the_digest_the_user_mounted(tree) -> None:
    # The mount serves (and registers with mountd) a private copy of the digest; `quiverfs
    # mounts` names the user's file, and keeps the copy apart as "snapshot".
    result = subprocess.run(quiverfs_cmd("mounts", "--json", "--cache-dir", str(tree["cache"])),
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    [row] = json.loads(result.stdout)
    assert row["digest"] == str(tree["digest"])
    snapshot = Path(row["snapshot"])
    assert snapshot.parent == tree["cache"] / "snapshots" and snapshot.suffix == ".qd"
    assert snapshot.read_bytes() == tree["digest"].read_bytes()
    table = subprocess.run(quiverfs_cmd("mounts", "--cache-dir", str(tree["cache"])),
                           capture_output=True, text=True, timeout=60)
    assert table.returncode == 0, table.stderr
    # The digest column of the one row, whose cell a narrow table folds over several lines.
    cells = [line.split("│")[2].strip() for line in table.stdout.splitlines() if line.startswith("│")]
    assert "".join(cells) == str(tree["digest"])
    assert snapshot.name not in table.stdout
