#!/usr/bin/env python3
"""Reproduce the shape of the Quiver (FAST'20) and DELI (IC2E'21) results on quiverfs.

One command runs a scaled-down suite (<= 15 minutes on 2 cores) and writes its section of
docs/benchmarks.md (between ``<!-- papers:begin -->`` and ``<!-- papers:end -->``) and PNG plots
into docs/img/:

1. Quiver Table 3: 7 jobs, time for K mini-batches in cache-miss, hit and co-op-miss modes;
2. Quiver Figures 6/7: throughput at 10/20/100% cache, LRU vs. the shim; chunk timeline;
3. DELI §V: miss rate and data wait vs. cache size, the pre-fetch threshold sweep, 50/50;
4. remote requests and bytes per epoch per mode, priced with mountd's cost model.

    .venv/bin/python scripts/bench/papers.py                  # the suite (~13 min)
    .venv/bin/python scripts/bench/papers.py --quick          # a smoke version (~3 min)
    .venv/bin/python scripts/bench/papers.py --sections deli --set deli.fetch_size=64
    .venv/bin/python scripts/bench/papers.py --report-only    # re-render the last results

Needs root, FUSE, torch and matplotlib (``bash scripts/setup.sh --torch``). Results are kept in
``.bench/papers/results.json`` (``results-quick.json`` for ``--quick``); job logs under
``.bench/papers/<run>/``.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import os
import platform
import shlex
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

REPO = Path(__file__).resolve().parents[2]
SECTIONS = ("table3", "fig67", "deli")


def check_dependencies() -> None:
    """One line and exit 1 when torch or matplotlib is missing."""
    for module in ("torch", "matplotlib"):
        try:
            __import__(module)
        except ImportError:
            raise SystemExit(f"papers.py: {module} is not installed in this Python; run "
                             f"`bash scripts/setup.sh --torch` (it installs the torch and bench extras)") from None


def section_params(quick: bool) -> dict[str, object]:
    from harness.papers_deli import DeliParams
    from harness.papers_fig67 import Fig67Params
    from harness.papers_table3 import Table3Params

    if not quick:
        return {"table3": Table3Params(), "fig67": Fig67Params(), "deli": DeliParams()}
    return {
        "table3": Table3Params(jobs=3, batches=15),
        "fig67": Fig67Params(jobs=2, epochs=1, fractions=(0.2, 1.0), bucket_factor=1.0),
        "deli": DeliParams(batches=20, cache_multiples=(0.5, 2.0), sweep=((2.0, 0.5),)),
    }


def apply_overrides(params: dict[str, object], sets: list[str]) -> dict[str, object]:
    """``--set section.field=value`` (value a Python literal: 5, 0.2, (0.1, 0.2), None)."""
    for item in sets:
        key, _, raw = item.partition("=")
        section, _, field = key.partition(".")
        if section not in params or not _ or field not in {f.name for f in dataclasses.fields(params[section])}:
            raise SystemExit(f"papers.py: --set {item!r}: no such parameter (sections: {', '.join(params)})")
        try:
            value = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            value = raw
        params[section] = dataclasses.replace(params[section], **{field: value})
    return params


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a ~3-minute smoke version")
    parser.add_argument("--sections", default=",".join(SECTIONS),
                        help=f"comma-separated subset of {','.join(SECTIONS)} (the cost table comes with any)")
    parser.add_argument("--files", type=int, default=None, help="files in the dataset (default 1500; quick 600)")
    parser.add_argument("--file-size", type=int, default=110 * 1000, help="bytes per file (ImageNet's mean)")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                        help="override one section parameter, e.g. table3.jobs=5 (repeatable)")
    parser.add_argument("--report-only", action="store_true",
                        help="re-render docs and plots from .bench/papers/results.json "
                             "(with --quick: results-quick.json)")
    parser.add_argument("--no-docs", action="store_true",
                        help="write the report to .bench/papers/report.md and the plots to .bench/papers/img/")
    args = parser.parse_args()
    check_dependencies()

    from harness import papers_report, plots
    from harness.papers_common import WORK

    saved = WORK / ("results-quick.json" if args.quick else "results.json")
    if args.report_only:
        data = json.loads(saved.read_text())
        write(data["results"], data["meta"], args.no_docs, papers_report, plots)
        return

    from harness.cli import preflight
    from harness.world import DatasetSpec, make_dataset

    sections = [s for s in args.sections.split(",") if s]
    if unknown := set(sections) - set(SECTIONS):
        raise SystemExit(f"papers.py: unknown section(s) {', '.join(sorted(unknown))}; known: {', '.join(SECTIONS)}")
    params = apply_overrides(section_params(args.quick), args.set)
    preflight()

    started, load_start = time.perf_counter(), os.getloadavg()
    spec = DatasetSpec(files=args.files or (600 if args.quick else 1500), file_size=args.file_size)
    print(f"[papers] dataset {spec.name} (built once under .bench/datasets/)", flush=True)
    dataset = make_dataset(spec)
    modules = _modules()
    results: dict[str, dict] = {}
    section_s: dict[str, float] = {}
    meta = {
        "command": ".venv/bin/python " + " ".join(shlex.quote(a) for a in sys.argv),
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M"),
        "machine": f"{os.cpu_count()} CPUs, {platform.system()} {platform.release()}, Python {platform.python_version()}",
        "load_start": " ".join(f"{x:.2f}" for x in load_start),
        "dataset": f"{spec.files:,} files × {spec.file_size:,} bytes = {dataset.total_bytes / 1e6:.1f} MB, "
                   f"{spec.classes} class directories, `file://` bucket",
        "params": {s: dataclasses.asdict(params[s]) for s in sections},
    }
    for section in sections:
        t0 = time.perf_counter()
        result = modules[section].run(dataset, params[section])
        result["dataset_files"], result["dataset_bytes"] = spec.files, dataset.total_bytes
        results[section] = result
        section_s[section] = time.perf_counter() - t0
        saved.parent.mkdir(parents=True, exist_ok=True)
        saved.write_text(json.dumps({"results": results, "meta": meta}))
    meta.update(wall_s=time.perf_counter() - started, section_s=section_s,
                load_end=" ".join(f"{x:.2f}" for x in os.getloadavg()))
    saved.write_text(json.dumps({"results": results, "meta": meta}))
    write(results, meta, args.no_docs, papers_report, plots)
    print(f"[papers] done in {meta['wall_s'] / 60:.1f} min", flush=True)


def _modules() -> dict[str, object]:
    from harness import papers_deli, papers_fig67, papers_table3

    return {"table3": papers_table3, "fig67": papers_fig67, "deli": papers_deli}


def write(results: dict, meta: dict, no_docs: bool, papers_report, plots) -> None:
    """The markdown section and the PNGs: into docs/, or under .bench/papers/ with --no-docs."""
    from harness.papers_common import WORK

    imgdir = WORK / "img" if no_docs else REPO / "docs" / "img"
    for path in plots.write_all(results, imgdir):
        print(f"[papers] wrote {path.relative_to(REPO)}")
    section = papers_report.render(results, meta)
    if no_docs:
        out = WORK / "report.md"
        out.write_text(section)
    else:
        out = REPO / "docs" / "benchmarks.md"
        out.write_text(papers_report.insert_section(out.read_text(), section))
    print(f"[papers] wrote {out.relative_to(REPO)}")
    print(section)


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        raise SystemExit(130) from None
