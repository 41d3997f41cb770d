"""PNG plots of the paper-reproduction results (matplotlib, Agg backend; no display needed).

Each function takes the section's result dict (as :mod:`harness.papers_report` reads it) and a
path, writes one PNG and returns the path, or None when the result lacks what it plots.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from harness import papers_deli, papers_fig67, papers_table3  # noqa: E402

DPI = 110


def _save(fig: Any, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def table3(result: dict[str, Any], path: Path) -> Path | None:
    r = papers_table3.rows(result)
    k = result["params"]["batches"]
    modes = [("miss", "cache miss\n(bucket)"), ("coop", "co-op miss\n(cold cache)"),
             ("hit", "cache hit"), ("synthetic", "no I/O\n(bound)")]
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    values = [r[f"{m}_s"] for m, _ in modes]
    bars = ax.bar([label for _, label in modes], values, color=["#b44", "#d92", "#4a4", "#888"])
    for bar, (m, _) in zip(bars, modes, strict=True):
        note = "" if m == "miss" else f"\n{r['miss_s'] / r[f'{m}_s']:.2f}x"
        ax.annotate(f"{bar.get_height():.1f} s{note}", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center", va="bottom", fontsize=8)
    ax.set_ylabel(f"time for {k} mini-batches (s)")
    ax.set_title(f"Quiver Table 3: {result['params']['jobs']} jobs (paper ResNet-50: 3.88x hit, 2.35x co-op)",
                 fontsize=9)
    ax.set_ylim(0, max(values) * 1.25)
    return _save(fig, path)


def fig67_throughput(result: dict[str, Any], path: Path) -> Path | None:
    rows = papers_fig67.rows(result)
    if not rows:
        return None
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    x = list(range(len(rows)))
    w = 0.38
    ax.bar([i - w / 2 for i in x], [r["lru_norm"] for r in rows], w, label="LRU, shuffled sampler",
           color="#b44")
    ax.bar([i + w / 2 for i in x], [r["shim_norm"] for r in rows], w, label="quiverfs + shim",
           color="#4a4")
    for i, r in enumerate(rows):
        ax.annotate(f"{r['lru_norm']:.2f}", (i - w / 2, r["lru_norm"]), ha="center", va="bottom", fontsize=8)
        ax.annotate(f"{r['shim_norm']:.2f}", (i + w / 2, r["shim_norm"]), ha="center", va="bottom", fontsize=8)
    labelled = False
    for i, r in enumerate(rows):  # the paper's points: 13% -> our smallest cache, 90% -> 100%
        near = 0.13 if r["fraction"] < 0.15 else (0.9 if r["fraction"] >= 0.9 else None)
        for kind, dx in (("lru", -w / 2), ("quiver", w / 2)):
            value = papers_fig67.PAPER[kind].get(near) if near else None
            if value:
                ax.plot(i + dx, value, "kD", ms=5, label=None if labelled else "paper (13% / 90% cache)")
                labelled = True
    ax.axhline(1.0, color="#444", lw=0.8, ls="--")
    ax.set_xticks(x, [f"cache {r['fraction']:.0%}" for r in rows])
    ax.set_ylabel("throughput / no cache")
    ax.set_title("Quiver Fig. 6: steady-state throughput ÷ no cache", fontsize=9)
    ax.legend(fontsize=8, loc="upper left")
    ax.set_ylim(0, max(2.5, max(max(r["shim_norm"], r["lru_norm"]) for r in rows)) * 1.2)
    return _save(fig, path)


def chunk_timeline(result: dict[str, Any], path: Path) -> Path | None:
    tl = papers_fig67.timeline(result)
    if tl is None:
        return None
    t0 = tl["t0"]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7.2, 5.0), sharex=True,
                                      gridspec_kw={"height_ratios": [3, 2]})
    for n, iv in enumerate(tl["intervals"]):
        loaded = iv["loaded"] if iv["loaded"] is not None else iv["evicted"]
        top.plot([iv["loading"] - t0, loaded - t0], [n, n], color="#9bd", lw=3, solid_capstyle="butt")
        if iv["loaded"] is not None:
            top.plot([loaded - t0, iv["evicted"] - t0], [n, n], color="#247", lw=3, solid_capstyle="butt")
        top.annotate(str(iv["chunk"]), (iv["loading"] - t0, n), fontsize=5, ha="right", va="center")
    top.set_ylabel("chunk load # (label: chunk)")
    top.set_title(f"Quiver Fig. 7: chunk residency, shim at cache {result['params']['timeline_fraction']:.0%} "
                  f"(light: loading, dark: resident); most resident at once: {tl['max_resident']}",
                  fontsize=8)
    edges = sorted([(iv["loaded"], 1) for iv in tl["intervals"] if iv["loaded"] is not None]
                   + [(iv["evicted"], -1) for iv in tl["intervals"] if iv["loaded"] is not None])
    xs, ys, now = [0.0], [0], 0
    for t, step in edges:
        now += step
        xs.append(t - t0)
        ys.append(now)
    bottom.step(xs, ys, where="post", color="#247", label="chunks resident")
    if tl["chunk_bytes"]:
        s = tl["samples"]
        bottom.plot([x["t"] - t0 for x in s], [x["used_bytes"] / tl["chunk_bytes"] for x in s],
                    color="#d92", lw=0.8, label="store bytes / chunk bytes")
    bottom.axhline(2, color="#b44", lw=0.8, ls="--", label="two chunks")
    bottom.set_xlabel("seconds since the jobs were launched (their set-up included)")
    bottom.set_ylabel("chunks")
    bottom.legend(fontsize=7, loc="upper right")
    return _save(fig, path)


def deli_missrate(result: dict[str, Any], path: Path) -> Path | None:
    rows = sorted((r for r in papers_deli.shim_rows(result) if r["deli_threshold"] == 0.0),
                  key=lambda r: r["cache_multiple"])
    if not rows:
        return None
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    xs = [r["cache_multiple"] for r in rows]
    ax.plot(xs, [r["miss_rate"] or 0.0 for r in rows], "o-", color="#b44", label="miss rate")
    ax.set_xlabel(f"cache size / fetch size (fetch size {result['params']['fetch_size']} files)")
    ax.set_ylabel("miss rate")
    ax.set_ylim(0, 1.05)
    ax2 = ax.twinx()
    ax2.plot(xs, [r["wait_s"] for r in rows], "s--", color="#247", label="data wait (s)")
    ax2.set_ylabel("data wait per run (s)")
    ax2.set_ylim(0, max(1e-3, max(r["wait_s"] for r in rows)) * 1.2)
    ax.set_title("DELI Fig. 7: miss rate and data wait vs. cache size at a fixed fetch size",
                 fontsize=9)
    lines = ax.get_legend_handles_labels()
    lines2 = ax2.get_legend_handles_labels()
    ax.legend(lines[0] + lines2[0], lines[1] + lines2[1], fontsize=8, loc="upper right")
    return _save(fig, path)


def deli_threshold(result: dict[str, Any], path: Path) -> Path | None:
    rows = papers_deli.shim_rows(result)
    multiples = sorted({r["cache_multiple"] for r in rows if r["deli_threshold"] > 0})
    if not multiples:
        return None
    fig, (left, right) = plt.subplots(1, 2, figsize=(7.6, 3.4))
    for m in multiples:
        pts = sorted((r for r in rows if r["cache_multiple"] == m), key=lambda r: r["deli_threshold"])
        ts = [r["deli_threshold"] * 100 for r in pts]
        left.plot(ts, [r["miss_rate"] or 0.0 for r in pts], "o-", label=f"cache {m:g}F")
        right.plot(ts, [r["wait_s"] for r in pts], "o-", label=f"cache {m:g}F")
    left.set_xlabel("pre-fetch threshold (% of cache)")
    left.set_ylabel("miss rate")
    left.set_ylim(0, 1.05)
    right.set_xlabel("pre-fetch threshold (% of cache)")
    right.set_ylabel("data wait per run (s)")
    left.legend(fontsize=8)
    fig.suptitle("DELI Fig. 8: pre-fetch threshold sweep (50% at 2F = the 50/50 setting)", fontsize=9)
    return _save(fig, path)


#: file name → (section, function)
PLOTS = {
    "papers_table3.png": ("table3", table3),
    "papers_fig67_throughput.png": ("fig67", fig67_throughput),
    "papers_chunk_timeline.png": ("fig67", chunk_timeline),
    "papers_deli_missrate.png": ("deli", deli_missrate),
    "papers_deli_threshold.png": ("deli", deli_threshold),
}


def write_all(results: dict[str, Any], outdir: Path) -> list[Path]:
    """Every plot whose section is in ``results``; the paths written."""
    written = []
    for name, (section, fn) in PLOTS.items():
        if section in results:
            out = fn(results[section], outdir / name)
            if out is not None:
                written.append(out)
    return written
