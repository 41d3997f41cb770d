"""A chunked dataset's gives matched by its readers' opens, through a real mount and DataLoader.

A marked chunk stays resident for its grace so that the files its jobs were given last are
still there when their DataLoaders read them; where the mount reports opens, the grace ends
once every file given out of the chunk has been opened (mountd/coop/unopened.py). That needs
every open of the real pipeline to come back to mountd's count: a ``DataLoader`` worker's
``open()`` sends a ``FUSE_IOCTL`` that the mount reports, also for a file whose bytes the
kernel's pages serve (quiverfs/fuse/worker.py, ``hits.opened``). Here a job reads a chunked
dataset with a 30 s grace: every give must be matched by an open once the epoch is read, and
the chunks must change within the epoch, not a grace apart.
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

FILES = 4 * 50
GRACE = 30.0


@pytest.fixture(scope="module")
def chunked_mount(fuse, module_tmp: Path):
    """A cold mount of 4 x 50 images, chunked in a mountd cache of a quarter of them, with a
    grace far longer than the epoch."""
    source = module_tmp / "graced"
    files = list(generate_images(n_classes=4, per_class=50, size=32))
    assert write_tree(source, iter(files)) == FILES
    cache_size = str(sum(len(data) for _, data in files) // 4)
    with serving(source, module_tmp, "graced", cache_size, "--dataset-mode", "chunked",
                 "--chunk-grace", str(GRACE)) as mountpoint:
        yield mountpoint, dict(files), module_tmp / "graced-cache"


def unopened_of(cache: Path) -> list:
    with SyncClient.connect(cache) as client:
        datasets = client.stats()["allocation"]["datasets"]
    return [row["unopened"] for row in datasets.values()]


def test_every_give_of_an_epoch_is_matched_by_an_open_of_the_real_pipeline(chunked_mount) -> None:
    mnt, files, cache = chunked_mount
    sampler, loader = shim_loader(mnt, files, "graced", seed=3, prefetch_factor=2)
    sampler.set_epoch(0)
    started = time.monotonic()
    read = [item for batch in loader for item in batch]
    took = time.monotonic() - started
    assert Counter(i for i, _ in read) == Counter(range(FILES))
    assert all(same for _, same in read), "wrong bytes"
    # The last opens reach mountd within the workers' and the mount's report ticks.
    deadline = time.monotonic() + 10
    while (waits := unopened_of(cache)) != [0] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert waits == [0], f"gives not matched by opens: {waits}"
    log = (cache.parent / f"{cache.name}-mountd.log").read_text(errors="replace")
    evicted = log.count("evicted chunk")
    assert evicted >= 2, f"{evicted} chunk evictions in the epoch:\n{log[-2000:]}"
    assert took < GRACE, f"the epoch took {took:.1f} s: a chunk was held for its grace"
    sampler.close()
