"""A job that waits on its misses is measured as such through a real DataLoader (issue 35).

mountd's benefit-aware policy compares a job's mini-batch time on hits and on misses; the shim
reports each interval with what the batch it timed read. A DataLoader with workers keeps
``num_workers × prefetch_factor`` batches in flight, so the interval the sampler sees when it
is asked for batch ``k`` is the training step of batch ``k - depth``: reported as batch ``k``'s,
a probe's slow misses were timed on hits, and a job that waited on data most of the time
was called insensitive and its dataset turned ``off`` (ResNet-50 with 15 workers on the GPU
machine: t_hit 0.078 s, t_miss 0.022 s). The shim now reads the depth from its DataLoader.

Here: a real mount, mountd's default (benefit-aware) policy, 60% of the dataset cached, a
bucket that serves 40 files/s, one job with a 2-worker DataLoader and no compute: every miss
is a wait. Its probe must measure ``t_miss`` well above ``t_hit``. The mount's sweep is off
(``--sweep 0``): the dataset fits in the cache, and the sweep would fetch the rest of it ahead
of the job, leaving it no misses to measure.
"""

from __future__ import annotations

import random
import sys
import threading
import time
from pathlib import Path

import pytest

from mountd.coop.benefit import MIN_BENEFIT
from mountd.rpc.client import SyncClient
from tests.mount.conftest import REPO, serving, write_tree

sys.path.insert(0, str(REPO / "scripts" / "bench"))

from harness.jobs import JobSpec, run_jobs, write_rels  # noqa: E402

pytestmark = pytest.mark.mount

pytest.importorskip("torch", reason="torch is not installed (pip install -e '.[torch]')")

FILES = 200
FILE_SIZE = 8192
CACHED = 120


@pytest.fixture(scope="module")
def mounted(fuse, module_tmp: Path):
    rng = random.Random(5)
    rels = [f"class_{i % 4}/img_{i:04d}.bin" for i in range(FILES)]
    write_tree(module_tmp / "source", {rel: rng.randbytes(FILE_SIZE) for rel in rels})
    with serving(module_tmp / "source", module_tmp, "d", "64M", "--remote-requests", "40",
                 mount_options=("--sweep", "0")) as mountpoint:
        yield mountpoint, rels, module_tmp / "d-cache"


def test_a_job_that_waits_on_misses_is_measured_sensitive(mounted, tmp_path: Path) -> None:
    mountpoint, rels, cache = mounted
    for rel in random.Random(6).sample(rels, CACHED):  # a partly cached dataset
        (mountpoint / rel).read_bytes()
    spec = JobSpec(name="waits", reader="mount-shim", root=str(mountpoint),
                   rels_file=write_rels(tmp_path / "rels.txt", rels), file_size=FILE_SIZE,
                   batch_size=5, epochs=1, compute_s=0.0, workers=2, prefetch_factor=2, seed=1)
    results: list[dict] = []
    runner = threading.Thread(target=lambda: results.extend(run_jobs([spec], tmp_path / "jobs",
                                                                     timeout=300)))
    runner.start()
    seen: dict = {}
    with SyncClient.connect(cache) as client:
        while runner.is_alive():  # the job's figures, as long as its session is open
            for dataset in client.stats()["allocation"]["datasets"].values():
                for job in dataset["jobs"]:
                    if job["job"] == "waits":
                        seen = {**job, "mode": dataset["mode"]}
            time.sleep(0.1)
    runner.join()
    assert [r["files"] for r in results] == [FILES]
    assert seen.get("probes", 0) >= 1, seen  # its t_miss comes from a probe of uncached files
    assert seen["t_hit"] is not None and seen["t_miss"] is not None, seen
    # A batch of 5 misses takes ~1/8 s at 40 files/s; a batch of hits a few milliseconds.
    assert seen["b"] > 3 * MIN_BENEFIT, seen
    assert seen["mode"] != "off", seen
