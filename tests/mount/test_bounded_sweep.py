"""The sweep of a dataset larger than the cache, through a real mount and mountd (docs/mount.md
"The sweep"): a shuffled reader of 5x more data than the cache, epoch after epoch, finds part
of its files fetched ahead and kept until read, where plain LRU finds none, and the bucket
sends about one dataset per epoch either way.

1,200 files of 10 KB. Four reader threads (a DataLoader's workers) take a fresh shuffle of
every file each epoch, 25 ms a file each (decoding); mountd runs with ``--cache-size`` a fifth
of the dataset and ``--protect-seconds 1``, so that an epoch (~8 s) outlives many protections
and only the mount's renewals keep what it asked for. (With 600 files of 20 KB and faster
readers, answer holds and protections together took the whole 120-file cache, readers'
misses displaced what the sweep kept, and the bucket sent 1.1-1.3 datasets an epoch: see
docs/mount.md.)
"""

from __future__ import annotations

import json
import os
import random
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from mountd.rpc.client import SyncClient
from tests.mount.conftest import MountdProcess, MountProcess, build_digest, write_tree

pytestmark = pytest.mark.usefixtures("fuse")

rng = random.Random(21)
FILES = {f"train/c{c}/img{i:03d}.jpg": rng.randbytes(10_000) for c in range(6) for i in range(200)}
DATASET_BYTES = sum(len(data) for data in FILES.values())  # 12 MB
CACHE = "2400K"  # a fifth of the dataset
EPOCHS = 3
READERS = 4


@pytest.fixture(scope="module")
def source(module_tmp: Path) -> Path:
    write_tree(module_tmp / "source", FILES)
    build_digest(module_tmp / "source", module_tmp / "d.qd")
    return module_tmp


def epochs(mountpoint: Path, cache: Path, seed: int, count: int) -> list[dict]:
    """Read every file once per epoch in a fresh shuffle with :data:`READERS` threads; per
    epoch the mount's misses and the bytes mountd (on ``cache``) fetched, in datasets."""
    out = []
    for epoch in range(count):
        order = random.Random(seed * 100 + epoch).sample(sorted(FILES), len(FILES))
        before = (stats_of(mountpoint), fetched(cache))

        def read(share: list[str]) -> None:
            for rel in share:
                assert (mountpoint / rel).read_bytes() == FILES[rel], rel
                time.sleep(0.025)  # decoding, augmenting

        with ThreadPoolExecutor(READERS) as pool:
            list(pool.map(read, [order[k::READERS] for k in range(READERS)]))
        after = (stats_of(mountpoint), fetched(cache))
        out.append({"misses": after[0]["misses"] - before[0]["misses"],
                    "restarts": after[0]["sweep_restarts"] - before[0]["sweep_restarts"],
                    "fetched": (after[1] - before[1]) / DATASET_BYTES})
    return out


def stats_of(mountpoint: Path) -> dict:
    return json.loads(os.getxattr(mountpoint, "user.quiver.stats"))


def fetched(cache: Path) -> int:
    with SyncClient.connect(cache) as client:
        return client.stats()["counters"]["total"]["remote_bytes"]


@pytest.fixture
def mountd(source: Path, request: pytest.FixtureRequest) -> Iterator[Path]:
    """A fresh mountd with a cache a fifth of the dataset; its cache directory."""
    cache = source / f"c{len(list(source.glob('c*')))}"  # short: the socket's path
    daemon = MountdProcess(cache, CACHE, "--protect-seconds", "1").start()
    try:
        yield cache
    finally:
        daemon.stop()


def run(source: Path, cache: Path, *extra: str, count: int = EPOCHS) -> tuple[list[dict], dict, dict]:
    mountpoint = cache.parent / f"mnt-{cache.name}"
    with MountProcess(source / "d.qd", mountpoint, cache, *extra):
        per_epoch = epochs(mountpoint, cache, seed=len(extra), count=count)
        mount = stats_of(mountpoint)
    with SyncClient.connect(cache) as client:
        usage = client.call("usage")
    return per_epoch, mount, usage


def test_a_shuffled_reader_of_a_larger_dataset_finds_files_the_sweep_kept(source: Path, mountd: Path) -> None:
    per_epoch, mount, usage = run(source, mountd)
    assert mount["sweep_running"] and mount["sweep_bound_bytes"] > 0
    assert mount["sweep_restarts"] == EPOCHS - 1, per_epoch  # one sweep per epoch
    assert mount["sweep_renewed"] > 0
    for epoch in per_epoch:
        # About 40% of the reads find their file kept (B/N (1 + ln N/B) for B kept of N,
        # and last epoch's files the reader is not done with); plain LRU (below) finds none.
        # The bucket sends about a dataset an epoch.
        assert epoch["misses"] <= 0.75 * len(FILES), per_epoch
        assert epoch["fetched"] <= 1.1, (per_epoch, usage["protection"], mount)
    protection = usage["protection"]
    # What the sweep asked for was read, not dropped when its time was up.
    assert protection["ended"]["timeout"] <= 0.05 * protection["started"], protection


def test_without_the_sweep_every_read_of_a_larger_dataset_misses(source: Path, mountd: Path) -> None:
    per_epoch, mount, _ = run(source, mountd, "--sweep", "0", count=2)
    assert not mount["sweep_running"] and mount["sweep_files"] == 0
    for epoch in per_epoch[1:]:
        assert epoch["misses"] >= 0.95 * len(FILES), per_epoch
        assert 0.95 <= epoch["fetched"] <= 1.05, per_epoch
