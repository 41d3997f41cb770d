"""A ``Dataset`` of a mount's files as raw bytes, each checked against what was written: the
reader the shim's mount tests hand a ``DataLoader``. It opens each file with ``open()``, as
PIL's loader for ``ImageFolder`` does (the mount sees that open even when the kernel's pages
serve the bytes: quiverfs/fuse/worker.py). Import it after ``pytest.importorskip("torch")``."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from quiverfs.torch import QuiverBatchSampler


def shim_loader(mnt: Path, files: dict[str, bytes], job: str, seed: int,
                prefetch_factor: int) -> tuple:
    """``(sampler, loader)``: a ``QuiverBatchSampler`` (batches of 8, no timing reports) over
    :class:`RawFiles` of ``files`` under ``mnt``, and a ``DataLoader`` with two workers that
    yields each batch's ``(index, bytes match)`` items."""
    dataset = RawFiles(mnt, files)
    sampler = QuiverBatchSampler(dataset, batch_size=8, job=job, seed=seed, report=False)
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler, num_workers=2,
                                         prefetch_factor=prefetch_factor,
                                         collate_fn=lambda items: items)
    return sampler, loader


class RawFiles(torch.utils.data.Dataset):
    """``(index, bytes match)`` for each of ``files`` (relative path -> bytes) under ``mnt``,
    in sorted path order (``samples``, as ``ImageFolder`` names them, for the shim)."""

    def __init__(self, mnt: Path, files: dict[str, bytes]) -> None:
        self.mnt = mnt
        self.files = files
        self.samples = [(str(mnt / rel), 0) for rel in sorted(files)]

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> tuple[int, bool]:
        path = self.samples[i][0]
        with open(path, "rb") as f:
            return i, f.read() == self.files[os.path.relpath(path, self.mnt)]
