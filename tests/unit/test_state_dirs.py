"""Where a user's state lives when it has no usable home (mountd/store/layout.py): the cache
directory and the runtime folder fall back to a private ``0700`` folder under the temporary
directory, which is refused with one line when someone else made it first or can write it.

The real-mount version (a throwaway user without a home mounting, reading, unmounting) is
tests/mount/test_accounts_without_home.py.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from mountd.store import layout
from quiverfs.base.errors import UsageError
from quiverfs.mount.start import mount_state_dir
from quiverfs.testing.users import LocalUsers, run_as, traversable_tmpdir

REPO = Path(__file__).resolve().parents[2]

#: A uid no account of the test machine has, for folders "someone else" made.
STRANGER = 54_321


@pytest.fixture
def no_home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """No XDG variables, a $HOME that does not exist, and a temporary directory of the
    test's own; that directory."""
    for name in ("XDG_CACHE_HOME", "XDG_RUNTIME_DIR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "missing-home"))
    temp = tmp_path / "tmp"
    temp.mkdir()
    temp.chmod(0o1777)
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    return temp


def _private(temp: Path) -> Path:
    return temp / f"quiverfs-{os.geteuid()}"


def test_no_home_falls_back_to_a_private_folder_under_the_temporary_directory(no_home: Path) -> None:
    assert layout.default_cache_dir() == _private(no_home) / "cache"
    st = os.lstat(_private(no_home))
    assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700
    assert st.st_uid == os.geteuid()
    assert layout.runtime_dir() == _private(no_home)
    # Made once, then reused as it is.
    (_private(no_home) / "kept").write_text("x")
    assert layout.default_cache_dir() == _private(no_home) / "cache"
    assert (_private(no_home) / "kept").read_text() == "x"


def test_a_home_that_is_a_file_is_no_home(no_home: Path, tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "file-home").write_text("")
    monkeypatch.setenv("HOME", str(tmp_path / "file-home"))
    assert layout.default_cache_dir() == _private(no_home) / "cache"


def test_the_xdg_variables_and_a_real_home_come_first(no_home: Path, tmp_path: Path, monkeypatch) -> None:
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    assert layout.default_cache_dir() == home / ".cache" / "quiverfs"
    assert layout.runtime_dir() == home / ".cache" / "quiverfs"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg-cache"))
    assert layout.default_cache_dir() == tmp_path / "xdg-cache" / "quiverfs"
    assert layout.runtime_dir() == tmp_path / "xdg-cache" / "quiverfs"
    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    assert layout.runtime_dir() == runtime / "quiverfs"
    assert layout.default_cache_dir() == tmp_path / "xdg-cache" / "quiverfs"  # a cache is no runtime state
    assert not _private(no_home).exists()  # never made when not needed


def test_a_runtime_dir_that_is_not_ours_is_skipped(no_home: Path, tmp_path: Path, monkeypatch) -> None:
    # su and sudo -E hand the caller's XDG_RUNTIME_DIR to another user.
    theirs = tmp_path / "run-theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, STRANGER, STRANGER)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(theirs))
    assert layout.runtime_dir() == _private(no_home)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "run-missing"))
    assert layout.runtime_dir() == _private(no_home)


def _refusal(temp: Path) -> str:
    with pytest.raises(UsageError) as caught:
        layout.default_cache_dir()
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith(f"refusing {_private(temp)} as this user's state folder: it ")
    assert message.endswith("remove it, or set XDG_CACHE_HOME (or HOME) to a directory of yours, "
                            "or pass --cache-dir")
    return message


def test_a_folder_someone_else_made_first_is_refused(no_home: Path) -> None:
    _private(no_home).mkdir(mode=0o700)
    os.chown(_private(no_home), STRANGER, STRANGER)
    assert f"belongs to uid {STRANGER}, not {os.geteuid()};" in _refusal(no_home)


@pytest.mark.parametrize("mode", [0o770, 0o707, 0o722])
def test_a_folder_others_can_write_is_refused(no_home: Path, mode: int) -> None:
    _private(no_home).mkdir()
    _private(no_home).chmod(mode)
    assert f"is writable by others (mode {mode:04o});" in _refusal(no_home)
    assert stat.S_IMODE(_private(no_home).stat().st_mode) == mode  # left as it was


def test_a_symbolic_link_or_a_file_is_refused(no_home: Path, tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o700)
    _private(no_home).symlink_to(target)
    assert "is not a directory;" in _refusal(no_home)
    assert list(target.iterdir()) == []
    _private(no_home).unlink()
    _private(no_home).write_text("")
    assert "is not a directory;" in _refusal(no_home)


def test_a_temporary_directory_we_cannot_write_says_what_to_set(no_home: Path, monkeypatch) -> None:
    monkeypatch.setattr(tempfile, "tempdir", "/proc")  # nobody, root included, makes a folder there
    with pytest.raises(UsageError) as caught:
        layout.default_cache_dir()
    assert str(caught.value).startswith(f"cannot create /proc/quiverfs-{os.geteuid()}: ")
    assert "set XDG_CACHE_HOME (or HOME) to a directory of yours" in str(caught.value)


def test_no_temporary_directory_at_all_says_what_to_set(no_home: Path, monkeypatch) -> None:
    def none_usable() -> str:
        raise FileNotFoundError("No usable temporary directory found in ['/tmp', ...]")

    monkeypatch.setattr(tempfile, "gettempdir", none_usable)
    with pytest.raises(UsageError) as caught:
        layout.runtime_dir()
    assert str(caught.value) == ("this user has no usable home and no writable temporary directory: "
                                 "set XDG_CACHE_HOME (or HOME) to a directory of yours, or pass --cache-dir")


def test_a_mount_next_to_another_users_cache_keeps_its_state_in_the_fallback(no_home: Path, tmp_path: Path) -> None:
    shared = tmp_path / "shared-cache"
    shared.mkdir()
    os.chown(shared, STRANGER, STRANGER)
    state = mount_state_dir(shared)
    assert state.parent == _private(no_home) and state.name.startswith("mounts-")
    assert stat.S_IMODE(state.stat().st_mode) == 0o700
    assert mount_state_dir(tmp_path) == tmp_path  # our own cache directory: its own folder


def test_the_command_line_says_it_in_one_line(no_home: Path) -> None:
    _private(no_home).mkdir()
    _private(no_home).chmod(0o777)
    env = {k: v for k, v in os.environ.items() if not k.startswith("XDG_")}
    env.update(HOME=str(no_home.parent / "missing-home"), TMPDIR=str(no_home))
    for argv in (["mounts"], ["stats"], ["mount", "d.qd", str(no_home)]):
        done = subprocess.run([sys.executable, "-m", "quiverfs", *argv], capture_output=True,
                              text=True, env=env, cwd=REPO, timeout=120, check=False)
        assert done.returncode == 2, (argv, done.stderr)
        assert done.stdout == ""
        assert done.stderr == (f"quiverfs: error: refusing {_private(no_home)} as this user's state "
                               "folder: it is writable by others (mode 0777); remove it, or set "
                               "XDG_CACHE_HOME (or HOME) to a directory of yours, or pass --cache-dir\n")


# -- a real account whose home it may not write --------------------------------------------------


@pytest.fixture
def shared_temp() -> Iterator[Path]:
    """A sticky, world-writable folder other users can reach (a /tmp of the test's own)."""
    outer = traversable_tmpdir()
    temp = outer / "tmp"
    temp.mkdir()
    temp.chmod(0o1777)
    try:
        yield temp
    finally:
        shutil.rmtree(outer, ignore_errors=True)


def test_a_real_user_whose_home_is_not_its_own(local_users: LocalUsers, shared_temp: Path) -> None:
    user = local_users.user("qfs_test_homeless")
    home = shared_temp.parent / "root-owned-home"  # exists, 0755, root's: not writable
    home.mkdir(mode=0o755)

    def where() -> list[str]:
        os.environ.pop("XDG_CACHE_HOME", None)
        os.environ.pop("XDG_RUNTIME_DIR", None)
        os.environ["HOME"] = str(home)
        tempfile.tempdir = str(shared_temp)
        cache = layout.default_cache_dir()
        st = os.lstat(cache.parent)
        return [str(cache), str(layout.runtime_dir()), oct(stat.S_IMODE(st.st_mode)), str(st.st_uid)]

    cache, runtime, mode, owner = run_as(user, where)
    private = shared_temp / f"quiverfs-{user.uid}"
    assert (cache, runtime, mode, owner) == (str(private / "cache"), str(private), "0o700", str(user.uid))
