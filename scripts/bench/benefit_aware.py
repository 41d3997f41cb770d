"""Quiver Figure 6 (§7.6) scaled down: who gets the cache when three datasets compete.

Three datasets of different sizes (harness.world.make_dataset, distinct seeds: 1200, 600 and
60 files by default), three emulated training jobs
each (a multi-job, as the paper ran four per dataset: co-operative misses are what chunked
mode buys; with one job per dataset two chunks gain nothing, every file is fetched once per
epoch either way, and LRU's cross-epoch hits win), of three I/O sensitivities: the same batch
size with different compute per mini-batch (``sensitive`` reads far faster than the bucket
gives, ``medium`` a little, ``insensitive`` needs less than its share of the bucket). One
mountd (in process: real Cache, real RPC, real tick loop, ``file://`` bucket under
``--remote-bandwidth``-style limits) serves all of them; each job claims through the session
layer (the shim's protocol) in a reader task that runs ``prefetch`` batches ahead of the
training loop (a DataLoader: I/O overlaps compute), reads hits from the store and ``ensure``s
misses; the loop computes ``compute_s`` and reports each step's time with the batch's files
and misses (exact hit/miss samples for the benefit measurement).

Policies, each at a cache of 15%, 30% and 90% of the three datasets together:

* ``benefit`` — mountd's default: probes, ``b = t_miss / t_hit``, greedy by ``G_D`` per byte;
* ``budget`` — the budget-only policy (each dataset's mode from the cache budget alone,
  datasets dealt in registration order: sensitive, medium, insensitive, the order of their
  benefit; with equal datasets budget-only then decides as benefit-aware would, with the
  default ones the sensitive dataset's chunks take the whole budget at 15%);
* ``budget-rev`` — budget-only with the datasets registered the other way round
  (insensitive first): what it does when the least sensitive job's dataset arrives first.
  Budget-only's result depends on arrival order, which it cannot see; the verdict compares
  benefit-aware with the mean of the two orders (and prints each);
* ``lru`` — ``--dataset-mode lru``;
* ``nocache`` (once) — the baseline: a cache of 1% in ``lru`` mode (a few files: in
  effect no cache, but fills still land in the store as the read path needs).

Cluster throughput = the mean over jobs of (mini-batches/s in the measured window ÷ the
same job's rate without cache), as the paper normalises. Each run warms up ``warm_s`` (the
probes run then), then measures ``measure_s``.

    .venv/bin/python scripts/bench/benefit_aware.py [--quick] [--json OUT]
    .venv/bin/python scripts/bench/benefit_aware.py --fractions 0.15 0.30 --repeats 3  # ~25 min

With ``--repeats N`` every cell runs N times (the cells interleaved, so a slow spell of the
machine spreads over all of them) and the table and the verdict use each cell's median run.

The default workload is the paper's regime: datasets of different sizes whose jobs' cached
epochs are comparable (about 5, 10 and 12 s), so that recency cannot tell the datasets apart
and LRU thrashes on all of them. ``--files`` and ``--compute`` set other workloads; the
earlier default, three equal datasets of 240 files whose jobs' epochs differ 200x, lets LRU
keep the fastest jobs' files (benefit order by recency), and at 90% every policy caches the
same files and the single benchmark process, not the cache, bounds the sensitive jobs
(docs/benchmarks.md):

    .venv/bin/python scripts/bench/benefit_aware.py --files 240 240 240 --compute 0.01 0.06 2.0
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import trio  # noqa: E402
from harness.world import BENCH, DatasetSpec, make_dataset  # noqa: E402

from mountd.daemon import DaemonConfig, serve  # noqa: E402
from mountd.rpc.async_client import open_client  # noqa: E402
from mountd.store import layout  # noqa: E402
from mountd.store.cache import CacheConfig  # noqa: E402


@dataclass(frozen=True)
class Params:
    #: files of each dataset: sensitive, medium, insensitive
    files: tuple[int, int, int] = (1200, 600, 60)
    file_size: int = 16 * 1024
    batch_size: int = 8
    #: compute seconds per mini-batch of the three jobs: sensitive, medium, insensitive
    compute_s: tuple[float, float, float] = (0.03, 0.15, 1.5)
    #: the bucket: bytes/s for all fills together
    bandwidth: float = 1.5e6
    fractions: tuple[float, ...] = (0.15, 0.3, 0.9)
    warm_s: float = 35.0
    measure_s: float = 20.0
    policies: tuple[str, ...] = ("benefit", "budget", "budget-rev", "lru")
    names: tuple[str, ...] = field(default=("sensitive", "medium", "insensitive"))
    #: jobs per dataset (the paper ran four per dataset: a multi-job, whose co-operative misses
    #: are what chunked mode buys; one job per dataset gains nothing from two chunks)
    jobs_per_dataset: int = 3
    #: batches the reader runs ahead of the training loop (a DataLoader's prefetch)
    prefetch: int = 2


async def job(server: Any, ds: Any, name: str, compute_s: float, p: Params,
              stop_at: float, marks: dict[str, Any]) -> None:
    async with open_client(server.cache.config.cache_dir) as client:
        await run_job(client, server, ds, name, compute_s, p, stop_at, marks)


async def run_job(client: Any, server: Any, ds: Any, name: str, compute_s: float, p: Params,
                  stop_at: float, marks: dict[str, Any]) -> None:
    """One emulated job, shaped like a DataLoader with one worker: a reader task claims (4
    batches a claim), reads each batch (hits from the store, reported to mountd as the direct
    loader reports them, so LRU sees those reads; misses ``ensure``d: the claim started
    their fills already) and hands it over up to ``p.prefetch`` batches ahead, while
    the training loop takes a batch, computes ``compute_s`` and reports the step time (wait +
    compute) with how many of the batch's files its claim gave as misses. I/O and compute
    overlap as in real training, so a job whose reads keep up with its compute gains nothing
    from the cache (the insensitive job)."""
    seed = int(name.rsplit("-", 1)[-1]) + 1 if "-" in name else 1
    await client.session_open(ds.dataset_id, name, seed=seed)
    view = server.coop.views[ds.dataset_id]
    cache_dir = server.cache.config.cache_dir
    send, receive = trio.open_memory_channel[tuple[int, int]](p.prefetch)
    done_at: list[float] = []

    async def reader() -> None:
        epoch = 0
        buffer: list[tuple[int, bool]] = []
        async with send:
            while True:
                # Full batches across claims, as the shim's sampler makes them (a claim in a
                # chunk's last files gives only those); a short batch only at the epoch's end.
                while len(buffer) < p.batch_size:
                    claim = await client.claim(ds.dataset_id, name, 0, 4 * p.batch_size, epoch=epoch)
                    ids = [(i, False) for i in claim["hits"]] + [(i, True) for i in claim["fetch"]]
                    if not ids:
                        break  # this epoch is given out
                    buffer.extend(ids)
                if not buffer:
                    epoch += 1
                    continue
                batch, buffer = buffer[: p.batch_size], buffer[p.batch_size:]
                read: list[bytes] = []  # from the store: reported as hits, as the direct loader does
                nbytes = 0
                for cid, _ in batch:
                    h, size, loc = view.item(cid)
                    try:
                        layout.store_path(cache_dir, h).read_bytes()
                        read.append(h)
                        nbytes += size
                    except FileNotFoundError:
                        await client.ensure(h, size, loc, ds.dataset_id)
                if read:
                    await client.hits(ds.dataset_id, read, nbytes)
                await send.send((len(batch), sum(1 for _, miss in batch if miss)))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(reader)
        last = None
        while trio.current_time() < stop_at:
            files, misses = await receive.receive()
            await trio.sleep(compute_s * files / p.batch_size)  # a short batch computes less
            now = trio.current_time()
            if last is not None:  # as the shim: the wait for the first batch is start-up
                await client.report_batch(ds.dataset_id, name, 0, now - last, files=files, misses=misses)
            last = now
            done_at.append(now)
        nursery.cancel_scope.cancel()
    marks[name] = done_at


async def one_run(datasets: list[Any], p: Params, policy: str, cache_size: int) -> dict[str, Any]:
    cache_dir = Path(tempfile.mkdtemp(prefix="qbenefit-", dir="/tmp"))
    try:
        mode = "lru" if policy in ("lru", "nocache") else None
        config = DaemonConfig(CacheConfig(cache_dir=cache_dir, cache_size=cache_size,
                                          remote_bandwidth=p.bandwidth),
                              dataset_mode=mode)
        marks: dict[str, Any] = {}
        async with trio.open_nursery() as nursery:
            running = await nursery.start(partial(serve, config, handle_signals=False))
            server = running.server
            if policy in ("budget", "budget-rev"):
                server.coop.registry.benefit_aware = False
            async with open_client(cache_dir) as admin:
                for ds in (datasets[::-1] if policy == "budget-rev" else datasets):
                    await admin.register(ds.dataset_id, digest=str(ds.digest))
                start = trio.current_time()
                stop_at = start + p.warm_s + p.measure_s
                async with trio.open_nursery() as jobs:
                    for ds, name, compute in zip(datasets, p.names, p.compute_s, strict=True):
                        for k in range(p.jobs_per_dataset):
                            jobs.start_soon(job, server, ds, f"{name}-{k}", compute, p, stop_at, marks)
                alloc = server.coop.allocation_json()
            server.shutdown.set()
        window_start = start + p.warm_s
        rates = {n: sum(1 for t in done if t >= window_start) / p.measure_s for n, done in marks.items()}
        rows = {n: alloc["datasets"][ds.dataset_id] for n, ds in zip(p.names, datasets, strict=True)}
        return {"policy": policy, "cache_size": cache_size, "rates": rates,
                "modes": {n: row["mode"] for n, row in rows.items()},
                "b": {n: [j["b"] for j in row["jobs"]] for n, row in rows.items()},
                "retained_bytes": {n: row.get("retained_bytes", 0) for n, row in rows.items()},
                "reasons": {n: row["reason"] for n, row in rows.items()}}
    finally:
        shutil.rmtree(cache_dir, ignore_errors=True)


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run of median cluster throughput (the lower middle one of an even count): its
    figure and its modes come from the same run."""
    ordered = sorted(runs, key=lambda r: r["norm"])
    return ordered[(len(ordered) - 1) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="30%% only, shorter runs (~4 min)")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--fractions", type=float, nargs="+", help="cache sizes (share of the total)")
    parser.add_argument("--warm", type=float, help="warm-up seconds per run")
    parser.add_argument("--measure", type=float, help="measured seconds per run (with --warm)")
    parser.add_argument("--policies", nargs="+", choices=("benefit", "budget", "budget-rev", "lru"))
    parser.add_argument("--files", type=int, nargs=3, help="files of each dataset (sens, med, insens)")
    parser.add_argument("--compute", type=float, nargs=3, help="compute s per batch (sens, med, insens)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs per cell, interleaved; the table and verdict use each cell's "
                             "median (one run's spread is larger than the differences judged)")
    args = parser.parse_args()
    if args.repeats < 1:
        raise SystemExit("--repeats must be >= 1")
    if args.files and (min(args.files) < 1 or sum(args.files) < 100):
        raise SystemExit("--files must be >= 1 each and >= 100 together (the no-cache baseline "
                         "is a cache of 1% of the three, which must hold a file)")
    if args.compute and min(args.compute) < 0:
        raise SystemExit("--compute must be >= 0 each")
    p = Params()
    if args.quick:
        p = Params(fractions=(0.3,), warm_s=25.0, measure_s=12.0)
    if args.warm is not None:
        p = replace(p, warm_s=args.warm, measure_s=args.measure or p.measure_s)
    if args.fractions:
        p = replace(p, fractions=tuple(args.fractions))
    if args.policies:
        p = replace(p, policies=tuple(args.policies))
    if args.files:
        p = replace(p, files=tuple(args.files))
    if args.compute:
        p = replace(p, compute_s=tuple(args.compute))
    datasets = [make_dataset(DatasetSpec(files=n, file_size=p.file_size, classes=4, seed=100 + i))
                for i, n in enumerate(p.files)]
    total = sum(d.total_bytes for d in datasets)
    print(f"[benefit] datasets of {', '.join(f'{d.total_bytes / 1e6:.1f}' for d in datasets)} MB; bucket "
          f"{p.bandwidth / 1e6:.1f} MB/s; jobs compute {p.compute_s} s per batch of {p.batch_size}",
          flush=True)
    results = []
    base = trio.run(one_run, datasets, p, "nocache", max(1, int(0.01 * total)))
    print(f"[benefit] nocache: {base['rates']}", flush=True)
    for repeat in range(args.repeats):
        for f, policy in ((f, policy) for f in p.fractions for policy in p.policies):
            t0 = time.perf_counter()
            r = trio.run(one_run, datasets, p, policy, int(f * total))
            r["fraction"], r["repeat"] = f, repeat
            r["norm"] = sum(r["rates"][n] / max(1e-9, base["rates"][n]) for n in r["rates"]) / len(r["rates"])
            results.append(r)
            print(f"[benefit] {f:.0%} {policy:8s} run {repeat + 1}/{args.repeats} "
                  f"throughput x{r['norm']:.2f}  modes {r['modes']}  "
                  f"b {({k: [round(x, 2) if x else None for x in v] for k, v in r['b'].items()})}  "
                  f"kept across epochs {({k: f'{v / 1e6:.2f} MB' for k, v in r['retained_bytes'].items() if v})}  "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)
    if args.repeats > 1:
        print(f"\neach cell's runs (the table shows the median of {args.repeats}):")
        for f, policy in ((f, policy) for f in p.fractions for policy in p.policies):
            norms = " ".join(f"{r['norm']:.2f}" for r in results
                             if r["fraction"] == f and r["policy"] == policy)
            print(f"  {f:.0%} {policy:10s} {norms}")
    print("\n| cache | benefit-aware | budget-only (sens first) | budget-only (insens first) | "
          "budget-only, mean | LRU | benefit-aware modes (sens/med/insens) | budget-only modes "
          "(sens first / insens first) |")
    print("|---|---|---|---|---|---|---|---|")
    ok = ok_each = True

    def modes_of(r: dict | None) -> str:
        return "/".join(r["modes"][n] for n in p.names) if r else "-"

    for f in p.fractions:
        row = {policy: median_run([r for r in results if r["fraction"] == f and r["policy"] == policy])
               for policy in p.policies}
        b = row.get("benefit")
        budgets = [row[k]["norm"] for k in ("budget", "budget-rev") if k in row]
        mean = sum(budgets) / len(budgets) if budgets else None
        cells = [f"{row[k]['norm']:.2f}" if k in row else "-" for k in ("benefit", "budget", "budget-rev")]
        cells += [f"{mean:.2f}" if mean is not None else "-",
                  f"{row['lru']['norm']:.2f}" if "lru" in row else "-"]
        print(f"| {f:.0%} | " + " | ".join(cells) + f" | {modes_of(b)} | "
              f"{modes_of(row.get('budget'))} / {modes_of(row.get('budget-rev'))} |")
        if b:
            ok &= (mean is None or b["norm"] >= mean) and ("lru" not in row or b["norm"] >= row["lru"]["norm"])
            ok &= all(r["modes"]["insensitive"] == "off" for r in results
                      if r["fraction"] == f and r["policy"] == "benefit")
            ok_each &= all(b["norm"] >= row[k]["norm"] for k in ("budget", "budget-rev", "lru") if k in row)
    print(f"\nverdict: benefit-aware >= budget-only (mean of the two arrival orders) and >= LRU, "
          f"insensitive dataset off, at every size: {ok}")
    print(f"         benefit-aware >= every other run (each arrival order): {ok_each}")
    if args.json:
        args.json.write_text(json.dumps({"params": asdict(p), "nocache": base, "runs": results}, indent=1))
    os.makedirs(BENCH, exist_ok=True)


if __name__ == "__main__":
    main()
