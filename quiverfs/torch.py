"""``quiverfs.torch``: the path training scripts import the PyTorch shim by (docs/shim.md).

The shim lives with the rest of the training side, in quiverfs/client/torch.py; this module
keeps ``from quiverfs.torch import QuiverBatchSampler, DirectDataset, direct_loader`` working.
It imports torch, as the shim does; nothing in quiverfs imports it.
"""

from quiverfs.client.torch import (
    DirectDataset,
    QuiverBatchSampler,
    direct_loader,
    direct_reader,
    pil_rgb,
)

__all__ = ["DirectDataset", "QuiverBatchSampler", "direct_loader", "direct_reader", "pil_rgb"]
