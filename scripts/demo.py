"""The README's main job, end to end on loopback.

1. Start a local S3 emulator (moto server) and upload a generated image dataset in ImageFolder
   layout (``train/class_NN/img_NNNNN.jpg``).
2. Build its digest with ``digests build s3://…`` (parallel hashing, progress bar).
3. Inspect the digest with ``digests inspect``.

Everything runs under ``.demo/`` in the repository (git-ignored) and the emulator is always
stopped. Usage: ``scripts/demo.sh [--classes N] [--per-class N]``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from quiverfs.testing.emulators import run_moto  # noqa: E402
from quiverfs.testing.sample_data import generate_images  # noqa: E402

BIN = Path(sys.executable).parent
BUCKET = "quiverfs-demo"
PREFIX = "imagefolder"


def step(message: str) -> None:
    print(f"\n==> {message}", flush=True)


def run(cmd: list[str], env: dict[str, str]) -> None:
    print("$ " + " ".join(cmd), flush=True)
    subprocess.run(cmd, env=env, check=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--per-class", type=int, default=300)
    args = parser.parse_args()

    work = REPO / ".demo"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    digest = work / "sample.digest"

    step("starting the S3 emulator (moto server) on loopback")
    with run_moto() as s3:
        env = {**os.environ, **s3.env}
        print(f"endpoint {s3.endpoint}")
        s3.create_bucket(BUCKET)
        started = time.monotonic()
        images = (
            (f"{PREFIX}/{path}", data)
            for path, data in generate_images(args.classes, args.per_class)
        )
        count = s3.upload_many(BUCKET, images)
        print(f"uploaded {count} JPEGs to s3://{BUCKET}/{PREFIX} in {time.monotonic() - started:.1f} s")

        step("building the digest")
        run([str(BIN / "digests"), "build", f"s3://{BUCKET}/{PREFIX}", "-o", str(digest)], env)

        step("inspecting the digest")
        run([str(BIN / "digests"), "inspect", str(digest)], env)
    print("\ndemo finished: the emulator is stopped; files are under .demo/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
