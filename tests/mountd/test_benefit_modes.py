"""Benefit-aware allocation in a real mountd: mode changes under load never fail a read nor
break exactly once, pins follow the mode, and ``stats`` says who got the cache and why."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import trio

from digests.build import build
from mountd.coop.benefit import HIT_SAMPLES, MISS_SAMPLES
from mountd.coop.chunks import ChunkState
from mountd.coop.plans import Mode
from mountd.errors import InvalidRequest
from mountd.rpc.async_client import open_client
from mountd.stats.metrics import render
from mountd.store import layout
from quiverfs.cli.mountd_views import print_allocation
from tests.mountd.conftest import in_process_mountd, mountd_env, wait_until


async def test_mode_changes_under_load_fail_no_read(tmp_path: Path) -> None:
    # 300 files of 1000 B in a 1 MB cache; the budget (what the allocator may give) is moved
    # while two ranks read, so the dataset goes full -> chunked -> off -> chunked -> full.
    async with mountd_env(tmp_path, files=300, size=1000, cache_size=1_000_000) as env:
        coop = env.server.coop
        assert coop is not None and coop.registry.benefit_aware
        for rank in (0, 1):
            await env.client.session_open(env.dataset, "job", rank=rank, world_size=2, seed=3)
        budgets = [400_000, 70_000, 1_000, 90_000, 400_000]
        seen_modes = set()
        for epoch in range(3):
            given: list[int] = []
            done = [False, False]
            step = 0
            while not all(done):
                for rank in (0, 1):
                    if done[rank]:
                        continue
                    claim = await env.client.claim(env.dataset, "job", rank, 8, epoch=epoch)
                    ids = claim["hits"] + claim["fetch"]
                    done[rank] = not ids
                    given.extend(ids)
                    for cid in ids:  # read every file: a hit from the store, else ensure
                        h, s, loc = env.view.item(cid)
                        path = layout.store_path(env.cache_dir, h)
                        try:
                            data = path.read_bytes()
                        except FileNotFoundError:
                            await env.client.ensure(h, s, loc, env.dataset)
                            data = path.read_bytes() if path.exists() else None
                        if data is not None:
                            assert data == env.files[cid][1]
                    step += 1
                    if step % 9 == 0:
                        coop.budget = budgets[(step // 9) % len(budgets)]
                        coop.reallocate()
                        seen_modes.add(coop.registry.mode(env.dataset))
                    await trio.sleep(0)
            assert sorted(given) == list(range(300))
        assert seen_modes >= {Mode.FULL, Mode.CHUNKED, Mode.OFF}
        # Off at the end: nothing of the dataset stays pinned.
        coop.budget = 1_000
        coop.reallocate()
        assert coop.registry.mode(env.dataset) is Mode.OFF
        pinned = coop.cache.index.pinned_of(env.view.hashes_of(range(300)))
        assert not pinned
        # Full: nothing pinned either (pins are chunk management's: a whole dataset pinned
        # would escape `quiverfs evict` and quota eviction); its cached files stay cached.
        coop.budget = 400_000
        coop.reallocate()
        assert coop.registry.mode(env.dataset) is Mode.FULL
        state = coop.registry.dataset(env.dataset)
        cached = [i for i in range(300) if state.is_cached(i)]
        assert cached
        assert not coop.cache.index.pinned_of(env.view.hashes_of(range(300)))
        assert all(coop.cache.index.size_of(h) == 1000 for h in env.view.hashes_of(cached))


async def test_chunked_to_full_releases_chunk_pins_keeps_files(tmp_path: Path) -> None:
    async with mountd_env(tmp_path, files=300, size=1000, cache_size=1_000_000) as env:
        coop = env.server.coop
        assert coop is not None
        await env.client.session_open(env.dataset, "job", seed=1)
        coop.budget = 70_000
        coop.reallocate()
        state = coop.registry.dataset(env.dataset)
        assert coop.registry.mode(env.dataset) is Mode.CHUNKED
        for _ in range(5):  # read a little, so that a chunk loads
            claim = await env.client.claim(env.dataset, "job", 0, 10, epoch=0)
            for cid in claim["fetch"]:
                h, s, loc = env.view.item(cid)
                await env.client.ensure(h, s, loc, env.dataset)
            await trio.sleep(0.05)
        assert state.manager is not None
        held = [c for c, st in enumerate(state.manager.states()) if st is not ChunkState.IDLE]
        assert held
        coop.budget = 400_000
        coop.reallocate()
        assert coop.registry.mode(env.dataset) is Mode.FULL
        # The old chunks' pins go with their manager; what they cached stays cached (the
        # dataset is full now: its jobs read it as hits).
        cached = [i for i in range(300) if state.is_cached(i)]
        assert cached
        assert not coop.cache.index.pinned_of(env.view.hashes_of(range(300)))
        assert all(coop.cache.index.size_of(h) == 1000 for h in env.view.hashes_of(cached))


async def test_stats_show_allocation_per_dataset_and_job(tmp_path: Path, capsys) -> None:
    async with mountd_env(tmp_path, files=100, size=1000, cache_size=1_000_000) as env:
        coop = env.server.coop
        assert coop is not None
        await env.client.session_open(env.dataset, "job", rank=0, world_size=4)
        coop.reallocate()
        stats = await env.client.stats()
        row = stats["allocation"]["datasets"][env.dataset]
        assert row["mode"] == "full" and row["bytes"] == 100_000
        assert row["benefit"] == 8.0  # one unmeasured job of 4 GPUs, assumed b = 2
        assert "G=8.00" in row["reason"]
        (job,) = row["jobs"]
        assert job["job"] == "job" and job["gpus"] == 4 and job["b"] is None
        text = render(stats)
        assert f'quiverfs_dataset_mode{{dataset="{env.dataset}",mode="full"}} 1' in text
        assert f'quiverfs_dataset_allocated_bytes{{dataset="{env.dataset}"}} 100000' in text
        print_allocation(stats["allocation"])
        out = capsys.readouterr().out
        assert "benefit-aware" in out and "full" in out and "G=8.00" in out


async def test_a_forced_mode_is_not_reallocated(tmp_path: Path) -> None:
    async with mountd_env(tmp_path, files=100, size=1000, cache_size=1_000_000, mode="lru") as env:
        coop = env.server.coop
        assert coop is not None and not coop.registry.benefit_aware
        await env.client.session_open(env.dataset, "job")
        coop.tick()
        stats = await env.client.stats()
        row = stats["allocation"]["datasets"][env.dataset]
        assert row["mode"] == "lru" and row["reason"] == "fixed by --dataset-mode"


async def test_batch_reports_with_their_misses_measure_the_job(tmp_path: Path) -> None:
    # report_batch's files/misses reach the registry over RPC and classify each report
    # exactly; a report with files but no misses is EINVAL and records nothing.
    async with mountd_env(tmp_path, files=40) as env:
        coop = env.server.coop
        assert coop is not None
        await env.client.session_open(env.dataset, "job")
        with pytest.raises(InvalidRequest) as info:
            await env.client.call(
                "report_batch",
                {"dataset": env.dataset, "job": "job", "rank": 0, "seconds": 0.1, "files": 4},
            )
        assert info.value.errno == errno.EINVAL
        for _ in range(HIT_SAMPLES):
            await env.client.report_batch(env.dataset, "job", 0, 0.1, files=4, misses=0)
        for _ in range(MISS_SAMPLES):
            await env.client.report_batch(env.dataset, "job", 0, 0.3, files=4, misses=4)
        (job,) = coop.allocation_json()["datasets"][env.dataset]["jobs"]
        assert job["t_hit"] == pytest.approx(0.1) and job["t_miss"] == pytest.approx(0.3)
        assert job["b"] == pytest.approx(3.0)


async def _build_datasets(
    tmp_path: Path, count: int, files: int, size: int
) -> list[tuple[str, Path, list[bytes]]]:
    """``count`` file:// datasets of ``files`` × ``size`` bytes (distinct contents), their
    digests built: ``(dataset id, digest, bodies in digest order)``."""
    out = []
    for k in range(count):
        source = tmp_path / f"remote{k}"
        source.mkdir()
        for i in range(files):
            body = bytes([k]) + i.to_bytes(4, "big") + os.urandom(size - 5)
            (source / f"f{i:05d}.bin").write_bytes(body)
        digest = tmp_path / f"ds{k}.qd"
        result = await build("file://" + str(source), digest)
        bodies = [(source / f"f{i:05d}.bin").read_bytes() for i in range(files)]
        out.append((result.dataset_id, digest, bodies))
    return out


@pytest.mark.parametrize("policy", ["budget-only", "manual"])
async def test_budget_only_shares_one_small_cache_among_three_datasets(
    tmp_path: Path, policy: str
) -> None:
    # Three datasets of 300 kB; a 100 kB cache (budget 80 kB). Each alone would take two
    # chunks of 30 kB; sized against the whole budget each, the three pinned 180 kB and fills
    # failed with CacheFull. Dealt in registration order: 60 kB, the 20 kB left, nothing.
    datasets = await _build_datasets(tmp_path, 3, files=300, size=1000)
    cache_dir = tmp_path / "cache"
    async with in_process_mountd(cache_dir, 100_000, chunk_grace=0.0,
                                 dataset_mode="chunked" if policy == "manual" else None) as running:
        coop = running.server.coop
        assert coop is not None
        coop.registry.benefit_aware = False
        assert coop.policy == policy
        async with open_client(cache_dir) as client:
            for name, digest, _ in datasets:  # one after the other: registration order is known
                await client.register(name, digest=str(digest))
                await client.session_open(name, "job", rank=0, world_size=2, seed=5)
                await client.session_open(name, "job", rank=1, world_size=2, seed=5)
            coop.tick()
            names = [name for name, _, _ in datasets]
            allocation = coop.registry.allocation()
            assert [allocation[n].mode for n in names] == [Mode.CHUNKED, Mode.CHUNKED, Mode.OFF]
            assert [allocation[n].budget for n in names] == [60_000, 20_000, 0]
            held = [2 * coop.registry.dataset(n).plan.target_bytes for n in names[:2]]
            assert held == [60_000, 20_000] and sum(held) <= coop.budget
            stats = await client.stats()
            assert stats["allocation"]["policy"] == policy
            assert all(
                policy in stats["allocation"]["datasets"][n]["reason"]
                or "fixed by --dataset-mode" in stats["allocation"]["datasets"][n]["reason"]
                for n in names
            )
            # Two epochs of two ranks on every dataset at once: every read returns its bytes.
            for epoch in range(2):
                given = {n: [] for n in names}
                done = {(n, r): False for n in names for r in (0, 1)}
                while not all(done.values()):
                    for (name, _digest, bodies), view in zip(
                        datasets, [coop.views[n] for n in names], strict=True
                    ):
                        for rank in (0, 1):
                            if done[name, rank]:
                                continue
                            claim = await client.claim(name, "job", rank, 10, epoch=epoch)
                            ids = claim["hits"] + claim["fetch"]
                            done[name, rank] = not ids
                            given[name].extend(ids)
                            read = []  # from the store: reported as the direct loader does
                            for cid in ids:
                                h, s, loc = view.item(cid)
                                path = layout.store_path(cache_dir, h)
                                try:
                                    data = path.read_bytes()
                                    read.append(h)
                                except FileNotFoundError:
                                    await client.ensure(h, s, loc, name)
                                    data = path.read_bytes() if path.exists() else None
                                if data is not None:
                                    assert data == bodies[int(loc.key[1:6])]
                            if read:
                                await client.hits(name, read, 1000 * len(read))
                            pinned = coop.cache.index.pinned_of(
                                [h for v in coop.views.values() for h in v.hashes_of(range(300))]
                            )
                            assert len(pinned) * 1000 <= coop.budget
                    await trio.sleep(0)
                assert all(sorted(ids) == list(range(300)) for ids in given.values())
            stats = await client.stats()
            assert stats["counters"]["total"]["fill_errors"] == 0


async def test_datasets_enter_the_registry_in_registration_order_whichever_loads_first(
    tmp_path: Path,
) -> None:
    # A large dataset registered first loads slower than a small one registered after it;
    # budget-only deals the budget in registration order, so the large one must come first.
    for part in ("big", "small"):
        (tmp_path / part).mkdir()
    (big, big_digest, _), = await _build_datasets(tmp_path / "big", 1, files=4000, size=100)
    (small, small_digest, _), = await _build_datasets(tmp_path / "small", 1, files=5, size=100)
    cache_dir = tmp_path / "cache"
    async with in_process_mountd(cache_dir, 100_000) as running:
        coop = running.server.coop
        assert coop is not None
        coop.registry.benefit_aware = False
        async with open_client(cache_dir) as client:
            await client.register(big, digest=str(big_digest))
            await client.register(small, digest=str(small_digest))
            await wait_until(lambda: len(coop.views) >= 2, 20, "both views loaded")
            assert [d.dataset for d in coop.registry.demands()] == [big, small]


async def test_stats_show_each_jobs_epoch_and_jobs_out_of_phase(tmp_path: Path, capsys) -> None:
    """Per job its position (epoch + share given); a chunked dataset whose jobs read more
    than a tenth of an epoch apart names the two furthest apart (their orders are coupled:
    docs/substitutable-reads.md "Jobs out of phase")."""
    async with mountd_env(tmp_path, files=300, size=1000, cache_size=60_000,
                          mode="chunked") as env:
        coop = env.server.coop
        assert coop is not None
        registry = coop.registry
        for job in ("a", "b"):
            await env.client.session_open(env.dataset, job)
        assert registry.mode(env.dataset) is Mode.CHUNKED

        def give(job: str, files: int) -> None:
            pool = registry.pool(env.dataset, job, 0)
            while pool.given_total < files:
                registry.claim(env.dataset, job, 0, min(5, files - pool.given_total), epoch=0)

        give("a", 105)
        give("b", 15)
        row = coop.allocation_json()["datasets"][env.dataset]
        positions = {job["job"]: job["position"] for job in row["jobs"]}
        assert positions == {"a": pytest.approx(0.35), "b": pytest.approx(0.05)}
        assert row["out_of_phase"] == {"jobs": ["a", "b"], "epochs": pytest.approx(0.3)}
        print_allocation(coop.allocation_json())
        out = capsys.readouterr().out
        assert "0.35" in out and "0.05" in out
        text = render(await env.client.stats())
        assert f'quiverfs_dataset_out_of_phase_epochs{{dataset="{env.dataset}"}} 0.3' in text
        assert f'quiverfs_job_position_epochs{{dataset="{env.dataset}",job="a"}} 0.35' in text
        assert "jobs a and b read 0.30 of an epoch apart" in " ".join(out.split())
        give("b", 90)  # 0.05 of an epoch apart: in phase
        row = coop.allocation_json()["datasets"][env.dataset]
        assert row["out_of_phase"] is None
        text = render(await env.client.stats())
        assert f'quiverfs_dataset_out_of_phase_epochs{{dataset="{env.dataset}"}} 0.0' in text
        print_allocation(coop.allocation_json())
        assert "apart" not in capsys.readouterr().out
