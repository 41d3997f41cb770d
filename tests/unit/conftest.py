"""Fixtures shared by the digest tests: trees on disk, an in-memory backend, a CLI runner.

Exposed as fixtures (``make_tree``, ``digest_cli``, ``tamper``, ``memory_backend``) because
tests/unit is not a package.
"""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path

import blake3
import pytest

from digests.cli import app
from quiverfs.base.backends import BackendOptions, ObjectInfo, RemoteSettings
from quiverfs.base.backends.base import Backend
from quiverfs.base.console import run_app
from quiverfs.base.errors import BackendError, NotFound


def make_tree(root: Path, files: dict[str, bytes]) -> Path:
    """Write ``files`` (relative path → bytes) under ``root``; return ``root``."""
    for rel, data in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return root


def b3(data: bytes) -> bytes:
    return blake3.blake3(data).digest()


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    """Run ``digests ARGS`` in-process; return (exit code, stdout, stderr)."""
    try:
        run_app(app, "digests", [str(a) for a in args])
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    else:  # pragma: no cover - run_app always exits
        code = 0
    out, err = capsys.readouterr()
    return code, out, err


def tamper(path: Path, *sql: str, fix_meta: bool = True) -> None:
    """Run ``sql`` on a digest in place (tests only), then make meta counts agree again."""
    conn = sqlite3.connect(path, isolation_level=None)
    for statement in sql:
        conn.execute(statement)
    if fix_meta:
        count, total = conn.execute("SELECT count(*), coalesce(sum(size), 0) FROM files").fetchone()
        conn.execute("UPDATE meta SET value = ? WHERE key = 'file_count'", (str(count),))
        conn.execute("UPDATE meta SET value = ? WHERE key = 'total_bytes'", (str(total),))
    conn.close()


class MemoryBackend(Backend):
    """Objects in a dict; ``on_read(key)`` may mutate them to simulate concurrent writers."""

    scheme = "file"

    def __init__(self, objects: dict[str, bytes], url: str = "file:///memory") -> None:
        super().__init__(url, BackendOptions(concurrency=4), RemoteSettings())
        self.objects = dict(objects)
        self.versions = {key: 1 for key in objects}
        self.on_read = None

    def put(self, key: str, data: bytes) -> None:
        self.objects[key] = data
        self.versions[key] = self.versions.get(key, 0) + 1

    def _info(self, key: str) -> ObjectInfo:
        return ObjectInfo(key, len(self.objects[key]), str(self.versions[key]))

    def _list_page(self, prefix, token):
        return [self._info(k) for k in sorted(self.objects) if k.startswith(prefix)], None

    def _stat(self, key):
        if key not in self.objects:
            raise KeyError(key)
        return self._info(key)

    def _read_range(self, key, offset, length):
        if key not in self.objects:
            raise KeyError(key)
        if self.on_read:
            self.on_read(key)  # a concurrent writer, just before the bytes are read
        return self.objects[key][offset : offset + length]

    def _translate(self, exc, key) -> BackendError | None:
        if isinstance(exc, KeyError):
            return NotFound("no such object", url=self.url, key=key)
        return None


def file_url(path: Path) -> str:
    return "file://" + os.path.abspath(path)


@pytest.fixture(name="make_tree")
def _make_tree_fixture():
    return make_tree


@pytest.fixture(name="digest_cli")
def _digest_cli_fixture(capsys):
    return lambda *args: run_cli(capsys, *args)


@pytest.fixture(name="tamper")
def _tamper_fixture():
    return tamper


@pytest.fixture(name="memory_backend")
def _memory_backend_fixture():
    return MemoryBackend
