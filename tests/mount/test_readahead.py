"""Read-ahead and the sweep through a real mount and mountd (docs/mount.md "Read-ahead", "The
sweep"): files read in digest order through a cold mount make mountd prefetch the files that
follow (a window that grows as the reader goes on, and stops where the reader stops), which the
reader then finds in the store; a shuffled read makes mountd prefetch the files between those
read, up to ``--sweep`` files per file read, and stops where the reader stops; ``--readahead 0``
and ``--sweep 0`` turn them off. Each test starts from an empty store (everything evicted) and a
fresh mount.

The zero-prefetch tests run first: a scan leaves nothing queued in mountd once it has read
every file, but running them before it also keeps a slow fill from an earlier test out of
their counts.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import time
from pathlib import Path

import pytest

from mountd.rpc.client import SyncClient
from quiverfs.filesystem.sweep import STEP
from tests.mount.conftest import MountProcess, dataset_served, quiverfs_cmd, wait_for

pytestmark = pytest.mark.mount

rng = random.Random(12)
#: ImageFolder-like: 4 classes of 100 files; digest order is path order here (files only in
#: the leaf directories), the order a sorted walk reads them.
FILES = {f"train/c{c}/img{i:03d}.jpg": rng.randbytes(rng.randrange(4_000, 40_000))
         for c in range(4) for i in range(100)}
ORDER = sorted(FILES)


@pytest.fixture(scope="module")
def world(fuse, module_tmp: Path):
    with dataset_served(module_tmp, FILES) as served:
        yield served


def cold(world: dict) -> int:
    """Empty the store; mountd's prefetch count so far."""
    with SyncClient.connect(world["cache"]) as client:
        client.evict(all=True)
        return _prefetches(client)


def prefetches(world: dict) -> int:
    with SyncClient.connect(world["cache"]) as client:
        return _prefetches(client)


def _prefetches(client: SyncClient) -> int:
    return client.stats()["counters"]["total"]["prefetches"]


def mount_stats(mountpoint: Path) -> dict:
    return json.loads(os.getxattr(mountpoint, "user.quiver.stats"))


def read_in(mountpoint: Path, paths: list[str]) -> None:
    for rel in paths:
        assert (mountpoint / rel).read_bytes() == FILES[rel], rel


def cached(mountpoint: Path, rel: str) -> bool:
    return os.getxattr(mountpoint / rel, "user.quiver.cached") == b"1"


def test_a_shuffled_read_without_the_sweep_prefetches_nothing(world: dict, mountpoint: Path) -> None:
    before = cold(world)
    shuffled = random.Random(3).sample(ORDER, len(ORDER))
    with MountProcess(world["digest"], mountpoint, world["cache"], "--sweep", "0"):
        read_in(mountpoint, shuffled)
        stats = mount_stats(mountpoint)
    assert stats["readahead"] == 256  # on, by default
    assert stats["readahead_files"] == 0 and stats["readahead_bytes"] == 0
    assert stats["sweep"] == 0 and stats["sweep_files"] == 0
    assert stats["misses"] == len(ORDER)
    assert prefetches(world) == before


def test_a_shuffled_read_is_swept_as_far_as_it_goes(world: dict, mountpoint: Path) -> None:
    before = cold(world)
    shuffled = random.Random(3).sample(ORDER, len(ORDER))
    first = shuffled[:20]
    position = {rel: i for i, rel in enumerate(ORDER)}  # digest order: ids in path order
    low, high = min(position[rel] for rel in first), max(position[rel] for rel in first)

    def cached_files() -> list[str]:
        return [rel for rel in ORDER if cached(mountpoint, rel)]

    with MountProcess(world["digest"], mountpoint, world["cache"]):
        read_in(mountpoint, first)  # 20 misses: the sweep may ask for 8 files per file read
        stats = mount_stats(mountpoint)
        assert (stats["sweep"], stats["sweep_running"]) == (8, True)  # on, by default
        swept = stats["sweep_files"]
        assert STEP <= swept <= 8 * len(first)
        assert stats["readahead_files"] == 0  # not a scan
        # mountd fills them without anybody reading them, only files between those read …
        wait_for(lambda: len(cached_files()) == len(first) + swept,
                 "mountd to fill the files the sweep asked for", timeout=30, interval=0.05)
        assert all(low <= position[rel] <= high for rel in cached_files())
        assert prefetches(world) - before == swept
        # … and no more once the reader stops.
        time.sleep(0.5)
        assert len(cached_files()) == len(first) + swept
        # The reader goes on: it finds them in the store (the same bytes), and the sweep goes on.
        read_in(mountpoint, shuffled[20:])
        stats = mount_stats(mountpoint)
    assert stats["hits"] + stats["misses"] == len(ORDER)
    assert stats["hits"] >= swept and stats["sweep_files"] > swept
    assert stats["sweep_bytes"] <= sum(len(data) for data in FILES.values())


def test_readahead_zero_prefetches_nothing(world: dict, mountpoint: Path) -> None:
    before = cold(world)
    with MountProcess(world["digest"], mountpoint, world["cache"], "--readahead", "0"):
        read_in(mountpoint, ORDER)
        stats = mount_stats(mountpoint)
    assert stats["readahead"] == 0 and stats["readahead_files"] == 0
    assert stats["misses"] == len(ORDER)
    assert prefetches(world) == before


def test_a_scan_in_digest_order_is_read_ahead(world: dict, mountpoint: Path) -> None:
    before = cold(world)
    with MountProcess(world["digest"], mountpoint, world["cache"], "--readahead", "64"):
        read_in(mountpoint, ORDER[:20])  # 15 files in order make it a scan
        # The window began at 4 files past the 15th and grew by one per file read since:
        # 9 files past the 20th. mountd fills them without anybody reading them …
        ahead = ORDER[20:29]
        wait_for(lambda: all(cached(mountpoint, rel) for rel in ahead),
                 "mountd to prefetch the files after the first 20", timeout=30, interval=0.05)
        assert prefetches(world) - before >= len(ahead)
        # … and nothing after them: the reader stopped, and so did read-ahead.
        assert not any(cached(mountpoint, rel) for rel in ORDER[29:])
        stats = mount_stats(mountpoint)
        assert len(ahead) <= stats["readahead_files"] <= len(ORDER[15:29])
        assert stats["readahead_bytes"] <= sum(len(FILES[rel]) for rel in ORDER[15:29])
        # … and the reader finds them in the store: hits, the same bytes.
        read_in(mountpoint, ORDER[20:])
        stats = mount_stats(mountpoint)
    assert stats["hits"] >= len(ahead)
    assert stats["hits"] + stats["misses"] == len(ORDER)
    assert stats["readahead_files"] >= len(ahead)
    assert stats["readahead_window_files"] == 64  # grown to --readahead along the scan
    assert prefetches(world) - before >= len(ahead)


@pytest.mark.parametrize(("flag", "value", "says"), [
    ("--readahead", "-1", "--readahead must be a number of files from 0 (off) to 10000, not -1"),
    ("--sweep", "65", "--sweep must be a number of files per file read from 0 (off) to 64, not 65"),
])
def test_a_bad_value_is_one_line(world: dict, mountpoint: Path, flag: str, value: str, says: str) -> None:
    out = subprocess.run(quiverfs_cmd("mount", str(world["digest"]), str(mountpoint), flag, value),
                         capture_output=True, text=True, check=False)
    assert out.returncode == 2
    assert out.stderr.strip() == f"quiverfs: error: {says}"
