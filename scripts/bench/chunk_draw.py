#!/usr/bin/env python3
"""What planning a chunk costs mountd's trio thread at ImageNet scale (issue 15's draw).

Every chunk is drawn afresh when it is planned (docs/substitutable-reads.md "Random order
across epochs"), in mountd's trio thread: every read of the machine waits meanwhile. This
script builds the real :class:`mountd.coop.dataset_state.DatasetState` for ``--files`` loose files
(default 1.3M, 110 KB each) in ``--chunks`` chunks (default 10: a 20% cache), opens
``--jobs`` epoch pools (default 2) and gives each a random ``--given`` share of the files
(default a third: mid-epoch), then times ``--rounds`` plannings (each from the same free
chunks). It prints the time per planning beside the time the chunk it plans takes to read at
``--rate`` files/s (default 4,000: a GPU's appetite), their ratio being the share of a chunk's
reading that mountd spends blocked on the draw.

    .venv/bin/python scripts/bench/chunk_draw.py                 # ~30 s
    .venv/bin/python scripts/bench/chunk_draw.py --files 200000  # quick
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

from mountd.coop.claims import EpochPool  # noqa: E402
from mountd.coop.dataset_state import DatasetState  # noqa: E402
from mountd.coop.plans import ChunkPlan  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", type=int, default=1_300_000)
    ap.add_argument("--chunks", type=int, default=10)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--given", type=float, default=1 / 3)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--rate", type=float, default=4000.0)
    args = ap.parse_args()

    t0 = time.perf_counter()
    plan = ChunkPlan(args.files, args.chunks)
    plan.set_sizes([110_000] * args.files)
    dataset = DatasetState("bench", plan)
    rng = random.Random(1)
    pools = []
    for j in range(args.jobs):
        pool = EpochPool(dataset, f"job{j}", 0)
        for i in rng.sample(range(args.files), int(args.files * args.given)):
            pool.given[i] = 1
        pools.append(pool)
    manager = dataset.manager
    assert manager is not None
    print(f"set-up: {time.perf_counter() - t0:.1f} s ({args.files:,} files, {args.chunks} "
          f"chunks, {args.jobs} jobs, {args.given:.0%} given each)")

    times = []
    for r in range(args.rounds):
        manager.planned.clear()  # the same free chunks every round
        t = time.perf_counter()
        chunk = manager.plan_next(pools[r % len(pools)])
        times.append(time.perf_counter() - t)
        assert chunk is not None
    size = plan.size_of(chunk)
    read = size / args.rate
    best, median = min(times), statistics.median(times)
    print(f"{'measure':<44} {'seconds':>9} {'ratio':>7}")
    print(f"{'reading one chunk at ' + f'{args.rate:,.0f} files/s':<44} {read:>9.1f} {1:>7.3f}")
    print(f"{'planning a chunk (' + f'{size:,} files), median':<44} {median:>9.3f} "
          f"{median / read:>7.4f}")
    print(f"{'planning a chunk, best of ' + str(args.rounds):<44} {best:>9.3f} {best / read:>7.4f}")


if __name__ == "__main__":
    main()
