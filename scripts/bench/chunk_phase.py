#!/usr/bin/env python3
"""How jobs that share chunks out of phase couple each job's order across epochs (issue 35).

Two jobs (``--jobs``) read a chunked dataset side by side at the same pace through mountd's
real claim registry on the simulated cache of the chunk-order tests
(quiverfs/testing/chunk_sim.py: a 20% cache, ``--files`` files), the second started
``phase`` of an epoch after the first. For each phase it prints the phase measured from
the jobs' epoch starts, each job's mean epoch-to-epoch correlation of file positions (a
fresh shuffle: 0 ± 0.04 at 1,200 files), the chi-square p of positions, the p99 share of
epochs a file spends in the first tenth, and the datasets fetched per epoch, each the mean
over ``--seeds`` seeds. Beside them, ``3φ(1-φ)``: the correlation of a job whose first
``φ`` of every epoch is one fixed set of files (what perfect sharing with a constant phase
offset forces; docs/substitutable-reads.md "Jobs out of phase").

    .venv/bin/python scripts/bench/chunk_phase.py      # ~6 s
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from statistics import fmean

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from harness.report import parameters, table  # noqa: E402

from quiverfs.testing import order_stats  # noqa: E402
from quiverfs.testing.chunk_sim import run_epochs  # noqa: E402


def _floats(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of numbers: {text!r}") from None
    if not values or any(not 0 <= v < 1 for v in values):
        raise argparse.ArgumentTypeError("phases are fractions of an epoch in [0, 1)")
    return values


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", type=int, default=1200)
    ap.add_argument("--jobs", type=int, default=2,
                    help="jobs; job k starts k x phase epochs after job 0")
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--batch", type=int, default=10, help="files a job claims per step")
    ap.add_argument("--rate", type=int, default=12, help="preloaded files landing per step")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--phases", type=_floats, default=_floats("0,0.1,0.2,0.3,0.5"),
                    help="comma-separated phase offsets, fractions of an epoch")
    args = ap.parse_args()
    if args.files < 100 or args.jobs < 2 or args.epochs < 3 or args.seeds < 1:
        ap.error("need --files >= 100, --jobs >= 2, --epochs >= 3, --seeds >= 1")

    print(parameters({"files": args.files, "jobs": args.jobs, "epochs": args.epochs,
                      "batch": args.batch, "rate": args.rate, "seeds": args.seeds,
                      "cache": "20% of the dataset"}))
    t0 = time.perf_counter()
    rows = []
    for phi in args.phases:
        measured, rs, ps, early, fetched = [], [], [], [], []
        for seed in range(1, args.seeds + 1):
            run = run_epochs(n=args.files, jobs=args.jobs, world=1, epochs=args.epochs,
                             batch=args.batch, rate=args.rate, seed=seed,
                             offsets=[k * phi for k in range(args.jobs)])
            names = list(run.order)
            measured.append(order_stats.phase_offset(run.starts[names[0]],
                                                     run.starts[names[1]]))
            for name in names:
                positions = [{i: p for p, i in enumerate(seq)} for seq in run.order[name]]
                rs.append(order_stats.mean_lag_correlation(positions))
                ps.append(order_stats.position_chi2_p(positions, args.files))
                early.append(order_stats.early_share_quantile(positions, args.files))
            fetched.append(run.fetched / args.files / args.epochs)
        rows.append([phi, fmean(measured), fmean(rs), max(rs), min(ps), fmean(early),
                     3 * phi * (1 - phi), fmean(fetched)])
        print(f"[chunk_phase] phase {phi:.2f}: r {fmean(rs):+.3f}, "
              f"{fmean(fetched):.2f} datasets/epoch ({time.perf_counter() - t0:.0f} s)",
              file=sys.stderr)
    print()
    print(table(["phase", "measured", "mean r", "max r", "min p", "first tenth p99",
                 "3φ(1-φ)", "datasets/epoch"], rows))
    print("(a fresh shuffle: r 0 ± 1/sqrt(files), p > 0.001, first tenth ~0.2-0.4; "
          "r is each job's mean over its epoch pairs, then over jobs and seeds)")


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        raise SystemExit(130) from None
