"""The shim's order in the real pipeline is a fresh shuffle every epoch (issue 35).

A real mount of a chunked dataset (mountd's cache holds 20% of it), one job of two ranks, each
rank a process of its own with a ``DataLoader`` of two worker processes, the ranks kept in step
by an all-reduce per step as DDP's gradient sync keeps them (scripts/bench/harness/jobs.py, the
same job the benchmarks run). Every epoch every file is read exactly once, and each file's
position is unrelated to where it was the epoch before.

The chunk-order simulation (tests/unit/test_chunk_order.py) passed while this pipeline kept
files in place (epoch-to-epoch correlation of positions +0.75): a reader that ran ahead of the
chunk loads planned chunks for the rest of its epoch and read them again, in the same order,
in the next one. Power: 300 files and 8 epochs give 7 epoch pairs; a correlation of 0.3 is
more than ten standard errors (1/sqrt(300) per pair) from the 0.1 bound asserted here.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

from quiverfs.testing import order_stats
from tests.mount.conftest import REPO, serving, write_tree

sys.path.insert(0, str(REPO / "scripts" / "bench"))

from harness.jobs import JobSpec, run_jobs, write_rels  # noqa: E402

pytestmark = pytest.mark.mount

pytest.importorskip("torch", reason="torch is not installed (pip install -e '.[torch]')")

FILES = 300
FILE_SIZE = 4096
EPOCHS = 8
RANKS = 2
BATCH = 10


@pytest.fixture(scope="module")
def mounted(fuse, module_tmp: Path):
    rng = random.Random(35)
    rels = [f"class_{i % 5}/img_{i:04d}.bin" for i in range(FILES)]
    write_tree(module_tmp / "source", {rel: rng.randbytes(FILE_SIZE) for rel in rels})
    cache_size = str(FILES * FILE_SIZE // 5)  # 20% of the dataset
    with serving(module_tmp / "source", module_tmp, "d", cache_size,
                 "--dataset-mode", "chunked") as mountpoint:
        yield mountpoint, rels


def test_every_epoch_is_a_fresh_shuffle_with_two_ranks_and_workers(mounted, tmp_path: Path) -> None:
    mountpoint, rels = mounted
    rels_file = write_rels(tmp_path / "rels.txt", rels)
    specs = [JobSpec(name=f"job-r{rank}", job="job", reader="mount-shim", root=str(mountpoint),
                     rels_file=rels_file, file_size=FILE_SIZE, batch_size=BATCH, epochs=EPOCHS,
                     compute_s=0.0, workers=2, seed=7, rank=rank, world_size=RANKS,
                     rendezvous=str(tmp_path / "rendezvous"), record_order=True)
             for rank in range(RANKS)]
    results = sorted(run_jobs(specs, tmp_path / "jobs", timeout=600), key=lambda r: r["rank"])

    epochs = []
    for epoch in range(EPOCHS):
        ranks = [r["epochs"][epoch]["order"] for r in results]
        assert [len(b) for b in ranks] == [FILES // RANKS // BATCH] * RANKS, f"epoch {epoch}: steps"
        assert order_stats.exactly_once(ranks, FILES) == (0, 0), f"epoch {epoch}"
        epochs.append(order_stats.epoch_positions(ranks))

    lags = order_stats.lag_correlations(epochs)
    p = order_stats.position_chi2_p(epochs, FILES, bins=4)
    detail = f"lag correlations {[round(r, 2) for r in lags]}, chi-square p {p:.3g}"
    assert abs(sum(lags) / len(lags)) < 0.1, detail
    assert p > 0.001, detail
