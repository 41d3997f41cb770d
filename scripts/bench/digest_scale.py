#!/usr/bin/env python3
"""How fast a big digest opens and answers the mount's questions.

Synthesises an ImageNet-shaped digest (1000 dirs x 1300 files = 1.3M entries, paths like
``train/n01440764/n01440764_10026.JPEG``) and a flat one (one directory of 1,000,000 files),
cached under .bench/ (git-ignored) so reruns skip the build. Each measurement runs in a fresh
subprocess so wall time and peak RSS (VmHWM) are those of a process that only opens the digest.

    .venv/bin/python scripts/bench/digest_scale.py            # build if needed, measure, table
    .venv/bin/python scripts/bench/digest_scale.py --rebuild  # rebuild the synthetic files

Targets (the mount): ready <= 2 s and peak RSS <= 300 MB for the 1.3M-entry digest.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

from digests.digest import Digest  # noqa: E402
from digests.write import write_digest  # noqa: E402

BENCH = os.path.join(REPO, ".bench")
IMAGENET = os.path.join(BENCH, "digest-imagenet-1.3m.qd")
FLAT = os.path.join(BENCH, "digest-flat-1m.qd")
SOURCE = "s3://example-bucket/imagenet"


def synsets(n: int) -> list[str]:
    rng = random.Random(7)
    return sorted({f"n{rng.randrange(1_000_000, 15_000_000):08d}" for _ in range(n * 2)})[:n]


def imagenet_rows():
    rng = random.Random(1)
    for synset in synsets(1000):
        for i in rng.sample(range(1, 50_000), 1300):
            yield (
                f"train/{synset}/{synset}_{i}.JPEG",
                rng.randrange(20_000, 300_000),
                rng.randbytes(32),
            )


def flat_rows():
    rng = random.Random(2)
    for i in range(1_000_000):
        yield f"flat/img_{i:07d}.JPEG", rng.randrange(20_000, 300_000), rng.randbytes(32)


def ensure(path: str, rows, rebuild: bool) -> float:
    if os.path.exists(path) and not rebuild:
        return 0.0
    os.makedirs(BENCH, exist_ok=True)
    start = time.perf_counter()
    write_digest(path, rows(), [SOURCE])
    return time.perf_counter() - start


def peak_rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def measure(path: str, check: str) -> dict:
    """Runs in the child: open, then lookups and listing."""
    result: dict = {"rss_before_mb": peak_rss_mb()}
    start = time.perf_counter()
    digest = Digest.open(path, check=check)
    result["open_s"] = time.perf_counter() - start
    result["rss_open_mb"] = peak_rss_mb()
    # Random path lookups (the mount's LOOKUP chain for cold paths).
    rng = random.Random(3)
    sample = (
        [f.path for f in digest.listdir(digest.lookup_path("train").id, limit=1000)]
        if digest.lookup_path("train")
        else []
    )
    paths = []
    for dir_path in sample[:200]:
        entry = digest.lookup_path(dir_path)
        paths += [e.path for e in digest.listdir(entry.id, limit=1300) if not e.is_dir]
    if not paths:
        top = digest.lookup_path("flat")
        paths = [e.path for e in digest.listdir(top.id, limit=50_000)]
    rng.shuffle(paths)
    paths = paths[:50_000]
    start = time.perf_counter()
    for p in paths:
        assert digest.lookup_path(p) is not None
    elapsed = time.perf_counter() - start
    result["lookup_path_per_s"] = len(paths) / elapsed
    # lookup(parent, name): what FUSE LOOKUP does once the parent inode is known.
    pairs = []
    for p in paths[:20_000]:
        e = digest.lookup_path(p)
        pairs.append((e.parent, e.name))
    start = time.perf_counter()
    for parent, name in pairs:
        digest.lookup(parent, name)
    result["lookup_per_s"] = len(pairs) / (time.perf_counter() - start)
    ids = [digest.lookup(p, n).id for p, n in pairs]
    start = time.perf_counter()
    for i in ids:
        digest.entry(i)
    result["entry_per_s"] = len(ids) / (time.perf_counter() - start)
    # Paging the biggest directory, 1000 entries a page (FUSE readdir-sized pages).
    big = max(digest.largest_dirs(1), key=lambda x: x[1])[0]
    start = time.perf_counter()
    after, total, pages, worst = None, 0, 0, 0.0
    while True:
        t = time.perf_counter()
        page = digest.listdir(big.id, after=after, limit=1000)
        worst = max(worst, time.perf_counter() - t)
        if not page:
            break
        total += len(page)
        pages += 1
        after = page[-1].id
    result["listdir_entries"] = total
    result["listdir_s"] = time.perf_counter() - start
    result["listdir_worst_page_ms"] = worst * 1000
    result["rss_end_mb"] = peak_rss_mb()
    digest.close()
    return result


def run_child(path: str, check: str) -> dict:
    args = [sys.executable, os.path.abspath(__file__), "--child", path, "--check", check]
    out = subprocess.run(args, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rebuild", action="store_true")
    parser.add_argument("--child")
    parser.add_argument("--check", default="structure")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.child, args.check)))
        return
    for path, rows in ((IMAGENET, imagenet_rows), (FLAT, flat_rows)):
        took = ensure(path, rows, args.rebuild)
        size = os.path.getsize(path) / 1e6
        note = f"built in {took:.1f} s" if took else "cached"
        print(f"{os.path.relpath(path, REPO)}: {size:.0f} MB ({note})")
    print()
    imagenet = run_child(IMAGENET, "structure")
    rows_check = run_child(IMAGENET, "rows")
    full = run_child(IMAGENET, "full")
    flat = run_child(FLAT, "structure")
    rows = [
        (
            "1.3M digest: open check='structure' (mount)",
            "<= 2 s",
            f"{imagenet['open_s']:.2f} s",
            imagenet["open_s"] <= 2,
        ),
        (
            "1.3M digest: peak RSS after open",
            "<= 300 MB",
            f"{imagenet['rss_open_mb']:.0f} MB",
            imagenet["rss_open_mb"] <= 300,
        ),
        (
            "1.3M digest: peak RSS after lookups+listing",
            "<= 300 MB",
            f"{imagenet['rss_end_mb']:.0f} MB",
            imagenet["rss_end_mb"] <= 300,
        ),
        (
            "1.3M digest: open check='rows' (CLI default)",
            "-",
            f"{rows_check['open_s']:.2f} s",
            None,
        ),
        ("1.3M digest: open check='full' (verify)", "-", f"{full['open_s']:.2f} s", None),
        ("1.3M digest: peak RSS with check='full'", "-", f"{full['rss_open_mb']:.0f} MB", None),
        ("lookup_path (3 components)", "-", f"{imagenet['lookup_path_per_s']:,.0f} /s", None),
        ("lookup(parent, name)", "-", f"{imagenet['lookup_per_s']:,.0f} /s", None),
        ("entry(id)", "-", f"{imagenet['entry_per_s']:,.0f} /s", None),
        (
            f"listdir all of a {imagenet['listdir_entries']:,}-entry dir",
            "-",
            f"{imagenet['listdir_s'] * 1000:.1f} ms",
            None,
        ),
        (
            "1M flat digest: open check='structure'",
            "<= 2 s",
            f"{flat['open_s']:.2f} s",
            flat["open_s"] <= 2,
        ),
        (
            f"listdir all of a {flat['listdir_entries']:,}-entry dir (1000/page)",
            "-",
            f"{flat['listdir_s']:.2f} s",
            None,
        ),
        ("  worst page of it", "-", f"{flat['listdir_worst_page_ms']:.1f} ms", None),
    ]
    width = max(len(r[0]) for r in rows)
    print(f"{'measurement':<{width}}  {'target':>10}  {'measured':>14}  result")
    for name, target, measured, ok in rows:
        verdict = "" if ok is None else ("PASS" if ok else "FAIL")
        print(f"{name:<{width}}  {target:>10}  {measured:>14}  {verdict}")
    if any(ok is False for *_, ok in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
