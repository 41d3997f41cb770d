"""The same files held in S3, Azure, GCS and a local directory give one dataset id.

The dataset id hashes paths, sizes and content hashes, never locations (docs/digest-format.md),
so a digest built from any copy identifies the same dataset version; the recorded locations
must still name each copy's own store.
"""

from __future__ import annotations

from pathlib import Path

import blake3
import pytest

from digests.build import build
from digests.digest import Digest
from quiverfs.base.backends import BackendOptions
from quiverfs.testing.sample_data import generate_images

pytestmark = pytest.mark.backends

FILES = dict(generate_images(n_classes=3, per_class=4, size=32))
FILES["train/empty file.txt"] = b""
FILES["train/naïve ☃/notes.txt"] = "unicode déjà vu".encode()


@pytest.fixture(scope="module")
def copies(moto, azurite, gcs_emulator, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One copy of FILES per store: scheme → (root URL, RemoteSettings)."""
    local = tmp_path_factory.mktemp("local-copy")
    for rel, data in FILES.items():
        (local / rel).parent.mkdir(parents=True, exist_ok=True)
        (local / rel).write_bytes(data)
    roots = {"file": (f"file://{local}", None)}
    for emulator, bucket in ((moto, "same-id"), (azurite, "same-id"), (gcs_emulator, "same-id")):
        emulator.create_bucket(bucket)
        emulator.upload_many(bucket, {f"copy/{k}": v for k, v in FILES.items()})
        roots[emulator.scheme] = (emulator.root_url(bucket, "copy"), emulator.settings())
    return roots


async def test_every_store_gives_the_same_dataset_id(copies: dict, open_at, tmp_path: Path) -> None:
    ids = {}
    for scheme, (url, settings) in copies.items():
        backend = open_at(url, BackendOptions(concurrency=4 if scheme != "gs" else 1), settings)
        out = tmp_path / f"{scheme}.digest"
        result = await build(backend, out, workers=4)
        assert result.files == len(FILES)
        with Digest.open(out, check="full") as digest:
            ids[scheme] = digest.dataset_id
            assert list(digest.sources.values()) == [backend.url]
            for entry in digest.iter_files():
                assert entry.hash == blake3.blake3(FILES[entry.path]).digest()
                assert entry.size == len(FILES[entry.path])
    assert set(ids) == {"file", "s3", "az", "gs"}
    assert len(set(ids.values())) == 1, ids
