"""What a run costs the machine: memory of its processes, disk of its caches, CPU busy.

A :class:`Monitor` thread samples, every :data:`INTERVAL` seconds, the process trees of
three groups — ``jobs`` (the job processes and their DataLoader workers), ``daemons``
(quiverfs's mountd and mount, with their fill processes and workers) and ``server`` (nginx
and s3dir) — and keeps the peak of each group's summed RSS (``/proc/PID/statm``) and, every
:data:`PSS_EVERY` samples, summed PSS (``/proc/PID/smaps_rollup``: shared pages divided among
the processes that map them, so forked workers that share torch's pages are not counted
once each). It also samples the machine's CPU (``/proc/stat``), the server's CPU seconds,
and the disk the caches use, keeping the peak.

**The disk, at no cost to the run.** The monitor shares the machine with the job it
measures, so what it spends is taken from that job. On a filesystem that holds only the
round's caches (harness/cachefs.py), the disk used is the filesystem's used blocks now less
at the round's start (one ``statvfs``). Elsewhere (``--cache-on-root``) it walks the cache
directories every :data:`DISK_EVERY` samples (``du``-like: allocated blocks); that walk costs
~0.3 s of CPU at 20,000 files in a store's fan-out folders (2026-11-30), 15% of a core at
one walk every 2 s, charged to the contenders whose caches hold many files, so the rates of
such a run favour the few-file caches. The monitor's own CPU seconds are kept
(:attr:`Peaks.monitor_cpu`), so a run says what it cost.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field

from quiverfs.testing.soak import children

INTERVAL = 0.5
PSS_EVERY = 4
DISK_EVERY = 4
PAGE = os.sysconf("SC_PAGE_SIZE")
TICK = os.sysconf("SC_CLK_TCK")


def descendants(pid: int) -> list[int]:
    """``pid`` and every process below it."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children(p))
    return out


def rss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * PAGE
    except (OSError, IndexError, ValueError):
        return 0


def pss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0


def cpu_seconds(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / TICK
    except (OSError, IndexError, ValueError):
        return 0.0


def machine_cpu() -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs since boot."""
    with open("/proc/stat") as f:
        values = [int(v) for v in f.readline().split()[1:]]
    idle = values[3] + (values[4] if len(values) > 4 else 0)
    total = sum(values[:8])
    return total - idle, total


def used_bytes(filesystem: str) -> int:
    """Bytes the filesystem mounted at ``filesystem`` has in use (blocks not free)."""
    st = os.statvfs(filesystem)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def disk_bytes(path: str) -> int:
    """Allocated bytes of every file under ``path`` (what ``du`` counts)."""
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
            except OSError:
                continue
    return total


@dataclass
class Peaks:
    rss: dict[str, int] = field(default_factory=dict)
    pss: dict[str, int] = field(default_factory=dict)
    disk: int = 0
    #: (time, busy jiffies, total jiffies, server CPU seconds)
    series: list[tuple[float, int, int, float]] = field(default_factory=list)
    #: CPU seconds the monitor's own sampling took
    monitor_cpu: float = 0.0

    def cpu_between(self, start: float, end: float) -> tuple[float | None, float | None]:
        """(machine CPU busy fraction, server cores used) between two times."""
        inside = [s for s in self.series if start <= s[0] <= end]
        if len(inside) < 2:
            before = [s for s in self.series if s[0] <= start][-1:]
            after = [s for s in self.series if s[0] >= end][:1]
            inside = before + after
        if len(inside) < 2 or inside[-1][2] == inside[0][2]:
            return None, None
        a, b = inside[0], inside[-1]
        busy = (b[1] - a[1]) / (b[2] - a[2])
        server = (b[3] - a[3]) / (b[0] - a[0]) if b[0] > a[0] else None
        return busy, server


class Monitor:
    """Samples in a thread from :meth:`start` to :meth:`stop` (see the module docstring)."""

    def __init__(self, disk_paths: list[str], server_pids: list[int],
                 filesystem: str | None = None) -> None:
        """``filesystem``: the mountpoint of a filesystem holding nothing but this round's
        caches (the disk is then its used blocks less at :meth:`start`), or None (the
        ``disk_paths`` are walked)."""
        self.disk_paths = list(disk_paths)
        self.filesystem = filesystem
        self._used_at_start = 0
        self.groups: dict[str, list[int]] = {"jobs": [], "daemons": [], "server": list(server_pids)}
        self.peaks = Peaks()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="peers-monitor")

    def watch(self, group: str, pids: list[int]) -> None:
        self.groups[group] = self.groups.get(group, []) + list(pids)

    def start(self) -> Monitor:
        if self.filesystem is not None:
            self._used_at_start = used_bytes(self.filesystem)
        self._thread.start()
        return self

    def stop(self) -> Peaks:
        self._stop.set()
        self._thread.join(10)
        self._sample(0, final=True)
        return self.peaks

    def _run(self) -> None:
        n = 0
        while not self._stop.is_set():
            self._sample(n)
            n += 1
            self._stop.wait(INTERVAL)

    def _sample(self, n: int, final: bool = False) -> None:
        started = time.thread_time()
        self._measure(n, final)
        self.peaks.monitor_cpu += time.thread_time() - started

    def _measure(self, n: int, final: bool) -> None:
        now = time.time()
        server_cpu = 0.0
        for group, roots in self.groups.items():
            pids = [p for root in roots for p in descendants(root)]
            if group == "server":
                server_cpu = sum(cpu_seconds(p) for p in pids)
            total = sum(rss(p) for p in pids)
            self.peaks.rss[group] = max(self.peaks.rss.get(group, 0), total)
            if n % PSS_EVERY == 0 and not final:
                self.peaks.pss[group] = max(self.peaks.pss.get(group, 0), sum(pss(p) for p in pids))
        busy, total = machine_cpu()
        self.peaks.series.append((now, busy, total, server_cpu))
        if self.filesystem is not None:
            used = max(0, used_bytes(self.filesystem) - self._used_at_start)
            self.peaks.disk = max(self.peaks.disk, used)
        elif n % DISK_EVERY == 0 or final:
            used = sum(disk_bytes(p) for p in self.disk_paths if os.path.exists(p))
            self.peaks.disk = max(self.peaks.disk, used)
