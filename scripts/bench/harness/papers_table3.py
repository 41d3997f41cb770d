"""Quiver Table 3 (§7.3): time for K mini-batches of 7 jobs in cache-miss, hit and co-op modes.

Four runs of the same ``jobs`` jobs, each job reading ``batches`` mini-batches of one dataset:

* ``miss`` — the baseline, (c): every job reads the bucket directly (quiverfs's backend code,
  no cache); the jobs share the bucket's limits evenly;
* ``hit`` — (b) the shim on a cache that holds the dataset and was filled before the jobs start;
* ``coop`` — (b) the shim on a cold cache that can hold the dataset (co-operative misses);
* ``synthetic`` — (d) no I/O at all: the upper bound ``hit`` should come within 10% of.

The bucket serves ``jobs × demand / io_ratio`` files/s (``demand`` = batch / compute, what one
job reads when data never waits), so with ``io_ratio`` = 3.88 the miss mode is I/O bound by
Quiver's ResNet-50 factor. mountd (hit, co-op) gets the same limits.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from harness.papers_common import Bucket, Workload, measure
from harness.world import Dataset, MountdConfig

#: Quiver Table 3: time for 7000 mini-batches (s): miss, hit, co-op miss.
PAPER = {
    "ResNet50": (2505, 646, 1064),
    "Inception": (2874, 1274, 1817),
    "DeepSpeech": (1614, 1234, 1265),
}


@dataclass(frozen=True)
class Table3Params:
    jobs: int = 7
    batches: int = 50
    batch_size: int = 16
    compute_s: float = 0.2
    workers: int = 2
    io_ratio: float = 3.88
    cache_factor: float = 1.5

    def bucket_files(self) -> float:
        return self.jobs * self.batch_size / self.compute_s / self.io_ratio


def run(dataset: Dataset, p: Table3Params) -> dict[str, Any]:
    load = Workload(jobs=p.jobs, batch_size=p.batch_size, compute_s=p.compute_s,
                    workers=p.workers, batches=p.batches)
    bucket = Bucket(p.bucket_files(), dataset.spec.file_size)
    full = MountdConfig(int(dataset.total_bytes * p.cache_factor), dataset_mode="full", **bucket.limits)
    runs = {
        "synthetic": measure("t3-synthetic", dataset, load, "synthetic"),
        "hit": measure("t3-hit", dataset, load, "mount-shim", config=full, warm=True),
        "coop": measure("t3-coop", dataset, load, "mount-shim", config=full),
        "miss": measure("t3-miss", dataset, load, "bucket", bucket=bucket),
    }
    return {"params": {**asdict(p), **bucket.params()}, "runs": runs}


def rows(result: dict[str, Any]) -> dict[str, float]:
    """Time for K mini-batches (the slowest job) per mode, and the speed-ups over ``miss``."""
    runs = result["runs"]
    t = {mode: runs[mode]["summary"]["wall_s"] for mode in ("miss", "hit", "coop", "synthetic")}
    return {
        **{f"{m}_s": v for m, v in t.items()},
        "hit_speedup": t["miss"] / t["hit"],
        "coop_speedup": t["miss"] / t["coop"],
        "bound_speedup": t["miss"] / t["synthetic"],
        "hit_over_bound": t["hit"] / t["synthetic"],
    }
