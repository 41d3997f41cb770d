"""Two mounts of two digests that share content: shared files are stored once."""

from __future__ import annotations

import json
import os
import random
from functools import partial
from pathlib import Path

import blake3
import pytest

from mountd.rpc.client import SyncClient
from tests.mount.conftest import MountProcess, datasets_served, wait_for
from tests.mountd.conftest import store_files

pytestmark = pytest.mark.mount

rng = random.Random(7)
SHARED = [rng.randbytes(rng.randrange(1, 200_000)) for _ in range(30)]
ONLY_A = {f"a/only_{i}.bin": rng.randbytes(50_000 + i) for i in range(20)}
ONLY_B = {f"b-only/{i}.dat": rng.randbytes(60_000 + i) for i in range(10)}
# The same bytes under other names and folders in each source.
TREE_A = {**ONLY_A, **{f"shared/s{i:02d}.bin": d for i, d in enumerate(SHARED)}}
TREE_B = {**ONLY_B, **{f"elsewhere/deep/copy of {i}.jpg": d for i, d in enumerate(SHARED)}}


@pytest.fixture(scope="module")
def mounts(fuse, module_tmp: Path):
    with datasets_served(module_tmp, {"A": TREE_A, "B": TREE_B}) as world:
        digests, cache = world["digests"], world["cache"]
        with MountProcess(digests["A"], module_tmp / "mnt-A", cache) as a, \
                MountProcess(digests["B"], module_tmp / "mnt-B", cache) as b:
            yield {"A": a.mountpoint, "B": b.mountpoint, "cache": cache}


def test_both_mounts_serve_their_bytes(mounts) -> None:
    for name, files in (("A", TREE_A), ("B", TREE_B)):
        for rel, data in files.items():
            assert (mounts[name] / rel).read_bytes() == data, (name, rel)


def test_shared_files_are_stored_once(mounts) -> None:
    for name, files in (("A", TREE_A), ("B", TREE_B)):  # whatever the test order, all read
        for rel in files:
            (mounts[name] / rel).read_bytes()
    distinct = {blake3.blake3(d).hexdigest(): len(d) for d in [*TREE_A.values(), *TREE_B.values()]}
    assert len(distinct) == 30 + 20 + 10
    assert store_files(mounts["cache"]) == distinct
    with SyncClient.connect(mounts["cache"]) as client:
        usage = client.usage()
        listing = client.ls()
    assert usage["entries"] == len(distinct)
    assert usage["used_bytes"] == sum(distinct.values())
    assert sorted(m["mountpoint"] for m in listing["mounts"]) == sorted([str(mounts["A"]), str(mounts["B"])])
    for name in ("A", "B"):
        assert os.getxattr(mounts[name] / next(iter(TREE_A if name == "A" else TREE_B)), "user.quiver.cached") == b"1"


def test_hits_reach_mountd_in_batches(mounts) -> None:
    def total_hits() -> int:
        with SyncClient.connect(mounts["cache"]) as client:
            return client.stats()["counters"]["total"]["hits"]

    for rel in TREE_A:  # make sure everything is cached
        (mounts["A"] / rel).read_bytes()
    before = total_hits()
    for rel in TREE_A:  # every read of a cached file from the mount is a hit, reported within a second or so
        path = mounts["A"] / rel
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # so the kernel asks the mount again
            assert os.read(fd, 1 << 20) == TREE_A[rel]
        finally:
            os.close(fd)
    wait_for(lambda: total_hits() >= before + len(TREE_A), "mountd to count the mount's hits", timeout=15,
             interval=0.1)


def test_a_python_reader_gets_a_file_in_one_read_request(mounts) -> None:
    """``st_blksize`` is the file's size rounded up (tree.io_block), so Python's buffered
    ``open()`` asks for all of it at once: PIL's pattern (16 bytes, then 64 KiB at a time)
    cost 3.3 READs a 110 KiB file with 4 KiB."""
    mnt = mounts["A"]
    rels = [f"shared/s{i:02d}.bin" for i in range(30) if 70_000 < len(SHARED[i]) <= 200_000]
    assert len(rels) >= 5
    for rel in rels:
        (mnt / rel).read_bytes()  # cached in the store
        fd = os.open(mnt / rel, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # the next read reaches the mount
        finally:
            os.close(fd)
    before = _mount_stats(mnt)
    for rel in rels:
        with open(mnt / rel, "rb") as f:
            assert os.fstat(f.fileno()).st_blksize >= len(SHARED[int(rel[-6:-4])])
            data = f.read(16)
            while chunk := f.read(65536):
                data += chunk
        assert data == SHARED[int(rel[-6:-4])]
    after = _mount_stats(mnt)
    assert after["opens"] - before["opens"] == len(rels)
    assert after["reads"] - before["reads"] == len(rels)


def test_stats_shows_each_mount_beside_mountd(mounts) -> None:
    import json
    import subprocess

    from tests.mount.conftest import quiverfs_cmd

    for rel in ONLY_B:
        (mounts["B"] / rel).read_bytes()
    out = subprocess.run(
        quiverfs_cmd("stats", "--cache-dir", str(mounts["cache"]), "--json"),
        capture_output=True, text=True, check=True,
    )
    report = json.loads(out.stdout)
    by_mountpoint = {row["mountpoint"]: row for row in report["mounts"]}
    assert set(by_mountpoint) == {str(mounts["A"]), str(mounts["B"])}
    b_stats = by_mountpoint[str(mounts["B"])]["stats"]
    assert b_stats["opens"] >= len(ONLY_B)
    assert b_stats["hits"] + b_stats["misses"] >= len(ONLY_B)
    assert report["total"]["hits"] + report["total"]["misses"] >= len(ONLY_B)
    table = subprocess.run(
        quiverfs_cmd("stats", "--cache-dir", str(mounts["cache"])),
        capture_output=True, text=True, check=True,
    ).stdout
    assert "mounts" in table and str(mounts["B"].name) in table


def test_evicted_files_are_read_from_the_mount_again_on_every_mount(mounts) -> None:
    """mountd evicts shared content: both mounts make the kernel drop those pages (the eviction
    journal), so the next read of it on either mount reaches the mount: a miss on the first,
    then a hit on the second (the first fetched it again)."""
    rel_a, rel_b = "shared/s03.bin", "elsewhere/deep/copy of 3.jpg"
    for name, rel in (("A", rel_a), ("B", rel_b)):
        assert (mounts[name] / rel).read_bytes() == SHARED[3]  # cached: store and kernel
    with SyncClient.connect(mounts["cache"]) as client:
        assert client.evict(all=True)["files"] >= 1
    for name, rel, kind in (("A", rel_a, "misses"), ("B", rel_b, "hits")):
        mnt = mounts[name]
        before = _mount_stats(mnt)
        wait_for(partial(_read_reaches_the_mount, mnt, rel, before["opens"]),
                 f"mount {name} to drop the evicted file's pages", timeout=10, interval=0.1)
        after = _mount_stats(mnt)
        assert after["opens"] == before["opens"] + 1 and after[kind] == before[kind] + 1, name
        assert (mnt / rel).read_bytes() == SHARED[3]  # the kernel keeps it again
        assert _mount_stats(mnt)["opens"] == after["opens"]


def _mount_stats(mnt: Path) -> dict:
    return json.loads(os.getxattr(mnt, "user.quiver.stats"))


def _read_reaches_the_mount(mnt: Path, rel: str, opens_before: int) -> bool:
    assert (mnt / rel).read_bytes() == SHARED[3]
    return _mount_stats(mnt)["opens"] > opens_before
