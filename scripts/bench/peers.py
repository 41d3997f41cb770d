#!/usr/bin/env python3
"""Side by side with what users would pick instead: quiverfs and other loaders on one dataset.

One JPEG dataset in ImageFolder layout (default 20,000 files, ~110 KB each with a realistic
spread; ``--quick``: 2,000) in a local S3-compatible bucket that is not the bottleneck for
reads (nginx serves object GETs with ``sendfile`` after an injected ``--latency-ms`` delay, a
small S3 server of ours answers listings and writes: scripts/bench/peers/source.py); one
training-like loop for every contender (``DataLoader`` with ``--workers`` workers, PIL decode
+ RandomResizedCrop/flip/normalize, ``--compute`` seconds of sleep per batch); contenders
(scripts/bench/peers/contenders.py): quiverfs (mount + ImageFolder, mount + QuiverBatchSampler,
DirectDataset + shim, and the last on a ``digests pack`` copy), s3torchconnector (map and iterable), litdata, mosaicml-streaming and a
plain boto3 Dataset. Scenarios:

  a  one job, each cache larger than the dataset
  b  one job, each cache limited to 20% of the dataset where the tool has a limit (quiverfs
     ``--cache-size``, litdata ``max_cache_size``, streaming ``cache_limit``); the tools
     without a cache read the bucket every epoch as in (a), and their (a) rows are reused.
     Chunked copies are sized for that cache as their tools ask: litdata gets a second
     conversion whose chunks fit its peak-cache rule (contenders.litdata_chunk_for_cache),
     the packed copy is packed in chunks of at most 5% of it (mountd's warning)
  c  three jobs on the same dataset at once, caches as in (a)

For each row: epoch 0 (cold) and epoch 1 images/s per job, bucket GETs and bytes per epoch
(from the bucket's access log), peak disk of the tool's cache, peak memory of its processes
(jobs and DataLoader workers; for quiverfs rows also mountd and the mount with their
children: summed RSS, and summed PSS, which counts pages shared by forked workers once),
the job's own set-up time, and what limited it: the bucket server (near the capacity the
run measured with a light client at its start), the CPU (machine busy >= 90%), or waiting on
the bucket's latency. Before the rows: each contender's set-up step (digest build, litdata
optimize, MDS conversion) with its time and bucket traffic. Then the issue's targets as
PASS/FAIL lines. Rates are the best of ``--rounds`` rounds (the machine is shared and noisy).

The contenders come from the ``peers`` extra; a contender whose package is missing is left out
with one line saying how to install it. ``--contenders`` and ``--scenarios`` pick a subset.

    .venv/bin/python scripts/bench/peers.py --quick             # ~13 minutes on 2 quiet cores
    .venv/bin/python scripts/bench/peers.py                     # 20,000 files: hours
    .venv/bin/python scripts/bench/peers.py --quick --scenarios a --contenders qfs-shim,litdata

Needs root and FUSE for the quiverfs rows, nginx with its echo module for the bucket
(``apt-get install -y nginx-light libnginx-mod-http-echo``; without it, ``--no-nginx`` uses
the slower Python server alone). Everything lives under .bench/peers/ (git-ignored); every
contender's cache on a fresh ext4 the run mounts there (harness/cachefs.py says why;
``--cache-on-root`` keeps them on the repository's filesystem).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO))

from harness.cachefs import IMAGE_BYTES, add_cache_on_root, dedicated_cache_fs  # noqa: E402
from harness.report import BucketAccount, RemoteDelta, parameters, table  # noqa: E402
from harness.world import Dataset as WorldDataset  # noqa: E402
from harness.world import DatasetSpec, MountdConfig, World, sigterm_as_interrupt  # noqa: E402
from peers.contenders import (  # noqa: E402
    CONTENDERS,
    LITDATA_CHUNKS_PER_WORKER,
    SetupResult,
    chunk_bytes_for,
    litdata_chunk_for_cache,
    packed_files_for_cache,
    s3_env,
    setup_litdata,
    setup_mds,
)
from peers.images import ImageSpec, make_images  # noqa: E402
from peers.job import JobFailed, run_jobs  # noqa: E402
from peers.monitor import Monitor  # noqa: E402
from peers.report import Row, markdown, markdown_table, modes_of, scenario_table, verdicts  # noqa: E402
from peers.source import Source, count, nginx_available, probe  # noqa: E402

WORK = REPO / ".bench" / "peers"
BUCKET, PREFIX, LITDATA_PREFIX, MDS_PREFIX = "peers", "train", "litdata", "mds"
#: litdata's conversion for scenario b (chunks sized for its cache) and the packed copy
LITDATA_B_PREFIX, PACKED_PREFIX = "litdata-b", "packed"
CONVERTED = (LITDATA_PREFIX, LITDATA_B_PREFIX, MDS_PREFIX, PACKED_PREFIX)
INSTALL = ".venv/bin/pip install -e '.[peers]'"
SCENARIOS = {"a": "one job, cache larger than the dataset",
             "b": "one job, cache 20% of the dataset",
             "c": "three jobs on the same dataset at once, caches larger than the dataset"}
#: Bucket rates at or above this share of the probed capacity mean the server limits a row.
SERVER_BOUND = 0.7
#: Machine CPU busy at or above this means the CPU limits a row.
CPU_BOUND = 0.9


def cache_fs_bytes(dataset_bytes: int, jobs: int) -> int:
    """The caches' filesystem: room for one contender's caches (each round's are removed
    when it ends), ``jobs`` datasets and one more, with a quarter to spare. In (c) a loader whose jobs each keep a local copy
    (streaming) holds ``jobs`` datasets at once. At the default 20,000 files, those three
    copies beside the two quiverfs rows' caches left behind filled the fixed 8 GiB, and its
    jobs failed with ENOSPC. The image is sparse: only what the caches write is used."""
    return max(IMAGE_BYTES, int((jobs + 1) * dataset_bytes * 1.25))


def say(message: str) -> None:
    print(f"[peers] {message}", file=sys.stderr, flush=True)


# -- the world of one run -------------------------------------------------------------------


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.root = WORK / "bucket-root"
        #: Where every contender's cache lives (main() mounts a filesystem of their own).
        self.caches = WORK / "caches"
        self.env = {k: v for k, v in os.environ.items()
                    if not k.startswith("AWS_") and k not in ("S3_ENDPOINT_URL",)}
        self.env["LITDATA_DISABLE_VERSION_CHECK"] = "1"  # a PyPI request at every dataset
        self.rows: dict[tuple[str, str], Row] = {}
        self.setups: dict[str, SetupResult] = {}
        self.digest: Path | None = None
        #: the packed copy's digest (``qfs-packed``)
        self.packed_digest: Path | None = None
        #: contender → why its set-up failed (its rows are then marked failed)
        self.failed: dict[str, str] = {}

    # -- set-up ---------------------------------------------------------------------------------

    def setup(self, source: Source, data, scenarios: list[str]) -> None:
        env = self.env | s3_env(source.endpoint)
        self.env = env
        os.environ.update(s3_env(source.endpoint))
        wanted = self.args.contenders
        keys, labels = data.keys, [data.classes.index(r.split("/", 1)[0]) for r in data.rels]
        chunk = self.chunk_bytes = chunk_bytes_for(data.total_bytes)
        if any(CONTENDERS[c].quiverfs for c in wanted):
            self._measured(source, "quiverfs", lambda: self._digest(source))
        if "qfs-packed" in wanted and "quiverfs" not in self.failed:
            self._measured(source, "qfs-packed", lambda: self._pack(data), stored=PACKED_PREFIX)
        if "litdata" in wanted and scenarios != ["b"]:
            self._measured(source, "litdata", lambda: setup_litdata(
                source.endpoint, BUCKET, keys, labels, LITDATA_PREFIX, chunk, self.args.convert_workers,
                str(WORK / "convert")), stored=LITDATA_PREFIX)
        if "litdata" in wanted and "b" in scenarios:
            b_chunk = self.litdata_b_chunk(data)
            self._measured(source, "litdata (b)", lambda: setup_litdata(
                source.endpoint, BUCKET, keys, labels, LITDATA_B_PREFIX, b_chunk, self.args.convert_workers,
                str(WORK / "convert-b")), stored=LITDATA_B_PREFIX)
        if "mosaic" in wanted:
            self._measured(source, "mosaic", lambda: setup_mds(
                source.endpoint, BUCKET, keys, labels, MDS_PREFIX, chunk), stored=MDS_PREFIX)

    def clear_conversions(self) -> None:
        """Remove the converted copies of an earlier run (before the bucket is served: the
        server's listing must not hold them), so that this run's set-up is measured whole."""
        for prefix in CONVERTED:
            shutil.rmtree(self.root / BUCKET / prefix, ignore_errors=True)
        for folder in ("convert", "convert-b"):
            shutil.rmtree(WORK / folder, ignore_errors=True)

    def cache_b(self, data) -> int:
        """Every cache's limit in scenario b."""
        return int(data.total_bytes * self.args.cache_fraction)

    def litdata_b_chunk(self, data) -> int:
        """litdata's chunk size for its (b) conversion (contenders.litdata_chunk_for_cache)."""
        return litdata_chunk_for_cache(self.cache_b(data), self.args.workers, chunk_bytes_for(data.total_bytes))

    def packed_files(self, data) -> int:
        """Files per packed chunk for ``qfs-packed``: sized for the (b) cache by the share
        mountd warns above (contenders.packed_files_for_cache)."""
        from mountd.coop.service import PACKED_CHUNK_WARN_SHARE

        return packed_files_for_cache(self.cache_b(data), data.total_bytes / data.spec.files,
                                      PACKED_CHUNK_WARN_SHARE)

    def _measured(self, source: Source, name: str, step, stored: str | None = None) -> None:
        say(f"set-up of {name}")
        mark = source.mark()
        try:
            result: SetupResult = step()
        except Exception as exc:  # noqa: BLE001 - a contender's failure is its row's, not the run's
            self.failed[name] = f"set-up failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
            say(f"{name}: {self.failed[name]}")
            return
        c = count(source.requests(mark))
        result.bucket = {"gets": c.gets, "get_bytes": c.get_bytes, "lists": c.lists, "writes": c.writes,
                         "write_bytes": c.write_bytes, "heads": c.heads}
        if stored:
            base = self.root / BUCKET / stored
            files = [p for p in base.rglob("*") if p.is_file()]
            result.stored_bytes = sum(p.stat().st_size for p in files)
            result.objects = len(files)
        self.setups[name] = result

    def _digest(self, source: Source) -> SetupResult:
        import trio

        from digests.build import build
        from quiverfs.base.backends.settings import RemoteSettings

        digest = WORK / "dataset.qd"
        for old in WORK.glob("dataset.qd*"):
            old.unlink()
        started = time.perf_counter()
        settings = RemoteSettings.from_environ(self.env)
        trio.run(lambda: build(f"s3://{BUCKET}/{PREFIX}", digest, settings=settings))
        seconds = time.perf_counter() - started
        self.digest = digest
        return SetupResult("digests build", seconds, notes=f"digest {digest.stat().st_size / 1e6:.1f} MB, local")

    def _pack(self, data) -> SetupResult:
        """``digests pack`` of the dataset into the bucket, from the loose digest (nothing
        hashed again), in chunks sized for the (b) cache (:meth:`packed_files`)."""
        import trio

        from digests.pack import pack
        from quiverfs.base.backends.settings import RemoteSettings

        out = WORK / "packed.qd"
        for old in WORK.glob("packed.qd*"):
            old.unlink()
        files = self.packed_files(data)
        started = time.perf_counter()
        settings = RemoteSettings.from_environ(self.env)
        trio.run(lambda: pack(f"s3://{BUCKET}/{PREFIX}", f"s3://{BUCKET}/{PACKED_PREFIX}", out,
                              chunk_size=files, seed=0, digest=self.digest, settings=settings))
        self.packed_digest = out
        return SetupResult("digests pack", time.perf_counter() - started,
                           notes=f"{files} files a chunk, seed 0, from the loose digest")

    # -- one row --------------------------------------------------------------------------------

    def run_row(self, source: Source, data, scenario: str, name: str) -> None:
        c = CONTENDERS[name]
        jobs = self.args.jobs if scenario == "c" else 1
        cache_bytes = self.cache_b(data) if scenario == "b" else None
        row = self.rows.setdefault((scenario, name), Row(scenario, name, jobs))
        for setup_of in setup_steps(name, scenario):
            if setup_of in self.failed:
                row.error = self.failed[setup_of]
                return
        for r in range(self.args.rounds):
            say(f"({scenario}) {name}, round {r + 1}/{self.args.rounds}")
            try:
                self._round(source, data, scenario, c, jobs, cache_bytes, row)
            except (JobFailed, RuntimeError) as exc:
                say(f"({scenario}) {name} failed: {exc}")
                if not row.rounds:
                    row.error = str(exc).splitlines()[0]
                break

    def _round(self, source: Source, data, scenario: str, c, jobs: int, cache_bytes: int | None,
               row: Row) -> None:
        work = WORK / "runs" / f"{scenario}-{c.name}"
        caches = self.caches / c.name
        shutil.rmtree(caches, ignore_errors=True)
        caches.mkdir(parents=True)
        specs = []
        for j in range(jobs):
            cache_dir = caches / (f"job{j}" if c.name == "mosaic" else "shared")  # see contenders.py
            specs.append({
                "name": f"{c.name}-{j}", "contender": c.name, "epochs": self.args.epochs,
                "batch_size": self.args.batch_size, "workers": self.args.workers, "compute_s": self.args.compute,
                "seed": j, "endpoint": source.endpoint, "bucket": BUCKET, "prefix": PREFIX,
                "litdata_prefix": LITDATA_B_PREFIX if scenario == "b" else LITDATA_PREFIX,
                "mds_prefix": MDS_PREFIX, "cache_dir": str(cache_dir),
                "cache_bytes": cache_bytes, "root": "",
            })
        timeout = 300 + data.spec.files * self.args.epochs * jobs / 20
        world = None
        disk_paths = [str(caches)]
        if c.quiverfs:
            size = cache_bytes or 2 * data.total_bytes
            digest = self.packed_digest if c.name == "qfs-packed" else self.digest
            dataset = WorldDataset(DatasetSpec(files=data.spec.files), self.root / BUCKET / PREFIX, digest,
                                   "", tuple(data.rels), data.total_bytes)
            world = World(dataset, f"peers-{c.name}", MountdConfig(cache_size=size), root=WORK / "worlds",
                          env=self.env, cache_dir=caches / "mountd")
            disk_paths = [str(caches / "mountd")]
        # The caches' own filesystem holds nothing but this round's caches: the disk they use
        # is its used blocks, with no walk over their files (scripts/bench/peers/monitor.py).
        own_fs = str(self.caches) if os.path.ismount(self.caches) else None
        monitor = Monitor(disk_paths, source.pids(), filesystem=own_fs)
        try:
            if world is not None:
                world.start()
                for spec in specs:
                    spec["root"] = str(world.mountpoint)
                monitor.watch("daemons", [world.mountd.pid, world.mount.pid])
            mark = source.mark()
            monitor.start()
            # mosaicml-streaming's datasets pick a shared-memory name in set-up by looking for a
            # free one and then creating it: three jobs set up at once can pick the same one,
            # and all but one fail ("File exists: '/000025_locals'", 2026-11-29). Their set-up
            # runs one after another; their epochs still start together.
            results = run_jobs(specs, work, self.env, timeout,
                               on_start=lambda pids: monitor.watch("jobs", pids),
                               one_by_one=c.name == "mosaic")
            peaks = monitor.stop()
            say(f"({scenario}) {c.name}: the monitor took {peaks.monitor_cpu:.1f} s of CPU")
            records = source.requests(mark)
            account = None if world is None else mountd_account(world, data.spec.files)
        finally:
            if monitor._thread.is_alive():
                monitor.stop()
            if world is not None:
                world.stop()
            # Its peak is measured: the next contender starts on an empty filesystem.
            shutil.rmtree(caches, ignore_errors=True)
        better = self._score(row, results, records, peaks, data, cache_bytes)
        if better and account is not None:
            row.mountd = account

    def _score(self, row: Row, results: list[dict[str, Any]], records, peaks, data, cache_bytes) -> bool:
        """Score a round into ``row``; True when it is the row's best so far (its figures kept)."""
        epochs = self.args.epochs
        starts = [min(r["epochs"][e]["start"] for r in results) for e in range(epochs)]
        ends = [max(r["epochs"][e]["end"] for r in results) for e in range(epochs)]
        # windows: [start of epoch 0, last job's end of epoch 0), [that, last job's end of epoch 1), ...
        bounds = [starts[0]] + ends
        windows = [count(records, bounds[e], bounds[e + 1]) for e in range(epochs)]
        before = count(records, None, starts[0])
        total = count(records)
        rates = [sum(r["epochs"][e]["images"] / (r["epochs"][e]["end"] - r["epochs"][e]["start"])
                     for r in results) / len(results) for e in range(epochs)]
        overall = sum(sum(e["images"] for e in r["epochs"]) / sum(e["end"] - e["start"] for e in r["epochs"])
                      for r in results) / len(results)
        images = [sum(r["epochs"][e]["images"] for r in results) for e in range(epochs)]
        limits = []
        for e in range(epochs):
            span = max(1e-9, bounds[e + 1] - bounds[e])
            busy, server = peaks.cpu_between(bounds[e], bounds[e + 1])
            limits.append(self._limit(windows[e].gets / span, windows[e].get_bytes / span, busy, server,
                                      windows[e].gets))
        better = not row.rounds or overall > row.overall
        row.rounds += 1
        row.rates = [max(a, b) for a, b in zip(row.rates, rates, strict=True)] if row.rates else rates
        if better:
            row.overall = overall
            row.gets = [w.gets for w in windows]
            row.get_bytes = [w.get_bytes for w in windows]
            row.setup_gets, row.setup_lists = before.gets, before.lists
            row.total_gets, row.total_bytes = total.gets, total.get_bytes
            row.images = images
            row.job_setup_s = max(r["setup_s"] for r in results)
            row.disk_peak = peaks.disk
            row.rss_jobs, row.pss_jobs = peaks.rss.get("jobs", 0), peaks.pss.get("jobs", 0)
            row.rss_daemons, row.pss_daemons = peaks.rss.get("daemons", 0), peaks.pss.get("daemons", 0)
            row.limits = limits
        expected = data.spec.files * len(results)
        short = [n for n in images if n != expected]
        if short:
            row.note = f"(images per epoch {images}, expected {expected})"
        return better

    def _limit(self, gets_s: float, bytes_s: float, busy: float | None, server: float | None, gets: int) -> str:
        cap = self.capacity
        cpu = "" if busy is None else f"CPU {busy:.0%}"
        if cap is not None and gets and (gets_s >= SERVER_BOUND * cap.gets_per_s
                                          or bytes_s >= SERVER_BOUND * cap.bytes_per_s):
            return f"server ({gets_s:,.0f} GET/s of {cap.gets_per_s:,.0f}); {cpu}"
        if busy is not None and busy >= CPU_BOUND:
            return f"CPU ({busy:.0%} busy; {gets_s:,.0f} GET/s)"
        if gets:
            return f"bucket latency ({gets_s:,.0f} GET/s; {cpu})"
        return f"loader ({cpu}, no GETs)"


def mountd_account(world: World, files: int) -> str:
    """What mountd says of a quiverfs row's run: its bucket reads in datasets (on demand,
    chunk loads, fetched ahead and what of that was read or dropped unread) and the modes
    its dataset went through (docs/substitutable-reads.md), e.g. ``1.96 = on demand 0.16 +
    ...; modes chunked, off``."""
    account = BucketAccount.of(RemoteDelta.since_start(world.counters()), {}, world.protection())
    modes = modes_of(world.mountd_log_lines(": mode "))
    return account.line(files) + ("; modes " + ", ".join(modes) if modes else "")


# -- main ------------------------------------------------------------------------------------------


def setup_steps(name: str, scenario: str) -> list[str]:
    """The set-up steps (names in :meth:`Bench.setup`) a row of ``name`` in ``scenario`` needs."""
    if name == "qfs-packed":
        return ["quiverfs", "qfs-packed"]
    if CONTENDERS[name].quiverfs:
        return ["quiverfs"]
    if name == "litdata" and scenario == "b":
        return ["litdata (b)"]
    return [name]


def check_contenders(names: list[str]) -> list[str]:
    """The contenders whose packages import here; one line for each left out."""
    ok = []
    for name in names:
        c = CONTENDERS[name]
        missing = [m for m in c.modules if importlib.util.find_spec(m) is None]
        if missing:
            say(f"{name} left out: {', '.join(missing)} not installed (install the peers extra: {INSTALL})")
            continue
        if c.quiverfs and (os.geteuid() != 0 or not os.path.exists("/dev/fuse")):
            say(f"{name} left out: quiverfs mounts need root and /dev/fuse")
            continue
        ok.append(name)
    return ok


def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for dist in ("torch", "torchvision", "s3torchconnector", "litdata", "mosaicml-streaming", "boto3", "obstore"):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            out[dist] = "-"
    try:
        nginx = subprocess.run(["nginx", "-v"], capture_output=True, text=True).stderr.strip().split("/")[-1]
    except OSError:
        nginx = "-"
    out["nginx"] = nginx
    return out


def configurations(args: argparse.Namespace, bench: Bench, data, names: list[str]) -> list[str]:
    """One line per contender: what it was given."""
    loader = f"batch {args.batch_size}, {args.workers} workers"
    limit = bench.cache_b(data)
    chunk = getattr(bench, "chunk_bytes", chunk_bytes_for(data.total_bytes))
    b_chunk = bench.litdata_b_chunk(data)
    lines = {
        "qfs-mount": f"quiverfs mount (defaults), ImageFolder, DataLoader(shuffle=True, {loader}, persistent); "
                     f"mountd --cache-size 2x dataset, (b) {limit:,} B; digest of s3://{BUCKET}/{PREFIX}",
        "qfs-shim": "as qfs-mount, QuiverBatchSampler(batch_size, report_lag=workers x 2) as batch_sampler",
        "qfs-direct": "as qfs-shim, DirectDataset.of(ImageFolder(mount)) (store files read directly)",
        "qfs-packed": f"as qfs-direct on digests pack --chunk-size {bench.packed_files(data)} (chunks <= 5% of the "
                      f"(b) cache, as mountd's warning asks) to s3://{BUCKET}/{PACKED_PREFIX}",
        "s3tc-map": f"S3MapDataset.from_prefix(s3://{BUCKET}/{PREFIX}/, endpoint, "
                    f"S3ClientConfig(force_path_style=True), sequential reader), DataLoader(shuffle=True, {loader})",
        "s3tc-iter": "S3IterableDataset.from_prefix(..., enable_sharding=True), same client config, "
                     f"DataLoader({loader}), no shuffle",
        "litdata": f"optimize(chunk_bytes={chunk:,}, {args.convert_workers} workers) to s3://{BUCKET}/{LITDATA_PREFIX}, "
                   f"for (b) chunk_bytes={b_chunk:,} ({args.workers} workers x {LITDATA_CHUNKS_PER_WORKER} chunks fit its cache) to "
                   f"s3://{BUCKET}/{LITDATA_B_PREFIX}; StreamingDataset(shuffle=True, cache_dir shared by the jobs, "
                   f"max_cache_size default / (b) {limit:,} B, max_pre_download 2), StreamingDataLoader({loader})",
        "mosaic": f"MDSWriter(size_limit={chunk:,}, no compression) to s3://{BUCKET}/{MDS_PREFIX}; "
                  f"StreamingDataset(shuffle=True (py1e), batch_size, local per job, cache_limit none / (b) "
                  f"{limit:,} B, predownload 8 x batch), DataLoader({loader}, persistent)",
        "boto3": f"one get_object per item, a client per worker, DataLoader(shuffle=True, {loader}, persistent)",
    }
    return [f"  {name:10s} {lines[name]}" for name in names]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--quick", action="store_true", help="2,000 files in 20 classes")
    parser.add_argument("--files", type=int, default=None, help="files in the dataset (default 20,000)")
    parser.add_argument("--classes", type=int, default=None, help="class folders (default files / 200, <= 100)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--workers", type=int, default=4, help="DataLoader workers per job, every contender")
    parser.add_argument("--compute", type=float, default=0.0, help="seconds of compute per batch")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--jobs", type=int, default=3, help="jobs at once in scenario c")
    parser.add_argument("--cache-fraction", type=float, default=0.2, help="cache / dataset in scenario b")
    parser.add_argument("--latency-ms", type=float, default=20.0, help="bucket delay before each answer")
    parser.add_argument("--rounds", type=int, default=1, help="rounds per row; rates are the best")
    parser.add_argument("--scenarios", default="a,b,c")
    parser.add_argument("--contenders", default=",".join(CONTENDERS))
    parser.add_argument("--convert-workers", type=int, default=4, help="litdata optimize's num_workers")
    parser.add_argument("--no-nginx", action="store_true", help="serve the bucket with the Python server alone")
    parser.add_argument("--markdown", type=Path, default=None, help="also write the tables as markdown here")
    add_cache_on_root(parser, "every contender's cache")
    args = parser.parse_args()
    files = args.files or (2_000 if args.quick else 20_000)
    classes = args.classes or max(2, min(100, files // 100))
    args.contenders = [c.strip() for c in args.contenders.split(",") if c.strip()]
    unknown = [c for c in args.contenders if c not in CONTENDERS]
    if unknown:
        parser.error(f"unknown contenders {unknown}; known: {', '.join(CONTENDERS)}")
    scenarios = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    if any(s not in SCENARIOS for s in scenarios):
        parser.error("--scenarios takes a, b and c")
    if not args.no_nginx and (missing := nginx_available()):
        raise SystemExit(f"peers.py: {missing}, or run with --no-nginx (slower bucket)")
    sigterm_as_interrupt()
    args.contenders = check_contenders(args.contenders)
    if not args.contenders:
        raise SystemExit(f"peers.py: no contender can run here (install the peers extra: {INSTALL})")

    bench = Bench(args)
    data = make_images(ImageSpec(files=files, classes=classes), bench.root / BUCKET, PREFIX, progress=say)
    bench.clear_conversions()
    started = time.time()
    with dedicated_cache_fs(bench.caches, WORK / "caches.img", not args.cache_on_root,
                            fallback=bench.caches, say=say,
                            size=cache_fs_bytes(data.total_bytes, args.jobs)) as bench.caches, \
            Source(bench.root, WORK / "source", latency_ms=args.latency_ms, nginx=not args.no_nginx) as source:
        paths = [f"/{BUCKET}/{k}" for k in data.keys]
        say("probing the bucket server")
        bench.capacity = probe(source.raw_endpoint, paths, connections=8) if source.raw_endpoint else None
        delayed = probe(source.endpoint, paths, connections=64, seconds=2.0)
        bench.setup(source, data, scenarios)
        for scenario in scenarios:
            for name in args.contenders:
                c = CONTENDERS[name]
                if scenario == "b" and not c.cache_limit:
                    continue
                bench.run_row(source, data, scenario, name)
    if "b" in scenarios:  # the tools without a cache: as in (a)
        for name in args.contenders:
            if not CONTENDERS[name].cache_limit and ("a", name) in bench.rows:
                row = Row(**{**asdict(bench.rows[("a", name)]), "scenario": "b"})
                row.note = "(no cache: its (a) row)"
                bench.rows[("b", name)] = row
    report(args, bench, data, scenarios, delayed, time.time() - started)


def report(args, bench: Bench, data, scenarios: list[str], delayed, elapsed: float) -> None:
    dataset = data.total_bytes
    sizes = sorted(data.sizes)
    out: list[str] = []
    md: list[str] = []
    out.append(parameters({
        "files": data.spec.files, "classes": data.spec.classes, "dataset_MB": round(dataset / 1e6),
        "file_KB_p5/p50/mean/p95": f"{sizes[len(sizes) // 20] // 1000}/{sizes[len(sizes) // 2] // 1000}/"
                                   f"{dataset // len(sizes) // 1000}/{sizes[-len(sizes) // 20] // 1000}",
        "batch": args.batch_size, "workers": args.workers, "compute_s": args.compute, "epochs": args.epochs,
        "jobs_c": args.jobs, "cache_b": f"{args.cache_fraction:.0%}", "latency_ms": args.latency_ms,
        "caches_on": "root fs" if args.cache_on_root else "own ext4",
        "rounds": args.rounds, "cpus": os.cpu_count(), "python": platform.python_version(),
        "elapsed_s": round(elapsed)}))
    out.append("versions: " + ", ".join(f"{k} {v}" for k, v in versions().items()))
    cap = bench.capacity
    if cap is not None:
        out.append(f"bucket server: nginx {cap.gets_per_s:,.0f} GETs/s, {cap.bytes_per_s / 1e6:,.0f} MB/s with no "
                   f"delay ({cap.connections} connections of a light client on the same cores: a lower bound); "
                   f"with the {args.latency_ms:g} ms delay and {delayed.connections} connections "
                   f"{delayed.gets_per_s:,.0f} GETs/s (ideal {delayed.connections / (args.latency_ms / 1000):,.0f}): "
                   "the delay holds no worker")
    else:
        out.append(f"bucket server: the Python server alone; {delayed.gets_per_s:,.0f} GETs/s with "
                   f"{delayed.connections} connections")
    out.append("")
    out.append("configuration:")
    out.extend(configurations(args, bench, data, args.contenders))
    out.append("")
    setup_rows = []
    for name, s in bench.setups.items():
        b = s.bucket
        setup_rows.append([name, s.step, f"{s.seconds:.1f}", b.get("gets", 0), f"{b.get('get_bytes', 0) / 1e6:,.0f}",
                           b.get("writes", 0), f"{b.get('write_bytes', 0) / 1e6:,.0f}",
                           f"{s.stored_bytes / 1e6:,.0f}" if s.stored_bytes else "", s.objects or "", s.notes])
    setup_headers = ["contender", "set-up step", "s", "GETs", "GET MB", "PUT/POST", "PUT MB", "copy in bucket MB",
                     "objects", "notes"]
    if setup_rows:
        out.append("set-up (once per dataset; the others need none):")
        out.append(table(setup_headers, setup_rows))
        md.append(markdown(setup_headers, setup_rows))
        md.append("")
    lines_verdicts: list[str] = []
    for scenario in scenarios:
        rows = [bench.rows[(scenario, n)] for n in args.contenders if (scenario, n) in bench.rows]
        if not rows:
            continue
        out.append("")
        title = f"({scenario}) {SCENARIOS[scenario]}"
        out.append(title)
        out.append(scenario_table(rows, dataset, data.spec.files))
        accounts = [f"  {row.contender}: {row.mountd}" for row in rows if row.mountd]
        if accounts:
            out.append("mountd's account of its bucket reads, datasets over the whole run:")
            out.extend(accounts)
        md.append(f"**{title}**\n")
        md.append(markdown_table(rows, dataset, data.spec.files))
        md.append("")
        if accounts:
            md.append("mountd's account of its bucket reads, datasets over the whole run:\n")
            md.extend(f"- {line.strip()}" for line in accounts)
            md.append("")
        lines_verdicts += verdicts(scenario, rows, dataset, args.epochs)
    out.append("")
    out.append("targets (issue 37), each quiverfs row against the best other row:")
    out.extend(lines_verdicts)
    text = "\n".join(out)
    print(text)
    WORK.mkdir(parents=True, exist_ok=True)
    (WORK / "results.json").write_text(json.dumps({
        "rows": [asdict(r) for r in bench.rows.values()],
        "setups": {k: asdict(v) for k, v in bench.setups.items()},
        "capacity": asdict(cap) if cap else None, "delayed": asdict(delayed), "text": text}, indent=1))
    if args.markdown:
        args.markdown.write_text("\n".join(md) + "\n\n```\n" + "\n".join(lines_verdicts) + "\n```\n")


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        raise SystemExit(130) from None
