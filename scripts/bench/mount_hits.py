#!/usr/bin/env python3
"""Warm hits through the mount vs. reading the same store files directly, side by side.

4,000 files of 110 KiB (all already in the store), 4 reader processes, each reading a
disjoint quarter with ``open()+read()+close()``. Measured in one run:

* direct: the readers open the store files themselves (``mountd.store.layout.store_path``);
* mount, first pass: right after a fresh mount (no dentry or page of the mount cached; the
  store files stay warm), so every file costs LOOKUP + OPEN + READ + RELEASE;
* mount, second pass: the same files again (``keep_cache``: the kernel keeps their pages, so
  only OPEN and RELEASE reach the mount);
* the same two passes through a mount with ``--passthrough`` (the kernel reads the store files;
  every open costs an OPEN and a RELEASE: docs/mount.md "Passthrough");
* informative: a first pass on a fresh mount whose directories were listed first (untimed),
  as ``ImageFolder`` does: the listing gives the kernel every dentry, so no LOOKUPs;
* for calibration, the same two passes through a naive pyfuse3 passthrough of the same store
  files (a dict from path to store file, inline ``os.pread``, keep_cache): the floor that
  pyfuse3 + trio set on this machine, whatever the filesystem does;
* for calibration, the same two passes through ``native_floor.c``, a libfuse low-level server
  in C doing what the mount does on a hit and nothing more (built with gcc when it is there);
* what the machine charges for the first pass, probed in the same run: a pipe round trip
  between processes on two CPUs and on one CPU (every FUSE request is one such round trip),
  and the cost of a fresh page (the first pass fills the mount's page cache).

Targets: first pass >= 0.15 of direct, second pass >= 0.30 of direct.

    .venv/bin/python scripts/bench/mount_hits.py [--files 4000] [--readers 4] [--profile]

``--profile`` runs the mount under cProfile and prints its top functions (what limits it).
Needs root and FUSE; everything lives under .bench/mount_hits/ (git-ignored).
"""

from __future__ import annotations

import argparse
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

import blake3  # noqa: E402
import trio  # noqa: E402

WORK = os.path.join(REPO, ".bench", "mount_hits")
FILE_SIZE = 110 * 1024
TARGET_FIRST = 0.15
TARGET_SECOND = 0.30
WORKERS = 0  # --workers of the mount (0: its default)


def quiverfs(*args: str) -> list[str]:
    return [sys.executable, "-m", "quiverfs.cli", *args]


def wait_for(predicate, what: str, timeout: float = 60.0, alive=None) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if alive is not None and alive() is not None:
            raise SystemExit(f"{what}: the process exited with {alive()}")
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.01)


def prepare(n_files: int) -> tuple[str, str, list[str]]:
    """Source tree, digest and the relative paths (rebuilt when the file count changes)."""
    from digests.build import build

    source = os.path.join(WORK, f"src-{n_files}")
    digest = os.path.join(WORK, f"hits-{n_files}.qd")
    rels = [f"class_{i % 40:02d}/img_{i:06d}.jpg" for i in range(n_files)]
    if not os.path.exists(digest):
        rng = random.Random(5)
        for rel in rels:
            path = os.path.join(source, rel)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as f:
                f.write(rng.randbytes(FILE_SIZE))
        trio.run(lambda: build("file://" + source, digest))
    return source, digest, rels


def _reader(paths: list[str], barrier, results) -> None:
    barrier.wait()
    start = time.perf_counter()
    total = 0
    for path in paths:
        with open(path, "rb") as f:
            total += len(f.read())
    results.put((time.perf_counter() - start, total))


def read_pass(paths: list[str], readers: int) -> float:
    """Files/s of ``readers`` processes reading disjoint shares of ``paths`` at once."""
    ctx = multiprocessing.get_context("fork")
    barrier = ctx.Barrier(readers + 1)
    results = ctx.Queue()
    shares = [paths[i::readers] for i in range(readers)]
    procs = [ctx.Process(target=_reader, args=(share, barrier, results)) for share in shares]
    for p in procs:
        p.start()
    barrier.wait()
    start = time.perf_counter()
    outs = [results.get() for _ in procs]
    wall = time.perf_counter() - start
    for p in procs:
        p.join()
    expected = len(paths) * FILE_SIZE
    got = sum(total for _, total in outs)
    if got != expected:
        raise SystemExit(f"read {got} bytes, expected {expected}")
    return len(paths) / wall


def build_native_floor() -> str | None:
    """Compile native_floor.c (gcc and libfuse3's headers); its path, or None with a reason printed."""
    source = os.path.join(os.path.dirname(os.path.abspath(__file__)), "native_floor.c")
    binary = os.path.join(WORK, "native_floor")
    if os.path.exists(binary) and os.path.getmtime(binary) >= os.path.getmtime(source):
        return binary
    try:
        flags = subprocess.run(["pkg-config", "--cflags", "--libs", "fuse3"], capture_output=True, text=True,
                               check=True).stdout.split()
        subprocess.run(["gcc", "-O2", "-o", binary, source, *flags], capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = (getattr(exc, "stderr", None) or str(exc)).strip().splitlines() or [repr(exc)]
        print(f"native floor skipped: cannot build it ({detail[-1]})")
        return None
    return binary


def _pingpong(rounds: int, cpus: tuple[int, int] | None) -> float:
    """Microseconds per round trip of one byte between two processes (pinned to ``cpus``)."""
    r1, w1 = os.pipe()
    r2, w2 = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the echoing child
        if cpus:
            os.sched_setaffinity(0, {cpus[1]})
        for _ in range(rounds):
            os.read(r1, 1)
            os.write(w2, b"x")
        os._exit(0)
    mask = os.sched_getaffinity(0)
    try:
        if cpus:
            os.sched_setaffinity(0, {cpus[0]})
        start = time.perf_counter()
        for _ in range(rounds):
            os.write(w1, b"x")
            os.read(r2, 1)
        elapsed = time.perf_counter() - start
    finally:
        os.sched_setaffinity(0, mask)
        os.waitpid(pid, 0)
        for fd in (r1, w1, r2, w2):
            os.close(fd)
    return elapsed / rounds * 1e6


def _fresh_page_us() -> float:
    """Microseconds to fault in one new page of anonymous memory (256 MiB, touched once)."""
    import mmap

    size = 256 << 20
    area = mmap.mmap(-1, size)
    try:
        start = time.perf_counter()
        for offset in range(0, size, mmap.PAGESIZE):
            area[offset] = 1
        return (time.perf_counter() - start) / (size // mmap.PAGESIZE) * 1e6
    finally:
        area.close()


def probe_machine() -> dict[str, float]:
    """What one FUSE round trip and one page of the first pass cost on this machine."""
    cpus = sorted(os.sched_getaffinity(0))
    probe = {"same_cpu_us": _pingpong(5000, (cpus[0], cpus[0])), "fresh_page_us": _fresh_page_us()}
    if len(cpus) > 1:
        probe["cross_cpu_us"] = _pingpong(5000, (cpus[0], cpus[1]))
    try:
        with open("/sys/module/haltpoll/parameters/guest_halt_poll_ns") as f:
            probe["guest_halt_poll_ns"] = float(f.read())
    except (OSError, ValueError):
        pass
    return probe


class Mount:
    """A mount for one round: ``quiverfs mount --foreground``, or one of the calibration servers
    (the pyfuse3 passthrough, the native floor). Its stderr is appended to ``WORK/mount.err``."""

    def __init__(self, digest: str, mountpoint: str, cache: str, profile: str | None = None,
                 passthrough: bool = False, native: tuple[str, str] | None = None,
                 options: tuple[str, ...] = ()) -> None:
        self.digest, self.mountpoint, self.cache, self.profile = digest, mountpoint, cache, profile
        self.passthrough = passthrough  # the pyfuse3 calibration server (not --passthrough)
        self.options = options  # more `quiverfs mount` options
        self.native = native  # (binary, list file) of the native floor
        self.proc: subprocess.Popen | None = None
        self.stderr = None

    def __enter__(self) -> Mount:
        try:
            os.makedirs(self.mountpoint, exist_ok=True)
        except OSError:  # a dead mount left by an interrupted run: ENOTCONN
            subprocess.run(["fusermount3", "-u", "-z", self.mountpoint], check=False, capture_output=True)
            os.makedirs(self.mountpoint, exist_ok=True)
        if self.native:
            cmd = [self.native[0], self.mountpoint, self.native[1]]
        elif self.passthrough:
            cmd = [sys.executable, os.path.abspath(__file__), "--passthrough-serve", self.mountpoint,
                   self.digest, self.cache]
        else:
            cmd = quiverfs("mount", "--foreground", "--cache-dir", self.cache, "--workers", str(WORKERS),
                           *self.options, self.digest, self.mountpoint)
            if self.profile:
                cmd = [sys.executable, "-m", "cProfile", "-o", self.profile, *cmd[1:]]
        self.stderr = open(os.path.join(WORK, "mount.err"), "ab")  # noqa: SIM115 - closed in __exit__
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdin=subprocess.DEVNULL, stderr=self.stderr)
        wait_for(self._ready, "the mount", alive=self.proc.poll)
        return self

    def _ready(self) -> bool:
        try:
            return os.path.ismount(self.mountpoint) and os.stat(self.mountpoint).st_ino == 1
        except OSError:
            return False

    def __exit__(self, *exc: object) -> None:
        if self.passthrough or self.native:
            subprocess.run(["fusermount3", "-u", self.mountpoint], check=False, capture_output=True)
        elif self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # unmounts and writes the profile
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        for flags in (["-u"], ["-u", "-z"]):
            if os.path.ismount(self.mountpoint):
                subprocess.run(["fusermount3", *flags, self.mountpoint], check=False, capture_output=True)
        self.stderr.close()


def serve_passthrough(mountpoint: str, digest_path: str, cache: str) -> None:
    """The calibration filesystem: the digest's files, flattened to one level, served from the
    store with the least Python per request pyfuse3 allows."""
    import errno
    import stat

    import pyfuse3

    from digests.digest import Digest
    from mountd.store import layout

    with Digest.open(digest_path) as digest:
        files = [(f.path.replace("/", "__").encode(), f.size, str(layout.store_path(cache, f.hash)))
                 for f in digest.iter_files()]
    by_name = {name: ino for ino, (name, _, _) in enumerate(files, 2)}

    def attr(ino: int) -> pyfuse3.EntryAttributes:
        a = pyfuse3.EntryAttributes()
        a.st_ino = ino
        a.entry_timeout = a.attr_timeout = 86400
        a.st_nlink = 1
        if ino == 1:
            a.st_mode = stat.S_IFDIR | 0o555
        else:
            a.st_mode = stat.S_IFREG | 0o444
            a.st_size = files[ino - 2][1]
        return a

    class Passthrough(pyfuse3.Operations):
        async def getattr(self, inode, ctx=None):
            return attr(inode)

        async def lookup(self, parent, name, ctx=None):
            ino = by_name.get(name)
            if ino is None:
                raise pyfuse3.FUSEError(errno.ENOENT)
            return attr(ino)

        async def open(self, inode, flags, ctx):
            return pyfuse3.FileInfo(fh=os.open(files[inode - 2][2], os.O_RDONLY), keep_cache=True)

        async def read(self, fh, off, size):
            return os.pread(fh, size, off)

        async def release(self, fh):
            os.close(fh)

        async def opendir(self, inode, ctx):
            return 1

        async def readdir(self, fh, start, token):
            # Lists nothing: a listing (readdirplus) would hand the kernel every file's dentry
            # and spare the first pass its LOOKUPs, which the quiverfs mount has to answer.
            return

    pyfuse3.init(Passthrough(), mountpoint, set(pyfuse3.default_options) | {"ro"})
    try:
        trio.run(pyfuse3.main)  # until fusermount3 -u
    finally:
        pyfuse3.close(unmount=False)


def main() -> None:
    if len(sys.argv) == 5 and sys.argv[1] == "--passthrough-serve":
        serve_passthrough(*sys.argv[2:])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--files", type=int, default=4000)
    parser.add_argument("--readers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2, help="fresh mounts per filesystem (best reported)")
    parser.add_argument("--profile", action="store_true", help="profile the mount process (cProfile)")
    parser.add_argument("--workers", type=int, default=0, help="processes serving the mount (0: its default)")
    args = parser.parse_args()
    global WORKERS
    WORKERS = args.workers
    if os.geteuid() != 0 or not os.path.exists("/dev/fuse"):
        raise SystemExit("needs root and /dev/fuse")

    from mountd.rpc.client import SyncClient
    from mountd.store import layout

    os.makedirs(WORK, exist_ok=True)
    source, digest, rels = prepare(args.files)
    cache = os.path.join(WORK, "cache")
    from mountd.rpc.client import probe

    if probe(cache, timeout=1.0) is not None:
        raise SystemExit(f"a mountd is running on {cache}: stop it first (the benchmark starts its own)")
    shutil.rmtree(cache, ignore_errors=True)
    mnt = os.path.join(WORK, "mnt")
    mountd = subprocess.Popen(quiverfs("mountd", "--cache-dir", cache, "--cache-size", "4G"), cwd=REPO,
                              stdin=subprocess.DEVNULL)
    try:
        wait_for(lambda: probe(cache, timeout=1.0) is not None, "mountd", alive=mountd.poll)
        # Fill the store (mountd fetches and verifies), then keep the store files warm.
        store_paths = []
        with SyncClient.connect(cache) as client:
            for rel in rels:
                with open(os.path.join(source, rel), "rb") as f:
                    h = blake3.blake3(f.read()).digest()
                client.ensure(h, FILE_SIZE, {"url": "file://" + source, "key": rel, "offset": 0, "length": FILE_SIZE})
                store_paths.append(str(layout.store_path(cache, h)))
        read_pass(store_paths, args.readers)  # warm the page cache of the store files
        direct = max(read_pass(store_paths, args.readers) for _ in range(3))

        mount_paths = [os.path.join(mnt, rel) for rel in rels]
        flat_paths = [os.path.join(mnt, rel.replace("/", "__")) for rel in rels]
        native_binary = build_native_floor()
        native_list = os.path.join(WORK, "native_floor.list")
        with open(native_list, "w") as f:
            for rel, store in zip(rels, store_paths, strict=True):
                f.write(f"{rel.replace('/', '__')}\t{store}\t{FILE_SIZE}\n")
        native_firsts, native_seconds = [], []
        profile = os.path.join(WORK, "mount.prof") if args.profile else None
        firsts, seconds, floor_firsts, floor_seconds, listed_firsts = [], [], [], [], []
        kernel_firsts, kernel_seconds = [], []
        dirs = sorted({os.path.dirname(p) for p in mount_paths})
        for _ in range(args.rounds):  # a fresh mount per round: its first pass starts cold
            with Mount(digest, mnt, cache, profile):
                firsts.append(read_pass(mount_paths, args.readers))
                seconds.append(read_pass(mount_paths, args.readers))
            with Mount(digest, mnt, cache, options=("--passthrough",)):
                kernel_firsts.append(read_pass(mount_paths, args.readers))
                kernel_seconds.append(read_pass(mount_paths, args.readers))
            with Mount(digest, mnt, cache):
                for d in dirs:  # untimed, as ImageFolder lists before reading: no LOOKUPs later
                    os.listdir(d)
                listed_firsts.append(read_pass(mount_paths, args.readers))
            with Mount(digest, mnt, cache, passthrough=True):
                floor_firsts.append(read_pass(flat_paths, args.readers))
                floor_seconds.append(read_pass(flat_paths, args.readers))
            if native_binary:
                with Mount(digest, mnt, cache, native=(native_binary, native_list)):
                    native_firsts.append(read_pass(flat_paths, args.readers))
                    native_seconds.append(read_pass(flat_paths, args.readers))
        direct_after = max(read_pass(store_paths, args.readers) for _ in range(2))
        direct = max(direct, direct_after)
    finally:
        mountd.send_signal(signal.SIGTERM)
        mountd.wait(30)

    first, second = max(firsts), max(seconds)
    ncpu = os.cpu_count()
    print(f"\nwarm hits, {args.files} files x {FILE_SIZE // 1024} KiB, {args.readers} reader processes, "
          f"{ncpu} CPUs, best of {args.rounds} rounds")
    print(f"{'measure':<44}{'files/s':>10}{'ratio':>8}{'target':>9}  result")
    print(f"{'direct reads of the store files':<44}{direct:>10,.0f}")
    for name, value, target in (("quiverfs mount, first pass (fresh mount)", first, TARGET_FIRST),
                                ("quiverfs mount, second pass (keep_cache)", second, TARGET_SECOND)):
        ratio = value / direct
        print(f"{name:<44}{value:>10,.0f}{ratio:>8.3f}{'>= ' + format(target, '.2f'):>9}  "
              f"{'PASS' if ratio >= target else 'FAIL'}")
    for name, value in (("quiverfs mount --passthrough, first pass", max(kernel_firsts)),
                        ("quiverfs mount --passthrough, second pass", max(kernel_seconds))):
        print(f"{name:<44}{value:>10,.0f}{value / direct:>8.3f}")
    listed = max(listed_firsts)
    print(f"{'  first pass after listing (informative)':<44}{listed:>10,.0f}{listed / direct:>8.3f}")
    for name, value in (("naive pyfuse3 passthrough, first pass", max(floor_firsts)),
                        ("naive pyfuse3 passthrough, second pass", max(floor_seconds))):
        print(f"{name:<44}{value:>10,.0f}{value / direct:>8.3f}{'(floor)':>9}")
    if native_firsts:
        for name, value in (("native libfuse server (C), first pass", max(native_firsts)),
                            ("native libfuse server (C), second pass", max(native_seconds))):
            print(f"{name:<44}{value:>10,.0f}{value / direct:>8.3f}{'(floor)':>9}")
    print(f"quiverfs vs the passthrough floor: first pass {first / max(floor_firsts):.2f}x, "
          f"second pass {second / max(floor_seconds):.2f}x")
    print(f"(all rounds: first {[round(x) for x in firsts]}, second {[round(x) for x in seconds]}, "
          f"floor {[round(x) for x in floor_firsts]} / {[round(x) for x in floor_seconds]})")
    machine = probe_machine()
    cross = f"{machine['cross_cpu_us']:.0f} µs across two CPUs, " if "cross_cpu_us" in machine else ""
    print(f"machine: a pipe round trip between two processes takes {cross}{machine['same_cpu_us']:.0f} µs on "
          f"one CPU; a fresh page costs {machine['fresh_page_us']:.1f} µs "
          f"({FILE_SIZE // 4096 + 1} pages per file on a first pass)"
          + (f"; guest_halt_poll_ns={machine['guest_halt_poll_ns']:.0f}" if "guest_halt_poll_ns" in machine else ""))
    if profile:
        import pstats

        print("\nmount process profile (cumulative, top 25):")
        pstats.Stats(profile).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
