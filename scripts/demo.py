"""The README's main job, end to end on loopback.

1. Start a local S3 emulator (moto server) and upload a generated image dataset in ImageFolder
   layout (``train/class_NN/img_NNNNN.jpg``).
2. Build its digest with ``digests build s3://…`` (parallel hashing, progress bar).
3. Inspect the digest with ``digests inspect``.
4. Mount it with ``quiverfs mount`` (which starts a mountd with a cache under ``.demo/``).
5. Train a small CNN for a few mini-batches with ImageFolder + DataLoader through the mount:
   the first epoch fills the cache from the bucket, the second reads only the cache. Each
   epoch prints its images/s, mean loss and accuracy (the loss falls, the accuracy rises).
6. Print ``quiverfs stats``, then unmount and stop mountd.

Everything runs under ``.demo/`` in the repository (git-ignored); the mount, mountd and the
emulator are always stopped. Usage: ``scripts/demo.sh [--classes N] [--per-class N]``.
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


def stop_mountd(cache_dir: Path) -> None:
    """Ask the demo's mountd to shut down (it was started on demand by the mount)."""
    from mountd.rpc.client import SyncClient, resolve_socket
    from quiverfs.base.errors import QuiverError

    try:
        with SyncClient.connect(resolve_socket(cache_dir)[0]) as client:
            client.shutdown()
    except (OSError, QuiverError) as exc:
        print(f"mountd already stopped ({exc})")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--per-class", type=int, default=300)
    parser.add_argument("--epochs", type=int, default=2)
    args = parser.parse_args()

    work = REPO / ".demo"
    if os.path.ismount(work / "mnt"):  # left behind by an interrupted earlier run
        subprocess.run(["fusermount3", "-u", "-z", str(work / "mnt")], check=False)
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

        mountpoint, cache = work / "mnt", work / "cache"
        mountpoint.mkdir()
        step("mounting the dataset (starts a mountd on demand)")
        quiverfs = str(BIN / "quiverfs")
        run([quiverfs, "mount", str(digest), str(mountpoint), "--cache-dir", str(cache),
             "--cache-size", "1G"], env)
        try:
            step("training a small CNN through the mount with the QuiverBatchSampler shim (epoch 0 cold, "
                 "epoch 1 cached; as the model learns the classes, the loss falls and the accuracy rises)")
            run([sys.executable, str(REPO / "scripts" / "demo_train.py"), str(mountpoint / "train"),
                 "--epochs", str(args.epochs)], env)
            step("quiverfs stats")
            run([quiverfs, "stats", "--cache-dir", str(cache)], env)
        finally:
            subprocess.run([quiverfs, "umount", str(mountpoint)], env=env, check=False)
            stop_mountd(cache)
    print("\ndemo finished: mount, mountd and emulator are stopped; files are under .demo/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
