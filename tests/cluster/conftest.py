"""Fixtures for the cluster's tests: a real ``redis-server`` on loopback, a cluster secret."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from quiverfs.testing.redis import RedisServer, redis_binary, run_redis

#: A cluster secret for tests (the real one comes from --cluster-secret-file).
SECRET = b"test-cluster-secret-0123456789abcdef"


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A fresh, empty redis-server of this test's own (killable, restartable)."""
    if redis_binary() is None:
        pytest.fail("redis-server is missing: run scripts/setup.sh (apt-get install redis-server)")
    with run_redis(tmp_path / "redis") as server:
        yield server
