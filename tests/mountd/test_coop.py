"""Substitutable, co-operative reads over the real RPC: an in-process mountd (real Cache,
real socket, real tick loop) serving a file:// dataset described by a real digest."""

from __future__ import annotations

import errno
from collections import Counter
from pathlib import Path

import pytest
import trio

from mountd.coop.chunks import ChunkState
from mountd.coop.plans import Mode
from mountd.daemon import DaemonConfig
from mountd.errors import (
    InvalidRequest,
    ProtocolError,
    SessionConflict,
    StaleEpoch,
    UnknownDataset,
    UnknownSession,
)
from mountd.store.cache import CacheConfig
from quiverfs.base.backends.base import Location
from quiverfs.base.errors import UsageError
from tests.mountd.conftest import Env, mountd_env, wait_until

#: Seconds to wait for a whole mountd's background work (fills, ticks) under load.
WAIT = 20.0


async def read_claimed(env: Env, ids: list[int]) -> None:
    """What a reader does with a claim's ids: open each from the store, falling back to
    ``ensure`` on a miss, and report the store reads as hits, as the direct loader does
    (LRU recency, hit counts, protections ended)."""
    hits, nbytes = [], 0
    for cid in ids:
        h, s, loc = env.view.item(cid)
        if env.in_store(cid):
            hits.append(h)
            nbytes += s
        else:
            await env.client.ensure(h, s, loc, env.dataset)
    if hits:
        await env.client.hits(env.dataset, hits, nbytes)


async def read_epoch(env: Env, job: str, ranks: int, n: int, epoch: int,
                     read: bool = False) -> list[list[int]]:
    """Claim round-robin over ``ranks`` until every rank is at the end; per-rank ids."""
    given: list[list[int]] = [[] for _ in range(ranks)]
    done = [False] * ranks
    while not all(done):
        for rank in range(ranks):
            if done[rank]:
                continue
            claim = await env.client.claim(env.dataset, job, rank, n, epoch=epoch)
            assert claim["epoch"] == epoch
            ids = claim["hits"] + claim["fetch"]
            if not ids:
                done[rank] = True
            given[rank].extend(ids)
            if read:
                await read_claimed(env, ids)
    return given


async def test_view_matches_the_digest_order(tmp_path: Path) -> None:
    async with mountd_env(tmp_path, files=30) as env:
        info = await env.client.session_open(env.dataset, "j")
        assert info["files"] == 30 and info["mode"] == "full"
        view = env.view
        for cid, (name, body) in enumerate(env.files):
            h, size, loc = view.item(cid)
            assert (size, loc.key, loc.offset) == (len(body), name, 0)
            assert view.ids_of(h) == [cid]
        assert view.ids_of(b"\0" * 32) == []


@pytest.mark.parametrize("ranks", [1, 4])
async def test_exactly_once_per_epoch_over_several_epochs(tmp_path: Path, ranks: int) -> None:
    async with mountd_env(tmp_path, files=203) as env:
        for rank in range(ranks):
            info = await env.client.session_open(env.dataset, "job", rank=rank, world_size=ranks)
        quota = info["quota"]
        assert quota == -(-203 // ranks)
        for epoch in range(3):
            given = await read_epoch(env, "job", ranks, 7, epoch)
            everything = [cid for ids in given for cid in ids]
            assert Counter(everything) == Counter(range(203)), f"epoch {epoch}"
            assert all(len(ids) <= quota for ids in given)
        with pytest.raises(StaleEpoch) as info:
            await env.client.claim(env.dataset, "job", 0, 1, epoch=0)
        assert info.value.errno == errno.ESTALE
        for rank in range(ranks):
            await env.client.session_close(env.dataset, "job", rank, seconds=1.5)


async def test_claims_are_hits_while_cached_unread_files_remain(tmp_path: Path) -> None:
    async with mountd_env(tmp_path, files=400) as env:
        # Load the view (session_open waits for it), then cache 10% through the real fill path.
        await env.client.session_open(env.dataset, "warm")
        cached = list(range(0, 400, 10))
        for cid in cached:
            h, s, loc = env.view.item(cid)
            await env.client.ensure(h, s, loc, env.dataset)
        await env.client.session_close(env.dataset, "warm", 0)
        await env.client.session_open(env.dataset, "job", seed=3)
        hits = total = 0
        while total < 36:  # 40 cached: at least n=4 cached unread remain for every claim
            claim = await env.client.claim(env.dataset, "job", 0, 4)
            hits += len(claim["hits"])
            total += len(claim["hits"]) + len(claim["fetch"])
        assert hits / total >= 0.95
        # The remaining epoch is mostly misses, and every claimed miss gets fetched.
        claimed_misses: list[int] = []
        while True:
            claim = await env.client.claim(env.dataset, "job", 0, 16)
            if not claim["hits"] and not claim["fetch"]:
                break
            claimed_misses.extend(claim["fetch"])
        assert len(claimed_misses) >= 300
        await wait_until(lambda: all(env.in_store(c) for c in claimed_misses), timeout=WAIT,
                         what="claimed misses")
        stats = await env.client.stats()
        assert stats["counters"]["datasets"][env.dataset]["prefetches"] >= 300


async def test_hits_come_from_what_is_cached(tmp_path: Path) -> None:
    async with mountd_env(tmp_path, files=100) as env:
        await env.client.session_open(env.dataset, "warm")
        cached = set(range(0, 100, 10))
        for cid in cached:
            h, s, loc = env.view.item(cid)
            await env.client.ensure(h, s, loc, env.dataset)
        await env.client.session_open(env.dataset, "job")
        claim = await env.client.claim(env.dataset, "job", 0, 10)
        assert set(claim["hits"]) == cached and claim["fetch"] == []


async def test_session_errors_carry_errno(tmp_path: Path) -> None:
    async with mountd_env(tmp_path, files=20) as env:
        await env.client.session_open(env.dataset, "job", rank=0, world_size=2)
        cases = [
            (env.client.claim(env.dataset, "nobody", 0, 1), UnknownSession, errno.ENOENT),
            (env.client.claim(env.dataset, "job", 0, 0), InvalidRequest, errno.EINVAL),
            (env.client.session_open(env.dataset, "job", rank=0, world_size=3), SessionConflict,
             errno.EBUSY),
            (env.client.session_open("f" * 64, "job"), UnknownDataset, errno.ENOENT),
            (env.client.call("claim", {"dataset": env.dataset, "job": "job", "rank": True, "n": 1}),
             InvalidRequest, errno.EINVAL),
        ]
        for call, cls, code in cases:
            with pytest.raises(cls) as info:
                await call
            assert info.value.errno == code
        with pytest.raises(ProtocolError):
            await env.client.call("claim", {"dataset": env.dataset, "bogus": 1})
        # ... and the good session is undisturbed
        claim = await env.client.claim(env.dataset, "job", 0, 5)
        assert len(claim["hits"] + claim["fetch"]) == 5
        await env.client.report_batch(env.dataset, "job", 0, 0.25)
        await env.client.report_epoch(env.dataset, "job", 0, 0, 3.0)
        timings = await env.client.timings(env.dataset, "job")
        assert timings["batches"] == 1 and timings["epochs"] == [[0, 0, 3.0]]


async def test_lru_mode_can_be_forced(tmp_path: Path) -> None:
    async with mountd_env(tmp_path, files=20, mode="lru") as env:
        info = await env.client.session_open(env.dataset, "job")
        assert info["mode"] == Mode.LRU


async def test_a_session_that_does_not_claim_yet_loads_one_chunk(tmp_path: Path) -> None:
    # Issue 36: a job that opened its session but had not claimed yet (a model still being
    # built) made mountd load and evict chunk after chunk: ~50 loads before its first claim
    # on 300 files. Now its first chunk loads, and nothing else until it reads.
    async with mountd_env(tmp_path, files=300, size=1000, cache_size=100_000) as env:
        info = await env.client.session_open(env.dataset, "job", seed=1)
        assert info["mode"] == "chunked"
        manager = env.server.coop.registry.dataset(env.dataset).manager
        await wait_until(lambda: manager.newest is not None, WAIT, "the first chunk loaded")
        first = manager.newest
        await trio.sleep(2.0)  # mountd ticks every second, and at every fill
        assert manager.newest == first and manager.loading is None
        assert manager.generations == 1 and manager.resident() == [first]
        claim = await env.client.claim(env.dataset, "job", 0, 10, epoch=0)
        assert claim["chunk"] == first and len(claim["hits"]) == 10


async def test_chunked_dataset_keeps_at_most_two_chunks_resident(tmp_path: Path) -> None:
    # 300 files of 1000 B; a 100 kB cache: budget 80 kB → chunks of ~30 kB (10 chunks).
    async with mountd_env(tmp_path, files=300, size=1000, cache_size=100_000) as env:
        info = await env.client.session_open(env.dataset, "job", seed=1)
        assert info["mode"] == "chunked"
        assert env.server.coop is not None
        state = env.server.coop.registry.dataset(env.dataset)
        manager = state.manager
        assert manager is not None
        plan = state.plan
        cache = env.server.cache
        max_resident = 0

        def held_chunks() -> list[int]:
            """Chunks holding a slot: resident (loaded or marked) or loading."""
            loading = [] if manager.loading is None else [manager.loading]
            return manager.resident() + loading

        def others_in_store() -> int:
            """Bytes in the store of chunks that hold no slot: files an evicted chunk left
            behind, unpinned (the room the held chunks leave keeps them until displaced;
            counting "most of a chunk's files" called two half-kept chunks resident)."""
            held = set(held_chunks())
            return 1000 * sum(1 for c in range(300)
                              if env.in_store(c) and plan.chunk_of(c) not in held)

        for epoch in range(2):
            while True:
                claim = await env.client.claim(env.dataset, "job", 0, 10, epoch=epoch)
                ids = claim["hits"] + claim["fetch"]
                if not ids:
                    break
                await read_claimed(env, ids)
                await trio.sleep(0.02)  # let the tick loop preload and evict
                max_resident = max(max_resident, len(manager.resident()))
                held = held_chunks()
                assert len(held) <= 3  # two resident + the loading one
                held_bytes = sum(plan.size_of(c) for c in held) * 1000
                # The protection cap leaves out every chunk that holds a slot, landed or
                # not: a loading chunk's room is not prefetches' to take.
                # (files kept across epochs are not pinned: the cap does not count them)
                assert cache.index.pinned_bytes + cache._expected_bytes == held_bytes
                assert cache.holds.protect_bytes == int((100_000 - held_bytes) * 0.5)
        assert max_resident <= 2
        evictions = [e for e in env.server.coop.evictions if e[0] == env.dataset]
        assert len({chunk for _, chunk, _, _ in evictions}) >= 3
        assert sum(files for _, _, files, _ in evictions) > 0

        usage = await env.client.usage()
        assert usage["used_bytes"] <= 100_000
        # At rest, what evicted chunks left in the store fits the room the held ones leave
        # (checked on disk, so only once fills and unlinks have settled).
        await wait_until(lambda: manager.loading is None and len(held_chunks()) <= 2 and (
            others_in_store() <= 100_000 - 1000 * sum(map(plan.size_of, held_chunks()))),
            WAIT, "at most two chunks resident, the rest within the room they leave")


async def test_a_chunked_dataset_keeps_the_budget_its_chunks_leave_across_epochs(tmp_path: Path) -> None:
    """300 files of 1000 B, budget 80 kB, two chunks of 30 kB: the other 20 kB keep files
    across epochs (Allocation.retain). Files kept are not removed with their chunk, nor
    pinned, and the next epoch gives them as hits; every file still comes exactly once.

    The cache's LRU takes kept files only after every other file it may evict
    (``Cache.set_retained``), so the first 20 files kept stay kept for good: the epoch's
    misses go instead. Holds (files just answered) are capped at 10 kB here, so that the
    misses' files are not all held at once in a cache this small (at half of 100 kB they
    were, at times, and kept files went then: not waited for, by design)."""
    async with mountd_env(tmp_path, files=300, size=1000, cache_size=100_000) as env:
        coop = env.server.coop
        assert coop is not None
        env.server.cache.holds.max_bytes = 10_000
        await env.client.session_open(env.dataset, "job", seed=1)
        await wait_until(lambda: coop.registry.retain_bytes(env.dataset) > 0, WAIT, "an allocation")
        assert coop.registry.retain_bytes(env.dataset) == 20_000
        cache = env.server.cache
        kept_before: set[bytes] = set()
        ever_kept: set[bytes] = set()
        for epoch in range(3):
            given, hits = [], set()
            while True:
                claim = await env.client.claim(env.dataset, "job", 0, 10, epoch=epoch)
                ids = claim["hits"] + claim["fetch"]
                if not ids:
                    break
                given.extend(ids)
                hits.update(env.view.hash_of(i) for i in claim["hits"])
                await read_claimed(env, ids)
                ever_kept.update(coop.retained.get(env.dataset, ()))
                await trio.sleep(0.01)  # let the tick loop preload and evict
            assert sorted(given) == list(range(300))  # exactly once, retention or not
            assert kept_before <= hits  # what was kept came as hits
            kept = coop.retained[env.dataset]
            assert sum(kept.values()) == 20_000
            assert all(env.in_store(env.view.ids_of(h)[0]) for h in kept)  # forgotten when taken
            manager, plan = coop.registry.dataset(env.dataset).manager, coop.registry.dataset(env.dataset).plan
            outside = [h for h in kept if manager.state(plan.chunk_of(env.view.ids_of(h)[0])) not in (
                ChunkState.LOADING, ChunkState.LOADED, ChunkState.MARKED)]
            assert not cache.index.pinned_of(outside)
            kept_before = set(kept)
        assert ever_kept == kept_before and len(kept_before) == 20  # never taken, never topped up
        stats = coop.allocation_json()["datasets"][env.dataset]
        assert stats["bytes"] == 80_000 and stats["retained_bytes"] == 20_000
        # A smaller budget that only holds the two chunks keeps nothing more: the kept files
        # are forgotten (left to LRU), not removed.
        kept = list(coop.retained[env.dataset])
        coop.budget = 60_000
        coop.reallocate()
        assert coop.registry.retain_bytes(env.dataset) == 0 and not coop.retained[env.dataset]
        assert all(env.in_store(env.view.ids_of(h)[0]) for h in kept)


async def test_fills_reach_every_dataset_sharing_the_content(tmp_path: Path) -> None:
    async with mountd_env(tmp_path, files=10) as env:
        await env.client.session_open(env.dataset, "a")
        h, s, loc = env.view.item(3)
        assert not env.server.coop.registry.dataset(env.dataset).is_cached(3)
        await env.client.ensure(h, s, Location(loc.url, loc.key, loc.offset, loc.length), None)
        assert env.server.coop.registry.dataset(env.dataset).is_cached(3)
        cache = env.server.cache
        cache.pin([h])
        assert cache.evict_hashes([h]) == (0, 0)  # pinned: kept
        cache.unpin([h])
        assert cache.evict_hashes([h], keep=lambda _: True) == (0, 0)  # held elsewhere: kept
        # Fetched ahead for a job that has not read it: kept until read (a chunk's grace
        # ends before a DataLoader with deep prefetch reads the last files it was given).
        cache.holds.protect(h, s, "job")
        assert cache.evict_hashes([h]) == (0, 0) and env.in_store(3)
        assert cache.holds.next_protection_deadline() <= trio.current_time() + 5.0  # cut short
        cache.record_hits(None, [h], s)  # read: no longer protected
        assert cache.evict_hashes([h, h]) == (1, s)
        assert not env.in_store(3)
        assert not env.server.coop.registry.dataset(env.dataset).is_cached(3)


async def test_a_fill_wakes_the_tick_loop_only_when_a_job_can_use_it(tmp_path: Path) -> None:
    """A plain mount's cold pass (no job open, nothing chunked) only records what landed:
    waking the tick loop for it cost ~6% of mountd's CPU. Once a job is open, a fill wakes
    it (claims, chunk loads and preloads react within TICK_COALESCE)."""
    async with mountd_env(tmp_path, files=10) as env:
        coop = env.server.coop
        await coop.ensure_view(env.dataset)  # as a mount's first miss loads it
        state = coop.registry.dataset(env.dataset)
        wakes: list[int] = []
        wake_soon = coop.wake_soon

        def counted() -> None:
            wakes.append(1)
            wake_soon()

        coop.wake_soon = counted
        for cid, job_open in ((1, False), (2, True)):
            if job_open:
                await env.client.session_open(env.dataset, "a")
            wakes.clear()
            h, s, loc = env.view.item(cid)
            await env.client.ensure(h, s, loc, env.dataset)
            assert state.is_cached(cid)
            assert bool(wakes) == job_open


async def test_two_jobs_on_a_cold_cache_fetch_each_file_about_once(tmp_path: Path) -> None:
    async with mountd_env(tmp_path, files=300) as env:
        for job in ("a", "b"):
            await env.client.session_open(env.dataset, job, seed=0)  # same seed: still disjoint
        before = (await env.client.stats())["counters"]["total"]["remote_requests"]["GET"]
        given: dict[str, list[int]] = {"a": [], "b": []}

        async def reader(job: str) -> None:
            while True:
                claim = await env.client.claim(env.dataset, job, 0, 8)
                ids = claim["hits"] + claim["fetch"]
                if not ids:
                    return
                given[job].extend(ids)
                for cid in ids:
                    h, s, loc = env.view.item(cid)
                    await env.client.ensure(h, s, loc, env.dataset)  # the read

        async with trio.open_nursery() as nursery:
            nursery.start_soon(reader, "a")
            nursery.start_soon(reader, "b")
        assert sorted(given["a"]) == sorted(given["b"]) == list(range(300))
        after = (await env.client.stats())["counters"]["total"]["remote_requests"]["GET"]
        assert after - before <= 1.05 * 300


async def test_fills_while_the_view_loads_are_not_lost(tmp_path: Path) -> None:
    import blake3

    async with mountd_env(tmp_path, files=50) as env:
        # The view started loading at register; fill files at once, racing the load.
        for name, body in env.files[:10]:
            loc = Location(env.url, name, 0, len(body))
            await env.client.ensure(blake3.blake3(body).digest(), len(body), loc, env.dataset)
        await env.client.session_open(env.dataset, "job")
        state = env.server.coop.registry.dataset(env.dataset)
        assert [state.is_cached(i) for i in range(12)] == [True] * 10 + [False] * 2
        claim = await env.client.claim(env.dataset, "job", 0, 10)
        assert sorted(claim["hits"]) == list(range(10))


async def test_chunk_grace_keeps_a_finished_chunk_in_the_store_until_it_passes(tmp_path: Path) -> None:
    # As above: 10 chunks of ~30 files. A 2 s grace from the daemon's config.
    async with mountd_env(tmp_path, files=300, size=1000, cache_size=100_000,
                          chunk_grace=2.0) as env:
        await env.client.session_open(env.dataset, "job", seed=1)
        state = env.server.coop.registry.dataset(env.dataset)
        manager = state.manager
        assert manager is not None and manager.grace == 2.0
        claim = await env.client.claim(env.dataset, "job", 0, 1)
        assert claim["chunk"] == 0
        await wait_until(lambda: manager.newest == 1, WAIT, "chunk 1 loaded")
        assert manager.state(0) is ChunkState.MARKED
        pool = env.server.coop.registry.pool(env.dataset, "job", 0)
        await read_claimed(env, claim["hits"] + claim["fetch"])
        while pool.chunk == 0:  # the job is given the rest of chunk 0 (and reads it)
            claim = await env.client.claim(env.dataset, "job", 0, 10)
            await read_claimed(env, claim["hits"] + claim["fetch"])
        finished = trio.current_time()
        chunk0 = list(state.plan.ids_of(0))
        await trio.sleep(0.5)
        if trio.current_time() - finished < 1.9:  # a loaded machine may have slept longer
            assert manager.state(0) is ChunkState.MARKED and manager.loading is None
            assert all(env.in_store(c) for c in chunk0)
        await wait_until(lambda: manager.state(0) is ChunkState.IDLE, WAIT, "chunk 0 evicted")
        assert trio.current_time() - finished >= 1.9
        # All gone but what the dataset keeps across epochs (the 20 kB its chunks leave of
        # the budget: the first chunk evicted gives up to 20 of its files, unpinned).
        kept = env.server.coop.retained[env.dataset]
        assert 0 < len(kept) <= 20
        assert {c for c in chunk0 if env.in_store(c)} == {env.view.ids_of(h)[0] for h in kept}
        assert [e[1:] for e in env.server.coop.evictions] == [(0, len(chunk0) - len(kept), False)]


async def test_a_finished_chunks_grace_ends_once_its_given_files_are_opened(tmp_path: Path) -> None:
    # Issue 35: where the mount reports opens (hits.opened), a marked chunk goes as soon as
    # every file given out of it was opened, not after the grace's seconds (10 here).
    async with mountd_env(tmp_path, files=300, size=1000, cache_size=100_000,
                          chunk_grace=10.0) as env:
        await env.client.session_open(env.dataset, "job", seed=1)
        state = env.server.coop.registry.dataset(env.dataset)
        manager = state.manager
        assert manager is not None
        given: list[int] = []
        claim = await env.client.claim(env.dataset, "job", 0, 1)
        given += claim["hits"] + claim["fetch"]
        await env.client.hits(env.dataset, [], 0, opened=[env.view.item(given[0])[0]])
        await wait_until(lambda: state.reports_opens(), WAIT, "opens reported")
        await wait_until(lambda: manager.newest == 1, WAIT, "chunk 1 loaded")
        pool = env.server.coop.registry.pool(env.dataset, "job", 0)
        while pool.chunk == 0:  # the job is given the rest of chunk 0
            claim = await env.client.claim(env.dataset, "job", 0, 10)
            given += claim["hits"] + claim["fetch"]
            await read_claimed(env, claim["hits"] + claim["fetch"])
        finished = trio.current_time()
        of_chunk0 = [i for i in given if state.plan.chunk_of(i) == 0]
        assert len(of_chunk0) > 2
        # All but the last given file of chunk 0 opened (the first one was, above).
        await env.client.hits(env.dataset, [], 0,
                              opened=[env.view.item(i)[0] for i in of_chunk0[1:-1]])
        await trio.sleep(0.3)
        assert manager.state(0) is ChunkState.MARKED  # one given file is still unopened
        await env.client.hits(env.dataset, [], 0, opened=[env.view.item(of_chunk0[-1])[0]])
        await wait_until(lambda: manager.state(0) is ChunkState.IDLE, WAIT, "chunk 0 evicted")
        assert trio.current_time() - finished < 5.0  # not the 10 s grace
        assert state.unopened is not None and state.unopened.waiting(0) == 0


def test_chunk_grace_must_not_be_negative(tmp_path: Path, capsys) -> None:
    from quiverfs.base.console import run_app
    from quiverfs.cli.main import app

    with pytest.raises(UsageError, match="grace"):
        DaemonConfig(CacheConfig(cache_dir=tmp_path, cache_size=1000), chunk_grace=-1.0)
    with pytest.raises(SystemExit) as done:
        run_app(app, "quiverfs", ["mountd", "--cache-dir", str(tmp_path), "--chunk-grace", "-1"])
    err = capsys.readouterr().err
    assert done.value.code == 2 and "--chunk-grace" in err and "internal error" not in err
