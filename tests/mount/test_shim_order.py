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

torch = pytest.importorskip("torch", reason="torch is not installed (pip install -e '.[torch]')")

from quiverfs.torch import QuiverBatchSampler  # noqa: E402  (after the importorskip)

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


def test_a_default_fetch_size_follows_mountd_and_a_given_one_is_kept(mounted) -> None:
    """On a chunked dataset mountd advises each rank a fetch size of a quarter chunk between
    the job's ranks (mountd/coop/claims.py ``advised_fetch``); a sampler left at its default
    fetch size claims that much (at least a batch) from then on, one given a fetch size keeps
    it. Every file still comes exactly once per epoch through a DataLoader with workers."""
    mountpoint, rels = mounted
    paths = [str(mountpoint / rel) for rel in rels]

    class Files(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return len(paths)

        def __getitem__(self, i: int) -> int:
            with open(paths[i], "rb") as f:
                assert len(f.read()) == FILE_SIZE
            return i

    def claim_sizes(sampler) -> list[int]:
        sizes: list[int] = []
        request = sampler.control.request

        def spy(op, **args):
            if op == "claim":
                sizes.append(args["n"])
            return request(op, **args)

        sampler.control.request = spy
        return sizes

    batch = 2
    default = QuiverBatchSampler(paths=paths, batch_size=batch, job="advised", report=False)
    given = QuiverBatchSampler(paths=paths, batch_size=batch, job="given", fetch_size=8, report=False)
    for sampler in (default, given):
        sizes = claim_sizes(sampler)
        loader = torch.utils.data.DataLoader(Files(), batch_sampler=sampler, num_workers=2)
        read = sorted(int(i) for b in loader for i in b)
        assert read == list(range(FILES)), sampler.job
        sampler.close()
        advice = sampler.advised_fetch
        assert advice is not None and batch < advice < 4 * batch, advice  # a real bound here
        if sampler is default:
            assert sizes[0] == 4 * batch and set(sizes[1:]) == {advice}, sizes
        else:
            assert set(sizes) == {8}, sizes
