"""The report's Quiver sections (Table 3; Figures 6/7) and their "where we fall short"
paragraphs, computed from the numbers (see :mod:`harness.papers_report`)."""

from __future__ import annotations

import re
from typing import Any

from harness import papers_fig67, papers_table3
from harness.papers_common import served
from harness.papers_md import TOL, compare, md_table, params_line, verdict

# -- section 1: Table 3 ----------------------------------------------------------------------------


def table3(result: dict[str, Any]) -> str:
    p, r, runs = result["params"], papers_table3.rows(result), result["runs"]
    paper = papers_table3.PAPER
    k = p["batches"]
    coop_remote = served(runs["coop"])[1]
    dataset_bytes = result.get("dataset_bytes")
    rows = []
    for mode, label in (("miss", "cache miss (c: bucket, no cache)"), ("hit", "cache hit (b: shim, warm)"),
                        ("coop", "co-op miss (b: shim, cold)"), ("synthetic", "no I/O bound (d)")):
        s = runs[mode]["summary"]
        speed = r["miss_s"] / r[f"{mode}_s"]
        col = {"miss": 0, "hit": 1, "coop": 2}.get(mode)
        papers = [None if col is None else (f"{paper[w][col]}" + ("" if col == 0 else f" ({paper[w][0] / paper[w][col]:.2f}x)"))
                  for w in paper]
        rows.append([label, r[f"{mode}_s"], f"{speed:.2f}x", s["mean_batch_s"], s["mean_wait_s"], *papers])
    out = [f"### 1. Quiver Table 3 (§7.3): {p['jobs']} jobs, time for {k} mini-batches", "",
           f"Parameters: {params_line(p)}.", "",
           md_table(["mode", f"time for {k} mini-batches (s, slowest job)", "speed-up vs miss",
                     "mini-batch s", "data wait s", "paper ResNet50 (7000)", "paper Inception",
                     "paper DeepSpeech"], rows), ""]
    near = r["hit_over_bound"] <= 1 + TOL
    out.append(f"Hit mode ÷ no-I/O bound: **{r['hit_over_bound']:.3f}** (target ≤ {1 + TOL:.2f}: "
               f"{verdict(near)}). Miss ÷ no-I/O bound {r['bound_speedup']:.2f}x (set by "
               f"`io_ratio={p['io_ratio']}`: the bucket serves {p['bucket_files_per_s']} files/s).")
    if dataset_bytes:
        out.append(f"The co-op run fetched {coop_remote / dataset_bytes:.2f}× the dataset's bytes from "
                   f"the bucket; the miss run read {served(runs['miss'])[1] / dataset_bytes:.2f}×.")
    out += ["", "![Table 3](img/papers_table3.png)", "", "**Where we fall short.** " + _table3_short(result, r), ""]
    return "\n".join(out)


def _table3_short(result: dict[str, Any], r: dict[str, float]) -> str:
    p = result["params"]
    hit_p, coop_p = 2505 / 646, 2505 / 1064
    notes = []
    c = compare(r["hit_speedup"], hit_p)
    if c == "matches":
        notes.append(f"The hit speed-up {r['hit_speedup']:.2f}x matches ResNet-50's {hit_p:.2f}x within "
                     f"{TOL:.0%}, but only because `io_ratio` was set to the paper's factor; it measures "
                     f"that hits take the bucket out of the loop, not the paper's bucket.")
    else:
        notes.append(f"The hit speed-up {r['hit_speedup']:.2f}x is {c} ResNet-50's {hit_p:.2f}x "
                     f"(the no-I/O bound here is {r['bound_speedup']:.2f}x: hits can at best reach it).")
    if r["hit_over_bound"] > 1 + TOL:
        notes.append(f"Hit mode is {r['hit_over_bound'] - 1:.0%} slower than the no-I/O bound (target "
                     f"≤ {TOL:.0%}): reading through FUSE costs CPU that {p['jobs']} jobs × "
                     f"{p['workers']} workers share on this machine's cores.")
    c = compare(r["coop_speedup"], coop_p)
    demand = p["batch_size"] / p["compute_s"]
    if c == "above":
        notes.append(f"The co-op speed-up {r['coop_speedup']:.2f}x is above the paper's {coop_p:.2f}x: "
                     f"here the bucket ({p['bucket_files_per_s']} files/s) "
                     + ("exceeds" if p["bucket_files_per_s"] >= demand else "is below")
                     + f" one job's demand ({demand:.0f} files/s) and every file fetched serves all "
                     f"{p['jobs']} jobs, so a cold cache costs little once it starts filling; our jobs "
                     f"read {p['batches'] * p['batch_size'] / max(1, result.get('dataset_files') or 1):.2f} "
                     f"epochs each, while the paper's 7000 mini-batches of 512 are ~2.8 ImageNet epochs "
                     f"in which a 10–20% cache keeps fetching.")
    elif c == "below":
        notes.append(f"The co-op speed-up {r['coop_speedup']:.2f}x is below the paper's {coop_p:.2f}x.")
    else:
        notes.append(f"The co-op speed-up {r['coop_speedup']:.2f}x matches the paper's {coop_p:.2f}x "
                     f"within {TOL:.0%}.")
    notes.append(f"Scale: {p['batches']} mini-batches of {p['batch_size']} files per job instead of "
                 f"7000 of 512 images, and compute is a sleep of {p['compute_s']} s, not ResNet-50 on GPUs.")
    return " ".join(notes)


# -- section 2: Figures 6/7 -------------------------------------------------------------------------


def fig67(result: dict[str, Any]) -> str:
    p, runs = result["params"], result["runs"]
    rows = papers_fig67.rows(result)
    base = papers_fig67.throughput(runs["nocache"])
    dataset_bytes = result.get("dataset_bytes") or 1
    table = [["no cache (c: bucket)", "–", base, 1.0, " ".join(f"{x:.3f}" for x in runs["nocache"]["epoch_means"]),
              _per_epoch(runs["nocache"], dataset_bytes)]]
    for row in rows:
        for kind in ("lru", "shim"):
            run = runs[f"{kind}-{row['fraction']:.0%}"]
            table.append([f"{'LRU, shuffled' if kind == 'lru' else 'quiverfs + shim'}",
                          f"{row['fraction']:.0%}", row[kind], row[f"{kind}_norm"],
                          " ".join(f"{x:.3f}" for x in run["epoch_means"]),
                          _per_epoch(run, dataset_bytes)])
    out = [f"### 2. Quiver Figures 6/7 (§7.5, §7.6): {p['jobs']} jobs, cache 10/20/100%, LRU vs. the shim",
           "", f"Parameters: {params_line(p)}.", "",
           md_table(["run", "cache", "files/s (last epoch, all jobs)", "÷ no cache",
                     "mini-batch s per epoch", "remote ÷ dataset per epoch"], table), "",
           md_table(["cache", "shim ÷ LRU", "paper (Fig. 6)"],
                    [[f"{r['fraction']:.0%}", r["shim_over_lru"], _paper67(r["fraction"])] for r in rows]),
           "", f"Paper: {papers_fig67.PAPER['text']}.", "",
           "![Figure 6](img/papers_fig67_throughput.png)", ""]
    tl = papers_fig67.timeline(result)
    if tl is not None:
        used = max(s["used_bytes"] for s in tl["samples"])
        chunk = tl["chunk_bytes"]
        out += [f"Timeline (shim, cache {p['timeline_fraction']:.0%}): {tl['loads']} chunk loads, at most "
                f"**{tl['max_resident']}** chunks resident at once by mountd's log (target ≤ 2: "
                f"{verdict(tl['max_resident'] <= 2)}); chunk {chunk or 0:,} bytes; the store held at most "
                f"{used:,} bytes"
                + (f" = {used / chunk:.2f} chunks" if chunk else "")
                + f" (cache {tl['cache_bytes']:,} bytes).", "",
                "![Figure 7](img/papers_chunk_timeline.png)", ""]
    out += ["**Where we fall short.** " + _fig67_short(result, rows, tl), ""]
    return "\n".join(out)


def _excess(f: str, run: dict[str, Any], p: dict[str, Any], dataset_bytes: int, remote: float) -> str:
    """Where a shim run's fetches beyond one dataset per epoch went: misses and chunk reloads."""
    epochs = run["load"]["epochs"]
    log = run.get("log", [])
    misses = (run.get("remote") or {}).get("misses", 0)
    chunks = {int(m.group(1)) for line in log if (m := re.search(r"loading chunk (\d+)", line))}
    loads = sum(1 for line in log if "loading chunk" in line)
    sizes = [(int(m.group(1)), int(m.group(2))) for line in log
             if (m := re.search(r"evicted chunk \d+ \((\d+) files, (\d+) bytes", line))]
    chunk_files, chunk_bytes = max(sizes, default=(0, 0))
    extra = max(0, loads - len(chunks) * epochs)
    window = (p.get("workers", 2) * p.get("prefetch_factor", 2) * p["batch_size"]
              + (p.get("fetch_size") or 4 * p["batch_size"]))
    excess = (remote - 1) * dataset_bytes * epochs
    file_bytes = dataset_bytes / max(1, run["summary"]["files"] / run["load"]["jobs"] / epochs)
    miss_mb, reload_mb = misses * file_bytes / 1e6, extra * chunk_bytes / 1e6
    rest = excess / 1e6 - miss_mb - reload_mb
    out = (f"At {f} the shim's {p['jobs']} jobs fetched {remote:.2f} datasets per epoch where "
           f"co-operating jobs ideally fetch about one: every byte beyond one dataset per epoch is a file "
           f"fetched again after its eviction. Of that excess ({excess / 1e6:.0f} MB), {misses:,} reads "
           f"that missed the store account for ~{miss_mb:.0f} MB; {loads} chunk loads of {len(chunks)} "
           f"chunks in {epochs} epoch(s), {extra} beyond one load per chunk and epoch, for up to "
           f"{reload_mb:.0f} MB"
           + (f"; the other ~{rest:.0f} MB: files fetched a second time by claims or chunk preloads."
              if rest > 0.05 * excess / 1e6 else "."))
    if chunk_files:
        out += (f" A chunk was {chunk_files} files against a look-ahead window of {window} files per job "
                f"(DataLoader prefetch + one fetch): claimed files of a chunk can be evicted before they are "
                f"read (Finding 1 above), and jobs drifting apart by more than a chunk make chunks load "
                f"again (Finding 2). Quiver's 15 GB chunks hold ~136,000 ImageNet files.")
    return out


def _per_epoch(run: dict[str, Any], dataset_bytes: int) -> float:
    """Bytes the bucket served per epoch of the run ÷ the dataset's bytes."""
    return served(run)[1] / dataset_bytes / run["load"]["epochs"]


def _paper67(fraction: float) -> str:
    if fraction >= 0.9:
        return "Quiver 2.32x, LRU 2.2x of no cache (at 90%): 1.05"
    if fraction <= 0.15:
        return "Quiver 1.6x of no cache at 13%; LRU 'quite poorly'"
    return "between 1.6x and 2.32x of no cache; LRU 'quite poorly'"


def _fig67_short(result: dict[str, Any], rows: list[dict[str, Any]], tl: dict[str, Any] | None) -> str:
    p, runs = result["params"], result["runs"]
    dataset_bytes = result.get("dataset_bytes") or 1
    notes = []
    for r in rows:
        f = f"{r['fraction']:.0%}"
        if r["fraction"] < 1.0:
            if r["shim_over_lru"] < 1 + TOL:
                notes.append(f"At {f} the shim is not clearly faster than LRU ({r['shim_over_lru']:.2f}x).")
            run = runs[f"shim-{f}"]
            remote = _per_epoch(run, dataset_bytes)
            if remote > 1 + TOL:
                notes.append(_excess(f, run, p, dataset_bytes, remote))
        elif r["shim_over_lru"] < 1 - TOL:
            notes.append(f"At 100% the shim is slower than LRU ({r['shim_over_lru']:.2f}x).")
    low = rows[0] if rows else None
    if low is not None and low["fraction"] < 0.15:
        notes.append(f"At {low['fraction']:.0%} the shim reaches {low['shim_norm']:.2f}x of no cache: "
                     f"{compare(low['shim_norm'], 1.6)} the paper's 1.6x at 13%"
                     + (" (within 10%)." if compare(low["shim_norm"], 1.6) == "matches" else "."))
    full = next((r for r in rows if r["fraction"] >= 1.0), None)
    if full is not None:
        ceiling = runs["nocache"]["epoch_means"][-1] / p["compute_s"]
        notes.append(f"At 100% the shim reaches {full['shim_norm']:.2f}x and LRU {full['lru_norm']:.2f}x of "
                     f"no cache (paper at 90%: 2.32x and 2.2x); the ceiling here is no cache's mini-batch "
                     f"time ÷ compute = {ceiling:.2f}x, set by the bucket we chose, so these cannot be "
                     f"compared with the paper's beyond being near the ceiling "
                     f"({full['shim_norm'] / ceiling:.0%} and {full['lru_norm'] / ceiling:.0%} of it).")
    notes.append(f"The ratios to no cache are set by the bucket we chose ({p['bucket_factor']}× one job's "
                 f"demand, shared by {p['jobs']} jobs), not by Azure blobs, and the paper's Figure 6 mixes "
                 f"three models on 48 GPUs; only the shape (shim ≫ LRU at small caches, ≈ at 100%) is comparable.")
    if tl is not None:
        if tl["max_resident"] > 2:
            notes.append(f"mountd had {tl['max_resident']} chunks resident at once (more than two).")
        if tl["chunk_bytes"]:
            over = max(s["used_bytes"] for s in tl["samples"]) / tl["chunk_bytes"]
            if over > 2 + TOL:
                notes.append(f"The store held up to {over:.2f} chunks' worth of bytes: besides the two "
                             f"chunks it keeps the files fetched on demand (misses, claims outside a loaded "
                             f"chunk) until the cache's LRU trims them.")
    return " ".join(notes)
