"""The dataset id: a function of canonical content only, reproducible from the spec."""

from __future__ import annotations

import blake3

from digests.digest import Digest
from digests.write import NewFile, write_digest

CONTENT = {"b/x": b"one", "a/y": b"two", "a-z": b"three", "a/sub/q": b""}


def h(data: bytes) -> bytes:
    return blake3.blake3(data).digest()


def spec_id(files: dict[str, bytes]) -> str:
    """Independent implementation of docs/digest-format.md's algorithm."""
    hasher = blake3.blake3(b"quiverfs-dataset-v1\n")
    for path in sorted(files, key=lambda p: p.encode().split(b"/")):
        data = files[path]
        hasher.update(path.encode() + b"\0" + len(data).to_bytes(8, "big") + h(data))
    return hasher.hexdigest()


def write(tmp_path, name, files, sources=("s3://bucket/ds",), **kw):
    path = tmp_path / name
    write_digest(path, [NewFile(p, len(d), h(d), **kw) for p, d in files.items()], list(sources))
    return path


def test_id_matches_spec(tmp_path):
    with Digest.open(write(tmp_path, "a.qd", CONTENT), check="full") as d:
        assert d.dataset_id == spec_id(CONTENT)


def test_same_content_two_sources_same_id(tmp_path):
    a = write(tmp_path, "a.qd", CONTENT, ("s3://bucket/ds",))
    b = write(
        tmp_path,
        "b.qd",
        dict(reversed(CONTENT.items())),
        ("file:///mnt/copy", "gs://x/y"),
        source=1,
    )
    with Digest.open(a) as da, Digest.open(b) as db:
        assert da.sources != db.sources
        assert da.dataset_id == db.dataset_id


def test_locations_do_not_change_id(tmp_path):
    a = write(tmp_path, "a.qd", CONTENT)
    b = write(tmp_path, "b.qd", CONTENT, key="pack.tar", offset=4096)
    with Digest.open(a) as da, Digest.open(b) as db:
        assert da.dataset_id == db.dataset_id
        assert db.lookup_path("b/x").location.key == "pack.tar"


def test_changes_change_id(tmp_path):
    base = spec_id(CONTENT)
    one_byte = dict(CONTENT, **{"b/x": b"onE"})
    renamed = {("b/X" if p == "b/x" else p): d for p, d in CONTENT.items()}
    extra = dict(CONTENT, **{"new": b""})
    ids = set()
    for i, files in enumerate((one_byte, renamed, extra)):
        with Digest.open(write(tmp_path, f"{i}.qd", files), check="full") as d:
            assert d.dataset_id == spec_id(files) != base
            ids.add(d.dataset_id)
    assert len(ids) == 3
