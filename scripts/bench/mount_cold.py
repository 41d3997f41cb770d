#!/usr/bin/env python3
"""Cold first reads through the mount beside the source, a bare fill loop and a warm pass.

Issue 34, "Fills at the speed of the cores". 2,000 files of 110 KiB in class folders (as
``ImageFolder`` expects), ``--readers`` reader processes (default 8), each reading its share
with ``open()+read()+close()``. Every cold pass gets a fresh empty cache directory, a fresh
``quiverfs mountd`` and a fresh ``quiverfs mount --foreground``, so every file is a miss that
mountd fills while the reader waits (or, in order, that read-ahead fetched first). Measured
in one run, best of ``--rounds`` rounds per row (the VM's ratios swing by ±20%):

``file://`` source, read once first so that it is in the page cache:

* direct: the readers read the source files themselves (a pass lasts ~0.1 s, so each round
  takes the best of three);
* bare fill loop: one process reads each source file, checks its blake3, writes a temp file
  and renames it into a fan-out folder of an empty store, one file after another: the
  floor a fill costs on this machine, with no cache around it;
* cold, in order: reader k reads files k, k+R, k+2R, ... of the digest's (sorted path) order,
  so the pass as a whole is a scan in digest order (read-ahead's case);
* cold, shuffled: the same shares of a random permutation (the mount's sweep fetches the files
  between those read ahead of the readers: docs/mount.md "The sweep");
* cold, shuffled, ``--sweep 0``: every read a miss on demand, as before the sweep;
* cold, in order, ``--readahead 0``;
* cold, in order, ``--fill-processes 0``: fills in mountd's own threads, the way they ran
  before fill processes (issue 34's "before");
* warm second pass on the in-order mount (files now cached), for reference;
* warm first pass: the in-order mount unmounted and mounted again on the same mountd, every
  file in the store, the mount's page cache empty: a first pass that fills nothing.

S3 emulator source (moto server on loopback, the same files uploaded under one prefix):

* plain boto3 reader: R processes, each with its own boto3 client, GETting their shares;
* cold, in order and shuffled through the mount; mountd's ``--remote-concurrency`` is
  max(16, R).

Columns: files/s; ÷ direct (the boto3 readers for S3); ÷ the warm first pass; ÷ the bare
fill loop; mountd's main process's CPU per file filled; the CPU of every quiverfs process
(mountd, its fill processes, the mount and its workers) per file read; mountd's fill latency
p50. Under the table, where the best in-order pass spent its fills' time (``quiverfs stats``
``fill_stages``: wall and CPU per fill of each stage, in mountd's main process and in the fill
processes).

Targets (issue 34, 2 cores, 8 readers): cold in order ÷ bare fill loop >= 0.4, shuffled >= 0.35;
mountd's main process <= 0.1 ms of CPU per fill; all quiverfs processes <= 0.5 ms per cold
file; S3: cold in order ÷ boto3 readers >= 1.0.

``--scale`` adds a table of cold in-order passes at 1, 2, 4, ... readers up to the core count
(at least 8), with ``--fill-processes`` 0, 1 and the default, to show what moves the number.

    .venv/bin/python scripts/bench/mount_cold.py [--files 2000] [--readers 8] [--rounds 2]
    .venv/bin/python scripts/bench/mount_cold.py --quick --only file   # 400 files, 1 round

``--only file|s3`` runs one section.

Every reader checks the bytes it read (total) and the blake3 of every 16th file against the
digest, after its timed loop. Needs root and FUSE; everything lives under .bench/mount_cold/
(git-ignored); mountd's and the mount's logs of the last cold pass are in .bench/mount_cold/world/.
Ctrl-C or SIGTERM unmounts and stops every process the benchmark started.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO))

import trio  # noqa: E402
from harness.cachefs import add_cache_on_root, dedicated_cache_fs  # noqa: E402
from harness.readers import S3Target  # noqa: E402
from harness.readers import read_pass as readers_pass  # noqa: E402
from harness.world import (  # noqa: E402
    MountdConfig,
    World,
    cpu_delta,
    force_unmount,
    sigterm_as_interrupt,
    stop_mountd_of,
)

WORK = REPO / ".bench" / "mount_cold"
WORLD = WORK / "world"  # harness World "world": mountd.log and mount.log of the last pass, mnt/
#: Where the cold passes' caches live: a filesystem of their own (harness/cachefs.py says why),
#: as docs/operations.md advises, unless --cache-on-root.
CACHE_FS = WORK / "cachefs"
CACHE_FS_IMAGE = WORK / "cachefs.img"
CACHE_ROOT = CACHE_FS
FILE_SIZE = 110 * 1024
CLASSES = 20
TARGET_BARE = {"cold, in order": 0.4, "cold, shuffled": 0.35}  # ÷ the bare fill loop
TARGET_MOUNTD_MS = 0.1  # mountd's main process, CPU per fill
TARGET_TOTAL_MS = 0.5  # every quiverfs process together, CPU per cold file
TARGET_S3 = 1.0  # cold in order ÷ plain boto3 readers, S3 emulator
BUCKET, PREFIX = "coldbench", "train"
PASS_TIMEOUT = 900.0  # seconds one read pass may take (today's cold S3 pass: ~10 s)
BARRIER_TIMEOUT = 120.0


def progress(message: str) -> None:
    print(f"[mount_cold] {message}", file=sys.stderr, flush=True)


def quiverfs(*args: str) -> list[str]:
    return [sys.executable, "-m", "quiverfs.cli", *args]


# -- the dataset ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Dataset:
    """A digest and its files in digest order: relative paths and blake3 hashes."""

    digest: Path
    rels: list[str]
    hashes: list[bytes]

    @property
    def total_bytes(self) -> int:
        return len(self.rels) * FILE_SIZE


def _digest_files(digest: Path) -> tuple[list[str], list[bytes]]:
    from digests.digest import Digest

    with Digest.open(str(digest)) as d:
        rows = list(d.iter_canonical())  # the digest's canonical (sorted path) order
    return [path for path, _, _ in rows], [h for _, _, h in rows]


def prepare_source(n_files: int) -> tuple[Path, Dataset]:
    """The ``file://`` source tree and its digest (written once per file count)."""
    from digests.build import build

    source = WORK / f"src-{n_files}"
    digest = WORK / f"file-{n_files}.qd"
    if not digest.exists():
        progress(f"writing {n_files} files of {FILE_SIZE // 1024} KiB under {source}")
        shutil.rmtree(source, ignore_errors=True)
        rng = random.Random(12)
        for i in range(n_files):  # random bytes: no two files share a content hash
            path = source / f"class_{i % CLASSES:02d}" / f"img_{i:06d}.jpg"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(rng.randbytes(FILE_SIZE))
        progress("building the file:// digest")
        partial = digest.with_name(digest.name + ".tmp")
        partial.unlink(missing_ok=True)
        trio.run(lambda: build("file://" + str(source), partial))
        partial.rename(digest)
    rels, hashes = _digest_files(digest)
    if len(rels) != n_files:
        raise SystemExit(f"{digest} lists {len(rels)} files, expected {n_files}: delete {WORK} and rerun")
    return source, Dataset(digest, rels, hashes)


# -- reading ------------------------------------------------------------------------------------


def read_pass(items: list[str], hashes: list[bytes], readers: int, shuffle_seed: int | None = None,
              s3: S3Target | None = None) -> float:
    """Files/s of ``readers`` processes reading interleaved shares of ``items`` at once
    (harness/readers.py), with this benchmark's file size and time limits."""
    return readers_pass(items, hashes, FILE_SIZE, readers, shuffle_seed=shuffle_seed, s3=s3,
                        pass_timeout=PASS_TIMEOUT, barrier_timeout=BARRIER_TIMEOUT)


# -- a fresh cache, mountd and mount --------------------------------------------------------------


def cold_world(dataset: Dataset, mount_args: list[str], concurrency: int,
               env: dict[str, str] | None, fill_processes: int | None = None) -> World:
    """A fresh empty cache (on the cache filesystem), a ``quiverfs mountd`` on it and a
    ``quiverfs mount --foreground`` of ``dataset`` with ``mount_args``: harness/world.py's
    World, whose teardown unmounts and stops both (SIGTERM, then SIGKILL)."""
    config = MountdConfig(cache_size=10 << 30, remote_concurrency=concurrency,
                          fill_processes=fill_processes)
    return World(dataset, "world", config, root=WORK, mount_args=mount_args, env=env,
                 cache_dir=CACHE_ROOT / "cache")


def sweep() -> None:
    """Whatever a cut-short teardown left: the mount, a mountd on the cache, the cache."""
    force_unmount(WORLD / "mnt")
    stop_mountd_of(CACHE_ROOT / "cache")
    shutil.rmtree(CACHE_ROOT / "cache", ignore_errors=True)


# -- the bare fill loop ------------------------------------------------------------------------


def bare_fill_loop(source: Path, dataset: Dataset) -> tuple[float, float]:
    """(files/s, CPU ms per file) of one process filling an empty store from the source, one
    file at a time: read, blake3 (checked against the digest), write a temp file, rename it
    into ``store/ab/cd/<hex>`` (folders made as needed). No quiverfs code: the floor."""
    import blake3

    root = CACHE_ROOT / "bare"
    shutil.rmtree(root, ignore_errors=True)
    (root / "tmp").mkdir(parents=True)
    store = str(root / "store")
    tmp = str(root / "tmp")
    made: set[str] = set()
    paths = [str(source / rel) for rel in dataset.rels]
    wall, cpu = time.perf_counter(), time.process_time()
    for i, (path, digest) in enumerate(zip(paths, dataset.hashes, strict=True)):
        with open(path, "rb") as f:
            data = f.read()
        if blake3.blake3(data).digest() != digest:
            raise RuntimeError(f"{path} does not match its digest")
        name = digest.hex()
        temp = f"{tmp}/{name}.{i}.tmp"
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o400)
        try:
            os.write(fd, data)
            os.fchmod(fd, 0o444)
        finally:
            os.close(fd)
        leaf = f"{store}/{name[:2]}/{name[2:4]}"
        if leaf not in made:
            os.makedirs(leaf, exist_ok=True)
            made.add(leaf)
        os.rename(temp, f"{leaf}/{name}")
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    shutil.rmtree(root, ignore_errors=True)
    return len(paths) / wall, cpu / len(paths) * 1e3


# -- measuring --------------------------------------------------------------------------------


@dataclass
class Round:
    """One pass: files/s, and for a cold pass what mountd and the mount spent on it."""

    rate: float
    fill: dict | None = None
    #: CPU ms of mountd's main process per file it filled
    mountd_ms: float | None = None
    #: of which its event loop's thread (the index's commits and other worker threads are
    #: the rest: on many cores only this part is serialized)
    loop_ms: float | None = None
    #: CPU ms of every quiverfs process per file read
    total_ms: float | None = None
    #: mountd's fill_stages (quiverfs stats) after the pass
    stages: dict | None = None
    #: cores each process kept busy during the pass (its CPU seconds ÷ the pass's seconds):
    #: on many cores, the role near 1.0 (one interpreter) is what limits the rate
    busy: dict[str, float] | None = None


@dataclass
class Row:
    """One row of a table: its rounds."""

    name: str
    rounds: list[Round] = field(default_factory=list)
    skipped: str | None = None

    def add(self, rate: float, **measured) -> Round:
        self.rounds.append(Round(rate, **measured))
        return self.rounds[-1]

    @property
    def best(self) -> Round:
        return max(self.rounds, key=lambda r: r.rate)


def fill_report(world: World) -> tuple[dict, dict]:
    """mountd's total ``fill_latency`` (``p50_s``, ``count``, ...) and ``fill_stages``."""
    from mountd.stats.costs import stats_report

    stats = world.stats()
    return stats_report(stats)["total"]["fill_latency"], stats["counters"]["fill_stages"]


def measured_pass(world: World, row: Row, paths: list[str], hashes: list[bytes], readers: int,
                  seed: int | None = None, s3: S3Target | None = None) -> Round:
    """One read pass through ``world``'s mount, with the CPU every quiverfs process spent."""
    before, loop_before = world.cpu(), world.loop_cpu()
    rate = read_pass(paths, hashes, readers, shuffle_seed=seed, s3=s3)
    used, loop = cpu_delta(before, world.cpu()), world.loop_cpu() - loop_before
    fill, stages = fill_report(world)
    fills = fill.get("count") or 0
    seconds = len(paths) / rate
    got = row.add(rate, fill=fill, stages=stages,
                  mountd_ms=used["mountd"] / fills * 1e3 if fills else None,
                  loop_ms=loop / fills * 1e3 if fills else None,
                  total_ms=sum(used.values()) / len(paths) * 1e3,
                  busy={role: cpu / seconds for role, cpu in used.items()})
    lat = latency_of(fill)
    note = f", fill p50 {lat * 1e3:.1f} ms over {fills} fills" if lat is not None else ""
    cpu = (f", mountd {got.mountd_ms:.3f} ms/fill" if got.mountd_ms is not None else "") + \
        f", all {got.total_ms:.3f} ms/file"
    progress(f"  {row.name}: {rate:,.0f} files/s{note}{cpu}")
    return got


def cold_round(dataset: Dataset, row: Row, mount_args: list[str], readers: int, concurrency: int,
               seed: int | None, env: dict[str, str] | None = None,
               warm: tuple[Row, Row] | None = None, fill_processes: int | None = None) -> None:
    """One cold pass on a fresh cache and mount; with ``warm`` (second pass, first pass)
    also the warm second pass on the same mount and a first pass on a fresh mount of the now
    filled cache."""
    with cold_world(dataset, mount_args, concurrency, env, fill_processes) as world:
        paths = world.paths
        got = measured_pass(world, row, paths, dataset.hashes, readers, seed)
        if got.fill and got.fill.get("count", len(paths)) < len(paths):
            progress(f"  warning: only {got.fill.get('count')} fills for {len(paths)} files: "
                     "was the cache cold?")
        if warm is not None:
            second, first = warm
            rate = read_pass(paths, dataset.hashes, readers)
            second.add(rate)
            progress(f"  {second.name}: {rate:,.0f} files/s")
            world.remount()
            rate = read_pass(paths, dataset.hashes, readers)
            first.add(rate)
            progress(f"  {first.name}: {rate:,.0f} files/s")
    shutil.rmtree(world.cache_dir, ignore_errors=True)


def latency_of(fill: dict | None) -> float | None:
    """mountd's fill latency p50 (its mean where it reports no p50)."""
    if not fill:
        return None
    for key in ("p50_s", "mean_s"):
        if fill.get(key) is not None:
            return float(fill[key])
    return None


# -- reporting -------------------------------------------------------------------------------------


def ratio(value: float, base: Row | None) -> str:
    if base is None or not base.rounds or base.skipped:
        return "–"
    return f"{value / base.best.rate:.3f}"


def print_table(title: str, base: Row, rows: list[Row], *, warm_first: Row | None,
                bare: Row | None, targets: dict[str, float], base_target: float | None,
                rounds: int) -> None:
    """One table: each row's best round beside the base row (direct reads or boto3 readers),
    the warm first pass and the bare fill loop, with the CPU columns and the verdicts."""
    print(f"\n{title}")
    print(f"{'pass':<44}{'files/s':>10}{'÷ base':>8}{'÷ warm1':>8}{'÷ bare':>8}"
          f"{'mountd ms':>11}{'all ms':>8}{'fill p50':>10}  verdicts; rounds (files/s)")
    verdicts_all = []
    for row in [base, *rows]:
        if row.skipped:
            print(f"{row.name:<44}{'–':>10}  ({row.skipped})")
            continue
        best = row.best
        verdicts = []
        if row is not base and row.name in targets and bare is not None and bare.rounds:
            target = targets[row.name]
            verdicts.append(("÷ bare", best.rate / bare.best.rate, target))
        if row is not base and row.name == "cold, in order" and base_target is not None:
            verdicts.append(("÷ base", best.rate / base.best.rate, base_target))
        if row.name in targets or row.name == "cold, in order":
            if best.mountd_ms is not None:
                verdicts.append(("mountd ms", -best.mountd_ms, -TARGET_MOUNTD_MS))
            if best.total_ms is not None:
                verdicts.append(("all ms", -best.total_ms, -TARGET_TOTAL_MS))
        text = " ".join(f"{name} {'PASS' if value >= goal else 'FAIL'}"
                        for name, value, goal in verdicts)
        verdicts_all.extend(verdicts)
        lat = latency_of(best.fill)
        print(f"{row.name:<44}{best.rate:>10,.0f}{ratio(best.rate, base):>8}"
              f"{ratio(best.rate, warm_first):>8}{ratio(best.rate, bare):>8}"
              f"{_ms(best.mountd_ms):>11}{_ms(best.total_ms):>8}"
              f"{(f'{lat * 1e3:.1f} ms' if lat is not None else ''):>10}  {text}"
              f"{'; ' if text else ''}{' '.join(f'{r.rate:,.0f}' for r in row.rounds)}")
    print(f"(÷ base: ÷ {base.name}; ÷ warm1: ÷ the warm first pass; ÷ bare: ÷ the bare fill loop; "
          f"mountd ms: CPU of mountd's main process per file filled; all ms: CPU of mountd, its "
          f"fill processes, the mount and its workers per file read; each row the best of "
          f"{rounds} round(s), a fresh cache, mountd and mount per cold pass, because the VM's "
          f"ratios swing by ±20%)")
    print(f"targets: ÷ bare {', '.join(f'{k} >= {v}' for k, v in targets.items())}; mountd <= "
          f"{TARGET_MOUNTD_MS} ms per fill; all <= {TARGET_TOTAL_MS} ms per cold file"
          + (f"; cold, in order ÷ base >= {base_target}" if base_target is not None else ""))


def _ms(value: float | None) -> str:
    return "" if value is None else f"{value:.3f}"


def _busy(busy: dict[str, float]) -> str:
    """``mountd 0.87, fill processes 1.98, ...``: the cores each process kept busy."""
    return ", ".join(f"{role} {cores:.2f}" for role, cores in busy.items())


def print_stages(row: Row) -> None:
    """Where the fills of ``row``'s best round spent their time (mountd's ``fill_stages``)."""
    stages = row.best.stages
    if not stages or row.skipped:
        return
    fills = (row.best.fill or {}).get("count") or 0
    print(f"\nwhere a fill's time went ({row.name}, best round, {fills} fills; "
          f"{stages.get('jobs', 0)} fill-process jobs): per observation of each stage")
    print(f"{'stage':<10}{'where':<16}{'observed':>10}{'wall µs':>10}{'CPU µs':>10}")
    places = {"read": "fill process", "hash": "fill process", "write": "fill process",
              "rename": "fill process", "commit": "mountd thread"}
    for name, stage in stages["stages"].items():
        if not stage["count"]:
            continue
        per = stage["count"]
        cpu = f"{stage['cpu_s'] / per * 1e6:.1f}" if stage["cpu_s"] else "–"
        print(f"{name:<10}{places.get(name, 'mountd'):<16}{stage['count']:>10}"
              f"{stage['wall_s'] / per * 1e6:>10.1f}{cpu:>10}")
    if row.best.mountd_ms is not None:
        loop = (f" (its event loop's thread {row.best.loop_ms * 1e3:.1f} µs)"
                if row.best.loop_ms is not None else "")
        print(f"mountd's main process, all told: {row.best.mountd_ms * 1e3:.1f} µs of CPU per "
              f"fill{loop}")
    if row.best.busy:
        print("cores kept busy during the pass: " +
              _busy(row.best.busy))


# -- the sections ----------------------------------------------------------------------------------


#: The mount flags some rows need (an older tree, measured for comparison, may lack them).
OPTIONAL_FLAGS = frozenset({"--readahead", "--sweep"})


def variants(flags: frozenset[str]) -> list[tuple[str, list[str], bool, int | None]]:
    """(row name, mount arguments, shuffled, mountd --fill-processes) of the cold passes this
    tree's ``quiverfs mount`` can run (``flags``: the optional flags it takes)."""
    out: list[tuple[str, list[str], bool, int | None]] = [
        ("cold, in order", [], False, None), ("cold, shuffled", [], True, None)]
    if "--sweep" in flags:
        out.append(("cold, shuffled, --sweep 0", ["--sweep", "0"], True, None))
    if "--readahead" in flags:
        out.append(("cold, in order, --readahead 0", ["--readahead", "0"], False, None))
    out.append(("cold, in order, --fill-processes 0", [], False, 0))
    return out


def cold_rows(flags: frozenset[str]) -> dict[str, Row]:
    """A row for every cold pass; those this tree cannot run marked skipped."""
    rows = {name: Row(name) for name, *_ in variants(OPTIONAL_FLAGS)}
    runnable = {name for name, *_ in variants(flags)}
    for name, row in rows.items():
        if name not in runnable:
            row.skipped = "this mount lacks the flag: skipped"
    return rows


def supported_flags() -> frozenset[str]:
    """Which of :data:`OPTIONAL_FLAGS` this tree's ``quiverfs mount`` takes."""
    out = subprocess.run(quiverfs("mount", "--help"), capture_output=True, text=True, cwd=REPO,
                         env={**os.environ, "COLUMNS": "200", "NO_COLOR": "1"}, check=False)
    return frozenset(flag for flag in OPTIONAL_FLAGS if flag in out.stdout + out.stderr)


def file_section(args: argparse.Namespace, source: Path, dataset: Dataset, flags: frozenset[str]) -> None:
    direct = Row("direct reads of the source files")
    bare = Row("bare fill loop (one process)")
    cold = cold_rows(flags)
    warm = Row("warm second pass (in-order mount)")
    first = Row("warm first pass (fresh mount, all cached)")
    source_paths = [str(source / rel) for rel in dataset.rels]
    progress("reading the source once (page cache)")
    read_pass(source_paths, dataset.hashes, args.readers)
    for r in range(args.rounds):
        progress(f"file:// round {r + 1}/{args.rounds}")
        rate = max(read_pass(source_paths, dataset.hashes, args.readers) for _ in range(3))
        direct.add(rate)
        progress(f"  {direct.name}: {rate:,.0f} files/s")
        rate, cpu_ms = bare_fill_loop(source, dataset)
        bare.add(rate, total_ms=cpu_ms)
        progress(f"  {bare.name}: {rate:,.0f} files/s, {cpu_ms:.3f} ms of CPU a file")
        for name, mount_args, shuffled, processes in variants(flags):
            cold_round(dataset, cold[name], mount_args, args.readers, args.concurrency,
                       seed=r if shuffled else None, fill_processes=processes,
                       warm=(warm, first) if name == "cold, in order" else None)
    print_table(f"cold reads, file:// source in the page cache: {len(dataset.rels):,} files x "
                f"{FILE_SIZE // 1024} KiB, {args.readers} reader processes, {os.cpu_count()} CPUs, "
                f"mountd --remote-concurrency {args.concurrency}",
                direct, [bare, *cold.values(), warm, first], warm_first=first, bare=bare,
                targets=TARGET_BARE, base_target=None, rounds=args.rounds)
    print_stages(cold["cold, in order"])
    print_stages(cold["cold, shuffled"])
    print(f"\ncold, in order ÷ warm first pass: "
          f"{cold['cold, in order'].best.rate / first.best.rate:.3f}; "
          f"÷ direct: {cold['cold, in order'].best.rate / direct.best.rate:.3f}")
    if args.scale:
        scale_section(args, dataset)


def scale_section(args: argparse.Namespace, dataset: Dataset) -> None:
    """Cold in order at 1, 2, 4, ... readers, with 0, 1 and the default fill processes."""
    cores = len(os.sched_getaffinity(0))
    counts = [1]
    while counts[-1] < max(8, cores):
        counts.append(min(counts[-1] * 2, max(8, cores)))
    settings = [("fills in mountd's threads (--fill-processes 0)", 0),
                ("1 fill process", 1), (f"default ({cores} fill processes)", None)]
    results: dict[tuple[str, int], Row] = {}
    for label, processes in settings:
        for readers in counts:
            row = results[label, readers] = Row(f"{label}, {readers} readers")
            progress(f"scaling: {row.name}")
            cold_round(dataset, row, [], readers, args.concurrency, seed=None,
                       fill_processes=processes)
    print(f"\nscaling: cold in order (files/s, best of 1), file:// source, {cores} CPUs; "
          "columns: readers; in brackets mountd's main-process CPU ms per fill")
    print(f"{'mountd':<48}" + "".join(f"{n:>16}" for n in counts))
    for label, _ in settings:
        cells = []
        for readers in counts:
            best = results[label, readers].best
            cells.append(f"{best.rate:,.0f} ({_ms(best.mountd_ms)})")
        print(f"{label:<48}" + "".join(f"{c:>16}" for c in cells))
    busiest = results[settings[-1][0], counts[-1]].best.busy
    if busiest:
        print(f"cores kept busy, default fill processes, {counts[-1]} readers: " +
              _busy(busiest))


@contextlib.contextmanager
def environ(changes: dict[str, str], drop: tuple[str, ...]) -> Iterator[None]:
    """``os.environ`` with ``changes`` and without ``drop`` for the block (digest build in-process)."""
    saved = dict(os.environ)
    for name in drop:
        os.environ.pop(name, None)
    os.environ.update(changes)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def s3_section(args: argparse.Namespace, source: Path, dataset: Dataset, flags: frozenset[str]) -> None:
    from digests.build import build
    from quiverfs.testing.emulators import run_moto

    drop = ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3", "AWS_CONFIG_FILE",
            "AWS_SHARED_CREDENTIALS_FILE")
    progress("starting the S3 emulator (moto server)")
    with run_moto() as s3:
        env = {k: v for k, v in os.environ.items() if k not in drop} | s3.env
        s3.upload_threads = 4
        s3.create_bucket(BUCKET)
        progress(f"uploading {len(dataset.rels):,} objects to s3://{BUCKET}/{PREFIX}")
        s3.upload_many(BUCKET, ((f"{PREFIX}/{rel}", (source / rel).read_bytes()) for rel in dataset.rels))
        digest = WORK / f"s3-{len(dataset.rels)}.qd"
        for stale in WORK.glob(digest.name + "*"):  # the emulator is new: so is its bucket
            stale.unlink()
        progress("building the s3:// digest")
        with environ(s3.env, drop):
            trio.run(lambda: build(s3.root_url(BUCKET, PREFIX), digest, settings=s3.settings()))
        rels, hashes = _digest_files(digest)
        if rels != dataset.rels or hashes != dataset.hashes:
            raise RuntimeError("the s3:// digest does not list the file:// digest's files")
        s3_data = Dataset(digest, rels, hashes)
        target = S3Target(s3.endpoint, s3.env, BUCKET, PREFIX)
        keys = [f"{PREFIX}/{rel}" for rel in rels]

        boto = Row(f"plain boto3 reader, {args.readers} processes")
        cold = cold_rows(flags)
        for r in range(args.rounds):
            progress(f"s3 round {r + 1}/{args.rounds}")
            rate = read_pass(keys, hashes, args.readers, s3=target)
            boto.add(rate)
            progress(f"  {boto.name}: {rate:,.0f} files/s")
            for name, mount_args, shuffled, processes in variants(flags):
                cold_round(s3_data, cold[name], mount_args, args.readers, args.concurrency,
                           seed=r if shuffled else None, env=env, fill_processes=processes)
    print_table(f"cold reads, S3 emulator (moto server on loopback) as the source: {len(rels):,} objects "
                f"x {FILE_SIZE // 1024} KiB, {args.readers} readers, mountd --remote-concurrency "
                f"{args.concurrency}", boto, list(cold.values()), warm_first=None, bare=None,
                targets={}, base_target=TARGET_S3, rounds=args.rounds)
    print_stages(cold["cold, in order"])


def run_sections(args: argparse.Namespace, source: Path, dataset: Dataset, flags: frozenset[str]) -> None:
    if args.only in (None, "file"):
        file_section(args, source, dataset, flags)
    if args.only in (None, "s3"):
        from quiverfs.testing.emulators import EmulatorError

        try:
            s3_section(args, source, dataset, flags)
        except EmulatorError as exc:
            if args.only == "s3":
                raise SystemExit(f"S3 emulator: {exc}") from None
            print(f"\nS3 section skipped: the emulator did not start ({exc})")


def main() -> None:
    global CACHE_ROOT
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--files", type=int, default=None, help="files in the dataset (default 2000; --quick 400)")
    parser.add_argument("--readers", type=int, default=8, help="reader processes (and boto3 readers)")
    parser.add_argument("--rounds", type=int, default=None,
                        help="rounds per row, best reported (default 2; --quick 1)")
    parser.add_argument("--quick", action="store_true", help="a small smoke run (400 files, 1 round)")
    parser.add_argument("--only", choices=("file", "s3"), help="run one section only")
    parser.add_argument("--scale", action="store_true",
                        help="also cold passes at 1, 2, 4, ... readers with 0, 1 and the default fill processes")
    add_cache_on_root(parser)
    args = parser.parse_args()
    args.files = args.files or (400 if args.quick else 2000)
    args.rounds = args.rounds or (1 if args.quick else 2)
    args.concurrency = max(64, args.readers)  # mountd's --remote-concurrency: its default, or R
    if args.files < args.readers or args.readers < 1 or args.rounds < 1:
        raise SystemExit("need --readers >= 1, --rounds >= 1 and --files >= --readers")
    if os.geteuid() != 0 or not os.path.exists("/dev/fuse"):
        raise SystemExit("needs root and /dev/fuse")
    sigterm_as_interrupt()  # SIGTERM tears down like Ctrl-C

    started = time.monotonic()
    load = os.getloadavg()
    WORK.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(WORLD, ignore_errors=True)  # the logs hold this invocation only
    source, dataset = prepare_source(args.files)
    flags = supported_flags()
    try:
        with dedicated_cache_fs(CACHE_FS, CACHE_FS_IMAGE, not args.cache_on_root,
                                fallback=WORK, say=progress) as cache_root:
            CACHE_ROOT = cache_root
            run_sections(args, source, dataset, flags)
    except KeyboardInterrupt:
        sweep()  # the interrupt may have cut a teardown short
        raise SystemExit("interrupted: mounts and processes stopped") from None
    except RuntimeError as exc:  # a reader, the mount or mountd failed: said in one message
        sweep()
        raise SystemExit(f"failed: {exc}\n(logs: {WORLD})") from None
    print(f"\nwall {time.monotonic() - started:.0f} s; load average {load[0]:.2f} at start, "
          f"{os.getloadavg()[0]:.2f} at end")


if __name__ == "__main__":
    main()
