"""A benchmark "world": a synthetic dataset in a ``file://`` bucket, a mountd and a mount.

    spec = DatasetSpec(files=1200, file_size=32 * 1024)
    dataset = make_dataset(spec)                       # built once under .bench/datasets/
    config = MountdConfig(cache_size=dataset.total_bytes * 2, remote_bandwidth=4e6,
                          remote_requests=150, dataset_mode="full")
    with World(dataset, "coop", config) as world:      # fresh cache dir, mountd, mount
        before = world.counters()
        ...                                            # jobs read world.paths
        after = world.counters()
    # unmounted and mountd stopped, also after an exception or Ctrl-C

The bucket is a local directory, read by quiverfs's own ``file://`` backend; mountd's remote
limits (``--remote-bandwidth``, ``--remote-requests``) make it the bottleneck, as the cloud
buckets of the Quiver and DELI papers are. mountd and the mount run in their own sessions
(``start_new_session``) so that a Ctrl-C reaches only the benchmark, which then tears them
down in order: unmount (``fusermount3 -u``, then ``-z``), stop the mount process, stop
mountd (SIGTERM, then SIGKILL). A world left behind by a killed run (a mountd still serving
the cache directory, a stale mount) is cleaned up when the next one starts.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from quiverfs.testing.mountd import log_tail, stop_process
from quiverfs.testing.soak import children

REPO = Path(__file__).resolve().parents[3]
BENCH = REPO / ".bench"

#: Seconds mountd or a mount may take to stop after SIGTERM before it is killed.
STOP_TIMEOUT = 15.0

#: Seconds mountd or a mount may take to become ready.
READY_TIMEOUT = 60.0


def quiverfs_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "quiverfs.cli", *args]


def wait_for(predicate: Callable[[], bool], what: str, timeout: float = READY_TIMEOUT,
             alive: Callable[[], str | None] | None = None) -> None:
    """Poll ``predicate`` until true; fail after ``timeout`` or when ``alive()`` names a death."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if alive is not None and (died := alive()):
            raise RuntimeError(f"{what}: {died}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(0.02)


def sigterm_as_interrupt() -> None:
    """Turn SIGTERM into KeyboardInterrupt, so ``with World(...)`` tears down on both."""

    def handler(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, handler)


# -- the dataset ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class DatasetSpec:
    """A synthetic dataset: ``files`` files of ``file_size`` random bytes in ``classes``
    directories (ImageFolder-like); ``seed`` makes the bytes reproducible."""

    files: int = 1200
    file_size: int = 32 * 1024
    classes: int = 10
    seed: int = 0

    @property
    def name(self) -> str:
        return f"ds-{self.files}x{self.file_size}-c{self.classes}-s{self.seed}"


@dataclass(frozen=True)
class Dataset:
    """A built dataset: its bucket directory, digest, id and relative paths."""

    spec: DatasetSpec
    source: Path
    digest: Path
    dataset_id: str
    rels: tuple[str, ...]
    total_bytes: int

    @property
    def url(self) -> str:
        return "file://" + str(self.source)


def make_dataset(spec: DatasetSpec, root: Path = BENCH / "datasets") -> Dataset:
    """Write the files and build the digest, once per spec (later calls reuse them)."""
    import trio

    from digests.build import build

    base = root / spec.name
    source, digest, done = base / "bucket", base / "dataset.qd", base / "built.json"
    rels = tuple(f"class_{i % spec.classes:03d}/img_{i:07d}.bin" for i in range(spec.files))
    if done.exists():
        meta = json.loads(done.read_text())
        return Dataset(spec, source, digest, meta["dataset_id"], rels, meta["total_bytes"])
    shutil.rmtree(base, ignore_errors=True)
    rng = random.Random(spec.seed)
    for rel in rels:  # random bytes: no two files share a content hash
        path = source / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(rng.randbytes(spec.file_size))
    result = trio.run(lambda: build("file://" + str(source), digest))
    total = spec.files * spec.file_size
    done.write_text(json.dumps({"dataset_id": result.dataset_id, "total_bytes": total}))
    return Dataset(spec, source, digest, result.dataset_id, rels, total)


# -- mountd and the mount ---------------------------------------------------------------------------


@dataclass(frozen=True)
class MountdConfig:
    """mountd's flags for one world (bytes, bytes/s, requests/s; None: unlimited/default)."""

    cache_size: int
    remote_bandwidth: float | None = None
    remote_requests: float | None = None
    remote_concurrency: int | None = None
    dataset_mode: str | None = None
    chunk_slots: int | None = None
    chunk_grace: float | None = None
    #: ``--remote-latency-ms``: each remote request's delay to its first byte (None: none).
    remote_latency_ms: float | None = None
    #: ``--max-span`` in bytes (chunk fills of packed datasets; 0: off; None: mountd's default).
    max_span: int | None = None
    #: ``--fill-processes`` (0: fills in mountd's own threads; None: mountd's default, a core each).
    fill_processes: int | None = None

    def flags(self) -> list[str]:
        out = ["--cache-size", str(int(self.cache_size))]
        if self.remote_bandwidth:
            out += ["--remote-bandwidth", str(int(self.remote_bandwidth))]
        if self.remote_requests:
            out += ["--remote-requests", f"{self.remote_requests:g}"]
        if self.remote_concurrency:
            out += ["--remote-concurrency", str(self.remote_concurrency)]
        if self.dataset_mode:
            out += ["--dataset-mode", self.dataset_mode]
        if self.chunk_slots:
            out += ["--chunk-slots", str(self.chunk_slots)]
        if self.chunk_grace is not None:
            out += ["--chunk-grace", f"{self.chunk_grace:g}"]
        if self.remote_latency_ms:
            out += ["--remote-latency-ms", f"{self.remote_latency_ms:g}"]
        if self.fill_processes is not None:
            out += ["--fill-processes", str(self.fill_processes)]
        if self.max_span is not None:
            out += ["--max-span", str(int(self.max_span))]
        return out


def _is_mounted(path: Path) -> bool:
    from quiverfs.mount.mountpoint import mounted_fstype

    return mounted_fstype(path) is not None


def force_unmount(path: Path) -> None:
    """``fusermount3 -u``, then ``-z`` if that did not do it."""
    for flags in (["-u"], ["-u", "-z"]):
        if not _is_mounted(path):
            return
        subprocess.run(["fusermount3", *flags, str(path)], capture_output=True, check=False)


def stop_mountd_of(cache_dir: Path) -> None:
    """Stop a mountd left serving ``cache_dir`` by an earlier, killed run."""
    from mountd.errors import MountdUnavailable
    from mountd.rpc.client import SyncClient

    try:
        with SyncClient.connect(cache_dir, timeout=2.0) as client:
            pid = client.stats()["server"]["pid"]
    except (MountdUnavailable, OSError):
        return
    try:
        os.kill(pid, signal.SIGTERM)
        wait_for(lambda: not os.path.exists(f"/proc/{pid}"), f"old mountd {pid} to stop", 15)
    except ProcessLookupError:
        pass
    except RuntimeError:
        os.kill(pid, signal.SIGKILL)


def mount_answers(mountpoint: Path) -> bool:
    """Whether a mount serves at ``mountpoint`` and lists its root (the kernel's handshake
    only shows at the first access: MEASURED.md)."""
    if not os.path.ismount(mountpoint):
        return False
    try:
        return bool(os.listdir(mountpoint))
    except OSError:
        return False


def process_cpu(pid: int, thread: int | None = None) -> float:
    """User plus system CPU seconds of process ``pid`` (all its threads), or of its thread
    ``thread`` alone; 0 once it is gone."""
    stat = f"/proc/{pid}/stat" if thread is None else f"/proc/{pid}/task/{thread}/stat"
    try:
        with open(stat) as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """``after - before`` per role (a child that exited in between counts from zero: its
    CPU then moved to its parent's waited-for children, which /proc does not show)."""
    return {role: max(0.0, after[role] - before.get(role, 0.0)) for role in after}


class World:
    """A fresh cache directory, a mountd with ``config`` and a mount of ``dataset`` at
    ``.bench/worlds/NAME/mnt``; a context manager that always tears down.

    ``mount_args`` are extra ``quiverfs mount`` options, ``env`` the environment of both
    processes (default: this one's), ``cache_dir`` a cache directory elsewhere (default:
    ``NAME/cache``, e.g. on a filesystem of its own)."""

    def __init__(self, dataset: Dataset, name: str, config: MountdConfig,
                 root: Path = BENCH / "worlds", *, mount_args: Sequence[str] = (),
                 env: Mapping[str, str] | None = None, cache_dir: Path | None = None) -> None:
        self.dataset = dataset
        self.config = config
        self.mount_args = list(mount_args)
        self.env = None if env is None else dict(env)
        self.dir = root / name
        self.cache_dir = cache_dir or self.dir / "cache"
        self.mountpoint = self.dir / "mnt"
        self.mountd_log = self.dir / "mountd.log"
        self.mount_log = self.dir / "mount.log"
        self.mountd: subprocess.Popen | None = None
        self.mount: subprocess.Popen | None = None

    @property
    def paths(self) -> list[str]:
        """Every file of the dataset, through the mount (the dataset's order)."""
        return [str(self.mountpoint / rel) for rel in self.dataset.rels]

    # -- lifetime ------------------------------------------------------------------------------

    def __enter__(self) -> World:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def start(self) -> None:
        from mountd.rpc.client import probe

        self.dir.mkdir(parents=True, exist_ok=True)
        force_unmount(self.mountpoint)  # leftovers of a killed run
        stop_mountd_of(self.cache_dir)
        shutil.rmtree(self.cache_dir, ignore_errors=True)
        self.mountpoint.mkdir(exist_ok=True)
        with open(self.mountd_log, "wb") as log:
            self.mountd = subprocess.Popen(
                quiverfs_cmd("mountd", "--cache-dir", str(self.cache_dir), *self.config.flags()),
                stdin=subprocess.DEVNULL, stdout=log, stderr=log, cwd=REPO, env=self.env,
                start_new_session=True,
            )
        wait_for(lambda: probe(self.cache_dir, timeout=1.0) is not None, "mountd to answer",
                 alive=lambda: self._died(self.mountd, "mountd", self.mountd_log))
        self._start_mount("wb")

    def remount(self) -> None:
        """Unmount and mount again on the same mountd and cache: a fresh mount process and an
        empty kernel page cache for the mount, every file still in the store (a first pass
        through the mount that fills nothing)."""
        force_unmount(self.mountpoint)
        if self.mount is not None:
            stop_process(self.mount, STOP_TIMEOUT)
        self._start_mount("ab")  # after the first mount's log

    def _start_mount(self, log_mode: str) -> None:
        with open(self.mount_log, log_mode) as log:
            self.mount = subprocess.Popen(
                quiverfs_cmd("mount", "--foreground", "--cache-dir", str(self.cache_dir),
                             *self.mount_args, str(self.dataset.digest), str(self.mountpoint)),
                stdin=subprocess.DEVNULL, stdout=log, stderr=log, cwd=REPO, env=self.env,
                start_new_session=True,
            )
        wait_for(self._mount_ready, f"the mount at {self.mountpoint}",
                 alive=lambda: self._died(self.mount, "the mount", self.mount_log))

    def _mount_ready(self) -> bool:
        return mount_answers(self.mountpoint)

    @staticmethod
    def _died(proc: subprocess.Popen | None, what: str, log: Path) -> str | None:
        if proc is not None and proc.poll() is not None:
            return f"{what} exited with {proc.returncode}:\n{log_tail(log)}"
        return None

    def stop(self) -> None:
        """Unmount, stop the mount process, stop mountd; each step runs whatever failed before."""
        try:
            force_unmount(self.mountpoint)
        finally:
            try:
                if self.mount is not None:
                    stop_process(self.mount, STOP_TIMEOUT)
            finally:
                if self.mountd is not None:
                    stop_process(self.mountd, STOP_TIMEOUT)

    # -- while it runs -----------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """mountd's ``stats`` answer (what ``quiverfs stats --json`` is built from)."""
        from mountd.rpc.client import SyncClient

        with SyncClient.connect(self.cache_dir, timeout=10.0) as client:
            return client.stats()

    def protection(self) -> dict[str, Any]:
        """The cache's ``usage.protection``: files fetched ahead, read and dropped unread
        (mountd/store/holds.py; ``quiverfs stats``'s "fetched ahead" line)."""
        from mountd.rpc.client import SyncClient

        with SyncClient.connect(self.cache_dir, timeout=10.0) as client:
            return (client.ls().get("usage") or {}).get("protection") or {}

    def counters(self) -> dict[str, Any]:
        """mountd's total counters: remote_bytes, remote_requests, hits, misses, ..."""
        return self.stats()["counters"]["total"]

    def warm(self, threads: int = 16) -> float:
        """Read every file once through the mount (fills the cache); seconds taken."""
        start = time.perf_counter()

        def read(path: str) -> int:
            with open(path, "rb") as f:
                return len(f.read())

        with concurrent.futures.ThreadPoolExecutor(threads) as pool:
            total = sum(pool.map(read, self.paths))
        if total != self.dataset.total_bytes:
            raise RuntimeError(f"warm-up read {total} bytes, expected {self.dataset.total_bytes}")
        return time.perf_counter() - start

    def cpu(self) -> dict[str, float]:
        """CPU seconds used so far by each role: ``mountd`` (its main process),
        ``fill processes`` (mountd's children), ``mount`` (the mount's main process) and
        ``mount workers`` (its children); with :func:`cpu_delta` around a pass."""
        out = dict.fromkeys(("mountd", "fill processes", "mount", "mount workers"), 0.0)
        for role, proc in (("mountd", self.mountd), ("mount", self.mount)):
            if proc is None:
                continue
            out[role] = process_cpu(proc.pid)
            helpers = "fill processes" if role == "mountd" else "mount workers"
            out[helpers] = sum(process_cpu(child) for child in children(proc.pid))
        return out

    def loop_cpu(self) -> float:
        """CPU seconds of mountd's main thread (its trio event loop) so far: the part of
        mountd's main process that no other thread can take over."""
        return 0.0 if self.mountd is None else process_cpu(self.mountd.pid, self.mountd.pid)

    def mountd_log_lines(self, needle: str) -> list[str]:
        """mountd's log lines containing ``needle`` (e.g. "chunk", "mode")."""
        try:
            return [line for line in self.mountd_log.read_text(errors="replace").splitlines()
                    if needle in line]
        except OSError:
            return []
