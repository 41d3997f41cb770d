"""The direct loader's hand-off mode through a real mount and a real mountd: mountd opens the
cached files and passes their descriptors, one request per batch; the bytes and tensors are
the sources'; each file handed over is exactly one hit for mountd, and is not reported again;
files not cached, and damaged rows, go to the mount; a process that may not open the store
uses hand-off by itself. (Another user and a private store: test_handoff_private.py.)

Two datasets share one mountd: ``images`` is never read through its mount, so mountd's hit
counter of it moves only with what is handed over and can be checked exactly; ``fallback``
is read through its mount (whose own hit reports come when they come).
"""

from __future__ import annotations

import errno
import json
import os
import pickle
import stat
import subprocess
import sys
from pathlib import Path

import blake3
import pytest

from digests.digest import Digest
from digests.write import NewFile, write_digest
from mountd.rpc.client import SyncClient
from mountd.store import layout
from quiverfs.client.direct import DirectReader
from quiverfs.testing.sample_data import generate_images, write_tree
from quiverfs.testing.soak import fd_count
from tests.mount.conftest import REPO, MountdProcess, MountProcess, build_digest

pytestmark = pytest.mark.mount

torchvision = pytest.importorskip("torchvision", reason="torchvision is not installed (pip install -e '.[torch]')")
torch = pytest.importorskip("torch")

from quiverfs.torch import DirectDataset  # noqa: E402

FILES = 2 * 10


def _dataset(module_tmp: Path, cache: Path, name: str, size: int) -> dict:
    source = module_tmp / name
    write_tree(source, generate_images(n_classes=2, per_class=10, size=size))
    digest = module_tmp / f"{name}.qd"
    return {"cache": cache, "dataset": build_digest(source, digest), "source": source,
            "digest": digest, "mount": MountProcess(digest, module_tmp / f"{name}-mnt", cache)}


@pytest.fixture(scope="module")
def worlds(fuse, module_tmp: Path):
    """Both datasets, one mountd (of this uid), both mounted."""
    cache = module_tmp / "cache"
    worlds = {"images": _dataset(module_tmp, cache, "images", 40),
              "fallback": _dataset(module_tmp, cache, "fallback", 32)}
    mountd = MountdProcess(cache).start()
    try:
        for w in worlds.values():
            w["mnt"] = w["mount"].start().mountpoint
        yield worlds
    finally:
        for w in worlds.values():
            w["mount"].stop()
        mountd.stop()


@pytest.fixture
def world(worlds) -> dict:
    """The dataset never read through its mount."""
    return worlds["images"]


def rels(world: dict) -> list[str]:
    return sorted(str(p.relative_to(world["source"])) for p in world["source"].rglob("*") if p.is_file())


def warm(world: dict) -> None:
    """Every file in the store, without reading the mount (mountd fetches them)."""
    with Digest.open(world["digest"]) as digest, SyncClient.connect(world["cache"]) as client:
        for entry in digest.iter_files():
            client.ensure(entry.hash, entry.size, entry.location, world["dataset"])


def counters(world: dict) -> dict:
    """mountd's hits of the dataset and this uid's hand-off counters (the mounts, of this
    uid too, report hits of their own: the uid's ``reported_hits`` is not checked here)."""
    with SyncClient.connect(world["cache"]) as client:
        stats = client.stats()
    dataset = stats["counters"]["datasets"].get(world["dataset"], {})
    user = stats["users"].get(str(os.getuid()), {})
    return {"hits": dataset.get("hits", 0), "bytes": dataset.get("bytes_from_cache", 0),
            "misses": dataset.get("misses", 0), "opens": user.get("opens", 0),
            "opened": user.get("opened", 0)}


def delta(before: dict, after: dict) -> dict:
    return {k: after[k] - before[k] for k in after}


def read_all(files) -> list[bytes]:
    try:
        return [f.read() for f in files]
    finally:
        for f in files:
            f.close()



def test_a_batch_is_one_request_and_each_file_one_hit(world) -> None:
    warm(world)
    names = rels(world)
    outside = [world["source"] / n for n in names[:3]]  # on no mount: opened as they are
    reader = DirectReader(handoff=True, flush_seconds=0.05)
    before = counters(world)
    got = read_all(reader.open_many([world["mnt"] / n for n in names] + outside))
    assert reader.flush()  # nothing was queued for a hits report: mountd counted them itself
    after = counters(world)
    assert got == [(world["source"] / n).read_bytes() for n in names] + [p.read_bytes() for p in outside]
    assert reader.counts() == {"store": FILES, "mount": 0, "elsewhere": 3}
    size = sum((world["source"] / n).stat().st_size for n in names)
    assert delta(before, after) == {"hits": FILES, "bytes": size, "misses": 0, "opens": 1,
                                    "opened": FILES}
    reader.close()


def test_open_is_a_batch_of_one_and_a_batch_over_64_takes_more_requests(world) -> None:
    warm(world)
    names = rels(world)
    reader = DirectReader(handoff=True)
    before = counters(world)
    assert [reader.read(world["mnt"] / n) for n in names[:3]] == \
        [(world["source"] / n).read_bytes() for n in names[:3]]
    mid = counters(world)
    paths = [world["mnt"] / n for n in names] * 4  # 80 files: 64 + 16
    got = read_all(reader.open_many(paths))
    after = counters(world)
    assert got == [(world["source"] / n).read_bytes() for n in names] * 4
    assert (delta(before, mid)["opens"], delta(before, mid)["opened"]) == (3, 3)
    assert (delta(mid, after)["opens"], delta(mid, after)["opened"], delta(mid, after)["hits"]) == (2, 80, 80)
    reader.close()


def test_files_not_cached_come_through_the_mount_then_by_hand_off(worlds) -> None:
    world = worlds["fallback"]
    names = rels(world)
    with SyncClient.connect(world["cache"]) as client:
        client.evict(world["dataset"])
    paths = [world["mnt"] / n for n in names]
    for path in paths:  # the kernel may keep pages of the evicted files: make it ask the mount
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    reader = DirectReader(handoff=True)
    before = counters(world)
    first = read_all(reader.open_many(paths))
    assert reader.counts() == {"store": 0, "mount": FILES, "elsewhere": 0}
    mid = counters(world)
    second = read_all(reader.open_many(paths))
    assert reader.counts() == {"store": FILES, "mount": FILES, "elsewhere": 0}
    want = [(world["source"] / n).read_bytes() for n in names]
    assert first == second == want
    assert (delta(before, mid)["opens"], delta(before, mid)["opened"]) == (1, 0)  # none cached yet
    assert (delta(mid, counters(world))["opened"]) == FILES
    reader.close()


def test_a_row_whose_size_is_not_its_contents_is_left_to_the_mount(world, module_tmp: Path) -> None:
    warm(world)
    good, other = rels(world)[:2]
    good_bytes = (world["source"] / good).read_bytes()
    other_bytes = (world["source"] / other).read_bytes()
    digest = module_tmp / "damaged.qd"
    write_digest(digest, [NewFile("good.jpg", len(good_bytes), blake3.blake3(good_bytes).digest()),
                          NewFile("bad.jpg", len(other_bytes) + 1, blake3.blake3(other_bytes).digest())],
                 ["file://" + str(world["source"])])
    reader = DirectReader(handoff=True)
    with MountProcess(digest, module_tmp / "damaged-mnt", world["cache"]) as mount:
        with SyncClient.connect(world["cache"]) as client:
            before = client.stats()["users"][str(os.getuid())]["opened"]
        good_file, bad_file = reader.open_many([mount.mountpoint / "good.jpg", mount.mountpoint / "bad.jpg"])
        with good_file, bad_file:
            assert good_file.read() == good_bytes
            with pytest.raises(OSError) as info:
                bad_file.read()
            assert info.value.errno == errno.EIO  # the mount's answer to a damaged row
        baseline = fd_count()
        with pytest.raises(FileNotFoundError):  # a path the mount does not have
            reader.open_many([mount.mountpoint / "good.jpg", mount.mountpoint / "nope.jpg"])
        assert fd_count() == baseline  # the good file, handed over, was closed again
        with SyncClient.connect(world["cache"]) as client:
            after = client.stats()["users"][str(os.getuid())]["opened"]
    assert after - before == 2  # good.jpg twice; bad.jpg never handed over
    assert reader.counts() == {"store": 2, "mount": 2, "elsewhere": 0}
    reader.close()


def test_dataloader_workers_fetch_each_batch_with_one_request(world) -> None:
    warm(world)
    root = world["mnt"] / "train"
    to_tensor = torchvision.transforms.ToTensor()
    folder = torchvision.datasets.ImageFolder(str(root), transform=to_tensor)
    reader = DirectReader(handoff=True)
    assert pickle.loads(pickle.dumps(reader))._settings.handoff is True  # spawned workers too
    dataset = DirectDataset.of(folder, reader=reader)
    before = counters(world)
    loader = torch.utils.data.DataLoader(dataset, batch_size=4, num_workers=2,
                                         multiprocessing_context="fork")
    images, labels = [], []
    for batch, targets in loader:
        images.extend(batch)
        labels.extend(targets.tolist())
    after = counters(world)
    source = torchvision.datasets.ImageFolder(str(world["source"] / "train"), transform=to_tensor)
    assert len(images) == len(source) == FILES
    for (want, label), image, got_label in zip(source, images, labels, strict=True):
        assert got_label == label and torch.equal(image, want)
    assert delta(before, after) | {"bytes": 0} == {"hits": FILES, "bytes": 0, "misses": 0,
                                                   "opens": FILES // 4, "opened": FILES}


_NO_STORE_READER = """
import json, sys
from quiverfs.client.direct import DirectReader
reader = DirectReader()
mnt, src, rels = sys.argv[1], sys.argv[2], sys.argv[3:]
files = reader.open_many([f"{mnt}/{r}" for r in rels])
same = [f.read() for f in files] == [open(f"{src}/{r}", "rb").read() for r in rels]
print(json.dumps({"same": same, "counts": reader.counts()}))
"""


def test_a_process_that_may_not_open_the_store_uses_hand_off_by_itself(world) -> None:
    """Root without CAP_DAC_OVERRIDE meets a store folder of mode 000 as another user meets
    a private store: it asks mountd, whose socket it may use, logged once."""
    warm(world)
    names = rels(world)
    store = layout.store_dir(world["cache"])
    mode = stat.S_IMODE(store.stat().st_mode)
    before = counters(world)
    store.chmod(0)
    try:
        done = subprocess.run(
            ["setpriv", "--bounding-set=-dac_override,-dac_read_search", "--", sys.executable,
             "-c", _NO_STORE_READER, str(world["mnt"]), str(world["source"]), *names],
            cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
            timeout=120, check=False)
    finally:
        store.chmod(mode)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"same": True, "counts": {"store": FILES, "mount": 0, "elsewhere": 0}}
    assert done.stderr.count("mountd hands them over instead") == 1, done.stderr
    assert (delta(before, counters(world))["opens"], delta(before, counters(world))["opened"]) == (1, FILES)
