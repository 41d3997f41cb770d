#!/usr/bin/env python3
"""How long does mountd take to open a big cache after a crash?

Builds (once, reused) a synthetic store of N entries under .bench/recovery-N/: empty files
named by fake hashes in the real fan-out layout, plus a matching index (kept pristine as
``index.base.sqlite``). Each run then times ``Cache.open()`` side by side for:

* clean      — after a clean shutdown (index marked clean): lock, tmp sweep, totals;
* crash      — a killed mountd (index not clean): store scan, index scan, set differences,
               with stray temp files, files deleted behind the index's back (rows without files),
               files without rows (killed between rename and commit);
* no-damage  — a crash that left nothing to repair (the cost of the full reconcile itself);
* rebuild    — the index file is garbage: every file is stat'ed and adopted.

The damage is undone after each run so the store can be reused. Files are empty because
recovery never reads content (a final-name file is verified by invariant); this keeps a
1M-entry store at ~65K directories + 1M inodes instead of 4 GB of blocks.

    .venv/bin/python scripts/bench/mountd_recovery.py               # 1,000,000 entries
    .venv/bin/python scripts/bench/mountd_recovery.py --entries 100000
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

import trio

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from mountd.store import layout  # noqa: E402
from mountd.store.cache import Cache, CacheConfig  # noqa: E402
from mountd.store.disk import prepare  # noqa: E402
from mountd.store.index import Index  # noqa: E402


def fake_hash(i: int, salt: int = 0) -> bytes:
    # Spread over all fan-out folders like real blake3 hashes would be.
    x = (i * 0x9E3779B97F4A7C15 + salt * 0xC2B2AE3D27D4EB4F) & ((1 << 64) - 1)
    return x.to_bytes(8, "big") * 4


def touch(cache_dir: Path, h: bytes) -> None:
    path = layout.store_path(cache_dir, h)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    except FileNotFoundError:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    os.close(fd)


def build(cache_dir: Path, entries: int) -> None:
    marker = cache_dir / "built"
    if marker.exists():
        print(f"reusing {cache_dir} ({entries:,} entries)")
        return
    print(f"building {entries:,} entries in {cache_dir} (once; reused later) ...", flush=True)
    shutil.rmtree(cache_dir, ignore_errors=True)
    prepare(cache_dir)
    start = time.perf_counter()
    for a in range(256):
        for b in range(256):
            (layout.store_dir(cache_dir) / f"{a:02x}" / f"{b:02x}").mkdir(
                parents=True, exist_ok=True
            )
    rows = []
    index = Index.open(cache_dir / "index.base.sqlite")
    for i in range(entries):
        h = fake_hash(i)
        touch(cache_dir, h)
        rows.append((h, 0, 1_700_000_000_000_000_000 + i))
        if len(rows) == 100_000:
            index.adopt(rows)
            rows.clear()
            print(f"  {i + 1:,} files  {time.perf_counter() - start:.0f}s", flush=True)
    index.adopt(rows)
    index.close()
    marker.write_text(str(entries))
    print(f"built in {time.perf_counter() - start:.1f}s")


def reset_index(cache_dir: Path, mode: str) -> None:
    """``mode``: "clean" (as left by a clean shutdown), "dirty" (by a crash) or "garbage"."""
    for suffix in ("", "-wal", "-shm", ".corrupt"):
        p = Path(str(layout.index_path(cache_dir)) + suffix)
        if p.exists():
            p.unlink()
    if mode == "garbage":
        layout.index_path(cache_dir).write_bytes(os.urandom(64 * 1024))
        return
    shutil.copyfile(cache_dir / "index.base.sqlite", layout.index_path(cache_dir))
    index = Index.open(layout.index_path(cache_dir))
    index.set_clean(mode == "clean")
    index.close()


def damage(cache_dir: Path, entries: int, k: int) -> tuple[list[bytes], list[bytes]]:
    """k stray temps, k indexed files deleted, k unindexed files added."""
    for i in range(k):
        (layout.tmp_dir(cache_dir) / f"{fake_hash(i).hex()}.{i:06x}.tmp").write_bytes(b"partial")
    deleted = [fake_hash(i) for i in range(0, entries, max(1, entries // k))][:k]
    for h in deleted:
        os.unlink(layout.store_path(cache_dir, h))
    added = [fake_hash(i, salt=1) for i in range(k)]
    for h in added:
        touch(cache_dir, h)
    return deleted, added


def repair(cache_dir: Path, deleted: list[bytes], added: list[bytes]) -> None:
    for h in deleted:
        touch(cache_dir, h)
    for h in added:
        os.unlink(layout.store_path(cache_dir, h))


async def timed_open(cache_dir: Path) -> tuple[float, object]:
    cache = Cache(CacheConfig(cache_dir=cache_dir, cache_size=1 << 50))
    start = time.perf_counter()
    await cache.open()
    seconds = time.perf_counter() - start
    report = cache.recovery
    await cache.aclose()
    return seconds, report


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--entries", type=int, default=1_000_000)
    parser.add_argument(
        "--damage", type=int, default=10_000, help="temps / missing / unindexed files each"
    )
    parser.add_argument("--dir", type=Path, default=REPO / ".bench")
    parser.add_argument(
        "--no-rebuild", action="store_true", help="skip the full index rebuild case"
    )
    args = parser.parse_args()
    cache_dir = args.dir / f"recovery-{args.entries}"
    build(cache_dir, args.entries)

    results = []
    reset_index(cache_dir, "clean")
    seconds, report = trio.run(timed_open, cache_dir)
    results.append(("clean", seconds, report))

    reset_index(cache_dir, "dirty")
    seconds, report = trio.run(timed_open, cache_dir)
    results.append(("no-damage", seconds, report))

    reset_index(cache_dir, "dirty")
    deleted, added = damage(cache_dir, args.entries, args.damage)
    try:
        seconds, report = trio.run(timed_open, cache_dir)
        results.append(("crash", seconds, report))
    finally:
        repair(cache_dir, deleted, added)

    if not args.no_rebuild:
        reset_index(cache_dir, "garbage")
        seconds, report = trio.run(timed_open, cache_dir)
        results.append(("rebuild", seconds, report))
    reset_index(cache_dir, "clean")

    print()
    print(
        f"Cache.open() on {args.entries:,} entries (page cache warm; damage = {args.damage:,} of each kind)"
    )
    print(
        f"{'case':<10} {'seconds':>8} {'entries/s':>12} {'temps':>7} {'dropped':>8} {'adopted':>9} "
        "scanned rebuilt"
    )
    for name, seconds, r in results:
        print(
            f"{name:<10} {seconds:>8.2f} {r.entries / seconds:>12,.0f} {r.temp_removed:>7,} "
            f"{r.rows_dropped:>8,} {r.adopted:>9,} {str(r.reconciled):>7} {r.index_rebuilt}"
        )
    base = results[1][1]
    for name, seconds, _ in results:
        print(f"{name} / no-damage = {seconds / base:.2f}x")


if __name__ == "__main__":
    main()
