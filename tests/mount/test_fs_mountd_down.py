"""mountd dies (SIGKILL) under a mount: hits go on; a miss waits for mountd to come back
(``--mountd-wait``, quiverfs/mount/mountd_wait.py) and then reads the right bytes; with no wait it
fails with EIO at once, and with a short one after it; once mountd is back, misses work again
without remounting. The numbered tests run in order on one mount (``--mountd-wait 0``); the
last ones on mounts of their own."""

from __future__ import annotations

import errno
import os
import random
import threading
import time
from pathlib import Path

import blake3
import pytest

from mountd.rpc.client import SyncClient
from quiverfs.client.control_client import ControlClient
from quiverfs.filesystem.fs import FAILURE_MEMORY
from tests.mount.conftest import (
    MountdProcess,
    MountProcess,
    build_digest,
    mount_stats,
    wait_for,
    write_tree,
)

pytestmark = pytest.mark.mount

rng = random.Random(11)
FILES = {f"part{i % 3}/file_{i:03d}.bin": rng.randbytes(20_000 + i) for i in range(40)}
WARM = sorted(FILES)[:20]
COLD = sorted(FILES)[20:]
#: Files no numbered test reads: misses for the tests of the wait.
LATE = [f"late/file_{i}.bin" for i in range(2)]
FILES.update({rel: rng.randbytes(30_000 + i) for i, rel in enumerate(LATE)})


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
        with MountProcess(digest, module_tmp / "mnt", cache, "--mountd-wait", "0") as mount:
            yield {"mnt": mount.mountpoint, "cache": cache, "mountds": mountds, "mount": mount,
                   "digest": digest, "tmp": module_tmp}
    finally:
        for mountd in mountds:
            mountd.stop()



def test_1_hits_are_served_without_mountd(state) -> None:
    state["mountds"][0].kill()
    mnt = state["mnt"]
    for rel in WARM:
        assert (mnt / rel).read_bytes() == FILES[rel]
    assert mount_stats(mnt)["hits"] == len(WARM)


def test_2_without_a_wait_misses_fail_with_eio_at_once_while_mountd_is_down(state) -> None:
    mnt = state["mnt"]
    started = time.monotonic()
    for rel in COLD[:5]:
        with pytest.raises(OSError) as info:
            (mnt / rel).read_bytes()
        assert info.value.errno == errno.EIO, rel
    assert time.monotonic() - started < 5.0  # no wait: each miss fails at its first try
    assert state["mount"].died() is None
    assert mount_stats(mnt)["errors"] == 5
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


def test_a_miss_waits_for_a_restarted_mountd_and_reads_the_right_bytes(state) -> None:
    """The default: a miss that finds mountd away blocks until mountd answers again, so a
    training job reading through a restart gets its bytes, not EIO; a control request (a
    sampler's session) waits the same way."""
    cache, tmp, mountds = state["cache"], state["tmp"], state["mountds"]
    with MountProcess(state["digest"], tmp / "mnt-wait", cache) as mount:
        mnt = mount.mountpoint
        mountds[-1].kill()
        reader, got = _read_in_thread(mnt / LATE[0])
        control = ControlClient(mnt)
        opener, opened = _in_thread(lambda: control.request("open", job="restart", rank=0, world=1))
        time.sleep(1.5)
        assert reader.is_alive() and opener.is_alive(), (got, opened)  # waiting, not failed
        mountds.append(MountdProcess(cache).start())
        reader.join(30)
        opener.join(30)
        assert not reader.is_alive() and not opener.is_alive()
        assert got.get("data") == FILES[LATE[0]], got.get("errno")
        assert got["seconds"] >= 1.5
        assert "error" not in opened and opened["value"]["job"] == "restart", opened
        assert mount_stats(mnt)["errors"] == 0
        log = mount.log.read_text()
        assert "mountd is not answering" in log and "mountd answers again after" in log


def test_a_miss_gives_up_with_eio_after_the_wait(state) -> None:
    cache, tmp, mountds = state["cache"], state["tmp"], state["mountds"]
    with MountProcess(state["digest"], tmp / "mnt-short", cache, "--mountd-wait", "1") as mount:
        mnt = mount.mountpoint
        mountds[-1].kill()
        started = time.monotonic()
        with pytest.raises(OSError) as info:
            (mnt / LATE[1]).read_bytes()
        assert info.value.errno == errno.EIO
        assert 1.0 <= time.monotonic() - started < 10.0
        assert "did not answer for 1 s" in mount.log.read_text()
        mountds.append(MountdProcess(cache).start())
        time.sleep(FAILURE_MEMORY)
        assert (mnt / LATE[1]).read_bytes() == FILES[LATE[1]]


def _in_thread(call) -> tuple[threading.Thread, dict]:
    """Run ``call()`` in a thread; its outcome ("value" or "error")."""
    out: dict = {}

    def run() -> None:
        try:
            out["value"] = call()
        except OSError as exc:
            out["error"] = exc.errno

    thread = threading.Thread(target=run)
    thread.start()
    return thread, out


def _read_in_thread(path: Path) -> tuple[threading.Thread, dict]:
    """Read ``path`` in a thread; its outcome ("data" or "errno", and "seconds")."""
    out: dict = {}

    def read() -> None:
        started = time.monotonic()
        try:
            out["data"] = path.read_bytes()
        except OSError as exc:
            out["errno"] = exc.errno
        out["seconds"] = time.monotonic() - started

    thread = threading.Thread(target=read)
    thread.start()
    return thread, out
