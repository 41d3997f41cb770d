"""The command-line knobs every emulated-job benchmark shares, and its start-up checks.

Each script passes its own defaults (a benchmark's defaults are part of what it measures),
then turns the parsed arguments into the dataset spec and the bucket's limits with
:func:`dataset_spec` and :func:`bucket_limits`.
"""

from __future__ import annotations

import argparse
import os

from harness.world import DatasetSpec, sigterm_as_interrupt


def add_workload_args(
    parser: argparse.ArgumentParser, *, jobs: int, files: int, compute: float, remote_files: float
) -> None:
    """``--jobs --files --file-size --scale --batch-size --compute --workers --remote-files``."""
    parser.add_argument("--jobs", type=int, default=jobs)
    parser.add_argument("--files", type=int, default=files, help="files in the dataset (before --scale)")
    parser.add_argument("--file-size", type=int, default=32 * 1024, help="bytes per file")
    parser.add_argument("--scale", type=float, default=1.0, help="multiplies --files")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--compute", type=float, default=compute, help="seconds of compute per mini-batch")
    parser.add_argument("--workers", type=int, default=2, help="DataLoader workers per job")
    parser.add_argument("--remote-files", type=float, default=remote_files,
                        help="bucket speed in files/s: sets --remote-requests and --remote-bandwidth")


def preflight() -> None:
    """Refuse to start without root and FUSE; make SIGTERM tear the worlds down like Ctrl-C."""
    if os.geteuid() != 0 or not os.path.exists("/dev/fuse"):
        raise SystemExit("needs root and /dev/fuse")
    sigterm_as_interrupt()


def dataset_spec(args: argparse.Namespace) -> DatasetSpec:
    """The synthetic dataset the arguments describe."""
    return DatasetSpec(files=int(args.files * args.scale), file_size=args.file_size)


def remote_limits(files_per_s: float, file_size: int) -> dict[str, float]:
    """mountd's remote limits (MountdConfig fields) for a bucket serving ``files_per_s`` files/s."""
    return {"remote_bandwidth": files_per_s * file_size, "remote_requests": files_per_s}


def bucket_limits(args: argparse.Namespace, spec: DatasetSpec) -> dict[str, float]:
    """mountd's remote limits for a bucket serving ``--remote-files`` files/s."""
    return remote_limits(args.remote_files, spec.file_size)
