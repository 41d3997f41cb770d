"""TLS between peers: transfers work and are encrypted on the wire; a peer without a
certificate from the cluster CA, or a server whose certificate names another host, is
refused; the options fail in one line at start-up."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import trio

from mountd.cluster.counters import ClusterCounters
from mountd.cluster.peer import PeerClient, PeerServer
from mountd.cluster.placement import owners
from mountd.cluster.tls import PeerTLS
from mountd.errors import PeerError
from mountd.rpc.client import SyncClient
from mountd.store.cache import Cache, CacheConfig
from quiverfs.testing.emulators import free_ports
from quiverfs.testing.mountd import location, make_dataset, running_mountd, wait_until
from quiverfs.testing.redis import RedisServer
from quiverfs.testing.tls import NodeCert, TestCA
from tests.cluster.conftest import SECRET, mountd_once, secret_file, until
from tests.mountd.conftest import Source

LIMITS = {"max_bytes": 16 << 20, "timeout": 5.0}
#: Where clients spool content above MEMORY_BYTES (none of these tests sends that much).
SPOOL = tempfile.gettempdir()
QUICK = {"max_bytes": 16 << 20, "timeout": 1.0}



def _tls(node: NodeCert) -> PeerTLS:
    return PeerTLS(node.cert, node.key, node.ca)


async def _relay(target: int, seen: bytearray, *,
                 task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
    """A TCP relay to 127.0.0.1:``target`` that keeps a copy of every byte it carries."""

    async def pipe(source: trio.abc.Stream, sink: trio.abc.Stream) -> None:
        while data := await source.receive_some(65536):
            seen.extend(data)
            await sink.send_all(data)
        await sink.send_eof()

    async def handle(client: trio.SocketStream) -> None:
        server = await trio.open_tcp_stream("127.0.0.1", target)
        try:
            async with client, server, trio.open_nursery() as nursery:
                nursery.start_soon(pipe, client, server)
                nursery.start_soon(pipe, server, client)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass

    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    async with trio.open_nursery() as nursery:
        await nursery.start(trio.serve_listeners, handle, listeners)
        task_status.started(listeners[0].socket.getsockname()[1])


async def test_transfers_over_tls_are_encrypted_and_need_the_cluster_ca(tmp_path: Path) -> None:
    ca, rogue = TestCA(tmp_path / "ca"), TestCA(tmp_path / "rogue", "another CA")
    server_tls, client_tls = _tls(ca.issue("a")), _tls(ca.issue("b"))
    source = Source(tmp_path / "remote")
    secret_text = b"the quick brown fox jumps over the lazy dog " * 50
    obj = source.add("f", secret_text)
    counters = ClusterCounters()
    async with trio.open_nursery() as nursery:
        cache = Cache(CacheConfig(cache_dir=tmp_path / "a", cache_size=64 << 20))
        await cache.open()
        await nursery.start(cache.run)
        await cache.ensure(obj.hash, obj.size, obj.location)
        server = PeerServer(cache, SECRET, counters, **QUICK, tls=server_tls.server_context())
        port = await nursery.start(server.serve, "127.0.0.1", 0)
        seen = bytearray()
        relayed = await nursery.start(_relay, port, seen)

        member = PeerClient(SECRET, ClusterCounters(), **LIMITS, spool=SPOOL, tls=client_tls.client_context())
        assert (await member.get(f"127.0.0.1:{relayed}", obj.hash, obj.size)).inline == secret_text
        assert counters.served_hits == 1 and len(seen) > len(secret_text)
        assert b"quick brown fox" not in seen  # the relay saw only ciphertext

        plain = PeerClient(SECRET, ClusterCounters(), **QUICK, spool=SPOOL)  # right secret, no TLS
        with pytest.raises(PeerError):  # both wait for the other's handshake: timed out
            await plain.get(f"127.0.0.1:{port}", obj.hash, obj.size)
        await until(lambda: counters.auth_failures == 1, "the server to refuse it")
        stranger = PeerClient(SECRET, ClusterCounters(), **LIMITS, spool=SPOOL,
                              tls=_tls(rogue.issue("x")).client_context())
        with pytest.raises(PeerError):  # the server is not in its CA: refused at once
            await stranger.get(f"127.0.0.1:{port}", obj.hash, obj.size)
        await until(lambda: counters.auth_failures == 2, "the server to see it fail")
        rogue_server = PeerServer(cache, SECRET, ClusterCounters(), **LIMITS,
                                  tls=_tls(rogue.issue("y")).server_context())
        rogue_port = await nursery.start(rogue_server.serve, "127.0.0.1", 0)
        with pytest.raises(PeerError):  # nor is a server with another CA's certificate
            await member.get(f"127.0.0.1:{rogue_port}", obj.hash, obj.size)
        elsewhere = PeerServer(cache, SECRET, ClusterCounters(), **LIMITS,
                               tls=_tls(ca.issue("c", host="10.1.2.3")).server_context())
        elsewhere_port = await nursery.start(elsewhere.serve, "127.0.0.1", 0)
        with pytest.raises(PeerError):  # a member's certificate for another host
            await member.get(f"127.0.0.1:{elsewhere_port}", obj.hash, obj.size)
        await trio.sleep(0.2)
        assert counters.served_hits == 1 and counters.auth_failures == 2  # nothing more served
        for client in (member, plain, stranger):
            await client.aclose()
        await cache.aclose()
        nursery.cancel_scope.cancel()


def test_bad_tls_options_are_one_line_errors(tmp_path: Path) -> None:
    ca = TestCA(tmp_path / "ca")
    node, other = ca.issue("a"), ca.issue("b")
    secret = secret_file(tmp_path)
    cluster = ["--cluster", "redis://127.0.0.1:1/0", "--advertise", "127.0.0.1:7000",
               "--cluster-secret-file", str(secret)]
    cases = [
        (cluster + ["--cluster-tls-cert", str(node.cert)], "needs all three"),
        (cluster + ["--cluster-tls-cert", str(node.cert), "--cluster-tls-key", str(other.key),
                    "--cluster-tls-ca", str(ca.path)], "cannot use"),
        (cluster + ["--cluster-tls-cert", str(node.cert), "--cluster-tls-key", str(node.key),
                    "--cluster-tls-ca", str(tmp_path / "none.pem")], "No such file"),
        (node.options(), "need --cluster"),
    ]
    for options, message in cases:
        done = mountd_once(tmp_path, *options)
        assert done.returncode == 2 and message in done.stderr, done.stderr
        assert len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_two_nodes_share_over_tls(tmp_path: Path, redis_server: RedisServer) -> None:
    ca = TestCA(tmp_path / "ca")
    url, files = make_dataset(tmp_path / "bucket", 12, size=5000)
    secret = secret_file(tmp_path)
    ports = free_ports(2)

    def options(i: int) -> list[str]:
        return ["--cluster", redis_server.url, "--advertise", f"127.0.0.1:{ports[i]}",
                "--cluster-secret-file", str(secret), *ca.issue(f"n{i}").options()]

    with running_mountd(tmp_path / "a", *options(0)) as a, \
            running_mountd(tmp_path / "b", *options(1)) as b, \
            SyncClient.connect(a.cache_dir) as ca_, SyncClient.connect(b.cache_dir) as cb:
        wait_until(lambda: len(cb.stats()["cluster"]["members"]) == 2, 30, "b to see a")
        wait_until(lambda: len(ca_.stats()["cluster"]["members"]) == 2, 30, "a to see b")
        for f in files:
            assert Path(ca_.ensure(f.hash, f.size, location(url, f))).read_bytes() == f.data
        for f in files:
            assert Path(cb.ensure(f.hash, f.size, location(url, f))).read_bytes() == f.data
        sa, sb = ca_.stats(), cb.stats()
        assert sum(s["counters"]["total"]["remote_requests"]["GET"] for s in (sa, sb)) == len(files)
        # What A owns is never pushed to B: B had it from A, over TLS.
        a_owns = sum(owners(f.hash, sb["cluster"]["members"])[0] == f"127.0.0.1:{ports[0]}"
                     for f in files)
        assert sb["cluster"]["tls"] is True and sb["cluster"]["peer_hits"] >= a_owns
        assert sa["cluster"]["auth_failures"] == sb["cluster"]["auth_failures"] == 0
