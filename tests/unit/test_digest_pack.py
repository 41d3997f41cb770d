"""digests pack: shuffled tar chunks from file:// to file://, verified, resumable, one-line errors.

Real file:// backends and real tar files read back with Python's tarfile; the one fault (a
write failing after k chunks) is injected by wrapping the destination's blocking write.
"""

from __future__ import annotations

import errno
import io
import json
import os
import tarfile
import threading
import time
from pathlib import Path

import blake3
import pytest
import trio

from digests.build import build
from digests.digest import Digest
from digests.pack import (
    MANIFEST_KEY,
    Member,
    pack,
    plan_chunks,
    tar_bytes,
)
from digests.progress import Progress
from quiverfs.base.backends import Backend, BackendOptions, RemoteSettings, open_backend
from quiverfs.base.errors import CorruptObject, PermanentFailure, UsageError

FILES = {f"train/c{i % 4}/img_{i:03d}.jpg": os.urandom(50 + i * 41) for i in range(45)}
FILES["train/naïve ☃/déjà vu.txt"] = b"unicode"
FILES["deep/" + "/".join(["long-directory-name"] * 8) + "/file.bin"] = os.urandom(900)  # > 100 B
FILES["big/blob.bin"] = os.urandom(2 * 1024 * 1024 + 5)  # hashed in a thread, read in ranges
FILES["empty"] = b""
EMPTY_DIRS = ["valid", "train/c9/none"]


def url(path: Path) -> str:
    return "file://" + str(path)


def b3(data: bytes) -> bytes:
    return blake3.blake3(data).digest()


def opened(path: Path) -> Backend:
    return open_backend(url(path), BackendOptions(concurrency=4), RemoteSettings())


@pytest.fixture
def source(tmp_path: Path, make_tree) -> Path:
    root = make_tree(tmp_path / "data", FILES)
    for d in EMPTY_DIRS:
        (root / d).mkdir(parents=True)
    return root


@pytest.fixture
def loose(source: Path, tmp_path: Path) -> Path:
    """``digests build`` of the source: the loose digest (sync, so CLI tests can use it)."""
    out = tmp_path / "loose.qd"
    trio.run(lambda: build(url(source), out, settings=RemoteSettings()))
    return out


def chunk_names(dest: Path) -> list[str]:
    return sorted(name for name in os.listdir(dest) if name.endswith(".tar"))


def members_of(tar_path: Path) -> list[tuple[str, bytes]]:
    with tarfile.open(tar_path) as tar:
        return [(m.name, tar.extractfile(m).read()) for m in tar.getmembers()]


def rows(digest: Path) -> list[tuple]:
    with Digest.open(digest, check="full") as d:
        return [
            (f.path, f.size, f.hash, f.location.key, f.location.offset, f.location.length)
            for f in d.iter_files()
        ]


# -- the happy path ------------------------------------------------------------------------------


async def test_pack_file_to_file(source: Path, loose: Path, tmp_path: Path) -> None:
    dest, out = tmp_path / "packed", tmp_path / "packed.qd"
    progress: dict[str, Progress] = {}

    def reporter(label: str) -> Progress:
        progress[label] = Progress()
        return progress[label]

    result = await pack(url(source), url(dest), out, chunk_size=8, seed=11, progress=reporter)
    n_chunks = -(-len(FILES) // 8)
    assert (result.files, result.chunks, result.seed) == (len(FILES), n_chunks, 11)
    assert result.written_chunks == n_chunks and result.reused_chunks == 0
    assert result.hashed_source  # no digest given: the source was hashed first
    assert set(progress) == {"hash", "pack"}
    assert (progress["pack"].done_files, progress["pack"].done_bytes) == (
        len(FILES), sum(map(len, FILES.values())))

    # The chunks: plain tars of the original paths, every file exactly once.
    names = chunk_names(dest)
    assert names == [f"chunk-{i:06d}.tar" for i in range(n_chunks)]
    assert sorted(os.listdir(dest)) == [*names, MANIFEST_KEY]
    packed: dict[str, bytes] = {}
    for name in names:
        members = members_of(dest / name)
        assert 1 <= len(members) <= 8
        packed.update(members)
    assert packed == FILES
    assert sum(len(members_of(dest / n)) for n in names) == len(FILES)
    manifest = json.loads((dest / MANIFEST_KEY).read_text())
    assert (manifest["seed"], manifest["chunk_size"], manifest["chunks"]) == (11, 8, n_chunks)

    # The digest: valid, same dataset (id, paths, sizes, hashes, empty dirs) as the loose one,
    # locations inside the chunks, every file's bytes there hash right.
    with Digest.open(out, check="full") as d, Digest.open(loose, check="full") as lo:
        assert d.dataset_id == lo.dataset_id == result.dataset_id
        assert list(d.iter_canonical()) == list(lo.iter_canonical())
        assert d.empty_dirs() == lo.empty_dirs() == sorted(EMPTY_DIRS)
        assert list(d.sources.values()) == [url(dest)]
        for f in d.iter_files():
            assert f.location.key in names
            with open(dest / f.location.key, "rb") as chunk:
                chunk.seek(f.location.offset)
                data = chunk.read(f.location.length)
            assert b3(data) == f.hash == b3(FILES[f.path])
    # Done: no state, no hashed source digest left behind.
    assert sorted(os.listdir(tmp_path)) == ["data", "loose.qd", "packed", "packed.qd"]


async def test_order_is_shuffled_and_the_seed_fixes_it(source: Path, loose: Path, tmp_path: Path) -> None:
    a = await pack(url(source), url(tmp_path / "a"), tmp_path / "a.qd", chunk_size=8, seed=5,
                   digest=loose)
    b = await pack(url(source), url(tmp_path / "b"), tmp_path / "b.qd", chunk_size=8, seed=5,
                   digest=loose)
    c = await pack(url(source), url(tmp_path / "c"), tmp_path / "c.qd", chunk_size=8, seed=6,
                   digest=loose)
    first = [name for name, _ in members_of(tmp_path / "a" / "chunk-000000.tar")]
    canonical = [p for p, _, _ in Digest.open(loose).iter_canonical()]
    assert first != canonical[:8] and first != sorted(FILES)[:8]  # not the sorted order
    # Same seed: the same plan, byte-identical chunks; another seed: another plan.
    assert a.plan_id == b.plan_id != c.plan_id
    for name in chunk_names(tmp_path / "a"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    assert first != [name for name, _ in members_of(tmp_path / "c" / "chunk-000000.tar")]
    assert [r[:5] for r in rows(tmp_path / "a.qd")] == [r[:5] for r in rows(tmp_path / "b.qd")]


def test_plan_is_a_uniform_shuffle_cut_into_chunks() -> None:
    files = [Member(f"f{i:04d}", i, b3(b"%d" % i), f"f{i:04d}", 0) for i in range(1000)]
    chunks = plan_chunks(files, seed=1, chunk_size=64)
    assert [len(c.members) for c in chunks] == [64] * 15 + [40]
    assert sorted(m.path for c in chunks for m in c.members) == [f.path for f in files]
    assert plan_chunks(files, seed=1, chunk_size=64) == chunks
    # Each chunk is a random sample: its members come from all over the sorted order.
    spans = [max(int(m.path[1:]) for m in c.members) - min(int(m.path[1:]) for m in c.members)
             for c in chunks[:15]]
    assert min(spans) > 500
    with pytest.raises(UsageError, match="--chunk-size must be at least 1"):
        plan_chunks(files, seed=1, chunk_size=0)


def test_tar_layout_matches_the_plan() -> None:
    data = {"a": b"x" * 511, "b/ünïcode": b"y" * 513, "c/" + "d" * 150: b"", "e": b"z"}
    members = [Member(p, len(v), b3(v), p, 0) for p, v in data.items()]
    (chunk,) = plan_chunks(members, seed=0, chunk_size=10)
    blob = tar_bytes(chunk, [data[m.path] for m in chunk.members])
    assert len(blob) == chunk.size and len(blob) % 512 == 0
    for m in chunk.members:
        assert blob[m.data_offset : m.data_offset + m.size] == data[m.path]
    with tarfile.open(fileobj=io.BytesIO(blob)) as tar:
        assert {m.name: tar.extractfile(m).read() for m in tar.getmembers()} == data


# -- input from an existing digest ---------------------------------------------------------------


async def test_pack_from_a_digest_reads_each_file_once(source: Path, loose: Path, tmp_path: Path) -> None:
    src = opened(source)
    async with src:
        result = await pack(src, url(tmp_path / "p"), tmp_path / "p.qd", chunk_size=16, seed=1,
                            digest=loose)
    assert not result.hashed_source
    # One GET a file (the empty one needs none): no hashing pass before packing.
    assert src.counters.requests["GET"] == len(FILES) - 1
    assert src.counters.requests["LIST"] == 0  # nothing listed: the digest says what is there


async def test_a_digest_of_another_location_is_read_under_source(
    source: Path, tmp_path: Path
) -> None:
    # Hashed here but recorded as a bucket (build --location): pack reads under SOURCE_URL.
    elsewhere = tmp_path / "elsewhere.qd"
    await build(url(source), elsewhere, location="s3://bucket/data", settings=RemoteSettings())
    result = await pack(url(source), url(tmp_path / "p"), tmp_path / "p.qd", digest=elsewhere)
    assert result.files == len(FILES)
    with Digest.open(tmp_path / "p.qd") as d, Digest.open(elsewhere) as e:
        assert d.dataset_id == e.dataset_id


async def test_wrong_bytes_are_never_packed(source: Path, loose: Path, tmp_path: Path) -> None:
    victim = "train/c1/img_005.jpg"
    data = bytearray(FILES[victim])
    data[7] ^= 0xFF  # same size, other content: only the hash can tell
    (source / victim).write_bytes(bytes(data))
    dest = tmp_path / "p"
    with pytest.raises(CorruptObject, match="does not match the digest's hash"):
        await pack(url(source), url(dest), tmp_path / "p.qd", chunk_size=4, seed=2,
                   digest=loose, workers=1)
    assert not (tmp_path / "p.qd").exists()
    for name in chunk_names(dest):
        assert victim not in dict(members_of(dest / name))


# -- resume ----------------------------------------------------------------------------------------


def fail_after(backend: Backend, puts: int, *, land: bool = False) -> None:
    """Make ``backend``'s writes fail after ``puts`` succeeded (``land``: the failing one
    still writes its object first, as a crash after the put and before the record would)."""
    real = backend._write_object
    count = 0

    def write(key: str, data: bytes) -> None:
        nonlocal count
        count += 1
        if count > puts:
            if land:
                real(key, data)
            raise OSError(errno.ENOSPC, "No space left on device (injected)")
        real(key, data)

    backend._write_object = write  # type: ignore[method-assign]


@pytest.mark.parametrize("land", [False, True], ids=["fails", "lands-unrecorded"])
async def test_resume_writes_only_the_missing_chunks(
    source: Path, loose: Path, tmp_path: Path, land: bool
) -> None:
    dest, out = tmp_path / "p", tmp_path / "p.qd"
    dest.mkdir()
    k = 3  # chunks written before the fault (the manifest is the first PUT)
    first = opened(dest)
    fail_after(first, 1 + k, land=land)
    async with first:
        with pytest.raises(PermanentFailure, match="no space left"):
            await pack(url(source), first, out, chunk_size=6, digest=loose, workers=1)
    assert not out.exists() and (tmp_path / "p.qd.pack-partial").exists()
    written = k + (1 if land else 0)
    assert len(chunk_names(dest)) == written

    second = opened(dest)
    async with second:  # the same command again: no seed given, the recorded one is used
        result = await pack(url(source), second, out, chunk_size=6, digest=loose, workers=3)
    n_chunks = -(-len(FILES) // 6)
    assert result.resumed and result.reused_chunks == written
    assert second.counters.requests["PUT"] == result.written_chunks == n_chunks - written
    assert not (tmp_path / "p.qd.pack-partial").exists()

    # The same digest as an uninterrupted pack with that seed.
    again = await pack(url(source), url(tmp_path / "q"), tmp_path / "q.qd", chunk_size=6,
                       seed=result.seed, digest=loose)
    assert rows(out) == rows(tmp_path / "q.qd")
    assert again.plan_id == result.plan_id
    for name in chunk_names(dest):
        assert (dest / name).read_bytes() == (tmp_path / "q" / name).read_bytes()


async def test_rerun_after_completion_rewrites_nothing(source: Path, loose: Path, tmp_path: Path) -> None:
    dest = tmp_path / "p"
    await pack(url(source), url(dest), tmp_path / "p.qd", chunk_size=8, seed=3, digest=loose)
    before = rows(tmp_path / "p.qd")
    dst = opened(dest)
    async with dst:
        result = await pack(url(source), dst, tmp_path / "p.qd", chunk_size=8, seed=3,
                            digest=loose)
    assert dst.counters.requests["PUT"] == 0 and result.written_chunks == 0
    assert rows(tmp_path / "p.qd") == before


# -- one-line errors (the CLI) -------------------------------------------------------------------


def test_cli_pack_json(source: Path, tmp_path: Path, digest_cli) -> None:
    code, out, err = digest_cli("pack", source, tmp_path / "p", "--chunk-size", "10",
                                "--seed", "9", "-o", tmp_path / "p.qd", "--json", "-q")
    assert code == 0, err
    report = json.loads(out)
    assert (report["seed"], report["chunk_size"], report["files"]) == (9, 10, len(FILES))
    assert report["chunks"] == report["written_chunks"] == -(-len(FILES) // 10)
    assert report["hashed_source"] is True and report["empty_dirs"] == len(EMPTY_DIRS)
    code, out, err = digest_cli("pack", source, tmp_path / "p2", "-o", tmp_path / "p2.qd", "-q")
    assert code == 0, err
    assert "seed " in out.splitlines()[1]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--chunk-size", "0"], "--chunk-size must be at least 1: 0"),
        (["--workers", "0"], "--workers must be at least 1: 0"),
        (["--seed", "-1"], "--seed must be a non-negative integer: -1"),
    ],
)
def test_cli_bad_numbers(source: Path, tmp_path: Path, digest_cli, args, message) -> None:
    code, out, err = digest_cli("pack", source, tmp_path / "p", *args)
    assert code == 2
    assert err.strip() == f"digests: error: {message}"
    assert not (tmp_path / "p").exists()


def test_cli_dest_equal_to_or_inside_source(source: Path, tmp_path: Path, digest_cli) -> None:
    for dest, what in ((source, "the source"), (source / "train" / "packed", "inside the source")):
        code, _, err = digest_cli("pack", source, dest)
        assert code == 2
        assert f"is {what} {url(source)}: pack into a location outside it" in err
        assert len(err.strip().splitlines()) == 1
    # Through a symbolic link too.
    (tmp_path / "link").symlink_to(source)
    code, _, err = digest_cli("pack", tmp_path / "link", source / "x")
    assert code == 2 and "inside the source" in err


def test_cli_unknown_scheme(source: Path, digest_cli) -> None:
    code, _, err = digest_cli("pack", source, "ftp://host/x")
    assert code == 2
    assert err.strip().startswith("digests: error: unknown URL scheme 'ftp'")


def test_cli_dest_not_empty_or_another_pack(
    source: Path, loose: Path, tmp_path: Path, digest_cli
) -> None:
    other = tmp_path / "other"
    other.mkdir()
    (other / "x.txt").write_text("not a pack")
    code, _, err = digest_cli("pack", source, other, "--digest", loose)
    assert code == 2
    assert "is not empty (e.g. 'x.txt') and holds no pack manifest" in err
    assert len(err.strip().splitlines()) == 1

    packed = tmp_path / "packed"
    code, _, err = digest_cli("pack", source, packed, "--seed", "4", "--digest", loose, "-q",
                              "-o", tmp_path / "packed.qd")
    assert code == 0, err
    for args in (["--seed", "5"], [], ["--seed", "4", "--chunk-size", "32"]):
        code, _, err = digest_cli("pack", source, packed, "--digest", loose, *args)
        assert code == 2
        assert "already holds another pack (seed 4, chunk size 64" in err
        assert "rerun with that --seed and --chunk-size to resume it" in err
    # Nothing was hashed for those refusals.
    assert not list(tmp_path.glob("*.pack-source*"))


def test_cli_state_of_another_pack(source: Path, loose: Path, tmp_path: Path, digest_cli) -> None:
    dest = tmp_path / "p"
    dest.mkdir()

    async def interrupted() -> None:
        first = opened(dest)
        fail_after(first, 2)
        async with first:
            with pytest.raises(PermanentFailure):
                await pack(url(source), first, tmp_path / "p.qd", chunk_size=6, seed=1,
                           digest=loose, workers=1)

    trio.run(interrupted)
    code, _, err = digest_cli("pack", source, dest, "--chunk-size", "7", "--digest", loose,
                              "-o", tmp_path / "p.qd")
    assert code == 2
    assert "p.qd.pack-partial holds a pack with --chunk-size 6 --seed 1" in err
    assert "delete" in err and "to start over" in err
    code, out, err = digest_cli("pack", source, dest, "--chunk-size", "6", "--digest", loose,
                                "-o", tmp_path / "p.qd", "--json", "-q")
    assert code == 0, err
    assert json.loads(out)["reused_chunks"] == 1


async def test_empty_dataset(tmp_path: Path) -> None:
    (tmp_path / "src" / "only-dir").mkdir(parents=True)
    result = await pack(url(tmp_path / "src"), url(tmp_path / "p"), tmp_path / "p.qd")
    assert (result.files, result.chunks) == (0, 0)
    with Digest.open(tmp_path / "p.qd", check="full") as d:
        assert d.file_count == 0 and d.empty_dirs() == ["only-dir"]
    assert os.listdir(tmp_path / "p") == [MANIFEST_KEY]


async def test_workers_bound_reads_and_writes(source: Path, loose: Path, tmp_path: Path) -> None:
    """--workers caps the source reads in flight (all chunks together) and the chunk writes,
    whatever the backends' own limiters would allow (16 here)."""
    src = open_backend(url(source), BackendOptions(concurrency=16), RemoteSettings())
    dest = tmp_path / "p"
    dest.mkdir()
    dst = open_backend(url(dest), BackendOptions(concurrency=16), RemoteSettings())
    lock = threading.Lock()
    in_flight = {"read": 0, "write": 0}
    most = {"read": 0, "write": 0}

    def counted(kind: str, real):
        def call(*args):
            with lock:
                in_flight[kind] += 1
                most[kind] = max(most[kind], in_flight[kind])
            try:
                time.sleep(0.002)  # long enough for others to pile up if nothing held them
                return real(*args)
            finally:
                with lock:
                    in_flight[kind] -= 1
        return call

    src._read_range = counted("read", src._read_range)  # type: ignore[method-assign]
    dst._write_object = counted("write", dst._write_object)  # type: ignore[method-assign]
    async with src, dst:
        result = await pack(src, dst, tmp_path / "p.qd", chunk_size=4, digest=loose, workers=3)
    assert result.written_chunks == -(-len(FILES) // 4)
    assert 1 <= most["read"] <= 3
    assert 1 <= most["write"] <= 3
