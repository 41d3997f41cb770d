"""Chunk fills (issue 14): a miss of a packed file fetches the wanted members of its chunk
with one ranged GET from a real S3 emulator (moto on loopback), each verified and stored by
its own hash; loose datasets and unknown datasets keep one GET per file."""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import trio

from mountd.coop.service import CoopService
from mountd.store import layout
from mountd.store.cache import Cache
from quiverfs.base.backends import Backend, BackendOptions, open_backend
from quiverfs.base.backends.base import Location
from quiverfs.base.errors import CorruptObject
from quiverfs.testing.emulators import (
    MOTO_ACCESS_KEY,
    MOTO_REGION,
    MOTO_SECRET_KEY,
    MotoEmulator,
    run_moto,
)
from quiverfs.testing.packed import PackedFile, loose_digest, pack, packed_digest
from tests.mountd.conftest import config

SIZE = 16 * 1024
MEMBERS = 32


@pytest.fixture(scope="module")
def moto() -> Iterator[MotoEmulator]:
    with run_moto() as emulator:
        yield emulator


@pytest.fixture(autouse=True)
def moto_credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    """boto3 takes credentials only from its chain: moto's dummies for each test."""
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", MOTO_ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", MOTO_SECRET_KEY)
    monkeypatch.setenv("AWS_DEFAULT_REGION", MOTO_REGION)


class S3Backends:
    """Backend factory onto the emulator; keeps what it made to count their requests."""

    def __init__(self, emulator: MotoEmulator) -> None:
        self.emulator = emulator
        self.made: list[Backend] = []

    def __call__(self, url: str) -> Backend:
        backend = open_backend(url, BackendOptions(concurrency=8), self.emulator.settings())
        self.made.append(backend)
        return backend

    def gets(self) -> int:
        return sum(b.counters.requests["GET"] for b in self.made)

    def bytes_read(self) -> int:
        return sum(b.counters.bytes_read for b in self.made)


class World:
    """A bucket holding one dataset both ways, its digests, and an in-process cache with
    mountd's session layer (which names chunks' members to the cache)."""

    def __init__(self, cache: Cache, coop: CoopService, backends: S3Backends,
                 files: list[PackedFile], url: str, dataset: str) -> None:
        self.cache, self.coop, self.backends = cache, coop, backends
        self.files, self.url, self.dataset = files, url, dataset

    def location(self, f: PackedFile) -> Location:
        return Location(self.url, f.key, f.offset, len(f.data))

    async def ensure(self, f: PackedFile, dataset: str | None = "packed") -> str:
        ds = self.dataset if dataset == "packed" else dataset
        return await self.cache.ensure(f.hash, len(f.data), self.location(f), ds)

    def stored(self, f: PackedFile) -> bytes | None:
        path = layout.store_path(self.cache.config.cache_dir, f.hash)
        return path.read_bytes() if path.exists() else None


def _files(n: int, tag: str) -> list[tuple[str, bytes]]:
    return [(f"{tag}/{i:04d}.bin", os.urandom(SIZE)) for i in range(n)]


def _bucket(emulator: MotoEmulator) -> tuple[str, str]:
    bucket = f"chunks-{uuid.uuid4().hex[:12]}"
    emulator.create_bucket(bucket)
    return bucket, emulator.root_url(bucket, "data")


@asynccontextmanager
async def world(tmp_path: Path, moto: MotoEmulator, *, members: int = MEMBERS,
                per_chunk: int = MEMBERS, alter: int | None = None, **cfg) -> AsyncIterator[World]:
    """``members`` files of 16 KiB packed ``per_chunk`` to a tar chunk in a fresh bucket;
    ``alter``: that member's bytes are changed in the bucket after the digest was built."""
    bucket, url = _bucket(moto)
    objects, placed = pack(_files(members, "train"), per_chunk)
    dataset = packed_digest(tmp_path / "packed.qd", url, placed)
    if alter is not None:
        victim = placed[alter]
        raw = bytearray(objects[victim.key])
        raw[victim.offset + 100] ^= 0xFF
        objects[victim.key] = bytes(raw)
    moto.upload_many(bucket, {f"data/{k}": v for k, v in objects.items()})
    backends = S3Backends(moto)
    async with serving(tmp_path, backends, dataset, tmp_path / "packed.qd", **cfg) as (cache, coop):
        yield World(cache, coop, backends, placed, url, dataset)


@asynccontextmanager
async def serving(tmp_path: Path, backends: S3Backends, dataset: str, digest: Path,
                  **cfg) -> AsyncIterator[tuple[Cache, CoopService]]:
    """An in-process cache with mountd's session layer, ``dataset`` registered with its
    ``digest`` and its view loaded (which names chunks' members to the cache)."""
    cache = Cache(config(tmp_path / "cache", **cfg), backends)
    await cache.open()
    coop = CoopService(cache)
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(cache.run)
            coop.dataset_registered(dataset, str(digest))
            await coop.ensure_view(dataset)
            try:
                yield cache, coop
            finally:
                await cache.aclose()
    finally:
        coop.close()
        await cache.aclose()


async def test_a_miss_of_one_member_fetches_its_whole_chunk_with_one_get(tmp_path: Path, moto):
    async with world(tmp_path, moto) as w:
        target = w.files[7]
        path = await w.ensure(target)
        assert Path(path).read_bytes() == target.data
        assert w.backends.gets() == 1
        for f in w.files:
            assert w.stored(f) == f.data, f.path
        total = w.cache.counters.total
        assert total.remote_requests["GET"] == 1
        first, last = w.files[0], w.files[-1]
        assert total.remote_bytes == last.offset + SIZE - first.offset  # one span, headers too
        assert (total.chunk_fills, total.chunk_members) == (1, MEMBERS)
        assert total.bytes_from_remote == MEMBERS * SIZE
        assert w.cache.entries == MEMBERS and w.cache.used == MEMBERS * SIZE
        assert w.cache.reserved == 0 and w.cache.counters.fills_in_flight == 0
        # every sibling is now a hit, no more GETs
        for f in w.files:
            await w.ensure(f)
        assert w.backends.gets() == 1
        assert total.hits == MEMBERS and total.misses == 1
        per = w.cache.counters.dataset(w.dataset)
        assert (per.chunk_fills, per.chunk_members) == (1, MEMBERS)


async def test_concurrent_misses_of_eight_siblings_make_one_get(tmp_path: Path, moto):
    async with world(tmp_path, moto) as w:
        picked = w.files[3:27:3]
        assert len(picked) == 8
        paths: dict[str, str] = {}

        async def read(f: PackedFile) -> None:
            paths[f.path] = await w.ensure(f)

        async with trio.open_nursery() as nursery:
            for f in picked:
                nursery.start_soon(read, f)
        assert w.backends.gets() == 1
        for f in picked:
            assert Path(paths[f.path]).read_bytes() == f.data
        assert w.cache.counters.total.misses == 8
        assert w.cache.counters.total.chunk_fills == 1


async def test_a_member_altered_in_the_bucket_fails_alone(tmp_path: Path, moto):
    async with world(tmp_path, moto, alter=5) as w:
        bad = w.files[5]
        with pytest.raises(CorruptObject):
            await w.ensure(bad)
        assert w.backends.gets() == 1
        assert w.stored(bad) is None
        for f in w.files:
            if f is not bad:
                assert w.stored(f) == f.data, f.path
        total = w.cache.counters.total
        assert total.verify_failures == 1
        assert (total.chunk_fills, total.chunk_members) == (1, MEMBERS - 1)
        assert w.cache.entries == MEMBERS - 1 and w.cache.reserved == 0
        # a waiter on a neighbour gets its bytes, the bad one fails again (its own GET)
        assert Path(await w.ensure(w.files[4])).read_bytes() == w.files[4].data
        with pytest.raises(CorruptObject):
            await w.ensure(bad)
        assert w.backends.gets() == 2
        assert w.stored(bad) is None


async def test_cached_members_are_not_fetched_again_and_the_span_shrinks(tmp_path: Path, moto):
    async with world(tmp_path, moto) as w:
        # Fill some members one GET each first (no chunk lookup): 0..9 and 31 at the ends,
        # 15..16 in the middle.
        w.cache.set_chunk_members(None)
        early = [*w.files[:10], w.files[15], w.files[16], w.files[31]]
        for f in early:
            await w.ensure(f)
        assert w.backends.gets() == len(early)
        bytes_before = w.cache.counters.total.remote_bytes
        w.cache.set_chunk_members(w.coop.chunk_members)

        await w.ensure(w.files[20])
        assert w.backends.gets() == len(early) + 1
        total = w.cache.counters.total
        span = total.remote_bytes - bytes_before
        # members 17..30: the cached ends are left out, and so are 10..14 behind the cached
        # 15 and 16: crossing 32 KiB to bring 16 KiB is not worth it (span.py crossable)
        assert span == w.files[30].offset + SIZE - w.files[17].offset
        assert (total.chunk_fills, total.chunk_members) == (1, 14)
        for f in [*early, *w.files[17:31]]:
            assert w.stored(f) == f.data, f.path
        assert all(w.stored(f) is None for f in w.files[10:15])
        assert w.cache.entries == len(early) + 14


async def test_a_large_gap_of_cached_members_is_not_crossed(tmp_path: Path, moto):
    async with world(tmp_path, moto, span_max_gap=4 * SIZE) as w:
        w.cache.set_chunk_members(None)
        for f in w.files[10:20]:  # ten cached members between 9 and 20: more than the gap
            await w.ensure(f)
        w.cache.set_chunk_members(w.coop.chunk_members)
        before = w.backends.gets()
        await w.ensure(w.files[5])
        assert w.backends.gets() == before + 1
        assert all(w.stored(f) == f.data for f in w.files[:20])
        assert all(w.stored(f) is None for f in w.files[20:])
        assert w.cache.counters.total.chunk_members == 10


async def test_the_span_is_capped(tmp_path: Path, moto):
    async with world(tmp_path, moto, span_max_bytes=8 * SIZE) as w:
        await w.ensure(w.files[16])
        assert w.backends.gets() == 1
        stored = [f for f in w.files if w.stored(f) is not None]
        # eight members' bytes minus their headers' room: at most 7 neighbours join
        assert w.files[16] in stored and 2 <= len(stored) <= 8
        assert w.cache.counters.total.remote_bytes <= 8 * SIZE


async def test_a_small_cache_with_many_requests_allowed_still_fetches_whole_chunks(tmp_path: Path, moto):
    """The spans' room is a quarter of the cache for the spans in flight, not a share per
    request slot: with 64 slots, a cache of five chunks' bytes used to give each span
    cache / 256 (10 KiB: no span at all), and a 20% cache fetched 2.2 members a GET
    (scripts/bench/peers.py (b), 2026-12-01)."""
    async with world(tmp_path, moto, size=5 * MEMBERS * SIZE, remote_concurrency=64) as w:
        await w.ensure(w.files[9])
        assert w.backends.gets() == 1
        assert all(w.stored(f) == f.data for f in w.files)
        assert (w.cache.counters.total.chunk_fills, w.cache.counters.total.chunk_members) == (1, MEMBERS)
        assert w.cache.span_bytes_in_flight == 0


async def test_spans_in_flight_share_a_quarter_of_the_cache(tmp_path: Path, moto):
    """Two misses in two chunks at once: the first span takes the quarter of the cache (one
    chunk's worth), the second gets only the floor (cache / 4 / 64 < one member: fetched
    alone), so the spans in flight never cover more than a quarter plus the floors."""
    chunk = MEMBERS * (SIZE + 512)  # a member and its tar header
    async with world(tmp_path, moto, members=2 * MEMBERS, size=4 * chunk + 4096, remote_concurrency=64) as w:
        first, second = w.files[5], w.files[MEMBERS + 5]
        async with trio.open_nursery() as nursery:
            nursery.start_soon(w.ensure, first)
            with trio.fail_after(5):  # until its span is open (its GET takes milliseconds)
                while w.cache.span_bytes_in_flight == 0:
                    await trio.sleep(0)
            assert w.cache.span_bytes_in_flight > 3 * chunk // 4
            nursery.start_soon(w.ensure, second)
        assert w.stored(first) == first.data and w.stored(second) == second.data
        assert w.backends.gets() == 2
        total = w.cache.counters.total
        assert (total.chunk_fills, total.chunk_members) == (1, MEMBERS)
        assert total.remote_bytes == chunk - 512 + SIZE  # one chunk's span + the second miss alone
        assert w.cache.span_bytes_in_flight == 0


async def test_claims_preloads_and_prefetches_fetch_chunks(tmp_path: Path, moto):
    async with world(tmp_path, moto, members=64) as w:
        first, second = w.files[:32], w.files[32:]
        items = [(f.hash, len(f.data), w.location(f)) for f in first[::4]]
        assert w.cache.fetch_now(items, w.dataset) == len(items)  # a claim's misses, preloads
        with trio.fail_after(10):
            while not all(w.cache.contains(f.hash) for f in first):
                await trio.sleep(0.01)
        assert w.backends.gets() == 1
        items = [(f.hash, len(f.data), w.location(f)) for f in second[::4]]
        assert w.cache.prefetch(items, w.dataset) == len(items)
        with trio.fail_after(10):
            while not all(w.cache.contains(f.hash) for f in second):
                await trio.sleep(0.01)
        assert w.backends.gets() == 2
        assert w.cache.counters.total.chunk_members == 64


async def test_without_a_dataset_a_packed_member_is_fetched_alone(tmp_path: Path, moto):
    async with world(tmp_path, moto) as w:
        await w.ensure(w.files[3], dataset=None)
        await w.ensure(w.files[4], dataset="not-registered")
        assert w.backends.gets() == 2
        assert w.cache.counters.total.remote_bytes == 2 * SIZE
        assert w.cache.counters.total.chunk_fills == 0
        assert w.cache.entries == 2


async def test_with_max_span_zero_every_member_is_fetched_alone(tmp_path: Path, moto):
    async with world(tmp_path, moto, span_max_bytes=0) as w:
        for f in w.files[:4]:
            await w.ensure(f)
        assert w.backends.gets() == 4 and w.cache.entries == 4


async def test_a_loose_dataset_keeps_one_get_per_file(tmp_path: Path, moto):
    bucket, url = _bucket(moto)
    files = _files(8, "loose")
    moto.upload_many(bucket, {f"data/{p}": d for p, d in files})
    dataset = loose_digest(tmp_path / "loose.qd", url, files)
    backends = S3Backends(moto)
    async with serving(tmp_path, backends, dataset, tmp_path / "loose.qd") as (cache, coop):
        view = await coop.ensure_view(dataset)
        assert view.packing is None
        for cid in range(view.count):
            h, size, loc = view.item(cid)
            assert loc.offset == 0
            await cache.ensure(h, size, loc, dataset)
        assert backends.gets() == 8
        assert cache.counters.total.chunk_fills == 0
        assert cache.entries == 8


async def test_a_chunk_fill_extends_only_while_protection_has_room(tmp_path: Path, moto):
    """Members a chunk fill brings beyond the miss are fetched ahead: protected until read,
    and only while the protection share has room; past it the GET covers the miss alone
    (mountd/store/holds.py: new prefetches wait)."""
    async with world(tmp_path, moto) as w:
        holds = w.cache.holds
        holds.protect_bytes = 8 * SIZE
        holds.protect(b"\xee" * 32, 8 * SIZE, "someone")  # the share is full
        target = w.files[7]
        assert Path(await w.ensure(target)).read_bytes() == target.data
        assert w.backends.gets() == 1 and w.cache.entries == 1
        assert w.cache.counters.total.remote_bytes == SIZE  # the miss alone
        assert not holds.protected(target.hash) and target.hash in holds  # read: held only
        assert w.cache.release_protection("someone") == 1  # room again
        other = w.files[20]
        assert Path(await w.ensure(other)).read_bytes() == other.data
        assert w.backends.gets() == 2
        # the members past the cached 7 came with it (crossing 7 to reach 0..6 would cost
        # as much as it brings: span.py crossable)
        brought = [f for f in w.files[8:] if f is not other]
        assert all(w.stored(f) == f.data for f in brought)
        assert all(w.stored(f) is None for f in w.files[:7])
        assert all(holds.protected(f.hash) for f in brought)  # kept until read
        assert holds.protected_bytes == len(brought) * SIZE


async def test_a_loading_chunks_members_join_its_spans_without_protection_room(tmp_path: Path, moto):
    """A chunk preload (``fetch_now(protect=False)``: the loading chunk's pin keeps what
    lands) brings the members the chunk will pin however full the protection share is; they
    are not protected (the pin keeps them). Without it a packed dataset's chunk loads in a
    20% cache made one GET per file (peers.py (b), 2026-12-01)."""
    async with world(tmp_path, moto, members=64) as w:
        loading, other = w.files[:32], w.files[32:]
        w.cache.expect_pins((f.hash, len(f.data)) for f in loading)
        holds = w.cache.holds
        holds.protect_bytes = 8 * SIZE
        holds.protect(b"\xee" * 32, 8 * SIZE, "someone")  # the share is full
        target = loading[11]
        assert w.cache.fetch_now([(target.hash, SIZE, w.location(target))], w.dataset, protect=False) == 1
        with trio.fail_after(10):
            while not all(w.cache.contains(f.hash) for f in loading):
                await trio.sleep(0.01)
        assert w.backends.gets() == 1
        assert all(w.stored(f) == f.data for f in loading)
        assert not any(holds.protected(f.hash) for f in loading)
        assert all(w.stored(f) is None for f in other)  # another object: not this GET's
        # a member of a chunk that is not loading still needs room: fetched alone
        await w.ensure(other[3])
        assert w.backends.gets() == 2 and sum(w.stored(f) is not None for f in other) == 1


async def test_packed_chunks_large_for_the_cache_are_warned_about(tmp_path: Path, moto):
    (tmp_path / "small").mkdir()
    (tmp_path / "large").mkdir()
    async with world(tmp_path / "small", moto, size=4 << 20) as w:  # 512 KiB chunks: 12%
        assert list(w.coop.warnings) == [w.dataset]
        assert "12% of the cache" in w.coop.warnings[w.dataset]
    async with world(tmp_path / "large", moto, size=64 << 20) as w:  # under 1%: fine
        assert w.coop.warnings == {}
