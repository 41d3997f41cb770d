"""The soak benchmark's leak check in short (scripts/bench/soak.py, docs/benchmarks.md "Soak").

mountd is SIGKILLed and started again 20 times under one mount, with reads of uncached files
in flight at each kill (they wait for the next mountd and must read the right bytes); after every restart reads of new files (misses) and of old ones
(hits) must succeed with the digest's bytes, without remounting. At the end, the open
descriptors and threads of mountd, of its fill processes and of the mount (main process and
FUSE workers) must be exactly what they were at the start, with the same number of fill
processes and the mount's original workers; killed fill processes must all be gone. Store
files a serving process keeps open are counted apart (a worker keeps a file whose last READ
went to another worker: bounded by design to OPEN_FILES a process, docs/mount.md), and must
stay within that bound.

Counts are compared when the processes are idle: trio keeps a worker thread for 10 s after
its last job (``trio.to_thread``'s cache), so both counts are taken more than 10 s after the
last read, once they have stopped changing. mountd is a new process after each restart: its counts are compared with
the first mountd's at the same point (idle, serving the same mount). No timing is asserted.
The sampling helpers are the benchmark's own (quiverfs/testing/soak.py).
"""

from __future__ import annotations

import os
import random
import threading
import time
from pathlib import Path

import pytest

from mountd.store.layout import store_dir
from quiverfs.filesystem.reads import OPEN_FILES
from quiverfs.testing.soak import DigestTable, Role, alive, fd_targets, sample_role, settled
from tests.mount.conftest import (
    MountdProcess,
    MountProcess,
    build_digest,
    fuse_skip_reason,
    wait_for,
    write_tree,
)

pytestmark = pytest.mark.mount

if (_reason := fuse_skip_reason()) is not None:
    pytest.skip(_reason, allow_module_level=True)

#: Restarts of mountd.
CYCLES = 20
#: Uncached files each cycle reads after the restart (and as many hits).
READS = 4
#: Files read in the background while mountd is killed.
IN_FLIGHT = 4
#: Seconds after the last read when every process counts as idle: longer than trio's thread
#: cache keeps an idle worker thread (10 s).
IDLE = 10.5

RNG = random.Random(36)
FILES = {f"c{i % 4}/f{i:04d}.bin": RNG.randbytes(RNG.randrange(2_000, 40_000))
         for i in range((CYCLES + 2) * (READS + IN_FLIGHT))}


def fd_targets_of(role: Role) -> dict[int, list[str]]:
    """Each of ``role``'s processes' descriptors (for a failure message)."""
    return {pid: fd_targets(pid) for pid in role.pids()}


def _read(path: Path) -> bytes:
    with open(path, "rb") as f:
        data = f.read()
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)  # the next read reaches the mount
    return data


def test_mountd_restarts_leave_no_descriptor_or_thread_behind(tmp_path: Path) -> None:
    source, digest, cache = tmp_path / "source", tmp_path / "d.qd", tmp_path / "cache"
    write_tree(source, FILES)
    build_digest(source, digest)
    table = DigestTable.load(digest)
    rels = table.paths()
    RNG.shuffle(rels)
    fresh = iter(rels)  # each file is first read once: a miss
    done: list[str] = []
    mountds = [MountdProcess(cache, "64M").start()]
    try:
        with MountProcess(digest, tmp_path / "mnt", cache) as mount:
            mnt = mount.mountpoint
            roles = [Role.main("mountd", lambda: mountds[-1].proc.pid),
                     Role.children_of("fill processes", lambda: mountds[-1].proc.pid),
                     Role.main("mount", lambda: mount.proc.pid),
                     Role.children_of("mount workers", lambda: mount.proc.pid)]

            store = str(store_dir(cache)) + "/"

            def kept(pids: tuple[int, ...]) -> int:
                """Store files the processes hold open: the READ path keeps a file it is
                reading (quiverfs/filesystem/reads.py, at most OPEN_FILES a process), e.g. when a
                file's last READ went to another worker; bounded by design, so counted apart."""
                return sum(t.startswith(store) for pid in pids for t in fd_targets(pid))

            def counts() -> dict[str, tuple[int, int, int]]:
                """Per role: processes, descriptors other than kept store files, threads."""
                return {s.role: (s.count, s.fds - kept(s.pids), s.threads) for s in map(sample_role, roles)}

            def read_checked(n: int) -> float:
                """``n`` misses, then as many hits, each with the digest's bytes; when done."""
                for rel in [next(fresh) for _ in range(n)] + done[-n:]:
                    assert table.matches(rel, _read(mnt / rel)), rel
                    if rel not in done:
                        done.append(rel)
                return time.monotonic()

            def idle_counts(last_read: float) -> dict[str, tuple[int, int, int]]:
                """The counts once every process is idle: trio ends a cached worker thread
                10 s after its last job, so no sooner than IDLE seconds after the last read,
                and then unchanged for a second."""
                wait_for(lambda: time.monotonic() >= last_read + IDLE,
                         "the threads of the last reads to go idle", timeout=IDLE + 5, interval=0.1)
                return settled(counts, quiet=1.0, timeout=30)

            workers = sample_role(roles[3]).pids
            start = idle_counts(read_checked(READS))
            for cycle in range(CYCLES):
                # Misses in flight while mountd dies wait for the next one (--mountd-wait,
                # quiverfs/mount/mountd_wait.py) and read the right bytes.
                batch = [next(fresh) for _ in range(IN_FLIGHT)]
                failed: list[int] = []

                def in_flight(paths: list[str] = batch, failed: list[int] = failed) -> None:
                    for rel in paths:
                        try:
                            assert table.matches(rel, _read(mnt / rel)), rel
                        except OSError as exc:
                            failed.append(exc.errno)

                reader = threading.Thread(target=in_flight)
                reader.start()
                fills = sample_role(roles[1]).pids
                mountds[-1].kill()
                wait_for(lambda fills=fills: not any(map(alive, fills)),
                         f"cycle {cycle}: the killed mountd's fill processes to exit", timeout=10)
                mountds.append(MountdProcess(cache, "64M").start())
                reader.join(30)
                assert not reader.is_alive(), f"cycle {cycle}: a read hung after mountd came back"
                assert failed == [], f"cycle {cycle}: reads failed across the restart: {failed}"
                last_read = read_checked(READS)  # the same mount: it reconnected by itself
                assert mount.died() is None
            end = idle_counts(last_read)
            assert sample_role(roles[3]).pids == workers, "the mount's workers were replaced"
            descriptors = {role.name: fd_targets_of(role) for role in roles}
            assert end == start, (
                "descriptors or threads (processes, descriptors, threads per role) not back to their "
                f"start after {CYCLES} restarts of mountd: start {start}, end {end}; "
                f"descriptors now: {descriptors}")
            for role in roles:
                for pid in role.pids():
                    assert kept((pid,)) <= OPEN_FILES, f"{role.name} {pid} keeps {kept((pid,))} store files"
    finally:
        for mountd in mountds:
            mountd.stop()
