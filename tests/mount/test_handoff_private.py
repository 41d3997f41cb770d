"""A private store (``mountd --private-store --shared``, run by root) read by another user's
loader through descriptor hand-off: a real throwaway user, its own real mount.

The user may not open store files (``EACCES``), and neither may its mount. The direct loader notices
the store is closed to it and asks mountd for the descriptors, one request per batch; the mount asks
for each file it reads (quiverfs/filesystem/reads.py), and fetches through mountd what it was not
handed over (not cached), then asks again. So every byte the user gets here came by hand-off, and
mountd counts each cached file as one hit of the dataset and of the user's uid, once: the mount does
not report the hits it was handed over.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from digests.digest import Digest
from mountd.rpc.client import SyncClient
from mountd.store import layout
from quiverfs.client.direct import DirectReader
from quiverfs.fuse import worker as fuse_worker
from quiverfs.mount import serve
from quiverfs.testing.sample_data import generate_images, write_tree
from quiverfs.testing.users import (
    LocalUser,
    LocalUsers,
    interpreter_reachable,
    run_as,
)
from tests.mount.conftest import (
    REPO,
    MountdProcess,
    UserMount,
    build_digest,
    sha,
)

pytestmark = [pytest.mark.mount, pytest.mark.usefixtures("fuse")]

torch = pytest.importorskip("torch")

from quiverfs.torch import DirectDataset  # noqa: E402

if os.geteuid() != 0:
    pytest.skip("creates local users and changes uids: needs root", allow_module_level=True)


@pytest.fixture(scope="module")
def world(dev_fuse_for_users: None, local_users: LocalUsers) -> Iterator[dict]:
    work = Path(tempfile.mkdtemp(prefix="quiverfs-handoff-private-"))
    work.chmod(0o711)
    user = local_users.user("qfs_test_reader")
    home = work / "home"
    home.mkdir()
    os.chown(home, user.uid, user.gid)
    source = work / "source"
    write_tree(source, generate_images(n_classes=2, per_class=6, size=24))
    digest = work / "images.qd"
    dataset = build_digest(source, digest)
    digest.chmod(0o644)
    cache = work / "cache"
    mountd = MountdProcess(cache, "1G", "--private-store", "--shared").start()
    mountpoint = work / "mnt"
    try:
        with Digest.open(digest) as d, SyncClient.connect(cache) as client:  # root fills
            entries = sorted(d.iter_files(), key=lambda entry: entry.path)
            cold = entries.pop()  # left out: the user's mount fetches it
            files = {entry.path: (entry.hash, entry.size) for entry in entries}
            for entry in entries:
                client.ensure(entry.hash, entry.size, entry.location, dataset)
        # No read-ahead: the cold file stays cold until the test reads it.
        with interpreter_reachable(REPO), \
                UserMount(user, home, cache, digest, mountpoint, "--readahead", "0"):
            yield {"user": user, "cache": cache, "mnt": mountpoint, "source": source,
                   "dataset": dataset, "files": files, "cold": cold.path}
    finally:
        mountd.stop()
        shutil.rmtree(work, ignore_errors=True)



def mountd_counters(cache: Path, dataset: str) -> dict:
    """mountd's counters of ``dataset`` and of this process's uid (run as the user)."""
    with SyncClient.connect(cache) as client:
        stats = client.stats()
        access = client.hello_info["store_access"]
    mine = stats["users"].get(str(os.getuid()), {})
    counted = stats["counters"]["datasets"][dataset]
    return {"access": access, "hits": counted["hits"], "misses": counted.get("misses", 0),
            **{name: mine.get(name, 0) for name in ("opens", "opened", "reported_hits")}}


def mount_counters(mnt: Path) -> dict:
    """The mount's own counters (``user.quiver.stats``), run as the user."""
    stats = json.loads(os.getxattr(mnt, "user.quiver.stats"))
    return {name: stats[name] for name in ("opens", "hits", "misses", "errors")}


def change(before: dict, after: dict) -> dict:
    return {name: after[name] - before[name] for name in before if isinstance(before[name], int)}


def settle() -> None:
    """Let the mount's hit reports reach mountd, if it sent any: a worker's flush, then the
    main process's report loop, twice over. (Checking that nothing is reported needs time
    to pass; there is nothing to poll for.)"""
    time.sleep(fuse_worker.FLUSH_INTERVAL + 2 * serve.HITS_INTERVAL)


def test_another_user_reads_a_private_store_by_hand_off_only(world: dict) -> None:
    user: LocalUser = world["user"]
    rels = sorted(world["files"])
    paths = [os.fspath(world["mnt"] / rel) for rel in rels]
    store_files = [os.fspath(layout.store_path(world["cache"], world["files"][rel][0])) for rel in rels]
    cache, dataset = world["cache"], world["dataset"]

    def as_user() -> dict:
        def counters() -> dict:
            return mountd_counters(cache, dataset)

        def failure(path: str) -> str:
            try:
                with open(path, "rb") as f:
                    f.read()
            except OSError as exc:
                return errno.errorcode[exc.errno]
            return "read"

        reader = DirectReader()  # nothing forced: it finds out the store is closed to it
        before = counters()
        batch = reader.open_many(paths)
        got = []
        for f in batch:
            with f:
                got.append(sha(f.read()))
        items = DirectDataset(paths, decode=lambda f: f.read(), reader=reader).__getitems__(list(range(len(paths))))
        one = reader.read(paths[0])
        after = counters()
        return {"got": got, "items": [sha(i) for i in items], "one": sha(one), "counts": reader.counts(),
                "before": before, "after": after,
                "store": failure(store_files[0])}

    result = run_as(user, as_user)
    want = [sha((world["source"] / rel).read_bytes()) for rel in rels]
    assert result["got"] == result["items"] == want and result["one"] == want[0]
    assert result["counts"] == {"store": 2 * len(rels) + 1, "mount": 0, "elsewhere": 0}
    before, after = result["before"], result["after"]
    assert before["access"] == "private"
    assert (after["opens"] - before["opens"], after["opened"] - before["opened"]) == (3, 2 * len(rels) + 1)
    assert after["hits"] - before["hits"] == 2 * len(rels) + 1
    # The only way it had: the store file is closed to it.
    assert result["store"] == "EACCES"


def test_the_users_own_mount_reads_hits_by_hand_off(world: dict) -> None:
    """The mount opens nothing itself: each cached file it reads is one ``open`` request
    answered with one descriptor, one hit in mountd (dataset and uid) and none reported
    again by the mount; the mount's own counters see hits."""
    rels = sorted(world["files"])
    cache, dataset, mnt = world["cache"], world["dataset"], world["mnt"]

    def as_user() -> dict:
        before, local_before = mountd_counters(cache, dataset), mount_counters(mnt)
        got = [sha((mnt / rel).read_bytes()) for rel in rels]
        settle()
        after, local_after = mountd_counters(cache, dataset), mount_counters(mnt)
        return {"got": got, "access": after["access"], "mountd": change(before, after),
                "mount": change(local_before, local_after)}

    result = run_as(world["user"], as_user)
    n = len(rels)
    assert result["got"] == [sha((world["source"] / rel).read_bytes()) for rel in rels]
    assert result["access"] == "private"
    assert result["mountd"] == {"hits": n, "misses": 0, "opens": n, "opened": n,
                                "reported_hits": n}
    assert result["mount"] == {"opens": n, "hits": n, "misses": 0, "errors": 0}


def test_the_users_own_mount_fetches_a_cold_file_then_reads_it_by_hand_off(world: dict) -> None:
    """A file not cached: the worker is not handed it (one ``open``, none given), forwards
    the READ; the main process is not handed it either (a second ``open``), fetches it
    (``lease``: a miss) and is handed the fresh store file (a third ``open``, which mountd
    counts as a hit too: the ``open`` operation cannot tell it from a hit)."""
    rel = world["cold"]
    cache, dataset, mnt = world["cache"], world["dataset"], world["mnt"]

    def as_user() -> dict:
        before, local_before = mountd_counters(cache, dataset), mount_counters(mnt)
        got = sha((mnt / rel).read_bytes())
        settle()
        after, local_after = mountd_counters(cache, dataset), mount_counters(mnt)
        return {"got": got, "mountd": change(before, after), "mount": change(local_before, local_after)}

    result = run_as(world["user"], as_user)
    assert result["got"] == sha((world["source"] / rel).read_bytes())
    assert result["mountd"] == {"hits": 1, "misses": 1, "opens": 3, "opened": 1,
                                "reported_hits": 1}
    assert result["mount"] == {"opens": 1, "hits": 0, "misses": 1, "errors": 0}

