"""The benchmark's image dataset: JPEGs in ImageFolder layout, written into the bucket directory.

``BUCKET/PREFIX/class_CCC/img_NNNNNNN.JPEG``: ``classes`` folders, files dealt round-robin.
Each image is ImageNet-like in shape and weight: width 300–640 px, one of the usual aspect
ratios, smooth structure (random low-resolution colour fields scaled up) plus grain whose
strength is log-normal, JPEG quality 80–95. Sizes come out log-normal too (about 20 KB to
over 300 KB, mean ~110 KB, like ImageNet's training set). The files are written once per
:class:`ImageSpec` (a marker file beside the bucket records it) and reused by later runs.
"""

from __future__ import annotations

import io
import json
import multiprocessing
import random
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

__all__ = ["ImageDataset", "ImageSpec", "make_images"]


@dataclass(frozen=True)
class ImageSpec:
    files: int = 20_000
    classes: int = 100
    seed: int = 0

    def rel(self, i: int) -> str:
        return f"class_{i % self.classes:03d}/img_{i:07d}.JPEG"


@dataclass(frozen=True)
class ImageDataset:
    """What was written: the spec, the files' keys under the prefix (sorted), total bytes."""

    spec: ImageSpec
    bucket: str
    prefix: str
    rels: tuple[str, ...]
    sizes: tuple[int, ...]

    @property
    def total_bytes(self) -> int:
        return sum(self.sizes)

    @property
    def keys(self) -> list[str]:
        return [f"{self.prefix}/{rel}" for rel in self.rels]

    @property
    def classes(self) -> list[str]:
        return sorted({rel.split("/", 1)[0] for rel in self.rels})


def _image(seed: int) -> bytes:
    import numpy as np
    from PIL import Image

    r = random.Random(seed)
    rng = np.random.default_rng(seed)
    w = r.randint(300, 640)
    h = int(w * r.choice((0.75, 0.667, 1.0, 0.5625, 1.333)))
    low = rng.integers(0, 256, (max(2, h // r.randint(4, 24)), max(2, w // r.randint(4, 24)), 3), dtype=np.uint8)
    pixels = np.asarray(Image.fromarray(low).resize((w, h), Image.BICUBIC), dtype=np.float32)
    grain = r.lognormvariate(2.85, 0.55)
    pixels = np.clip(pixels + rng.normal(0.0, grain, pixels.shape), 0, 255).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "JPEG", quality=r.randint(80, 95))
    return out.getvalue()


def _write(job: tuple[str, int]) -> int:
    path, seed = job
    data = _image(seed)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)
    return len(data)


def make_images(spec: ImageSpec, bucket_dir: Path, prefix: str = "train", processes: int = 2,
                progress=print) -> ImageDataset:
    """Write the dataset under ``bucket_dir/prefix`` unless the same spec is already there."""
    base = bucket_dir / prefix
    marker = bucket_dir.parent / f".images-{bucket_dir.name}-{prefix}.json"  # outside the bucket
    rels = [spec.rel(i) for i in range(spec.files)]
    if marker.exists():
        meta = json.loads(marker.read_text())
        if meta.get("spec") == asdict(spec):
            return ImageDataset(spec, bucket_dir.name, prefix, tuple(meta["rels"]), tuple(meta["sizes"]))
    progress(f"writing {spec.files:,} JPEGs in {spec.classes} classes under {base}")
    marker.unlink(missing_ok=True)
    shutil.rmtree(base, ignore_errors=True)
    jobs = [(str(base / rel), spec.seed * 10_000_019 + i) for i, rel in enumerate(rels)]
    pool = multiprocessing.get_context("fork").Pool(processes)
    try:
        sizes = pool.map(_write, jobs, chunksize=64)
        pool.close()  # let the workers exit on their own (terminate() would SIGTERM them)
    except BaseException:
        pool.terminate()
        raise
    finally:
        pool.join()
    order = sorted(range(len(rels)), key=lambda i: rels[i].encode())
    rels = [rels[i] for i in order]
    sizes = [sizes[i] for i in order]
    marker.write_text(json.dumps({"spec": asdict(spec), "rels": rels, "sizes": sizes}))
    return ImageDataset(spec, bucket_dir.name, prefix, tuple(rels), tuple(sizes))
