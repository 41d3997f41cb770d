"""The chunk map of a packed dataset (mountd/coop/packing.py), through a real digest."""

from __future__ import annotations

import blake3
import trio

from digests.write import NewFile, write_digest
from mountd.coop.datasets import load_view


def _file(path: str, key: str | None, offset: int) -> NewFile:
    data = path.encode()
    return NewFile(path, len(data), blake3.blake3(data).digest(), 0, key, offset)


def test_files_sharing_an_object_form_one_chunk_in_offset_order(tmp_path) -> None:
    files = [
        # chunk-1 holds c, a, e at increasing offsets (shuffled order, as digests pack writes)
        _file("train/c.jpg", "chunk-1.tar", 512),
        _file("train/a.jpg", "chunk-1.tar", 2048),
        _file("val/e.jpg", "chunk-1.tar", 4096),
        # chunk-0 holds b and d
        _file("train/d.jpg", "chunk-0.tar", 1536),
        _file("train/b.jpg", "chunk-0.tar", 512),
        # loose: its own object, or the only file of an object
        _file("loose.txt", None, 0),
        _file("alone.jpg", "chunk-9.tar", 512),
    ]
    out = tmp_path / "packed.qd"
    dataset = write_digest(out, files, ["s3://bucket/packed"])
    view = trio.run(load_view, dataset, out)
    try:
        packing = view.packing
        assert packing is not None
        assert packing.chunks == 2
        paths = {cid: view.digest.entry(view.file_ids[cid]).path for cid in range(view.count)}
        by_path = {path: cid for cid, path in paths.items()}
        groups = sorted([paths[c] for c in packing.members_of(k)] for k in range(packing.chunks))
        assert groups == [["train/b.jpg", "train/d.jpg"],
                          ["train/c.jpg", "train/a.jpg", "val/e.jpg"]]
        assert packing.chunk(by_path["loose.txt"]) == -1
        assert packing.chunk(by_path["alone.jpg"]) == -1
        assert list(packing.siblings(by_path["alone.jpg"])) == [by_path["alone.jpg"]]
        a = by_path["train/a.jpg"]
        assert [paths[c] for c in packing.siblings(a)] == ["train/c.jpg", "train/a.jpg", "val/e.jpg"]
        assert packing.chunk(a) == packing.chunk(by_path["val/e.jpg"])
    finally:
        view.close()


def test_a_loose_dataset_has_no_packing(tmp_path) -> None:
    files = [_file(f"d/{i}.bin", None, 0) for i in range(5)]
    out = tmp_path / "loose.qd"
    dataset = write_digest(out, files, ["file:///data"])
    view = trio.run(load_view, dataset, out)
    try:
        assert view.packing is None
    finally:
        view.close()
