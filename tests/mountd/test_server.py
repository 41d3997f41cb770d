"""A real mountd in a subprocess, driven over its socket: ensure, single-flight across
connections, malformed input, permissions, registrations, prefetch, evict, scrub, metrics."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import stat
import struct
import tempfile
import time
import urllib.request
from pathlib import Path

import blake3
import pytest
import trio

from mountd.errors import ProtocolError
from mountd.rpc import protocol
from mountd.rpc.async_client import open_client
from mountd.rpc.client import SyncClient
from mountd.store import layout
from quiverfs.base.errors import CorruptObject, NotFound
from quiverfs.testing.mountd import location, make_dataset, running_mountd, wait_until
from quiverfs.testing.prometheus import scraped

NOBODY = 65534


@pytest.fixture(scope="module")
def workdir():
    # Under /tmp with a traversable parent (not pytest's 0700 tmp tree), so the permission
    # test can let uid nobody reach the socket.
    path = Path(tempfile.mkdtemp(prefix="quiverfs-mountd-test-"))
    path.chmod(0o711)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def dataset(workdir):
    return make_dataset(workdir / "remote", 20, size=8192)


@pytest.fixture(scope="module")
def daemon(workdir):
    with running_mountd(workdir / "cache", "--metrics-port", "0") as d:
        yield d


@pytest.fixture
def client(daemon):
    with SyncClient.connect(daemon.cache_dir) as c:
        yield c


def dataset_counters(client, name):
    return client.stats()["counters"]["datasets"].get(name, {})


def test_socket_is_private_to_the_owner(daemon):
    st = os.stat(daemon.socket_path)
    assert stat.S_ISSOCK(st.st_mode)
    assert stat.S_IMODE(st.st_mode) == 0o600
    assert st.st_uid == os.getuid()


def test_hello_reports_version_pid_and_admin(client, daemon):
    info = client.hello_info
    assert info["version"] == protocol.PROTOCOL_VERSION
    assert info["pid"] == daemon.proc.pid
    assert info["cache_dir"] == str(daemon.cache_dir)
    assert info["cache_size"] == 256 << 20  # running_mountd's --cache-size 256M
    assert info["admin"] is True and info["peer"]["pid"] == os.getpid()
    # How it keeps files fetched ahead: a mount's bounded sweep sizes itself by these.
    assert (info["protect_share"], info["sweep_share"], info["protect_seconds"]) == (0.5, 0.8, 30.0)


def test_ensure_returns_the_verified_store_file(client, daemon, dataset):
    url, files = dataset
    f = files[0]
    path = client.ensure(f.hash, f.size, location(url, f), dataset="ensure-one")
    assert path == str(layout.store_path(daemon.cache_dir, f.hash))
    data = Path(path).read_bytes()
    assert blake3.blake3(data).digest() == f.hash and data == f.data
    # Asking again is a hit: no second remote GET.
    assert client.ensure(f.hash, f.size, location(url, f), dataset="ensure-one") == path
    counters = dataset_counters(client, "ensure-one")
    assert counters["remote_requests"]["GET"] == 1
    assert (counters["misses"], counters["hits"]) == (1, 1)


def test_remote_errors_come_back_as_their_class(client, dataset):
    url, files = dataset
    f = files[1]
    with pytest.raises(NotFound) as missing:
        client.ensure(f.hash, f.size, {**location(url, f), "key": "no-such-file.bin"})
    assert missing.value.key == "no-such-file.bin" and missing.value.exit_code == 3
    wrong = blake3.blake3(b"something else").digest()
    with pytest.raises(CorruptObject):
        client.ensure(wrong, f.size, location(url, f), dataset="corrupt")
    assert dataset_counters(client, "corrupt")["verify_failures"] == 1


async def test_50_concurrent_ensures_over_5_connections_make_one_get(daemon, workdir):
    url, files = make_dataset(workdir / "remote-sf", 1, size=4 << 20, seed=7)
    f = files[0]
    paths = []

    async def one(client):
        paths.append(await client.ensure(f.hash, f.size, location(url, f), dataset="single-flight"))

    async with (
        open_client(daemon.cache_dir) as c1, open_client(daemon.cache_dir) as c2,
        open_client(daemon.cache_dir) as c3, open_client(daemon.cache_dir) as c4,
        open_client(daemon.cache_dir) as c5,
    ):
        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                for client in (c1, c2, c3, c4, c5):
                    for _ in range(10):
                        nursery.start_soon(one, client)
        counters = (await c1.stats())["counters"]["datasets"]["single-flight"]
    assert len(paths) == 50 and len(set(paths)) == 1
    assert blake3.blake3(Path(paths[0]).read_bytes()).digest() == f.hash
    assert counters["remote_requests"]["GET"] == 1
    assert counters["bytes_from_remote"] == f.size
    assert counters["hits"] + counters["misses"] == 50


def _raw_connect(daemon) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect(str(daemon.socket_path))
    return sock


def _read_message(sock: socket.socket, decoder: protocol.FrameDecoder) -> dict | None:
    while True:
        bodies = decoder.feed(b"")
        if bodies:
            return protocol.decode_body(bodies[0])
        data = sock.recv(65536)
        if not data:
            return None
        bodies = decoder.feed(data)
        if bodies:
            assert len(bodies) == 1
            return protocol.decode_body(bodies[0])


async def test_malformed_input_on_one_connection_does_not_disturb_another(daemon, dataset):
    url, files = dataset
    async with open_client(daemon.cache_dir) as good:
        bad = _raw_connect(daemon)
        decoder = protocol.FrameDecoder()
        try:
            # Not JSON: an error with id null, and the connection stays usable.
            bad.sendall(struct.pack(">I", 5) + b"\xff{]]x")
            answer = _read_message(bad, decoder)
            assert answer["id"] is None and answer["error"]["type"] == "ProtocolError"
            f = files[2]
            assert await good.ensure(f.hash, f.size, location(url, f))
            bad.sendall(protocol.encode_frame({"id": 41, "op": "ensure", "args": {"hash": 1}}))
            answer = _read_message(bad, decoder)
            assert answer["id"] == 41 and not answer["ok"]
            bad.sendall(protocol.encode_frame({"id": 42, "op": "usage"}))
            answer = _read_message(bad, decoder)
            assert answer["id"] == 42 and answer["ok"] and answer["result"]["entries"] >= 1
            # An impossible frame length: error, then only this connection is closed.
            bad.sendall(struct.pack(">I", protocol.MAX_FRAME + 1) + b"junk")
            answer = _read_message(bad, decoder)
            assert "exceeds" in answer["error"]["message"]
            assert _read_message(bad, decoder) is None
        finally:
            bad.close()
        f = files[3]
        path = await good.ensure(f.hash, f.size, location(url, f))
        assert Path(path).read_bytes() == f.data
        assert (await good.stats())["server"]["protocol_errors"] >= 3
    assert daemon.proc.poll() is None


def test_a_client_that_vanishes_with_answers_unread_is_an_ordinary_disconnect(daemon, client):
    # Closing a unix socket with bytes unread makes the peer's next read fail with
    # ECONNRESET (a job killed mid-epoch, a DataLoader worker's exit): mountd forgets the
    # connection like any other, with no traceback in its log.
    before = daemon.log()
    for _ in range(3):
        sock = _raw_connect(daemon)
        for i in range(20):
            sock.sendall(protocol.encode_frame({"id": i, "op": "usage"}))
        time.sleep(0.05)  # the answers arrive, unread
        sock.close()
    wait_until(lambda: client.stats()["server"]["connections"] == 1, 10, "the connections to go")
    new = daemon.log()[len(before):]
    assert "Traceback" not in new and "failed" not in new, new
    assert daemon.proc.poll() is None


def _as_nobody(fn) -> dict:
    """Run ``fn()`` in a forked child as uid/gid nobody; its JSON-able result."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: never return into pytest
        status = 0
        try:
            os.close(read_fd)
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            result = fn()
            os.write(write_fd, json.dumps(result).encode())
        except BaseException as exc:  # report anything, including assertion errors
            os.write(write_fd, json.dumps({"child_error": repr(exc)}).encode())
            status = 1
        finally:
            os._exit(status)
    os.close(write_fd)
    with os.fdopen(read_fd, "rb") as pipe:
        data = pipe.read()
    os.waitpid(pid, 0)
    return json.loads(data)


def _outcome(call) -> str:
    try:
        call()
        return "ok"
    except Exception as exc:
        return type(exc).__name__


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to run a client as uid nobody (os.setuid)")
def test_other_uids_cannot_connect_or_run_admin_ops(daemon):
    def connect_only():
        return {"connect": _outcome(lambda: SyncClient.connect(daemon.cache_dir).close())}

    assert _as_nobody(connect_only) == {"connect": "PermissionDenied"}  # the socket is 0600

    def try_everything():
        with SyncClient.connect(daemon.cache_dir) as c:
            return {
                "admin": c.hello_info["admin"],
                "uid": c.hello_info["peer"]["uid"],
                "stats": _outcome(c.stats),
                "evict": _outcome(lambda: c.evict(all=True)),
                "scrub": _outcome(c.scrub),
                "shutdown": _outcome(c.shutdown),
            }

    # Widen the socket by hand as an operator might (the cache directory is traversable
    # already: 0711): the SO_PEERCRED check still refuses admin ops.
    os.chmod(daemon.socket_path, 0o666)
    try:
        result = _as_nobody(try_everything)
    finally:
        os.chmod(daemon.socket_path, 0o600)
    assert result == {"admin": False, "uid": NOBODY, "stats": "ok", "evict": "PermissionDenied",
                      "scrub": "PermissionDenied", "shutdown": "PermissionDenied"}
    assert daemon.proc.poll() is None


async def test_registrations_follow_their_connection_and_hits_count(daemon, dataset):
    url, files = dataset
    f = files[4]
    async with open_client(daemon.cache_dir) as mount:
        handle = await mount.register("hits-ds", digest="/d/hits.digest", mountpoint="/mnt/hits",
                                      sources=[url])
        listing = await mount.ls()
        [record] = [m for m in listing["mounts"] if m["dataset"] == "hits-ds"]
        assert (record["mountpoint"], record["pid"], record["uid"]) == ("/mnt/hits", os.getpid(), os.getuid())
        assert "hits-ds" in listing["datasets"]
        await mount.ensure(f.hash, f.size, location(url, f), dataset="hits-ds")
        await mount.hits("hits-ds", [f.hash] * 3, 3 * f.size)
        async with open_client(daemon.cache_dir) as other:
            # The hits notification and this request travel on different connections: poll.
            async def counted():
                return (await other.stats())["counters"]["datasets"]["hits-ds"]["hits"] == 3

            with trio.fail_after(10):
                while not await counted():
                    await trio.sleep(0.01)
        await mount.unregister(handle)
        assert "hits-ds" not in (await mount.ls())["datasets"]
        await mount.register("hits-ds", mountpoint="/mnt/again")
    # The connection closed: mountd dropped its registration by itself.
    with SyncClient.connect(daemon.cache_dir) as c:
        wait_until(lambda: not [m for m in c.ls()["mounts"] if m["dataset"] == "hits-ds"], 10,
                   "the closed connection's mount to go")
        assert c.stats()["schemes"]["datasets"]["hits-ds"] == ["file"]


async def test_prefetch_fills_in_the_background(daemon, dataset):
    url, files = dataset
    batch = files[10:15]
    async with open_client(daemon.cache_dir) as c:
        queued = await c.prefetch([(f.hash, f.size, location(url, f)) for f in batch], dataset="pf")
        assert queued == len(batch)
        # A fill process renames the file into the store before its answer reaches mountd
        # (which then counts the GET): wait for the counts, not for the files.
        with trio.fail_after(10):
            while True:
                counters = (await c.stats())["counters"]["datasets"].get("pf", {})
                if counters.get("remote_requests", {}).get("GET", 0) >= len(batch):
                    break
                await trio.sleep(0.01)
        await trio.sleep(0.2)  # a sixth GET, were there one, would show by now
        counters = (await c.stats())["counters"]["datasets"]["pf"]
    assert counters["prefetches"] == 5 and counters["remote_requests"]["GET"] == 5
    for f in batch:
        assert layout.store_path(daemon.cache_dir, f.hash).read_bytes() == f.data


async def test_a_renewing_prefetch_protects_cached_files(daemon, dataset):
    url, files = dataset
    f = files[19]
    async with open_client(daemon.cache_dir) as c:
        await c.ensure(f.hash, f.size, location(url, f), dataset="renew")
        before = (await c.call("usage"))["protection"]["started"]
        assert await c.prefetch([(f.hash, f.size, location(url, f))], "renew", renew=True) == 0
        usage = (await c.call("usage"))["protection"]
        assert usage["started"] == before + 1 and usage["files"] >= 1
        with pytest.raises(ProtocolError, match="'renew' must be true or false"):
            await c.call("prefetch", {"items": [], "renew": "yes"})
        await c.hits("renew", [], 0, done=[f.hash])  # read for the epoch: evicted first
        with pytest.raises(ProtocolError, match="'done' must be hex digits"):
            await c.call("hits", {"packed": "", "bytes": 0, "done": "xyz"})
        assert (await c.call("usage"))["protection"]["files"] >= 1  # the connection still serves


def test_evict_removes_a_datasets_files(client, daemon, dataset):
    url, files = dataset
    batch = files[15:18]
    paths = [Path(client.ensure(f.hash, f.size, location(url, f), dataset="evict-me")) for f in batch]
    assert all(p.exists() for p in paths)
    result = client.evict("evict-me")
    assert result["files"] == 3 and result["bytes"] == sum(f.size for f in batch)
    assert not any(p.exists() for p in paths)
    with pytest.raises(ProtocolError, match="exactly one"):
        client.call("evict", {})


def test_scrub_finds_a_damaged_file_and_reports_progress(client, daemon, dataset):
    url, files = dataset
    f = files[19]
    path = Path(client.ensure(f.hash, f.size, location(url, f), dataset="scrub"))
    path.chmod(0o644)
    path.write_bytes(b"bit rot" + f.data[7:])
    frames = []
    report = client.scrub(progress=frames.append)
    assert report["bad"] == 1 and report["checked"] >= 2
    assert report["checked"] == report["ok"] + report["bad"] + report["missing"]
    assert all(set(frame) >= {"done", "total"} for frame in frames)
    assert not path.exists()
    # The next read fetches it again, verified.
    assert Path(client.ensure(f.hash, f.size, location(url, f))).read_bytes() == f.data


def test_metrics_endpoint_serves_prometheus_text(client, daemon):
    match = re.search(r"metrics on http://127\.0\.0\.1:(\d+)/metrics", daemon.log())
    assert match, daemon.log()
    base = f"http://127.0.0.1:{match.group(1)}"
    hits = client.stats()["counters"]["total"]["hits"]
    with urllib.request.urlopen(base + "/metrics", timeout=10) as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        text = response.read().decode()
    lines = text.splitlines()
    assert scraped(text)["quiverfs_hits_total"] == hits
    assert "# TYPE quiverfs_fill_latency_seconds histogram" in lines
    assert any(line.startswith("quiverfs_cache_used_bytes ") for line in lines)
    with pytest.raises(urllib.error.HTTPError) as missing:
        urllib.request.urlopen(base + "/nope", timeout=10)
    assert missing.value.code == 404
