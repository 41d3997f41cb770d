"""One rank of a real two-process DDP job over a quiverfs mount (run by test_shim_ddp.py).

    python tests/mount/ddp_rank.py MOUNT_TRAIN_DIR RENDEZVOUS_FILE RANK WORLD OUT_JSON

Initialises torch.distributed (gloo, file rendezvous), builds ``QuiverBatchSampler`` with no
rank, world size or job given (all three must come from torch.distributed), reads two epochs
through a DataLoader with 2 worker processes, and writes what it saw as JSON.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
import torchvision

from quiverfs.torch import QuiverBatchSampler


class Indexed(torch.utils.data.Dataset):
    """ImageFolder that returns the index after really reading and decoding the file."""

    def __init__(self, root: str) -> None:
        self.inner = torchvision.datasets.ImageFolder(root)
        self.samples = self.inner.samples

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, i: int) -> int:
        image, _ = self.inner[i]
        assert image.size == (32, 32)
        return i


def main() -> None:
    root, rendezvous, rank, world, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    dataset = Indexed(root)
    sampler = QuiverBatchSampler(dataset, batch_size=7, seed=3)
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler, num_workers=2)
    seen = {}
    for epoch in range(2):
        sampler.set_epoch(epoch)
        seen[epoch] = [[int(i) for i in batch] for batch in loader]
        dist.barrier()  # as gradient all-reduces would keep the ranks in step
    result = {"rank": sampler.rank, "world": sampler.world_size, "job": sampler.job,
              "steps": len(sampler), "on_quiver": sampler.on_quiver, "epochs": seen}
    with open(out, "w") as f:
        json.dump(result, f)
    sampler.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
