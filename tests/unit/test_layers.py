"""The import layers (quiverfs/__init__.py): the contract names every module, and it bites.

``lint-imports`` (run by scripts/test.sh) checks the contracts in pyproject.toml; these tests
keep the contract honest: a new module must be placed in a layer, and an upward import or an
import cycle hidden in a function breaks it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("quiverfs", "digests", "mountd")
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"


def _contracts() -> list[dict]:
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    return config["tool"]["importlinter"]["contracts"]


def _named_in_layers(root: str = "base") -> set[str]:
    """Module names of the layers contract whose name starts with ``root``."""
    (layers,) = [c["layers"] for c in _contracts()
                 if c["type"] == "layers" and c["name"].startswith(root)]
    return {name.strip() for layer in layers for name in layer.replace("|", ":").split(":")}


def _top_level_modules(package: str) -> set[str]:
    root = REPO.joinpath(*package.split("."))
    names = {f"{package}.{p.stem}" for p in root.glob("*.py") if p.stem != "__init__"}
    names |= {f"{package}.{p.name}" for p in root.iterdir() if (p / "__init__.py").exists()}
    return names


def _covered(module: str, named: set[str]) -> bool:
    """Named itself, or a subpackage each of whose modules is named (the base, in two layers)."""
    if module in named:
        return True
    return REPO.joinpath(*module.split(".")).is_dir() and _top_level_modules(module) <= named


def test_every_module_of_ours_sits_in_a_layer() -> None:
    named = _named_in_layers()
    assert {"digests", "mountd"} <= named  # whole packages, one layer each
    missing = sorted(m for m in _top_level_modules("quiverfs") if not _covered(m, named))
    assert missing == [], f"add these to [tool.importlinter] layers in pyproject.toml: {missing}"
    floors = {m for m in _top_level_modules("quiverfs") if REPO.joinpath(*m.split(".")).is_dir()}
    known = _top_level_modules("quiverfs").union(*map(_top_level_modules, floors))
    assert named - {"digests", "mountd"} <= known  # no stale names


def test_every_part_of_mountd_sits_in_a_layer_of_its_own_contract() -> None:
    assert _named_in_layers("mountd:") == _top_level_modules("mountd")


def test_the_acyclic_contract_covers_every_package() -> None:
    (acyclic,) = [c for c in _contracts() if c["type"] == "acyclic_siblings"]
    assert set(acyclic["ancestors"]) == set(PACKAGES)


def _lint_copy(tmp_path: Path, edits: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """``lint-imports`` over a copy of our packages with ``edits`` (path → text appended)."""
    for package in PACKAGES:
        shutil.copytree(REPO / package, tmp_path / package,
                        ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    for path, text in edits.items():
        with open(tmp_path / path, "a") as f:
            f.write(text)
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    return subprocess.run([str(LINT_IMPORTS), "--no-cache"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120, check=False)


@pytest.mark.skipif(not LINT_IMPORTS.exists(), reason="lint-imports is not installed (test extra)")
def test_the_contracts_hold_for_the_tree_as_it_is(tmp_path: Path) -> None:
    done = _lint_copy(tmp_path, {})
    assert done.returncode == 0, done.stdout + done.stderr
    assert "3 kept, 0 broken" in done.stdout


@pytest.mark.skipif(not LINT_IMPORTS.exists(), reason="lint-imports is not installed (test extra)")
@pytest.mark.parametrize(
    ("edits", "broken"),
    [
        # digests reaching up into mountd, from inside a function
        ({"digests/paths.py": "\n\ndef _up():\n    import mountd.store.cache  # noqa\n"}, "base -> digests"),
        # the base reaching up into the mount
        ({"quiverfs/base/errors.py": "\n\ndef _up():\n    from quiverfs.filesystem import tree  # noqa\n"},
         "base -> digests"),
        # the filesystem reaching up into the FUSE workers that serve it
        ({"quiverfs/filesystem/fs.py": "\n\ndef _up():\n    from quiverfs.fuse import worker  # noqa\n"},
         "base -> digests"),
        # the filesystem reaching up into the training side
        ({"quiverfs/filesystem/reads.py": "\n\ndef _up():\n    from quiverfs.client import direct  # noqa\n"},
         "base -> digests"),
        # a cycle inside mountd hidden in a function
        ({"mountd/store/layout.py": "\n\ndef _cycle():\n    from mountd.store import index  # noqa\n"},
         "no import cycles"),
    ],
)
def test_an_upward_import_or_a_hidden_cycle_breaks_a_contract(tmp_path: Path, edits, broken) -> None:
    done = _lint_copy(tmp_path, edits)
    assert done.returncode != 0
    assert ", 0 broken" not in done.stdout
    assert broken in done.stdout.split("Broken contracts", 1)[1]
