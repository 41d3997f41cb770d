"""torchvision's ImageFolder over the mount sees what it sees over the original folder."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from quiverfs.testing.sample_data import generate_images, write_tree
from tests.mount.conftest import serving

pytestmark = pytest.mark.mount

torchvision = pytest.importorskip("torchvision", reason="torchvision is not installed (pip install -e '.[torch]')")
torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def folders(fuse, module_tmp: Path):
    source = module_tmp / "images"
    count = write_tree(source, generate_images(n_classes=4, per_class=25, size=48))
    assert count == 100
    with serving(source, module_tmp, "images") as mountpoint:
        yield source / "train", mountpoint / "train"


def _relative(samples: list[tuple[str, int]], root: Path) -> list[tuple[str, int]]:
    return [(os.path.relpath(path, root), target) for path, target in samples]


def test_same_classes_and_samples(folders) -> None:
    original, mounted = folders
    a = torchvision.datasets.ImageFolder(str(original))
    b = torchvision.datasets.ImageFolder(str(mounted))
    assert a.classes == b.classes == [f"class_{i:02d}" for i in range(4)]
    assert a.class_to_idx == b.class_to_idx
    assert _relative(a.samples, original) == _relative(b.samples, mounted)
    assert len(b) == 100


def test_same_decoded_tensors(folders) -> None:
    original, mounted = folders
    to_tensor = torchvision.transforms.ToTensor()
    a = torchvision.datasets.ImageFolder(str(original), transform=to_tensor)
    b = torchvision.datasets.ImageFolder(str(mounted), transform=to_tensor)
    for i in range(len(a)):
        (xa, ya), (xb, yb) = a[i], b[i]
        assert ya == yb
        assert xa.shape == xb.shape == (3, 48, 48)
        assert torch.equal(xa, xb), a.samples[i][0]


def test_through_a_dataloader_with_workers(folders) -> None:
    _, mounted = folders
    to_tensor = torchvision.transforms.ToTensor()
    dataset = torchvision.datasets.ImageFolder(str(mounted), transform=to_tensor)
    loader = torch.utils.data.DataLoader(dataset, batch_size=16, num_workers=2, shuffle=False)
    labels = torch.cat([y for _, y in loader])
    assert labels.tolist() == [t for _, t in dataset.samples]
