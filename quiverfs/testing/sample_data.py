"""A small, deterministic image dataset in ImageFolder layout, for the demo, tests and benchmarks.

``generate_images(n_classes, per_class)`` yields ``(relative_path, jpeg_bytes)`` pairs such as
``train/class_03/img_00017.jpg``. Each class has its own colour and shape so a small CNN can
learn something in a few steps; noise makes every file distinct (distinct content hashes) and
sizes realistic. The same arguments always give the same bytes.
"""

from __future__ import annotations

import io
import random
from collections.abc import Iterator
from pathlib import Path

#: Base colours per class (cycled for more classes).
_PALETTE = [
    (220, 60, 60), (60, 180, 75), (60, 90, 220), (240, 200, 40), (150, 60, 200),
    (40, 200, 210), (240, 130, 40), (200, 200, 200), (120, 80, 40), (250, 120, 200),
]


def class_name(index: int) -> str:
    """The folder name of class ``index``."""
    return f"class_{index:02d}"


def render_jpeg(class_index: int, sample_index: int, size: int = 64, quality: int = 90) -> bytes:
    """One JPEG: a class-coloured shape on a noisy background, unique per (class, sample)."""
    from PIL import Image, ImageDraw  # pillow is a test/demo dependency, not a runtime one

    rng = random.Random(class_index * 1_000_003 + sample_index)
    noise = bytes(rng.getrandbits(8) for _ in range(size * size * 3))
    image = Image.frombytes("RGB", (size, size), noise)
    draw = ImageDraw.Draw(image)
    colour = _PALETTE[class_index % len(_PALETTE)]
    margin = rng.randint(4, size // 4)
    box = (margin, margin, size - margin, size - margin)
    if class_index % 2:
        draw.ellipse(box, fill=colour)
    else:
        draw.rectangle(box, fill=colour)
    out = io.BytesIO()
    image.save(out, format="JPEG", quality=quality)
    return out.getvalue()


def generate_images(
    n_classes: int = 10, per_class: int = 300, size: int = 64, split: str = "train"
) -> Iterator[tuple[str, bytes]]:
    """``(relative_path, jpeg_bytes)`` for every image, in path order."""
    for c in range(n_classes):
        for i in range(per_class):
            yield f"{split}/{class_name(c)}/img_{i:05d}.jpg", render_jpeg(c, i, size)


def write_tree(root: Path, files: Iterator[tuple[str, bytes]]) -> int:
    """Write ``files`` under ``root`` (creating folders); returns the number written."""
    count = 0
    for rel, data in files:
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        count += 1
    return count
