"""A real two-process DDP job (torch.distributed, gloo) reads a quiverfs mount through
``QuiverBatchSampler`` with DataLoader workers: rank, world size and job id come from
torch.distributed, the ranks split every epoch exactly, and both take the same number of steps.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from quiverfs.testing.sample_data import generate_images, write_tree
from tests.mount.conftest import REPO, serving

pytestmark = pytest.mark.mount

pytest.importorskip("torchvision", reason="torchvision is not installed (pip install -e '.[torch]')")

FILES = 4 * 25
WORLD = 2


@pytest.fixture(scope="module")
def mounted(fuse, module_tmp: Path):
    source = module_tmp / "images"
    assert write_tree(source, generate_images(n_classes=4, per_class=25, size=32)) == FILES
    with serving(source, module_tmp, "images") as mountpoint:
        yield mountpoint


def test_two_ddp_processes_split_each_epoch_exactly(mounted: Path, tmp_path: Path) -> None:
    script = Path(__file__).with_name("ddp_rank.py")
    rendezvous = tmp_path / "rendezvous"
    outs = [tmp_path / f"rank{r}.json" for r in range(WORLD)]
    procs = [
        subprocess.Popen([sys.executable, str(script), str(mounted / "train"), str(rendezvous), str(r),
                          str(WORLD), str(outs[r])], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True)
        for r in range(WORLD)
    ]
    for proc in procs:
        output, _ = proc.communicate(timeout=240)
        assert proc.returncode == 0, output[-3000:]
    results = [json.loads(out.read_text()) for out in outs]
    assert [r["rank"] for r in results] == [0, 1] and {r["world"] for r in results} == {WORLD}
    assert results[0]["job"] == results[1]["job"]  # broadcast from rank 0
    assert all(r["on_quiver"] for r in results)
    for epoch in ("0", "1"):
        batches = [r["epochs"][epoch] for r in results]
        assert len(batches[0]) == len(batches[1]) == results[0]["steps"]  # DDP needs equal steps
        per_rank = [[i for b in bs for i in b] for bs in batches]
        assert len(per_rank[0]) == len(set(per_rank[0])) and len(per_rank[1]) == len(set(per_rank[1]))
        assert set(per_rank[0]) | set(per_rank[1]) == set(range(FILES)), f"epoch {epoch}"
        assert not set(per_rank[0]) & set(per_rank[1]), f"epoch {epoch}"
    orders = [[i for b in results[0]["epochs"][e] for i in b] for e in ("0", "1")]
    assert orders[0] != orders[1]
