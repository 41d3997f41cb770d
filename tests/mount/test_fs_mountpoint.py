"""One mount per mount point: racing `quiverfs mount`s (one wins, the others get one line and
touch nothing), a refused mount next to a live one, and non-empty directories (refused
unless --nonempty, also through the mount(8) helper)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from quiverfs.testing.soak import alive
from tests.mount.conftest import (
    REPO,
    MountProcess,
    dataset_served,
    force_unmount,
    quiverfs_cmd,
    wait_for,
)

pytestmark = pytest.mark.mount

FILES = {"x/a.txt": b"hello\n", "x/b.bin": os.urandom(30_000), "top": b"top"}

#: Concurrent `quiverfs mount` commands per round, and rounds.
RACERS = 4
ROUNDS = 4


@pytest.fixture(scope="module")
def world(fuse, module_tmp: Path):
    with dataset_served(module_tmp, FILES, "small") as served:
        yield served


def _mounts_at(path: Path) -> int:
    from quiverfs.mount.mountpoint import _unescape

    with open("/proc/self/mountinfo") as f:
        return sum(1 for line in f if _unescape(line.split(" ")[4]) == str(path))



#: ``quiverfs ARGS`` once a line arrives on stdin, with everything imported beforehand (it
#: touches the file named first when it is ready), so that the racers start together: the
#: outside check's race needs two mounts between their check and their mount at once.
RACER = """
import sys, pathlib
from quiverfs.cli.main import app
from quiverfs.base.console import run_app
import quiverfs.mount.start, digests.digest, mountd.rpc.async_client
pathlib.Path(sys.argv[1]).touch()
sys.stdin.readline()
run_app(app, "quiverfs", sys.argv[2:])
"""

#: The mount(8) helper (scripts/mount.fuse.quiverfs runs ``helper_main``), started like RACER.
HELPER_RACER = """
import sys, pathlib
from quiverfs.cli.mount_cli import helper_main
import quiverfs.mount.start, digests.digest, mountd.rpc.async_client
pathlib.Path(sys.argv[1]).touch()
sys.stdin.readline()
sys.exit(helper_main(sys.argv[2:]))
"""


def _race(world, mountpoint: Path, round_: int, racer: str = RACER) -> list[tuple[int, str, str]]:
    racers, marks = [], []
    if racer == RACER:
        args = ["mount", str(world["digest"]), str(mountpoint), "--cache-dir", str(world["cache"])]
    else:
        args = [str(world["digest"]), str(mountpoint), "-o", f"cache_dir={world['cache']}"]
    for i in range(RACERS):
        mark = world["tmp"] / f"racer-{mountpoint.name}-{round_}-{i}"
        marks.append(mark)
        racers.append(subprocess.Popen(
            [sys.executable, "-c", racer, str(mark), *args],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO))
    try:
        wait_for(lambda: all(m.exists() for m in marks), "the racers to be ready", timeout=60)
    finally:
        for p in racers:
            p.stdin.write("go\n")
            p.stdin.flush()
    return [(p.wait(120), *p.communicate()) for p in racers]


def test_racing_mounts_one_wins(world, mountpoint) -> None:
    for round_ in range(ROUNDS):
        results = _race(world, mountpoint, round_)
        winners = [r for r in results if r[0] == 0]
        assert len(winners) == 1, (round_, results)
        assert _mounts_at(mountpoint) == 1, (round_, results)
        for code, out, err in results:
            if code == 0:
                continue
            lines = err.strip().splitlines()
            assert code == 2 and out == "" and len(lines) == 1, (round_, code, out, err)
            assert lines[0].startswith("quiverfs: error: ") and str(mountpoint) in lines[0], lines
            assert "already a mount point" in lines[0] or "being mounted by another process" in lines[0]
        # The winner still serves (the losers' cleanup touched nothing).
        assert (mountpoint / "x/b.bin").read_bytes() == FILES["x/b.bin"]
        pid = int(winners[0][1].strip().rsplit("pid ", 1)[1].rstrip(")"))
        done = subprocess.run(quiverfs_cmd("umount", str(mountpoint)), capture_output=True, text=True,
                              cwd=REPO, timeout=60)
        assert done.returncode == 0, done.stderr
        assert _mounts_at(mountpoint) == 0
        wait_for(lambda p=pid: not alive(p), "the winner to exit after the unmount", timeout=15)


def test_racing_fstab_helpers_one_wins_the_others_exit_1(world, mountpoint) -> None:
    # mount(8)'s codes: losing the race is a refusal (1), not a failed mount (32), whether the
    # loser's own checks saw the winner's mount or its forked mount process did.
    for round_ in range(ROUNDS):
        results = _race(world, mountpoint, round_, HELPER_RACER)
        winners = [r for r in results if r[0] == 0]
        assert len(winners) == 1, (round_, results)
        assert _mounts_at(mountpoint) == 1, (round_, results)
        for code, out, err in results:
            if code == 0:
                continue
            lines = err.strip().splitlines()
            assert code == 1 and out == "" and len(lines) == 1, (round_, code, out, err)
            assert lines[0].startswith(f"mount.fuse.quiverfs: {mountpoint} "), lines
            assert "already a mount point" in lines[0] or "being mounted by another process" in lines[0]
        assert (mountpoint / "x/b.bin").read_bytes() == FILES["x/b.bin"]
        pid = int(winners[0][1].strip().rsplit("pid ", 1)[1].rstrip(")"))
        done = subprocess.run(quiverfs_cmd("umount", str(mountpoint)), capture_output=True, text=True,
                              cwd=REPO, timeout=60)
        assert done.returncode == 0, done.stderr
        wait_for(lambda p=pid: not alive(p), "the winner to exit after the unmount", timeout=15)


def test_a_refused_mount_leaves_the_live_one_alone(world, mountpoint) -> None:
    with MountProcess(world["digest"], mountpoint, world["cache"]):
        for extra in ([], ["--foreground"]):
            result = subprocess.run(
                quiverfs_cmd("mount", *extra, str(world["digest"]), str(mountpoint), "--cache-dir", str(world["cache"])),
                capture_output=True, text=True, cwd=REPO, timeout=120)
            assert result.returncode == 2
            assert result.stderr.strip() == (f"quiverfs: error: {mountpoint} is already a mount point "
                                              f"(quiverfs umount {mountpoint} first)")
            assert _mounts_at(mountpoint) == 1
            assert (mountpoint / "x/a.txt").read_bytes() == b"hello\n"


def test_nonempty_mountpoint_is_refused_unless_asked(world, mountpoint) -> None:
    (mountpoint / "keep.txt").write_bytes(b"mine")
    for extra in ([], ["--foreground"]):
        result = subprocess.run(
            quiverfs_cmd("mount", *extra, str(world["digest"]), str(mountpoint), "--cache-dir", str(world["cache"])),
            capture_output=True, text=True, cwd=REPO, timeout=120)
        assert result.returncode == 2
        assert result.stderr.strip() == (f"quiverfs: error: mount point {mountpoint} is not empty "
                                          "(--nonempty mounts over its entries, hiding them)")
        assert _mounts_at(mountpoint) == 0
    helper = REPO / "scripts" / "mount.fuse.quiverfs"
    refused = subprocess.run([str(helper), str(world["digest"]), str(mountpoint), "-o", f"cache_dir={world['cache']}"],
                             capture_output=True, text=True, timeout=120)
    assert refused.returncode == 1 and len(refused.stderr.strip().splitlines()) == 1
    assert "is not empty" in refused.stderr and _mounts_at(mountpoint) == 0

    # Asked for: through the helper's `nonempty`, and with --nonempty.
    done = subprocess.run([str(helper), str(world["digest"]), str(mountpoint), "-o",
                           f"cache_dir={world['cache']},nonempty"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert sorted(os.listdir(mountpoint)) == ["top", "x"]
    force_unmount(mountpoint)
    result = subprocess.run(
        quiverfs_cmd("mount", "--nonempty", str(world["digest"]), str(mountpoint), "--cache-dir", str(world["cache"])),
        capture_output=True, text=True, cwd=REPO, timeout=120)
    assert result.returncode == 0, result.stderr
    assert (mountpoint / "x/a.txt").read_bytes() == b"hello\n"
    force_unmount(mountpoint)
    assert os.listdir(mountpoint) == ["keep.txt"]
    assert (mountpoint / "keep.txt").read_bytes() == b"mine"


def test_helper_parses_nonempty() -> None:
    from quiverfs.cli.mount_cli import parse_helper_args

    assert parse_helper_args(["d.qd", "/mnt", "-o", "nonempty,ro"])["nonempty"] is True
    assert parse_helper_args(["d.qd", "/mnt"])["nonempty"] is False
