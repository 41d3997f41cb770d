"""What a run costs the machine: memory of its processes, disk of its caches, CPU busy.

A :class:`Monitor` thread samples, every :data:`INTERVAL` seconds, the process trees of
three groups — ``jobs`` (the job processes and their DataLoader workers), ``daemons``
(quiverfs's mountd and mount, with their fill processes and workers) and ``server`` (nginx
and s3dir) — and keeps the peak of each group's summed RSS (``/proc/PID/statm``) and, every
:data:`PSS_EVERY` samples, summed PSS (``/proc/PID/smaps_rollup``: shared pages divided among
the processes that map them, so forked workers that share torch's pages are not counted
once each). It also samples the machine's CPU (``/proc/stat``), the server's CPU seconds,
and every :data:`DISK_EVERY` samples the bytes under the cache directories (``du``-like:
allocated blocks), keeping the peak.
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

    def __init__(self, disk_paths: list[str], server_pids: list[int]) -> None:
        self.disk_paths = list(disk_paths)
        self.groups: dict[str, list[int]] = {"jobs": [], "daemons": [], "server": list(server_pids)}
        self.peaks = Peaks()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="peers-monitor")

    def watch(self, group: str, pids: list[int]) -> None:
        self.groups[group] = self.groups.get(group, []) + list(pids)

    def start(self) -> Monitor:
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
        if n % DISK_EVERY == 0 or final:
            used = sum(disk_bytes(p) for p in self.disk_paths if os.path.exists(p))
            self.peaks.disk = max(self.peaks.disk, used)
