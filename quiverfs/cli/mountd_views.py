"""How the mountd admin commands look in a terminal: rich tables and the scrub progress bar.

Pure presentation of the dicts that :mod:`mountd.rpc.client` and :func:`mountd.stats.costs.stats_report`
return; ``--json`` prints those dicts instead. Kept apart from :mod:`quiverfs.cli.main` so the
command definitions stay short.
"""

from __future__ import annotations

import pwd
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table


def human_bytes(n: int | float | None) -> str:
    """``1536`` → ``"1.5 KiB"``; binary units like the rest of quiverfs."""
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} PiB"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _dollars(value: float | None) -> str:
    if value is None:
        return "n/a"
    return f"${value:,.4f}" if value < 1 else f"${value:,.2f}"


def _seconds(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value * 1000:.1f} ms" if value < 1 else f"{value:.2f} s"


def _requests(kinds: Mapping[str, int]) -> str:
    shown = [f"{kind} {count}" for kind, count in sorted(kinds.items()) if count]
    return ", ".join(shown) or "0"


def _console() -> Console:
    """A console for tables: the terminal's width, or 160 columns when output is piped, so
    tables in logs and CI output are not squeezed into rich's default 80."""
    console = Console()
    return console if console.is_terminal else Console(width=160)


#: Dataset ids are shown by their first hex digits in tables (``--json`` has them whole).
SHORT_ID = 16


def _rows(report: Mapping[str, Any]) -> list[tuple[str, Mapping[str, Any]]]:
    datasets = sorted(report["datasets"].items())
    return [("TOTAL", report["total"]), *((name[:SHORT_ID], row) for name, row in datasets)]


def print_mounts(rows: Iterable[Mapping[str, Any]], console: Console | None = None) -> None:
    """One row per mount with the digest file it mounted (the user's, not the private copy it
    serves), that mount's own counters (from ``mount_cli.mount_stats``), and the files
    (bytes) its read-ahead and its sweep sent to mountd."""
    table = Table(title="mounts", title_justify="left")
    for column in ("mount point", "digest", "dataset", "pid", "opens", "hits", "misses", "reads", "bytes",
                   "errors", "read ahead", "sweep"):
        if column == "digest":  # a path: folded where it must, whatever its characters
            table.add_column(column, justify="left", overflow="fold")
            continue
        left = column in ("mount point", "dataset")
        table.add_column(column, justify="left" if left else "right", no_wrap=left)
    for row in rows:
        stats = row.get("stats") or {}
        figures = [str(stats.get(k, "-")) for k in ("opens", "hits", "misses", "reads", "bytes", "errors")]
        if not row.get("stats"):
            figures[0] = row.get("stats_error") or "-"
        table.add_row(
            str(row.get("mountpoint") or "-"), str(row.get("digest") or "-"),
            str(row.get("dataset", ""))[:SHORT_ID], str(row.get("pid", "")), *figures, _read_ahead(stats),
            _sweep(stats),
        )
    (console or _console()).print(table)


def _read_ahead(stats: Mapping[str, Any]) -> str:
    """A mount's read-ahead: ``off``, or files sent to mountd and their bytes."""
    if "readahead" not in stats:
        return "-"
    if not stats["readahead"]:
        return "off"
    nbytes = stats.get("readahead_bytes")  # absent from an older mount
    files = stats.get("readahead_files", 0)
    return str(files) if nbytes is None else f"{files} ({human_bytes(nbytes)})"


def _sweep(stats: Mapping[str, Any]) -> str:
    """A mount's sweep: ``off``, ``idle`` (not running: the cache's size not known yet, or a
    dataset larger than the cache on a mount whose fills mountd does not keep), or files sent
    to mountd and their bytes, and for a dataset larger than the cache what is asked for and
    not read yet against its bound."""
    if "sweep" not in stats:
        return "-"  # an older mount
    if not stats["sweep"]:
        return "off"
    if not stats.get("sweep_running"):
        return "idle"
    sent = f"{stats['sweep_files']} ({human_bytes(stats['sweep_bytes'])})"
    bound = stats.get("sweep_bound_bytes")
    if not bound:
        return sent
    return f"{sent}, unread {human_bytes(stats['sweep_unread_bytes'])} of {human_bytes(bound)}"


def _user_name(uid: str) -> str:
    try:
        return f"{pwd.getpwuid(int(uid)).pw_name} ({uid})"
    except (KeyError, ValueError):
        return uid


def print_users(users: Mapping[str, Mapping[str, Any]], console: Console | None = None) -> None:
    """One row per local user that used mountd (requests are attributed by SO_PEERCRED),
    with the cached bytes charged to it and its quota (``-``: none)."""
    table = Table(title="mountd: users", title_justify="left")
    for column in ("user", "requests", "misses asked", "supplied", "supplied bytes", "hits reported",
                   "handed over", "refused", "cached", "quota", "quota evicted"):
        table.add_column(column, justify="left" if column == "user" else "right", no_wrap=True)
    for uid, row in sorted(users.items(), key=lambda item: int(item[0])):
        quota = row.get("quota")
        table.add_row(
            _user_name(uid), str(row["requests"]), str(row["ensures"]), str(row["supplied"]),
            human_bytes(row["supplied_bytes"]), str(row["reported_hits"]),
            str(row.get("opened", 0)),  # descriptors (hand-off); absent from an older mountd
            str(row["refused"]),
            f"{row.get('cached_files', 0)} ({human_bytes(row.get('cached_bytes', 0))})",
            "-" if quota is None else human_bytes(quota),
            f"{row.get('quota_evicted_files', 0)} ({human_bytes(row.get('quota_evicted_bytes', 0))})",
        )
    (console or _console()).print(table)


def print_cluster(cluster: Mapping[str, Any], console: Console | None = None) -> None:
    """This node's cluster (docs/cluster.md): Redis reachable or serving alone, the members,
    what came from peers and what went to them; one row per peer that failed or lied."""
    console = console or _console()
    state = "connected" if cluster["connected"] else "Redis UNREACHABLE: serving alone"
    transport = "TLS" if cluster.get("tls") else "plain TCP"  # absent from an older mountd
    table = Table(title=f"mountd: cluster {cluster['name']} (node {cluster['node']}, "
                        f"Redis {cluster['redis']}: {state}; peers over {transport})",
                  title_justify="left")
    for column in ("members", "peer hits", "from peers", "peer misses", "bucket turns",
                   "waited", "taken over", "pushed", "served", "served bytes", "refused handshakes",
                   "Redis errors"):
        table.add_column(column, justify="right", no_wrap=True)
    table.add_row(
        str(len(cluster["members"])), str(cluster["peer_hits"]),
        human_bytes(cluster["peer_bytes"]), str(cluster["peer_misses"]),
        str(cluster["bucket_turns"]), str(cluster["lock_waits"]),
        str(cluster.get("take_overs", 0)),
        f"{cluster['pushes']} ({cluster['push_errors']} failed)",
        str(cluster["served_hits"]), human_bytes(cluster["served_bytes"]),
        str(cluster["auth_failures"]), str(cluster["redis_errors"]),
    )
    console.print(table)
    console.print("members: " + ", ".join(cluster["members"]))
    bad = sorted(set(cluster["peer_errors"]) | set(cluster["peer_corrupt"]))
    if bad:
        errors = Table(title="mountd: peers that failed", title_justify="left")
        for column in ("peer", "failed transfers", "wrong bytes"):
            errors.add_column(column, justify="left" if column == "peer" else "right")
        for peer in bad:
            errors.add_row(peer, str(cluster["peer_errors"].get(peer, 0)),
                           str(cluster["peer_corrupt"].get(peer, 0)))
        console.print(errors)


def _prefetched(row: Mapping[str, Any]) -> str:
    """Fills started ahead of readers, and those dropped for want of room: ``120 (3 dropped)``."""
    dropped = row.get("prefetches_dropped", 0)  # absent from an older mountd
    return f"{row['prefetches']} ({dropped} dropped)" if dropped else str(row["prefetches"])


def _chunk_fills(row: Mapping[str, Any]) -> str:
    """Chunk fills and the files each stored on average (one GET each): ``12 (×63.5)``."""
    fills = row.get("chunk_fills", 0)  # absent from an older mountd
    if not fills:
        return "-"
    return f"{fills} (×{row.get('chunk_members', 0) / fills:.1f})"


def print_stats(report: Mapping[str, Any], console: Console | None = None) -> None:
    """Three tables: what was read from where, how fills went, and what the cache saved."""
    console = console or _console()
    reads = Table(title="mountd: reads", title_justify="left")
    for column in ("dataset", "hits", "misses", "hit ratio", "from cache", "from remote", "remote requests"):
        reads.add_column(column, justify="left" if column in ("dataset", "remote requests") else "right")
    health = Table(title="mountd: fills", title_justify="left")
    for column in ("dataset", "prefetched", "chunk fills", "verify fail", "errors", "evicted", "fill p50",
                   "fill mean", "fill p95"):
        health.add_column(column, justify="left" if column == "dataset" else "right", no_wrap=True)
    for name, row in _rows(report):
        reads.add_row(
            name, str(row["hits"]), str(row["misses"]), _ratio(row["hit_ratio"]),
            human_bytes(row["bytes_from_cache"]), human_bytes(row["bytes_from_remote"]),
            _requests(row["remote_requests"]),
        )
        latency = row["fill_latency"]
        p95 = latency["p95_le_s"]
        health.add_row(
            name, _prefetched(row), _chunk_fills(row), str(row["verify_failures"]),
            str(row["fill_errors"]),
            f"{row['evicted_files']} ({human_bytes(row['evicted_bytes'])})",
            _seconds(latency.get("p50_s")),
            _seconds(latency["mean_s"]),
            ("≤ " + _seconds(p95)) if p95 is not None else ("> 10 s" if latency["count"] else "-"),
        )
    console.print(reads)
    console.print(health)

    saved = Table(title="mountd: saved by the cache (DELI cost model)", title_justify="left")
    for column in ("dataset", "cloud", "requests saved", "bytes saved", "cost saved", "remote cost"):
        saved.add_column(column, justify="left" if column in ("dataset", "cloud") else "right")
    for name, row in _rows(report):
        saved.add_row(
            name, ", ".join(row["schemes"]) or "-", str(row["requests_saved"]),
            human_bytes(row["bytes_saved"]), _dollars(row["cost_saved"]), _dollars(row["remote_cost"]),
        )
    console.print(saved)
    notes = [f"list prices as of {report['prices_as_of']}"]
    notes.append("egress not counted (--in-region)" if report["in_region"] else "internet egress priced")
    if report.get("total_priced_partially"):
        notes.append("TOTAL cost counts only the datasets with one known cloud")
    console.print("  " + "; ".join(notes) + ".", style="dim")


def _files_bytes(files: int, nbytes: int | None, why: str = "") -> str:
    """``12 files (3.0 MiB: why)``; without bytes (None) ``12 files (why)``."""
    count = f"{files} file" if files == 1 else f"{files} files"
    if nbytes is None:
        return f"{count} ({why})" if why else count
    return f"{count} ({human_bytes(nbytes)}{': ' + why if why else ''})"


def print_fetched_ahead(protection: Mapping[str, Any], console: Console | None = None) -> None:
    """One line from the cache's ``protection`` (mountd/store/holds.py): the files mountd
    fetched ahead of their readers since it started (the mounts' read-ahead, claims' misses,
    packed members brought along), how many were read, how many wait unread now, and how
    many were dropped unread, and why (their time ran out, a reader's miss needed the room,
    their job let go, they left the store or their fill failed). Bytes where mountd counts
    them (an older one counts files only)::

        fetched ahead 120 files (52.9 MiB): read 100 files (2.4 MiB), unread now 4 files
        (96.0 KiB), dropped unread 16 files (50.4 MiB: timeout 15, demand 1)

    and, when claims kept cached files for the jobs they handed them to (``kept``), a second
    line of the same form, ``kept for their readers ...``.
    """
    console = console or _console()
    console.print(_protection_line("fetched ahead", protection))
    kept = protection.get("kept")  # absent from an older mountd
    if kept and kept.get("started"):
        console.print(_protection_line("kept for their readers", kept))


def _protection_line(what: str, tally: Mapping[str, Any]) -> str:
    """``WHAT N files (B): read ..., unread now ..., dropped unread ...`` of one kind of
    protection (files fetched ahead, or cached files a claim handed out and keeps)."""
    ended = tally.get("ended") or {}
    ended_bytes = tally.get("ended_bytes")  # absent from an older mountd

    def nbytes(reasons: list[str]) -> int | None:
        return None if ended_bytes is None else sum(ended_bytes.get(r, 0) for r in reasons)

    dropped = [reason for reason in ended if reason != "read"]
    why = ", ".join(f"{reason} {ended[reason]}" for reason in dropped if ended[reason])
    return (f"{what} {_files_bytes(tally.get('started', 0), tally.get('started_bytes'))}: "
            f"read {_files_bytes(ended.get('read', 0), nbytes(['read']))}, "
            f"unread now {_files_bytes(tally.get('files', 0), tally.get('bytes'))}, "
            f"dropped unread {_files_bytes(sum(ended[r] for r in dropped), nbytes(dropped), why)}")


#: Where each stage of ``fill_stages`` runs (the rest run in mountd's main process, its
#: event loop but for ``commit``, which a worker thread of that process runs).
_IN_FILL_PROCESS = ("read", "hash", "write", "rename")

#: CPU of a fill's ``write`` and ``rename`` together above which ``quiverfs stats`` says the
#: cache's filesystem is slow to create files: ~0.15 ms for 110 KiB on a fresh ext4, 0.9–3.2 ms
#: on a root ext4 a cache had just been deleted from (docs/operations.md, 2026-11-30).
SLOW_CREATE_S = 0.0005

#: Fills observed before that is judged (the first few include opening the fan-out folders).
SLOW_CREATE_FILLS = 200


def print_fill_stages(stages: Mapping[str, Any], console: Console | None = None) -> None:
    """Where fills spend their time, stage by stage (``counters.fill_stages``, docs/operations.md
    "Monitoring"): per observation, wall and (where measured) CPU microseconds."""
    console = console or _console()
    table = Table(title=f"mountd: where fills spend their time ({stages.get('jobs', 0)} jobs "
                        "in fill processes)", title_justify="left")
    for column in ("stage", "where", "observed", "wall per fill", "CPU per fill"):
        table.add_column(column, justify="left" if column in ("stage", "where") else "right")
    for name, stage in (stages.get("stages") or {}).items():
        count = stage.get("count", 0)
        if not count:
            continue
        cpu = stage.get("cpu_s", 0.0)
        table.add_row(
            name, "fill process" if name in _IN_FILL_PROCESS
            else "mountd (thread)" if name == "commit" else "mountd", str(count),
            f"{stage.get('wall_s', 0.0) / count * 1e6:,.0f} µs",
            f"{cpu / count * 1e6:,.0f} µs" if cpu else "-")
    console.print(table)
    creating = slow_file_creation(stages)
    if creating is not None:
        console.print(
            f"creating cache files is slow: a fill's write and rename cost {creating * 1e3:.2f} ms "
            "of CPU (~0.15 ms on a fresh filesystem); a filesystem of its own for the cache "
            "helps (docs/operations.md)")


def slow_file_creation(stages: Mapping[str, Any]) -> float | None:
    """The CPU seconds a fill's ``write`` and ``rename`` took together, when above
    :data:`SLOW_CREATE_S` over at least :data:`SLOW_CREATE_FILLS` fills; else None."""
    parts = [(stages.get("stages") or {}).get(name) or {} for name in ("write", "rename")]
    fills = min(part.get("count", 0) for part in parts)
    if fills < SLOW_CREATE_FILLS:
        return None
    cpu = sum(part.get("cpu_s", 0.0) / part["count"] for part in parts)
    return cpu if cpu > SLOW_CREATE_S else None


def print_sources(sources: Mapping[str, Any], console: Console | None = None) -> None:
    """Each remote source mountd opened: its requests, bytes read, retries and failures, and
    how reads reach it where there is a choice (S3 and Azure: ``obstore``, or ``boto3`` /
    ``azure-storage-blob`` once that backend's reads go through its SDK; docs/backends.md
    "Reads through obstore")."""
    console = console or _console()
    table = Table(title="mountd: sources", title_justify="left")
    for column in ("source", "reads", "requests", "bytes read", "retries", "failures"):
        table.add_column(column, justify="left" if column in ("source", "reads", "requests",
                                                              "failures") else "right")
    for url, row in sorted(sources.items()):
        failures = row.get("failures") or {}
        table.add_row(
            url, row.get("reads") or "-", _requests(row.get("requests") or {}),
            human_bytes(row.get("bytes_read", 0)), str(row.get("retries", 0)),
            ", ".join(f"{kind} {n}" for kind, n in sorted(failures.items())) or "-",
        )
    console.print(table)


def _float(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def print_allocation(allocation: Mapping[str, Any], console: Console | None = None) -> None:
    """Who gets the cache (Quiver §5.3): the policy in force (benefit-aware, budget-only or
    manual); per dataset its mode, bytes and why; per job where it is (epoch and share
    given), the measured mini-batch times, ``b = t_miss / t_hit`` and ``g = b × GPUs`` (a
    job not measured yet shows the ``b`` the allocation counts for it in parentheses); and
    for a chunked dataset whose jobs read out of phase, which two are furthest apart."""
    console = console or _console()
    policy = allocation.get("policy") or (  # mountds before the policy was named
        "benefit-aware" if allocation.get("benefit_aware") else "manual")
    table = Table(title=f"mountd: cache allocation ({policy}, budget "
                        f"{human_bytes(allocation.get('budget'))})", title_justify="left")
    for column in ("dataset", "mode", "bytes", "G", "job", "epoch", "GPUs", "t_hit", "t_miss",
                   "b", "g"):
        table.add_column(column, justify="left" if column in ("dataset", "mode", "job") else "right",
                         no_wrap=column != "dataset")
    reasons = []
    for name, row in (allocation.get("datasets") or {}).items():
        jobs = row.get("jobs") or [{}]
        for k, job in enumerate(jobs):
            first = k == 0
            probing = " (probing)" if job.get("probing") else ""
            table.add_row(
                name if first else "", row["mode"] if first else "",
                (human_bytes(row["bytes"]) if row.get("bytes") is not None else "-") if first else "",
                _float(row.get("benefit")) if first else "",
                (job.get("job") or "-") + probing,
                "-" if job.get("position") is None else f"{job['position']:.2f}",
                str(job.get("gpus", "-")),
                _seconds(job.get("t_hit")), _seconds(job.get("t_miss")),
                _float(job.get("b")) if job.get("b") is not None or job.get("b_counted") is None
                else f"({_float(job.get('b_counted'))})",
                _float(job.get("g")),
            )
        reasons.append(f"  {name[:16]}: {row.get('reason')}")
        apart = row.get("out_of_phase")
        if apart:
            a, b = apart["jobs"]
            reasons.append(f"  {name[:16]}: jobs {a} and {b} read {apart['epochs']:.2f} of an "
                           "epoch apart: the chunks they share tie each one's order to the "
                           "other's (docs/substitutable-reads.md, \"Jobs out of phase\")")
    console.print(table)
    for line in reasons:
        console.print(line, style="dim")


def print_ls(listing: Mapping[str, Any], console: Console | None = None) -> None:
    """Cache usage, datasets with their cached bytes, and registered mounts."""
    console = console or _console()
    usage = listing.get("usage") or {}
    used, cap = usage.get("used_bytes"), usage.get("cap_bytes")
    share = f" ({100 * used / cap:.1f}%)" if used is not None and cap else ""
    console.print(
        f"cache {usage.get('cache_dir', '?')}: {human_bytes(used)} of {human_bytes(cap)}{share} "
        f"in {usage.get('entries', 0)} files, {usage.get('fills_in_flight', 0)} fills in flight"
    )
    datasets = Table(title="datasets", title_justify="left")
    for column in ("dataset", "files", "bytes", "registered"):
        datasets.add_column(column, justify="left" if column == "dataset" else "right")
    mounted = set(listing.get("datasets") or [])
    per = usage.get("datasets") or {}
    for name in sorted(set(per) | mounted):
        info = per.get(name) or {}
        datasets.add_row(name, str(info.get("entries", 0)), human_bytes(info.get("bytes", 0)),
                         "yes" if name in mounted or info.get("registered") else "no")
    console.print(datasets)
    mounts = Table(title="mounts", title_justify="left")
    for column in ("id", "dataset", "mountpoint", "pid", "uid"):
        mounts.add_column(column)
    for m in listing.get("mounts") or []:
        mounts.add_row(str(m["id"]), m["dataset"], m.get("mountpoint") or "-", str(m["pid"]), str(m["uid"]))
    console.print(mounts)


@contextmanager
def scrub_progress(console: Console | None = None) -> Iterator[Callable[[Mapping[str, Any]], None]]:
    """A progress bar (rate, ETA) fed by scrub's progress frames ``{"done", "total"}``."""
    with Progress(
        TextColumn("scrub"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
        console=console or Console(stderr=True), transient=True,
    ) as bar:
        task = bar.add_task("scrub", total=None)

        def update(progress: Mapping[str, Any]) -> None:
            bar.update(task, completed=progress.get("done", 0), total=progress.get("total"))

        yield update


def print_scrub(report: Mapping[str, Any], console: Console | None = None) -> None:
    """One line per count of the scrub report."""
    console = console or _console()
    console.print(
        f"scrub: checked {report.get('checked', 0)} files ({human_bytes(report.get('bytes_checked', 0))}) "
        f"in {report.get('seconds', 0.0):.1f} s: {report.get('ok', 0)} ok, {report.get('bad', 0)} bad, "
        f"{report.get('missing', 0)} missing; removed {human_bytes(report.get('removed_bytes', 0))}"
    )
