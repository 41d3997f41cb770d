"""A real mount of a packed digest (``digests pack``): every file reads byte-identical through
its original path, served from ranged reads of the tar chunks.

The loose source tree is deleted before mounting, so the bytes can only come from the chunks.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import trio

from digests.digest import Digest
from digests.pack import pack
from tests.mount.conftest import MountdProcess, MountProcess, build_digest, file_hash, write_tree

pytestmark = pytest.mark.mount

FILES = {f"train/n{i % 5:02d}/img_{i:04d}.JPEG": os.urandom(500 + 331 * i) for i in range(60)}
FILES["train/naïve ☃/notes.txt"] = "déjà vu\n".encode()
FILES["big.bin"] = os.urandom(3 * 1024 * 1024 + 1)
FILES["empty"] = b""
EMPTY = ["valid"]


@pytest.fixture(scope="module")
def served(fuse, module_tmp: Path):
    source = module_tmp / "source"
    write_tree(source, FILES)
    for empty in EMPTY:
        (source / empty).mkdir()
    loose_id = build_digest(source, module_tmp / "loose.qd")
    digest = module_tmp / "packed.qd"
    result = trio.run(
        lambda: pack(f"file://{source}", f"file://{module_tmp / 'chunks'}", digest,
                     chunk_size=16, seed=3)
    )
    assert result.dataset_id == loose_id
    shutil.rmtree(source)
    cache = module_tmp / "cache"
    mountd = MountdProcess(cache).start()
    try:
        with MountProcess(digest, module_tmp / "mnt", cache) as mount:
            yield {"mnt": mount.mountpoint, "digest": digest}
    finally:
        mountd.stop()


def test_every_file_reads_identical_through_its_original_path(served) -> None:
    mnt = served["mnt"]
    for path, data in FILES.items():
        assert os.stat(mnt / path).st_size == len(data), path
        assert (mnt / path).read_bytes() == data, path


def test_the_tree_is_the_original_one(served) -> None:
    mnt = served["mnt"]
    seen = set()
    for dirpath, dirnames, filenames in os.walk(mnt):
        rel = os.path.relpath(dirpath, mnt)
        seen |= {os.path.normpath(os.path.join(rel, name)) for name in filenames}
        if rel in EMPTY:
            assert (dirnames, filenames) == ([], [])
    assert seen == set(FILES)
    assert os.listdir(mnt / "valid") == []


def test_reads_came_from_the_chunks(served) -> None:
    with Digest.open(served["digest"]) as d:
        for f in d.iter_files():
            assert f.location.key.startswith("chunk-") and f.location.key.endswith(".tar")
            assert file_hash(served["mnt"] / f.path) == f.hash
