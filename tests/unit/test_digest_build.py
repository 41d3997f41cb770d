"""digests build: hashing through the Backend interface, progress, resume, --location."""

from __future__ import annotations

import json
import os
import sqlite3
from pathlib import Path

import blake3
import pytest
import trio

from digests import build as build_module
from digests.build import build, hash_object
from digests.digest import Digest
from digests.progress import Progress
from digests.write import NewFile, write_digest
from quiverfs.base.backends import BackendOptions, RemoteSettings, open_backend
from quiverfs.base.errors import AccessDenied, CorruptObject, NotFound, UsageError

FILES = {f"train/c{i % 5}/img_{i:03d}.jpg": os.urandom(100 + i * 37) for i in range(60)}
FILES["big/blob.bin"] = os.urandom(3 * 1024 * 1024 + 17)
FILES["empty"] = b""


def url(path: Path) -> str:
    return "file://" + str(path)


def backend(path: Path, **kw):
    return open_backend(url(path), BackendOptions(**kw), RemoteSettings())


@pytest.fixture
def tree(tmp_path, make_tree) -> Path:
    return make_tree(tmp_path / "data", FILES)


async def test_build_hashes_every_file(tree, tmp_path):
    out = tmp_path / "d.qd"
    progress = Progress()
    result = await build(url(tree), out, workers=4, progress=progress, settings=RemoteSettings())
    assert result.files == len(FILES) == result.hashed_files
    assert result.total_bytes == sum(map(len, FILES.values()))
    assert (progress.done_files, progress.done_bytes) == (len(FILES), result.total_bytes)
    assert progress.total_known and progress.total_files == len(FILES)
    assert not (tmp_path / "d.qd.partial").exists()
    assert sorted(os.listdir(tmp_path)) == ["d.qd", "data"]
    with Digest.open(out, check="full") as d:
        assert d.dataset_id == result.dataset_id
        assert d.sources == {1: url(tree)}
        for path, data in FILES.items():
            entry = d.lookup_path(path)
            assert entry.hash == blake3.blake3(data).digest()
            assert entry.size == len(data)
            assert entry.location.key == path


async def test_large_object_read_in_chunks(tree, monkeypatch):
    monkeypatch.setattr(build_module, "DEFAULT_CHUNK", 1024 * 1024)
    b = backend(tree)
    info = await b.stat("big/blob.bin")
    size, _, digest = await hash_object(b, info)
    assert (size, digest) == (
        len(FILES["big/blob.bin"]),
        blake3.blake3(FILES["big/blob.bin"]).digest(),
    )
    # 4 ranged GETs of 1 MiB (the last one short) + 1 probe past the end; a HEAD for the version
    assert b.counters.requests["GET"] == 5 and b.counters.requests["HEAD"] == 2


async def test_location_records_other_url(tree, tmp_path):
    out = tmp_path / "d.qd"
    plain = await build(backend(tree), tmp_path / "plain.qd")
    result = await build(backend(tree), out, location="s3://bucket/imagenet/")
    assert result.dataset_id == plain.dataset_id  # location is not content
    with Digest.open(out) as d:
        assert d.sources == {1: "s3://bucket/imagenet"}
        loc = d.lookup_path("train/c1/img_001.jpg").location
        assert (loc.url, loc.key) == ("s3://bucket/imagenet", "train/c1/img_001.jpg")


class FailAfter:
    """Wraps a backend's _read_range to fail permanently after ``n`` reads."""

    def __init__(self, backend, n):
        self.n, self.reads, self.inner = n, 0, backend._read_range
        backend._read_range = self

    def __call__(self, *args):
        self.reads += 1
        if self.reads > self.n:
            raise PermissionError(13, "injected failure")
        return self.inner(*args)


async def test_resume_after_failure_rereads_nothing_done(tree, tmp_path):
    out = tmp_path / "d.qd"
    first = backend(tree, concurrency=2)
    FailAfter(first, 25)
    with pytest.raises(Exception) as info:
        await build(first, out, workers=2)
    assert isinstance(info.value, AccessDenied)  # one error, not a group
    assert not out.exists() and (tmp_path / "d.qd.partial").exists()
    done = (
        sqlite3.connect(tmp_path / "d.qd.partial")
        .execute("SELECT count(*) FROM hashed")
        .fetchone()[0]
    )
    assert 20 <= done <= 25  # everything hashed before the failure was committed
    second = backend(tree)
    result = await build(second, out, workers=4)
    assert result.reused_files == done
    assert result.hashed_files == len(FILES) - done
    # Only the objects not hashed in the first run were read (empty and big files: 1 GET each)
    assert second.counters.requests["GET"] == len(FILES) - done
    with Digest.open(out, check="full") as d:
        assert d.file_count == len(FILES)
        assert d.lookup_path("big/blob.bin").hash == blake3.blake3(FILES["big/blob.bin"]).digest()


class CancelAfter(Progress):
    def __init__(self, n, scope):
        super().__init__()
        self.n, self.scope = n, scope

    def advance(self, files, nbytes):
        super().advance(files, nbytes)
        if self.done_files >= self.n:
            self.scope.cancel()


async def test_resume_after_cancellation(tree, tmp_path):
    out = tmp_path / "d.qd"
    with trio.CancelScope() as scope:
        await build(backend(tree), out, workers=3, progress=CancelAfter(10, scope))
    assert scope.cancelled_caught and not out.exists()
    second = backend(tree)
    progress = Progress()
    result = await build(second, out, workers=3, progress=progress)
    assert result.reused_files >= 10
    assert (
        second.counters.requests["GET"] == result.hashed_files == len(FILES) - result.reused_files
    )
    assert progress.done_files == len(FILES)


async def test_resume_rehashes_changed_objects(tree, tmp_path):
    out = tmp_path / "d.qd"
    with trio.CancelScope() as scope:
        await build(backend(tree), out, workers=2, progress=CancelAfter(10, scope))
    partial = sqlite3.connect(tmp_path / "d.qd.partial")
    keys = [k for (k,) in partial.execute("SELECT key FROM hashed WHERE key LIKE 'train/%'")]
    (done,) = partial.execute("SELECT count(*) FROM hashed").fetchone()
    partial.close()
    changed = tree / keys[0]
    changed.write_bytes(b"new content")  # a new size and a new mtime (the file version)
    result = await build(backend(tree), out)
    assert result.reused_files == done - 1
    with Digest.open(out, check="full") as d:
        assert d.lookup_path(keys[0]).hash == blake3.blake3(b"new content").digest()


async def test_partial_of_another_build_refused(tree, tmp_path):
    out = tmp_path / "d.qd"
    with trio.CancelScope() as scope:
        await build(backend(tree), out, progress=CancelAfter(5, scope))
    with pytest.raises(UsageError, match="belongs to another build"):
        await build(backend(tree), out, location="s3://elsewhere/x")


async def test_markers_and_invalid_keys_skipped(tmp_path, memory_backend):
    objects = {
        "ok/a.jpg": b"a",
        "ok/": b"",  # S3 console directory marker
        "bad//double": b"x",
        "../escape": b"x",
        "dir": b"clash",  # also the directory of dir/inner
        "dir/inner": b"in",
    }
    mem = memory_backend(objects)
    progress = Progress()
    result = await build(mem, tmp_path / "m.qd", progress=progress)
    assert result.markers == 1
    assert result.skipped_count == 3
    assert {k for k, _ in result.skipped} == {"bad//double", "../escape", "dir"}
    assert len(progress.notes) == 3
    with Digest.open(tmp_path / "m.qd") as d:
        assert sorted(f.path for f in d.iter_files()) == ["dir/inner", "ok/a.jpg"]


async def test_object_growing_during_build_is_rehashed(tmp_path, memory_backend):
    mem = memory_backend({"a": b"12345", "b": b"b"})
    grown = []

    def on_read(key):
        if key == "a" and not grown:
            grown.append(1)
            mem.put("a", b"1234567")  # grows right after being listed/read

    mem.on_read = on_read
    await build(mem, tmp_path / "g.qd", workers=1)
    with Digest.open(tmp_path / "g.qd") as d:
        entry = d.lookup_path("a")
        # Listed at 5 bytes, read at 7: re-stat and record the content actually hashed.
        assert (entry.size, entry.hash) == (7, blake3.blake3(b"1234567").digest())
        assert d.total_bytes == 8


async def test_object_changing_forever_is_an_error(tmp_path, memory_backend):
    mem = memory_backend({"a": b"x"})
    mem.on_read = lambda key: mem.put(key, mem.objects[key] + b"x")
    with pytest.raises(CorruptObject, match="keeps changing"):
        await build(mem, tmp_path / "c.qd")
    assert not (tmp_path / "c.qd").exists()


async def test_stale_tmp_removed_and_missing_out_dir(tree, tmp_path):
    stale = tmp_path / "d.qd.tmp-999999999"
    stale.write_bytes(b"half a digest")
    await build(backend(tree), tmp_path / "d.qd")
    assert not stale.exists()
    with pytest.raises(UsageError, match="output directory does not exist"):
        await build(backend(tree), tmp_path / "nope" / "d.qd")


async def test_failure_before_any_work_leaves_no_partial(tree, tmp_path):
    """A missing source: nothing to resume, so no OUT.partial is left behind; a partial that
    holds hashed files is kept (test_resume_after_failure_rereads_nothing_done)."""
    with pytest.raises(NotFound):
        await build(backend(tmp_path / "missing"), tmp_path / "d.qd")
    assert sorted(os.listdir(tmp_path)) == ["data"]
    # A partial from an earlier run is never removed by a failing rerun.
    (tmp_path / "d.qd.partial").write_bytes(b"")
    with pytest.raises(NotFound):
        await build(backend(tmp_path / "missing"), tmp_path / "d.qd")
    assert (tmp_path / "d.qd.partial").exists()


def test_progress_kinds():
    import io

    from digests.progress import LineProgress, make_progress

    assert type(make_progress("build", quiet=True)) is Progress
    stream = io.StringIO()
    progress = make_progress("build", stream=stream)
    assert isinstance(progress, LineProgress)
    progress.add_total(3, 3000)
    progress.totals_known()
    progress.advance(2, 2000)
    progress.note("skipping 'x': empty path component")
    progress.close()
    lines = stream.getvalue().splitlines()
    assert lines[-2] == "build: warning: skipping 'x': empty path component"
    assert lines[-1].startswith("build: 2/3 files, 2.0 KB of 3.0 KB, ")


# -- what a tree is: empty directories and symbolic links ---------------------------------------


def _v1_id(files: dict[str, bytes]) -> str:
    """The dataset id as format version 1 defined it (files only), written out here."""
    hasher = blake3.blake3(b"quiverfs-dataset-v1\n")
    for path in sorted(files, key=lambda p: p.encode().split(b"/")):
        data = files[path]
        hasher.update(path.encode() + b"\0" + len(data).to_bytes(8, "big")
                      + blake3.blake3(data).digest())
    return hasher.hexdigest()


async def test_empty_directories_are_kept(tmp_path, make_tree):
    files = {"train/a.jpg": b"a", "train/b.jpg": b"bb", "top.txt": b"top"}
    plain = make_tree(tmp_path / "plain", files)
    source = make_tree(tmp_path / "source", files)
    for empty in ("valid", "nested/deeper/deepest", "train/none"):
        (source / empty).mkdir(parents=True)

    without = await build(url(plain), tmp_path / "plain.qd")
    result = await build(url(source), tmp_path / "d.qd")
    assert result.files == 3 and result.empty_dirs == 3
    # No empty directory: the id version 1 gave the same files. Empty ones change the id.
    assert without.dataset_id == _v1_id(files)
    assert result.dataset_id != without.dataset_id
    with Digest.open(tmp_path / "d.qd", check="full") as d:
        assert d.format_version == 2
        assert d.empty_dirs() == ["nested/deeper/deepest", "train/none", "valid"]
        valid = d.lookup_path("valid")
        assert valid.is_dir and d.listdir(valid.id) == []
        assert [e.name for e in d.listdir(d.lookup_path("nested").id)] == ["deeper"]
        assert [e.name for e in d.listdir(d.lookup_path("train").id)] == [
            "none", "a.jpg", "b.jpg"]
        assert d.file_count == 3 and d.dir_count == 7  # root, nested, deeper, deepest, train,
        # train/none, valid
    with Digest.open(tmp_path / "plain.qd") as d:
        assert d.empty_dirs() == []


async def test_markers_become_directories_never_files(tmp_path, memory_backend):
    mem = memory_backend({
        "train/a.jpg": b"a",
        "train/": b"",          # marker of a directory that has files: changes nothing
        "valid/": b"",          # marker of an empty directory: kept
        "deep/er/": b"",        # nested empty
        "clash": b"file",       # an object and a marker of the same name: the directory wins
        "clash/": b"",
        "..//": b"",            # an invalid marker is skipped like an invalid key
    })
    progress = Progress()
    result = await build(mem, tmp_path / "m.qd", progress=progress)
    assert result.markers == 5 and result.empty_dirs == 3
    assert {k for k, _ in result.skipped} == {"clash", "..//"}
    with Digest.open(tmp_path / "m.qd", check="full") as d:
        assert [f.path for f in d.iter_files()] == ["train/a.jpg"]
        assert d.empty_dirs() == ["clash", "deep/er", "valid"]
        assert d.lookup_path("valid").is_dir


def _linked_tree(tmp_path: Path, make_tree) -> Path:
    outside = make_tree(tmp_path / "outside", {"secret.txt": b"not part of the dataset"})
    source = make_tree(tmp_path / "source", {"real.txt": b"real", "sub/x.bin": b"x"})
    os.symlink("real.txt", source / "relative_inside")
    os.symlink(source / "sub" / "x.bin", source / "absolute_inside")
    os.symlink(outside / "secret.txt", source / "absolute_out")
    os.symlink("../../outside/secret.txt", source / "sub" / "dotdot_out")
    os.symlink("/etc/hostname", source / "etc_link")
    os.symlink(outside, source / "dir_link")  # links to directories are not descended into
    return source


async def test_links_out_of_the_root_are_skipped(tmp_path, make_tree):
    source = _linked_tree(tmp_path, make_tree)
    result = await build(url(source), tmp_path / "d.qd")
    assert result.external_links == 3 and result.skipped_count == 3
    assert {k for k, _ in result.skipped} == {"absolute_out", "sub/dotdot_out", "etc_link"}
    assert all("outside the source root" in reason for _, reason in result.skipped)
    with Digest.open(tmp_path / "d.qd") as d:
        # Links inside the root are followed, as before.
        assert sorted(f.path for f in d.iter_files()) == [
            "absolute_inside", "real.txt", "relative_inside", "sub/x.bin"]
        assert d.lookup_path("relative_inside").hash == blake3.blake3(b"real").digest()
        assert d.empty_dirs() == []  # dir_link is neither a directory nor a file here


def test_links_out_of_the_root_on_request(tmp_path, make_tree, digest_cli):
    source = _linked_tree(tmp_path, make_tree)
    code, _, err = digest_cli("build", url(source), "-o", tmp_path / "w.qd", "--quiet")
    assert code == 0, err
    assert "skipped 3 symbolic links to targets outside the source" in err
    code, out, err = digest_cli("build", url(source), "-o", tmp_path / "f.qd", "--quiet",
                                "--follow-external-links", "--json")
    assert code == 0, err
    assert json.loads(out)["external_links_skipped"] == 0 and json.loads(out)["files"] == 7
    with Digest.open(tmp_path / "f.qd") as d:
        secret = blake3.blake3(b"not part of the dataset").digest()
        assert d.lookup_path("absolute_out").hash == secret
        assert d.lookup_path("sub/dotdot_out").hash == secret
        assert d.lookup_path("etc_link").size == os.path.getsize("/etc/hostname")


def test_version_1_digest_still_opens(tmp_path, tamper):
    """A digest as version 1 wrote it (same tables, version '1', no empty directory)."""
    files = [NewFile("a/x", 1, blake3.blake3(b"x").digest()), NewFile("b", 1, blake3.blake3(b"b").digest())]
    dataset_id = write_digest(tmp_path / "v1.qd", files, ["file:///data"])
    tamper(tmp_path / "v1.qd", "UPDATE meta SET value = '1' WHERE key = 'format_version'")
    with Digest.open(tmp_path / "v1.qd", check="full") as d:
        assert d.format_version == 1 and d.dataset_id == dataset_id
        assert d.dataset_id == _v1_id({"a/x": b"x", "b": b"b"})
        assert d.empty_dirs() == []


async def test_diff_lists_empty_directories(tmp_path, make_tree, digest_cli):
    a = make_tree(tmp_path / "a", {"f": b"f"})
    b = make_tree(tmp_path / "b", {"f": b"f"})
    (b / "valid").mkdir()
    await build(url(a), tmp_path / "a.qd")
    await build(url(b), tmp_path / "b.qd")
    code, out, _ = digest_cli("diff", tmp_path / "a.qd", tmp_path / "b.qd")
    assert code == 1 and out.split() == ["+", "valid/"]
