"""`quiverfs mounts` names the digest the user mounted, never the private copy mountd knows
(the real mount: tests/mount/test_fs_tree.py::test_mounts_command_shows_the_digest_the_user_mounted)."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

from quiverfs.cli.mount_cli import mount_stats
from quiverfs.cli.mountd_views import print_mounts


def test_a_mount_that_does_not_answer_shows_no_digest_rather_than_the_copy(tmp_path: Path) -> None:
    # mountd's record names the copy the mount registered; the mount is gone (a plain folder).
    record = {"id": 1, "dataset": "d" * 64, "digest": "/var/cache/quiverfs/snapshots/77-ab.qd",
              "mountpoint": str(tmp_path), "pid": 77, "uid": 0}
    [row] = mount_stats([record])
    assert row["digest"] is None and row["stats"] is None and row["stats_error"]
    assert row["snapshot"] == "/var/cache/quiverfs/snapshots/77-ab.qd"
    console = Console(record=True, width=400)
    print_mounts([row], console)
    [line] = [line for line in console.export_text().splitlines() if str(tmp_path) in line]
    assert [cell.strip() for cell in line.split("│")[1:4]] == [str(tmp_path), "-", "d" * 16]
    assert "snapshots" not in console.export_text()


def test_the_table_shows_the_users_digest() -> None:
    row = {"mountpoint": "/mnt/imagenet", "digest": "/data/imagenet.qd", "dataset": "a" * 64, "pid": 5,
           "snapshot": "/var/cache/quiverfs/snapshots/5-cd.qd",
           "stats": {"opens": 1, "hits": 1, "misses": 0, "reads": 1, "bytes": 10, "errors": 0,
                     "mounted_digest": "/data/imagenet.qd"}}
    console = Console(record=True, width=400)
    print_mounts([row], console)
    [line] = [line for line in console.export_text().splitlines() if "/mnt/imagenet" in line]
    assert [cell.strip() for cell in line.split("│")[1:5]] == ["/mnt/imagenet", "/data/imagenet.qd",
                                                               "a" * 16, "5"]
