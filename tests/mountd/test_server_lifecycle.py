"""mountd's lifetime: clean stop on SIGTERM, one mountd per cache directory, starting on demand
(two racing clients start exactly one), and kill -9 then restart keeps the cache intact."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import blake3
import pytest
import trio

from mountd.errors import EXIT_ALREADY_RUNNING, MountdUnavailable
from mountd.rpc.async_client import connect_or_start, open_client
from mountd.rpc.client import SyncClient, probe
from mountd.store import layout
from quiverfs.testing.mountd import (
    location,
    make_dataset,
    mountd_argv,
    running_mountd,
    stop_process,
    wait_until,
)


def mountd_pids(cache_dir: Path) -> list[int]:
    """Processes running ``quiverfs.cli mountd --cache-dir CACHE_DIR``: the mountds, not their
    fill processes (forked children, with the same command line)."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
            parent = int(Path(f"/proc/{entry}/stat").read_text().rsplit(") ", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if b"mountd" in argv and os.fsencode(cache_dir) in argv:
            found[int(entry)] = parent
    return sorted(pid for pid, parent in found.items() if parent not in found)


def pid_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # A zombie still answers kill(0); it is gone for our purposes.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1].startswith("Z")
    except (OSError, IndexError):
        return True


@pytest.fixture
def reap(request):
    """Stop any on-demand mountd a test started (they are detached: not our children)."""
    dirs: list[Path] = []
    yield dirs.append
    for cache_dir in dirs:
        for pid in mountd_pids(cache_dir):
            os.kill(pid, signal.SIGTERM)
            try:
                wait_until(lambda pid=pid: pid_gone(pid), 10, f"mountd {pid} to stop")
            except AssertionError:
                os.kill(pid, signal.SIGKILL)


def test_sigterms_that_keep_coming_while_mountd_winds_down_still_end_it_with_0(tmp_path):
    # A service manager's stop, then a user's kill (or Ctrl-C twice): the signals keep
    # coming while mountd closes its cache and stops its fill processes, and none may kill
    # it half-way (exit -15 before its index was closed).
    with running_mountd(tmp_path / "cache") as daemon:
        deadline = time.monotonic() + 30
        while daemon.proc.poll() is None and time.monotonic() < deadline:
            daemon.proc.send_signal(signal.SIGTERM)
            time.sleep(0.001)
        assert daemon.proc.wait(5) == 0, daemon.log()
        assert "stopped" in daemon.log()
        assert not daemon.socket_path.exists()


def test_sigterm_stops_cleanly_and_removes_the_socket(tmp_path):
    with running_mountd(tmp_path / "cache") as daemon:
        assert daemon.socket_path.exists()
        status = daemon.stop()
        assert status == 0, daemon.log()
        assert not daemon.socket_path.exists()
        assert "stopped" in daemon.log()
        with pytest.raises(MountdUnavailable, match="no mountd is running"):
            SyncClient.connect(daemon.cache_dir)


def test_second_mountd_on_the_same_directory_exits_75(tmp_path):
    with running_mountd(tmp_path / "cache") as daemon:
        second = subprocess.run(
            mountd_argv(daemon.cache_dir, "--cache-size", "16M"), capture_output=True, text=True,
            timeout=60,
        )
        assert second.returncode == EXIT_ALREADY_RUNNING
        assert second.stderr.count("\n") == 1 and "quiverfs: error:" in second.stderr
        assert probe(daemon.cache_dir)["pid"] == daemon.proc.pid  # the first one is untouched


RACER = textwrap.dedent(
    """
    import json, sys
    import trio
    from mountd.rpc.async_client import connect_or_start

    async def main():
        sys.stdin.readline()  # start line: both racers are loaded before either tries
        async with connect_or_start(sys.argv[1], options=["--cache-size", "16M"], timeout=60) as c:
            print(json.dumps({"pid": (await c.hello())["pid"]}), flush=True)

    trio.run(main)
    """
)


def test_two_racing_clients_start_exactly_one_mountd(tmp_path, reap):
    cache_dir = tmp_path / "cache"
    reap(cache_dir)
    racers = [
        subprocess.Popen([sys.executable, "-c", RACER, str(cache_dir)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    for racer in racers:
        racer.stdin.write("go\n")
        racer.stdin.flush()
    outputs = [racer.communicate(timeout=90) for racer in racers]
    assert [r.returncode for r in racers] == [0, 0], outputs
    pids = {json.loads(out)["pid"] for out, _ in outputs}
    assert len(pids) == 1
    assert mountd_pids(cache_dir) == list(pids)
    log = (cache_dir / "mountd.log").read_text()
    assert log.count(" ready: cache ") == 1, log


async def test_connect_or_start_starts_then_reuses_and_reconnects(tmp_path, reap):
    cache_dir = tmp_path / "cache"
    reap(cache_dir)
    url, files = make_dataset(tmp_path / "remote", 2)
    async with connect_or_start(cache_dir, options=["--cache-size", "16M"]) as client:
        first_pid = client.info["pid"]
        assert mountd_pids(cache_dir) == [first_pid]
        path = await client.ensure(files[0].hash, files[0].size, location(url, files[0]))
        assert blake3.blake3(Path(path).read_bytes()).digest() == files[0].hash
        async with connect_or_start(cache_dir) as again:
            assert again.info["pid"] == first_pid  # reused, not started twice
        # mountd goes away; the next call starts a new one and reconnects by itself.
        await client.shutdown()
        with trio.fail_after(20):
            while not pid_gone(first_pid):
                await trio.sleep(0.01)
        path = await client.ensure(files[1].hash, files[1].size, location(url, files[1]))
        assert Path(path).read_bytes() == files[1].data
        assert client.info["pid"] != first_pid
        # The first file survived the restart: it is a hit, not a second GET.
        await client.ensure(files[0].hash, files[0].size, location(url, files[0]))
        total = (await client.stats())["counters"]["total"]
        assert total["remote_requests"]["GET"] == 1 and total["hits"] == 1


def test_kill_9_then_restart_keeps_entries_and_no_partials(tmp_path):
    cache_dir = tmp_path / "cache"
    url, small = make_dataset(tmp_path / "remote", 5, size=64 * 1024)
    _, [big] = make_dataset(tmp_path / "remote", 1, size=24 << 20, seed=1, prefix="big")
    with running_mountd(cache_dir, "--remote-bandwidth", "4M") as daemon:
        with SyncClient.connect(cache_dir) as c:
            for f in small:
                c.ensure(f.hash, f.size, location(url, f), dataset="crash")
            c.notify("prefetch", {"items": [{"hash": big.hash.hex(), "size": big.size,
                                             "location": location(url, big)}]})
            # Kill while the big fill is under way (at 4 MB/s it takes ~6 s).
            wait_until(lambda: c.stats()["counters"]["fills_in_flight"] == 1, 10, "the big fill to start")
            wait_until(lambda: os.listdir(cache_dir / layout.TMP), 10, "a partial file in tmp/")
        daemon.proc.send_signal(signal.SIGKILL)
        assert daemon.proc.wait(10) == -signal.SIGKILL
        assert daemon.socket_path.exists()  # stale socket left behind by kill -9
    with running_mountd(cache_dir) as daemon, SyncClient.connect(cache_dir) as c:
        usage = c.usage()
        assert usage["entries"] == 5 and usage["used_bytes"] == sum(f.size for f in small)
        assert os.listdir(cache_dir / layout.TMP) == []
        stored = {}
        for dirpath, _, names in os.walk(layout.store_dir(cache_dir)):
            for name in names:
                stored[name] = Path(dirpath, name).read_bytes()
        assert set(stored) == {f.hash.hex() for f in small}
        assert all(blake3.blake3(data).hexdigest() == name for name, data in stored.items())
        for f in small:
            c.ensure(f.hash, f.size, location(url, f), dataset="crash")
        counters = c.stats()["counters"]["datasets"]["crash"]
        assert counters["hits"] == 5 and counters["remote_requests"]["GET"] == 0
    assert stop_process(daemon.proc) == 0


async def test_client_reconnects_to_a_restarted_mountd_and_re_registers(tmp_path):
    cache_dir = tmp_path / "cache"
    url, files = make_dataset(tmp_path / "remote", 2)
    with running_mountd(cache_dir) as daemon:
        async with open_client(cache_dir) as client:
            await client.register("re-reg", mountpoint="/mnt/re")
            await client.ensure(files[0].hash, files[0].size, location(url, files[0]))
            first_pid = client.info["pid"]
            assert daemon.stop() == 0 and not daemon.socket_path.exists()
            with pytest.raises(MountdUnavailable):  # nobody there: a clear error, no retry loop
                await client.stats()
            with running_mountd(cache_dir):
                path = await client.ensure(files[1].hash, files[1].size, location(url, files[1]))
                assert Path(path).read_bytes() == files[1].data
                assert client.info["pid"] != first_pid
                mounts = (await client.ls())["mounts"]
                assert [(m["dataset"], m["mountpoint"]) for m in mounts] == [("re-reg", "/mnt/re")]
