"""digests build --tar members: tar shards on file://, checked against Python's tarfile.

Every shard is written by :mod:`tarfile` in a temporary directory; the digest's offsets,
lengths and hashes must be exactly those of tarfile's own reading of the same bytes.
"""

from __future__ import annotations

import io
import json
import os
import sqlite3
import subprocess
import sys
import tarfile
from pathlib import Path

import blake3
import pytest

from digests import build as build_module
from digests.build import build
from digests.digest import Digest
from digests.progress import Progress
from digests.tar import normalize_member_name
from quiverfs.base.backends import BackendOptions, RemoteSettings, open_backend
from quiverfs.base.errors import AccessDenied, CorruptObject, UsageError

REPO = Path(__file__).resolve().parents[2]


def b3(data: bytes) -> bytes:
    return blake3.blake3(data).digest()


def url(path: Path) -> str:
    return "file://" + str(path)


def backend(path: Path, **kw):
    return open_backend(url(path), BackendOptions(**kw), RemoteSettings())


def add_file(t: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mode = 0o644
    t.addfile(info, io.BytesIO(data))


def add_entry(t: tarfile.TarFile, name: str, kind: bytes, linkname: str = "") -> None:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = linkname
    t.addfile(info)


def write_tar(path: Path, members: list[tuple[str, bytes]], fmt=tarfile.PAX_FORMAT) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w", format=fmt) as t:
        for name, data in members:
            add_file(t, name, data)
    return path


def tarfile_view(path: Path) -> dict[str, tuple[int, int, bytes]]:
    """What tarfile reads: name -> (data offset, size, blake3), the later member winning."""
    out = {}
    with tarfile.open(path) as t:
        for m in t.getmembers():
            if m.isfile():
                out[m.name.removeprefix("./")] = (
                    m.offset_data, m.size, b3(t.extractfile(m).read())
                )
    return out


def digest_view(out: Path) -> dict[str, tuple[str | None, int, int, bytes]]:
    with Digest.open(out, check="full") as d:
        return {
            f.path: (f.location.key, f.location.offset, f.size, f.hash) for f in d.iter_files()
        }


LONG_DIR = "d" * 120
MIXED = [
    ("train/cat/001.jpg", os.urandom(1500)),
    ("train/dog/002.jpg", os.urandom(512)),  # exactly one block: no padding
    ("empty.txt", b""),
    (f"{LONG_DIR}/{'n' * 200}.bin", os.urandom(700)),  # a 325-byte name
    ("train/cat/003.jpg", os.urandom(20_000)),
    ("last.bin", os.urandom(3)),
]


@pytest.mark.parametrize(
    "fmt", [tarfile.PAX_FORMAT, tarfile.GNU_FORMAT], ids=["pax", "gnu"]
)
@pytest.mark.parametrize("chunk", [build_module.DEFAULT_CHUNK, 1000], ids=["8MiB", "1000B"])
async def test_offsets_sizes_hashes_match_tarfile(tmp_path, monkeypatch, fmt, chunk):
    # 1000-byte reads split headers and members across GETs (not a multiple of 512).
    monkeypatch.setattr(build_module, "DEFAULT_CHUNK", chunk)
    src = tmp_path / "src"
    shard = write_tar(src / "shard-000.tar", MIXED, fmt)
    b = backend(src)
    result = await build(b, tmp_path / "d.qd", tar="members")
    expected = tarfile_view(shard)
    assert len(expected) == len(MIXED)
    got = digest_view(tmp_path / "d.qd")
    assert got == {
        name: ("shard-000.tar", off, size, h) for name, (off, size, h) in expected.items()
    }
    assert (result.shards, result.members, result.files) == (1, len(MIXED), len(MIXED))
    assert result.scanned_shards == 1 and result.hashed_files == 0
    assert result.total_bytes == sum(len(d) for _, d in MIXED)
    # The shard was downloaded once: no byte read twice (plus at most the 1-byte probe).
    assert b.counters.bytes_read <= shard.stat().st_size
    # and every member's content is what the location names
    raw = shard.read_bytes()
    for name, data in MIXED:
        _, off, size, _ = got[name]
        assert raw[off : off + size] == data


async def test_big_member_streamed_in_chunks(tmp_path, monkeypatch):
    monkeypatch.setattr(build_module, "DEFAULT_CHUNK", 1 << 20)
    big = os.urandom(3 * (1 << 20) + 5)  # hashed in a thread, slice by slice
    shard = write_tar(tmp_path / "src" / "big.tar", [("small", b"s"), ("big.bin", big)])
    b = backend(tmp_path / "src")
    await build(b, tmp_path / "d.qd", tar="members")
    assert digest_view(tmp_path / "d.qd")["big.bin"][2:] == (len(big), b3(big))
    size = shard.stat().st_size
    # ceil(size / 1 MiB) GETs up to the end marker's chunk (the last one may hold the probe),
    # at most one 1-byte probe past the end, and a HEAD for the version.
    assert b.counters.requests["GET"] <= -(-size // (1 << 20)) + 1
    assert b.counters.bytes_read <= size + 1
    assert b.counters.requests["HEAD"] == 1


async def test_ustar_prefix_names(tmp_path):
    # ustar splits a long path into prefix + name; no pax or GNU header is involved.
    name = f"{'p' * 90}/{'q' * 90}/file.bin"
    shard = write_tar(tmp_path / "src" / "u.tar", [(name, b"ustar data")], tarfile.USTAR_FORMAT)
    assert b"ustar\x0000" in shard.read_bytes()[:512]
    await build(url(tmp_path / "src"), tmp_path / "d.qd", tar="members")
    assert digest_view(tmp_path / "d.qd")[name][2:] == (10, b3(b"ustar data"))


async def test_directories_links_and_devices(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    with tarfile.open(src / "s.tar", "w", format=tarfile.GNU_FORMAT) as t:
        add_entry(t, "./", tarfile.DIRTYPE)  # tar -C dir -c . writes these
        add_entry(t, "./train/", tarfile.DIRTYPE)
        add_entry(t, "./empty-class/", tarfile.DIRTYPE)
        add_file(t, "./train/a.jpg", b"AAAA")
        add_entry(t, "train/link.jpg", tarfile.SYMTYPE, "a.jpg")
        add_entry(t, "train/hard.jpg", tarfile.LNKTYPE, "train/a.jpg")
        add_entry(t, "dev/null", tarfile.CHRTYPE)
        add_entry(t, "fifo", tarfile.FIFOTYPE)
        add_file(t, "/etc/passwd", b"root")
        add_file(t, "../escape", b"x")
        add_file(t, "after.bin", b"still read")
    progress = Progress()
    result = await build(url(src), tmp_path / "d.qd", tar="members", progress=progress)
    assert set(digest_view(tmp_path / "d.qd")) == {"train/a.jpg", "after.bin"}
    with Digest.open(tmp_path / "d.qd") as d:
        assert d.empty_dirs() == ["empty-class"]
        assert d.lookup_path("train").is_dir
    assert result.skipped_count == 6
    reasons = dict(result.skipped)
    assert reasons["s.tar:train/link.jpg"] == "tar member: symbolic link (not supported)"
    assert reasons["s.tar:train/hard.jpg"].startswith("tar member: hard link")
    assert reasons["s.tar:dev/null"] == "tar member: character device"
    assert any("absolute path" in note for note in progress.notes)


def test_member_name_normalisation():
    assert normalize_member_name("./a/b") == "a/b"
    assert normalize_member_name("././a/") == "a"
    assert normalize_member_name("./") == ""
    assert normalize_member_name(".") == ""
    assert normalize_member_name("a/./b") == "a/./b"  # then refused by path_problem


async def test_shard_cut_right_after_the_last_members_data(tmp_path):
    src = tmp_path / "src"
    shard = write_tar(src / "cut.tar", [("a.bin", os.urandom(700)), ("b.bin", os.urandom(333))])
    last = tarfile_view(shard)["b.bin"]
    with open(shard, "r+b") as f:
        f.truncate(last[0] + last[1])  # no padding, no end blocks
    assert shard.stat().st_size % 512 != 0
    result = await build(url(src), tmp_path / "d.qd", tar="members")
    got = digest_view(tmp_path / "d.qd")
    assert got["b.bin"] == ("cut.tar", last[0], 333, last[2])
    assert result.members == 2 and result.skipped_count == 0


async def test_shard_cut_inside_a_member_is_corrupt(tmp_path):
    src = tmp_path / "src"
    shard = write_tar(src / "cut.tar", [("a.bin", os.urandom(700)), ("b.bin", os.urandom(333))])
    off = tarfile_view(shard)["b.bin"][0]
    with open(shard, "r+b") as f:
        f.truncate(off + 100)
    with pytest.raises(CorruptObject, match="ends inside member 'b.bin'"):
        await build(url(src), tmp_path / "d.qd", tar="members")
    assert not (tmp_path / "d.qd").exists()


async def test_not_a_tar_is_corrupt(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "junk.tar").write_bytes(os.urandom(4096))
    with pytest.raises(CorruptObject, match="not a tar archive"):
        await build(url(src), tmp_path / "d.qd", tar="members")


async def test_duplicate_names_later_wins(tmp_path):
    src = tmp_path / "src"
    first, second, third = os.urandom(100), os.urandom(200), os.urandom(300)
    write_tar(src / "a.tar", [("x.bin", first), ("dup.bin", b"old"), ("dup.bin", b"newer")])
    write_tar(src / "b.tar", [("x.bin", second), ("readme.txt", third)])
    (src / "readme.txt").write_bytes(b"the plain object")
    (src / "notes.txt").write_bytes(b"a plain object")
    progress = Progress()
    result = await build(url(src), tmp_path / "d.qd", tar="members", progress=progress)
    got = digest_view(tmp_path / "d.qd")
    assert set(got) == {"x.bin", "dup.bin", "readme.txt", "notes.txt"}
    assert got["x.bin"][0] == "b.tar" and got["x.bin"][3] == b3(second)  # later shard
    assert got["dup.bin"][2:] == (5, b3(b"newer"))  # later member of the same tar
    assert got["readme.txt"][0] == "b.tar" and got["readme.txt"][3] == b3(third)
    assert got["notes.txt"] == ("notes.txt", 0, 14, b3(b"a plain object"))
    assert result.shadowed == 3  # dup.bin in a.tar, x.bin of a.tar, the readme.txt object
    assert sorted(result.shadowed_examples) == ["readme.txt", "x.bin"]
    assert any("appears more than once" in n for n in progress.notes)
    assert (result.files, result.members, result.shards) == (4, 3, 2)


async def test_member_and_directory_clash_directory_wins(tmp_path):
    src = tmp_path / "src"
    write_tar(src / "a.tar", [("c", b"file c"), ("c/inner", b"under c"), ("ok", b"fine")])
    result = await build(url(src), tmp_path / "d.qd", tar="members")
    assert set(digest_view(tmp_path / "d.qd")) == {"c/inner", "ok"}
    assert ("c", "is also a directory of other keys") in result.skipped


async def test_shards_in_folders_extract_in_place(tmp_path):
    src = tmp_path / "src"
    write_tar(src / "train" / "shard-0.tar", [("cat/1.jpg", b"t1"), ("dog/2.jpg", b"t2")])
    write_tar(src / "val" / "shard-0.tar", [("cat/1.jpg", b"v1")])
    await build(url(src), tmp_path / "d.qd", tar="members")
    got = digest_view(tmp_path / "d.qd")
    assert {p: k for p, (k, *_) in got.items()} == {
        "train/cat/1.jpg": "train/shard-0.tar",
        "train/dog/2.jpg": "train/shard-0.tar",
        "val/cat/1.jpg": "val/shard-0.tar",
    }


async def test_shards_mode_keeps_each_shard_one_file(tmp_path):
    src = tmp_path / "src"
    shard = write_tar(src / "a.tar", [("x", b"x")])
    (src / "b.tgz").write_bytes(b"\x1f\x8b whatever")  # any object in shards mode
    result = await build(url(src), tmp_path / "d.qd")
    got = digest_view(tmp_path / "d.qd")
    assert got["a.tar"] == ("a.tar", 0, shard.stat().st_size, b3(shard.read_bytes()))
    assert set(got) == {"a.tar", "b.tgz"}
    assert (result.tar, result.shards, result.members) == ("shards", 0, 0)


async def test_compressed_shards_refused(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    with tarfile.open(src / "z.tar", "w:gz") as t:  # gzip behind a .tar name
        add_file(t, "x", b"x")
    with pytest.raises(UsageError, match=r"'z.tar' is a compressed tar \(gzip\).*repack"):
        await build(url(src), tmp_path / "d.qd", tar="members")
    (src / "z.tar").unlink()
    (src / "y.tar.zst").write_bytes(b"(\xb5/\xfd....")
    with pytest.raises(UsageError, match=r"compressed tar \(.tar.zst\)"):
        await build(url(src), tmp_path / "d2.qd", tar="members")


def _cli(*args: object) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-c", "from digests.cli import main; main()", *map(str, args)],
        capture_output=True, text=True, timeout=120, env=env, cwd=REPO,
    )


@pytest.mark.parametrize("name", ["data.tar.gz", "data.tgz", "data.tar"])
def test_cli_refuses_gzip_in_one_line(tmp_path, name):
    src = tmp_path / "src"
    src.mkdir()
    with tarfile.open(src / name, "w:gz") as t:
        add_file(t, "x", b"x" * 1000)
    proc = _cli("build", src, "-o", tmp_path / "d.qd", "--tar", "members", "-q")
    assert proc.returncode == UsageError.exit_code == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith(f"digests: error: '{name}' is a compressed tar (")
    assert "repack it uncompressed" in line and proc.stdout == ""


def test_cli_json_counts_shards_and_members(tmp_path):
    src = tmp_path / "src"
    write_tar(src / "s0.tar", [("a/1", b"1"), ("a/2", b"22")])
    write_tar(src / "s1.tar", [("b/1", b"333")])
    (src / "plain").write_bytes(b"p")
    proc = _cli("build", url(src), "-o", tmp_path / "d.qd", "--tar", "members", "--json", "-q")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert (out["tar"], out["shards"], out["members"], out["files"]) == ("members", 2, 3, 4)
    assert (out["scanned_shards"], out["reused_shards"], out["shadowed"]) == (2, 0, 0)
    text = _cli("build", url(src), "-o", tmp_path / "e.qd", "--tar", "members", "-q")
    assert "3 files from 2 tar shards (2 read" in text.stdout


class FailOn:
    """Makes a backend's reads of one key fail permanently."""

    def __init__(self, backend, key):
        self.key, self.inner = key, backend._read_range
        backend._read_range = self

    def __call__(self, key, *args):
        if key == self.key:
            raise PermissionError(13, "injected failure")
        return self.inner(key, *args)


async def test_resume_reuses_read_shards(tmp_path):
    src = tmp_path / "src"
    shards = {
        f"s{i}.tar": write_tar(src / f"s{i}.tar", [(f"c{i}/{j}.jpg", os.urandom(300 + j))
                                                   for j in range(20)])
        for i in range(3)
    }
    (src / "plain.txt").write_bytes(b"plain")
    out = tmp_path / "d.qd"
    first = backend(src)
    FailOn(first, "s2.tar")
    with pytest.raises(AccessDenied):
        await build(first, out, tar="members", workers=1)
    partial = tmp_path / "d.qd.partial"
    assert not out.exists() and partial.exists()
    done = {k for (k,) in sqlite3.connect(partial).execute("SELECT key FROM shards")}
    assert done == {"s0.tar", "s1.tar"}

    second = backend(src)
    progress = Progress()
    result = await build(second, out, tar="members", progress=progress)
    assert (result.reused_shards, result.scanned_shards, result.reused_files) == (2, 1, 1)
    assert second.counters.bytes_read <= shards["s2.tar"].stat().st_size + 1
    assert (progress.done_files, progress.total_files) == (4, 4)  # 3 shards + 1 object
    assert result.members == 60 and result.files == 61
    fresh = await build(url(src), tmp_path / "fresh.qd", tar="members")
    assert fresh.dataset_id == result.dataset_id


async def test_resume_rereads_a_changed_shard(tmp_path):
    src = tmp_path / "src"
    write_tar(src / "s0.tar", [("a", b"a0")])
    write_tar(src / "s1.tar", [("b", b"b0")])
    out = tmp_path / "d.qd"
    first = backend(src)
    FailOn(first, "z-plain")  # listed last: both shards are read before it fails
    (src / "z-plain").write_bytes(b"p")
    with pytest.raises(AccessDenied):
        await build(first, out, tar="members", workers=1)
    write_tar(src / "s1.tar", [("b", b"b1")])
    result = await build(url(src), out, tar="members")
    assert (result.reused_shards, result.scanned_shards) == (1, 1)
    assert digest_view(out)["b"][3] == b3(b"b1")


async def test_partial_of_the_other_mode_refused(tmp_path):
    src = tmp_path / "src"
    write_tar(src / "s0.tar", [("a", b"a0")])
    (src / "z-plain").write_bytes(b"p")  # after the shard: the failed run leaves work behind
    first = backend(src)
    FailOn(first, "z-plain")
    with pytest.raises(AccessDenied):
        await build(first, tmp_path / "d.qd", tar="members", workers=1)
    with pytest.raises(UsageError, match="--tar members"):
        await build(url(src), tmp_path / "d.qd")
    with pytest.raises(UsageError, match="--tar must be one of"):
        await build(url(src), tmp_path / "d.qd", tar="files")


def _header(name: bytes, size_field: bytes, kind: bytes = b"0") -> bytes:
    block = bytearray(512)
    block[0 : len(name)] = name
    block[124:136] = size_field
    block[156:157] = kind
    block[148:156] = b" " * 8
    block[148:156] = b"%06o\0 " % sum(block)
    return bytes(block)


async def test_gnu_base256_size_and_bad_pax(tmp_path):
    # A size in GNU base-256 (what GNU tar writes past 8 GiB), here for 5 bytes.
    src = tmp_path / "src"
    src.mkdir()
    size = b"\x80" + (5).to_bytes(11, "big")
    (src / "b.tar").write_bytes(_header(b"five.bin", size) + b"12345" + bytes(507 + 1024))
    await build(url(src), tmp_path / "d.qd", tar="members")
    assert digest_view(tmp_path / "d.qd")["five.bin"] == ("b.tar", 512, 5, b3(b"12345"))
    # A pax header whose record is malformed is a corrupt shard, named with its offset.
    pax = b"99 path=x\n".ljust(512, b"\0")
    (src / "b.tar").write_bytes(_header(b"pax", b"%011o\0" % 10, b"x") + pax + bytes(1024))
    with pytest.raises(CorruptObject, match="malformed pax header at offset 0"):
        await build(url(src), tmp_path / "e.qd", tar="members")
