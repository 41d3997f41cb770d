"""Remote requests and bytes per epoch for each mode, priced with mountd's cost model.

No runs of its own: it reads the runs of the other sections. "Per epoch" is per epoch of the
whole multi-job (every job reading the dataset once): the run's files read by all jobs ÷
(jobs × dataset files). The bucket is ``file://`` (free), so the counts are priced as if it were
S3 (:mod:`mountd.stats.costs`: GETs at S3's read price, bytes at internet egress; "in region" drops the
egress), and scaled to an ImageNet-1k epoch (1,281,167 files of the same size).
"""

from __future__ import annotations

from typing import Any

from harness.papers_common import served

IMAGENET_FILES = 1_281_167

#: (section, run name, label) of the runs the table shows, in order.
PICKS = (
    ("table3", "miss", "Table 3: cache miss (jobs read the bucket)"),
    ("table3", "coop", "Table 3: co-op miss (shim, cold cache)"),
    ("table3", "hit", "Table 3: cache hit (shim, warm cache)"),
    ("fig67", "nocache", "Fig 6: no cache (jobs read the bucket)"),
    ("fig67", "lru-10%", "Fig 6: LRU, cache 10%"),
    ("fig67", "shim-10%", "Fig 6: shim, cache 10%"),
    ("fig67", "lru-20%", "Fig 6: LRU, cache 20%"),
    ("fig67", "shim-20%", "Fig 6: shim, cache 20%"),
    ("fig67", "lru-100%", "Fig 6: LRU, cache 100%"),
    ("fig67", "shim-100%", "Fig 6: shim, cache 100%"),
    ("deli", "bucket", "DELI: bucket, no cache"),
    ("deli", "cache-only", "DELI: cache only, C = 2F (LRU, shuffled)"),
    ("deli", "c2F-t50%", "DELI: 50/50 (shim, C = 2F, threshold 50%)"),
)


def rows(results: dict[str, Any], dataset_files: dict[str, int]) -> list[dict[str, Any]]:
    """One row per picked run that was measured (``dataset_files``: files per section's dataset)."""
    from mountd.stats.costs import PRICES, egress_cost, request_cost

    s3 = PRICES["s3"]
    out = []
    for section, name, label in PICKS:
        run = (results.get(section) or {}).get("runs", {}).get(name)
        if run is None:
            continue
        files = dataset_files[section]
        jobs = run["load"]["jobs"]
        epochs = run["summary"]["files"] / (jobs * files)
        if epochs <= 0:
            continue
        gets, nbytes = served(run)
        gets_e, bytes_e = gets / epochs, nbytes / epochs
        req = request_cost(s3, {"GET": gets_e})
        egress = egress_cost(s3, int(bytes_e))
        scale = IMAGENET_FILES / files
        out.append({
            "label": label, "section": section, "run": name, "jobs": jobs, "epochs": epochs,
            "gets_per_epoch": gets_e, "bytes_per_epoch": bytes_e,
            "datasets_per_epoch": gets_e / files,
            "usd_per_epoch": req + egress, "usd_in_region": req,
            "usd_imagenet": (req + egress) * scale, "usd_imagenet_in_region": req * scale,
        })
    return out
