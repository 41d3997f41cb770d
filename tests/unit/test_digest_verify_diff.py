"""digests verify (re-read everything) and digests diff (canonical content), API and CLI."""

from __future__ import annotations

import json
import os

import blake3
import pytest
import trio

from digests.build import build
from digests.diff import diff
from digests.digest import Digest
from digests.progress import Progress
from digests.verify import verify
from digests.write import NewFile, write_digest
from quiverfs.base.backends import RemoteSettings

FILES = {f"d{i % 3}/f{i:02d}": os.urandom(50 + i) for i in range(20)}


@pytest.fixture
def built(tmp_path, make_tree):
    data = make_tree(tmp_path / "data", FILES)
    out = tmp_path / "d.qd"
    trio.run(lambda: build("file://" + str(data), out, settings=RemoteSettings()))
    return data, out


async def test_verify_clean(built):
    _, out = built
    progress = Progress()
    with Digest.open(out) as d:
        result = await verify(d, workers=4, progress=progress, settings=RemoteSettings())
    assert result.ok and result.checked == 20 and result.bytes == sum(map(len, FILES.values()))
    assert progress.done_files == 20


async def test_verify_reports_every_problem(built):
    data, out = built
    (data / "d0/f00").write_bytes(b"tampered" + FILES["d0/f00"][8:])  # same size, new bytes
    (data / "d1/f01").write_bytes(FILES["d1/f01"][:-1])  # one byte short
    os.unlink(data / "d2/f02")
    os.unlink(data / "d2/f05")
    with Digest.open(out) as d:
        result = await verify(d, workers=3, settings=RemoteSettings())
    assert not result.ok and result.checked == 20
    assert [p for p, _ in result.missing] == ["d2/f02", "d2/f05"]
    assert result.mismatched == [
        ("d0/f00", "content differs (blake3 mismatch)"),
        ("d1/f01", f"size {len(FILES['d1/f01']) - 1} bytes, digest says {len(FILES['d1/f01'])}"),
    ]


async def test_verify_packed_location(tmp_path):
    shard = b"HEADER" + b"first" + b"second"
    (tmp_path / "src").mkdir()
    (tmp_path / "src/shard.tar").write_bytes(shard)
    out = tmp_path / "p.qd"
    write_digest(
        out,
        [
            NewFile("a", 5, blake3.blake3(b"first").digest(), key="shard.tar", offset=6),
            NewFile("b", 6, blake3.blake3(b"second").digest(), key="shard.tar", offset=11),
        ],
        ["file://" + str(tmp_path / "src")],
    )
    with Digest.open(out) as d:
        result = await verify(d, settings=RemoteSettings())
    assert result.ok and result.bytes == 11


def test_verify_cli_exit_codes(built, digest_cli):
    data, out = built
    code, stdout, _ = digest_cli("verify", out, "--quiet")
    assert code == 0 and "checked 20 files" in stdout and "0 missing, 0 different" in stdout
    os.unlink(data / "d0/f03")
    code, stdout, _ = digest_cli("verify", out, "--quiet", "--json")
    report = json.loads(stdout)
    assert code == 1 and not report["ok"] and report["missing"][0]["path"] == "d0/f03"


def write(tmp_path, name, files, source="file:///a"):
    path = tmp_path / name
    write_digest(
        path, [NewFile(p, len(d), blake3.blake3(d).digest()) for p, d in files.items()], [source]
    )
    return path


def test_diff_api_and_cli(tmp_path, digest_cli):
    old = {"a": b"1", "b/c": b"2", "b/d": b"3", "z": b"4"}
    new = {"a": b"1", "b/c": b"changed", "b/e": b"5", "z": b"4"}
    a, b = write(tmp_path, "a.qd", old), write(tmp_path, "b.qd", new, source="s3://x/y")
    with Digest.open(a) as da, Digest.open(b) as db:
        result = diff(da, db)
    assert (result.added, result.removed, result.changed) == (["b/e"], ["b/d"], ["b/c"])
    assert not result.same_id
    code, out, _ = digest_cli("diff", a, b)
    assert code == 1 and out.splitlines() == ["+ b/e", "- b/d", "M b/c"]
    code, out, _ = digest_cli("diff", a, b, "--json")
    assert code == 1 and json.loads(out)["changed"] == ["b/c"]


def test_diff_identical_across_locations(tmp_path, digest_cli):
    files = {"x/1": b"one", "x/2": b"two"}
    a, b = write(tmp_path, "a.qd", files), write(tmp_path, "b.qd", files, source="gs://bucket/copy")
    code, out, _ = digest_cli("diff", a, b)
    assert code == 0 and out.startswith("identical: dataset id ")


def test_inspect_cli(built, digest_cli):
    _, out = built
    code, stdout, _ = digest_cli("inspect", out, "--json", "--check", "--top", "2")
    info = json.loads(stdout)
    assert code == 0
    assert info["files"] == 20 and info["directories"] == 4 and info["format_version"] == 2
    assert info["dataset_id_checked"] is True
    assert [f["path"] for f in info["largest_files"]] == ["d1/f19", "d0/f18"]
    assert info["largest_directories"][0] == {"path": "d0", "files": 7}
    code, stdout, _ = digest_cli("inspect", out)
    assert code == 0 and "files           20" in stdout


def test_build_cli_json_and_help(tmp_path, make_tree, digest_cli):
    data = make_tree(tmp_path / "data", {"a/b": b"x", "c": b"yy"})
    code, stdout, err = digest_cli("build", data, "-o", tmp_path / "o.qd", "--json", "--quiet")
    report = json.loads(stdout)
    assert code == 0 and report["files"] == 2 and report["total_bytes"] == 3 and err == ""
    for command in ("build", "inspect", "verify", "diff"):
        code, stdout, _ = digest_cli(command, "--help")
        assert code == 0 and "Example: digests " + command in stdout.replace("\n", " ").replace(
            "  ", " "
        )


def test_build_cli_bad_source(tmp_path, digest_cli):
    code, _, err = digest_cli("build", "ftp://nowhere/x", "-o", tmp_path / "o.qd")
    assert code == 2 and err.strip().startswith("digests: error: unknown URL scheme 'ftp'")
    code, _, err = digest_cli("build", tmp_path / "missing", "-o", tmp_path / "o.qd", "-q")
    assert code == 3 and len(err.strip().splitlines()) == 1 and "Traceback" not in err
