"""The pyfuse3 front end's own life: counters, hit reports to mountd, SIGTERM, detached mounts.

What it answers is compared with the native front end in test_frontends_differential.py;
this module checks what only a whole mount shows.
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

from mountd.rpc.client import SyncClient
from tests.mount.conftest import (
    MountProcess,
    dataset_served,
    drop_pages,
    is_mounted,
    mount_stats,
    quiverfs_cmd,
    wait_for,
)

pytestmark = pytest.mark.mount
pytest.importorskip("pyfuse3", reason="the pyfuse3 front end needs the pyfuse3 extra")

REPO = Path(__file__).resolve().parents[2]
FILES = {"a.bin": os.urandom(200_000), "dir/b.txt": b"bee\n"}


@pytest.fixture(scope="module")
def world(fuse, module_tmp: Path):
    with dataset_served(module_tmp, FILES, "d") as served:
        yield served




def _mountd_hits(cache: Path) -> int:
    with SyncClient.connect(cache) as client:
        return client.stats()["counters"]["total"]["hits"]


def test_reads_are_counted_and_hits_reach_mountd(world) -> None:
    mnt = world["tmp"] / "mnt-counts"
    with MountProcess(world["digest"], mnt, world["cache"], "--frontend", "pyfuse3"):
        stats = mount_stats(mnt)
        assert (stats["frontend"], stats["workers"]) == ("pyfuse3", 0)
        assert sorted(os.listdir(mnt)) == ["a.bin", "dir"]
        assert (mnt / "a.bin").read_bytes() == FILES["a.bin"]  # a miss, through mountd
        after_miss = mount_stats(mnt)
        assert (after_miss["opens"], after_miss["misses"], after_miss["hits"]) == (1, 1, 0)
        assert after_miss["bytes"] == len(FILES["a.bin"]) and after_miss["errors"] == 0
        before = _mountd_hits(world["cache"])
        drop_pages(mnt / "a.bin")
        assert (mnt / "a.bin").read_bytes() == FILES["a.bin"]  # from the store: a hit
        after_hit = mount_stats(mnt)
        assert (after_hit["opens"], after_hit["misses"], after_hit["hits"]) == (2, 1, 1)
        # Reported to mountd within a second or so (HITS_INTERVAL), as a worker's hits are.
        wait_for(lambda: _mountd_hits(world["cache"]) == before + 1, "mountd to count the hit",
                 timeout=10)


def test_sigterm_unmounts_cleanly(world) -> None:
    mnt = world["tmp"] / "mnt-sigterm"
    mount = MountProcess(world["digest"], mnt, world["cache"], "--frontend", "pyfuse3").start()
    try:
        assert (mnt / "dir/b.txt").read_bytes() == b"bee\n"
        mount.proc.send_signal(signal.SIGTERM)
        assert mount.proc.wait(30) == 0
        assert not is_mounted(mnt)
        assert os.listdir(mnt) == []
    finally:
        mount.stop()


def test_detached_mount_and_umount(world) -> None:
    mnt = world["tmp"] / "mnt-detached"
    mnt.mkdir()
    done = subprocess.run(
        quiverfs_cmd("mount", "--frontend", "pyfuse3", "--cache-dir", str(world["cache"]),
                     str(world["digest"]), str(mnt)),
        capture_output=True, text=True, cwd=REPO, timeout=90)
    try:
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith("mounted dataset ") and done.stderr == ""
        pid = int(done.stdout.rsplit("(pid ", 1)[1].rstrip(")\n"))
        assert (mnt / "dir/b.txt").read_bytes() == b"bee\n"
        assert mount_stats(mnt)["frontend"] == "pyfuse3"
        umount = subprocess.run(quiverfs_cmd("umount", str(mnt)), capture_output=True, text=True,
                                cwd=REPO, timeout=60)
        assert umount.returncode == 0, umount.stderr
        assert not is_mounted(mnt)

        def gone() -> bool:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return True
            return False

        wait_for(gone, "the detached pyfuse3 mount process to exit", timeout=30)
    finally:
        if is_mounted(mnt):
            subprocess.run(["fusermount3", "-u", "-z", str(mnt)], capture_output=True, check=False)
