"""Fixtures for the mountd tests: a real ``file://`` source, real caches on disk, and whole
mountds in this process (:func:`in_process_mountd`, :func:`mountd_env`)."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import blake3
import pytest
import trio

from digests.build import build
from mountd.coop.datasets import DatasetView
from mountd.daemon import DaemonConfig, Running, serve
from mountd.rpc.async_client import AsyncClient, open_client
from mountd.rpc.server import Server
from mountd.store import layout
from mountd.store.cache import Cache, CacheConfig
from mountd.store.fillpool import ProcessFills
from quiverfs.base.backends import Backend, BackendOptions, RemoteSettings, open_backend
from quiverfs.base.backends.base import Location


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
async def pooled(cfg: CacheConfig, processes: int = 2,
                 factory: Callable[[str], Backend] | None = None,
                 child_factory: Callable[[str], Backend] | None = None,
                 ) -> AsyncIterator[tuple[Cache, ProcessFills]]:
    """An open cache whose fills run in ``processes`` forked fill processes, as mountd's do
    (mountd/store/fillpool.py); closed, and its fill processes stopped, on exit. ``factory``
    opens the cache's own backends, ``child_factory`` the fill processes' (default: real
    ones; a wrapper runs in the children, so what it records must be shared memory)."""
    assert cfg.fill_concurrency is not None
    threads = ProcessFills.threads_for(processes, cfg.fill_concurrency)
    fills = ProcessFills(cfg.cache_dir, processes, threads, child_factory or
                         partial(open_backend, options=BackendOptions(concurrency=threads)))
    try:
        cache = Cache(cfg, factory, fills=fills)
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


def short_dir(tmp_path: Path) -> Path:
    """``tmp_path``, or the same directory relative to the working directory when its path is
    long: a cache directory's socket path must fit a unix socket address (107 bytes)."""
    return tmp_path if len(str(tmp_path)) < 60 else Path(os.path.relpath(tmp_path))


@asynccontextmanager
async def in_process_mountd(cache_dir: Path, cache_size: int, **options: Any) -> AsyncIterator[Running]:
    """A whole mountd in this process (real Cache, socket, session layer and tick loop:
    :func:`mountd.daemon.serve` without signal handlers) serving ``cache_dir``; ``options``
    are :class:`~mountd.daemon.DaemonConfig` fields. Shut down on exit."""
    config = DaemonConfig(CacheConfig(cache_dir=cache_dir, cache_size=cache_size), **options)
    async with trio.open_nursery() as nursery:
        running = await nursery.start(partial(serve, config, handle_signals=False))
        try:
            yield running
        finally:
            running.server.shutdown.set()


@dataclass
class Env:
    """A mountd in this process serving one ``file://`` dataset, registered with its digest
    (:func:`mountd_env`)."""

    server: Server
    client: AsyncClient
    cache_dir: Path
    dataset: str
    digest: Path
    url: str
    files: list[tuple[str, bytes]]  # in digest (path) order

    @property
    def view(self) -> DatasetView:
        assert self.server.coop is not None
        return self.server.coop.views[self.dataset]

    def in_store(self, cid: int) -> bool:
        return layout.store_path(self.cache_dir, self.view.hash_of(cid)).exists()


@asynccontextmanager
async def mountd_env(tmp_path: Path, *, files: int = 200, size: int = 1000,
                     cache_size: int = 1 << 26, mode: str | None = None,
                     chunk_grace: float = 0.0) -> AsyncIterator[Env]:
    """``files`` files of ``size`` bytes (the first 4 their index) under ``tmp_path/remote``,
    their digest built, served by :func:`in_process_mountd` (``mode``: ``--dataset-mode``)
    and registered by an :class:`AsyncClient` (the client of :class:`Env`)."""
    source = tmp_path / "remote"
    source.mkdir()
    data = []
    for i in range(files):
        body = i.to_bytes(4, "big") + os.urandom(size - 4)
        name = f"d{i % 7}/f{i:05d}.bin"
        (source / name).parent.mkdir(exist_ok=True)
        (source / name).write_bytes(body)
        data.append((name, body))
    data.sort(key=lambda item: [p.encode() for p in item[0].split("/")])
    digest = tmp_path / "ds.qd"
    url = "file://" + str(source)
    result = await build(url, digest)
    cache_dir = short_dir(tmp_path) / "cache"
    async with in_process_mountd(cache_dir, cache_size, dataset_mode=mode,
                                 chunk_grace=chunk_grace) as running, \
            open_client(cache_dir) as client:
        await client.register(result.dataset_id, digest=str(digest))
        yield Env(running.server, client, cache_dir, result.dataset_id, digest, url, data)
