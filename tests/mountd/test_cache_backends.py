"""Backends are opened once, off mountd's trio thread, and ahead of a registered dataset's
first miss (an SDK's import and client cost a few hundred ms of CPU)."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import trio

from mountd.rpc import protocol
from mountd.rpc.server import Server
from quiverfs.base.backends import Backend
from quiverfs.base.errors import QuiverError, TemporaryFailure
from tests.mountd.conftest import Backends, Source, config, pooled, running, wait_until


class GatedBackends(Backends):
    """Backends whose opening blocks its thread until the test opens the gate; the first
    ``failures`` openings raise instead."""

    def __init__(self, failures: int = 0) -> None:
        super().__init__()
        self.entered = threading.Event()
        self.gate = threading.Event()
        self.calls = 0
        self.failures = failures
        self.threads: set[int] = set()

    def __call__(self, url: str) -> Backend:
        self.calls += 1
        self.threads.add(threading.get_ident())
        self.entered.set()
        if not self.gate.wait(10):
            raise AssertionError("the test never opened the gate")
        if self.calls <= self.failures:
            raise TemporaryFailure("cannot open (test)", url=url, key="")
        return super().__call__(url)


async def test_one_opening_in_a_thread_serves_every_waiting_fill(tmp_path: Path, source: Source):
    objs = source.many(3, 50_000)
    factory = GatedBackends()
    paths: list[str] = []
    async with running(config(tmp_path / "c"), factory) as cache:
        async with trio.open_nursery() as nursery:
            for obj in objs:
                nursery.start_soon(
                    lambda o: _append(paths, cache.ensure(o.hash, o.size, o.location, "ds")), obj)
            # The opening blocks its thread, not mountd's: this task still runs meanwhile.
            with trio.fail_after(10):
                while not factory.entered.is_set():
                    await trio.sleep(0.01)
            await trio.sleep(0.1)
            assert paths == [] and factory.calls == 1
            factory.gate.set()
        assert sorted(Path(p).read_bytes() for p in paths) == sorted(o.data for o in objs)
        assert factory.calls == 1 and len(factory.made) == 1 and factory.gets() == 3
        assert threading.get_ident() not in factory.threads
        [(url, row)] = cache.backend_counters().items()
        assert url == objs[0].location.url and row["requests"] == {"GET": 3}
        assert row["bytes_read"] == sum(o.size for o in objs)
        assert (row["retries"], row["failures"], row["reads"]) == (0, {}, None)


async def test_a_failed_opening_fails_its_fill_and_the_next_fill_opens_again(
        tmp_path: Path, source: Source):
    obj = source.add("x", os.urandom(20_000))
    factory = GatedBackends(failures=1)
    factory.gate.set()
    async with running(config(tmp_path / "c"), factory) as cache:
        try:
            await cache.ensure(obj.hash, obj.size, obj.location, "ds")
        except QuiverError as exc:
            assert "cannot open (test)" in str(exc)
        else:
            raise AssertionError("the first fill should fail with the opening's error")
        path = await cache.ensure(obj.hash, obj.size, obj.location, "ds")
        assert Path(path).read_bytes() == obj.data
        assert factory.calls == 2 and len(factory.made) == 1


async def test_warming_opens_the_backend_before_any_miss(tmp_path: Path, source: Source):
    obj = source.add("y", os.urandom(20_000))
    factory = GatedBackends(failures=1)
    factory.gate.set()
    async with running(config(tmp_path / "c"), factory) as cache:
        cache.warm_backends([obj.location.url])  # fails: left for the first fill
        await wait_until(lambda: factory.calls == 1, what="the first opening")
        cache.warm_backends([obj.location.url])
        await wait_until(lambda: len(factory.made) == 1, what="the backend to open")
        assert factory.gets() == 0
        await cache.ensure(obj.hash, obj.size, obj.location, "ds")
        assert factory.calls == 2 and factory.gets() == 1


async def test_with_fill_processes_warming_leaves_the_caches_own_backend_unopened(
        tmp_path: Path, source: Source):
    """Fill processes open their own backends; the cache's would cost mountd's main process
    an SDK's import and client (~1 s of CPU for S3) that no fill uses."""
    obj = source.add("p", os.urandom(20_000))
    factory = Backends()
    async with pooled(config(tmp_path / "c"), factory=factory) as (cache, _):
        cache.warm_backends([obj.location.url])
        path = await cache.ensure(obj.hash, obj.size, obj.location, "ds")
        assert Path(path).read_bytes() == obj.data
        await trio.sleep(0.1)  # a warm-up started in the background has had its turn
        assert factory.made == []
        [(url, row)] = cache.backend_counters().items()  # the fill process's GET, counted
        assert url == obj.location.url and row["bytes_read"] == obj.size


async def test_register_warms_the_dataset_sources(tmp_path: Path, source: Source):
    obj = source.add("z", os.urandom(1000))
    factory = Backends()
    async with running(config(tmp_path / "c"), factory) as cache, trio.open_nursery() as nursery:
        server = Server(cache, tmp_path / "c")
        left, right = trio.socket.socketpair()
        nursery.start_soon(server.handle_connection, trio.SocketStream(right))
        async with trio.SocketStream(left) as stream:
            args = {"dataset": "warm", "sources": [obj.location.url]}
            await stream.send_all(protocol.encode_frame({"id": 1, "op": "register",
                                                         "args": args}))
            with trio.fail_after(5):
                answer = await protocol.ExactReader(stream).read_frame()
            assert answer["ok"], answer
            # The factory records a backend in the opening thread, before the cache keeps
            # it: wait for what stats shows (waiting for the factory alone raced, under load).
            await wait_until(lambda: server.stats_snapshot()["sources"], what="the source's backend")
            assert len(factory.made) == 1
            assert factory.made[0].url == obj.location.url and factory.gets() == 0
            sources = server.stats_snapshot()["sources"]
            assert sources == {obj.location.url: {"requests": {}, "bytes_read": 0, "retries": 0,
                                                  "failures": {}, "reads": None}}


async def _append(out: list[str], call) -> None:
    out.append(await call)
