"""The direct loader through real mounts and a real mountd: cached files are read from the
store itself, with the same bytes and tensors as through the mount; every direct read is
reported to mountd exactly once; evicted, never cached and unreachable store files are read
through the mount; DataLoader workers (fork and spawn) do all of it in their own processes.

Two datasets share one mountd: ``images`` (read through its mount by several tests, evicted
by some) and ``counted`` (never read through its mount: warmed with mountd's ``ensure``), so
mountd's hit counter of ``counted`` moves only with direct reads and can be checked exactly.
"""

from __future__ import annotations

import errno
import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import blake3
import pytest

from digests.digest import Digest
from digests.write import NewFile, write_digest
from mountd.rpc.client import SyncClient
from mountd.store import layout
from quiverfs.client.direct import RECHECK_SECONDS, DirectReader, mount_info
from quiverfs.testing.sample_data import generate_images, write_tree
from tests.mount.conftest import (
    REPO,
    MountdProcess,
    MountProcess,
    build_digest,
    drop_pages,
    wait_for,
)

pytestmark = pytest.mark.mount

torchvision = pytest.importorskip("torchvision", reason="torchvision is not installed (pip install -e '.[torch]')")
torch = pytest.importorskip("torch")

from quiverfs.torch import DirectDataset, QuiverBatchSampler, direct_loader, direct_reader  # noqa: E402

IMAGES = 3 * 12
COUNTED = 2 * 10


@pytest.fixture(scope="module")
def world(fuse, module_tmp: Path):
    """Both datasets built, one mountd, both mounted: paths, ids and the cache directory."""
    sources, digests, ids = {}, {}, {}
    for name, images in (("images", generate_images(n_classes=3, per_class=12, size=32)),
                         ("counted", generate_images(n_classes=2, per_class=10, size=40))):
        sources[name] = module_tmp / name
        write_tree(sources[name], images)
        digests[name] = module_tmp / f"{name}.qd"
        ids[name] = build_digest(sources[name], digests[name])
    cache = module_tmp / "cache"
    mountd = MountdProcess(cache).start()
    mounts = [MountProcess(digests[n], module_tmp / f"{n}-mnt", cache) for n in ("images", "counted")]
    try:
        for mount in mounts:
            mount.start()
        yield {"cache": cache, "ids": ids, "sources": sources, "digests": digests,
               "mnt": {"images": mounts[0].mountpoint, "counted": mounts[1].mountpoint}}
    finally:
        for mount in mounts:
            mount.stop()
        mountd.stop()


def _files(world: dict, name: str) -> list[str]:
    """Relative paths of a dataset's files, sorted."""
    root = world["sources"][name]
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def _mountd(world: dict) -> SyncClient:
    return SyncClient.connect(world["cache"], timeout=10.0)


def _dataset_counters(world: dict, name: str) -> dict:
    with _mountd(world) as client:
        return client.stats()["counters"]["datasets"].get(world["ids"][name], {"hits": 0, "bytes_from_cache": 0})


def _warm_through_mount(world: dict) -> None:
    """Read every file of ``images`` through its mount (a miss fetches it into the store)."""
    for rel in _files(world, "images"):
        drop_pages(world["mnt"]["images"] / rel)  # else pages the kernel kept answer
        assert (world["mnt"]["images"] / rel).read_bytes() == (world["sources"]["images"] / rel).read_bytes()


def _warm_counted_through_mountd(world: dict) -> None:
    """Fill the store with every file of ``counted`` without reading its mount."""
    with Digest.open(world["digests"]["counted"]) as digest, _mountd(world) as client:
        for entry in digest.iter_files():
            client.ensure(entry.hash, entry.size, entry.location, world["ids"]["counted"])


def _evict(world: dict, name: str) -> int:
    with _mountd(world) as client:
        return client.evict(world["ids"][name])["files"]



def _tensors(dataset) -> list[tuple]:
    return [dataset[i] for i in range(len(dataset))]


# -- same content ---------------------------------------------------------------------------


def test_imagefolder_with_the_direct_loader_gives_the_mounts_tensors(world) -> None:
    _warm_through_mount(world)
    root = world["mnt"]["images"] / "train"
    to_tensor = torchvision.transforms.ToTensor()
    through_mount = torchvision.datasets.ImageFolder(str(root), transform=to_tensor)
    direct = torchvision.datasets.ImageFolder(str(root), transform=to_tensor, loader=direct_loader)
    before = direct_reader().counts()
    expected, got = _tensors(through_mount), _tensors(direct)
    after = direct_reader().counts()
    assert len(got) == IMAGES
    for (want_image, want_label), (image, label) in zip(expected, got, strict=True):
        assert label == want_label and torch.equal(image, want_image)
    assert after["store"] - before["store"] == IMAGES  # every one read from the store
    assert after["mount"] == before["mount"]


def test_direct_bytes_are_the_sources_and_files_elsewhere_are_opened_as_they_are(world) -> None:
    _warm_through_mount(world)
    reader = DirectReader()
    for rel in _files(world, "images"):
        assert reader.read(world["mnt"]["images"] / rel) == (world["sources"]["images"] / rel).read_bytes()
        assert reader.read(world["sources"]["images"] / rel) == (world["sources"]["images"] / rel).read_bytes()
    assert reader.counts() == {"store": IMAGES, "mount": 0, "elsewhere": IMAGES}
    assert reader.flush()
    reader.close()


def test_the_mount_says_where_its_store_and_digest_are(world) -> None:
    info = mount_info(str(world["mnt"]["counted"]))
    assert info.dataset == world["ids"]["counted"]
    assert Path(info.cache_dir).resolve() == world["cache"].resolve()
    with Digest.open(info.digest) as digest:  # the mount's private copy of the digest
        assert digest.dataset_id == world["ids"]["counted"]


def test_the_shim_sampler_and_the_direct_dataset_work_together(world) -> None:
    """Claims from mountd in the main process, direct reads in two workers: every file once."""
    _warm_through_mount(world)
    folder = torchvision.datasets.ImageFolder(str(world["mnt"]["images"] / "train"),
                                              transform=torchvision.transforms.PILToTensor())
    dataset = DirectDataset.of(folder, reader=DirectReader())
    sampler = QuiverBatchSampler(dataset, batch_size=6, job="direct", report=False)
    assert sampler.on_quiver
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler, num_workers=2)
    seen = [image.numpy().tobytes() for images, _ in loader for image in images]
    assert sorted(seen) == sorted(folder[i][0].numpy().tobytes() for i in range(IMAGES))
    sampler.close()


# -- hit reports ------------------------------------------------------------------------------


def test_every_direct_read_is_one_hit_for_mountd(world) -> None:
    _warm_counted_through_mountd(world)
    rels = _files(world, "counted")
    sizes = {rel: (world["sources"]["counted"] / rel).stat().st_size for rel in rels}
    reader = DirectReader(flush_hits=7, flush_seconds=60)  # sends by count, not time
    before = _dataset_counters(world, "counted")
    reads = rels + rels[:5]  # five of them twice: each open is a hit
    for n, rel in enumerate(reads):
        # str paths after the first: DirectReader.open's shortcut, as ImageFolder's samples
        path = world["mnt"]["counted"] / rel
        assert reader.read(path if n == 0 else str(path)) == (world["sources"]["counted"] / rel).read_bytes()
    assert reader.flush()
    after = _dataset_counters(world, "counted")
    assert reader.counts()["store"] == len(reads) == COUNTED + 5
    assert after["hits"] - before["hits"] == len(reads)
    assert after["bytes_from_cache"] - before["bytes_from_cache"] == sum(sizes[r] for r in reads)
    reader.close()
    assert _dataset_counters(world, "counted")["hits"] == after["hits"]  # nothing twice


def test_hits_are_reported_by_time_and_at_close(world) -> None:
    _warm_counted_through_mountd(world)
    rels = _files(world, "counted")
    mnt = world["mnt"]["counted"]
    reader = DirectReader(flush_hits=10_000, flush_seconds=0.2)
    before = _dataset_counters(world, "counted")["hits"]
    for rel in rels[:3]:
        reader.read(mnt / rel)
    wait_for(lambda: _dataset_counters(world, "counted")["hits"] == before + 3,
             "the timed report", timeout=10)
    closing = DirectReader(flush_hits=10_000, flush_seconds=3600)
    for rel in rels[:4]:
        closing.read(mnt / rel)
    closing.close()  # waits for mountd's answer
    assert _dataset_counters(world, "counted")["hits"] == before + 3 + 4
    reader.close()


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_dataloader_workers_read_directly_and_report_at_exit(world, context: str) -> None:
    _warm_counted_through_mountd(world)
    root = world["mnt"]["counted"] / "train"
    to_tensor = torchvision.transforms.ToTensor()
    folder = torchvision.datasets.ImageFolder(str(root), transform=to_tensor)
    dataset = DirectDataset.of(folder, reader=DirectReader(flush_seconds=3600))
    expected = {os.path.relpath(path, root): label for path, label in folder.samples}
    before = _dataset_counters(world, "counted")["hits"]
    loader = torch.utils.data.DataLoader(dataset, batch_size=4, num_workers=2,
                                         multiprocessing_context=context)
    seen = 0
    for images, labels in loader:
        assert images.shape == (len(labels), 3, 40, 40)
        seen += len(labels)
    assert seen == COUNTED
    # The same tensors as the source files give (read in this process, outside any mount).
    source = torchvision.datasets.ImageFolder(str(world["sources"]["counted"] / "train"), transform=to_tensor)
    for i, (image, label) in enumerate(source):
        got_image, got_label = dataset[i]
        assert got_label == label == expected[os.path.relpath(folder.samples[i][0], root)]
        assert torch.equal(got_image, image)
    dataset.reader.close()  # this process's COUNTED reads just above
    # Workers exited after the epoch, each reporting its hits on the way out.
    wait_for(lambda: _dataset_counters(world, "counted")["hits"] >= before + 2 * COUNTED,
             "the workers' and this process's reports", timeout=15)
    assert _dataset_counters(world, "counted")["hits"] == before + 2 * COUNTED


# -- falling back to the mount ---------------------------------------------------------------


def test_files_evicted_while_reading_come_through_the_mount(world) -> None:
    _warm_through_mount(world)
    rels = _files(world, "images")
    half = len(rels) // 2
    reader = DirectReader()
    for rel in rels[:half]:
        assert reader.read(str(world["mnt"]["images"] / rel)) == (world["sources"]["images"] / rel).read_bytes()
    assert _evict(world, "images") == IMAGES
    # The first half read again (the shortcut of files read before), the second half new.
    for rel in rels:
        drop_pages(world["mnt"]["images"] / rel)
        assert reader.read(str(world["mnt"]["images"] / rel)) == (world["sources"]["images"] / rel).read_bytes()
    assert reader.counts() == {"store": half, "mount": IMAGES, "elsewhere": 0}
    # The mount fetched them again: read now, they are direct.
    for rel in rels:
        assert reader.read(world["mnt"]["images"] / rel) == (world["sources"]["images"] / rel).read_bytes()
    assert reader.counts()["store"] == half + IMAGES
    reader.close()


def test_files_never_cached_come_through_the_mount_then_from_the_store(world) -> None:
    _evict(world, "images")
    rels = _files(world, "images")
    reader = DirectReader()
    for rel in rels:
        drop_pages(world["mnt"]["images"] / rel)
        assert reader.read(world["mnt"]["images"] / rel) == (world["sources"]["images"] / rel).read_bytes()
    assert reader.counts() == {"store": 0, "mount": IMAGES, "elsewhere": 0}
    for rel in rels:
        assert reader.read(world["mnt"]["images"] / rel) == (world["sources"]["images"] / rel).read_bytes()
    assert reader.counts() == {"store": IMAGES, "mount": IMAGES, "elsewhere": 0}
    reader.close()


def test_a_row_whose_size_is_not_its_contents_fails_as_through_the_mount(world, module_tmp: Path) -> None:
    """A damaged digest row (a cached file's hash, another size) is refused by the mount with
    EIO (docs/mount.md "Sizes"); the direct loader leaves it to the mount rather than serve
    the store file."""
    _warm_through_mount(world)
    good, other = _files(world, "images")[:2]
    good_bytes = (world["sources"]["images"] / good).read_bytes()
    other_bytes = (world["sources"]["images"] / other).read_bytes()
    digest = module_tmp / "damaged.qd"
    write_digest(digest, [NewFile("good.jpg", len(good_bytes), blake3.blake3(good_bytes).digest()),
                          NewFile("bad.jpg", len(other_bytes) + 1, blake3.blake3(other_bytes).digest())],
                 ["file://" + str(world["sources"]["images"])])
    reader = DirectReader()
    with MountProcess(digest, module_tmp / "damaged-mnt", world["cache"]) as mount:
        for _ in range(2):  # the size is checked once per file; a bad row stays bad
            assert reader.read(mount.mountpoint / "good.jpg") == good_bytes
            with pytest.raises(OSError) as info:
                reader.read(mount.mountpoint / "bad.jpg")
            assert info.value.errno == errno.EIO
    assert reader.counts() == {"store": 2, "mount": 2, "elsewhere": 0}
    reader.close()


_NO_STORE_READER = """
import json, sys
from quiverfs.client.direct import DirectReader
reader = DirectReader(handoff=False)  # else mountd hands the files over: test_handoff_loader.py
mnt, src, rels = sys.argv[1], sys.argv[2], sys.argv[3:]
same = all(reader.read(f"{mnt}/{r}") == open(f"{src}/{r}", "rb").read() for r in rels)
print(json.dumps({"same": same, "counts": reader.counts()}))
"""


_NO_DAC = ["setpriv", "--bounding-set=-dac_override,-dac_read_search", "--"]


def test_a_store_this_process_cannot_open_is_read_through_the_mount_logged_once(world) -> None:
    """Root without CAP_DAC_OVERRIDE meets a store folder of mode 000 as any user meets a
    store that is not traversable: EACCES, so every file comes through the mount."""
    _warm_through_mount(world)
    rels = _files(world, "images")
    store = layout.store_dir(world["cache"])
    mode = stat.S_IMODE(store.stat().st_mode)
    store.chmod(0)
    try:
        done = subprocess.run(
            [*_NO_DAC, sys.executable, "-c", _NO_STORE_READER, str(world["mnt"]["images"]),
             str(world["sources"]["images"]), *rels],
            cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
            timeout=120, check=False)
    finally:
        store.chmod(mode)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result == {"same": True, "counts": {"store": 0, "mount": IMAGES, "elsewhere": 0}}
    assert done.stderr.count("cannot open its store files") == 1, done.stderr
    assert "Permission denied" in done.stderr


def test_a_mount_replaced_at_the_same_place_is_mapped_with_its_own_digest(world, module_tmp: Path) -> None:
    """Both datasets hold train/class_00/img_00000.jpg with different bytes: a reader that
    outlives one mount must map the next one's paths with the next one's digest."""
    _warm_through_mount(world)
    _warm_counted_through_mountd(world)
    rel = "train/class_00/img_00000.jpg"
    want = {name: (world["sources"][name] / rel).read_bytes() for name in ("images", "counted")}
    assert want["images"] != want["counted"]
    place = module_tmp / "swap-mnt"
    reader = DirectReader()
    for name in ("images", "counted", "images"):
        swap_started = time.monotonic()
        with MountProcess(world["digests"][name], place, world["cache"]):
            # The reader relies on a new mount taking longer to start than its recheck.
            assert time.monotonic() - swap_started > RECHECK_SECONDS
            assert reader.read(place / rel) == want[name], name
            assert reader.read(str(place / rel)) == want[name], name  # the shortcut's case
        wait_for(lambda: _missing(reader, str(place / rel)), "the reader to see the unmount",
                 timeout=10 * RECHECK_SECONDS)  # the empty directory now, not the old digest
    assert reader.counts()["store"] >= 6 and reader.counts()["mount"] == 0  # (the polls above count too)
    reader.close()


def _missing(reader: DirectReader, path: Path) -> bool:
    try:
        reader.read(path)
    except FileNotFoundError:
        return True
    return False
