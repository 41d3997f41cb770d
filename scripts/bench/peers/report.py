"""Rows, tables, verdicts and markdown of the side-by-side benchmark.

A :class:`Row` is one contender in one scenario (the best of its rounds). Rates are
images/s per job: each epoch's images over its wall time, averaged over the jobs of the row.
Bucket figures come from the bucket's access log (``peers.source``): for one job, split at
the job's epoch boundaries; for several jobs at once, "epoch 0" ends when the last job ends
its epoch 0 (a faster job's first requests of epoch 1 then count as epoch 0), so the
targets use the whole run's total, which nothing can shift.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from harness.report import table

MB = 1e6


@dataclass
class Row:
    scenario: str
    contender: str
    jobs: int
    rounds: int = 0
    #: images/s per job, per epoch (best of rounds)
    rates: list[float] = field(default_factory=list)
    #: images/s per job over the whole run (all epochs; best of rounds)
    overall: float = 0.0
    #: bucket GETs and bytes per epoch window, all jobs together (from the best round)
    gets: list[int] = field(default_factory=list)
    get_bytes: list[int] = field(default_factory=list)
    #: before the first epoch: the jobs' own set-up (listing, index files)
    setup_gets: int = 0
    setup_lists: int = 0
    total_gets: int = 0
    total_bytes: int = 0
    images: list[int] = field(default_factory=list)
    job_setup_s: float = 0.0
    disk_peak: int = 0
    rss_jobs: int = 0
    pss_jobs: int = 0
    rss_daemons: int = 0
    pss_daemons: int = 0
    limits: list[str] = field(default_factory=list)
    error: str | None = None
    note: str = ""
    #: a quiverfs row's bucket reads as mountd accounts for them, whole run (best round):
    #: harness.report.BucketAccount.line, and the dataset's modes in order
    mountd: str = ""


def _mb(n: int | float) -> str:
    return f"{n / MB:,.0f}"


def _rate(x: float | None) -> str:
    return "" if x is None else f"{x:,.0f}"


def row_cells(row: Row, dataset_bytes: int, files: int) -> list[Any]:
    if row.error:
        return [row.contender, "failed", "", "", "", "", "", "", "", "", row.error[:60]]
    e0 = row.rates[0] if row.rates else None
    e1 = row.rates[1] if len(row.rates) > 1 else None
    per_epoch = " / ".join(f"{b / dataset_bytes:.2f}" for b in row.get_bytes)
    gets = " / ".join(f"{g:,}" for g in row.gets)
    mem = f"{_mb(row.rss_jobs + row.rss_daemons)} / {_mb(row.pss_jobs + row.pss_daemons)}"
    return [row.contender + (f" {row.note}" if row.note else ""), _rate(e0), _rate(e1), _rate(row.overall), gets,
            per_epoch, f"{row.total_bytes / dataset_bytes:.2f}", _mb(row.disk_peak), mem,
            f"{row.job_setup_s:.1f}", " | ".join(row.limits)]


HEADERS = ["contender", "e0 img/s", "e1 img/s", "all img/s", "GETs e0 / e1", "bucket/dataset e0 / e1",
           "run total", "disk MB", "RSS / PSS MB", "job set-up s", "limited by (e0 | e1)"]


def scenario_table(rows: list[Row], dataset_bytes: int, files: int) -> str:
    return table(HEADERS, [row_cells(r, dataset_bytes, files) for r in rows])


def markdown_table(rows: list[Row], dataset_bytes: int, files: int) -> str:
    cells = [row_cells(r, dataset_bytes, files) for r in rows]
    return markdown(HEADERS, cells)


def markdown(headers: list[str], rows: list[list[Any]]) -> str:
    """A markdown table (``|`` inside a cell escaped)."""
    def cell(value: Any) -> str:
        return (f"{value:,}" if isinstance(value, int) and not isinstance(value, bool)
                else str(value)).replace("|", "\\|")

    lines = ["| " + " | ".join(cell(h) for h in headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


# -- verdicts -----------------------------------------------------------------------------------


def _best(rows: list[Row], key) -> tuple[Row | None, float]:
    best, value = None, float("-inf")
    for r in rows:
        if r.error:
            continue
        v = key(r)
        if v is not None and v > value:
            best, value = r, v
    return best, value


def _lowest(rows: list[Row], key) -> tuple[Row | None, float]:
    best, value = None, float("inf")
    for r in rows:
        if r.error:
            continue
        v = key(r)
        if v is not None and v < value:
            best, value = r, v
    return best, value


def _line(ok: bool, text: str) -> str:
    return f"{'PASS' if ok else 'FAIL'}  {text}"


def _ratio(value: float, target: float) -> str:
    """``value`` with two decimals, or three where two would round it onto ``target`` from
    the other side (a cold epoch at 0.8991 of the best read "0.90 x ... FAIL" against a
    target of 0.9, 2026-12-01): the digits shown never contradict the verdict."""
    two = f"{value:.2f}"
    return two if (float(two) >= target) == (value >= target) else f"{value:.3f}"


def _at_most(ours: float, theirs: float) -> tuple[bool, str, str]:
    """Whether ``ours`` is at most ``theirs``, and both as shown: two decimals, or three
    where two would show them the other way round (1.004 against 1.000 read "1.00 vs 1.00"
    beside a FAIL)."""
    ok = ours <= theirs + 1e-9
    a, b = f"{ours:.2f}", f"{theirs:.2f}"
    if (float(a) <= float(b)) != ok:
        a, b = f"{ours:.3f}", f"{theirs:.3f}"
    return ok, a, b


def verdicts(scenario: str, rows: list[Row], dataset_bytes: int, epochs: int) -> list[str]:
    """The issue's targets for each quiverfs row of ``scenario`` against the best other row."""
    ours = [r for r in rows if r.contender.startswith("qfs-") and not r.error]
    theirs = [r for r in rows if not r.contender.startswith("qfs-")]
    out: list[str] = []
    if not ours or not _best(theirs, lambda r: r.overall)[0]:
        return [f"(no verdict for {scenario}: a quiverfs row or every other row is missing)"]
    cold = lambda r: r.rates[0] if r.rates else None  # noqa: E731
    warm = lambda r: r.rates[-1] if r.rates else None  # noqa: E731
    per_epoch = lambda r: r.total_bytes / epochs / dataset_bytes  # noqa: E731
    for q in ours:
        if scenario == "a":
            who, value = _best(theirs, warm)
            out.append(_line(warm(q) >= 1.0 * value, f"(a) {q.contender}: warm epoch {warm(q):,.0f} img/s = "
                             f"{_ratio(warm(q) / value, 1.0)} x best other ({who.contender} {value:,.0f}); "
                             "target >= 1.0"))
            who, value = _best(theirs, cold)
            out.append(_line(cold(q) >= 0.9 * value, f"(a) {q.contender}: cold epoch {cold(q):,.0f} img/s = "
                             f"{_ratio(cold(q) / value, 0.9)} x best other ({who.contender} {value:,.0f}); "
                             "target >= 0.9"))
        elif scenario == "b":
            who, value = _best(theirs, lambda r: r.overall)
            out.append(_line(q.overall >= 1.2 * value, f"(b) {q.contender}: {q.overall:,.0f} img/s over "
                             f"{epochs} epochs = {_ratio(q.overall / value, 1.2)} x best other ({who.contender} "
                             f"{value:,.0f}); target >= 1.2"))
            who, value = _lowest(theirs, per_epoch)
            ok, mine, best = _at_most(per_epoch(q), value)
            out.append(_line(ok, f"(b) {q.contender}: bucket bytes per epoch {mine} datasets vs the lowest "
                             f"other ({who.contender} {best}); target <= 1.0 x"))
        elif scenario == "c":
            total = q.total_bytes / dataset_bytes
            out.append(_line(total <= 1.1, f"(c) {q.contender}: {q.jobs} jobs read {total:.2f} datasets from "
                             f"the bucket over the whole run ({epochs} epochs; stricter than per epoch); "
                             f"target <= 1.1"))
            who, value = _lowest(theirs, per_epoch)
            ok, mine, best = _at_most(per_epoch(q), value)
            out.append(_line(ok, f"(c) {q.contender}: bucket bytes per epoch, all jobs {mine} datasets vs "
                             f"the lowest other ({who.contender} {best}); target <= 1.0 x"))
            who, value = _best(theirs, lambda r: r.overall)
            out.append(_line(q.overall >= value, f"(c) {q.contender}: {q.overall:,.0f} img/s per job = "
                             f"{_ratio(q.overall / value, 1.0)} x best other ({who.contender} {value:,.0f}); "
                             f"target >= 1.0"))
    return out


#: mountd's log line of a dataset's mode change (mountd/coop/service.py)
MODE_CHANGE = re.compile(r": mode (?P<old>\w+) -> (?P<new>\w+) \(")


def modes_of(lines: list[str]) -> list[str]:
    """The modes a dataset went through, in order, from mountd's log lines of its mode
    changes (a change to the same mode, a new budget, is not a new mode)."""
    modes: list[str] = []
    for line in lines:
        change = MODE_CHANGE.search(line)
        if change is None:
            continue
        if not modes:
            modes.append(change["old"])
        if change["new"] != modes[-1]:
            modes.append(change["new"])
    return modes
