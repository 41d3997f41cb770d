#!/usr/bin/env python3
"""Co-operative misses: 7 concurrent jobs on a cold cache fetch the dataset about once.

Seven emulated training jobs (separate processes, a real DataLoader each, QuiverBatchSampler)
read one epoch of the same dataset through one mount, starting together on a cold cache that
can hold the whole dataset (``--dataset-mode full``). The bucket is a ``file://`` directory
behind mountd's remote limits. Measured in one run:

* (b) the shim: mountd's remote bytes (``remote_bytes`` of its counters) during the epoch ÷
  the dataset's bytes. Target: <= 1.05 (each file fetched about once; Quiver §5.2, 7.3).
* (c) the baseline: the same 7 jobs reading straight from the bucket with quiverfs's backend
  code and no cache (each job throttled to 1/7 of the same bucket limits): the bytes the
  backends read ÷ the dataset's bytes (7.0 by construction; measured, or from the first
  ``--baseline-batches`` mini-batches of each job when given, scaled to the epoch).

Every job must read every file exactly once in its epoch (checked).

    .venv/bin/python scripts/bench/coop_jobs.py
    .venv/bin/python scripts/bench/coop_jobs.py --scale 2 --jobs 7 --compute 0.05

Needs root and FUSE; everything lives under .bench/ (git-ignored). See docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from harness.cli import add_workload_args, bucket_limits, dataset_spec, preflight  # noqa: E402
from harness.jobs import JobSpec, run_jobs, write_rels  # noqa: E402
from harness.report import RemoteDelta, parameters, summarize, table, verdict  # noqa: E402
from harness.world import (  # noqa: E402
    BENCH,
    MountdConfig,
    World,
    make_dataset,
)

TARGET = 1.05


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_workload_args(parser, jobs=7, files=1400, compute=0.05, remote_files=200.0)
    parser.add_argument("--cache-factor", type=float, default=1.5, help="cache size / dataset bytes (>= 1)")
    parser.add_argument("--baseline-batches", type=int, default=None,
                        help="baseline jobs stop after this many mini-batches (default: the whole epoch)")
    parser.add_argument("--no-baseline", action="store_true", help="compute the baseline as 7.0 instead")
    args = parser.parse_args()
    preflight()

    spec = dataset_spec(args)
    dataset = make_dataset(spec)
    limits = bucket_limits(args, spec)
    bandwidth, requests = limits["remote_bandwidth"], limits["remote_requests"]
    config = MountdConfig(cache_size=int(dataset.total_bytes * args.cache_factor),
                          dataset_mode="full", **limits)
    work = BENCH / "coop_jobs"
    rels_file = write_rels(work / "rels.txt", dataset.rels)

    def job(i: int, reader: str, root: str, **kw) -> JobSpec:
        return JobSpec(name=f"{reader}-{i}", reader=reader, root=root, rels_file=rels_file,
                       file_size=spec.file_size, url=dataset.url, batch_size=args.batch_size,
                       epochs=1, compute_s=args.compute, workers=args.workers, seed=i, **kw)

    with World(dataset, "coop_jobs", config) as world:
        before = world.counters()
        t0 = time.perf_counter()
        shim = run_jobs([job(i, "mount-shim", str(world.mountpoint)) for i in range(args.jobs)],
                        work / "shim")
        shim_wall = time.perf_counter() - t0
        after = world.counters()
        remote = RemoteDelta.between(before, after)
        modes = world.mountd_log_lines("mode ")
    for r in shim:
        if r["files"] != spec.files or r["bytes"] != dataset.total_bytes:
            raise SystemExit(f"job {r['name']} read {r['files']} files ({r['bytes']} bytes), "
                             f"expected every file once ({spec.files})")

    baseline = None
    if not args.no_baseline:
        share = {"bucket_bandwidth": bandwidth / args.jobs / args.workers,
                 "bucket_requests": requests / args.jobs / args.workers}
        baseline = run_jobs([job(i, "bucket", str(dataset.source), batches=args.baseline_batches, **share)
                             for i in range(args.jobs)], work / "baseline")

    s = summarize(shim)
    ratio = remote.bytes / dataset.total_bytes
    rows = [
        ["(b) shim: mountd remote bytes / dataset bytes", ratio, f"<= {TARGET}", verdict(ratio, TARGET)],
        ["    remote GETs / dataset files", remote.gets / spec.files, "", ""],
    ]
    if baseline is not None:
        b = summarize(baseline)
        read_fraction = b["files"] / args.jobs / spec.files  # of one epoch, per job
        base_ratio = b["bytes"] / (dataset.total_bytes * read_fraction)
        how = "measured" if args.baseline_batches is None else f"measured over {read_fraction:.0%} of the epoch"
        rows.append([f"(c) bucket, no cache: remote bytes / dataset bytes ({how})", base_ratio, "(7 jobs: 7.0)", ""])
        rows.append(["    bucket GETs / dataset files", b["bucket_gets"] / spec.files / read_fraction, "", ""])
    else:
        rows.append(["(c) bucket, no cache: remote bytes / dataset bytes (computed)", float(args.jobs), "", ""])

    print()
    print(parameters({
        "jobs": args.jobs, "files": spec.files, "file_size": spec.file_size,
        "dataset_bytes": dataset.total_bytes, "batch_size": args.batch_size, "compute_s": args.compute,
        "workers": args.workers, "epochs": 1, "cache_size": config.cache_size,
        "dataset_mode": config.dataset_mode, "remote_requests/s": requests,
        "remote_bandwidth_B/s": int(bandwidth), "cpus": os.cpu_count(),
    }))
    for line in modes:
        print("mountd:", line.split("INFO ", 1)[-1])
    print()
    print(table(["measure", "value", "target", "result"], rows))
    print()
    runs = [["(b) shim, cold cache", s["mean_batch_s"], s["mean_wait_s"], s["mean_epoch_s"], s["wall_s"]]]
    if baseline is not None:
        runs.append(["(c) bucket, no cache" + ("" if args.baseline_batches is None else " (partial)"),
                     b["mean_batch_s"], b["mean_wait_s"], b["mean_epoch_s"], b["wall_s"]])
    print(table(["run (per job)", "mini-batch s", "data wait s", "epoch s", "slowest job s"], runs))
    print(f"\nshim run: {shim_wall:.1f} s with setup; mountd: {remote.gets} GETs, {remote.bytes:,} bytes, "
          f"{remote.hits} hits, {remote.misses} misses, {remote.prefetches} claim/preload fills")


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        raise SystemExit(130) from None
