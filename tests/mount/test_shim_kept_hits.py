"""A claim's hits kept until their reader opens them, through a real mount and DataLoader.

At a small cache a job's DataLoader asks for more files than the cache holds, and a new
epoch's claims hand out the cached files (hits) and, after them, misses whose fills need
room. Unprotected, the hits went first (least recently used) and the loader read them on
demand (``peers.py`` (b), docs/benchmark-history.md, 2026-12-02). Now mountd keeps a claim's
hits until they are read, and the read it sees is the open: a hit is read from the kernel's
pages, which send no READ, but Python's ``open()`` sends a ``FUSE_IOCTL`` that the mount
reports (quiverfs/fuse/worker.py). So every kept hit must end as *read*, none by its time
running out or its job letting go.
"""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

import pytest

from mountd.rpc.client import SyncClient
from quiverfs.testing.sample_data import generate_images, write_tree
from tests.mount.conftest import serving

pytestmark = pytest.mark.mount

pytest.importorskip("torch")

from tests.mount.raw_files import shim_loader  # noqa: E402  (after the importorskip)

FILES = 4 * 40


@pytest.fixture(scope="module")
def small_mount(fuse, module_tmp: Path):
    """A cold mount of 4 x 40 images whose mountd cache holds about a third of them; LRU
    mode, so that its cached files are handed out as hits, unpinned."""
    source = module_tmp / "kept"
    files = list(generate_images(n_classes=4, per_class=40, size=32))
    assert write_tree(source, iter(files)) == FILES
    cache_size = str(sum(len(data) for _, data in files) // 3)
    with serving(source, module_tmp, "kept", cache_size, "--dataset-mode", "lru") as mountpoint:
        yield mountpoint, dict(files), module_tmp / "kept-cache"


def kept_of(cache: Path) -> dict:
    with SyncClient.connect(cache) as client:
        return client.call("usage")["protection"]["kept"]


def test_a_new_epochs_hits_are_kept_until_the_loader_opens_them(small_mount) -> None:
    mnt, files, cache = small_mount
    sampler, loader = shim_loader(mnt, files, "kept", seed=5, prefetch_factor=4)
    for epoch in range(3):
        sampler.set_epoch(epoch)
        read = [item for batch in loader for item in batch]
        assert Counter(i for i, _ in read) == Counter(range(FILES)), f"epoch {epoch}"
        assert all(same for _, same in read), f"epoch {epoch}: wrong bytes"
        # The last opens reach mountd within the workers' and the mount's report ticks.
        deadline = time.monotonic() + 10
        while (kept := kept_of(cache))["files"] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert kept["files"] == 0, f"epoch {epoch}: kept hits still unread: {kept}"
    assert kept["started"] > 0, "no epoch's claims handed out a cached file"
    dropped = {reason: n for reason, n in kept["ended"].items() if reason != "read" and n}
    assert kept["ended"]["read"] == kept["started"] and not dropped, kept
    sampler.close()
