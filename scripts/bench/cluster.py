#!/usr/bin/env python3
"""A cluster of mountds as one cache vs. the same nodes alone, side by side (issue 16).

Four nodes on this machine, each a ``quiverfs mountd`` with its own cache directory
(``--cache-size`` = 40% of the dataset: the four caches together hold it, one does not) and a
``quiverfs mount`` of the dataset; one job per node reads every file of the dataset each
epoch, in its own shuffled order, through its node's mount (a few reader threads per job,
each file's blake3 checked against the digest). The bucket is moto's S3 server on loopback
(``--source file``: a ``file://`` directory). Measured in one run:

* **cluster** (``--cluster`` through one ``redis-server`` on loopback, each node advertising
  its own port on 127.0.0.1): bucket bytes per epoch ÷ dataset bytes (the sum of the nodes'
  ``remote_bytes``); then one more epoch in which one node (its mountd, its mount, its job)
  is killed with SIGKILL when the jobs are halfway through: that epoch's time (the surviving
  jobs') ÷ the epoch before it (no kill), and every file every surviving job read checked.
* **independent**: the same four nodes without ``--cluster``: bucket bytes per epoch ÷
  dataset bytes (LRU with a cache of 40%, shuffled reads: about every file every epoch on
  every node, so ~4.0).

Targets (issue 16): cluster ≤ 1.1 bucket bytes ÷ dataset bytes in every epoch (epochs after
the first ~0); epoch time with a node killed ≤ 1.5 × without; no wrong or missing byte.

    .venv/bin/python scripts/bench/cluster.py                 # 2,000 files x 64 KiB, 3 epochs
    .venv/bin/python scripts/bench/cluster.py --quick         # 400 files x 32 KiB, 2 epochs
    .venv/bin/python scripts/bench/cluster.py --source file   # a file:// bucket instead of moto

Needs root, FUSE, ``redis-server`` (scripts/setup.sh) and, for the default source,
``moto_server``. Everything lives under .bench/cluster/ (git-ignored; each node's
``mountd.log`` and ``mount.log`` under ``.bench/cluster/worlds/``). Ctrl-C or SIGTERM
unmounts and stops every process the benchmark started.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os
import queue
import random
import shutil
import signal
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO))

import blake3  # noqa: E402
import trio  # noqa: E402
from harness.world import (  # noqa: E402
    Dataset,
    DatasetSpec,
    MountdConfig,
    World,
    make_dataset,
    sigterm_as_interrupt,
    wait_for,
)

WORK = REPO / ".bench" / "cluster"
NODES = 4
CACHE_SHARE = 0.4  # each node's cache, of the dataset
TARGET_REMOTE = 1.1  # cluster: bucket bytes ÷ dataset bytes per epoch
TARGET_KILL = 1.5  # epoch time with a node killed ÷ without
BUCKET, PREFIX = "clusterbench", "train"
EPOCH_TIMEOUT = 1800.0


def progress(message: str) -> None:
    print(f"[cluster] {message}", file=sys.stderr, flush=True)


# -- the dataset -------------------------------------------------------------------------------------


def digest_hashes(digest: Path) -> dict[str, bytes]:
    """Relative path → blake3, from the digest."""
    from digests.digest import Digest

    with Digest.open(str(digest)) as d:
        return {path: h for path, _, h in d.iter_canonical()}


@contextlib.contextmanager
def environ(changes: dict[str, str]) -> Iterator[None]:
    """``os.environ`` with ``changes`` for the block (the in-process digest build)."""
    saved = dict(os.environ)
    os.environ.update(changes)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


@contextlib.contextmanager
def source(kind: str, spec: DatasetSpec) -> Iterator[tuple[Dataset, dict[str, str] | None]]:
    """The dataset in its bucket: the ``file://`` one, or the same files uploaded to moto
    (with its own digest); and the environment mountd needs for it."""
    dataset = make_dataset(spec)
    if kind == "file":
        yield dataset, None
        return
    from digests.build import build
    from quiverfs.testing.emulators import run_moto

    progress("starting the S3 emulator (moto server)")
    with run_moto() as s3:
        s3.upload_threads = 4
        s3.create_bucket(BUCKET)
        progress(f"uploading {len(dataset.rels):,} objects to s3://{BUCKET}/{PREFIX}")
        s3.upload_many(
            BUCKET,
            ((f"{PREFIX}/{rel}", (dataset.source / rel).read_bytes()) for rel in dataset.rels),
        )
        digest = WORK / "s3.qd"
        digest.unlink(missing_ok=True)  # the emulator is new: so is its bucket
        with environ(s3.env):
            result = trio.run(
                lambda: build(s3.root_url(BUCKET, PREFIX), digest, settings=s3.settings())
            )
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")} | s3.env
        yield replace(dataset, digest=digest, dataset_id=result.dataset_id), env


# -- the jobs -----------------------------------------------------------------------------------------


def _job(paths: list[str], hashes: list[bytes], threads: int, seed: int, done, results) -> None:
    """One node's job (a forked process): every file of ``paths`` in a shuffled order, read
    by ``threads`` threads; ``done`` counts files read; reports (start, end, files, bytes,
    wrong, errors)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    order = list(range(len(paths)))
    random.Random(seed).shuffle(order)
    lock = threading.Lock()
    tally = {"files": 0, "bytes": 0, "wrong": 0, "errors": 0}

    def read(share: list[int]) -> None:
        for i in share:
            try:
                with open(paths[i], "rb") as f:
                    data = f.read()
            except OSError:
                with lock:
                    tally["errors"] += 1
                continue
            right = blake3.blake3(data).digest() == hashes[i]
            with lock:
                tally["files"] += 1
                tally["bytes"] += len(data)
                tally["wrong"] += not right
            with done.get_lock():
                done.value += 1

    start = time.perf_counter()
    workers = [threading.Thread(target=read, args=(order[t::threads],)) for t in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    results.put((seed, start, time.perf_counter(), tally))


@dataclass
class Epoch:
    """One epoch of the four jobs: bucket bytes (all nodes) and the surviving jobs' times."""

    remote_bytes: int
    seconds: float
    files: int
    wrong: int
    errors: int
    complete: bool  # every surviving job read every file


def run_epoch(
    worlds: list[World], hashes: list[bytes], threads: int, seed: int, kill: int | None = None
) -> Epoch:
    """The jobs of ``worlds`` read the dataset once, together; with ``kill``, node ``kill``
    is killed (SIGKILL: its mountd, its mount, its job) once the jobs are halfway."""
    ctx = multiprocessing.get_context("fork")
    results = ctx.Queue()
    counters = [ctx.Value("i", 0) for _ in worlds]
    live = [w for i, w in enumerate(worlds) if i != kill]
    before = sum(w.counters()["remote_bytes"] for w in live)
    jobs = [
        ctx.Process(
            target=_job,
            args=(w.paths, hashes, threads, seed * 100 + i, counters[i], results),
            daemon=True,
        )
        for i, w in enumerate(worlds)
    ]
    for job in jobs:
        job.start()
    try:
        if kill is not None:
            total = len(hashes) * len(worlds)
            wait_for(
                lambda: sum(c.value for c in counters) >= total // 2,
                "the jobs' half",
                EPOCH_TIMEOUT,
            )
            victim = worlds[kill]
            progress(
                f"  kill -9 node {kill} (mountd pid {victim.mountd.pid}) at "
                f"{sum(c.value for c in counters)}/{total} files"
            )
            for proc in (victim.mountd, victim.mount, jobs[kill]):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGKILL)
        got = []
        want = len(jobs) - (kill is not None)
        deadline = time.monotonic() + EPOCH_TIMEOUT
        while len(got) < want:
            try:
                item = results.get(timeout=1.0)
            except queue.Empty:
                if time.monotonic() > deadline:
                    raise RuntimeError("an epoch took longer than its timeout") from None
                continue
            if kill is None or item[0] != seed * 100 + kill:
                got.append(item)
    finally:
        for job in jobs:
            if job.is_alive():
                job.kill()
            job.join()
    after = sum(w.counters()["remote_bytes"] for w in live)
    return Epoch(
        remote_bytes=after - before,
        seconds=max(end for _, _, end, _ in got) - min(start for _, start, _, _ in got),
        files=sum(t["files"] for *_, t in got),
        wrong=sum(t["wrong"] for *_, t in got),
        errors=sum(t["errors"] for *_, t in got),
        complete=all(t["files"] == len(hashes) for *_, t in got),
    )


# -- the nodes ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class NodeConfig(MountdConfig):
    """mountd's flags plus the cluster's (``--cluster``, ``--advertise``, ...)."""

    extra: tuple[str, ...] = ()

    def flags(self) -> list[str]:
        return [*super().flags(), *self.extra]


@contextlib.contextmanager
def nodes(
    dataset: Dataset,
    name: str,
    cache_size: int,
    env: dict[str, str] | None,
    cluster: tuple[str, Path] | None,
) -> Iterator[list[World]]:
    """Four worlds (mountd + mount each), in a cluster through ``cluster`` = (Redis URL,
    secret file) or alone; all stopped on the way out."""
    from quiverfs.testing.emulators import free_port

    worlds = []
    with contextlib.ExitStack() as stack:
        for i in range(NODES):
            extra: tuple[str, ...] = ()
            if cluster is not None:
                extra = (
                    "--cluster",
                    cluster[0],
                    "--advertise",
                    f"127.0.0.1:{free_port()}",
                    "--cluster-secret-file",
                    str(cluster[1]),
                    "--cluster-name",
                    "bench",
                )
            config = NodeConfig(cache_size=cache_size, remote_concurrency=16, extra=extra)
            worlds.append(
                stack.enter_context(
                    World(dataset, f"{name}-n{i}", config, root=WORK / "worlds", env=env)
                )
            )
        if cluster is not None:
            wait_for(
                lambda: all(len(w.stats()["cluster"]["members"]) == NODES for w in worlds),
                "every node to see the others",
            )
        yield worlds


def run_mode(
    dataset: Dataset,
    hashes: list[bytes],
    args: argparse.Namespace,
    name: str,
    env: dict[str, str] | None,
    cluster: tuple[str, Path] | None,
) -> tuple[list[Epoch], Epoch | None, dict]:
    """``args.epochs`` epochs on fresh nodes (and, for the cluster, one with a node killed)."""
    cache_size = int(dataset.total_bytes * CACHE_SHARE)
    epochs: list[Epoch] = []
    killed = None
    with nodes(dataset, name, cache_size, env, cluster) as worlds:
        for e in range(args.epochs):
            epoch = run_epoch(worlds, hashes, args.threads, seed=e)
            epochs.append(epoch)
            progress(
                f"  {name} epoch {e + 1}: {epoch.seconds:.1f} s, bucket bytes ÷ dataset "
                f"{epoch.remote_bytes / dataset.total_bytes:.3f}"
            )
        if cluster is not None:
            killed = run_epoch(worlds, hashes, args.threads, seed=args.epochs, kill=NODES - 1)
            progress(f"  {name} epoch {args.epochs + 1} with a node killed: {killed.seconds:.1f} s")
        stats = {}
        for i, w in enumerate(worlds[: NODES - (cluster is not None)]):
            snap = w.stats()
            stats[i] = snap.get("cluster", {}), snap["counters"]["total"]
    return epochs, killed, stats


# -- the report ---------------------------------------------------------------------------------------


def verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def report(
    args: argparse.Namespace,
    dataset: Dataset,
    cluster: list[Epoch],
    alone: list[Epoch],
    killed: Epoch,
    stats: dict,
) -> bool:
    total = dataset.total_bytes
    print(
        f"\n{NODES} nodes on one machine, one job each reading every file every epoch (shuffled, "
        f"{args.threads} threads, through its node's mount); dataset {len(dataset.rels):,} files x "
        f"{dataset.spec.file_size // 1024} KiB = {total / 2**20:.0f} MiB in the {args.source} bucket; "
        f"each node's --cache-size {CACHE_SHARE:.0%} of it; {os.cpu_count()} CPUs"
    )
    print(
        f"{'epoch':<8}{'cluster: bucket ÷ dataset':>27}{'independent: bucket ÷ dataset':>31}"
        f"{'cluster s':>11}{'independent s':>15}"
    )
    for e, (c, a) in enumerate(zip(cluster, alone, strict=True)):
        print(
            f"{e + 1:<8}{c.remote_bytes / total:>27.3f}{a.remote_bytes / total:>31.3f}"
            f"{c.seconds:>11.1f}{a.seconds:>15.1f}"
        )
    all_cluster = sum(c.remote_bytes for c in cluster) / total
    print(f"{'all':<8}{all_cluster:>27.3f}{sum(a.remote_bytes for a in alone) / total:>31.3f}")
    worst = max(c.remote_bytes for c in cluster) / total
    remote_ok = worst <= TARGET_REMOTE
    print(
        f"cluster bucket bytes ÷ dataset bytes, worst epoch {worst:.3f} (target <= "
        f"{TARGET_REMOTE}): {verdict(remote_ok)}"
    )
    base = cluster[-1].seconds
    ratio = killed.seconds / base
    kill_ok = ratio <= TARGET_KILL
    print(
        f"epoch with node {NODES - 1} killed (kill -9 halfway): {killed.seconds:.1f} s ÷ "
        f"{base:.1f} s without = {ratio:.2f} (target <= {TARGET_KILL}): {verdict(kill_ok)}; "
        f"bucket bytes ÷ dataset in it {killed.remote_bytes / total:.3f}"
    )
    intact = (
        killed.complete
        and killed.wrong == 0
        and killed.errors == 0
        and all(c.complete and c.wrong == 0 and c.errors == 0 for c in cluster + alone)
    )
    print(
        f"nothing lost: {killed.files:,} files read by the {NODES - 1} surviving jobs in the "
        f"kill epoch, {killed.wrong} with wrong bytes, {killed.errors} read errors (every "
        f"epoch: every file's blake3 checked): {verdict(intact)}"
    )
    keys = ("peer_hits", "bucket_turns", "lock_waits", "take_overs", "pushes", "served_hits")
    for i, (cl, total_counters) in sorted(stats.items()):
        shown = ", ".join(f"{k} {cl.get(k, 0)}" for k in keys)
        print(f"node {i}: {shown}, evicted {total_counters['evicted_files']}")
    return remote_ok and kill_ok and intact


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--files", type=int, default=None, help="default 2000; --quick 400")
    parser.add_argument(
        "--file-size", type=int, default=None, help="bytes; default 64 KiB; --quick 32 KiB"
    )
    parser.add_argument(
        "--epochs", type=int, default=None, help="epochs before the kill; default 3; --quick 2"
    )
    parser.add_argument("--threads", type=int, default=4, help="reader threads per job")
    parser.add_argument(
        "--source",
        choices=("s3", "file"),
        default="s3",
        help="the bucket: moto's S3 server (default) or a file:// directory",
    )
    parser.add_argument("--quick", action="store_true", help="a small run")
    args = parser.parse_args()
    args.files = args.files or (400 if args.quick else 2000)
    args.file_size = args.file_size or ((32 if args.quick else 64) << 10)
    args.epochs = args.epochs or (2 if args.quick else 3)
    if os.geteuid() != 0 or not os.path.exists("/dev/fuse"):
        raise SystemExit("needs root and /dev/fuse")
    sigterm_as_interrupt()
    from quiverfs.testing.redis import run_redis

    started = time.monotonic()
    WORK.mkdir(parents=True, exist_ok=True)
    secret = WORK / "cluster.secret"
    secret.write_bytes(os.urandom(32).hex().encode())
    secret.chmod(0o600)
    spec = DatasetSpec(files=args.files, file_size=args.file_size)
    try:
        with source(args.source, spec) as (dataset, env):
            by_path = digest_hashes(dataset.digest)
            hashes = [by_path[rel] for rel in dataset.rels]
            shutil.rmtree(WORK / "redis", ignore_errors=True)
            with run_redis(WORK / "redis") as redis_server:
                progress(f"cluster of {NODES} (Redis {redis_server.url})")
                cluster, killed, stats = run_mode(
                    dataset, hashes, args, "cluster", env, (redis_server.url, secret)
                )
            progress(f"{NODES} independent nodes")
            alone, _, _ = run_mode(dataset, hashes, args, "alone", env, None)
    except KeyboardInterrupt:
        raise SystemExit("interrupted: mounts and processes stopped") from None
    assert killed is not None
    ok = report(args, dataset, cluster, alone, killed, stats)
    print(f"wall {time.monotonic() - started:.0f} s")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
