"""Remote counters around a run, summaries of job results, and the printed tables."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class RemoteDelta:
    """What mountd asked of the bucket during a run (from its total counters)."""

    bytes: int
    gets: int
    hits: int
    misses: int
    prefetches: int

    @classmethod
    def between(cls, before: dict[str, Any], after: dict[str, Any]) -> RemoteDelta:
        return cls(
            bytes=after["remote_bytes"] - before["remote_bytes"],
            gets=after["remote_requests"]["GET"] - before["remote_requests"]["GET"],
            hits=after["hits"] - before["hits"],
            misses=after["misses"] - before["misses"],
            prefetches=after["prefetches"] - before["prefetches"],
        )

    @classmethod
    def since_start(cls, after: dict[str, Any]) -> RemoteDelta:
        """Everything a mountd asked of the bucket since it started."""
        return cls(bytes=after["remote_bytes"], gets=after["remote_requests"]["GET"],
                   hits=after["hits"], misses=after["misses"], prefetches=after["prefetches"])


@dataclass(frozen=True)
class BucketAccount:
    """Where mountd's bucket reads of a run went, from its counters and its protection
    figures (``stats`` and ``usage.protection``, what ``quiverfs stats`` prints) taken
    before and after: the breakdown that says where fetches beyond one dataset an epoch
    come from (issue 35, item 2).

    Every GET is a fill for a reader that waits (``on_demand``) or a prefetch fill.
    Prefetches are files fetched ahead for a reader (``fetched_ahead``: a claim's misses,
    the mounts' read-ahead and sweep, a displaced file fetched again, the members a chunk
    fill adds), which are protected until read (docs/store-layout.md "Holds and
    protection"), and chunk preloads, which the chunk's pin keeps instead (``preloads``:
    the prefetches that started no protection). Of the files fetched ahead, those whose
    protection ended other than by a read were dropped unread, by reason: ``released``
    (their job's epoch closed first), ``timeout``, ``demand`` (a reader's miss took their
    room: fetched again), ``removed``."""

    gets: int
    prefetches: int
    fetched_ahead: int
    read: int
    dropped: dict[str, int]

    @classmethod
    def of(cls, remote: RemoteDelta, protection_before: dict[str, Any],
           protection_after: dict[str, Any]) -> BucketAccount:
        """The account of a run whose bucket requests were ``remote``, from the cache's
        ``usage.protection`` before and after it (``{}``: a mountd just started)."""
        ended_before = protection_before.get("ended") or {}
        ended = {reason: n - ended_before.get(reason, 0)
                 for reason, n in (protection_after.get("ended") or {}).items()}
        return cls(
            gets=remote.gets,
            prefetches=remote.prefetches,
            fetched_ahead=protection_after.get("started", 0) - protection_before.get("started", 0),
            read=ended.pop("read", 0),
            dropped={reason: n for reason, n in ended.items() if n},
        )

    @property
    def on_demand(self) -> int:
        return max(0, self.gets - self.prefetches)

    @property
    def preloads(self) -> int:
        return max(0, self.prefetches - self.fetched_ahead)

    def line(self, files: int) -> str:
        """The account in datasets (``files`` GETs: one file each for a loose dataset),
        e.g. ``1.21 = on demand 0.31 + chunk loads 0.52 + fetched ahead 0.38 (read 0.33,
        dropped unread 0.05: released 0.02, demand 0.03)``."""
        def share(n: int) -> str:
            return f"{n / files:.2f}"

        dropped = sum(self.dropped.values())
        why = ", ".join(f"{reason} {share(n)}" for reason, n in self.dropped.items())
        return (f"{share(self.gets)} = on demand {share(self.on_demand)} + chunk loads "
                f"{share(self.preloads)} + fetched ahead {share(self.fetched_ahead)} (read "
                f"{share(self.read)}, dropped unread {share(dropped)}{': ' + why if why else ''})")


def mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def summarize(results: list[dict[str, Any]]) -> dict[str, float]:
    """Across jobs: mean mini-batch time and data wait weighted by batches, the slowest job's
    wall time, mean epoch time, files and bytes read."""
    batches = sum(r["batches"] for r in results)
    return {
        "jobs": len(results),
        "batches": batches,
        "mean_batch_s": sum(r["mean_batch_s"] * r["batches"] for r in results) / max(1, batches),
        "mean_wait_s": sum(r["mean_wait_s"] * r["batches"] for r in results) / max(1, batches),
        "p95_batch_s": max(r["p95_batch_s"] for r in results),
        "wall_s": max(r["wall_s"] for r in results),
        "mean_epoch_s": mean([e["seconds"] for r in results for e in r["epochs"]]),
        "files": sum(r["files"] for r in results),
        "bytes": sum(r["bytes"] for r in results),
        "bucket_gets": sum(r["bucket_gets"] for r in results),
    }


def epoch_means(results: list[dict[str, Any]]) -> list[float]:
    """Mean mini-batch time per epoch index, across jobs."""
    count = max(len(r["epochs"]) for r in results)
    out = []
    for e in range(count):
        rows = [r["epochs"][e] for r in results if len(r["epochs"]) > e]
        n = sum(x["batches"] for x in rows)
        out.append(sum(x["mean_batch_s"] * x["batches"] for x in rows) / max(1, n))
    return out


def verdict(value: float, target: float, *, at_most: bool = True) -> str:
    ok = value <= target if at_most else value >= target
    return "PASS" if ok else "FAIL"


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain text table; the first column left-aligned, the others right-aligned."""
    cells = [[str(h) for h in headers]] + [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = []
    for n, row in enumerate(cells):
        parts = [row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=True)]
        lines.append("  ".join(parts).rstrip())
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3f}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return str(value)


def parameters(pairs: dict[str, Any]) -> str:
    """``name=value`` pairs, wrapped at 100 columns."""
    lines, line = [], ""
    for key, value in pairs.items():
        item = f"{key}={value}"
        if line and len(line) + len(item) + 2 > 100:
            lines.append(line)
            line = ""
        line = f"{line}  {item}" if line else item
    lines.append(line)
    return "\n".join(lines)
