#!/usr/bin/env python3
"""Do the cache's remote limits hold? Measured bytes/s and requests/s vs configured.

Fills a fresh cache from a ``file://`` source of many 110 KB files (built once under
.bench/remote-src/), with many concurrent ensure() calls, in two side-by-side scenarios:

* bandwidth-bound — remote_bandwidth binds, remote_requests is set but loose;
* requests-bound  — remote_requests binds, remote_bandwidth is set but loose.

Each scenario skips a 1 s warm-up (the token buckets start with a 0.1 s burst) and then
measures the cache's own counters over a 10 s window. Target: within 10% of the limit.

    .venv/bin/python scripts/bench/remote_limits.py
    .venv/bin/python scripts/bench/remote_limits.py --bandwidth 20e6 --requests 100 --window 10
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

import blake3
import trio

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from mountd.store.cache import Cache, CacheConfig  # noqa: E402
from quiverfs.base.backends.base import Location  # noqa: E402

FILE_SIZE = 110 * 1024


def build_source(root: Path, count: int) -> list[tuple[bytes, int, str]]:
    root.mkdir(parents=True, exist_ok=True)
    have = len(os.listdir(root))
    if have < count:
        print(f"writing {count - have} source files of {FILE_SIZE} bytes to {root} ...", flush=True)
        for i in range(have, count):
            (root / f"img-{i:06d}.jpg").write_bytes(os.urandom(FILE_SIZE))
    items = []
    for i in range(count):
        name = f"img-{i:06d}.jpg"
        data = (root / name).read_bytes()
        items.append((blake3.blake3(data).digest(), len(data), name))
    return items


async def scenario(
    cache_dir: Path,
    url: str,
    items,
    bandwidth: float,
    requests: float,
    warmup: float,
    window: float,
) -> tuple[float, float]:
    shutil.rmtree(cache_dir, ignore_errors=True)
    cache = Cache(
        CacheConfig(
            cache_dir=cache_dir,
            cache_size=1 << 40,
            remote_bandwidth=bandwidth,
            remote_requests=requests,
            remote_concurrency=32,
            fill_concurrency=64,
        )
    )
    await cache.open()
    measured: dict[str, float] = {}
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(cache.run)
            slots = trio.Semaphore(64)

            async def one(h: bytes, size: int, name: str) -> None:
                try:
                    await cache.ensure(h, size, Location(url, name, 0, size))
                finally:
                    slots.release()

            async def feed() -> None:
                for h, size, name in items:
                    await slots.acquire()
                    nursery.start_soon(one, h, size, name)

            async def measure() -> None:
                total = cache.counters.total
                await trio.sleep(warmup)
                t0, b0, r0 = time.perf_counter(), total.remote_bytes, total.remote_requests["GET"]
                await trio.sleep(window)
                t1, b1, r1 = time.perf_counter(), total.remote_bytes, total.remote_requests["GET"]
                measured["bytes"] = (b1 - b0) / (t1 - t0)
                measured["requests"] = (r1 - r0) / (t1 - t0)
                nursery.cancel_scope.cancel()

            nursery.start_soon(feed)
            nursery.start_soon(measure)
    finally:
        await cache.aclose()
        shutil.rmtree(cache_dir, ignore_errors=True)
    return measured["bytes"], measured["requests"]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--bandwidth", type=float, default=10e6, help="bytes/s in the bandwidth-bound run"
    )
    parser.add_argument(
        "--requests", type=float, default=50, help="req/s in the requests-bound run"
    )
    parser.add_argument("--window", type=float, default=10.0)
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--dir", type=Path, default=REPO / ".bench")
    args = parser.parse_args()

    span = args.warmup + args.window + 1
    needed = int(max(args.bandwidth / FILE_SIZE, args.requests) * span * 1.2) + 64
    src = args.dir / "remote-src"
    items = build_source(src, needed)
    url = "file://" + str(src)
    loose = 3.0  # the other limit is set 3x above what the binding one allows
    runs = [
        ("bandwidth-bound", args.bandwidth, args.bandwidth / FILE_SIZE * loose),
        ("requests-bound", args.requests * FILE_SIZE * loose, args.requests),
    ]
    rows = []
    for name, bw, rq in runs:
        got_b, got_r = trio.run(
            scenario, args.dir / "remote-cache", url, items, bw, rq, args.warmup, args.window
        )
        rows.append((name, bw, got_b, rq, got_r))

    print()
    print(
        f"{FILE_SIZE}-byte files from file://, {args.window:.0f} s window after {args.warmup:.0f} s warm-up"
    )
    print(
        f"{'run':<16} {'limit B/s':>12} {'measured B/s':>13} {'ratio':>6}   {'limit req/s':>11} {'measured':>9} {'ratio':>6}"
    )
    for name, bw, got_b, rq, got_r in rows:
        print(
            f"{name:<16} {bw:>12,.0f} {got_b:>13,.0f} {got_b / bw:>6.3f}   {rq:>11.1f} {got_r:>9.1f} {got_r / rq:>6.3f}"
        )
    bound = [rows[0][2] / rows[0][1], rows[1][4] / rows[1][3]]
    verdict = "PASS" if all(0.9 <= r <= 1.1 for r in bound) else "FAIL"
    print(
        f"binding-limit ratios: bandwidth {bound[0]:.3f}, requests {bound[1]:.3f} -> {verdict} (target 0.9-1.1)"
    )


if __name__ == "__main__":
    main()
