"""Brand's policy in a real mountd: an in-process daemon (real Cache, socket, tick loop)
serving a packed dataset — tar objects on a file:// source, described by a real digest whose
files point into them by offset."""

from __future__ import annotations

import random
from pathlib import Path

from mountd.coop.brand import unit_members, unit_of, units_in
from mountd.rpc.async_client import open_client
from mountd.store import layout
from quiverfs.testing.packed import PackedFile, pack, packed_digest
from tests.mountd.conftest import in_process_mountd, short_dir, wait_until

FILES, PER_TAR, SIZE = 320, 16, 600


def packed_source(root: Path) -> tuple[list[PackedFile], dict[str, bytes]]:
    """Files shuffled into tar objects of ``PER_TAR`` members under ``root`` (what ``digests
    pack`` writes), placed by offset: every file's place and its bytes by path."""
    rng = random.Random(1)
    names = [f"c{i % 5}/f{i:04d}.bin" for i in range(FILES)]
    bodies = {name: i.to_bytes(4, "big") + rng.randbytes(SIZE - 4) for i, name in enumerate(names)}
    order = names[:]
    rng.shuffle(order)
    objects, placed = pack([(name, bodies[name]) for name in order], PER_TAR, prefix="")
    for key, data in objects.items():
        (root / key).write_bytes(data)
    return placed, bodies


async def test_packed_dataset_claims_whole_packed_chunks_and_protects_what_they_bring(
    tmp_path: Path,
) -> None:
    source = tmp_path / "remote"
    source.mkdir()
    placed, bodies = packed_source(source)
    digest = tmp_path / "packed.qd"
    dataset = packed_digest(digest, "file://" + str(source), placed)
    cache_dir = short_dir(tmp_path) / "cache"
    # the dataset fits: mode full, forced so that only the protection of what claims fetch
    # is at work (a dataset the benefit-aware allocation makes full is pinned whole)
    async with in_process_mountd(cache_dir, 1 << 24, chunk_grace=0.0,
                                 dataset_mode="full") as running:
        server = running.server
        async with open_client(cache_dir) as client:
            await client.register(dataset, digest=str(digest))
            await client.session_open(dataset, "job", rank=0, world_size=1, epoch=0, seed=3)
            view = server.coop.views[dataset]
            packing = view.packing
            assert packing is not None and packing.chunks == FILES // PER_TAR
            cache = server.cache

            def stored(cid: int) -> bytes | None:
                path = layout.store_path(cache_dir, view.hash_of(cid))
                return path.read_bytes() if path.exists() else None

            first = await client.claim(dataset, "job", 0, 4, epoch=0)
            assert first["hits"] == [] and len(first["fetch"]) == 4
            unit = unit_of(packing, first["fetch"][0])
            assert {unit_of(packing, i) for i in first["fetch"]} == {unit}
            brought = [i for i in unit_members(packing, unit) if i not in first["fetch"]]
            state = server.coop.registry.dataset(dataset)
            assert set(state.reserved) == set(brought)
            # the packed chunk lands whole (the claim's misses and what they bring), and
            # all of it is protected until read (mountd/store/holds.py), never pinned
            await wait_until(lambda: all(stored(i) is not None for i in unit_members(packing, unit)),
                             20, "the packed chunk")
            for i in unit_members(packing, unit):
                path = view.digest.entry(view.file_ids[i]).path
                assert stored(i) == bodies[path]
            members = view.hashes_of(unit_members(packing, unit))
            assert all(cache.holds.protected(h) for h in members)
            assert not cache.index.pinned_of(members)
            second = await client.claim(dataset, "job", 0, len(brought), epoch=0)
            assert sorted(second["hits"]) == sorted(brought) and second["fetch"] == []
            # given, not read yet: still protected; read (the mount reports hits): ended
            assert all(cache.holds.protected(h) for h in view.hashes_of(brought))
            await client.hits(dataset, view.hashes_of(brought), 0)  # a notification
            await wait_until(lambda: not any(cache.holds.protected(h) for h in view.hashes_of(brought)),
                             20, "the read members' protection to end")
            assert all(cache.holds.protected(h) for h in view.hashes_of(first["fetch"]))
            # the rest of the epoch: exactly once, misses a packed chunk at a time
            given = first["fetch"] + second["hits"]
            while True:
                claim = await client.claim(dataset, "job", 0, 8, epoch=0)
                ids = claim["hits"] + claim["fetch"]
                if not ids:
                    break
                given.extend(ids)
                assert len(units_in(packing, claim["fetch"])) <= 1
                for cid in ids:  # read it: wait for the claimed misses to land
                    await wait_until(lambda cid=cid: stored(cid) is not None, 20, f"file {cid}")
            assert sorted(given) == list(range(FILES))
            assert cache.holds.protected_count() > 0  # fetched for the job, never reported read
            await client.session_close(dataset, "job", 0)
            # the pool closed: the next tick releases them
            await wait_until(lambda: not cache.holds.protected_count(), 20, "the release")
            assert cache.holds.ended["released"] > 0
