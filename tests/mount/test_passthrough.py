"""Passthrough opens (quiverfs/fuse/passthrough.py): the kernel reads cached files from the store.

Run on a real mount. Where the kernel offers FUSE passthrough (Linux 6.9+ built with
``CONFIG_FUSE_PASSTHROUGH``, as CI's is), the mount must use it when asked and no READ may
reach it; elsewhere it must fall back to serving reads itself, with the same bytes.
"""

from __future__ import annotations

import errno
import gzip
import json
import mmap
import os
import platform
import random
import threading
from pathlib import Path

import pytest

from mountd.rpc.client import SyncClient
from quiverfs.mount.serve import PASSTHROUGH_MEAN_BYTES
from tests.mount.conftest import MountProcess, datasets_served

pytestmark = pytest.mark.mount

rng = random.Random(41)
FILES = {f"d{i % 3}/f{i:02d}.bin": rng.randbytes(rng.randrange(1, 300_000)) for i in range(24)}
LARGE = {f"shard{i}.tar": rng.randbytes(PASSTHROUGH_MEAN_BYTES + 4096 * i) for i in range(3)}


def kernel_offers_passthrough() -> bool:
    """Whether this kernel can do FUSE passthrough (6.9+, CONFIG_FUSE_PASSTHROUGH=y)."""
    major, minor = (int(x) for x in platform.release().split(".")[:2])
    if (major, minor) < (6, 9):
        return False
    try:
        with gzip.open("/proc/config.gz", "rt") as f:
            return "CONFIG_FUSE_PASSTHROUGH=y" in f.read()
    except OSError:
        return True  # no config to read: a 6.9+ distribution kernel has it


PASSTHROUGH = kernel_offers_passthrough()


def stats(mnt: Path) -> dict:
    return json.loads(os.getxattr(mnt, "user.quiver.stats"))


@pytest.fixture(scope="module")
def world(fuse, module_tmp: Path):
    with datasets_served(module_tmp, {"small": FILES, "large": LARGE}) as served:
        yield served


def mount(world, name: str, where: str, *extra: str) -> MountProcess:
    return MountProcess(world["digests"][name], world["tmp"] / where, world["cache"], *extra)


def evict_all(cache: Path) -> None:
    with SyncClient.connect(cache) as client:
        client.evict(all=True)


def test_asked_for_it_no_read_reaches_the_mount_and_the_bytes_are_the_files(world) -> None:
    evict_all(world["cache"])
    with mount(world, "small", "mnt-on", "--passthrough", "--readahead", "0", "--sweep", "0") as m:
        mnt = m.mountpoint
        assert stats(mnt)["passthrough"] is PASSTHROUGH
        for _ in range(2):  # misses (fetched at OPEN), then hits (the worker's OPEN)
            for rel, data in FILES.items():
                assert (mnt / rel).read_bytes() == data, rel
        s = stats(mnt)
        if PASSTHROUGH:
            # Every open() reaches the mount (OPEN), none of their READs does.
            assert (s["opens"], s["misses"], s["hits"], s["reads"]) == (48, 24, 24, 0)
        else:
            assert s["misses"] == 24 and s["reads"] > 0


def test_opens_of_one_file_at_once_and_one_after_another_share_its_backing_file(world) -> None:
    """A second open of an inode while one is open must get the same backing file (else the
    kernel fails it with EIO), and a backing id must live until its open's RELEASE (the
    kernel reads it after our reply: closing it at once failed most opens)."""
    rel, data = "d1/f04.bin", FILES["d1/f04.bin"]
    with mount(world, "small", "mnt-share", "--passthrough") as m:
        path = m.mountpoint / rel
        held = [open(path, "rb") for _ in range(4)]  # noqa: SIM115 - closed below
        try:
            assert all(f.read() == data for f in held)
            errors: list[BaseException] = []

            def reopen() -> None:
                try:
                    for _ in range(50):
                        assert path.read_bytes() == data
                except BaseException as exc:  # noqa: BLE001 - reported below
                    errors.append(exc)

            threads = [threading.Thread(target=reopen) for _ in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert errors == []
        finally:
            for f in held:
                f.close()
        for _ in range(100):  # closed and reopened at once, again and again
            assert path.read_bytes() == data
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as mapped:
            assert mapped[:] == data
        if PASSTHROUGH:
            assert stats(m.mountpoint)["reads"] == 0


def test_a_file_evicted_while_open_reads_on_and_reopens_as_a_miss(world) -> None:
    rel, data = "d2/f05.bin", FILES["d2/f05.bin"]
    with mount(world, "small", "mnt-evict", "--passthrough", "--readahead", "0", "--sweep", "0") as m:
        path = m.mountpoint / rel
        assert path.read_bytes() == data
        with open(path, "rb") as f:
            evict_all(world["cache"])
            assert f.read() == data  # the backing file is the evicted store file, still whole
        before = stats(m.mountpoint)
        assert path.read_bytes() == data
        after = stats(m.mountpoint)
        assert after["misses"] == before["misses"] + 1


@pytest.mark.parametrize("name, flags, expected", [
    ("large", (), PASSTHROUGH),            # files of 1 MiB or more: on by default
    ("small", (), False),                  # smaller: off by default
    ("large", ("--no-passthrough",), False),
])
def test_the_default_follows_the_size_of_the_files(world, name, flags, expected) -> None:
    files = LARGE if name == "large" else FILES
    with mount(world, name, f"mnt-default-{name}-{len(flags)}", *flags) as m:
        assert stats(m.mountpoint)["passthrough"] is expected
        for rel, data in files.items():
            assert (m.mountpoint / rel).read_bytes() == data
        assert (stats(m.mountpoint)["reads"] == 0) is expected


def test_a_fetch_that_fails_fails_the_reads_not_the_open(world) -> None:
    """As without passthrough: the open succeeds (without a backing file) and its reads get
    EIO; the error is logged once."""
    rel = "d0/f09.bin"
    source = world["tmp"] / "src-small" / rel
    kept = source.read_bytes()
    evict_all(world["cache"])
    source.unlink()
    try:
        with mount(world, "small", "mnt-fail", "--passthrough", "--readahead", "0", "--sweep", "0") as m:
            fd = os.open(m.mountpoint / rel, os.O_RDONLY)
            try:
                with pytest.raises(OSError) as caught:
                    os.pread(fd, 4096, 0)
                assert caught.value.errno == errno.EIO
            finally:
                os.close(fd)
            assert stats(m.mountpoint)["errors"] == 1
            lines = [line for line in m.log.read_text().splitlines() if "cannot read " + rel in line]
            assert len(lines) == 1, lines
    finally:
        source.write_bytes(kept)
