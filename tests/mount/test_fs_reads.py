"""Reads through a real mount that the outside checks found wrong, and odd requests:

* a digest row whose size is not its content's fails with EIO and one log line, whether the
  content is in the store (a hit, checked by the mount) or not (a fill, refused by mountd);
* a reader interrupted by a signal (FUSE_INTERRUPT) or killed while its miss is fetched gets
  the data or EINTR, and the mount goes on serving.

One mountd (a bandwidth cap makes a 3 MiB fill last seconds; a cache bigger than the largest
lying row, so a cold 1 TiB row is a fill that fails verification, not a full cache) and one
mount of a hand-written digest.
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import blake3
import pytest

from digests.write import NewFile, write_digest
from tests.mount.conftest import MountdProcess, MountProcess, file_hash, wait_for, write_tree

pytestmark = pytest.mark.usefixtures("fuse")

X_COLD, X_WARM = os.urandom(3000), os.urandom(3000)
Y_COLD, Y_WARM = os.urandom(300 * 1024), os.urandom(300 * 1024)
SLOW = os.urandom(3 << 20)  # about 3 s at the cap
SOURCE = {"x-cold": X_COLD, "x-warm": X_WARM, "y-cold": Y_COLD, "y-warm": Y_WARM,
          "slow-1": SLOW[:-1] + b"1", "slow-2": SLOW[:-1] + b"2", "slow-3": SLOW[:-1] + b"3"}


def b3(data: bytes) -> bytes:
    return blake3.blake3(data).digest()


def rows() -> list[NewFile]:
    out = [NewFile(path, len(data), b3(data)) for path, data in SOURCE.items()]
    # The outside check's rows: 2^40 bytes naming a 3,000-byte content, 100 bytes naming a
    # 300 KB one; each points at the object that holds that content.
    for kind in ("cold", "warm"):
        x, y = SOURCE[f"x-{kind}"], SOURCE[f"y-{kind}"]
        out.append(NewFile(f"huge-{kind}", 1 << 40, b3(x), key=f"x-{kind}"))
        out.append(NewFile(f"short-{kind}", 100, b3(y), key=f"y-{kind}"))
    return out


@pytest.fixture(scope="module")
def mounted(module_tmp: Path) -> Iterator[MountProcess]:
    source = module_tmp / "source"
    write_tree(source, SOURCE)
    digest = module_tmp / "lying.qd"
    write_digest(digest, rows(), ["file://" + str(source)])
    cache = module_tmp / "cache"
    # A cache far smaller than the 2^40-byte rows: a cold lying row is found out by one stat
    # of its object, not by a fill (which could not even reserve its space).
    mountd = MountdProcess(cache, "64M", "--remote-bandwidth", "1M").start()
    try:
        with MountProcess(digest, module_tmp / "mnt", cache) as mount:
            yield mount
    finally:
        mountd.stop()


def read_errno(path: Path, offset: int = 0) -> int:
    """The errno of reading 64 KiB of ``path`` at ``offset`` (0: it read)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.pread(fd, 65536, offset)  # not read(): Python would size its buffer from st_size
        return 0
    except OSError as exc:
        return exc.errno or -1
    finally:
        os.close(fd)


def log_lines(mount: MountProcess, needle: str) -> list[str]:
    return [line for line in mount.log.read_text(errors="replace").splitlines() if needle in line]


@pytest.mark.parametrize("kind", ["cold", "warm"])
def test_a_row_whose_size_is_not_its_contents_is_eio_with_one_log_line(mounted: MountProcess, kind: str) -> None:
    mnt = mounted.mountpoint
    if kind == "warm":  # the content is in the store, read through its correct rows
        assert (mnt / "x-warm").read_bytes() == X_WARM
        assert (mnt / "y-warm").read_bytes() == Y_WARM
        assert os.getxattr(mnt / "huge-warm", "user.quiver.cached") == b"1"
        assert os.getxattr(mnt / "short-warm", "user.quiver.cached") == b"1"
    else:
        assert os.getxattr(mnt / "huge-cold", "user.quiver.cached") == b"0"
    huge, short = mnt / f"huge-{kind}", mnt / f"short-{kind}"
    assert os.stat(huge).st_size == 1 << 40 and os.stat(short).st_size == 100
    assert read_errno(huge) == errno.EIO
    assert read_errno(short) == errno.EIO
    assert read_errno(huge, 1 << 20) == errno.EIO  # any offset
    # One line each, however many times the kernel asked (its retries are answered from the
    # failure's memory), and nothing else went wrong.
    for name in (huge.name, short.name):
        lines = log_lines(mounted, f"cannot read {name}:")
        assert len(lines) == 1, lines
    assert "Traceback" not in mounted.log.read_text(errors="replace")
    # The mount goes on serving the rows that are right.
    assert file_hash(mnt / f"x-{kind}") == b3(SOURCE[f"x-{kind}"])


READER = r"""
import os, signal, sys
signal.signal(signal.SIGUSR1, lambda *a: None)  # handled: the read is interrupted, not the reader
print("reading", flush=True)
fd = os.open(sys.argv[1], os.O_RDONLY)
chunks = []
try:
    while chunk := os.read(fd, 1 << 20):
        chunks.append(chunk)
except InterruptedError:
    print("EINTR", flush=True)
    sys.exit(0)
except OSError as exc:
    print("error", exc.errno, flush=True)
    sys.exit(1)
import blake3
print(blake3.blake3(b"".join(chunks)).hexdigest(), flush=True)
"""


def _fetching(cache: Path) -> bool:
    from mountd.rpc.client import SyncClient

    with SyncClient.connect(cache, timeout=5.0) as client:
        return client.usage()["fills_in_flight"] > 0


def _reader(path: Path) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-c", READER, str(path)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline() == "reading\n"
    return proc


def test_a_reader_interrupted_during_its_miss_gets_the_data_or_eintr(mounted: MountProcess) -> None:
    path = mounted.mountpoint / "slow-1"
    reader = _reader(path)
    try:
        wait_for(lambda: _fetching(mounted.cache_dir), "the fill of slow-1 to start", timeout=30)
        for _ in range(3):  # a FUSE_INTERRUPT for the READ in flight each time
            reader.send_signal(signal.SIGUSR1)
        out, _ = reader.communicate(timeout=120)
    finally:
        if reader.poll() is None:
            reader.kill()
            reader.wait()
    assert reader.returncode == 0, out
    assert out.strip() in ("EINTR", b3(SOURCE["slow-1"]).hex())
    # The mount goes on: the file reads whole (from the store by now, or fetched again).
    assert file_hash(path) == b3(SOURCE["slow-1"])
    assert (mounted.mountpoint / "x-cold").stat().st_size == 3000


def test_a_reader_killed_during_its_miss_leaves_the_mount_serving(mounted: MountProcess) -> None:
    path = mounted.mountpoint / "slow-2"
    reader = _reader(path)
    try:
        wait_for(lambda: _fetching(mounted.cache_dir), "the fill of slow-2 to start", timeout=30)
    finally:
        reader.kill()  # the kernel drops the request; our late reply meets ENOENT
        reader.wait(timeout=60)
    # Another reader of the same file, and of another one, get every byte.
    assert file_hash(path) == b3(SOURCE["slow-2"])
    assert file_hash(mounted.mountpoint / "slow-3") == b3(SOURCE["slow-3"])
    text = mounted.log.read_text(errors="replace")
    assert "Traceback" not in text and "cannot answer a FUSE request" not in text
    assert mounted.died() is None
