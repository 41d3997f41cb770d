"""A real mount shows a tree's empty directories, serves version 1 digests, and refuses
hostile digests with one line.

DLIO (the MLPerf Storage engine) lists its empty ``valid/`` at start: a mount that dropped
empty directories made it exit with FileNotFoundError (docs/digest-format.md, format 2).
"""

from __future__ import annotations

import os
import shutil
import sqlite3
import subprocess
from pathlib import Path

import pytest

from digests.digest import Digest
from digests.errors import DigestError
from tests.mount.conftest import (
    REPO,
    MountdProcess,
    MountProcess,
    build_digest,
    force_unmount,
    quiverfs_cmd,
    write_tree,
)

pytestmark = pytest.mark.mount

FILES = {
    "train/img_0.npz": b"zero" * 1000,
    "train/img_1.npz": b"one" * 777,
    "README": b"a DLIO-like layout\n",
}
EMPTY = ["valid", "checkpoints/run1", "train/none"]


def _walk(root: Path) -> list[tuple[str, list[str], list[str]]]:
    return sorted((os.path.relpath(dirpath, root), sorted(dirnames), sorted(filenames))
                  for dirpath, dirnames, filenames in os.walk(root))


@pytest.fixture(scope="module")
def served(fuse, module_tmp: Path):
    """The source tree, its digest, a mountd and the digest mounted (module scope)."""
    source = module_tmp / "source"
    write_tree(source, FILES)
    for empty in EMPTY:
        (source / empty).mkdir(parents=True)
    digest = module_tmp / "tree.qd"
    build_digest(source, digest)
    cache = module_tmp / "cache"
    mountd = MountdProcess(cache).start()
    try:
        with MountProcess(digest, module_tmp / "mnt", cache) as mount:
            yield {"source": source, "digest": digest, "cache": cache, "mnt": mount.mountpoint,
                   "work": module_tmp}
    finally:
        mountd.stop()


def test_empty_directory_lists_empty(served) -> None:
    mnt = served["mnt"]
    assert os.listdir(mnt / "valid") == []
    assert os.path.isdir(mnt / "checkpoints" / "run1")
    assert sorted(os.listdir(mnt)) == ["README", "checkpoints", "train", "valid"]


def test_walk_equals_the_source_walk(served) -> None:
    walked = _walk(served["mnt"])
    assert walked == _walk(served["source"])
    assert ("valid", [], []) in walked and ("train/none", [], []) in walked
    for rel, data in FILES.items():
        assert (served["mnt"] / rel).read_bytes() == data


def test_version_1_digest_mounts(served) -> None:
    """A digest written by the version 1 rules (no empty directory, version '1') still
    opens and mounts, with the dataset id it always had."""
    work = served["work"]
    plain = work / "plain"
    write_tree(plain, FILES)
    v1 = work / "v1.qd"
    dataset = build_digest(plain, v1)
    conn = sqlite3.connect(v1)
    conn.execute("UPDATE meta SET value = '1' WHERE key = 'format_version'")
    conn.commit()
    conn.close()
    with Digest.open(v1, check="full") as d:
        assert (d.format_version, d.dataset_id) == (1, dataset)
    with MountProcess(v1, work / "v1-mnt", served["cache"]) as mount:
        assert _walk(mount.mountpoint) == _walk(plain)
        for rel, data in FILES.items():
            assert (mount.mountpoint / rel).read_bytes() == data


def _mount_refuses(work: Path, digest: Path, cache: Path, expected: str) -> None:
    mnt = work / f"refused-{digest.name}"
    mnt.mkdir(exist_ok=True)
    try:
        proc = subprocess.run(
            quiverfs_cmd("mount", "--cache-dir", str(cache), str(digest), str(mnt)),
            capture_output=True, text=True, timeout=30, cwd=REPO,
        )
        mounted = os.path.ismount(mnt)
    finally:
        force_unmount(mnt)  # only if a regression let it mount
    assert not mounted
    assert proc.returncode == DigestError.exit_code, proc
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr


def test_mount_refuses_a_fifo_at_once(served) -> None:
    fifo = served["work"] / "fifo.qd"
    os.mkfifo(fifo)
    # The 30 s timeout of the subprocess is the regression check: it used to wait 60 s.
    _mount_refuses(served["work"], fifo, served["cache"], "not a regular file (a FIFO)")


def test_mount_refuses_undecodable_names(served) -> None:
    bad = served["work"] / "bad-utf8.qd"
    shutil.copy(served["digest"], bad)
    conn = sqlite3.connect(bad)
    conn.execute("UPDATE dirs SET name = CAST(X'76ff' AS TEXT) WHERE name = 'valid'")
    conn.commit()
    conn.close()
    _mount_refuses(served["work"], bad, served["cache"], "name is not valid UTF-8")
