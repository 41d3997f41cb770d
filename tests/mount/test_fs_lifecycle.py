"""Starting and stopping mounts: detached `quiverfs mount`, `quiverfs umount`, signals, a dead
mount process, the mount(8) helper, a mountd started on demand, one-line errors.

Each test is about a mount's life, so each mounts (and always unmounts) its own."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from quiverfs.testing.soak import alive
from tests.mount.conftest import (
    REPO,
    MountProcess,
    dataset_served,
    force_unmount,
    is_mounted,
    quiverfs_cmd,
    stop_mountd_of,
    wait_for,
)

pytestmark = pytest.mark.mount

FILES = {"x/a.txt": b"hello\n", "x/b.bin": os.urandom(70_000), "top": b"top"}


@pytest.fixture(scope="module")
def world(fuse, module_tmp: Path):
    with dataset_served(module_tmp, FILES, "small") as served:
        yield served


def _run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(quiverfs_cmd(*args), capture_output=True, text=True, cwd=REPO, timeout=timeout)



def test_detached_mount_and_umount(world, mountpoint) -> None:
    result = _run("mount", str(world["digest"]), str(mountpoint), "--cache-dir", str(world["cache"]))
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mounted dataset ") and str(mountpoint) in lines[0]
    pid = int(lines[0].rsplit("pid ", 1)[1].rstrip(")"))
    # Ready means ready: no polling needed after the command returns.
    assert (mountpoint / "x/a.txt").read_bytes() == b"hello\n"
    assert json.loads(os.getxattr(mountpoint, "user.quiver.stats"))["pid"] == pid
    result = _run("umount", str(mountpoint))
    assert result.returncode == 0, result.stderr
    assert not is_mounted(mountpoint)
    wait_for(lambda: not alive(pid), "the mount process to exit after the unmount", timeout=15)
    result = _run("umount", str(mountpoint))
    assert result.returncode == 2 and result.stderr.strip() == f"quiverfs: error: {mountpoint} is not mounted"


def test_bad_digest_is_one_line_and_mounts_nothing(world, mountpoint) -> None:
    bad = world["tmp"] / "not-a-digest.qd"
    bad.write_bytes(b"SQLite format 3\x00" + b"\x00" * 200)
    result = _run("mount", str(bad), str(mountpoint), "--cache-dir", str(world["cache"]))
    assert result.returncode == 4  # DigestError's exit status, passed on by the parent
    err = result.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("quiverfs: error: ") and "digest" in err[0], err
    assert not is_mounted(mountpoint)
    result = _run("mount", str(world["tmp"] / "missing.qd"), str(mountpoint), "--cache-dir", str(world["cache"]))
    assert result.returncode == 2 and "no such digest file" in result.stderr
    assert not is_mounted(mountpoint)


def test_bad_mountpoint_is_one_line(world) -> None:
    missing = world["tmp"] / "no-such-dir"
    result = _run("mount", str(world["digest"]), str(missing), "--cache-dir", str(world["cache"]))
    assert result.returncode == 2
    assert result.stderr.strip() == f"quiverfs: error: mount point {missing} does not exist"


def test_sigterm_unmounts_cleanly(world, mountpoint) -> None:
    mount = MountProcess(world["digest"], mountpoint, world["cache"]).start()
    try:
        assert (mountpoint / "top").read_bytes() == b"top"
        mount.proc.send_signal(signal.SIGTERM)
        assert mount.proc.wait(30) == 0
        assert not is_mounted(mountpoint)
        assert os.listdir(mountpoint) == []
    finally:
        mount.stop()


def test_a_sigterm_right_after_an_unmount_still_ends_the_mount_with_0(world, mountpoint) -> None:
    # An unmount followed at once by SIGTERM (the soak's remount, a service manager): the
    # signals keep coming while the process winds down, and none may kill it (exit -15).
    mount = MountProcess(world["digest"], mountpoint, world["cache"]).start()
    try:
        assert (mountpoint / "top").read_bytes() == b"top"
        subprocess.run(["fusermount3", "-u", "-z", str(mountpoint)], check=True)
        deadline = time.monotonic() + 30
        while mount.proc.poll() is None and time.monotonic() < deadline:
            mount.proc.send_signal(signal.SIGTERM)
            time.sleep(0.001)
        assert mount.proc.wait(5) == 0
        assert not is_mounted(mountpoint)
    finally:
        mount.stop()


def _statfs_errno(path: Path) -> int:
    try:
        os.statvfs(path)  # always asks the filesystem (a listing may come from the kernel's cache)
    except OSError as exc:
        return exc.errno or 0
    return 0


def test_umount_after_the_mount_process_died(world, mountpoint) -> None:
    mount = MountProcess(world["digest"], mountpoint, world["cache"]).start()
    try:
        mount.proc.kill()
        mount.proc.wait()
        # Its workers follow it (parent-death signal); then the connection is gone and the
        # kernel answers ENOTCONN while it still lists the mount.
        wait_for(lambda: _statfs_errno(mountpoint) == errno.ENOTCONN, "ENOTCONN from the dead mount", timeout=10)
        assert is_mounted(mountpoint)
        result = _run("umount", str(mountpoint))
        assert result.returncode == 0, result.stderr
        assert not is_mounted(mountpoint) and os.listdir(mountpoint) == []
    finally:
        mount.stop()


def test_fstab_helper_parses_options_and_mounts(world, mountpoint) -> None:
    helper = REPO / "scripts" / "mount.fuse.quiverfs"
    result = subprocess.run(
        [str(helper), str(world["digest"]), str(mountpoint), "-o",
         f"rw,noauto,_netdev,cache_dir={world['cache']},cache_size=1G,allow_other"],
        capture_output=True, text=True, timeout=120,
    )
    try:
        assert result.returncode == 0, result.stderr
        assert result.stdout.startswith("mounted dataset ")
        with open("/proc/mounts") as f:
            [line] = [ln for ln in f if f" {mountpoint} " in ln]
        assert " fuse.quiverfs " in line and "allow_other" in line and " ro," in line
        assert (mountpoint / "x/b.bin").read_bytes() == FILES["x/b.bin"]
    finally:
        force_unmount(mountpoint)
    bad = subprocess.run([str(helper), str(world["digest"]), str(mountpoint), "-o", "cache_size"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1 and "cache_size needs a value" in bad.stderr


def test_mount_starts_a_mountd_when_none_runs(world, mountpoint) -> None:
    from mountd.rpc.client import probe

    fresh_cache = world["tmp"] / "fresh-cache"
    assert probe(fresh_cache) is None
    try:
        with MountProcess(world["digest"], mountpoint, fresh_cache, "--cache-size", "64M"):
            assert (mountpoint / "x/b.bin").read_bytes() == FILES["x/b.bin"]
            assert probe(fresh_cache) is not None
            stored = list((fresh_cache / "store").rglob("*"))
            assert any(p.is_file() and p.stat().st_size == len(FILES["x/b.bin"]) for p in stored)
    finally:
        stop_mountd_of(fresh_cache)
