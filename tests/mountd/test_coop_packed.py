"""Brand's policy in a real mountd: an in-process daemon (real Cache, socket, tick loop)
serving a packed dataset — tar objects on a file:// source, described by a real digest whose
files point into them by offset."""

from __future__ import annotations

import io
import os
import random
import tarfile
from functools import partial
from pathlib import Path

import blake3
import trio

from digests.write import NewFile, write_digest
from mountd.coop.brand import unit_members, unit_of, units_in
from mountd.daemon import DaemonConfig, serve
from mountd.rpc.async_client import open_client
from mountd.store import layout
from mountd.store.cache import CacheConfig

FILES, PER_TAR, SIZE = 320, 16, 600


def write_packed_source(root: Path) -> tuple[list[NewFile], dict[str, bytes]]:
    """Files shuffled into tar objects of ``PER_TAR`` members (what ``digests pack``
    writes); the digest's entries point at each member's data by offset."""
    rng = random.Random(1)
    names = [f"c{i % 5}/f{i:04d}.bin" for i in range(FILES)]
    bodies = {name: i.to_bytes(4, "big") + rng.randbytes(SIZE - 4) for i, name in enumerate(names)}
    order = names[:]
    rng.shuffle(order)
    entries = []
    for k in range(0, FILES, PER_TAR):
        key = f"chunk-{k // PER_TAR:03d}.tar"
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
            for name in order[k : k + PER_TAR]:
                info = tarfile.TarInfo(name)
                info.size = len(bodies[name])
                tar.addfile(info, io.BytesIO(bodies[name]))
        data = buf.getvalue()
        (root / key).write_bytes(data)
        with tarfile.open(fileobj=io.BytesIO(data)) as tar:
            for member in tar.getmembers():
                body = bodies[member.name]
                assert data[member.offset_data : member.offset_data + member.size] == body
                entries.append(NewFile(member.name, member.size, blake3.blake3(body).digest(), 0,
                                       key, member.offset_data))
    return entries, bodies


async def test_packed_dataset_claims_whole_packed_chunks_and_protects_what_they_bring(
    tmp_path: Path,
) -> None:
    source = tmp_path / "remote"
    source.mkdir()
    entries, bodies = write_packed_source(source)
    digest = tmp_path / "packed.qd"
    dataset = write_digest(digest, entries, ["file://" + str(source)])
    base = tmp_path if len(str(tmp_path)) < 60 else Path(os.path.relpath(tmp_path))
    cache_dir = base / "cache"
    # the dataset fits: mode full, forced so that only the protection of what claims fetch
    # is at work (a dataset the benefit-aware allocation makes full is pinned whole)
    config = DaemonConfig(CacheConfig(cache_dir=cache_dir, cache_size=1 << 24), chunk_grace=0.0,
                          dataset_mode="full")
    async with trio.open_nursery() as nursery:
        running = await nursery.start(partial(serve, config, handle_signals=False))
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
            with trio.fail_after(20):
                while any(stored(i) is None for i in unit_members(packing, unit)):
                    await trio.sleep(0.01)
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
            with trio.fail_after(20):
                while any(cache.holds.protected(h) for h in view.hashes_of(brought)):
                    await trio.sleep(0.01)
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
                    with trio.fail_after(20):
                        while stored(cid) is None:
                            await trio.sleep(0.01)
            assert sorted(given) == list(range(FILES))
            assert cache.holds.protected_count() > 0  # fetched for the job, never reported read
            await client.session_close(dataset, "job", 0)
            with trio.fail_after(20):  # the pool closed: the next tick releases them
                while cache.holds.protected_count():
                    await trio.sleep(0.01)
            assert cache.holds.ended["released"] > 0
        server.shutdown.set()
