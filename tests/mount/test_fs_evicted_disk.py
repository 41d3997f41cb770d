"""Evicted store files do not keep their disk through a mount's descriptors (an outside check:
with 1 MiB files and an 8 MiB cache, the mount's processes held 48-52 deleted store files open,
31.7 MiB of disk for an 8 MiB cap).

The mount reads many files partially (so that no READ reaches a file's end, which closes it
anyway): misses, kept open by the main process, then hits, kept open by the workers, while
mountd evicts. Every store file any of the mount's processes still has open must be one that
is still in the store, within a few timer periods. The files are small enough for each process
to keep one (its share of 5 % of the cache: quiverfs/filesystem/reads.py);
tests/mount/test_evicted_open.py checks that bound itself.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.mount.conftest import (
    MountdProcess,
    MountProcess,
    build_digest,
    mount_pids,
    open_store_files,
    wait_for,
    write_tree,
)

pytestmark = pytest.mark.usefixtures("fuse")

FILES = 80
SIZE = 512 << 10
CACHE = "32M"
CACHED = 64  # files the cache holds


@pytest.fixture(scope="module")
def mounted(module_tmp: Path) -> Iterator[MountProcess]:
    source = module_tmp / "source"
    write_tree(source, {f"f{i:02d}": bytes([i]) * (SIZE - 1) + os.urandom(1) for i in range(FILES)})
    digest = module_tmp / "d.qd"
    build_digest(source, digest)
    cache = module_tmp / "cache"
    mountd = MountdProcess(cache, CACHE).start()
    try:
        with MountProcess(digest, module_tmp / "mnt", cache, "--workers", "2") as mount:
            yield mount
    finally:
        mountd.stop()


def deleted(mount: MountProcess) -> list[str]:
    return [name for files in open_store_files(mount).values() for name, _ in files
            if name.endswith(" (deleted)")]


def read_part(path: Path, offset: int) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.pread(fd, 4096, offset)
    finally:
        os.close(fd)


def test_evicted_store_files_are_closed_by_every_process(mounted: MountProcess) -> None:
    mnt = mounted.mountpoint
    assert len(mount_pids(mounted)) == 3  # the main process and two workers
    # Misses: the main process fetches and keeps each file open (the kernel read ahead of
    # 4 KiB, never to the end); mountd evicts all but the last CACHED meanwhile.
    for i in range(FILES):
        assert read_part(mnt / f"f{i:02d}", 0) == bytes([i]) * 4096
    wait_for(lambda: not deleted(mounted), "the main process to close evicted store files",
             timeout=10, alive=mounted.died)
    # Hits further into the cached files: the workers keep those open; then new misses evict
    # them, and the workers' timers must notice.
    cached = [i for i in range(FILES) if os.getxattr(mnt / f"f{i:02d}", "user.quiver.cached") == b"1"]
    assert 0 < len(cached) <= CACHED
    for i in cached:
        assert read_part(mnt / f"f{i:02d}", SIZE // 2) == bytes([i]) * 4096
    held = open_store_files(mounted)
    assert any(held[pid] for pid in mount_pids(mounted)[1:]), held  # the workers keep them
    for i in range(FILES):
        if i not in cached:
            read_part(mnt / f"f{i:02d}", SIZE // 4)
    wait_for(lambda: not deleted(mounted), "every process to close evicted store files",
             timeout=10, alive=mounted.died)

