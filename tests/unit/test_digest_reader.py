"""The digest format and the reader API the mount uses."""

from __future__ import annotations

import blake3
import pytest

from digests.digest import Digest, DirEntry, FileEntry
from digests.paths import components_key
from digests.schema import ROOT_ID
from digests.write import NewFile, write_digest


def h(data: bytes) -> bytes:
    return blake3.blake3(data).digest()


FILES = {
    "train/n01/a.JPEG": b"alpha",
    "train/n01/b.JPEG": b"bravo!",
    "train/n02/c.JPEG": b"c",
    "train/n02/deep/d.JPEG": b"delta",
    "val/x.JPEG": b"",
    "README": b"readme",
    "train-notes.txt": b"notes",  # '-' sorts before '/': component order differs from string order
}


@pytest.fixture
def small(tmp_path):
    path = tmp_path / "small.qd"
    write_digest(
        path,
        [NewFile(p, len(d), h(d)) for p, d in FILES.items()],
        ["s3://bucket/ds"],
    )
    with Digest.open(path) as digest:
        yield digest


def test_meta_and_counts(small):
    assert small.format_version == 2
    assert small.file_count == len(FILES)
    assert small.total_bytes == sum(len(d) for d in FILES.values())
    # root, train, train/n01, train/n02, train/n02/deep, val
    assert small.dir_count == 6
    assert small.sources == {1: "s3://bucket/ds"}
    assert len(small.dataset_id) == 64
    assert small.created_at.endswith("Z")


def test_ids_dirs_first_then_files(small):
    root = small.entry(ROOT_ID)
    assert isinstance(root, DirEntry) and root.path == "" and root.parent == 0
    dir_ids = [
        small.lookup_path(p).id
        for p in ("train", "train/n01", "train/n02", "train/n02/deep", "val")
    ]
    assert sorted(dir_ids) == dir_ids == list(range(2, 7))
    file_ids = sorted(small.lookup_path(p).id for p in FILES)
    assert file_ids == list(range(7, 7 + len(FILES)))
    assert small.entry(0) is None and small.entry(7 + len(FILES)) is None


def test_files_between_is_a_range_of_ids(small):
    last = 6 + len(FILES)
    assert small.files_between(7, last) == [small.entry(i) for i in range(7, last + 1)]
    assert [f.id for f in small.files_between(8, 10)] == [8, 9, 10]
    assert [f.id for f in small.files_between(last, last + 100)] == [last]  # ends with the digest
    assert small.files_between(1, 6) == []  # directory ids name no file
    assert small.files_between(9, 8) == []


def test_lookup_and_entries(small):
    entry = small.lookup_path("train/n02/deep/d.JPEG")
    assert isinstance(entry, FileEntry)
    assert (entry.name, entry.path, entry.size, entry.hash) == (
        "d.JPEG",
        "train/n02/deep/d.JPEG",
        5,
        h(b"delta"),
    )
    assert entry.location.url == "s3://bucket/ds"
    assert entry.location.key == "train/n02/deep/d.JPEG"
    assert (entry.location.offset, entry.location.length) == (0, 5)
    deep = small.lookup_path("train/n02/deep")
    assert small.lookup(deep.id, "d.JPEG") == entry
    assert small.entry(entry.id) == entry
    assert entry.parent == deep.id
    assert small.lookup_path("train/n02/missing") is None
    assert small.lookup_path("train/../README") is None
    assert small.lookup_path("nope/a") is None
    assert small.lookup(ROOT_ID, "train").is_dir
    assert small.lookup_path("/README").size == 6
    assert small.lookup(ROOT_ID, "bad\udcff") is None
    assert small.lookup(ROOT_ID, "a\0b") is None


def test_content_and_dir_contents_agree_with_lookup(small):
    """The direct loader's lean lookups (size and hash only) give what lookup() gives."""
    n02 = small.lookup_path("train/n02").id
    assert small.content(n02, "c.JPEG") == (1, h(b"c"))
    assert small.content(ROOT_ID, "README") == (6, h(b"readme"))
    assert small.content(n02, "deep") is None  # a directory is not a file
    assert small.content(n02, "nope") is None and small.content(n02, "a\0b") is None
    assert small.dir_contents(n02) == [("c.JPEG", 1, h(b"c"))]
    n01 = small.lookup_path("train/n01").id
    assert small.dir_contents(n01) == [("a.JPEG", 5, h(b"alpha")), ("b.JPEG", 6, h(b"bravo!"))]
    assert [name for name, _, _ in small.dir_contents(ROOT_ID)] == ["README", "train-notes.txt"]
    assert small.dir_contents(small.lookup_path("train").id) == []  # only subdirectories


def test_listdir_order_and_paging(small):
    names = [e.name for e in small.listdir(ROOT_ID)]
    assert names == ["train", "val", "README", "train-notes.txt"]  # dirs, then files, by name
    n02 = small.lookup_path("train/n02")
    page1 = small.listdir(n02.id, limit=1)
    page2 = small.listdir(n02.id, after=page1[-1].id, limit=1)
    page3 = small.listdir(n02.id, after=page2[-1].id, limit=1)
    assert [e.name for e in page1 + page2 + page3] == ["deep", "c.JPEG"]
    assert page3 == []
    with pytest.raises(ValueError):
        small.listdir(n02.id, after=ROOT_ID)


def test_iter_files_in_component_order(small):
    paths = [f.path for f in small.iter_files()]
    assert paths == sorted(FILES, key=components_key)
    assert paths[0] == "README"
    assert paths[-1] == "val/x.JPEG"
    assert [p for p, _, _ in small.iter_canonical()] == paths


def test_big_directory_pages(tmp_path):
    names = [f"img_{i:05d}.JPEG" for i in range(3000)]
    path = tmp_path / "big.qd"
    files = [NewFile(f"d/{n}", i, h(n.encode())) for i, n in enumerate(names)]
    files += [NewFile(f"d/sub{j}/x", 1, h(b"x")) for j in range(3)]
    write_digest(path, reversed(files), ["file:///data"])
    with Digest.open(path) as digest:
        d = digest.lookup_path("d")
        seen, after, pages = [], None, 0
        while page := digest.listdir(d.id, after=after, limit=700):
            seen += page
            after = page[-1].id
            pages += 1
        assert pages == 5
        assert [e.name for e in seen] == ["sub0", "sub1", "sub2"] + names
        files_only = [e for e in seen if not e.is_dir]
        # File ids ascend with names: the readdir offset can be the id.
        assert [e.id for e in files_only] == sorted(e.id for e in files_only)
        assert digest.lookup(d.id, "img_02999.JPEG").size == 2999
        assert digest.largest_dirs(1)[0][0].path == "d" and digest.largest_dirs(1)[0][1] == 3000


def test_packed_locations(tmp_path):
    path = tmp_path / "packed.qd"
    write_digest(
        path,
        [
            NewFile("a.jpg", 10, h(b"a"), source=0, key="shards/000.tar", offset=512),
            NewFile("b.jpg", 20, h(b"b"), source=1, key=None),
        ],
        ["s3://bucket/tars", "gs://other/raw"],
    )
    with Digest.open(path, check="full") as digest:
        a, b = digest.lookup_path("a.jpg"), digest.lookup_path("b.jpg")
        assert (a.location.url, a.location.key, a.location.offset, a.location.length) == (
            "s3://bucket/tars",
            "shards/000.tar",
            512,
            10,
        )
        assert (b.location.url, b.location.key) == ("gs://other/raw", "b.jpg")


def test_empty_digest(tmp_path):
    path = tmp_path / "empty.qd"
    write_digest(path, [], ["file:///nothing"])
    with Digest.open(path, check="full") as digest:
        assert digest.file_count == 0 and digest.dir_count == 1
        assert digest.listdir(ROOT_ID) == []
        assert list(digest.iter_files()) == []


def test_validated_cache_skips_full_check(tmp_path, monkeypatch):
    path = tmp_path / "c.qd"
    write_digest(path, [NewFile("a", 1, h(b"a"))], ["file:///x"])
    cache = tmp_path / "cache"
    Digest.open(path, check="full", validated_cache=cache).close()
    assert len(list(cache.glob("*.ok"))) == 1
    from digests import validate

    def boom(*args):
        raise AssertionError("full check ran again")

    monkeypatch.setattr(validate, "check_dataset_id", boom)
    monkeypatch.setattr(validate, "check_file_rows", boom)
    Digest.open(path, check="full", validated_cache=cache).close()
    with pytest.raises(AssertionError):
        Digest.open(path, check="full").close()


def test_writer_refuses_bad_trees(tmp_path):
    from digests.errors import DigestError

    with pytest.raises(DigestError, match="duplicate path 'a/b'"):
        write_digest(tmp_path / "x.qd", [("a/b", 1, h(b"1")), ("a/b", 1, h(b"1"))], ["file:///x"])
    with pytest.raises(DigestError, match="both a file and a directory"):
        write_digest(tmp_path / "x.qd", [("a", 1, h(b"1")), ("a/b", 1, h(b"1"))], ["file:///x"])
    with pytest.raises(DigestError, match="not allowed"):
        write_digest(tmp_path / "x.qd", [("a/../b", 1, h(b"1"))], ["file:///x"])
    assert not (tmp_path / "x.qd").exists()
    assert list(tmp_path.iterdir()) == []
