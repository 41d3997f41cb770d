#!/usr/bin/env python3
"""Cached files read through the mount with and without FUSE passthrough, side by side.

For three file sizes (110 KiB images, 1 MiB records, 64 MiB shards), all already in the store
and in the page cache, 4 reader processes read disjoint shares (``open()``, reads of 1 MiB into
one buffer, ``close()``):

* direct: the store files themselves (the reference);
* through a fresh mount with ``--no-passthrough``: a first pass (every file's pages go through
  the mount's workers into the mount's page cache) and a second (the kernel keeps them);
* through a fresh mount with ``--passthrough``: the same two passes (the kernel reads the
  store files; every open reaches the mount as an OPEN and a RELEASE).

It prints MB/s, each ÷ direct, and passthrough ÷ without, best of ``--rounds`` fresh mounts;
it is what docs/mount.md "Passthrough" and the mount's default (passthrough for datasets of
files of 1 MiB or more on average: quiverfs/mount/serve.py PASSTHROUGH_MEAN_BYTES) rest on.
There is no target. Needs root, FUSE and a kernel with passthrough (Linux 6.9+); everything
lives under .bench/passthrough/ (git-ignored).

    .venv/bin/python scripts/bench/passthrough.py [--rounds 2] [--readers 4]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import shutil
import signal
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

import trio  # noqa: E402

WORK = os.path.join(REPO, ".bench", "passthrough")
#: (name, file size, files): ~200-500 MB each
SETS = (("110 KiB", 110 * 1024, 2000), ("1 MiB", 1 << 20, 300), ("64 MiB", 64 << 20, 6))


def quiverfs(*args: str) -> list[str]:
    return [sys.executable, "-m", "quiverfs.cli", *args]


def wait_for(predicate, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.01)


def prepare(name: str, size: int, files: int) -> tuple[str, list[str]]:
    """The digest of ``files`` random files of ``size`` bytes, and their relative paths."""
    from digests.build import build

    tag = name.replace(" ", "")
    source, digest = os.path.join(WORK, f"src-{tag}"), os.path.join(WORK, f"{tag}.qd")
    rels = [f"part_{i % 10}/f_{i:05d}.bin" for i in range(files)]
    if not os.path.exists(digest):
        rng = random.Random(size)
        for rel in rels:
            path = os.path.join(source, rel)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as f:
                f.write(rng.randbytes(size))
        trio.run(lambda: build("file://" + source, digest))
    return digest, rels


def _reader(paths: list[str], barrier, results) -> None:
    # 1 MiB reads into one buffer, as a loader streams a shard: a whole-file read() of a
    # 64 MiB file measures the allocator (fresh pages: ~1.7 GB/s here), not the filesystem.
    buffer = memoryview(bytearray(1 << 20))
    barrier.wait()
    total = 0
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while n := f.readinto(buffer):
                total += n
    results.put(total)


def read_pass(paths: list[str], readers: int, size: int) -> float:
    """MB/s of ``readers`` processes reading disjoint shares of ``paths`` at once."""
    ctx = multiprocessing.get_context("fork")
    barrier, results = ctx.Barrier(readers + 1), ctx.Queue()
    procs = [ctx.Process(target=_reader, args=(paths[i::readers], barrier, results)) for i in range(readers)]
    for p in procs:
        p.start()
    barrier.wait()
    start = time.perf_counter()
    got = sum(results.get() for _ in procs)
    wall = time.perf_counter() - start
    for p in procs:
        p.join()
    if got != len(paths) * size:
        raise SystemExit(f"read {got} bytes, expected {len(paths) * size}")
    return got / wall / 1e6


class Mount:
    """``quiverfs mount --foreground`` of a digest for one round."""

    def __init__(self, digest: str, mountpoint: str, cache: str, *options: str) -> None:
        self.cmd = quiverfs("mount", "--foreground", "--cache-dir", cache, *options, digest, mountpoint)
        self.mountpoint = mountpoint

    def __enter__(self) -> Mount:
        os.makedirs(self.mountpoint, exist_ok=True)
        self.proc = subprocess.Popen(self.cmd, cwd=REPO, stdin=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for(lambda: os.path.ismount(self.mountpoint), "the mount")
        return self

    def stats(self) -> dict:
        return json.loads(os.getxattr(self.mountpoint, "user.quiver.stats"))

    def __exit__(self, *exc: object) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=2, help="fresh mounts per mode (best reported)")
    parser.add_argument("--readers", type=int, default=4)
    args = parser.parse_args()
    if os.geteuid() != 0 or not os.path.exists("/dev/fuse"):
        raise SystemExit("needs root and /dev/fuse")
    from mountd.rpc.client import probe

    os.makedirs(WORK, exist_ok=True)
    cache, mnt = os.path.join(WORK, "cache"), os.path.join(WORK, "mnt")
    if probe(cache, timeout=1.0) is not None:
        raise SystemExit(f"a mountd is running on {cache}: stop it first (the benchmark starts its own)")
    shutil.rmtree(cache, ignore_errors=True)
    mountd = subprocess.Popen(quiverfs("mountd", "--cache-dir", cache, "--cache-size", "8G"), cwd=REPO,
                              stdin=subprocess.DEVNULL)
    rows = []
    try:
        wait_for(lambda: probe(cache, timeout=1.0) is not None, "mountd")
        for name, size, files in SETS:
            digest, rels = prepare(name, size, files)
            paths = [os.path.join(mnt, rel) for rel in rels]
            with Mount(digest, mnt, cache, "--no-passthrough"):
                read_pass(paths, args.readers, size)  # fills the cache (cold)
            with Mount(digest, mnt, cache, "--passthrough") as m:
                if not m.stats().get("passthrough"):
                    raise SystemExit("this kernel or user cannot use FUSE passthrough (Linux 6.9+, root)")
            store = os.path.join(cache, "store")
            store_paths = [os.path.join(d, f) for d, _, fs in os.walk(store) for f in fs]
            store_paths = [p for p in store_paths if os.path.getsize(p) == size]
            read_pass(store_paths, args.readers, size)  # the store's pages warm
            direct = max(read_pass(store_paths, args.readers, size) for _ in range(2))
            out = {}
            for mode in ("--no-passthrough", "--passthrough"):
                firsts, seconds = [], []
                for _ in range(args.rounds):
                    with Mount(digest, mnt, cache, mode):
                        firsts.append(read_pass(paths, args.readers, size))
                        seconds.append(read_pass(paths, args.readers, size))
                out[mode] = (max(firsts), max(seconds))
            rows.append((name, files, direct, out))
    finally:
        mountd.send_signal(signal.SIGTERM)
        mountd.wait(30)
    print(f"\ncached files through the mount, {args.readers} readers, {os.cpu_count()} CPUs, "
          f"best of {args.rounds} fresh mounts per mode")
    print(f"{'files':<16}{'direct MB/s':>12}  {'mode':<18}{'1st MB/s':>10}{'÷ direct':>9}"
          f"{'2nd MB/s':>10}{'÷ direct':>9}")
    for name, files, direct, out in rows:
        for i, (mode, (first, second)) in enumerate(out.items()):
            label = f"{files:,} x {name}" if i == 0 else ""
            ref = f"{direct:,.0f}" if i == 0 else ""
            print(f"{label:<16}{ref:>12}  {mode.lstrip('-'):<18}{first:>10,.0f}{first / direct:>9.3f}"
                  f"{second:>10,.0f}{second / direct:>9.3f}")
        (f0, s0), (f1, s1) = out["--no-passthrough"], out["--passthrough"]
        print(f"{'':<16}{'':>12}  {'passthrough ÷ not':<18}{f1 / f0:>10.2f}{'':>9}{s1 / s0:>10.2f}")


if __name__ == "__main__":
    main()
