#!/usr/bin/env python3
"""Substitutable reads when the dataset does not fit: the shim vs. a shuffled sampler on LRU.

Four emulated training jobs (separate processes, a real DataLoader each, a sleep per
mini-batch for compute) read three epochs of one dataset through one mount; the cache holds
20% of the dataset and the bucket (``file://`` behind mountd's remote limits) is the
bottleneck whenever jobs miss. Three runs, side by side in one invocation, each with a
fresh mountd and mount, their caches on a fresh ext4 of their own (harness/cachefs.py: the
VM's root filesystem makes every fill's file creation several times dearer, and the shim
met its targets more often there; ``--cache-on-root`` keeps the caches on it):

* all-hit: cache larger than the dataset, filled before the jobs start, shuffled sampler —
  the reference mini-batch time (data never waits on the bucket);
* shim: cache = 20%, mountd's default chunked residency (``--dataset-mode chunked``),
  ``QuiverBatchSampler`` (hits first, claimed misses prefetched, jobs share chunks);
* LRU: cache = 20%, ``--dataset-mode lru``, shuffled sampler (what a plain DataLoader gets).

Each job runs as ``--ranks`` processes (default 2, kept in step by an all-reduce per step as
DDP's gradient sync keeps them), and every run prints the order statistics of each job
(quiverfs/testing/order_stats.py): the chi-square p of each file's position over the epochs,
the mean epoch-to-epoch correlation of positions, the 99th percentile over files of the share
of epochs in which a file falls in the first tenth, and the correlation between jobs in the
same epoch (issue 35: the shim's order must look like a fresh shuffle every epoch).

Printed: mean mini-batch time (data wait + compute, over every mini-batch of every job and
epoch) ÷ the all-hit mean, for the shim (target <= 1.3, Quiver §7.5/7.6) and for LRU beside
it, and remote bytes per epoch ÷ the dataset (target <= 1.2 for the shim: the remote serves
about one dataset per epoch whatever the number of jobs; issue 15). ``--file-counts 600,1200``
runs the three worlds for each dataset size and ends with one summary table of the ratios
(issue 15's "shim at 20% cache, 4 jobs, 600 and 1,200 files"). ``--synthetic`` adds a run
with no I/O at all (the upper bound).

    .venv/bin/python scripts/bench/shim_vs_lru.py
    .venv/bin/python scripts/bench/shim_vs_lru.py --file-counts 600,1200
    .venv/bin/python scripts/bench/shim_vs_lru.py --scale 2 --compute 0.2 --remote-files 150

Needs root and FUSE; everything lives under .bench/ (git-ignored). See docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from harness.cachefs import add_cache_on_root, dedicated_cache_fs  # noqa: E402
from harness.cli import add_workload_args, bucket_limits, dataset_spec, preflight  # noqa: E402
from harness.jobs import JobSpec, run_jobs, write_rels  # noqa: E402
from harness.report import (  # noqa: E402
    BucketAccount,
    RemoteDelta,
    epoch_means,
    parameters,
    summarize,
    table,
    verdict,
)
from harness.world import (  # noqa: E402
    BENCH,
    MountdConfig,
    World,
    make_dataset,
)

from quiverfs.testing import order_stats  # noqa: E402

TARGET = 1.3
#: Remote bytes per epoch ÷ dataset bytes the shim may use (issue 15).
REMOTE_TARGET = 1.2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_workload_args(parser, jobs=4, files=1200, compute=0.2, remote_files=150.0)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--ranks", type=int, default=2,
                        help="processes per job (DDP-style ranks, in step by an all-reduce)")
    parser.add_argument("--cache-fraction", type=float, default=0.2, help="cache size / dataset bytes")
    parser.add_argument("--fetch-size", type=int, default=None,
                        help="QuiverBatchSampler's fetch size (default: its own, 4 x batch size "
                             "bounded by mountd's advice)")
    parser.add_argument("--prefetch-factor", type=int, default=2, help="DataLoader batches per worker in flight")
    parser.add_argument("--shim-mode", default="chunked", help="mountd --dataset-mode for the shim run")
    parser.add_argument("--chunk-slots", type=int, default=None, choices=(2, 3),
                        help="mountd --chunk-slots for the shim run (default: mountd's)")
    parser.add_argument("--chunk-grace", type=float, default=None,
                        help="mountd --chunk-grace (s) for the shim run (default: mountd's)")
    parser.add_argument("--skip-lru", action="store_true",
                        help="leave out the LRU run (for sweeps of shim settings)")
    parser.add_argument("--synthetic", action="store_true", help="also run the jobs with no I/O")
    add_cache_on_root(parser)
    parser.add_argument("--file-counts", default=None,
                        help="comma-separated dataset sizes in files (e.g. 600,1200): run the "
                             "worlds for each and print a summary (overrides --files)")
    parser.add_argument("--computes", default=None,
                        help="comma-separated compute seconds per mini-batch (e.g. 0,0.2): run "
                             "the worlds for each, with every --file-counts (overrides --compute)")
    args = parser.parse_args()
    if args.chunk_grace is not None and not args.chunk_grace >= 0:
        parser.error("--chunk-grace must be >= 0 seconds")
    counts = [args.files]
    if args.file_counts:
        try:
            counts = [int(x) for x in args.file_counts.split(",")]
        except ValueError:
            parser.error("--file-counts takes integers separated by commas, e.g. 600,1200")
        if any(c < 10 for c in counts):
            parser.error("--file-counts: at least 10 files per dataset")
    computes = [args.compute]
    if args.computes:
        try:
            computes = [float(x) for x in args.computes.split(",")]
        except ValueError:
            parser.error("--computes takes seconds separated by commas, e.g. 0,0.2")
        if any(c < 0 for c in computes):
            parser.error("--computes: seconds must be >= 0")
    preflight()
    summary = []
    work = BENCH / "shim_vs_lru"
    with dedicated_cache_fs(work / "cachefs", work / "cachefs.img", not args.cache_on_root,
                            fallback=work, say=lambda line: print(line, flush=True)) as caches:
        for compute in computes:
            for files in counts:
                args.files, args.compute = files, compute
                summary.append(bench(args, caches))
    if len(summary) > 1:
        print()
        print("summary (ratios from one run each; noisy on a shared machine):")
        print(table(["files", "compute s", "shim / all-hit", "lru / all-hit", "shim remote/epoch",
                     "lru remote/epoch", "batch <= 1.3", "remote <= 1.2", "remote <= lru",
                     "order fair"], summary))


def _sampler_fetch(results: list[dict], args: argparse.Namespace) -> str:
    """The fetch size the shim's samplers ended with at their default: 4 × batch, bounded by
    mountd's advice for a chunked dataset (QuiverBatchSampler.fetch_now)."""
    used = sorted({r["fetch_size"] for r in results if r.get("fetch_size") is not None})
    return f"default {4 * args.batch_size}, used {'/'.join(map(str, used)) or '?'}"


def bench(args: argparse.Namespace, caches: Path) -> list:
    """One dataset size: the all-hit, shim and LRU worlds side by side, each with its cache
    under ``caches``; prints their table and returns the summary row."""
    spec = dataset_spec(args)
    dataset = make_dataset(spec)
    limits = bucket_limits(args, spec)
    bandwidth, requests = limits["remote_bandwidth"], limits["remote_requests"]
    small = int(dataset.total_bytes * args.cache_fraction)
    work = BENCH / "shim_vs_lru"
    rels_file = write_rels(work / "rels.txt", dataset.rels)

    def jobs(reader: str, root: str) -> list[JobSpec]:
        for stale in work.glob("rendezvous-*"):
            stale.unlink()
        return [JobSpec(name=f"{reader}-{i}-r{rank}", job=f"{reader}-{i}", reader=reader,
                        root=root, rels_file=rels_file, file_size=spec.file_size,
                        batch_size=args.batch_size, epochs=args.epochs, compute_s=args.compute,
                        workers=args.workers, seed=1000 * i, prefetch_factor=args.prefetch_factor,
                        fetch_size=args.fetch_size, rank=rank, world_size=args.ranks,
                        rendezvous=str(work / f"rendezvous-{reader}-{i}"), record_order=True)
                for i in range(args.jobs) for rank in range(args.ranks)]

    runs: dict[str, tuple[list[dict], RemoteDelta | None, MountdConfig | None, list[str]]] = {}

    def run(name: str, config: MountdConfig, reader: str, warm: bool = False) -> None:
        cache_dir = caches / f"shim_vs_lru-{name}"
        with World(dataset, f"shim_vs_lru-{name}", config, cache_dir=cache_dir) as world:
            if warm:
                world.warm()
            before, protection = world.counters(), world.protection()
            results = run_jobs(jobs(reader, str(world.mountpoint)), work / name)
            remote = RemoteDelta.between(before, world.counters())
            account = BucketAccount.of(remote, protection, world.protection())
            notes = [line.split("INFO ", 1)[-1] for line in world.mountd_log_lines("mountd.coop.service")
                     if "mode" in line]
            notes.append(f"{len(world.mountd_log_lines('evicted chunk'))} chunk evictions, "
                         f"{len(world.mountd_log_lines('loading chunk'))} chunk loads")
            if name != "all-hit":
                notes.append("bucket reads, datasets per epoch: "
                             + account.line(spec.files * args.epochs))
        shutil.rmtree(cache_dir, ignore_errors=True)
        runs[name] = (results, remote, config, notes)

    run("all-hit", MountdConfig(int(dataset.total_bytes * 1.5), dataset_mode="full", **limits),
        "mount-shuffle", warm=True)
    run("shim", MountdConfig(small, dataset_mode=args.shim_mode, chunk_slots=args.chunk_slots,
                             chunk_grace=args.chunk_grace, **limits), "mount-shim")
    if not args.skip_lru:
        run("lru", MountdConfig(small, dataset_mode="lru", **limits), "mount-shuffle")
    if args.synthetic:
        runs["synthetic"] = (run_jobs(jobs("synthetic", str(dataset.source)), work / "synthetic"),
                             None, None, [])

    orders: dict[str, list[list[dict[int, int]]]] = {}
    #: per run, each job's epoch starts (rank 0's), then its last epoch's end
    epoch_starts: dict[str, list[list[float]]] = {}
    for name, (results, _, _, _) in runs.items():
        orders[name] = []
        epoch_starts[name] = []
        for job in dict.fromkeys(r["job"] for r in results):
            ranks = sorted((r for r in results if r["job"] == job), key=lambda r: r["rank"])
            epochs = []
            for e in range(args.epochs):
                batches = [r["epochs"][e]["order"] for r in ranks]
                missing, repeated = order_stats.exactly_once(batches, spec.files)
                if missing or (repeated and spec.files % (args.ranks * args.batch_size) == 0):
                    raise SystemExit(f"{name}: job {job} epoch {e}: {missing} files unread, "
                                     f"{repeated} read twice (every file once per epoch)")
                epochs.append(order_stats.epoch_positions(batches))
            orders[name].append(epochs)
            times = ranks[0]["epochs"]
            epoch_starts[name].append([e["started_at"] for e in times] + [times[-1]["ended_at"]])

    ref = summarize(runs["all-hit"][0])["mean_batch_s"]
    # files/s one job (all its ranks, a batch each per step) reads when data never waits
    # (no compute: as fast as data comes)
    demand = args.ranks * args.batch_size / args.compute if args.compute > 0 else float("inf")
    print()
    print(parameters({
        "jobs": args.jobs, "epochs": args.epochs, "files": spec.files, "file_size": spec.file_size,
        "dataset_bytes": dataset.total_bytes, "cache_bytes": small, "cache_fraction": args.cache_fraction,
        "batch_size": args.batch_size, "compute_s": args.compute, "workers": args.workers,
        "prefetch_factor": args.prefetch_factor, "fetch_size": args.fetch_size or _sampler_fetch(runs["shim"][0], args),
        "remote_requests/s": requests, "remote_bandwidth_B/s": int(bandwidth),
        "bucket/one job's demand": round(requests / demand, 2) if requests else "unlimited",
        "ranks": args.ranks, "shim_mode": args.shim_mode,
        "chunk_slots": args.chunk_slots or "mountd's", "chunk_grace_s": (
            "mountd's" if args.chunk_grace is None else args.chunk_grace),
        "cpus": os.cpu_count(),
    }))
    for name, (_, _, _, notes) in runs.items():
        for note in notes:
            print(f"mountd ({name}): {note}")
    print()
    rows = []
    ratios: dict[str, tuple[float, float | None]] = {}
    for name, (results, remote, _, _) in runs.items():
        s = summarize(results)
        ratio = s["mean_batch_s"] / ref
        per_epoch_remote = (None if remote is None
                            else remote.bytes / dataset.total_bytes / args.epochs)
        ratios[name] = (ratio, per_epoch_remote)
        target, result = "", ""
        if name == "shim":
            target = f"<= {TARGET}, <= {REMOTE_TARGET}"
            ok = ratio <= TARGET and per_epoch_remote is not None and per_epoch_remote <= REMOTE_TARGET
            result = "PASS" if ok else "FAIL"
        elif name == "lru":
            target = "(beside)"
        per_epoch = " ".join(f"{x / ref:.2f}" for x in epoch_means(results))
        remote_ratio = "" if per_epoch_remote is None else f"{per_epoch_remote:.2f}"
        misses = "" if remote is None else f"{remote.misses / args.epochs / spec.files:.2f}"
        rows.append([name, s["mean_batch_s"], s["mean_wait_s"], ratio, per_epoch, remote_ratio,
                     misses, s["mean_epoch_s"], target, result])
    print(table(["run", "mini-batch s", "data wait s", "/ all-hit", "per epoch / all-hit",
                 "remote/dataset/epoch", "waited misses/N/epoch", "epoch s", "target",
                 "result"], rows))
    print()
    print("order across epochs, per job (a fair shuffle: p > 0.01, |r| < 0.1, first tenth ~0.2-0.4;")
    print("phase: how far behind job 0 its epochs start after the first, a fraction of an epoch:")
    print("jobs out of phase couple their orders, docs/substitutable-reads.md 'Jobs out of phase'):")
    order_rows = []
    for name, jobs_epochs in orders.items():
        if name == "synthetic":
            continue
        starts = epoch_starts[name]
        for k, epochs in enumerate(jobs_epochs):
            cross = (order_stats.cross_correlation(jobs_epochs[0], epochs) if k else None)
            phase = order_stats.phase_offset(starts[0], starts[k]) if k else None
            order_rows.append([name, k, order_stats.position_chi2_p(epochs, spec.files),
                               order_stats.mean_lag_correlation(epochs),
                               order_stats.early_share_quantile(epochs, spec.files),
                               "" if cross is None else f"{cross:+.3f}",
                               "" if phase is None or phase != phase else f"{phase:+.2f}"])
    print(table(["run", "job", "chi-square p", "epoch-to-epoch r", "first tenth (p99)",
                 "r with job 0", "phase vs job 0"], order_rows))
    shim_orders = orders["shim"]
    shim_fair = all(order_stats.position_chi2_p(e, spec.files) > 0.001
                    and abs(order_stats.mean_lag_correlation(e)) < 0.1 for e in shim_orders)
    shim, lru = ratios["shim"], ratios.get("lru", (float("nan"), None))
    below_lru = lru[1] is None or (shim[1] or 0.0) <= lru[1]
    print(f"shim order a fresh shuffle (every job: p > 0.001, |r| < 0.1): "
          f"{'PASS' if shim_fair else 'FAIL'}; shim remote <= LRU's: {'PASS' if below_lru else 'FAIL'}")
    return [spec.files, args.compute, shim[0], lru[0], shim[1], lru[1] if lru[1] is not None else "",
            verdict(shim[0], TARGET), verdict(shim[1] or 0.0, REMOTE_TARGET),
            "PASS" if below_lru else "FAIL", "PASS" if shim_fair else "FAIL"]


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        raise SystemExit(130) from None
