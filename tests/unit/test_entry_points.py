"""Every way into the commands does the command: the console scripts, ``python -m`` on each
package and on each script's module, and the mount(8) helper. ``python -m digests.cli build``
once exited 0 having done nothing (the module had no ``__main__`` guard); no way in may
succeed silently.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from digests.digest import Digest
from quiverfs.base.version import __version__

REPO = Path(__file__).resolve().parents[2]
SCRIPTS: dict[str, str] = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]


def _ways_in(name: str) -> list[list[str]]:
    """Command lines that run console script ``name``: ``python -m`` on its package and on
    its module (``module:function`` in pyproject.toml), and the script itself when installed."""
    module = SCRIPTS[name].split(":")[0]
    ways = [[sys.executable, "-m", module.split(".")[0]], [sys.executable, "-m", module]]
    script = Path(sys.executable).parent / name
    if script.exists():
        ways.append([str(script)])
    return ways


def _run(argv: list[str], cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, cwd=cwd, timeout=120, check=False)


CASES = [(name, way) for name in sorted(SCRIPTS) for way in range(3)]


def test_the_commands_are_the_ones_tested() -> None:
    assert sorted(SCRIPTS) == ["digests", "quiverfs"]  # a new one: give it a case below


@pytest.mark.parametrize(("name", "way"), CASES)
def test_help_names_the_command(name: str, way: int) -> None:
    ways = _ways_in(name)
    if way >= len(ways):
        pytest.skip(f"the {name} console script is not installed in this environment")
    done = _run([*ways[way], "--help"])
    assert done.returncode == 0, done.stderr
    assert f"Usage: {name} [OPTIONS] COMMAND [ARGS]..." in done.stdout


@pytest.mark.parametrize(("name", "way"), CASES)
def test_no_command_and_a_wrong_command_fail_loudly(name: str, way: int) -> None:
    ways = _ways_in(name)
    if way >= len(ways):
        pytest.skip(f"the {name} console script is not installed in this environment")
    bare = _run(ways[way])
    assert bare.returncode == 2
    assert f"Usage: {name} [OPTIONS] COMMAND [ARGS]..." in bare.stdout + bare.stderr
    wrong = _run([*ways[way], "no-such-command"])
    assert wrong.returncode == 2
    assert "No such command 'no-such-command'" in wrong.stderr


@pytest.mark.parametrize("way", range(3))
def test_quiverfs_version_prints_the_version(way: int) -> None:
    ways = _ways_in("quiverfs")
    if way >= len(ways):
        pytest.skip("the quiverfs console script is not installed in this environment")
    done = _run([*ways[way], "version"])
    assert (done.returncode, done.stdout, done.stderr) == (0, f"{__version__}\n", "")


@pytest.mark.parametrize("way", range(3))
def test_digests_build_writes_the_digest(way: int, tmp_path: Path) -> None:
    ways = _ways_in("digests")
    if way >= len(ways):
        pytest.skip("the digests console script is not installed in this environment")
    source = tmp_path / "source"
    (source / "sub").mkdir(parents=True)
    (source / "a.txt").write_bytes(b"hello\n")
    (source / "sub" / "b.bin").write_bytes(os.urandom(5000))
    out = tmp_path / "out.qd"
    done = _run([*ways[way], "build", f"file://{source}", "-o", str(out)])
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"wrote {out}: 2 files, 5006 bytes, dataset id ")
    digest = Digest.open(out)
    try:
        assert sorted(path for path, _size, _hash in digest.iter_canonical()) == ["a.txt", "sub/b.bin"]
    finally:
        digest.close()


def test_the_mount_helper_without_arguments_says_how_to_use_it() -> None:
    done = _run([str(REPO / "scripts" / "mount.fuse.quiverfs")])
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.startswith("mount.fuse.quiverfs: usage: mount.fuse.quiverfs DIGEST MOUNTPOINT ")
    assert len(done.stderr.strip().splitlines()) == 1
