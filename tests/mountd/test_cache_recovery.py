"""Crash recovery on open (states A–E of mountd.store.recovery), SIGKILL mid-fill, and scrub."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import blake3
import pytest
import trio

from mountd.store import layout
from mountd.store.cache import Cache
from tests.mountd.conftest import Backends, Source, config, running, store_files, tmp_files

WORKER = Path(__file__).with_name("crash_worker.py")


def simulate_crash(cache_dir: Path) -> None:
    """Leave the index as a killed mountd would: not marked clean."""
    conn = sqlite3.connect(layout.index_path(cache_dir))
    conn.execute("UPDATE meta SET value='0' WHERE key='clean'")
    conn.commit()
    conn.close()


async def fill(cache_dir: Path, objs, backends=None, dataset=None, **kw) -> None:
    async with running(config(cache_dir, **kw), backends) as cache:
        for o in objs:
            await cache.ensure(o.hash, o.size, o.location, dataset)


async def test_sigkill_during_hundreds_of_fills(tmp_path: Path, source: Source):
    source.many(300, 20_000)
    cache_dir = tmp_path / "c"
    repo = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=str(repo))
    # 300 × 20 KB at 1.5 MB/s ≈ 4 s; 8 KB chunks so fills in flight have temp files open.
    proc = await trio.lowlevel.open_process(
        [sys.executable, str(WORKER), str(cache_dir), str(source.root), "1.5e6", "8192"],
        stdout=subprocess.PIPE,
        env=env,
    )
    filled: list[str] = []
    buffer = b""
    try:
        with trio.fail_after(30):
            while len(filled) < 100:
                chunk = await proc.stdout.receive_some()
                assert chunk, f"worker exited early: {buffer!r}"
                buffer += chunk
                *lines, buffer = buffer.split(b"\n")
                filled += [ln.split()[1].decode() for ln in lines if ln.startswith(b"filled ")]
                assert b"all-done" not in b"\n".join(lines), "the worker finished before the kill"
    finally:
        proc.send_signal(signal.SIGKILL)
        await proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert tmp_files(cache_dir), "the kill should have caught fills in flight (temp files)"

    async with running(config(cache_dir)) as cache:
        report = cache.recovery
        assert report is not None and not report.index_rebuilt and report.reconciled
        assert report.temp_removed >= 1
        assert tmp_files(cache_dir) == []
        for hex_hash in filled:  # everything acknowledged before the kill survived
            assert cache.contains(bytes.fromhex(hex_hash))
        on_disk = store_files(cache_dir)
        assert set(on_disk) == {h.hex() for h, _ in cache.index.entries()}
        assert cache.used == sum(on_disk.values())
        scrub = await cache.scrub()
        assert scrub.bad == 0 and scrub.missing == 0 and scrub.ok == len(on_disk) >= len(filled)


async def test_stray_temp_file_is_removed(tmp_path: Path, source: Source):
    cache_dir = tmp_path / "c"
    objs = source.many(2, 1000)
    await fill(cache_dir, objs)
    (cache_dir / "tmp" / ("ab" * 32 + ".123456.tmp")).write_bytes(b"half a fil")
    async with running(config(cache_dir)) as cache:
        assert cache.recovery.temp_removed == 1
        assert tmp_files(cache_dir) == []
        assert all(cache.contains(o.hash) for o in objs)


async def test_file_without_row_is_adopted(tmp_path: Path, source: Source):
    cache_dir = tmp_path / "c"
    await fill(cache_dir, source.many(1, 100))
    data = os.urandom(3000)
    h = blake3.blake3(data).digest()
    path = layout.store_path(cache_dir, h)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)  # as if killed between rename and index commit
    simulate_crash(cache_dir)
    async with running(config(cache_dir)) as cache:
        assert cache.recovery.adopted == 1
        assert cache.contains(h) and cache.index.size_of(h) == 3000
        assert cache.used == 3100 and cache.entries == 2


async def test_row_without_file_is_dropped(tmp_path: Path, source: Source):
    cache_dir = tmp_path / "c"
    a, b = source.many(2, 1000)
    await fill(cache_dir, [a, b], dataset="ds")
    os.unlink(layout.store_path(cache_dir, a.hash))
    simulate_crash(cache_dir)
    backends = Backends()
    async with running(config(cache_dir), backends) as cache:
        assert cache.recovery.rows_dropped == 1
        assert not cache.contains(a.hash) and cache.contains(b.hash)
        assert cache.usage()["datasets"]["ds"]["entries"] == 1  # its reference went too
        assert cache.used == 1000
        await cache.ensure(a.hash, a.size, a.location)  # refetched
        assert backends.gets() == 1


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty", "wrong-schema"])
async def test_unreadable_index_is_rebuilt_from_the_store(
    tmp_path: Path, source: Source, damage: str
):
    cache_dir = tmp_path / "c"
    objs = source.many(20, 2000)
    await fill(cache_dir, objs)
    index = layout.index_path(cache_dir)
    if damage == "truncated":
        with open(index, "r+b") as f:
            f.truncate(os.path.getsize(index) // 3)
    elif damage == "garbage":
        index.write_bytes(os.urandom(8192))
    elif damage == "empty":
        index.write_bytes(b"")
    else:
        conn = sqlite3.connect(index)
        conn.execute("UPDATE meta SET value='999' WHERE key='schema_version'")
        conn.commit()
        conn.close()
    async with running(config(cache_dir)) as cache:
        if damage != "empty":  # an empty file is a valid, empty database: adopted all the same
            assert cache.recovery.index_rebuilt
        assert cache.recovery.adopted == 20
        assert all(cache.contains(o.hash) for o in objs)
        assert cache.used == 20 * 2000
        assert (await cache.scrub()).ok == 20


async def test_junk_in_the_store_is_removed(tmp_path: Path, source: Source):
    cache_dir = tmp_path / "c"
    objs = source.many(2, 100)
    await fill(cache_dir, objs)
    (cache_dir / "store" / "notes.txt").write_text("hi")
    misplaced = cache_dir / "store" / "00" / "00"
    misplaced.mkdir(parents=True, exist_ok=True)
    (misplaced / ("ff" * 32)).write_bytes(b"x")  # valid name, wrong fan-out folder
    simulate_crash(cache_dir)
    async with running(config(cache_dir)) as cache:
        assert cache.recovery.junk_removed == 2
        assert set(store_files(cache_dir)) == {o.hash.hex() for o in objs}


async def test_lowered_cap_shrinks_on_open(tmp_path: Path, source: Source):
    cache_dir = tmp_path / "c"
    objs = source.many(10, 1000)
    await fill(cache_dir, objs)
    async with running(config(cache_dir, size=4000)) as cache:
        assert cache.used <= 4000 and cache.entries == 4
        assert sum(store_files(cache_dir).values()) == cache.used
        assert all(cache.contains(o.hash) for o in objs[-4:])  # the most recent stay


async def test_scrub_removes_altered_file(tmp_path: Path, source: Source, backends: Backends):
    objs = source.many(3, 5000)
    async with running(config(tmp_path / "c"), backends) as cache:
        for o in objs:
            await cache.ensure(o.hash, o.size, o.location, "ds")
        victim = Path(cache.store_path(objs[1].hash))
        data = bytearray(victim.read_bytes())
        data[100] ^= 0xFF
        victim.write_bytes(bytes(data))  # bit rot: same size, different bytes
        seen = []
        report = await cache.scrub(lambda done, total: seen.append((done, total)))
        assert (report.checked, report.ok, report.bad, report.missing) == (3, 2, 1, 0)
        assert seen[-1] == (3, 3)
        assert not victim.exists() and not cache.contains(objs[1].hash)
        assert cache.used == 10_000 and cache.counters.snapshot()["scrub_removed"] == 1
        path = await cache.ensure(objs[1].hash, objs[1].size, objs[1].location)
        assert Path(path).read_bytes() == objs[1].data
        assert (await cache.scrub()).bad == 0


async def test_cache_dir_is_created_and_reopened_without_work(tmp_path: Path):
    cache_dir = tmp_path / "new" / "cache"
    cache = Cache(config(cache_dir))
    await cache.open()
    await cache.aclose()
    for sub in ("store", "tmp"):
        assert (cache_dir / sub).is_dir()
    assert layout.index_path(cache_dir).exists()


async def test_clean_shutdown_skips_the_scan_unless_asked(tmp_path: Path, source: Source):
    cache_dir = tmp_path / "c"
    objs = source.many(3, 1000)
    await fill(cache_dir, objs)
    data = os.urandom(500)
    h = blake3.blake3(data).digest()
    path = layout.store_path(cache_dir, h)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)  # copied in by hand while mountd was stopped
    async with running(config(cache_dir)) as cache:
        assert cache.recovery.reconciled is False  # trusted the clean index
        assert not cache.contains(h) and cache.entries == 3
    cache = Cache(config(cache_dir))
    await cache.open(reconcile=True)
    try:
        assert cache.recovery.reconciled and cache.recovery.adopted == 1
        assert cache.contains(h) and cache.used == 3500
    finally:
        await cache.aclose()
    # While open, the index is marked dirty on disk: a crash now would be reconciled.
    async with running(config(cache_dir)):
        conn = sqlite3.connect(layout.index_path(cache_dir))
        assert conn.execute("SELECT value FROM meta WHERE key='clean'").fetchone() == ("0",)
        conn.close()
