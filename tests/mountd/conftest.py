"""Fixtures for the mountd cache tests: a real ``file://`` source and real caches on disk."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import blake3
import pytest
import trio

from mountd.store.cache import Cache, CacheConfig
from mountd.store.fillpool import ProcessFills
from quiverfs.backends import Backend, BackendOptions, RemoteSettings, open_backend
from quiverfs.backends.base import Location


@dataclass(frozen=True)
class Obj:
    """One source object: its content hash, size, bytes and location."""

    hash: bytes
    size: int
    data: bytes
    location: Location


class Source:
    """A directory of objects served through ``file://``."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.url = "file://" + str(root)

    def add(self, name: str, data: bytes) -> Obj:
        path = self.root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        h = blake3.blake3(data).digest()
        return Obj(h, len(data), data, Location(self.url, name, 0, len(data)))

    def many(self, n: int, size: int, prefix: str = "obj") -> list[Obj]:
        return [self.add(f"{prefix}-{i:05d}", os.urandom(size)) for i in range(n)]


@pytest.fixture
def open_umask() -> Iterator[None]:
    """The widest umask a careless service unit could have."""
    old = os.umask(0)
    yield
    os.umask(old)


@pytest.fixture
def source(tmp_path: Path) -> Source:
    return Source(tmp_path / "remote")


class Backends:
    """A backend factory that keeps the real FileBackends it made, to count their requests."""

    def __init__(self, wrap: Callable[[Backend], Backend] | None = None) -> None:
        self.made: list[Backend] = []
        self.wrap = wrap

    def __call__(self, url: str) -> Backend:
        backend = open_backend(url, BackendOptions(), RemoteSettings.from_environ({}))
        if self.wrap is not None:
            backend = self.wrap(backend)
        self.made.append(backend)
        return backend

    def gets(self) -> int:
        return sum(b.counters.requests["GET"] for b in self.made)


@pytest.fixture
def backends() -> Backends:
    return Backends()


def config(cache_dir: Path, size: int = 1 << 30, **kw) -> CacheConfig:
    return CacheConfig(cache_dir=cache_dir, cache_size=size, **kw)


@asynccontextmanager
async def running(
    cfg: CacheConfig, factory: Callable[[str], Backend] | None = None
) -> AsyncIterator[Cache]:
    """An open cache with its workers running; closed (and its lock released) on exit."""
    cache = Cache(cfg, factory)
    await cache.open()
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(cache.run)
            try:
                yield cache
            finally:
                await cache.aclose()
    finally:
        await cache.aclose()


@asynccontextmanager
async def pooled(cfg: CacheConfig, processes: int = 2) -> AsyncIterator[tuple[Cache, ProcessFills]]:
    """An open cache whose fills run in ``processes`` forked fill processes, as mountd's do
    (mountd/store/fillpool.py); closed, and its fill processes stopped, on exit."""
    assert cfg.fill_concurrency is not None
    threads = ProcessFills.threads_for(processes, cfg.fill_concurrency)
    fills = ProcessFills(cfg.cache_dir, processes, threads,
                         partial(open_backend, options=BackendOptions(concurrency=threads)))
    try:
        cache = Cache(cfg, fills=fills)
        await cache.open()
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(cache.run)
                try:
                    yield cache, fills
                finally:
                    await cache.aclose()
        finally:
            await cache.aclose()
    finally:
        fills.close()


@asynccontextmanager
async def running_with(fills: str, cfg: CacheConfig, factory: Callable[[str], Backend] | None = None
                       ) -> AsyncIterator[Cache]:
    """:func:`running` (``fills="threads"``: mountd's own threads, with ``factory``) or
    :func:`pooled` (``"processes"``: fill processes with real backends): for the tests whose
    guarantees must hold whichever runs the fills."""
    if fills == "threads":
        async with running(cfg, factory) as cache:
            yield cache
    else:
        async with pooled(cfg) as (cache, _):
            yield cache


def store_files(cache_dir: Path) -> dict[str, int]:
    """Every file under store/ → size."""
    out = {}
    for dirpath, _, names in os.walk(cache_dir / "store"):
        for name in names:
            out[name] = os.path.getsize(os.path.join(dirpath, name))
    return out


def tmp_files(cache_dir: Path) -> list[str]:
    return os.listdir(cache_dir / "tmp")


async def wait_until(predicate: Callable[[], bool], timeout: float = 10.0, what: str = "") -> None:
    """Poll ``predicate`` until true; fail after ``timeout`` seconds (no fixed sleeps)."""
    with trio.move_on_after(timeout):
        while not predicate():
            await trio.sleep(0.005)
        return
    raise AssertionError(f"timed out after {timeout}s waiting for {what or predicate}")
