#!/usr/bin/env python3
"""The direct loader (quiverfs/client/direct.py) against plain reads of the store files, side by
side.

2,000 files of 110 KiB (``--files``) in ImageFolder-style class folders, one mountd, one
mount (harness/world.py's ``World``). Each round measures, in one run:

* **readers** (``--readers`` processes, default 4, each reading a disjoint share
  ``--repeat`` times, default 10, with ``open()+read()+close()``, started together by a
  barrier; 2,000 warm files alone take ~20 ms, too short to time):

  - *plain*: the store files themselves (``layout.store_path``, paths computed beforehand):
    the ceiling, what a process that already knew every hash would get;
  - *direct*: ``DirectReader.open(mount path)``: the path mapped to its hash with the
    mount's digest, the store file opened, the hit queued and reported to mountd (each
    reader maps the directories it reads before the timed span, as ``DirectDataset`` does
    where it is built; its last reports are sent, and answered, inside it). Target: direct ÷
    plain **>= 0.8**;
  - *direct, hits not reported*: the same with ``DirectReader(report=False)``: what the
    reads cost without mountd's share (mountd spends ~1–2 µs of CPU on each reported hit, on
    the same two cores);
  - *direct, hand-off*: ``DirectReader(handoff=True).open_many`` in batches of 64: mountd
    opens the store files and passes their descriptors (``SCM_RIGHTS``, one request per
    batch), what a ``--private-store`` costs (docs/shim.md "Hand-off");
  - *mount, cold*: the first pass through the mount after every file was evicted (misses,
    filled by mountd from the ``file://`` bucket), once;
  - *mount, second pass*: the same files again, the kernel keeping their pages;
  - *mount, warm store*: through the mount with the store warm but the mount's pages
    dropped (``POSIX_FADV_DONTNEED``): the hit path that the direct loader replaces;

* **DataLoader** (``--workers`` persistent worker processes, default 4, fork, batches of 64;
  ``--epochs`` epochs timed, default 3, after one that starts the workers): items are the
  files' bytes as uint8 tensors, over a ``DatasetFolder`` of the mount (its pages dropped
  before each epoch, as above), the same through ``DirectDataset.of(...)``, and over the
  store files themselves.

mountd's CPU time during the direct rows is printed too: recording a reported hit costs it
a few µs, on the same CPUs as the readers.

Each figure is the best of ``--rounds`` rounds (default 3; the VM swings by ±20%); the rounds
interleave the rows. The plain and direct rows run as ``--pairs`` side-by-side pairs per round
(default 3, back to back, their order alternating): the verdict is the median of the pairs'
ratios, printed with the best and worst pair and the ratio of the two rows' bests (one lucky
plain pass alone made that ratio swing from 0.65 to 0.94 between rounds, 2026-11-23). Needs root and FUSE; everything lives under .bench/ (git-ignored).

    .venv/bin/python scripts/bench/direct_loader.py [--files 2000] [--readers 4] [--workers 4] [--rounds 3] [--pairs 3] [--repeat 10] [--epochs 3]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO))

from harness.cli import preflight  # noqa: E402
from harness.world import DatasetSpec, MountdConfig, World, make_dataset  # noqa: E402

FILE_SIZE = 110 * 1024
TARGET = 0.8
BATCH = 64


# -- reader processes ------------------------------------------------------------------------------


def _plain(paths: list[str]) -> int:
    total = 0
    for path in paths:
        with open(path, "rb") as f:
            total += len(f.read())
    return total


def _direct(paths: list[str], reader) -> int:
    total = 0
    for path in paths:
        with reader.open(path) as f:
            total += len(f.read())
    return total


def _handed_over(paths: list[str], reader) -> int:
    total = 0
    for start in range(0, len(paths), BATCH):
        for f in reader.open_many(paths[start:start + BATCH]):
            with f:
                total += len(f.read())
    return total


def _reader(kind: str, paths: list[str], repeat: int, barrier, results) -> None:
    from quiverfs.client.direct import DirectReader

    reader = DirectReader(report=kind != "unreported", handoff=kind == "handoff")
    if kind != "plain":
        # Find the mount, open its digest and map the directories read, untimed, as
        # DirectDataset does in the process that builds it (its forked workers reuse that).
        for directory in dict.fromkeys(os.path.dirname(path) for path in paths):
            reader.prepare(directory)
    barrier.wait()
    start = time.perf_counter()
    if kind != "plain":
        read = _handed_over if kind == "handoff" else _direct
        total = sum(read(paths, reader) for _ in range(repeat))
        if reader.counts()["store"] != len(paths) * repeat:
            raise SystemExit(f"direct: only {reader.counts()} of {len(paths) * repeat} from the store")
        reader.close()  # the last hits reported, and answered, inside the timed span
    else:
        total = sum(_plain(paths) for _ in range(repeat))
    results.put((time.perf_counter() - start, total))


def read_pass(kind: str, paths: list[str], readers: int, repeat: int = 1) -> float:
    """Files/s of ``readers`` processes reading disjoint shares of ``paths`` at once, each
    its share ``repeat`` times."""
    ctx = multiprocessing.get_context("fork")
    barrier = ctx.Barrier(readers + 1)
    results = ctx.Queue()
    procs = [ctx.Process(target=_reader, args=(kind, paths[i::readers], repeat, barrier, results))
             for i in range(readers)]
    for p in procs:
        p.start()
    barrier.wait()
    start = time.perf_counter()
    outs = [results.get() for _ in procs]
    wall = time.perf_counter() - start
    for p in procs:
        p.join()
    got = sum(total for _, total in outs)
    if got != len(paths) * FILE_SIZE * repeat:
        raise SystemExit(f"{kind}: read {got} bytes, expected {len(paths) * FILE_SIZE * repeat}")
    return len(paths) * repeat / wall


def drop_pages(paths: list[str]) -> None:
    """Make the kernel forget the pages of ``paths`` (through the mount: its next reads are
    READs the mount answers; the store files keep theirs)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


# -- DataLoader ------------------------------------------------------------------------------------


def _as_tensor(f):
    import torch

    return torch.frombuffer(bytearray(f.read()), dtype=torch.uint8)


def _open_as_tensor(path: str):
    with open(path, "rb") as f:
        return _as_tensor(f)


class _Files:
    """Item i: file i's bytes as a uint8 tensor, opened as it is (the store-files ceiling)."""

    def __init__(self, paths: list[str]) -> None:
        self.paths = paths

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int):
        return _open_as_tensor(self.paths[i]), 0


def loader_pass(make: Callable[[], object], files: int, workers: int, epochs: int,
                before: Callable[[], None] = lambda: None) -> float:
    """Files/s of a DataLoader over ``make()`` in ``epochs`` timed epochs after an untimed
    one that starts the persistent workers; ``before()`` runs (untimed) before each."""
    import torch

    loader = torch.utils.data.DataLoader(make(), batch_size=BATCH, num_workers=workers,
                                         persistent_workers=True, multiprocessing_context="fork")
    timed = 0.0
    for epoch in range(1 + epochs):
        before()
        start = time.perf_counter()
        seen = sum(len(labels) for _, labels in loader)
        if epoch:
            timed += time.perf_counter() - start
        if seen != files:
            raise SystemExit(f"the DataLoader gave {seen} items, expected {files}")
    del loader  # the workers stop (reporting their last hits)
    return files * epochs / timed


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# -- the run ---------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--files", type=int, default=2000)
    parser.add_argument("--readers", type=int, default=4)
    parser.add_argument("--workers", type=int, default=4, help="DataLoader workers")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=3, help="timed DataLoader epochs")
    parser.add_argument("--pairs", type=int, default=3,
                        help="side-by-side plain/direct pairs per round (their median ratio is the verdict)")
    parser.add_argument("--repeat", type=int, default=10,
                        help="times each reader reads its share in the plain and direct rows "
                             "(2,000 warm files take ~20 ms: too short to time alone)")
    args = parser.parse_args()
    preflight()

    import torchvision

    from mountd.rpc.client import SyncClient
    from mountd.store import layout
    from quiverfs.client.direct import DirectReader
    from quiverfs.torch import DirectDataset

    dataset = make_dataset(DatasetSpec(files=args.files, file_size=FILE_SIZE, classes=10))
    config = MountdConfig(cache_size=4 * dataset.total_bytes)
    best: dict[str, float] = {}
    mountd_us: list[float] = []  # mountd's CPU per file during the direct rows

    pairs: list[float] = []  # direct ÷ plain of each side-by-side pair

    def record(name: str, value: float) -> float:
        best[name] = max(best.get(name, 0.0), value)
        print(f"  {name:<34}{value:>10,.0f} files/s", flush=True)
        return value

    with World(dataset, "direct_loader", config) as world:
        mount_paths = world.paths
        from digests.digest import Digest

        with Digest.open(dataset.digest) as digest:
            store_paths = [os.fspath(layout.store_path(world.cache_dir, digest.lookup_path(rel).hash))
                           for rel in dataset.rels]
        root = str(world.mountpoint)

        def folder():
            return torchvision.datasets.DatasetFolder(root, loader=_open_as_tensor, extensions=(".bin",))

        def direct_folder():
            return DirectDataset.of(folder(), decode=_as_tensor, reader=DirectReader())

        for r in range(args.rounds):
            print(f"round {r + 1} of {args.rounds}", flush=True)
            with SyncClient.connect(world.cache_dir, timeout=10) as client:
                client.evict(dataset.dataset_id)
            drop_pages(mount_paths)
            record("mount, cold (misses)", read_pass("plain", mount_paths, args.readers))
            record("mount, second pass", read_pass("plain", mount_paths, args.readers))
            drop_pages(mount_paths)
            record("mount, warm store", read_pass("plain", mount_paths, args.readers))
            for pair in range(args.pairs):
                # Side by side: each pair's two passes run back to back (their order
                # alternates, so a drift of the VM's speed favours neither), and the pair's
                # ratio is kept besides the best of each row.
                plain_first = pair % 2 == 0
                if plain_first:
                    plain = record("plain store files",
                                   read_pass("plain", store_paths, args.readers, args.repeat))
                cpu = cpu_seconds(world.mountd.pid)  # type: ignore[union-attr]
                direct = record("direct loader",
                                read_pass("direct", mount_paths, args.readers, args.repeat))
                mountd_us.append((cpu_seconds(world.mountd.pid) - cpu)  # type: ignore[union-attr]
                                 / (args.files * args.repeat) * 1e6)
                if not plain_first:
                    plain = record("plain store files",
                                   read_pass("plain", store_paths, args.readers, args.repeat))
                pairs.append(direct / plain)
                print(f"  {'pair ' + str(len(pairs)) + ': direct ÷ plain':<34}{direct / plain:>10.3f}")
            record("direct loader, hits not reported",
                   read_pass("unreported", mount_paths, args.readers, args.repeat))
            record("direct loader, hand-off", read_pass("handoff", mount_paths, args.readers, args.repeat))
            record("DataLoader, mount (warm store)",
                   loader_pass(folder, args.files, args.workers, args.epochs,
                               lambda: drop_pages(mount_paths)))
            record("DataLoader, direct", loader_pass(direct_folder, args.files, args.workers, args.epochs))
            record("DataLoader, store files", loader_pass(lambda: _Files(store_paths), args.files,
                                                          args.workers, args.epochs))

    plain, direct = best["plain store files"], best["direct loader"]
    print(f"\n{args.files} files x {FILE_SIZE // 1024} KiB, {args.readers} reader processes, "
          f"DataLoader with {args.workers} workers, {os.cpu_count()} CPUs, best of {args.rounds} rounds")
    print(f"{'measure':<36}{'files/s':>10}{'÷ plain':>9}{'÷ direct':>10}")
    for name in ("plain store files", "direct loader", "direct loader, hits not reported",
                 "direct loader, hand-off", "mount, cold (misses)", "mount, warm store", "mount, second pass"):
        print(f"{name:<36}{best[name]:>10,.0f}{best[name] / plain:>9.3f}{best[name] / direct:>10.3f}")
    paired = sorted(pairs)
    median = statistics.median(paired)
    verdict = "PASS" if median >= TARGET else "FAIL"
    print(f"direct ÷ plain, {len(pairs)} side-by-side pairs: median {median:.3f}, best {paired[-1]:.3f}, "
          f"worst {paired[0]:.3f}; best direct ÷ best plain {direct / plain:.3f}")
    print(f"direct ÷ plain (median of the pairs) = {median:.3f} (target >= {TARGET}): {verdict}")
    print(f"mountd's CPU while the direct loader read: {min(mountd_us):.1f} µs a file "
          f"(recording the hits), on the {os.cpu_count()} CPUs the readers share")
    dl_mount, dl_direct, dl_store = (best["DataLoader, mount (warm store)"], best["DataLoader, direct"],
                                     best["DataLoader, store files"])
    print(f"{'DataLoader, store files':<36}{dl_store:>10,.0f}{1.0:>9.3f}")
    print(f"{'DataLoader, direct':<36}{dl_direct:>10,.0f}{dl_direct / dl_store:>9.3f}")
    print(f"{'DataLoader, mount (warm store)':<36}{dl_mount:>10,.0f}{dl_mount / dl_store:>9.3f}")
    print(f"DataLoader: direct ÷ mount = {dl_direct / dl_mount:.2f}x")


if __name__ == "__main__":
    main()
