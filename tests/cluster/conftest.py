"""Fixtures for the cluster's tests: a real ``redis-server`` on loopback, a cluster secret."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import trio

from quiverfs.testing.redis import RedisServer, redis_binary, run_redis

#: A cluster secret for tests (the real one comes from --cluster-secret-file).
SECRET = b"test-cluster-secret-0123456789abcdef"


def secret_file(tmp_path: Path, mode: int = 0o600) -> Path:
    """``SECRET`` in a file of ``mode``, as ``--cluster-secret-file`` takes it."""
    path = tmp_path / "cluster.secret"
    path.write_bytes(SECRET + b"\n")
    path.chmod(mode)
    return path


def mountd_once(tmp_path: Path, *options: str) -> subprocess.CompletedProcess[str]:
    """``quiverfs mountd OPTIONS`` run to its end (for options it refuses at start-up)."""
    return subprocess.run(
        [sys.executable, "-m", "quiverfs.cli", "mountd", "--cache-dir", str(tmp_path / "c"),
         "--cache-size", "16M", *options], capture_output=True, text=True, timeout=60)


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A fresh, empty redis-server of this test's own (killable, restartable)."""
    if redis_binary() is None:
        pytest.fail("redis-server is missing: run scripts/setup.sh (apt-get install redis-server)")
    with run_redis(tmp_path / "redis") as server:
        yield server


async def until(check: Callable[[], object], what: str = "", timeout: float = 10.0) -> None:
    """Poll ``check`` until it is true; fail after ``timeout`` seconds, saying ``what``."""
    with trio.move_on_after(timeout):
        while not check():
            await trio.sleep(0.02)
        return
    raise AssertionError(f"timed out after {timeout:g} s waiting for {what or check}")
