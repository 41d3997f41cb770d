"""Three machines' worth of quiverfs on one: each node a real ``quiverfs mountd --cluster``
and a real ``quiverfs mount`` of the same digest, through one real redis-server.

Readers open and read files through the three mounts at once: every node reads the same
bytes, the cluster asks the bucket once per file, and a node whose mountd is killed (-9)
in the middle of an epoch costs the readers on the other nodes nothing but time.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest

from mountd.rpc.client import SyncClient
from quiverfs.testing.emulators import free_port
from quiverfs.testing.redis import RedisServer
from tests.cluster.conftest import secret_file
from tests.mount.conftest import (
    MountdProcess,
    MountProcess,
    build_digest,
    file_hash,
    fuse_skip_reason,
    wait_for,
    write_tree,
)

NODES = 3
SIZE = 20_000


@pytest.fixture
def fuse() -> None:
    reason = fuse_skip_reason()
    if reason:
        pytest.skip(reason)


@pytest.fixture
def cluster(fuse: None, tmp_path: Path, redis_server: RedisServer) -> Iterator[dict]:
    """80 files (``a/…`` read in the first epoch, ``b/…`` in the second), their digest, and
    three nodes: ``{"mountds", "mounts", "caches", "files"}``."""
    files = {
        f"{half}/f{i:03d}.bin": random.Random(i).randbytes(SIZE) + bytes([i])
        for half in ("a", "b")
        for i in range(40)
    }
    write_tree(tmp_path / "bucket", files)
    digest = tmp_path / "d.qd"
    build_digest(tmp_path / "bucket", digest)
    secret = secret_file(tmp_path)
    with ExitStack() as stack:
        mountds, mounts, caches = [], [], []
        for i in range(NODES):
            cache = tmp_path / f"n{i}" / "cache"
            flags = (
                "--cluster",
                redis_server.url,
                "--advertise",
                f"127.0.0.1:{free_port()}",
                "--cluster-secret-file",
                str(secret),
                "--cluster-name",
                "mounts",
            )
            mountd = MountdProcess(cache, "64M", *flags).start()
            stack.callback(mountd.stop)
            mount = MountProcess(digest, tmp_path / f"n{i}" / "mnt", cache).start()
            stack.callback(mount.stop)
            mountds.append(mountd)
            mounts.append(mount)
            caches.append(cache)
        wait_for(
            lambda: all(len(_stats(c)["cluster"]["members"]) == NODES for c in caches),
            "every node to see the others",
        )
        yield {"mountds": mountds, "mounts": mounts, "caches": caches, "files": files}


def _stats(cache: Path) -> dict:
    with SyncClient.connect(cache, timeout=10.0) as client:
        return client.stats()


def _gets(caches: list[Path]) -> int:
    return sum(_stats(c)["counters"]["total"]["remote_requests"]["GET"] for c in caches)


def _reader(
    mountpoint: Path,
    rels: list[str],
    seed: int,
    got: dict[str, bytes],
    read_one: threading.Event | None = None,
    after: int = 0,
) -> threading.Thread:
    """A thread reading ``rels`` through ``mountpoint`` in its own order; every file's blake3
    lands in ``got`` (an ``OSError`` by name, for a node that was killed); ``read_one`` is set
    once ``after`` files were read."""
    order = list(rels)
    random.Random(seed).shuffle(order)

    def run() -> None:
        for n, rel in enumerate(order):
            try:
                got[rel] = file_hash(mountpoint / rel)
            except OSError as exc:
                got[rel] = type(exc).__name__.encode()
            if read_one is not None and n + 1 >= after:
                read_one.set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _hashes(files: dict[str, bytes], rels: list[str]) -> dict[str, bytes]:
    import blake3

    return {rel: blake3.blake3(files[rel]).digest() for rel in rels}


def test_mounts_read_identical_bytes_fetch_once_and_survive_a_killed_node(cluster: dict) -> None:
    files, mounts, caches = cluster["files"], cluster["mounts"], cluster["caches"]
    first = sorted(r for r in files if r.startswith("a/"))
    second = sorted(r for r in files if r.startswith("b/"))

    # Epoch 1: two readers per node, all at once; every node reads every byte right, and
    # the cluster fetched each file from the bucket once.
    results = [{} for _ in range(NODES * 2)]
    threads = [
        _reader(mounts[i // 2].mountpoint, first[i % 2 :: 2], i, results[i])
        for i in range(NODES * 2)
    ]
    for t in threads:
        t.join(120)
    want = _hashes(files, first)
    for i in range(NODES):
        assert {**results[2 * i], **results[2 * i + 1]} == want
    assert _gets(caches) == len(first)
    assert sum(_stats(c)["cluster"]["peer_hits"] for c in caches) >= len(first)

    # Epoch 2: node 2's mountd is killed (-9) while every node reads the second half.
    read_some = threading.Event()
    results = [{} for _ in range(NODES)]
    threads = [
        _reader(
            mounts[i].mountpoint,
            second,
            100 + i,
            results[i],
            read_some if i == NODES - 1 else None,
            after=10,
        )
        for i in range(NODES)
    ]
    assert read_some.wait(120)
    cluster["mountds"][NODES - 1].kill()
    for t in threads[: NODES - 1]:
        t.join(180)
        assert not t.is_alive()
    want = _hashes(files, second)
    for i in range(NODES - 1):  # every byte right on the survivors; nothing failed
        assert results[i] == want
    live = caches[: NODES - 1]
    wait_for(
        lambda: all(len(_stats(c)["cluster"]["members"]) == NODES - 1 for c in live),
        "the survivors to see node 2 gone",
    )
    # Whatever node 2 took to its grave came from the bucket once more, never twice
    # per survivor: at most once per file from this epoch on the survivors.
    assert _gets(live) <= len(first) + len(second)
