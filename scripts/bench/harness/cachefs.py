"""A filesystem of its own for a benchmark's caches: a fresh ext4 on a loop device.

Why: a cache's fills are file creations and writes, and what they cost depends on the
filesystem far more than on the program that makes them. This VM's root ext4 (the one the
repository and the sources live on) charges ~0.2 ms of CPU to create a file and ~0.6 ms to
create and write 110 KiB, against ~0.04 ms and ~0.12 ms on a fresh ext4 on the same disk
(MEASURED.md). Profiled in a cold epoch through the shim (2026-11-29), the fill processes
spent most of their CPU in the kernel's inode allocation (``ext4_create`` / ``ext4_mkdir``
scanning past inodes freed minutes before, by the previous row's deleted cache: the root
filesystem has no journal, and ext4 then skips recently freed inodes one table lookup at a
time). A cache on a filesystem of its own is also what docs/operations.md advises. Every
contender of a benchmark gets the same filesystem, so none is favoured.
"""

from __future__ import annotations

import argparse
import contextlib
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

from harness.world import force_unmount

#: Size of the sparse image; blocks are allocated only as the caches fill.
IMAGE_BYTES = 8 << 30


def add_cache_on_root(parser: argparse.ArgumentParser, caches: str = "the caches") -> None:
    """``--cache-on-root``: keep ``caches`` on the repository's filesystem instead of the
    ext4 of their own that :func:`dedicated_cache_fs` makes (every benchmark that uses it)."""
    parser.add_argument("--cache-on-root", action="store_true",
                        help=f"keep {caches} on the repository's filesystem instead of a fresh "
                             "ext4 of their own (slow to create files on this VM)")


@contextlib.contextmanager
def dedicated_cache_fs(mountpoint: Path, image: Path, enabled: bool = True,
                       *, fallback: Path | None = None,
                       say: Callable[[str], None] | None = None,
                       size: int = IMAGE_BYTES) -> Iterator[Path]:
    """Yield the folder to keep caches in: ``mountpoint`` with a fresh ext4 of ``size``
    bytes (over the sparse file ``image``) mounted on it, unmounted and deleted on the way
    out; or, when not ``enabled``, ``fallback`` (default: ``mountpoint``'s parent) on the
    repository's filesystem. ``say`` is told which (a progress line). Exits with a one-line message when
    the filesystem cannot be made."""
    if say is not None:
        say("caches on " + (f"a fresh ext4 of their own ({mountpoint})" if enabled else
                            "the repository's filesystem"))
    if not enabled:
        yield fallback or mountpoint.parent
        return
    force_unmount(mountpoint)
    mountpoint.mkdir(parents=True, exist_ok=True)
    image.unlink(missing_ok=True)
    with open(image, "wb") as f:
        f.truncate(size)
    try:
        subprocess.run(["mkfs.ext4", "-q", "-F", str(image)], check=True, capture_output=True)
        subprocess.run(["mount", "-o", "loop", str(image), str(mountpoint)], check=True,
                       capture_output=True)
    except (OSError, subprocess.CalledProcessError) as exc:
        image.unlink(missing_ok=True)
        detail = (getattr(exc, "stderr", b"") or b"").decode().strip() or str(exc)
        raise SystemExit(f"cannot make the cache filesystem ({detail}); use --cache-on-root") from None
    try:
        yield mountpoint
    finally:
        subprocess.run(["umount", str(mountpoint)], check=False, capture_output=True)
        image.unlink(missing_ok=True)
