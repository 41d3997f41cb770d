#!/usr/bin/env python3
"""Cold first reads through the mount vs. reading the source directly, side by side.

Issue 12, "Cold reads at the source's speed". 2,000 files of 110 KiB in class folders (as
``ImageFolder`` expects), 8 reader processes, each reading its share with
``open()+read()+close()``. Every cold pass gets a fresh empty cache directory, a fresh
``quiverfs mountd`` and a fresh ``quiverfs mount --foreground``, so every file is a miss that
mountd fills from the source while the reader waits. Measured in one run, best of ``--rounds``
rounds per row (fresh cache and mount each time; the VM's ratios swing by ±20%):

``file://`` source, read once first so that it is in the page cache:

* direct: the readers read the source files themselves (the source's speed; a pass lasts
  ~0.1 s, so each round takes the best of three);
* cold, in order: reader k reads files k, k+R, k+2R, ... of the digest's (sorted path) order,
  so the pass as a whole is a sequential scan in digest order;
* cold, shuffled: the same shares of a random permutation, so read-ahead in digest order cannot
  make the ratio (printed beside it);
* cold, in order, ``--readahead 0``: when ``quiverfs mount --help`` offers ``--readahead``;
* warm second pass on the in-order mount (files now cached), for reference;
* warm first pass: the in-order mount unmounted and mounted again on the same mountd, every
  file in the store, the mount's page cache empty: a first pass that fills nothing, so the
  ceiling of any cold pass on this machine (its ratio is printed as that ceiling);
* mountd's fill latency for each cold pass (``quiverfs stats --json``, ``fill_latency``): its
  ``p50_s`` where mountd reports one, else its ``mean_s`` (marked).

S3 emulator source (moto server on loopback, the same files uploaded under one prefix):

* plain boto3 reader: R processes, each with its own boto3 client, GETting their shares of the
  objects (the same R as the mount's readers);
* cold, in order and shuffled through the mount (and in order with ``--readahead 0`` when
  offered); mountd's ``--remote-concurrency`` is max(16, R).

Targets: cold in order ÷ direct >= 0.25 with the ``file://`` source (2026-11: ~0.012),
fill latency p50 <= 2 ms; cold in order ÷ boto3 >= 0.8 with the S3 emulator.

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
from harness.readers import S3Target  # noqa: E402
from harness.readers import read_pass as readers_pass  # noqa: E402
from harness.world import (  # noqa: E402
    MountdConfig,
    World,
    force_unmount,
    sigterm_as_interrupt,
    stop_mountd_of,
)

WORK = REPO / ".bench" / "mount_cold"
WORLD = WORK / "world"  # harness World "world": mountd.log and mount.log of the last pass, mnt/
#: Where the cold passes' caches live: a filesystem of their own (see dedicated_cache_fs), as
#: docs/operations.md advises, unless --cache-on-root.
CACHE_FS = WORK / "cachefs"
CACHE_FS_IMAGE = WORK / "cachefs.img"
CACHE_ROOT = CACHE_FS
FILE_SIZE = 110 * 1024
CLASSES = 20
TARGET_FILE = 0.25  # cold in order ÷ direct, file:// source
TARGET_P50_S = 0.002  # mountd's fill latency p50
TARGET_S3 = 0.8  # cold in order ÷ plain boto3 reader, S3 emulator
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


def readahead_supported() -> bool:
    """Whether this tree's ``quiverfs mount`` takes ``--readahead`` (being added meanwhile)."""
    out = subprocess.run(quiverfs("mount", "--help"), capture_output=True, text=True, cwd=REPO,
                         env={**os.environ, "COLUMNS": "200", "NO_COLOR": "1"}, check=False)
    return "--readahead" in out.stdout + out.stderr


def cold_world(dataset: Dataset, mount_args: list[str], concurrency: int,
               env: dict[str, str] | None) -> World:
    """A fresh empty cache (on the cache filesystem), a ``quiverfs mountd`` on it and a
    ``quiverfs mount --foreground`` of ``dataset`` with ``mount_args``: harness/world.py's
    World, whose teardown unmounts and stops both (SIGTERM, then SIGKILL)."""
    config = MountdConfig(cache_size=10 << 30, remote_concurrency=concurrency)
    return World(dataset, "world", config, root=WORK, mount_args=mount_args, env=env,
                 cache_dir=CACHE_ROOT / "cache")


def fill_latency(world: World) -> dict:
    """mountd's total ``fill_latency`` as ``quiverfs stats`` reports it (``p50_s``, ``mean_s``,
    ``count``, ...)."""
    from mountd.stats.costs import stats_report

    return stats_report(world.stats())["total"]["fill_latency"]


def sweep() -> None:
    """Whatever a cut-short teardown left: the mount, a mountd on the cache, the cache."""
    force_unmount(WORLD / "mnt")
    stop_mountd_of(CACHE_ROOT / "cache")
    shutil.rmtree(CACHE_ROOT / "cache", ignore_errors=True)


# -- measuring and reporting ------------------------------------------------------------------------


@dataclass
class Row:
    """One row of a table: its files/s in every round, and the fill latency of each cold round."""

    name: str
    rates: list[float] = field(default_factory=list)
    fills: list[dict] = field(default_factory=list)
    skipped: str | None = None

    def add(self, rate: float, fill: dict | None = None) -> None:
        self.rates.append(rate)
        if fill is not None:
            self.fills.append(fill)

    @property
    def best(self) -> float:
        return max(self.rates)

    def best_fill(self) -> dict | None:
        """The fill latency measured in this row's best round."""
        return self.fills[self.rates.index(self.best)] if self.fills else None


def latency_of(fill: dict | None) -> tuple[float | None, str]:
    """(seconds, which): mountd's exact ``p50_s`` when it reports one, else its ``mean_s``."""
    if not fill:
        return None, ""
    if fill.get("p50_s") is not None:
        return float(fill["p50_s"]), "p50"
    if fill.get("mean_s") is not None:
        return float(fill["mean_s"]), "mean"
    return None, ""


@contextlib.contextmanager
def dedicated_cache_fs(enabled: bool) -> Iterator[None]:
    """The caches on an ext4 filesystem of their own: a loop device over a sparse image file
    on the machine's disk, made fresh for this run and unmounted after it.

    Why: the cache's fills are file creations and writes, and what they cost depends on the
    filesystem far more than on quiverfs. On this VM the root ext4 (the one the source and
    the repository live on) charges ~0.2 ms of CPU to create a file and ~0.6 ms to create and
    write 110 KiB; a fresh ext4 on the same disk ~0.04 ms and ~0.12 ms (MEASURED.md). A cache
    shares nothing with other programs on its own filesystem, which is also what its
    ``syncfs`` checkpoints want (docs/operations.md).
    """
    global CACHE_ROOT
    if not enabled:
        CACHE_ROOT = WORK
        yield
        return
    force_unmount(CACHE_FS)
    CACHE_FS.mkdir(parents=True, exist_ok=True)
    CACHE_FS_IMAGE.unlink(missing_ok=True)
    with open(CACHE_FS_IMAGE, "wb") as image:
        image.truncate(4 << 30)  # sparse: blocks are allocated as the caches fill
    try:
        subprocess.run(["mkfs.ext4", "-q", "-F", str(CACHE_FS_IMAGE)], check=True, capture_output=True)
        subprocess.run(["mount", "-o", "loop", str(CACHE_FS_IMAGE), str(CACHE_FS)], check=True,
                       capture_output=True)
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = (getattr(exc, "stderr", b"") or b"").decode().strip() or str(exc)
        raise SystemExit(f"cannot make the cache filesystem ({detail}); use --cache-on-root") from None
    CACHE_ROOT = CACHE_FS
    try:
        yield
    finally:
        subprocess.run(["umount", str(CACHE_FS)], check=False, capture_output=True)
        CACHE_FS_IMAGE.unlink(missing_ok=True)


def cold_round(dataset: Dataset, row: Row, mount_args: list[str], readers: int, concurrency: int,
               seed: int | None, env: dict[str, str] | None = None,
               warm: tuple[Row, Row] | None = None) -> None:
    """One cold pass on a fresh cache and mount; with ``warm`` (second pass, first pass)
    also the warm second pass on the same mount and a first pass on a fresh mount of the now
    filled cache."""
    with cold_world(dataset, mount_args, concurrency, env) as world:
        paths = world.paths
        rate = read_pass(paths, dataset.hashes, readers, shuffle_seed=seed)
        fill = fill_latency(world)
        row.add(rate, fill)
        value, which = latency_of(fill)
        lat = f", fill {which} {value * 1e3:.1f} ms over {fill.get('count')} fills" if value is not None else ""
        progress(f"  {row.name}: {rate:,.0f} files/s{lat}")
        if fill.get("count", len(paths)) < len(paths):
            progress(f"  warning: only {fill.get('count')} fills for {len(paths)} files: was the cache cold?")
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


def print_table(title: str, base: Row, rows: list[Row], targets: dict[str, float], rounds: int) -> None:
    print(f"\n{title}")
    print(f"{'pass':<44}{'files/s':>10}{'ratio':>8}{'target':>9}  {'result':<6}{'fill latency':>16}"
          f"{'fills':>7}  rounds (files/s)")
    marked = False
    for row in [base, *rows]:
        if row.skipped:
            print(f"{row.name:<44}{'–':>10}  ({row.skipped})")
            continue
        ratio = row.best / base.best
        target = targets.get(row.name)
        verdict = ("PASS" if ratio >= target else "FAIL") if target is not None else ""
        value, which = latency_of(row.best_fill())
        lat = ""
        if value is not None:
            lat = f"{which} {value * 1e3:.1f} ms" + ("*" if which == "mean" else "")
            marked = marked or which == "mean"
        fills = str(row.best_fill().get("count", "")) if row.best_fill() else ""
        print(f"{row.name:<44}{row.best:>10,.0f}{ratio:>8.3f}"
              f"{'>= ' + format(target, '.2f') if target is not None else '':>9}  {verdict:<6}"
              f"{lat:>16}{fills:>7}  {' '.join(f'{r:,.0f}' for r in row.rates)}")
    print(f"(ratios: ÷ {base.name}; each row the best of {rounds} round(s), a fresh cache, mountd "
          f"and mount per cold pass, because the VM's ratios swing by ±20%; fill latency and fills: "
          f"mountd's, in the best round)")
    if marked:
        print("* mountd's mean fill latency: this mountd reports no p50_s in fill_latency")


def p50_verdict(row: Row) -> None:
    value, which = latency_of(row.best_fill())
    if value is None:
        print(f"fill latency p50 ({row.name}): not reported by mountd")
        return
    note = "" if which == "p50" else " (judged on mean_s: this mountd reports no p50_s)"
    result = "PASS" if value <= TARGET_P50_S else "FAIL"
    print(f"fill latency {which} ({row.name}): {value * 1e3:.2f} ms, target p50 <= "
          f"{TARGET_P50_S * 1e3:.0f} ms: {result}{note}")


# -- the two sections ------------------------------------------------------------------------------


def variants(readahead: bool) -> list[tuple[str, list[str], bool]]:
    """(row name, mount arguments, shuffled) of the cold passes."""
    out = [("cold, in order", [], False), ("cold, shuffled", [], True)]
    if readahead:
        out.append(("cold, in order, --readahead 0", ["--readahead", "0"], False))
    return out


def file_section(args: argparse.Namespace, source: Path, dataset: Dataset, readahead: bool) -> None:
    direct = Row("direct reads of the source files")
    cold = {name: Row(name) for name, _, _ in variants(True)}
    if not readahead:
        cold["cold, in order, --readahead 0"].skipped = "this mount has no --readahead: skipped"
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
        for name, mount_args, shuffled in variants(readahead):
            cold_round(dataset, cold[name], mount_args, args.readers, args.concurrency,
                       seed=r if shuffled else None, warm=(warm, first) if name == "cold, in order" else None)
    print_table(f"cold reads, file:// source in the page cache: {len(dataset.rels):,} files x "
                f"{FILE_SIZE // 1024} KiB, {args.readers} reader processes, {os.cpu_count()} CPUs, "
                f"mountd --remote-concurrency {args.concurrency}",
                direct, [*cold.values(), warm, first], {"cold, in order": TARGET_FILE}, args.rounds)
    p50_verdict(cold["cold, in order"])
    print(f"ceiling of a cold pass here: a first pass that fills nothing reaches "
          f"{first.best / direct.best:.3f} of direct reads (cold in order: "
          f"{cold['cold, in order'].best / direct.best:.3f}, target {TARGET_FILE})")


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


def s3_section(args: argparse.Namespace, source: Path, dataset: Dataset, readahead: bool) -> None:
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
        cold = {name: Row(name) for name, _, _ in variants(True)}
        if not readahead:
            cold["cold, in order, --readahead 0"].skipped = "this mount has no --readahead: skipped"
        for r in range(args.rounds):
            progress(f"s3 round {r + 1}/{args.rounds}")
            rate = read_pass(keys, hashes, args.readers, s3=target)
            boto.add(rate)
            progress(f"  {boto.name}: {rate:,.0f} files/s")
            for name, mount_args, shuffled in variants(readahead):
                cold_round(s3_data, cold[name], mount_args, args.readers, args.concurrency,
                           seed=r if shuffled else None, env=env)
    print_table(f"cold reads, S3 emulator (moto server on loopback) as the source: {len(rels):,} objects "
                f"x {FILE_SIZE // 1024} KiB, {args.readers} readers, mountd --remote-concurrency "
                f"{args.concurrency}", boto, list(cold.values()), {"cold, in order": TARGET_S3}, args.rounds)


def run_sections(args: argparse.Namespace, source: Path, dataset: Dataset, readahead: bool) -> None:
    if args.only in (None, "file"):
        file_section(args, source, dataset, readahead)
    if args.only in (None, "s3"):
        from quiverfs.testing.emulators import EmulatorError

        try:
            s3_section(args, source, dataset, readahead)
        except EmulatorError as exc:
            if args.only == "s3":
                raise SystemExit(f"S3 emulator: {exc}") from None
            print(f"\nS3 section skipped: the emulator did not start ({exc})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--files", type=int, default=None, help="files in the dataset (default 2000; --quick 400)")
    parser.add_argument("--readers", type=int, default=8, help="reader processes (and boto3 readers)")
    parser.add_argument("--rounds", type=int, default=None,
                        help="rounds per row, best reported (default 2; --quick 1)")
    parser.add_argument("--quick", action="store_true", help="a small smoke run (400 files, 1 round)")
    parser.add_argument("--only", choices=("file", "s3"), help="run one section only")
    parser.add_argument("--cache-on-root", action="store_true",
                        help="keep the caches on the repository's filesystem instead of a fresh "
                             "ext4 of their own (slow to create files on this VM)")
    args = parser.parse_args()
    args.files = args.files or (400 if args.quick else 2000)
    args.rounds = args.rounds or (1 if args.quick else 2)
    args.concurrency = max(16, args.readers)  # mountd's --remote-concurrency: at least R
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
    readahead = readahead_supported()
    progress(f"quiverfs mount --readahead: {'supported' if readahead else 'not offered by this tree'}")
    progress("caches on " + ("the repository's filesystem" if args.cache_on_root else
                              f"a fresh ext4 of their own ({CACHE_FS})"))
    try:
        with dedicated_cache_fs(not args.cache_on_root):
            run_sections(args, source, dataset, readahead)
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
