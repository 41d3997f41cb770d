"""mountd dies (SIGKILL) under a mount: hits go on, misses fail with EIO, and once mountd is
back, misses work again without remounting. The tests run in order on one mount."""

from __future__ import annotations

import errno
import json
import os
import random
import time
from pathlib import Path

import blake3
import pytest

from mountd.rpc.client import SyncClient
from quiverfs.fs import FAILURE_MEMORY
from tests.mount.conftest import MountdProcess, MountProcess, build_digest, wait_for, write_tree

pytestmark = pytest.mark.mount

rng = random.Random(11)
FILES = {f"part{i % 3}/file_{i:03d}.bin": rng.randbytes(20_000 + i) for i in range(40)}
WARM = sorted(FILES)[:20]
COLD = sorted(FILES)[20:]


@pytest.fixture(scope="module")
def state(fuse, module_tmp: Path):
    source = module_tmp / "source"
    write_tree(source, FILES)
    digest = module_tmp / "d.qd"
    build_digest(source, digest)
    cache = module_tmp / "cache"
    # Started here, so the mount found it running: a service, which the mount never restarts.
    mountds = [MountdProcess(cache).start()]
    try:
        # Warm through mountd (not the mount), so no page of these files is in the kernel's
        # cache: reading them later really goes through the mount's hit path.
        with SyncClient.connect(cache) as client:
            for rel in WARM:
                data = FILES[rel]
                client.ensure(blake3.blake3(data).digest(), len(data),
                              {"url": "file://" + str(source), "key": rel, "offset": 0, "length": len(data)})
        with MountProcess(digest, module_tmp / "mnt", cache) as mount:
            yield {"mnt": mount.mountpoint, "cache": cache, "mountds": mountds, "mount": mount}
    finally:
        for mountd in mountds:
            mountd.stop()


def _stats(mnt: Path) -> dict:
    return json.loads(os.getxattr(mnt, "user.quiver.stats"))


def test_1_hits_are_served_without_mountd(state) -> None:
    state["mountds"][0].kill()
    mnt = state["mnt"]
    for rel in WARM:
        assert (mnt / rel).read_bytes() == FILES[rel]
    assert _stats(mnt)["hits"] == len(WARM)


def test_2_misses_fail_with_eio_while_mountd_is_down(state) -> None:
    mnt = state["mnt"]
    for rel in COLD[:5]:
        with pytest.raises(OSError) as info:
            (mnt / rel).read_bytes()
        assert info.value.errno == errno.EIO, rel
    assert state["mount"].died() is None
    assert _stats(mnt)["errors"] == 5
    assert os.getxattr(mnt / COLD[0], "user.quiver.cached") == b"0"
    # The tree itself needs no mountd.
    assert len(os.listdir(mnt / "part0")) == len([r for r in FILES if r.startswith("part0/")])


def test_3_misses_work_again_once_mountd_is_back(state) -> None:
    mnt = state["mnt"]
    state["mountds"].append(MountdProcess(state["cache"]).start())
    # A failed miss is remembered for FAILURE_MEMORY (docs/mount.md "Reads"), so the kernel's
    # retry of the same page gets the same answer; a mountd that starts faster than that would
    # see COLD[0], which failed in test 2, fail once more from that memory.
    time.sleep(FAILURE_MEMORY)
    for rel in COLD:  # the same mount process: it reconnected by itself
        assert (mnt / rel).read_bytes() == FILES[rel]
    assert state["mount"].died() is None

    def registered() -> bool:
        with SyncClient.connect(state["cache"]) as client:
            return [m["mountpoint"] for m in client.ls()["mounts"]] == [str(mnt)]

    wait_for(registered, "the mount to register again with the new mountd", timeout=15, interval=0.05)
