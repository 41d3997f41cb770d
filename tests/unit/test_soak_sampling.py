"""The soak's process sampling: descriptors of the files a reader is reading are not counted as
held (quiverfs/testing/soak.py, ``Role``), everything else is."""

from __future__ import annotations

import os
from pathlib import Path

from quiverfs.testing.soak import Role, sample_role


def _open_files(folder: Path, names: list[str]) -> list[int]:
    folder.mkdir(parents=True, exist_ok=True)
    fds = []
    for name in names:
        path = folder / name
        path.write_bytes(b"x")
        fds.append(os.open(path, os.O_RDONLY))
    return fds


def test_a_readers_data_files_are_left_out_of_its_descriptors_and_nothing_else(tmp_path: Path) -> None:
    data = tmp_path / "data"
    # A sibling whose name starts like the data folder's is not under it.
    fds = _open_files(data / "class_0", ["a", "b", "c"]) + _open_files(tmp_path / "data2", ["d"]) \
        + _open_files(tmp_path / "other", ["e", "f"])
    try:
        counted = sample_role(Role.main("self", os.getpid)).fds
        held = sample_role(Role.main("self", os.getpid, data=(str(data),))).fds
        assert counted - held == 3
        # A trailing slash names the same folder.
        assert sample_role(Role.main("self", os.getpid, data=(f"{data}/",))).fds == held
        os.close(fds.pop())  # one outside the data closed: both counts fall by one
        assert sample_role(Role.main("self", os.getpid)).fds == counted - 1
        assert sample_role(Role.main("self", os.getpid, data=(str(data),))).fds == held - 1
    finally:
        for fd in fds:
            os.close(fd)


def test_children_of_passes_the_data_folders_on(tmp_path: Path) -> None:
    role = Role.children_of("workers", lambda: None, data=(str(tmp_path),))
    assert role.data == (str(tmp_path),)
    assert sample_role(role).pids == ()
