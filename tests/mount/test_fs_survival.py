"""A mount survives what happens around it: its digest file truncated or overwritten while it
serves (it serves a private copy), and workers killed while they hold requests (the main
process answers their request with EIO, closes their channel so the kernel ends anything
else they read, and forks a replacement).

Real mounts, a real mountd; faults are induced with signals, ``truncate`` and a FIFO in place
of a store file (which makes a worker block while it holds a READ)."""

from __future__ import annotations

import errno
import fcntl
import os
import random
import shutil
import signal
import threading
import time
from pathlib import Path

import pytest

from mountd.store.layout import store_path
from tests.mount.conftest import (
    MountProcess,
    dataset_served,
    file_hash,
    force_unmount,
    mount_stats,
    wait_for,
)

pytestmark = pytest.mark.mount

RNG = random.Random(11)
FILES = {
    **{f"a/f{i:02d}": RNG.randbytes(RNG.randrange(1, 90_000)) for i in range(40)},
    **{f"b/g{i:02d}": RNG.randbytes(RNG.randrange(1, 90_000)) for i in range(40)},
    **{f"c/h{i:02d}": RNG.randbytes(RNG.randrange(1, 90_000)) for i in range(40)},
    "d/stuck": RNG.randbytes(50_000),
    "top": b"top\n",
}

#: Seconds within which every reader must have had an answer.
ANSWER_DEADLINE = 20.0


@pytest.fixture(scope="module")
def world(fuse, module_tmp: Path):
    with dataset_served(module_tmp, FILES, "pristine") as served:
        yield served


@pytest.fixture
def digest(world, request) -> Path:
    """A digest file of the test's own, free to be damaged."""
    path = world["tmp"] / f"{request.node.name}.qd"
    shutil.copyfile(world["digest"], path)
    return path


def _workers(mount_pid: int) -> set[int]:
    """The mount's worker processes (its children running the same program); none once the
    mount process is gone."""
    kids: set[int] = set()
    try:
        with open(f"/proc/{mount_pid}/cmdline", "rb") as f:
            program = f.read()
        for task in os.listdir(f"/proc/{mount_pid}/task"):
            with open(f"/proc/{mount_pid}/task/{task}/children") as f:
                kids.update(int(pid) for pid in f.read().split())
    except OSError:
        return set()
    out = set()
    for pid in kids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if f.read() == program:
                    out.add(pid)
        except OSError:
            continue
    return out



def _check_subtree(mountpoint: Path, top: str) -> None:
    expected = sorted(k.split("/", 1)[1] for k in FILES if k.startswith(top + "/"))
    assert sorted(os.listdir(mountpoint / top)) == expected
    for name in expected:
        assert (mountpoint / top / name).read_bytes() == FILES[f"{top}/{name}"], name


def _uncached_read(path: Path) -> bytes:
    """Read ``path`` through the mount even if the kernel kept its pages (drop them first)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        size = os.fstat(fd).st_size
        return os.pread(fd, size, 0)
    finally:
        os.close(fd)


def test_digest_truncated_then_overwritten_under_the_mount(world, digest) -> None:
    mountpoint = world["tmp"] / "mnt-changed"
    snapshots = world["cache"] / "snapshots"
    size = digest.stat().st_size
    with MountProcess(digest, mountpoint, world["cache"]) as mount:
        [copy] = [p for p in snapshots.iterdir() if p.name.startswith(f"{mount.proc.pid}-")]
        assert copy.read_bytes() == world["digest"].read_bytes()
        assert (mountpoint / "top").read_bytes() == b"top\n"
        workers = _workers(mount.proc.pid)
        assert workers

        # What the outside check did: the digest (memory-mapped by SQLite) cut short.
        os.truncate(digest, 8192)
        _check_subtree(mountpoint, "a")  # never looked at before: every answer comes from the mount
        # Then rewritten in place with garbage, longer than before.
        with open(digest, "r+b") as f:
            f.write(os.urandom(size + 4096))
        _check_subtree(mountpoint, "b")
        os.statvfs(mountpoint)  # never cached by the kernel
        assert _uncached_read(mountpoint / "a/f03") == FILES["a/f03"]

        assert _workers(mount.proc.pid) == workers, "a worker died"
        assert mount_stats(mountpoint)["errors"] == 0
        assert "died" not in mount.log.read_text()
        force_unmount(mountpoint)
        assert mount.proc.wait(30) == 0
    assert not copy.exists(), "the digest copy outlived its mount"


def test_stale_digest_copies_are_removed(world, digest) -> None:
    snapshots = world["cache"] / "snapshots"
    snapshots.mkdir(mode=0o700, exist_ok=True)
    stale = snapshots / "999999-deadbeef.qd"
    stale.write_bytes(b"left by a mount that was killed")
    held = snapshots / "999998-alive.qd"
    held.write_bytes(b"a live mount's copy")
    holder = os.open(held, os.O_RDONLY)
    fcntl.flock(holder, fcntl.LOCK_EX)  # as a live mount holds its copy
    try:
        mountpoint = world["tmp"] / "mnt-stale"
        with MountProcess(digest, mountpoint, world["cache"]) as mount:
            assert not stale.exists()
            assert held.exists()
            own = [p for p in snapshots.iterdir() if p.name.startswith(f"{mount.proc.pid}-")]
            assert len(own) == 1
            assert (mountpoint / "top").read_bytes() == b"top\n"
            force_unmount(mountpoint)
            assert mount.proc.wait(30) == 0
        assert not own[0].exists()
        assert held.exists()
    finally:
        os.close(holder)
        held.unlink()


def _wchan(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/wchan") as f:
            return f.read()
    except OSError:
        return ""


def test_a_worker_killed_while_holding_a_request_answers_it(world, digest) -> None:
    mountpoint = world["tmp"] / "mnt-stuck"
    target = mountpoint / "d/stuck"
    with MountProcess(digest, mountpoint, world["cache"], "--workers", "2") as mount:
        assert target.read_bytes() == FILES["d/stuck"]  # now in the store
        stored = store_path(world["cache"], file_hash(target))
        # A FIFO in place of the store file: the worker that serves the next READ blocks in
        # open() while it holds the request, as a worker does in a fault it cannot survive.
        stored.unlink()
        os.mkfifo(stored)
        try:
            outcome: list[object] = []

            def read() -> None:
                try:
                    outcome.append(_uncached_read(target))
                except OSError as exc:
                    outcome.append(exc.errno)

            reader = threading.Thread(target=read, daemon=True)
            reader.start()
            workers = _workers(mount.proc.pid)
            stuck: list[int] = []

            def one_stuck() -> bool:
                stuck[:] = [pid for pid in workers if _wchan(pid) == "wait_for_partner"]
                return bool(stuck)

            wait_for(one_stuck, "a worker to block on the FIFO", timeout=15, alive=mount.died)
            os.kill(stuck[0], signal.SIGKILL)
            wait_for(lambda: not os.path.exists(f"/proc/{stuck[0]}"), "the worker to be gone", timeout=15)
            # The kernel reads the page once more after a failed readahead: give that READ's
            # open() a partner, so it does not block another worker (its pread then fails).
            unblock = os.open(stored, os.O_RDWR | os.O_NONBLOCK)
            try:
                reader.join(ANSWER_DEADLINE)
            finally:
                os.close(unblock)
            assert not reader.is_alive(), "the dead worker's request was never answered"
            assert outcome == [errno.EIO]
        finally:
            stored.unlink()

        wait_for(lambda: len(_workers(mount.proc.pid)) == 2 and stuck[0] not in _workers(mount.proc.pid),
                 "a replacement worker", timeout=15, alive=mount.died)
        _check_subtree(mountpoint, "c")  # the mount keeps serving, hits and misses
        assert mount_stats(mountpoint)["errors"] >= 1
        lines = [ln for ln in mount.log.read_text().splitlines() if "died" in ln]
        assert len(lines) == 1, lines
        assert f"pid {stuck[0]}" in lines[0] and "killed by SIGKILL" in lines[0]
        assert "with EIO" in lines[0] and "replaced by pid" in lines[0]


def test_workers_killed_under_load(world, digest) -> None:
    mountpoint = world["tmp"] / "mnt-load"
    names = sorted(FILES)
    with MountProcess(digest, mountpoint, world["cache"], "--workers", "2") as mount:
        for name in names:  # warm the store: the load below is hits (served by the workers)
            assert (mountpoint / name).read_bytes() == FILES[name]
        stop = threading.Event()
        wrong: list[str] = []
        counts = {"ok": 0, "eio": 0}
        lock = threading.Lock()

        def reader(seed: int) -> None:
            rng = random.Random(seed)
            while not stop.is_set():
                name = rng.choice(names)
                try:
                    os.statvfs(mountpoint)
                    data = _uncached_read(mountpoint / name)
                except OSError as exc:
                    # EIO: the request the worker was handling, answered by the main process;
                    # ECONNABORTED: one the kernel had handed it as it died, ended by the kernel.
                    if exc.errno not in (errno.EIO, errno.ECONNABORTED):
                        wrong.append(f"{name}: {exc}")
                    with lock:
                        counts["eio"] += 1
                    continue
                if data != FILES[name]:
                    wrong.append(f"{name}: wrong bytes")
                with lock:
                    counts["ok"] += 1

        threads = [threading.Thread(target=reader, args=(i,), daemon=True) for i in range(4)]
        for t in threads:
            t.start()
        try:
            for sig in (signal.SIGKILL, signal.SIGBUS, signal.SIGKILL):
                before = _workers(mount.proc.pid)
                served = counts["ok"]
                wait_for(lambda s=served: counts["ok"] > s + 20, "reads to be under way", timeout=30)
                victim = min(before)
                os.kill(victim, sig)
                wait_for(lambda v=victim, n=len(before): v not in _workers(mount.proc.pid)
                         and len(_workers(mount.proc.pid)) == n,
                         "a replacement worker", timeout=15, alive=mount.died)
            served = counts["ok"]
            wait_for(lambda: counts["ok"] > served + 20, "reads after the kills", timeout=30)
        finally:
            stop.set()
            deadline = time.monotonic() + ANSWER_DEADLINE
            for t in threads:
                t.join(max(0.1, deadline - time.monotonic()))
        assert not [t for t in threads if t.is_alive()], "a reader never got an answer"
        assert not wrong, wrong[:5]
        for name in names:
            assert _uncached_read(mountpoint / name) == FILES[name]
        lines = [ln for ln in mount.log.read_text().splitlines() if "died" in ln]
        assert len(lines) == 3, lines
        assert "SIGBUS" in lines[1]


def test_workers_that_keep_dying_end_the_mount(world, digest) -> None:
    from quiverfs.fuse.worker_pool import MAX_RESTARTS

    mountpoint = world["tmp"] / "mnt-doomed"
    with MountProcess(digest, mountpoint, world["cache"], "--workers", "2") as mount:
        pid = mount.proc.pid
        kills = 0
        while mount.proc.poll() is None:
            assert kills <= MAX_RESTARTS + 2, "the mount outlived its restart budget"
            workers = _workers(pid)
            if not workers:
                wait_for(lambda: mount.proc.poll() is not None or _workers(pid), "a worker or the end",
                         timeout=15)
                continue
            victim = min(workers)
            os.kill(victim, signal.SIGKILL)
            kills += 1
            wait_for(lambda v=victim: mount.proc.poll() is not None or v not in _workers(pid),
                     "the worker to be gone", timeout=15)
        assert mount.proc.wait(30) == 1
        assert kills == MAX_RESTARTS + 2  # the replaced ones, then both slots retired
        assert not os.path.ismount(mountpoint)
        log = mount.log.read_text()
        assert log.count("not replaced") == 2 and "the FUSE workers kept dying" in log
