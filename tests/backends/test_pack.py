"""digests pack into the S3 emulator (moto on loopback): from file://, and from S3 itself,
with a resume that writes only the missing chunks."""

from __future__ import annotations

import errno
import io
import json
import os
import tarfile
import uuid
from pathlib import Path

import blake3
import pytest

from digests.build import build
from digests.digest import Digest
from digests.pack import MANIFEST_KEY, pack
from digests.verify import verify
from quiverfs.base.backends import Backend, BackendOptions
from quiverfs.base.errors import PermanentFailure, UsageError
from quiverfs.testing.emulators import MotoEmulator

from .conftest import OpenAt

pytestmark = pytest.mark.backends

FILES = {f"train/c{i % 3}/{i:03d}.jpg": os.urandom(200 + 97 * i) for i in range(23)}
FILES["train/naïve ☃.txt"] = b"unicode name"
FILES["empty"] = b""


def b3(data: bytes) -> bytes:
    return blake3.blake3(data).digest()


@pytest.fixture
def bucket(moto: MotoEmulator) -> str:
    name = f"pack-{uuid.uuid4().hex[:12]}"
    moto.create_bucket(name)
    return name


@pytest.fixture
def source(tmp_path: Path) -> Path:
    for rel, data in FILES.items():
        (tmp_path / "data" / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "data" / rel).write_bytes(data)
    return tmp_path / "data"


async def _tar_members(backend: Backend, key: str) -> dict[str, bytes]:
    blob = await backend.read(key)
    with tarfile.open(fileobj=io.BytesIO(blob)) as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers()}


async def test_pack_file_into_s3(
    moto: MotoEmulator, bucket: str, source: Path, tmp_path: Path, open_at: OpenAt
) -> None:
    dst = open_at(moto.root_url(bucket, "packed"), BackendOptions(concurrency=4), moto.settings())
    out = tmp_path / "packed.qd"
    result = await pack(f"file://{source}", dst, out, chunk_size=5, seed=42, workers=4)
    n_chunks = -(-len(FILES) // 5)
    assert result.chunks == result.written_chunks == n_chunks
    assert dst.counters.requests["PUT"] == n_chunks + 1  # the chunks and the manifest
    assert dst.counters.retries == 0

    keys = sorted([info.key async for info in dst.list()])
    assert keys == sorted([f"chunk-{i:06d}.tar" for i in range(n_chunks)] + [MANIFEST_KEY])
    packed: dict[str, bytes] = {}
    for key in keys[:-1]:
        packed.update(await _tar_members(dst, key))
    assert packed == FILES
    assert json.loads(await dst.read(MANIFEST_KEY))["seed"] == 42

    loose = tmp_path / "loose.qd"
    await build(f"file://{source}", loose)
    with Digest.open(out, check="full") as d, Digest.open(loose) as lo:
        assert d.dataset_id == lo.dataset_id
        assert list(d.sources.values()) == [dst.url] == ["s3://" + bucket + "/packed"]
        for f in d.iter_files():
            data = await dst.read_range(f.location.key, f.location.offset, f.location.length)
            assert b3(data) == f.hash == b3(FILES[f.path])
        checked = await verify(d, settings=moto.settings())
        assert checked.ok and checked.checked == len(FILES)


async def test_pack_s3_to_s3_resumes_with_only_the_missing_chunks(
    moto: MotoEmulator, bucket: str, tmp_path: Path, open_at: OpenAt
) -> None:
    moto.upload_many(bucket, {f"loose/{k}": v for k, v in FILES.items()})
    options, settings = BackendOptions(concurrency=4), moto.settings()
    src = open_at(moto.root_url(bucket, "loose"), options, settings)
    loose = tmp_path / "loose.qd"
    await build(src, loose)
    out = tmp_path / "p.qd"

    with pytest.raises(UsageError, match="inside the source"):
        await pack(src, moto.root_url(bucket, "loose/packed"), out, digest=loose)

    first = open_at(moto.root_url(bucket, "packed"), options, settings)
    real = first._write_object
    puts = 0

    def failing(key: str, data: bytes) -> None:
        nonlocal puts
        puts += 1
        if puts > 3:  # the manifest and two chunks, then the disk of the world is full
            raise OSError(errno.ENOSPC, "injected")
        real(key, data)

    first._write_object = failing  # type: ignore[method-assign]
    with pytest.raises(PermanentFailure):
        await pack(src, first, out, chunk_size=4, digest=loose, workers=1)
    assert not out.exists()

    second = open_at(moto.root_url(bucket, "packed"), options, settings)
    gets_before = src.counters.requests["GET"]
    result = await pack(src, second, out, chunk_size=4, digest=loose, workers=2)
    n_chunks = -(-len(FILES) // 4)
    assert result.reused_chunks == 2
    assert second.counters.requests["PUT"] == result.written_chunks == n_chunks - 2
    # Only the missing chunks' files were read again.
    reused = {}
    for i in range(2):
        reused.update(await _tar_members(second, f"chunk-{i:06d}.tar"))
    missing_files = sum(1 for path, v in FILES.items() if v and path not in reused)
    assert src.counters.requests["GET"] - gets_before == missing_files
    with Digest.open(out, check="full") as d, Digest.open(loose) as lo:
        assert d.dataset_id == lo.dataset_id
        assert (await verify(d, settings=settings)).ok
