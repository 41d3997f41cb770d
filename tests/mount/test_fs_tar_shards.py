"""A digest of tar shards in a real S3 emulator (moto), served by a real mount.

``digests build s3://... --tar members`` over WebDataset-style shards whose members are
``train/class_NN/img_NNNNN.jpg``: the mount shows ImageFolder's class folders (each class
spread over every shard), every member reads back byte for byte (one ranged GET each, from
the emulator), and a shard cut short in the bucket after the build fails exactly the members
past the cut with EIO, while its earlier members and the members of other shards still read.
"""

from __future__ import annotations

import errno
import io
import os
import tarfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from digests.build import build
from digests.digest import Digest
from quiverfs.testing.emulators import run_moto
from quiverfs.testing.sample_data import generate_images
from tests.mount.conftest import MountdProcess, MountProcess

pytestmark = [pytest.mark.mount, pytest.mark.usefixtures("fuse")]

BUCKET = "shards"
PREFIX = "wds"
N_SHARDS = 3

#: ImageFolder layout: 3 classes x 12 JPEGs, dealt round-robin over the shards.
IMAGES = dict(generate_images(n_classes=3, per_class=12, size=48))
#: A shard the test cuts in the bucket, and one beside it that stays whole.
VICTIM = [(f"victim-{i}.bin", os.urandom(20_000 + i)) for i in range(4)]
INTACT = [("intact-0.bin", os.urandom(9_000)), ("intact-1.bin", b"")]


def tar_bytes(members: list[tuple[str, bytes]]) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as t:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
    return out.getvalue()


def data_offsets(shard: bytes) -> dict[str, int]:
    with tarfile.open(fileobj=io.BytesIO(shard)) as t:
        return {m.name: m.offset_data for m in t.getmembers()}


SHARDS = {
    f"train-{i:03d}.tar": tar_bytes(sorted(IMAGES.items())[i::N_SHARDS]) for i in range(N_SHARDS)
}
SHARDS["cut/victim.tar"] = tar_bytes(VICTIM)
SHARDS["cut/intact.tar"] = tar_bytes(INTACT)


@pytest.fixture(scope="module")
def world(module_tmp: Path) -> Iterator[dict]:
    with run_moto() as moto, pytest.MonkeyPatch.context() as env:
        # The build here and the mountd subprocess reach the emulator through the standard
        # chain (endpoint and dummy keys in the environment), as a user's would.
        for name, value in moto.env.items():
            env.setenv(name, value)
        moto.create_bucket(BUCKET)
        for key, data in SHARDS.items():
            moto.upload(BUCKET, f"{PREFIX}/{key}", data)
        digest = module_tmp / "wds.qd"
        result = trio.run(
            lambda: build(f"s3://{BUCKET}/{PREFIX}", digest, tar="members", workers=4)
        )
        cache = module_tmp / "cache"
        mountd = MountdProcess(cache).start()
        try:
            with MountProcess(digest, module_tmp / "mnt", cache) as mount:
                yield {"moto": moto, "mnt": mount.mountpoint, "digest": digest,
                       "result": result}
        finally:
            mountd.stop()


def test_build_counts_shards_and_members(world) -> None:
    result = world["result"]
    assert (result.shards, result.scanned_shards) == (N_SHARDS + 2, N_SHARDS + 2)
    assert result.members == result.files == len(IMAGES) + len(VICTIM) + len(INTACT)
    assert result.skipped_count == result.shadowed == 0
    with Digest.open(world["digest"]) as d:
        loc = d.lookup_path("train/class_01/img_00004.jpg").location
        assert loc.url == f"s3://{BUCKET}/{PREFIX}"
        assert loc.key.startswith("train-") and loc.offset > 0


def test_class_folders_listed(world) -> None:
    train = world["mnt"] / "train"
    assert sorted(os.listdir(world["mnt"])) == ["cut", "train"]
    assert sorted(os.listdir(train)) == ["class_00", "class_01", "class_02"]
    for c in range(3):
        expected = sorted(Path(p).name for p in IMAGES if p.startswith(f"train/class_{c:02d}/"))
        assert sorted(os.listdir(train / f"class_{c:02d}")) == expected
        assert len(expected) == 12


def test_every_member_reads_back_byte_for_byte(world) -> None:
    for path, data in IMAGES.items():
        target = world["mnt"] / path
        assert target.stat().st_size == len(data)
        assert target.read_bytes() == data, path


def test_imagefolder_over_the_shards(world) -> None:
    torchvision = pytest.importorskip("torchvision", reason="torchvision is not installed")
    dataset = torchvision.datasets.ImageFolder(str(world["mnt"] / "train"))
    assert dataset.classes == ["class_00", "class_01", "class_02"]
    assert len(dataset) == len(IMAGES)
    image, label = dataset[13]
    assert image.size == (48, 48) and label == 1


def _read_errno(path: Path) -> tuple[int, bytes]:
    fd = os.open(path, os.O_RDONLY)
    try:
        return 0, os.read(fd, 1 << 20)
    except OSError as exc:
        return exc.errno or -1, b""
    finally:
        os.close(fd)


def test_shard_cut_in_the_bucket_fails_only_members_past_the_cut(world) -> None:
    victim = SHARDS["cut/victim.tar"]
    offsets = data_offsets(victim)
    cut = offsets["victim-2.bin"] + 100  # inside the third member's data
    world["moto"].upload(BUCKET, f"{PREFIX}/cut/victim.tar", victim[:cut])
    mnt = world["mnt"] / "cut"
    for i, (name, data) in enumerate(VICTIM):
        code, got = _read_errno(mnt / name)
        if i < 2:
            assert (code, got) == (0, data), name  # wholly before the cut
        else:
            assert code == errno.EIO, name  # cut short, or entirely past the cut
    for name, data in INTACT:  # the other shard in the same folder
        assert _read_errno(mnt / name) == (0, data)
