"""Fills from bytes a client supplied (mountd/store/supplied.py) and leases: co-operative
single-flight across users without mountd's authority (docs/operations.md "Security")."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import trio

from mountd.store.cache import Cache, SuppliedBytes
from quiverfs.base.errors import CorruptObject
from tests.mountd.conftest import Backends, Source, config, running, store_files, wait_until


def supplied(data: bytes, holder: object | None = None, offset: int = 0) -> SuppliedBytes:
    """A memfd holding ``data`` at ``offset``, as a mount would supply it."""
    fd = os.memfd_create("test-supply", os.MFD_CLOEXEC)
    os.pwrite(fd, b"\0" * offset + data, 0)
    return SuppliedBytes(fd, offset, holder)


async def test_supplied_bytes_are_verified_stored_and_never_fetched(
    tmp_path: Path, source: Source, backends: Backends
):
    obj = source.add("a.bin", os.urandom(5000))
    async with running(config(tmp_path / "c"), backends) as cache:
        bytes_in = supplied(obj.data, offset=123)
        path = await cache.ensure_supplied(obj.hash, obj.size, obj.location, bytes_in, "ds")
        assert Path(path).read_bytes() == obj.data
        assert bytes_in.fd == -1  # the fill closed what it adopted
        assert backends.gets() == 0  # mountd read nothing itself
        # A second supply is a hit: its descriptor is closed unused.
        again = supplied(obj.data)
        assert await cache.ensure_supplied(obj.hash, obj.size, obj.location, again, "ds") == path
        assert again.fd == -1
        assert cache.counters.snapshot()["datasets"]["ds"]["hits"] == 1


async def test_forged_bytes_are_refused_and_do_not_poison(
    tmp_path: Path, source: Source, backends: Backends
):
    obj = source.add("a.bin", os.urandom(5000))
    async with running(config(tmp_path / "c"), backends) as cache:
        with pytest.raises(CorruptObject):
            await cache.ensure_supplied(obj.hash, obj.size, obj.location,
                                        supplied(os.urandom(5000)))
        with pytest.raises(CorruptObject):  # right bytes, too few of them
            await cache.ensure_supplied(obj.hash, obj.size, obj.location, supplied(obj.data[:-1]))
        assert store_files(cache.config.cache_dir) == {}
        assert not cache.contains(obj.hash)
        path = await cache.ensure(obj.hash, obj.size, obj.location)
        assert Path(path).read_bytes() == obj.data


async def test_a_lease_makes_others_wait_and_its_release_hands_it_on(
    tmp_path: Path, source: Source, backends: Backends
):
    obj = source.add("a.bin", os.urandom(5000))
    a, b = object(), object()
    async with running(config(tmp_path / "c"), backends) as cache:
        assert await cache.lease(obj.hash, obj.size, "ds", holder=a) is None
        assert await cache.lease(obj.hash, obj.size, "ds", holder=a) is None  # still a's
        answers: list = []

        async def b_asks() -> None:
            answers.append(await cache.lease(obj.hash, obj.size, "ds", holder=b))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(b_asks)
            await trio.sleep(0.05)
            assert answers == []  # b waits for a's supply
            assert cache.release(a, [obj.hash]) == 1
        assert answers == [None]  # now b is asked to supply
        # b supplies; a mountd-authority ensure that joined meanwhile gets the same path
        path = await cache.ensure_supplied(obj.hash, obj.size, obj.location,
                                           supplied(obj.data, holder=b))
        assert Path(path).read_bytes() == obj.data
        assert backends.gets() == 0


async def test_another_users_failure_is_not_passed_on(
    tmp_path: Path, source: Source, backends: Backends
):
    obj = source.add("a.bin", os.urandom(5000))
    a = object()
    async with running(config(tmp_path / "c"), backends) as cache:
        assert await cache.lease(obj.hash, obj.size, "ds", holder=a) is None
        results: dict = {}

        async def mountd_reader() -> None:
            results["mountd"] = await cache.ensure(obj.hash, obj.size, obj.location, "ds")

        async def other_user() -> None:
            results["b"] = await cache.ensure_supplied(
                obj.hash, obj.size, obj.location, supplied(obj.data), "ds")

        async with trio.open_nursery() as nursery:
            nursery.start_soon(mountd_reader)
            nursery.start_soon(other_user)
            await trio.sleep(0.05)
            assert results == {}  # both wait for a's lease
            with pytest.raises(CorruptObject):  # a supplies garbage: a's own error
                await cache.ensure_supplied(obj.hash, obj.size, obj.location,
                                            supplied(os.urandom(5000), holder=a))
        # Neither waiter saw a's failure; the content came from one of their own fills.
        assert Path(results["mountd"]).read_bytes() == obj.data
        assert results["b"] == results["mountd"]
        assert backends.gets() <= 1


async def test_a_lease_expires_and_close_gives_leases_up(
    tmp_path: Path, source: Source, backends: Backends, monkeypatch
):
    from mountd.store import misses

    monkeypatch.setattr(misses, "LEASE_SECONDS", 0.1)
    obj = source.add("a.bin", os.urandom(100))
    async with running(config(tmp_path / "c"), backends) as cache:
        assert await cache.lease(obj.hash, obj.size, None, holder=object()) is None
        # Nobody supplies: after the lease expires, a mountd-authority ensure fills it.
        path = await cache.ensure(obj.hash, obj.size, obj.location)
        assert Path(path).read_bytes() == obj.data
        other = source.add("b.bin", os.urandom(100))
        assert await cache.lease(other.hash, other.size, None, holder=object()) is None
    # aclose gave the unsupplied lease up; the index was closed clean.
    reopened = Cache(config(tmp_path / "c"), backends)
    await reopened.open()
    assert reopened.recovery is not None and reopened.recovery.reconciled is False
    assert reopened.recovery.entries == 1
    await reopened.aclose()


async def test_supplied_large_object_streams_in_chunks(tmp_path: Path, source: Source,
                                                      backends: Backends):
    obj = source.add("big.bin", os.urandom(3 * 65536 + 17))
    async with running(config(tmp_path / "c", chunk_size=65536), backends) as cache:
        path = await cache.ensure_supplied(obj.hash, obj.size, obj.location,
                                           supplied(obj.data, offset=4096))
        assert Path(path).read_bytes() == obj.data
        await wait_until(lambda: cache.counters.fills_in_flight == 0)
        assert backends.gets() == 0
