"""The paper-reproduction report (scripts/bench/harness/papers_*.py, plots.py) on fake results:
markdown content, verdicts computed from the numbers, the marked section of benchmarks.md, the
chunk timeline parser and the PNGs. No FUSE, no jobs."""

from __future__ import annotations

import sys
from dataclasses import asdict
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts" / "bench"))

pytest.importorskip("matplotlib")

from harness import papers_deli, papers_fig67, papers_report, papers_table3, plots  # noqa: E402
from harness.papers_deli import DeliParams  # noqa: E402

FILES, SIZE = 1000, 100_000
T = 1_700_000_000.0


def run(reader: str, *, jobs: int = 1, wall: float = 10.0, batch: float = 0.2, wait: float = 0.0,
        epochs: int = 1, files: int = FILES, remote: tuple[int, int] | None = None,
        hits: int = 0, misses: int = 0, batch_size: int = 16, **extra) -> dict:
    batches = 50
    rec = {
        "name": reader, "reader": reader,
        "load": {"jobs": jobs, "batch_size": batch_size, "epochs": epochs},
        "config": {"cache_size": FILES * SIZE // 5},
        "summary": {"wall_s": wall, "mean_batch_s": batch, "mean_wait_s": wait,
                    "files": files * jobs * epochs, "bytes": files * jobs * epochs * SIZE,
                    "bucket_gets": files * jobs * epochs if reader == "bucket" else 0},
        "epoch_means": [batch] * epochs,
        "wait_totals": [wait * batches] * jobs,
        "remote": None if remote is None else {"gets": remote[0], "bytes": remote[1], "hits": hits,
                                               "misses": misses, "prefetches": 0},
        "samples": [], "log": [],
    }
    rec.update(extra)
    return rec


def log_line(t: float, text: str) -> str:
    from datetime import datetime

    stamp = datetime.fromtimestamp(t).strftime("%Y-%m-%d %H:%M:%S,%f")[:-3]
    return f"{stamp} mountd[1] INFO mountd.coop.service: dataset abc: {text}"


def fake_results(hit_wall: float = 3.0) -> dict:
    table3 = {
        "params": {"jobs": 7, "batches": 50, "batch_size": 16, "compute_s": 0.2, "workers": 2,
                   "io_ratio": 3.88, "cache_factor": 1.5, "bucket_files_per_s": 144.3},
        "runs": {"miss": run("bucket", jobs=7, wall=11.6, batch=0.8, wait=0.6),
                 "hit": run("mount-shim", jobs=7, wall=hit_wall, remote=(0, 0), hits=5600),
                 "coop": run("mount-shim", jobs=7, wall=5.0, remote=(FILES, FILES * SIZE)),
                 "synthetic": run("synthetic", jobs=7, wall=2.9)},
        "dataset_files": FILES, "dataset_bytes": FILES * SIZE,
    }
    lines = [log_line(T + 1, "loading chunk 0 (60 files to fetch)"), log_line(T + 2, "chunk 0 loaded"),
             log_line(T + 2, "loading chunk 1 (60 files to fetch)"), log_line(T + 3, "chunk 1 loaded"),
             log_line(T + 3.5, "evicted chunk 0 (60 files, 6000000 bytes)"),
             log_line(T + 3.5, "loading chunk 2 (60 files to fetch)"), log_line(T + 4.5, "chunk 2 loaded"),
             log_line(T + 5, "evicted chunk 1 (60 files, 6000000 bytes)")]
    samples = [{"t": T + i * 0.5, "used_bytes": min(i, 4) * 3_000_000, "entries": i, "remote_bytes": 0}
               for i in range(14)]
    fig67 = {
        "params": {"jobs": 4, "epochs": 2, "batch_size": 16, "compute_s": 0.1, "fractions": [0.1, 0.2, 1.0],
                   "bucket_factor": 1.88, "timeline_fraction": 0.2},
        "runs": {"nocache": run("bucket", jobs=4, epochs=2, batch=0.2)},
        "dataset_files": FILES, "dataset_bytes": FILES * SIZE,
    }
    for pct, lru, shim in (("10%", 0.36, 0.13), ("20%", 0.35, 0.12), ("100%", 0.11, 0.1)):
        fig67["runs"][f"lru-{pct}"] = run("mount-shuffle", jobs=4, epochs=2, batch=lru,
                                          remote=(3 * FILES, 3 * FILES * SIZE))
        extra = {"samples": samples, "log": lines} if pct == "20%" else {}
        fig67["runs"][f"shim-{pct}"] = run("mount-shim", jobs=4, epochs=2, batch=shim,
                                           remote=(2 * FILES, 2 * FILES * SIZE), **extra)
    p = DeliParams()
    deli = {"params": {**asdict(p), "window_files": p.window(), "bucket_files_per_s": 240.0},
            "runs": {"bucket": run("bucket", wait=0.01),
                     "bucket-latency": run("bucket", wait=0.2),
                     "cache-only": run("mount-shuffle", wait=0.02, remote=(800, 800 * SIZE), misses=800)},
            "dataset_files": FILES, "dataset_bytes": FILES * SIZE}
    for multiple, deli_t, rate in ((0.5, 0.0, 0.8), (1.0, 0.0, 0.1), (2.0, 0.0, 0.05), (3.0, 0.0, 0.05),
                                   (2.0, 0.5, 0.02), (2.0, 0.75, 0.02), (3.0, 0.75, 0.02)):
        t, exact = papers_deli.shim_threshold(p, multiple, deli_t)
        misses = int(800 * rate)
        r = run("mount-shim", wait=0.01 + rate * 0.1, remote=(800, 800 * SIZE), hits=800 - misses,
                misses=misses, files=800)
        r["deli"] = {"cache_multiple": multiple, "deli_threshold": deli_t, "shim_threshold": t,
                     "expressible": exact}
        deli["runs"][f"c{multiple:g}F-t{deli_t:.0%}"] = r
    return {"table3": table3, "fig67": fig67, "deli": deli}


META = {"command": ".venv/bin/python scripts/bench/papers.py --quick", "date": "2026-01-01 00:00",
        "wall_s": 180.0, "machine": "2 CPUs", "load_start": "1.00 1.00 1.00", "load_end": "2.00 2.00 2.00",
        "dataset": "1,000 files", "section_s": {"table3": 60.0, "fig67": 60.0, "deli": 60.0}}


def test_render_has_every_section_the_command_and_the_papers_numbers() -> None:
    md = papers_report.render(fake_results(), META)
    assert md.startswith(papers_report.BEGIN) and md.rstrip().endswith(papers_report.END)
    for heading in ("### 1. Quiver Table 3", "### 2. Quiver Figures 6/7", "### 3. DELI",
                    "### 4. Remote requests and bytes"):
        assert heading in md
    assert md.count("**Where we fall short.**") == 4
    assert ".venv/bin/python scripts/bench/papers.py --quick" in md
    assert "1.00 1.00 1.00" in md and "2.00 2.00 2.00" in md
    assert "646 (3.88x)" in md and "1064 (2.35x)" in md  # the paper beside ours
    assert "85.6% – 93.5%" in md
    assert "img/papers_chunk_timeline.png" in md and "img/papers_deli_threshold.png" in md


def test_verdicts_follow_the_numbers() -> None:
    good = papers_report.render(fake_results(hit_wall=3.0), META)  # 3.0 / 2.9 = 1.034
    assert "(target ≤ 1.10: PASS)" in good
    assert "slower than the no-I/O bound" not in good
    bad = papers_report.render(fake_results(hit_wall=4.0), META)  # 4.0 / 2.9 = 1.38
    assert "(target ≤ 1.10: FAIL)" in bad
    assert "38% slower than the no-I/O bound" in bad
    r = papers_table3.rows(fake_results()["table3"])
    assert r["hit_speedup"] == pytest.approx(11.6 / 3.0)
    # the shim fetched 2 datasets over 2 epochs: 1.0 per epoch, the ideal, so no complaint
    assert "shim's 4 jobs fetched" not in good
    assert "(target ≤ 2: PASS)" in good


def test_fig67_rows_and_timeline() -> None:
    res = fake_results()["fig67"]
    rows = papers_fig67.rows(res)
    assert [r["fraction"] for r in rows] == [0.1, 0.2, 1.0]
    assert rows[0]["shim_over_lru"] == pytest.approx(0.36 / 0.13)
    tl = papers_fig67.timeline(res)
    assert tl["max_resident"] == 2
    assert tl["chunk_bytes"] == 6_000_000
    assert [iv["chunk"] for iv in tl["intervals"]] == [0, 1, 2]
    assert tl["intervals"][0]["loaded"] - tl["intervals"][0]["loading"] == pytest.approx(1.0)


def test_max_resident_counts_overlaps() -> None:
    ivs = [{"loaded": 0.0, "evicted": 3.0}, {"loaded": 1.0, "evicted": 4.0}, {"loaded": 2.0, "evicted": 5.0}]
    assert papers_fig67.max_resident(ivs) == 3
    touching = [{"loaded": 0.0, "evicted": 1.0}, {"loaded": 1.0, "evicted": 2.0}]
    assert papers_fig67.max_resident(touching) == 1


def test_deli_threshold_mapping_and_reduction() -> None:
    p = DeliParams()  # F = 128, window = 2 workers x 2 x 16 = 64
    assert papers_deli.shim_threshold(p, 2.0, 0.5) == (0.5, True)  # the 50/50 setting
    assert papers_deli.shim_threshold(p, 2.0, 0.75) == (1.0, True)
    assert papers_deli.shim_threshold(p, 3.0, 0.75) == (1.0, False)
    assert papers_deli.shim_threshold(p, 1.0, 0.25) == (0.0, True)
    rates = {r["name"]: r["miss_rate"] for r in papers_deli.shim_rows(fake_results()["deli"])}
    assert rates["c0.5F-t0%"] == pytest.approx(0.8) and rates["c2F-t50%"] == pytest.approx(0.02)
    red = papers_deli.reduction(fake_results()["deli"])
    assert red["bucket-latency"] == pytest.approx(1 - 0.012 / 0.2)
    md = papers_report.render(fake_results(), META)
    assert "75% at 3F" in md and "(clamped)" in md


def test_deli_miss_rate_counts_from_the_first_fetch_and_the_sweep_verdict() -> None:
    # 80 misses in all, 75 of them while the first fetch (F = 128) was in flight: the cold
    # start's race; 5 afterwards over the 672 files read after the first F.
    run = {"before": {"gets": 10, "misses": 3}, "summary": {"files": 800},
           "remote": {"misses": 80},
           "samples": [{"t": 0.0, "gets": 10, "misses": 3}, {"t": 0.05, "gets": 100, "misses": 60},
                       {"t": 0.10, "gets": 138, "misses": 78}, {"t": 0.15, "gets": 200, "misses": 80}]}
    assert papers_deli.steady_miss_rate(run, 128) == pytest.approx(5 / 672)
    assert papers_deli.steady_miss_rate({**run, "samples": []}, 128) is None
    assert papers_deli.steady_miss_rate({**run, "samples": run["samples"][:2]}, 128) is None

    def row(multiple: float, t: float, rate: float) -> dict:
        return {"cache_multiple": multiple, "shim_threshold": t, "miss_rate": rate}

    # F = 128, W = 64: at 2F, t = 1 holds 320 fetched-unread > 256, left out of the verdict
    shim = [row(2.0, 0.0, 0.013), row(2.0, 0.5, 0.004), row(2.0, 1.0, 0.2),
            row(3.0, 0.0, 0.015), row(3.0, 0.25, 0.018), row(3.0, 1.0, 0.003)]
    assert papers_deli.monotone(shim, 64, 128) == {2.0: True, 3.0: True}  # 0.018: within 0.005
    shim[4] = row(3.0, 0.25, 0.05)
    assert papers_deli.monotone(shim, 64, 128) == {2.0: True, 3.0: False}
    assert papers_deli.monotone([row(2.0, 0.0, 0.1)], 64, 128) == {}
    md = papers_report.render(fake_results(), META)  # no samples: the rates over all reads
    assert "miss rate non-increasing in the threshold" in md and "2F yes" in md


def test_insert_section_touches_nothing_outside_the_markers() -> None:
    doc = "# Benchmarks\n\nintro\n\n## Notes on the machine\n\nnotes\n"
    section = papers_report.BEGIN + "\nfirst\n" + papers_report.END + "\n"
    once = papers_report.insert_section(doc, section)
    assert once.index("first") < once.index("## Notes on the machine")
    assert once.startswith("# Benchmarks\n\nintro\n\n") and once.endswith("## Notes on the machine\n\nnotes\n")
    again = papers_report.insert_section(once, section.replace("first", "second"))
    assert "first" not in again and "second" in again
    assert again.replace("second", "first") == once
    assert papers_report.insert_section(again, section.replace("first", "second")) == again
    assert papers_report.insert_section("no anchor\n", section).endswith(papers_report.END + "\n")


def test_plots_write_pngs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(plots, "DPI", 40)  # fast; the content is the same
    written = plots.write_all(fake_results(), tmp_path)
    assert {p.name for p in written} == set(plots.PLOTS)
    for path in written:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 2000
