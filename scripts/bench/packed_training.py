#!/usr/bin/env python3
"""Small files from a slow bucket with a cache of 20%: loose + LRU, loose + shim, packed + Brand.

Four emulated training jobs (separate processes, a real DataLoader each, a sleep per
mini-batch for compute; harness/jobs.py) read ``--epochs`` epochs of one dataset of small
files (default 2,400 × 16 KiB) through one mount. The cache holds ``--cache-fraction`` (20%)
of the dataset. The bucket is a ``file://`` tree behind mountd's remote limits: a bandwidth
(``--remote-mbps``), requests in flight (``--remote-concurrency``) and a first-byte latency
per request (``--latency-ms``, 20 ms, ``quiverfs mountd --remote-latency-ms``), the knobs
that make one GET per small file latency-bound as on a real bucket. Runs, side by side in
one invocation, each with a fresh mountd and mount:

* **all-hit**: the loose dataset, cache larger than it and filled first: the reference
  mini-batch time;
* **(a) loose + LRU**: ``--dataset-mode lru``, a shuffled sampler (a plain DataLoader);
* **(b) loose + shim**: chunked residency (Quiver), ``QuiverBatchSampler``;
* **(c) packed + Brand**: the same files packed by ``digests pack`` into tar chunks of
  ``--chunk-size`` files (64), chunked residency over whole packed chunks, misses by fill
  rate (docs/substitutable-reads.md "Packed datasets"), one ranged GET per chunk
  (docs/store-layout.md "Chunk fills"), the shim;
* the chunk-size sweep (``--sweep``, default 1 4 16 64 256): (c) again per chunk size,
  Brand's Figures 13/14 (I/O rate and epoch time against chunk size).

Printed per run: mean epoch time, mini-batch time ÷ all-hit, remote bytes ÷ dataset bytes
per epoch, GETs per epoch. Plots (with matplotlib, the ``bench`` extra) go to
``.bench/packed_training/`` and docs/img/ with ``--plots``.

    .venv/bin/python scripts/bench/packed_training.py
    .venv/bin/python scripts/bench/packed_training.py --sweep 1 16 64 --epochs 2 --plots

Needs root and FUSE; everything lives under .bench/ (git-ignored). See docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from harness.cli import add_workload_args, dataset_spec, preflight  # noqa: E402
from harness.jobs import JobSpec, run_jobs, write_rels  # noqa: E402
from harness.report import RemoteDelta, parameters, summarize, table  # noqa: E402
from harness.world import BENCH, Dataset, MountdConfig, World, make_dataset  # noqa: E402

WORK = BENCH / "packed_training"


def packed_dataset(dataset: Dataset, chunk_size: int, seed: int = 0) -> Dataset:
    """``dataset`` packed into tar chunks of ``chunk_size`` files under a ``file://`` bucket of
    its own (once per chunk size; later calls reuse it): the same dataset id and paths."""
    import trio

    from digests.pack import pack

    base = dataset.digest.parent / f"packed-{chunk_size}-s{seed}"
    digest = base / "dataset.qd"
    if not digest.exists():
        base.mkdir(parents=True, exist_ok=True)
        result = trio.run(lambda: pack(dataset.url, "file://" + str(base / "bucket"), digest,
                                       chunk_size=chunk_size, seed=seed, digest=dataset.digest))
        if result.dataset_id != dataset.dataset_id:
            raise SystemExit(f"packing changed the dataset id: {result.dataset_id}")
    return dataclasses.replace(dataset, source=base / "bucket", digest=digest)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_workload_args(parser, jobs=4, files=2400, compute=0.05, remote_files=0)
    parser.set_defaults(file_size=16 * 1024)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--cache-fraction", type=float, default=0.2, help="cache size / dataset bytes")
    parser.add_argument("--latency-ms", type=float, default=20.0, help="first-byte delay per GET")
    parser.add_argument("--remote-mbps", type=float, default=40.0, help="bucket bandwidth, MB/s")
    parser.add_argument("--remote-concurrency", type=int, default=16, help="GETs in flight")
    parser.add_argument("--chunk-size", type=int, default=64, help="files per packed chunk for (c)")
    parser.add_argument("--sweep", type=int, nargs="*", default=[1, 4, 16, 64, 256],
                        help="chunk sizes for the sweep of (c) (none: no sweep)")
    parser.add_argument("--plots", action="store_true", help="write the sweep's plots to docs/img/")
    args = parser.parse_args()
    preflight()

    spec = dataset_spec(args)
    dataset = make_dataset(spec)
    small = int(dataset.total_bytes * args.cache_fraction)
    limits = {"remote_bandwidth": args.remote_mbps * 1e6, "remote_concurrency": args.remote_concurrency,
              "remote_latency_ms": args.latency_ms}
    rels_file = write_rels(WORK / "rels.txt", dataset.rels)

    def jobs(reader: str, root: str) -> list[JobSpec]:
        return [JobSpec(name=f"{reader}-{i}", reader=reader, root=root, rels_file=rels_file,
                        file_size=spec.file_size, batch_size=args.batch_size, epochs=args.epochs,
                        compute_s=args.compute, workers=args.workers, seed=i)
                for i in range(args.jobs)]

    runs: dict[str, tuple[list[dict], RemoteDelta | None]] = {}

    def run(name: str, data: Dataset, config: MountdConfig, reader: str, warm: bool = False) -> None:
        print(f"run {name} ...", flush=True)
        with World(data, f"packed_training-{name}", config) as world:
            if warm:
                world.warm()
            before = world.counters()
            results = run_jobs(jobs(reader, str(world.mountpoint)), WORK / name)
            remote = RemoteDelta.between(before, world.counters())
        for r in results:
            if r["files"] != spec.files * args.epochs:
                raise SystemExit(f"{name}: job {r['name']} read {r['files']} files, expected "
                                 f"{spec.files * args.epochs} (every file once per epoch)")
        runs[name] = (results, remote)

    run("all-hit", dataset, MountdConfig(int(dataset.total_bytes * 1.5), dataset_mode="full", **limits),
        "mount-shuffle", warm=True)
    run("(a) loose + LRU", dataset, MountdConfig(small, dataset_mode="lru", **limits), "mount-shuffle")
    run("(b) loose + shim", dataset, MountdConfig(small, dataset_mode="chunked", **limits), "mount-shim")
    sizes = sorted(set(args.sweep) | {args.chunk_size})
    for size in sizes:
        name = f"(c) packed {size} + Brand"
        run(name, packed_dataset(dataset, size), MountdConfig(small, dataset_mode="chunked", **limits),
            "mount-shim")

    ref = summarize(runs["all-hit"][0])["mean_batch_s"]
    print()
    print(parameters({
        "jobs": args.jobs, "epochs": args.epochs, "files": spec.files, "file_size": spec.file_size,
        "dataset_bytes": dataset.total_bytes, "cache_bytes": small, "cache_fraction": args.cache_fraction,
        "batch_size": args.batch_size, "compute_s": args.compute, "workers": args.workers,
        "latency_ms": args.latency_ms, "remote_MB/s": args.remote_mbps,
        "remote_concurrency": args.remote_concurrency, "cpus": os.cpu_count(),
    }))
    rows = []
    for name, (results, remote) in runs.items():
        s = summarize(results)
        per_epoch = None if remote is None else remote.bytes / dataset.total_bytes / args.epochs
        gets = None if remote is None else remote.gets / args.epochs
        rows.append([name, s["mean_epoch_s"], s["mean_batch_s"] / ref, s["mean_wait_s"],
                     per_epoch, gets])
    print(table(["run", "epoch s", "mini-batch / all-hit", "data wait s",
                 "remote / dataset / epoch", "GETs / epoch"], rows))
    loose = summarize(runs["(b) loose + shim"][0])["mean_epoch_s"]
    packed = summarize(runs[f"(c) packed {args.chunk_size} + Brand"][0])["mean_epoch_s"]
    print(f"epoch time, packed {args.chunk_size} + Brand ÷ loose + shim = {packed / loose:.2f} "
          f"(÷ loose + LRU = {packed / summarize(runs['(a) loose + LRU'][0])['mean_epoch_s']:.2f})")
    if args.plots:
        plot_sweep(runs, sizes, dataset.total_bytes, args.epochs)


def plot_sweep(runs: dict, sizes: list[int], total: int, epochs: int) -> None:
    """Epoch time and GETs per epoch against chunk size (Brand's Figures 13/14)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    epoch_s = [summarize(runs[f"(c) packed {n} + Brand"][0])["mean_epoch_s"] for n in sizes]
    gets = [runs[f"(c) packed {n} + Brand"][1].gets / epochs for n in sizes]
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.5))
    left.plot(sizes, epoch_s, marker="o", label="packed + Brand")
    for name, style in (("(a) loose + LRU", ":"), ("(b) loose + shim", "--")):
        left.axhline(summarize(runs[name][0])["mean_epoch_s"], linestyle=style, color="gray", label=name)
    left.set_xscale("log", base=2)
    left.set_xlabel("files per chunk")
    left.set_ylabel("epoch time (s)")
    left.legend(fontsize=8)
    right.plot(sizes, gets, marker="o")
    right.set_xscale("log", base=2)
    right.set_yscale("log")
    right.set_xlabel("files per chunk")
    right.set_ylabel("GETs per epoch")
    fig.suptitle("packed_training.py: chunk-size sweep (cache 20%, 4 jobs)")
    fig.tight_layout()
    repo = Path(__file__).resolve().parents[2]
    for out in (WORK / "chunk_sweep.png", repo / "docs" / "img" / "packed_chunk_sweep.png"):
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out, dpi=110)
        print(f"plot: {out}")


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        raise SystemExit(130) from None
