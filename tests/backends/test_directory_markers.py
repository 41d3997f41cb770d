"""Bucket directory markers become directories of the digest, empty ones included, never files.

A "folder" made in the S3, GCS or Azure console (or by tools such as DLIO's data generator) is
a zero-byte object whose key ends in ``/``; Azure accounts with a hierarchical namespace and
Storage Explorer mark folders with an ``hdi_isfolder=true`` blob instead. docs/backends.md.
"""

from __future__ import annotations

from pathlib import Path

import blake3
import pytest

from digests.build import build
from digests.digest import Digest
from quiverfs.base.backends import DIRECTORY, OBJECT, BackendOptions

pytestmark = pytest.mark.backends

FILES = {"train/a.jpg": b"a" * 100, "train/b.jpg": b"b" * 50}
MARKERS = ["train/", "valid/", "extra/deeper/"]  # one over files, two empty


@pytest.mark.parametrize("fixture", ["moto", "azurite", "gcs_emulator"])
async def test_markers_are_kept_as_directories(fixture, request, open_at, tmp_path: Path) -> None:
    emulator = request.getfixturevalue(fixture)
    bucket = f"markers-{emulator.scheme}"
    emulator.create_bucket(bucket)
    emulator.upload_many(bucket, {f"ds/{k}": v for k, v in FILES.items()})
    for marker in MARKERS:
        emulator.upload(bucket, f"ds/{marker}", b"")
    backend = open_at(emulator.root_url(bucket, "ds"), BackendOptions(concurrency=1),
                      emulator.settings())
    listed = {info.key: info.kind async for info in backend.list()}
    assert listed == {"train/a.jpg": OBJECT, "train/b.jpg": OBJECT, "train": DIRECTORY,
                      "valid": DIRECTORY, "extra/deeper": DIRECTORY}

    result = await build(backend, tmp_path / "d.qd", workers=2)
    assert (result.files, result.markers, result.empty_dirs, result.skipped_count) == (2, 3, 2, 0)
    with Digest.open(tmp_path / "d.qd", check="full") as d:
        assert sorted(f.path for f in d.iter_files()) == sorted(FILES)
        assert d.empty_dirs() == ["extra/deeper", "valid"]
        valid = d.lookup_path("valid")
        assert valid.is_dir and d.listdir(valid.id) == []
        for path, data in FILES.items():
            assert d.lookup_path(path).hash == blake3.blake3(data).digest()


async def test_azure_folder_blobs_are_directories(azurite, open_at, tmp_path: Path) -> None:
    """``hdi_isfolder`` blobs (no trailing ``/``) are folders, not zero-byte files."""
    azurite.create_bucket("hdi")
    azurite.upload_many("hdi", {f"ds/{k}": v for k, v in FILES.items()})
    container = azurite.client.get_container_client("hdi")
    for folder in ("ds/train", "ds/valid"):
        container.upload_blob(folder, b"", metadata={"hdi_isfolder": "true"})
    backend = open_at(azurite.root_url("hdi", "ds"), BackendOptions(concurrency=2),
                      azurite.settings())
    result = await build(backend, tmp_path / "d.qd", workers=2)
    assert (result.files, result.markers, result.empty_dirs, result.skipped_count) == (2, 2, 1, 0)
    with Digest.open(tmp_path / "d.qd", check="full") as d:
        assert sorted(f.path for f in d.iter_files()) == sorted(FILES)
        assert d.empty_dirs() == ["valid"]
