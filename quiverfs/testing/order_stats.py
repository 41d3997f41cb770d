"""Is a sampler's order a fresh shuffle every epoch? Statistics over recorded orders.

A job's epoch is recorded as its ranks' mini-batches (dataset indices); :func:`epoch_positions`
turns that into each file's position in the epoch (0 .. N-1: step by step, rank by rank, as
the ranks' steps run side by side under DDP). The tests of this order (a fair shuffle passes
them, a sampler that keeps files in place fails them):

* :func:`position_chi2_p` — pooled chi-square over files × position bins: is each file's
  position uniform over the epochs?
* :func:`mean_lag_correlation` — Pearson's r of the positions of epoch ``e`` and ``e + 1``
  (0 ± 1/sqrt(N) for independent shuffles), averaged over the epochs;
* :func:`early_share_quantile` — the share of epochs in which a file falls in the first
  tenth, at a high quantile over the files (~0.1 plus binomial spread for a shuffle).

:func:`phase_offset` says how far apart two jobs' epochs run: jobs sharing chunks out of
phase couple each job's order across epochs (docs/substitutable-reads.md "Jobs out of phase").

Used by the end-to-end test of the shim (tests/mount/test_shim_order.py), the chunk-order
simulation (tests/unit/test_chunk_order.py) and scripts/bench/shim_vs_lru.py. Pure Python:
scipy may be absent.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from mountd.coop.jobs import fold_phase

__all__ = [
    "chi2_sf",
    "cross_correlation",
    "early_share_quantile",
    "epoch_positions",
    "exactly_once",
    "lag_correlations",
    "mean_lag_correlation",
    "pearson",
    "phase_offset",
    "position_chi2_p",
    "spearman",
]


def epoch_positions(ranks: Sequence[Sequence[Sequence[int]]]) -> dict[int, int]:
    """File -> position in one epoch of one job, from each rank's mini-batches (``ranks[r]``
    is rank ``r``'s list of batches). Step ``k`` of every rank comes before step ``k + 1``;
    within a step, rank 0's batch first. A file read twice (DDP padding) keeps its first
    position."""
    positions: dict[int, int] = {}
    steps = max((len(batches) for batches in ranks), default=0)
    for step in range(steps):
        for batches in ranks:
            if step < len(batches):
                for i in batches[step]:
                    positions.setdefault(int(i), len(positions))
    return positions


def exactly_once(ranks: Sequence[Sequence[Sequence[int]]], n: int) -> tuple[int, int]:
    """``(missing, repeated)``: files of ``0..n-1`` no rank read in the epoch, and reads
    beyond the first of a file (0, 0 when every file was read exactly once)."""
    reads = [0] * n
    for batches in ranks:
        for batch in batches:
            for i in batch:
                reads[int(i)] += 1
    return sum(1 for r in reads if r == 0), sum(r - 1 for r in reads if r > 1)


def chi2_sf(x: float, df: int) -> float:
    """P(X >= x) for X ~ chi-square(df): Wilson–Hilferty's normal approximation (good to a
    few per cent of p for the hundreds of degrees of freedom and more used here)."""
    if df <= 0:
        return 1.0
    z = ((max(x, 0.0) / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
    return 0.5 * math.erfc(z / math.sqrt(2))


def position_chi2_p(epochs: Iterable[dict[int, int]], n: int, bins: int = 5) -> float:
    """p of "each file's position is uniform over the epochs": per file, its positions
    counted in ``bins`` equal bins, chi-square against equal counts, pooled over the files
    (df = files × (bins − 1)). ``bins`` small enough that a bin expects a couple of counts:
    5 bins over 10 epochs expects 2."""
    counts: dict[int, list[int]] = {}
    for positions in epochs:
        for i, p in positions.items():
            counts.setdefault(i, [0] * bins)[p * bins // n] += 1
    chi2 = 0.0
    df = 0
    for row in counts.values():
        total = sum(row)
        if total < 2:
            continue
        expected = total / bins
        chi2 += sum((c - expected) ** 2 / expected for c in row)
        df += bins - 1
    return chi2_sf(chi2, df)


def pearson(a: Sequence[float], b: Sequence[float]) -> float:
    """Pearson's correlation of two equal-length series (0 when either is constant)."""
    n = len(a)
    if n != len(b) or n < 2:
        raise ValueError("pearson needs two series of the same length, at least 2")
    ma, mb = sum(a) / n, sum(b) / n
    cov = sum((x - ma) * (y - mb) for x, y in zip(a, b, strict=True))
    va = sum((x - ma) ** 2 for x in a)
    vb = sum((y - mb) ** 2 for y in b)
    return cov / math.sqrt(va * vb) if va > 0 and vb > 0 else 0.0


def _paired(first: dict[int, int], second: dict[int, int]) -> tuple[list[int], list[int]]:
    common = sorted(first.keys() & second.keys())
    return [first[i] for i in common], [second[i] for i in common]


def lag_correlations(epochs: Sequence[dict[int, int]]) -> list[float]:
    """Pearson's r of the files' positions in each epoch and the next."""
    return [pearson(*_paired(epochs[e], epochs[e + 1])) for e in range(len(epochs) - 1)]


def mean_lag_correlation(epochs: Sequence[dict[int, int]]) -> float:
    """The mean of :func:`lag_correlations` (0 for a fresh shuffle every epoch)."""
    rs = lag_correlations(epochs)
    return sum(rs) / len(rs) if rs else 0.0


def cross_correlation(a: Sequence[dict[int, int]], b: Sequence[dict[int, int]]) -> float:
    """Mean Pearson's r of two jobs' positions in the same epochs."""
    rs = [pearson(*_paired(x, y)) for x, y in zip(a, b, strict=False)]
    return sum(rs) / len(rs) if rs else 0.0


def early_share_quantile(epochs: Sequence[dict[int, int]], n: int, q: float = 0.99,
                         front: float = 0.1) -> float:
    """The ``q`` quantile over files of the share of epochs in which the file's position is
    in the first ``front`` of the epoch."""
    early: dict[int, int] = {}
    for positions in epochs:
        for i, p in positions.items():
            early[i] = early.get(i, 0) + (p < front * n)
    if not early or not epochs:
        return 0.0
    shares = sorted(c / len(epochs) for c in early.values())
    return shares[min(len(shares) - 1, int(q * len(shares)))]


def phase_offset(ref: Sequence[float], other: Sequence[float], skip: int = 1) -> float:
    """The mean fraction of an epoch by which job ``other``'s epochs start after job
    ``ref``'s, folded into [-0.5, 0.5) (negative: ``other`` runs ahead). ``ref`` and
    ``other`` are the times (or steps) at which each epoch started; ``ref``'s epoch ``e``
    lasts until ``ref[e + 1]`` (append its last epoch's end to count that one). The first
    ``skip`` epochs are left out: jobs started together part during the cold first one.
    NaN when no epoch is left to compare."""
    offsets = []
    for e in range(skip, min(len(ref) - 1, len(other))):
        length = ref[e + 1] - ref[e]
        if length > 0:
            offsets.append(fold_phase((other[e] - ref[e]) / length))
    return sum(offsets) / len(offsets) if offsets else math.nan


def spearman(order: Sequence[int]) -> float:
    """Spearman's rank correlation between a position in ``order`` (a permutation of
    ``0..n-1``, e.g. the ids in the order claims gave them) and the id there: about 0 for a
    shuffle, 1 for the digest's order."""
    n = len(order)
    d2 = sum((pos - file_id) ** 2 for pos, file_id in enumerate(order))
    return 1 - 6 * d2 / (n * (n * n - 1))
