"""What a long run samples and checks: the helpers of the soak benchmark and its short test.

``scripts/bench/soak.py`` (half an hour of jobs and faults, or longer) and
``tests/integration/test_soak_leaks.py`` (20 restarts of mountd under a mount) measure the
same things the same way, from here:

* **processes** — :func:`proc_sample` reads one process's resident memory, open descriptors
  and threads from ``/proc``; a :class:`Role` names a set of processes found afresh at each
  sample (mountd's main process, its fill processes = its children, a mount's main process,
  its FUSE workers, a job and its loader workers) and :func:`sample_role` adds them up, with
  the pids, so a restart shows as a new *segment* of the series; :func:`floors` turns
  frequent samples into one per period, the minimum of each metric (the floor a leak raises,
  under the noise of the work in flight);
* **the cache** — :func:`cache_bytes`: bytes of the files under ``store/`` and ``tmp/`` of a
  cache directory (what ``--cache-size`` caps, plus fills in flight);
* **trends** — :func:`pooled_slope`: the least-squares slope of a series per minute, fitted
  within each segment with one common slope (a process restarted by a fault starts a new
  segment: its fresh, smaller footprint is not read as a fall); :func:`pooled_median_slope`,
  the median of the slopes between pairs of points (what most points agree on, whatever one
  outlier does); :class:`Trend` turns them into the table's figures, leaving out each
  process's own warm-up after a restart;
* **content** — :class:`DigestTable` maps a digest's paths to their blake3 and size, so a
  reader checks every byte it read; :class:`Tally` counts reads, verified bytes, wrong bytes
  and errors (per second and errno, so a long run's errors stay small to ship) and merges
  tallies from many processes;
* **faults** — :class:`FaultWindow` and :func:`attribute`: each error goes to the documented
  fault window it happened in (with a grace after the window's end for the recovery), or is
  flagged as outside every window.

Only the standard library, ``blake3``, ``digests`` and ``mountd``'s client and store layout
are used (this module sits in the top layer beside the mount and must not import it); a job
running as another local user imports it too.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import statistics
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import blake3

__all__ = [
    "DigestTable",
    "FaultWindow",
    "ProcSample",
    "Role",
    "RoleSample",
    "Tally",
    "Trend",
    "alive",
    "attribute",
    "cache_bytes",
    "children",
    "fd_targets",
    "floors",
    "mountd_pid",
    "pooled_median_slope",
    "pooled_slope",
    "proc_sample",
    "sample_role",
    "settled",
]

_PAGE = os.sysconf("SC_PAGE_SIZE")


# -- processes ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ProcSample:
    """One process at one moment: resident bytes, open descriptors, threads."""

    pid: int
    rss: int
    fds: int
    threads: int


def proc_sample(pid: int, data: tuple[str, ...] = ()) -> ProcSample | None:
    """``pid``'s resident memory (``statm``), descriptors (``/proc/PID/fd``) and threads
    (``/proc/PID/task``); None once it is gone, a zombie, or was never there. Descriptors of
    files under the folders ``data`` (a reader's dataset) are not counted: see :class:`Role`."""
    if not alive(pid):
        return None  # gone, or dead and not yet reaped: nothing of it is left to count
    try:
        with open(f"/proc/{pid}/statm") as f:
            rss = int(f.read().split()[1]) * _PAGE
        fds = _held_descriptors(pid, data) if data else len(os.listdir(f"/proc/{pid}/fd"))
        threads = len(os.listdir(f"/proc/{pid}/task"))
    except (OSError, IndexError, ValueError):
        return None
    return ProcSample(pid, rss, fds, threads)


def _held_descriptors(pid: int, data: tuple[str, ...]) -> int:
    """``pid``'s open descriptors as ``/proc/PID/fd`` lists them, less those of files under
    ``data`` (each a folder); one that closed since the listing still counts, as it does in
    a plain count."""
    prefixes = tuple(folder.rstrip("/") + "/" for folder in data)
    listed, targets = _fd_links(pid)
    return listed - sum(target.startswith(prefixes) for target in targets)


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not: it is dead, waiting to be reaped, which an
    orphan's new parent may take a while to do)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def fd_count(pid: int | str = "self") -> int:
    """Descriptors process ``pid`` has open (``"self"``: this one)."""
    return len(os.listdir(f"/proc/{pid}/fd"))


def fd_targets(pid: int) -> list[str]:
    """What each open descriptor of ``pid`` is (``readlink`` of ``/proc/PID/fd/N``: a path,
    ``socket:[…]``, ``pipe:[…]``, ``anon_inode:…``); empty once it is gone."""
    try:
        return sorted(_fd_links(pid)[1])
    except OSError:
        return []


def _fd_links(pid: int) -> tuple[int, list[str]]:
    """How many descriptors ``/proc/PID/fd`` of ``pid`` lists, and the target of each still
    open when read (raises OSError once the process is gone)."""
    fds = os.listdir(f"/proc/{pid}/fd")
    targets = []
    for fd in fds:
        with contextlib.suppress(OSError):
            targets.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
    return len(fds), targets


def children(pid: int) -> list[int]:
    """The children of process ``pid`` (every thread's list; empty once it is gone)."""
    out: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                out.extend(int(child) for child in f.read().split())
        except OSError:
            continue
    return sorted(set(out))


def mountd_pid(cache_dir: str | os.PathLike[str], timeout: float = 2.0) -> int | None:
    """The pid of the mountd answering for ``cache_dir`` (None: none answers)."""
    from mountd.errors import MountdUnavailable
    from mountd.rpc.client import SyncClient

    try:
        with SyncClient.connect(cache_dir, timeout=timeout) as client:
            pid = client.hello_info.get("pid") or client.stats()["server"]["pid"]
    except (MountdUnavailable, OSError):
        return None
    return int(pid)


@dataclass(frozen=True)
class Role:
    """A set of processes that plays one part, found afresh at each sample: ``pids()``
    returns them now (empty: none running). Use :meth:`main` and :meth:`children_of`.

    ``data``: folders whose files the processes read as their work (a job's dataset). Their
    descriptors are left out of the count: a reader has the file it reads open for most of
    its time, so a reading catches one or not by chance, and a period's floor of two busy
    DataLoader workers went 24–26 and back all run long, which the soak took for a leak
    (2026-12-01, twice). What a leak keeps open is anything else, and that is counted."""

    name: str
    pids: Callable[[], Sequence[int]]
    data: tuple[str, ...] = ()

    @staticmethod
    def main(name: str, pid: Callable[[], int | None], data: tuple[str, ...] = ()) -> Role:
        """The single process ``pid()`` (e.g. a ``Popen``'s pid, mountd's from its socket)."""
        return Role(name, lambda: [p] if (p := pid()) else [], data)

    @staticmethod
    def children_of(name: str, pid: Callable[[], int | None], data: tuple[str, ...] = ()) -> Role:
        """The children of ``pid()``: mountd's fill processes, a mount's FUSE workers, a
        DataLoader's worker processes."""
        return Role(name, lambda: children(p) if (p := pid()) else [], data)


@dataclass(frozen=True)
class RoleSample:
    """A role at one moment: the sums over its processes, and which processes they were."""

    role: str
    t: float
    pids: tuple[int, ...]
    rss: int
    fds: int
    threads: int

    @property
    def count(self) -> int:
        return len(self.pids)

    def value(self, metric: str) -> float:
        """``rss`` (bytes), ``fds``, ``threads`` or ``count``."""
        return float(self.count if metric == "count" else getattr(self, metric))


def sample_role(role: Role, t: float | None = None) -> RoleSample:
    """:func:`proc_sample` of each of ``role``'s processes, added up (those that vanished
    between listing and reading are left out)."""
    samples = [s for pid in role.pids() if (s := proc_sample(pid, role.data)) is not None]
    return RoleSample(role.name, time.monotonic() if t is None else t,
                      tuple(s.pid for s in samples), sum(s.rss for s in samples),
                      sum(s.fds for s in samples), sum(s.threads for s in samples))


def floors(samples: Sequence[RoleSample], period: float, min_readings: int = 1) -> list[RoleSample]:
    """One sample per ``period`` seconds (and per set of pids within it) from samples taken
    more often: the *floor* of each metric, its minimum over the period, at the period's mean
    time; a period with fewer than ``min_readings`` readings gives none (its minimum says
    little). Descriptors and threads come and go with the work in flight (a fill's temp file,
    a descriptor handed over, a thread for a burst); a leak raises the floor under that
    noise, so the floor's slope shows it where single readings would mostly show the load."""
    groups: dict[tuple[int, tuple[int, ...]], list[RoleSample]] = {}
    for s in samples:
        if s.pids:
            groups.setdefault((int(s.t // period), s.pids), []).append(s)
    out = [RoleSample(group[0].role, sum(s.t for s in group) / len(group), pids,
                      min(s.rss for s in group), min(s.fds for s in group), min(s.threads for s in group))
           for (_, pids), group in groups.items() if len(group) >= min_readings]
    return sorted(out, key=lambda s: s.t)


def settled(read: Callable[[], Any], *, quiet: float = 1.0, timeout: float = 20.0,
            interval: float = 0.1) -> Any:
    """``read()`` once it has returned the same value for ``quiet`` seconds (threads a
    process starts for a burst of work, and exit once idle, make a count read mid-burst
    meaningless); the last value when ``timeout`` passes first."""
    deadline = time.monotonic() + timeout
    value = read()
    since = time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(interval)
        now = read()
        if now != value:
            value, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet:
            break
    return value


# -- the cache ------------------------------------------------------------------------------------


def cache_bytes(cache_dir: str | os.PathLike[str]) -> int:
    """Bytes of the files under the cache's ``store/`` and ``tmp/`` (apparent sizes): the
    cached content that ``--cache-size`` caps, plus the fills being written."""
    from mountd.store import layout

    total = 0
    stack = [str(layout.store_dir(cache_dir)), str(layout.tmp_dir(cache_dir))]
    while stack:
        try:
            entries = list(os.scandir(stack.pop()))
        except OSError:  # gone (a fan-out folder removed, a tmp file renamed) while walking
            continue
        for entry in entries:
            try:
                if entry.is_dir(follow_symlinks=False):
                    stack.append(entry.path)
                elif entry.is_file(follow_symlinks=False):
                    total += entry.stat(follow_symlinks=False).st_size
            except OSError:
                continue
    return total


# -- trends ---------------------------------------------------------------------------------------


def pooled_slope(points: Iterable[tuple[float, float, object]]) -> float | None:
    """The least-squares slope of ``(x, y, segment)`` points, one slope for every segment and
    an intercept per segment (the "within" estimator): how fast y grows with x *inside* each
    segment. A segment is one life of a process (or one set of processes): a restart begins a
    new one. None when no segment has two distinct x."""
    groups: dict[object, list[tuple[float, float]]] = {}
    for x, y, segment in points:
        groups.setdefault(segment, []).append((x, y))
    sxy = sxx = 0.0
    for pts in groups.values():
        if len(pts) < 2:
            continue
        mx = sum(x for x, _ in pts) / len(pts)
        my = sum(y for _, y in pts) / len(pts)
        sxy += sum((x - mx) * (y - my) for x, y in pts)
        sxx += sum((x - mx) ** 2 for x, _ in pts)
    return sxy / sxx if sxx > 0 else None


def pooled_median_slope(points: Iterable[tuple[float, float, object]]) -> float | None:
    """The median of the slopes between every two points of the same segment (Theil–Sen,
    within segments): the trend most points agree on, which one outlier (a dip while a
    process sat idle, a burst) barely moves; None when no segment has two distinct x."""
    groups: dict[object, list[tuple[float, float]]] = {}
    for x, y, segment in points:
        groups.setdefault(segment, []).append((x, y))
    slopes = [(y2 - y1) / (x2 - x1)
              for pts in groups.values()
              for i, (x1, y1) in enumerate(pts) for x2, y2 in pts[i + 1:] if x2 != x1]
    return statistics.median(slopes) if slopes else None


@dataclass(frozen=True)
class Trend:
    """One series after the warm-up: its mean, the pooled least-squares slope per minute, the
    slope ÷ the mean (relative, per minute), the pooled median slope (Theil–Sen), and the
    growth a slope adds up to over the time measured (the segments' spans added up)."""

    samples: int
    segments: int
    mean: float
    first: float
    last: float
    slope: float | None
    span_min: float
    median_slope: float | None = None

    @classmethod
    def of(cls, series: Sequence[RoleSample], metric: str, since: float, settle: float = 0.0) -> Trend:
        """The trend of ``metric`` over the samples of ``series`` taken at ``since`` or later
        (``t`` in seconds, the slope per minute); a segment per set of pids; see
        :meth:`of_points` for ``settle``."""
        return cls.of_points([(s.t, s.value(metric), s.pids) for s in series if s.pids], since, settle)

    @classmethod
    def of_points(cls, points: Sequence[tuple[float, float, object]], since: float,
                  settle: float = 0.0) -> Trend:
        """The trend of ``(t seconds, value, segment)`` points at ``since`` or later, leaving
        out the points less than ``settle`` seconds after their segment's first point: a
        process started again by a fault warms up again (imports done, caches filling), and
        that is not growth of the run."""
        first: dict[object, float] = {}
        for t, _, segment in points:
            first.setdefault(segment, t)
        kept = [p for p in points if p[0] >= since and p[0] >= first[p[2]] + settle]
        if not kept:
            return cls(0, 0, 0.0, 0.0, 0.0, None, 0.0)
        values = [v for _, v, _ in kept]
        minutes = [(t / 60.0, v, segment) for t, v, segment in kept]
        spans: dict[object, list[float]] = {}
        for t, _, segment in kept:
            spans.setdefault(segment, []).append(t)
        span = sum(max(ts) - min(ts) for ts in spans.values()) / 60.0
        return cls(len(kept), len(spans), sum(values) / len(values), values[0], values[-1],
                   pooled_slope(minutes), span, pooled_median_slope(minutes))

    @property
    def relative(self) -> float | None:
        """The slope ÷ the mean, per minute (None without a slope or with a zero mean)."""
        if self.slope is None or not self.mean:
            return None
        return self.slope / self.mean

    @property
    def growth(self) -> float | None:
        """What the slope adds up to over the span measured."""
        return None if self.slope is None else self.slope * self.span_min

    @property
    def growth_relative(self) -> float | None:
        """:attr:`growth` ÷ the mean."""
        growth = self.growth
        return None if growth is None or not self.mean else growth / self.mean

    @property
    def median_growth(self) -> float | None:
        """What the median slope adds up to over the span measured."""
        return None if self.median_slope is None else self.median_slope * self.span_min

    @property
    def median_growth_relative(self) -> float | None:
        """:attr:`median_growth` ÷ the mean."""
        growth = self.median_growth
        return None if growth is None or not self.mean else growth / self.mean


# -- content ---------------------------------------------------------------------------------------


class DigestTable:
    """A digest's files: relative path → (blake3, size), loaded once."""

    def __init__(self, rows: dict[str, tuple[bytes, int]]) -> None:
        self.rows = rows

    @classmethod
    def load(cls, digest: str | os.PathLike[str]) -> DigestTable:
        """Every file row of ``digest`` (the canonical order's path, size and hash)."""
        from digests.digest import Digest

        with Digest.open(str(digest)) as d:
            return cls({path: (content_hash, size) for path, size, content_hash in d.iter_canonical()})

    def paths(self) -> list[str]:
        """The paths, sorted (the digest's order)."""
        return sorted(self.rows)

    def matches(self, rel: str, data: bytes) -> bool:
        """Whether ``data`` is exactly the content the digest names for ``rel``."""
        expected = self.rows.get(rel)
        return (expected is not None and len(data) == expected[1]
                and blake3.blake3(data).digest() == expected[0])


@dataclass
class Tally:
    """What a reader did: reads that returned the digest's bytes, the bytes verified, reads
    whose bytes differ (and how many bytes they returned), and failed reads per
    (second, errno name, where). ``mismatches`` keeps up to :attr:`KEEP` of the differing
    reads as ``(time, path, blake3 hex of what was read)`` for whoever can tell a newer
    version of a file from damage; ``progress`` counts the good reads per :attr:`BUCKET`
    seconds (whether a reader went on after a fault); ``last_ok`` is when a read last
    succeeded."""

    KEEP = 100_000
    BUCKET = 10

    reads: int = 0
    bytes_ok: int = 0
    wrong_reads: int = 0
    wrong_bytes: int = 0
    errors: Counter = field(default_factory=Counter)
    mismatches: list[tuple[float, str, str]] = field(default_factory=list)
    progress: Counter = field(default_factory=Counter)
    last_ok: float = 0.0

    def ok(self, nbytes: int, t: float | None = None) -> None:
        """A read that returned the digest's bytes."""
        t = time.time() if t is None else t
        self.reads += 1
        self.bytes_ok += nbytes
        self.progress[int(t) // self.BUCKET * self.BUCKET] += 1
        self.last_ok = max(self.last_ok, t)

    def read_between(self, start: float, end: float) -> bool:
        """Whether good reads were counted in a :attr:`BUCKET` that starts in [start, end)
        (so they happened at ``start`` or later)."""
        return any(n and start <= t < end for t, n in self.progress.items())

    def wrong(self, rel: str, data: bytes, t: float | None = None) -> None:
        """A read whose bytes are not the digest's."""
        self.wrong_reads += 1
        self.wrong_bytes += len(data)
        if len(self.mismatches) < self.KEEP:
            self.mismatches.append((time.time() if t is None else t, rel,
                                    blake3.blake3(data).hexdigest()))

    def error(self, exc: BaseException | int, where: str = "read", t: float | None = None) -> None:
        """A failed operation (an ``OSError``, or an errno), counted in its second."""
        code = exc if isinstance(exc, int) else getattr(exc, "errno", None)
        name = errno.errorcode.get(code, str(code)) if code is not None else type(exc).__name__
        self.errors[(int(time.time() if t is None else t), name, where)] += 1

    def rate(self, start: float, end: float) -> float | None:
        """Good reads per second over the buckets (:attr:`BUCKET` seconds each) that lie
        wholly in [start, end] (None: none does)."""
        first = math.ceil(start / self.BUCKET) * self.BUCKET  # the first bucket from ``start`` on
        buckets = range(first, int(end) - self.BUCKET + 1, self.BUCKET)
        if not buckets:
            return None
        return sum(self.progress.get(t, 0) for t in buckets) / (len(buckets) * self.BUCKET)

    def merge(self, other: Tally) -> None:
        """Add ``other``'s counts to this one."""
        self.reads += other.reads
        self.bytes_ok += other.bytes_ok
        self.wrong_reads += other.wrong_reads
        self.wrong_bytes += other.wrong_bytes
        self.errors.update(other.errors)
        room = self.KEEP - len(self.mismatches)
        self.mismatches.extend(other.mismatches[:max(0, room)])
        self.progress.update(other.progress)
        self.last_ok = max(self.last_ok, other.last_ok)

    @property
    def error_count(self) -> int:
        return sum(self.errors.values())

    def to_json(self) -> dict[str, Any]:
        return {"reads": self.reads, "bytes_ok": self.bytes_ok, "wrong_reads": self.wrong_reads,
                "wrong_bytes": self.wrong_bytes, "last_ok": self.last_ok,
                "errors": [[t, name, where, n] for (t, name, where), n in sorted(self.errors.items())],
                "mismatches": self.mismatches,
                "progress": [[t, n] for t, n in sorted(self.progress.items())]}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Tally:
        tally = cls(data["reads"], data["bytes_ok"], data["wrong_reads"], data["wrong_bytes"],
                    last_ok=data.get("last_ok", 0.0))
        for t, name, where, n in data["errors"]:
            tally.errors[(t, name, where)] += n
        tally.mismatches = [tuple(m) for m in data["mismatches"]]
        for t, n in data.get("progress", []):
            tally.progress[t] += n
        return tally

    def write(self, path: Path, **extra: Any) -> None:
        """Write the tally (and ``extra``) as JSON atomically (temp file, rename)."""
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({**self.to_json(), **extra}))
        os.replace(tmp, path)


# -- faults ----------------------------------------------------------------------------------------


@dataclass
class FaultWindow:
    """A fault made on purpose, from ``start`` until ``end`` (``time.time()`` seconds; None
    while it lasts): errors in it, or up to ``grace`` seconds after it, are expected.
    ``targets`` names what it touches (a dataset, a mount: ``"A"``, ``"B"``; empty: all),
    ``note`` what was done."""

    kind: str
    start: float
    end: float | None = None
    grace: float = 10.0
    targets: tuple[str, ...] = ()
    note: str = ""

    def covers(self, t: float, target: str | None = None, width: float = 0.0) -> bool:
        """Whether an error at ``t`` (of a reader of ``target``) belongs to this window;
        ``width``: the error's time is only known to lie in [t, t + width] (a tally's
        second)."""
        if target is not None and self.targets and target not in self.targets:
            return False
        end = (self.end if self.end is not None else float("inf")) + self.grace
        return self.start <= t + width and t <= end


def attribute(t: float, windows: Sequence[FaultWindow], target: str | None = None,
              width: float = 0.0) -> FaultWindow | None:
    """The window that explains an error at ``t`` (within ``width``, see
    :meth:`FaultWindow.covers`): the latest one that covers it (None: outside every window)."""
    covering = [w for w in windows if w.covers(t, target, width)]
    return max(covering, key=lambda w: w.start) if covering else None
