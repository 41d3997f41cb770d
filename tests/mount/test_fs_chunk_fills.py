"""A packed dataset in an S3 emulator read through a real mount: one ranged GET per chunk
(mountd's chunk fills, issue 14), every file byte-identical; a member altered in the bucket
after its digest was built reads as EIO while its neighbours read fine."""

from __future__ import annotations

import errno
import os
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from quiverfs.testing.emulators import run_moto
from quiverfs.testing.packed import PackedFile, pack, packed_digest
from tests.mount.conftest import MountdProcess, MountProcess

SIZE = 16 * 1024
PER_CHUNK = 32


@pytest.fixture(scope="module")
def world(fuse, module_tmp: Path) -> Iterator[dict]:
    """moto with a good packed dataset (2 chunks) and a damaged one (1 chunk, member 5
    altered), their digests, and a mountd that reaches moto through its environment."""
    with run_moto() as s3, pytest.MonkeyPatch.context() as env:
        for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3"):
            env.delenv(name, raising=False)
        for name, value in s3.env.items():  # inherited by mountd
            env.setenv(name, value)
        bucket = f"packed-{uuid.uuid4().hex[:10]}"
        s3.create_bucket(bucket)
        good_objects, good = pack(
            [(f"good/{i:03d}.bin", os.urandom(SIZE)) for i in range(2 * PER_CHUNK)], PER_CHUNK)
        bad_objects, bad = pack(
            [(f"bad/{i:03d}.bin", os.urandom(SIZE)) for i in range(PER_CHUNK)], PER_CHUNK,
            prefix="damaged/")
        packed_digest(module_tmp / "good.qd", s3.root_url(bucket), good)
        packed_digest(module_tmp / "bad.qd", s3.root_url(bucket), bad)
        victim = bad[5]
        raw = bytearray(bad_objects[victim.key])
        raw[victim.offset + 7] ^= 0x55
        bad_objects[victim.key] = bytes(raw)
        s3.upload_many(bucket, good_objects | bad_objects)
        cache = module_tmp / "cache"
        mountd = MountdProcess(cache).start()
        try:
            yield {"tmp": module_tmp, "cache": cache, "good": good, "bad": bad}
        finally:
            mountd.stop()


def _counters(cache: Path) -> dict:
    from mountd.rpc.client import SyncClient

    with SyncClient.connect(cache, timeout=5.0) as client:
        return client.stats()["counters"]["total"]


def _read(root: Path, f: PackedFile) -> bytes:
    return (root / f.path).read_bytes()


def test_cold_reads_of_a_packed_dataset_make_one_get_per_chunk(world: dict) -> None:
    good: list[PackedFile] = world["good"]
    with MountProcess(world["tmp"] / "good.qd", world["tmp"] / "good-mnt", world["cache"]) as mount:
        with ThreadPoolExecutor(8) as pool:
            got = list(pool.map(lambda f: _read(mount.mountpoint, f), good[::-1]))
        assert got == [f.data for f in good[::-1]]
        total = _counters(world["cache"])
    assert total["remote_requests"]["GET"] == 2
    assert (total["chunk_fills"], total["chunk_members"]) == (2, 2 * PER_CHUNK)
    assert total["verify_failures"] == 0


def test_a_member_altered_in_the_bucket_reads_as_eio_alone(world: dict) -> None:
    bad: list[PackedFile] = world["bad"]
    with MountProcess(world["tmp"] / "bad.qd", world["tmp"] / "bad-mnt", world["cache"]) as mount:
        assert _read(mount.mountpoint, bad[0]) == bad[0].data  # fetches the chunk
        with pytest.raises(OSError) as caught:
            _read(mount.mountpoint, bad[5])
        assert caught.value.errno == errno.EIO
        for f in bad:
            if f is not bad[5]:
                assert _read(mount.mountpoint, f) == f.data, f.path
    assert _counters(world["cache"])["verify_failures"] >= 1
