"""Fills without per-file fsync: group commit, durable checkpoints, and recovery after a power
cut (state F of mountd.store.recovery; docs/store-layout.md "Durability").

A power cut cannot be produced on demand, so the tests make its two traces by hand after a
real SIGKILL: the index's boot id is changed (the machine "rebooted"), and files written after
the last checkpoint are damaged the way a lost page cache leaves them (truncated, zero-filled,
other bytes). Recovery must never serve one of them.
"""

from __future__ import annotations

import os
import signal
import sqlite3
import stat
import subprocess
import sys
from pathlib import Path

import blake3
import trio

from mountd.store import durability, layout
from mountd.store.cache import Cache
from mountd.store.index import Index
from tests.mountd.conftest import Backends, Source, config, running, store_files

WORKER = Path(__file__).with_name("durability_worker.py")
REPO = Path(__file__).resolve().parents[2]


def meta(cache_dir: Path) -> dict[str, str]:
    conn = sqlite3.connect(layout.index_path(cache_dir))
    try:
        return dict(conn.execute("SELECT key, value FROM meta"))
    finally:
        conn.close()


def simulate_reboot(cache_dir: Path) -> None:
    """The index as a mountd of an earlier boot left it (the boot id is what a reboot changes)."""
    conn = sqlite3.connect(layout.index_path(cache_dir))
    conn.execute("INSERT OR REPLACE INTO meta (key, value) VALUES ('boot_id', 'an-earlier-boot')")
    conn.commit()
    conn.close()


async def kill_after_fills(cache_dir: Path, source: Path, synced: int, unsynced: int) -> None:
    """Run durability_worker.py until it has filled both sets, then SIGKILL it."""
    proc = await trio.lowlevel.open_process(
        [sys.executable, str(WORKER), str(cache_dir), str(source), str(synced), str(unsynced)],
        stdout=subprocess.PIPE, env=dict(os.environ, PYTHONPATH=str(REPO)))
    out = b""
    try:
        with trio.fail_after(60):
            while b"filled" not in out:
                chunk = await proc.stdout.receive_some()
                assert chunk, f"worker exited early: {out!r}"
                out += chunk
    finally:
        proc.send_signal(signal.SIGKILL)
        await proc.wait()
    assert out.split() == [b"synced", b"filled"]


def rows_added_after_mark(cache_dir: Path) -> set[bytes]:
    index = Index.open(layout.index_path(cache_dir))
    try:
        through, _ = index.durable_mark()
        return {h for h, _ in index.added_since(through)}
    finally:
        index.conn.close()


async def test_power_cut_after_sigkill_never_serves_unsynced_damage(tmp_path: Path, source: Source):
    objs = source.many(30, 5000)
    synced, unsynced = objs[:20], objs[20:]
    cache_dir = tmp_path / "c"
    await kill_after_fills(cache_dir, source.root, len(synced), len(unsynced))
    assert meta(cache_dir)["clean"] == "0"
    assert rows_added_after_mark(cache_dir) == {o.hash for o in unsynced}

    # The power cut: another boot, and what the lost page cache did to the unsynced files.
    simulate_reboot(cache_dir)
    truncated, zeroed, other, intact = unsynced[0], unsynced[1], unsynced[2], unsynced[3:]
    for obj, damage in ((truncated, obj_truncate), (zeroed, obj_zero), (other, obj_other)):
        damage(layout.store_path(cache_dir, obj.hash))
    # ...and a file whose row was lost with the index's tail, its bytes lost too.
    orphan = blake3.blake3(b"never fully written").digest()
    orphan_path = layout.store_path(cache_dir, orphan)
    orphan_path.parent.mkdir(parents=True, exist_ok=True)
    orphan_path.write_bytes(b"\0" * 19)

    backends = Backends()
    async with running(config(cache_dir), backends) as cache:
        report = cache.recovery
        assert report is not None and report.reconciled
        assert report.verified == len(unsynced) + 1  # the newer rows and the orphan only
        assert report.unsynced_dropped == 4
        assert report.adopted == 0
        for obj in (truncated, zeroed, other):
            assert not cache.contains(obj.hash)
            assert not layout.store_path(cache_dir, obj.hash).exists()
        assert not orphan_path.exists() and not cache.contains(orphan)
        for obj in synced + intact:
            assert cache.contains(obj.hash)
        on_disk = store_files(cache_dir)
        assert set(on_disk) == {h.hex() for h, _ in cache.index.entries()}
        assert cache.used == sum(on_disk.values()) == 5000 * (len(objs) - 3)
        # A damaged entry is fetched again, with its right bytes.
        path = await cache.ensure(zeroed.hash, zeroed.size, zeroed.location)
        assert Path(path).read_bytes() == zeroed.data
        assert backends.gets() == 1
        scrub = await cache.scrub()
        assert scrub.bad == 0 and scrub.ok == len(objs) - 2
    assert meta(cache_dir)["boot_id"] == (durability.boot_id() or "")


async def test_sigkill_in_the_same_boot_loses_nothing_and_verifies_nothing(
    tmp_path: Path, source: Source
):
    objs = source.many(12, 3000)
    cache_dir = tmp_path / "c"
    await kill_after_fills(cache_dir, source.root, 6, 6)
    async with running(config(cache_dir)) as cache:
        report = cache.recovery
        assert report.reconciled and report.verified == 0 and report.unsynced_dropped == 0
        assert all(cache.contains(o.hash) for o in objs)
        for obj in objs:
            assert layout.store_path(cache_dir, obj.hash).read_bytes() == obj.data


async def test_checkpoints_follow_fills_and_cover_every_row(tmp_path: Path, source: Source):
    objs = source.many(40, 2000)
    cache_dir = tmp_path / "c"
    async with running(config(cache_dir, sync_interval=0.05)) as cache:
        start = cache.checkpoints
        for obj in objs:
            await cache.ensure(obj.hash, obj.size, obj.location)
        # Rows become visible to another connection when their group commit lands (up to
        # GROUP_COMMIT_DELAY later): wait for a checkpoint after the fills, then for one
        # that covers every row.
        with trio.fail_after(10):
            while cache.checkpoints <= start or rows_added_after_mark(cache_dir):
                await trio.sleep(0.02)
        assert cache.checkpoints > start
        assert cache.index.pending == 0  # the group commit was flushed as well
    facts = meta(cache_dir)
    assert facts["clean"] == "1" and facts["boot_id"] == (durability.boot_id() or "")


async def test_clean_shutdown_after_a_reboot_is_trusted(tmp_path: Path, source: Source):
    objs = source.many(5, 1000)
    cache_dir = tmp_path / "c"
    async with running(config(cache_dir, sync_interval=3600)) as cache:
        for obj in objs:
            await cache.ensure(obj.hash, obj.size, obj.location)
    simulate_reboot(cache_dir)  # the close synced everything: nothing to doubt
    async with running(config(cache_dir)) as cache:
        assert not cache.recovery.reconciled and cache.recovery.verified == 0
        assert all(cache.contains(o.hash) for o in objs)


async def test_rebuilt_index_after_a_reboot_verifies_every_file(tmp_path: Path, source: Source):
    objs = source.many(6, 1500)
    cache_dir = tmp_path / "c"
    async with running(config(cache_dir)) as cache:
        for obj in objs:
            await cache.ensure(obj.hash, obj.size, obj.location)
    layout.index_path(cache_dir).write_bytes(b"garbage" * 100)  # no boot id to trust
    obj_other(layout.store_path(cache_dir, objs[0].hash))
    async with running(config(cache_dir)) as cache:
        report = cache.recovery
        assert report.index_rebuilt and report.verified == len(objs)
        assert report.unsynced_dropped == 1 and report.adopted == len(objs) - 1
        assert not cache.contains(objs[0].hash)
        assert all(cache.contains(o.hash) for o in objs[1:])


async def test_rows_in_the_group_commit_are_visible_at_once_and_survive_close(
    tmp_path: Path, source: Source
):
    objs = source.many(5, 1000)
    cache_dir = tmp_path / "c"
    cache = Cache(config(cache_dir))
    await cache.open()
    async with trio.open_nursery() as nursery:
        await nursery.start(cache.run)
        await cache.ensure(objs[0].hash, objs[0].size, objs[0].location)
        assert cache.contains(objs[0].hash)  # before any commit
        await cache.aclose()
    async with running(config(cache_dir)) as cache:
        assert cache.contains(objs[0].hash) and not cache.recovery.reconciled


def obj_truncate(path: Path) -> None:
    _rewrite(path, lambda data: data[: len(data) // 3])


def obj_zero(path: Path) -> None:
    _rewrite(path, lambda data: b"\0" * len(data))


def obj_other(path: Path) -> None:
    _rewrite(path, lambda data: os.urandom(len(data)))


def _rewrite(path: Path, change) -> None:
    """Change a store file behind mountd's back (store files are read-only: 0444 or 0400)."""
    data = path.read_bytes()
    mode = stat.S_IMODE(os.stat(path).st_mode)
    os.chmod(path, 0o600)
    path.write_bytes(change(data))
    os.chmod(path, mode)
