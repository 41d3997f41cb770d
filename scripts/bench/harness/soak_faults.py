"""The faults of the soak (scripts/bench/soak.py), one class each.

Each fault gets the running soak (``scripts/bench/soak.py``'s ``Soak``: its plan, mountd,
mounts, datasets, proxy and cache directory) and does to it what an operator's bad day
would: :meth:`Fault.begin` makes it happen, :meth:`Fault.step` ends it once its time is up.
Kept apart from the run so the script reads as set-up, loop and report.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from harness.soak_world import Version, build_digest
from quiverfs.testing.soak import DigestTable, FaultWindow, alive, children

#: Share of B's files each digest replacement rewrites.
CHANGED_SHARE = 0.02


class Fault:
    """One fault: :meth:`begin` makes it happen and returns its window; :meth:`step`, called
    every tick, ends it (sets ``window.end``) and returns True once its cause is gone."""

    kind = ""

    def __init__(self, soak: Any) -> None:
        self.soak = soak
        self.window = FaultWindow(self.kind, time.time(), grace=soak.plan.grace)

    def begin(self) -> FaultWindow:
        raise NotImplementedError

    def step(self, now: float) -> bool:
        raise NotImplementedError

    def finish(self, note: str = "") -> bool:
        self.window.end = time.time()
        if note:
            self.window.note = f"{self.window.note}; {note}" if self.window.note else note
        return True


class MountdKill(Fault):
    """mountd SIGKILLed (its fill processes die with it), started again after
    ``plan.mountd_down`` seconds; the window ends when it answers."""

    kind = "mountd-kill"

    def begin(self) -> FaultWindow:
        self.orphans = self.soak.mountd.kill()
        self.window.note = f"SIGKILL, {len(self.orphans)} fill processes"
        return self.window

    def step(self, now: float) -> bool:
        if now < self.window.start + self.soak.plan.mountd_down:
            return False
        self.soak.mountd.start()
        left = [pid for pid in self.orphans if alive(pid)]
        self.soak.leftovers += [f"fill process {pid} of a killed mountd" for pid in left]
        return self.finish(f"answering again after {time.time() - self.window.start:.1f} s"
                           + (f"; {len(left)} fill processes still alive" if left else ""))


class BucketDown(Fault):
    """Every S3 request of dataset A answered ``503 SlowDown`` for half of
    ``plan.bucket_down`` seconds, then every connection reset (TCP RST) for the other half."""

    kind = "bucket-down"

    def begin(self) -> FaultWindow:
        self.soak.proxy.arm("503", None)
        self.mode = "503"
        self.window.targets = ("A",)
        self.before = self.soak.proxy.faults_injected
        return self.window

    def step(self, now: float) -> bool:
        elapsed = now - self.window.start
        if self.mode == "503" and elapsed >= self.soak.plan.bucket_down / 2:
            self.soak.proxy.arm("reset", None)
            self.mode = "reset"
        if elapsed < self.soak.plan.bucket_down:
            return False
        self.soak.proxy.disarm()
        return self.finish(f"503 then RST, {self.soak.proxy.faults_injected - self.before} requests refused")


class WorkerKill(Fault):
    """One FUSE worker of a mount (A's, then B's, in turn) SIGKILLed; the window ends when
    the mount has forked its replacement."""

    kind = "worker-kill"

    def begin(self) -> FaultWindow:
        self.mount = self.soak.mounts[self.soak.worker_kills % 2]
        self.soak.worker_kills += 1
        self.window.targets = (self.mount.dataset.tag,)
        self.workers = children(self.mount.pid or 0)
        self.victim = self.workers[0] if self.workers else None
        if self.victim is not None:
            os.kill(self.victim, signal.SIGKILL)
        self.window.note = f"mount {self.mount.dataset.tag}, worker {self.victim} of {len(self.workers)}"
        return self.window

    def step(self, now: float) -> bool:
        now_workers = children(self.mount.pid or 0)
        if self.victim is None or (self.victim not in now_workers and len(now_workers) >= len(self.workers)):
            return self.finish(f"replaced after {now - self.window.start:.1f} s")
        if now - self.window.start > 30:
            return self.finish("NOT replaced within 30 s")
        return False


class DiskFull(Fault):
    """Another program (``dd``) fills the cache's filesystem to its last block; the filler
    is removed after ``plan.disk_full`` seconds."""

    kind = "disk-full"

    def begin(self) -> FaultWindow:
        self.filler = self.soak.cachefs / "filler"
        # Another program: dd writes until ENOSPC (its exit status 1 is expected), then the
        # blocks left by the last partial megabyte in 4 KiB.
        for block, extra in (("1M", []), ("4k", ["oflag=append", "conv=notrunc"])):
            subprocess.run(["dd", "if=/dev/zero", f"of={self.filler}", f"bs={block}", "status=none", *extra],
                           check=False, capture_output=True)
        st = os.statvfs(self.soak.cachefs)
        usage = ", ".join(f"{name} {size / 2**20:.1f}" for name, size in disk_usage(self.soak.cache_dir))
        self.window.note = (f"filler {self.filler.stat().st_size / 2**20:.1f} MiB, "
                            f"{st.f_bavail * st.f_frsize // 1024} KiB left; cache dir MiB: {usage}")
        return self.window

    def step(self, now: float) -> bool:
        if now < self.window.start + self.soak.plan.disk_full:
            return False
        self.filler.unlink(missing_ok=True)
        return self.finish()


class DigestReplace(Fault):
    """A share of B's files rewritten, B's digest rebuilt and renamed over the file B was
    mounted from (the mount goes on serving its private copy); after ``plan.digest_hold``
    seconds B is mounted again on the new digest, and the window ends when it answers."""

    kind = "digest-replace"

    def begin(self) -> FaultWindow:
        b = self.soak.datasets["B"]
        assert b.source is not None
        self.window.targets = ("B",)
        rng = random.Random(f"replace-{len(b.versions)}")
        changed = rng.sample(b.rels, max(1, int(len(b.rels) * CHANGED_SHARE)))
        for rel in changed:  # rewritten in place, as a sync of an updated dataset would
            (b.source / rel).write_bytes(rng.randbytes(b.file_size))
        build_digest(b.url, b.digest)
        b.versions.append(Version(DigestTable.load(b.digest), 0.0))
        self.window.note = f"{len(changed)} files changed, digest v{len(b.versions) - 1} renamed over B.qd"
        return self.window

    def step(self, now: float) -> bool:
        if now < self.window.start + self.soak.plan.digest_hold:
            return False
        b = self.soak.datasets["B"]
        mount = self.soak.mounts[1]
        status = mount.stop()
        b.versions[-2].end = time.time()
        if status not in (0, None):
            self.soak.leftovers.append(f"the mount of B (old digest) exited {status} when stopped")
        b.versions[-1].start = time.time()
        mount.start()
        return self.finish(f"mounted again on the new digest after {time.time() - self.window.start:.1f} s")


def index_bytes(cache_dir: Path) -> int:
    """Bytes of the cache's index and its write-ahead log (``index.sqlite*``)."""
    total = 0
    for path in cache_dir.glob("index.sqlite*"):
        with contextlib.suppress(OSError):
            total += path.stat().st_size
    return total


def disk_usage(cache_dir: Path) -> list[tuple[str, int]]:
    """Blocks used under each top-level entry of the cache directory (bytes), largest first."""
    out = []
    for entry in os.scandir(cache_dir):
        total = 0
        for root, _, files in os.walk(entry.path) if entry.is_dir(follow_symlinks=False) else [("", [], [entry.path])]:
            for name in files:
                with contextlib.suppress(OSError):
                    total += os.lstat(os.path.join(root, name)).st_blocks * 512
        out.append((entry.name, total))
    return sorted(out, key=lambda item: -item[1])


FAULTS = {cls.kind: cls for cls in (MountdKill, BucketDown, WorkerKill, DiskFull, DigestReplace)}
