"""Eight reader processes at once over one mount, half the files cached and half not: with the
sweep off (every cold file a miss on demand, concurrent first opens waiting for one fetch) and
on (fills asked for ahead racing the readers' own misses)."""

from __future__ import annotations

import json
import multiprocessing
import os
import random
from pathlib import Path

import blake3
import pytest

from mountd.rpc.client import SyncClient
from tests.mount.conftest import MountdProcess, MountProcess, build_digest, write_tree
from tests.mountd.conftest import store_files

pytestmark = pytest.mark.mount

READERS = 8


def _files() -> dict[str, bytes]:
    rng = random.Random(3)
    files = {f"d{i % 7}/f{i:04d}.bin": rng.randbytes(rng.choice([0, 1, 4096, 65536, 110_000, 300_000]))
             for i in range(300)}
    files["big/a"] = rng.randbytes(8 << 20)
    files["big/b"] = rng.randbytes(3 << 20)
    return files


FILES = _files()


@pytest.fixture(scope="module", params=["sweep-off", "sweep-on"])
def mounted(fuse, module_tmp: Path, request):
    source = module_tmp / "source"
    write_tree(source, FILES)
    digest = module_tmp / "d.qd"
    build_digest(source, digest)
    cache = module_tmp / f"cache-{request.param}"
    mountd = MountdProcess(cache).start()
    try:
        # Warm every other file straight through mountd: the readers meet hits and misses.
        warm = sorted(FILES)[::2]
        with SyncClient.connect(cache) as client:
            for rel in warm:
                data = FILES[rel]
                location = {"url": "file://" + str(source), "key": rel, "offset": 0, "length": len(data)}
                client.ensure(blake3.blake3(data).digest(), len(data), location)
        args = ["--sweep", "0"] if request.param == "sweep-off" else []
        with MountProcess(digest, module_tmp / f"mnt-{request.param}", cache, *args) as mount:
            yield mount.mountpoint, cache, warm
    finally:
        mountd.stop()


def _read_all(args: tuple[str, int]) -> dict[str, str]:
    root, seed = args
    names = sorted(FILES)
    random.Random(seed).shuffle(names)
    out = {}
    for rel in names:
        with open(os.path.join(root, rel), "rb") as f:
            out[rel] = blake3.blake3(f.read()).hexdigest()
    return out


def test_eight_concurrent_readers_get_every_byte(mounted) -> None:
    mnt, cache, warm = mounted
    warm_hashes = {blake3.blake3(FILES[rel]).digest() for rel in warm}
    cold = [rel for rel, data in FILES.items() if data and blake3.blake3(data).digest() not in warm_hashes]
    assert len(cold) > 100
    assert all(os.getxattr(mnt / rel, "user.quiver.cached") == b"0" for rel in cold)
    expected = {rel: blake3.blake3(data).hexdigest() for rel, data in FILES.items()}
    with multiprocessing.get_context("spawn").Pool(READERS) as pool:
        results = pool.map(_read_all, [(str(mnt), seed) for seed in range(READERS)])
    for result in results:
        assert result == expected
    stats = json.loads(os.getxattr(mnt, "user.quiver.stats"))
    assert stats["errors"] == 0
    if stats["sweep"] == 0:
        assert stats["misses"] >= len(cold)  # concurrent first opens of a cold file all wait for it
        assert stats["hits"] >= len(warm_hashes)
    else:  # the sweep fetched cold files ahead of some readers: they were hits
        assert stats["sweep_files"] > 0 and stats["misses"] < len(cold)
        assert stats["hits"] + stats["misses"] >= sum(1 for data in FILES.values() if data)  # each once at least
    # (the empty file is in the store only because the warm-up asked mountd for it)
    distinct = {blake3.blake3(d).hexdigest(): len(d) for d in FILES.values()}
    assert store_files(cache) == distinct
