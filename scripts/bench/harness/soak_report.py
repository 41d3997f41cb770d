"""What a soak run found (scripts/bench/soak.py): the series' slopes, the fault windows' errors,
the jobs' verified reads and the targets, printed and saved.

``SoakReport`` is a mixin of the run's ``Soak`` (it reads the samples, windows, jobs and plan
the run gathered); it is kept apart so the script reads as set-up, loop and report, and
judging a run can change without touching how it runs.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from dataclasses import asdict
from typing import Any

from harness.report import table
from mountd.store.evictions import JOURNAL_ENTRIES
from quiverfs.base.errors import QuiverError
from quiverfs.testing.soak import FaultWindow, RoleSample, Tally, Trend, attribute, floors

#: Fill slots of mountd (``fill_concurrency``: max(32, --remote-concurrency 64), and a quarter
#: more for other sources: mountd/store/limits.py): each may hold one file being written in
#: ``tmp/`` beyond the cap.
FILL_SLOTS = 80

#: Seconds after a fault window within which every job it touched must have read again.
RECOVERY = 30.0

#: The jobs of a dataset a fault does not touch should keep this share of the reads/s they
#: had in the ISOLATION_BEFORE seconds before it (a target: a bucket that hangs held every
#: fill slot of mountd, and the other dataset read nothing, until fills took slots per source).
STALL, ISOLATION_BEFORE = 0.5, 60.0

#: RSS may move by this much (what a slope adds up to over the time measured, ÷ the mean)
#: after the warm-up (Soak.flat: both slopes must exceed it).
RSS_TOLERANCE = 0.10

#: Readings of every process per sample period; a period with fewer than half of them left
#: outside the fault windows gives no point.
READINGS = 20

#: Points a series needs after the warm-up for a verdict (fewer: "-", too short to judge;
#: short runs, whose fault windows take much of the time, leave some series this short).
MIN_POINTS = 5

#: Descriptors and threads are flat while what a slope adds up to over the time measured
#: stays below this, or below this share of the mean where that is more.
FLAT_ABSOLUTE, FLAT_RELATIVE = 1.0, 0.05


class SoakReport:
    """The report half of ``Soak`` (the attributes it reads are set by ``Soak.__init__``
    and ``Soak.run``)."""

    plan: Any
    samples: Any
    windows: list[FaultWindow]

    def report(self) -> bool:
        plan, start = self.plan, self.start
        tallies = {job.spec.name: job.tally() for job in self.jobs}
        print()
        print(f"soak: {plan.seconds / 60:g} min, {len(self.windows)} faults (one every {plan.fault_every:g} s), "
              f"samples every {plan.sample_every:.0f} s, warm-up {plan.warmup:g} s; cache {self.cap / 2**20:.1f} MiB "
              f"on a {self.fs_size / 2**20:.0f} MiB tmpfs; datasets A (s3://, moto behind "
              f"a fault proxy) and B (file://, mounted by {self.user.name if self.user else 'root'}), "
              f"{self.args.files} x {self.args.file_size // 1024} KiB each; {os.cpu_count()} CPUs")

        # the series
        rows, verdicts = [], {"rss": [], "fds": [], "threads": []}
        for role, readings in self.samples.items():
            series = floors(self.outside_faults(readings), plan.sample_every, READINGS // 2)
            for metric in ("rss", "fds", "threads"):
                kept = series
                if role == "mountd" and metric == "rss":  # judged once its eviction journal is full
                    kept = [p for p in series if self.journal_full(p)]
                trend = Trend.of(kept, metric, plan.warmup, settle=plan.warmup)
                scale = 2**20 if metric == "rss" else 1
                ok = self.flat(metric, trend)
                verdicts[metric].append((role, ok))
                rows.append([role, {"rss": "RSS MiB", "fds": "descriptors", "threads": "threads"}[metric],
                             f"{trend.samples}/{trend.segments}", _num(trend.first / scale),
                             _num(trend.last / scale), _num(trend.mean / scale),
                             _num(None if trend.slope is None else trend.slope / scale, 3),
                             _pct(trend.relative),
                             _num(None if trend.median_slope is None else trend.median_slope / scale, 3),
                             _pct(trend.growth_relative), _pct(trend.median_growth_relative),
                             "-" if ok is None else ("PASS" if ok else "FAIL")])
        for name, points in (("cache store/ + tmp/", self.cache_points), ("cache index + WAL", self.index_points)):
            cache = Trend.of_points(points, plan.warmup)
            rows.append([name, "MiB", f"{cache.samples}/1", _num(cache.first / 2**20),
                         _num(cache.last / 2**20), _num(cache.mean / 2**20),
                         _num(None if cache.slope is None else cache.slope / 2**20, 3), _pct(cache.relative),
                         _num(None if cache.median_slope is None else cache.median_slope / 2**20, 3),
                         _pct(cache.growth_relative), _pct(cache.median_growth_relative), ""])
        print()
        print(f"series after the warm-up ({plan.warmup:g} s), each point the floor (minimum) of a "
              f"{plan.sample_every:.0f} s period's {READINGS} readings, those taken outside the fault windows (at least "
              f"half); n/seg: points/segments (a segment = one life of the "
              "processes, its first warm-up left out); slope: least squares, per minute, within segments; "
              "median slope: Theil-Sen, the same way; growth/mean: what a slope adds up to over the time "
              "measured, / the mean")
        print(table(["process (role)", "series", "n/seg", "first", "last", "mean", "slope/min",
                     "slope/mean/min", "median slope/min", "growth/mean", "median growth/mean",
                     "verdict"], rows))
        self.mountd_work(Trend.of(floors(self.outside_faults(self.samples["mountd"]), plan.sample_every,
                                         READINGS // 2), "rss", plan.warmup, settle=plan.warmup))
        full = [t for t, _, n in self.removals if n >= JOURNAL_ENTRIES]
        print(f"(mountd's RSS is judged from the moment its eviction journal is full, {JOURNAL_ENTRIES:,} "
              "files evicted since it started (mountd/store/evictions.py: it grows with each eviction "
              "until then, by design): "
              + (f"first full at {full[0]:.0f} s" if full else "never full in this run") + ")")

        # the faults and the errors they explain
        per_window: dict[int, Counter] = {i: Counter() for i in range(len(self.windows))}
        outside: list[str] = []
        errors_total = 0
        for job in self.jobs:
            tally = tallies[job.spec.name][0]
            for (t, name, where), n in sorted(tally.errors.items()):
                errors_total += n
                window = attribute(t, self.windows, job.tag, width=1.0)
                if window is None:
                    outside.append(f"{t - start:.0f} s {job.spec.name} {where} {name} x{n}")
                else:
                    per_window[self.windows.index(window)][f"{name}" + ("" if where == "read" else f" ({where})")] += n
        print()
        print(f"fault windows (errors: each job's failed reads and claims in the window or up to "
              f"{plan.grace:g} s after it)")
        rows = []
        stalls = []
        for i, w in enumerate(self.windows):
            errs = per_window[i]
            others = self.others_rate(w, tallies)
            if others is not None and others[0] < STALL * others[1]:
                stalls.append(f"{i + 1} {w.kind}: {others[0]:.1f}/s against {others[1]:.1f}/s before")
            rows.append([f"{i + 1} {w.kind}", ",".join(w.targets) or "all", f"{w.start - start:.0f}",
                         f"{(w.end or w.start) - w.start:.1f}", sum(errs.values()),
                         " ".join(f"{k} {v}" for k, v in errs.most_common()) or "-",
                         "-" if others is None else f"{others[0]:.1f} / {others[1]:.1f}", w.note])
        rows.append(["outside any window", "", "", "", len(outside), "; ".join(outside[:8]) or "-", "", ""])
        print(table(["window", "targets", "start s", "length s", "errors", "by errno",
                     "others reads/s (in / before)", "note"], rows))
        print("(others: the jobs of the dataset the fault does not touch, good reads per second "
              f"in the window and in the {ISOLATION_BEFORE:g} s before it)")

        # the jobs
        print()
        rows = []
        wrong_total, versions_total = 0, 0
        for job in self.jobs:
            tally, data = tallies[job.spec.name]
            wrong, other = self.classify(job, tally)
            wrong_total += wrong
            versions_total += other
            rows.append([job.spec.name + (f" ({self.user.name})" if job.user is not None else ""),
                         f"{tally.reads:,}", f"{tally.bytes_ok / 2**20:,.1f}", data.get("epochs", 0),
                         tally.error_count, other, wrong])
        print(table(["job", "verified reads", "verified MiB", "epochs", "errors",
                     "other version (served)", "wrong bytes"], rows))

        # recovery: every job the fault touched read again after it (before the next fault,
        # or within RECOVERY seconds where the next comes sooner)
        missing = []
        for i, w in enumerate(self.windows):
            end = w.end or w.start
            until = self.windows[i + 1].start if i + 1 < len(self.windows) else start + plan.seconds
            until = min(start + plan.seconds, max(until, end + RECOVERY))
            for job in self.jobs:
                if w.targets and job.tag not in w.targets:
                    continue
                if not tallies[job.spec.name][0].read_between(end, until):
                    missing.append(f"{job.spec.name} after {i + 1} {w.kind}")

        bound = self.cap + FILL_SLOTS * self.args.file_size
        checks = [
            ("wrong bytes", wrong_total == 0,
             f"{wrong_total:,} wrong bytes in {sum(t.reads for t, _ in tallies.values()):,} verified reads"
             + (f" ({versions_total} reads of B returned a version that a mount of it served)" if versions_total else "")),
            ("read errors inside fault windows", not outside,
             f"{errors_total:,} errors, {len(outside)} (job, second, errno) groups outside any window"),
            ("RSS within ±10% after warm-up", all(ok is not False for _, ok in verdicts["rss"]),
             _failed(verdicts["rss"])),
            ("descriptors flat after warm-up", all(ok is not False for _, ok in verdicts["fds"]),
             _failed(verdicts["fds"])),
            ("threads flat after warm-up", all(ok is not False for _, ok in verdicts["threads"]),
             _failed(verdicts["threads"])),
            ("cache bytes <= cap + a file per fill slot", self.cache_max <= bound,
             f"max {self.cache_max / 2**20:.2f} MiB, bound {bound / 2**20:.2f} MiB "
             f"(cap {self.cap / 2**20:.2f} + {FILL_SLOTS} x {self.args.file_size // 1024} KiB)"),
            ("(info) the whole cache directory", True,
             f"max {self.dir_max / 2**20:.2f} MiB with the index and its WAL (not capped by --cache-size)"),
            ("a fault of one dataset leaves the other's jobs reading", not stalls,
             "; ".join(stalls) or f"in every window of one dataset, the other's jobs kept over "
             f"{STALL:.0%} of their reads/s"),
            ("every job read again after each fault", not missing, "; ".join(missing[:6]) or
             f"{len(self.windows)} windows"),
            ("no process left behind, none died", not self.leftovers and not self.deaths,
             "; ".join(self.leftovers + self.deaths)[:400] or "none"),
        ]
        print()
        print("targets")
        width = max(len(name) for name, _, _ in checks)
        for name, ok, detail in checks:
            verdict = "    " if name.startswith("(info)") else ("PASS" if ok else "FAIL")
            print(f"  {verdict}  {name:<{width}}  {detail}")
        self.save(tallies)
        return all(ok for name, ok, _ in checks if not name.startswith("(info)"))

    def outside_faults(self, readings: list[RoleSample]) -> list[RoleSample]:
        """The readings taken outside every fault window and its grace: a fault's transient
        (a process idle while its readers are stalled, one recovering) is not a trend, and a
        leak a fault causes still shows, as a step between the readings before and after."""
        return [r for r in readings if attribute(self.start + r.t, self.windows) is None]

    def mountd_work(self, rss: Trend) -> None:
        """One line: what mountd did in its last life, and its RSS slope per 1,000 fills."""
        try:
            counters = self.mountd.counters()
        except (OSError, QuiverError) as exc:
            print(f"mountd's counters: not available ({exc})")
            return
        minutes = (time.time() - self.mountd.started) / 60.0
        fills = counters["fill_latency"].get("count", 0)
        per = ""
        if rss.slope is not None and fills and minutes > 0:
            per = f"; its RSS slope is {rss.slope / 2**20 / (fills / minutes) * 1000:.3f} MiB per 1,000 fills"
        print(f"mountd's last life ({minutes:.1f} min): {counters['hits']:,} hits, {counters['misses']:,} "
              f"misses, {fills:,} fills ({fills / max(minutes, 1e-9):,.0f}/min), "
              f"{counters['evicted_files']:,} files evicted{per}")
        self.mountd_counters = counters

    def others_rate(self, w: FaultWindow, tallies: dict[str, tuple[Tally, dict]]) -> tuple[float, float] | None:
        """(reads/s in ``w``, reads/s in the ISOLATION_BEFORE s before it) of the jobs whose
        dataset ``w`` does not touch; None for a fault that touches every job, or a window
        too short to measure."""
        if not w.targets:
            return None
        others = [tallies[job.spec.name][0] for job in self.jobs if job.tag not in w.targets]
        during = [t.rate(w.start, w.end or w.start) for t in others]
        before = [t.rate(w.start - ISOLATION_BEFORE, w.start) for t in others]
        if not others or None in during or None in before:
            return None
        return sum(during), sum(before)

    @staticmethod
    def flat(metric: str, trend: Trend) -> bool | None:
        """The verdict on one series (None: too few points to say). A series moves when both
        its least-squares slope and its median slope add up to more than the tolerance over
        the span (the median slope keeps one outlying point, e.g. a process idle for a
        period while a fault stalled its readers, from deciding): RSS must stay within ±10%;
        descriptors and threads must not grow (a falling floor is no leak)."""
        if trend.slope is None or trend.median_slope is None or trend.samples < MIN_POINTS:
            return None
        if metric == "rss":
            ls, median = trend.growth_relative or 0.0, trend.median_growth_relative or 0.0
            return not (min(ls, median) > RSS_TOLERANCE or max(ls, median) < -RSS_TOLERANCE)
        tolerance = max(FLAT_ABSOLUTE, FLAT_RELATIVE * trend.mean)
        return min(trend.growth or 0.0, trend.median_growth or 0.0) < tolerance

    def save(self, tallies: dict[str, tuple[Tally, dict]]) -> None:
        out = {
            "plan": asdict(self.plan), "start": self.start, "cap": self.cap, "cache_max": self.cache_max,
            "dir_max": self.dir_max,
            "mountd_counters": getattr(self, "mountd_counters", None),
            "removals": self.removals,
            "windows": [asdict(w) for w in self.windows],
            "samples": {role: [asdict(s) for s in series] for role, series in self.samples.items()},
            "cache": self.cache_points, "index": self.index_points, "leftovers": self.leftovers, "deaths": self.deaths,
            "jobs": {name: data for name, (_, data) in tallies.items()},
        }
        (self.run_dir / "results.json").write_text(json.dumps(out, default=str))
        print(f"\n(logs, job statuses and results.json in {self.run_dir})")


def _num(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:+.2f}%"


def _failed(verdicts: list[tuple[str, bool | None]]) -> str:
    bad = [role for role, ok in verdicts if ok is False]
    short = sum(ok is None for _, ok in verdicts)
    return (f"{sum(ok is True for _, ok in verdicts)}/{len(verdicts)} series"
            + (f" ({short} too short to judge)" if short else "")
            + (f"; moving: {', '.join(bad)}" if bad else ""))
