#!/usr/bin/env python3
"""Mounting a 1.3-million-entry digest: time to ready and the FUSE process's memory.

Reuses the synthetic digests of scripts/bench/digest_scale.py (ImageNet-shaped: 1000 dirs x
1300 files; flat: one directory of 1,000,000 files), built under .bench/ on first use. With a
mountd already running (the usual case), it measures:

* ``quiverfs mount DIGEST MNT`` from start to return (the command returns once the mount
  answers), for the ImageNet-shaped digest;
* the mount's VmRSS/VmHWM (its main process and FUSE workers, summed) right after, and after walking 50 class directories with
  ``os.scandir`` + ``stat`` (65,000 entries) and stat-ing 20,000 random files;
* listing the flat digest's million-entry directory through the mount (readdir pages through
  the digest; nothing is materialised) and the process's memory after it.

Targets: ready <= 2 s and the mount's memory (PSS of its processes, summed) <= 300 MB.

    .venv/bin/python scripts/bench/mount_scale.py [--no-flat]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)
WORK = os.path.join(REPO, ".bench", "mount_scale")
TARGET_READY_S = 2.0
TARGET_RSS_MB = 300.0


def _digest_scale():
    spec = importlib.util.spec_from_file_location("digest_scale", os.path.join(REPO, "scripts", "bench", "digest_scale.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def quiverfs(*args: str) -> list[str]:
    return [sys.executable, "-m", "quiverfs.cli", *args]


def _status_mb(pid: int) -> dict[str, float]:
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key = line.split(":", 1)[0]
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(line.split()[1]) / 1024
    return out


def _pss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith("Pss:"):
                return int(line.split()[1]) / 1024
    return 0.0


def memory_mb(pid: int) -> dict[str, float]:
    """The mount's memory: its main process plus its FUSE workers (its children).

    ``VmRSS``/``VmHWM`` are summed over the processes, so pages they share (copy-on-write
    after fork, the digest's mapped file) count once per process: an overstatement.
    ``Pss`` splits every shared page between the processes sharing it: summed, it is what
    the mount really holds now, and what the target is checked against."""
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        pids = [pid, *map(int, f.read().split())]
    totals = {"VmRSS": 0.0, "VmHWM": 0.0, "Pss": 0.0}
    for each in pids:
        for key, value in _status_mb(each).items():
            totals[key] += value
        totals["Pss"] += _pss_mb(each)
    totals["processes"] = len(pids)
    return totals


def mount(digest: str, mnt: str, cache: str) -> tuple[float, int]:
    """Seconds ``quiverfs mount`` took to return, and the FUSE process's pid."""
    os.makedirs(mnt, exist_ok=True)
    start = time.perf_counter()
    result = subprocess.run(quiverfs("mount", digest, mnt, "--cache-dir", cache), cwd=REPO,
                            capture_output=True, text=True)
    took = time.perf_counter() - start
    if result.returncode != 0:
        raise SystemExit(f"mount failed: {result.stderr.strip()}")
    pid = json.loads(os.getxattr(mnt, "user.quiver.stats"))["pid"]
    return took, pid


def umount(mnt: str) -> None:
    subprocess.run(quiverfs("umount", mnt), cwd=REPO, capture_output=True, check=False)
    if os.path.ismount(mnt):
        subprocess.run(["fusermount3", "-u", "-z", mnt], check=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--no-flat", action="store_true", help="skip the million-entry directory")
    parser.add_argument("--rounds", type=int, default=3, help="mounts to time (the median is reported)")
    args = parser.parse_args()
    if os.geteuid() != 0 or not os.path.exists("/dev/fuse"):
        raise SystemExit("needs root and /dev/fuse")
    scale = _digest_scale()
    scale.ensure(scale.IMAGENET, scale.imagenet_rows, False)
    if not args.no_flat:
        scale.ensure(scale.FLAT, scale.flat_rows, False)

    from mountd.rpc.client import probe

    cache = os.path.join(WORK, "cache")
    if probe(cache, timeout=1.0) is not None:
        raise SystemExit(f"a mountd is running on {cache}: stop it first (the benchmark starts its own)")
    shutil.rmtree(cache, ignore_errors=True)
    os.makedirs(cache)
    mnt = os.path.join(WORK, "mnt")
    mountd = subprocess.Popen(quiverfs("mountd", "--cache-dir", cache, "--cache-size", "1G"), cwd=REPO,
                              stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    rows = []
    try:
        deadline = time.monotonic() + 60
        while probe(cache, timeout=1.0) is None:
            if mountd.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("mountd did not start")
            time.sleep(0.01)

        times = []
        for _ in range(args.rounds):
            took, pid = mount(scale.IMAGENET, mnt, cache)
            times.append(took)
            mem_ready = memory_mb(pid)
            umount(mnt)
        ready = sorted(times)[len(times) // 2]
        rows.append(("1.3M digest: `quiverfs mount` to ready (median)", f"<= {TARGET_READY_S:g} s",
                     f"{ready:.2f} s ({', '.join(f'{t:.2f}' for t in times)})", ready <= TARGET_READY_S))
        rows.append((f"mount RSS when ready ({mem_ready['processes']} processes, summed)", f"<= {TARGET_RSS_MB:g} MB",
                     f"{mem_ready['VmRSS']:.0f} MB (peak {mem_ready['VmHWM']:.0f}, PSS {mem_ready['Pss']:.0f})",
                     mem_ready["Pss"] <= TARGET_RSS_MB))

        took, pid = mount(scale.IMAGENET, mnt, cache)
        try:
            train = os.path.join(mnt, "train")
            classes = sorted(os.listdir(train))
            start = time.perf_counter()
            entries = 0
            for name in classes[:50]:
                with os.scandir(os.path.join(train, name)) as it:
                    for entry in it:
                        entry.stat()
                        entries += 1
            walk_s = time.perf_counter() - start
            rng = random.Random(1)
            picks = [os.path.join(train, rng.choice(classes)) for _ in range(200)]
            files = []
            for d in picks:
                names = os.listdir(d)
                files += [os.path.join(d, n) for n in rng.sample(names, 100)]
            start = time.perf_counter()
            for path in files:
                os.stat(path)
            stat_s = time.perf_counter() - start
            mem = memory_mb(pid)
            rows.append((f"after scandir+stat of {entries:,} entries ({entries / walk_s:,.0f}/s) "
                         f"and {len(files):,} stats ({len(files) / stat_s:,.0f}/s)",
                         f"<= {TARGET_RSS_MB:g} MB", f"{mem['VmRSS']:.0f} MB (peak {mem['VmHWM']:.0f}, PSS {mem['Pss']:.0f})",
                         mem["Pss"] <= TARGET_RSS_MB))
        finally:
            umount(mnt)

        if not args.no_flat:
            took, pid = mount(scale.FLAT, mnt, cache)
            try:
                start = time.perf_counter()
                count = 0
                with os.scandir(os.path.join(mnt, "flat")) as it:
                    for _ in it:
                        count += 1
                list_s = time.perf_counter() - start
                mem = memory_mb(pid)
                rows.append((f"1M-entry directory: mount {took:.2f} s, list {count:,} entries in {list_s:.1f} s",
                             f"<= {TARGET_RSS_MB:g} MB", f"{mem['VmRSS']:.0f} MB (peak {mem['VmHWM']:.0f}, PSS {mem['Pss']:.0f})",
                             mem["Pss"] <= TARGET_RSS_MB and count == 1_000_000))
            finally:
                umount(mnt)
    finally:
        if os.path.ismount(mnt):
            umount(mnt)
        mountd.send_signal(signal.SIGTERM)
        mountd.wait(30)

    print(f"\nmount scale ({os.cpu_count()} CPUs)")
    width = max(len(r[0]) for r in rows)
    for name, target, value, ok in rows:
        print(f"{name:<{width}}  {target:>10}  {value:>24}  {'PASS' if ok else 'FAIL'}")


if __name__ == "__main__":
    main()
