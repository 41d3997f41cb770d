"""Serving the mountd protocol on a unix socket: connections, requests, permissions.

One task per connection reads frames and starts one task per request in the connection's
nursery, so a FUSE process can pipeline many misses over one connection and get each answer
as soon as its fill is done, in any order. A malformed frame or request gets an error
response and disturbs nothing else; only a frame header announcing more than
:data:`~mountd.rpc.protocol.MAX_FRAME` bytes (after which the stream cannot be resynchronised)
closes that one connection.

Peer credentials (``SO_PEERCRED``, :mod:`mountd.rpc.connection`) are read once per
connection; admin operations (``admin`` in :data:`~mountd.rpc.protocol.OPERATIONS`) are
refused unless the peer is root or the uid that owns mountd. The socket itself is created
``0600`` by :func:`mountd.rpc.listener.bind_socket` unless the operator chose a group or every
local user (``--socket-group``, ``--shared``), so by default only that uid (and root) can
connect at all; the credential check is the second line of defence.

Invariant: the registration tables (``mounts``, ``_dataset_refs``) are changed only from the
trio thread with no ``await`` in between reads and writes, so they need no lock.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import stat
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

from mountd.cluster.service import Cluster
from mountd.coop.service import CoopService, info_json
from mountd.errors import PermissionDenied, ProtocolError
from mountd.rpc import protocol
from mountd.rpc.connection import Connection, Peer, peer_credentials
from mountd.rpc.fdpass import DescriptorStream, close_all
from mountd.rpc.protocol import (
    MAX_OPEN,
    MAX_WAIT_MS,
    OPERATIONS,
    PROTOCOL_VERSION,
    Request,
    check_hash,
    check_int,
    check_item,
    check_list,
    check_packed_hashes,
    check_text,
)
from mountd.stats.costs import scheme_of
from mountd.stats.users import UserStats
from mountd.store.cache import Cache
from mountd.store.evictions import EvictionJournal
from mountd.store.supplied import SuppliedBytes
from quiverfs.base.backends.base import Location
from quiverfs.base.errors import QuiverError
from quiverfs.base.version import __version__

log = logging.getLogger("mountd.rpc.server")

#: The operations whose requests ``fill_stages`` times (``rpc``: reading and checking the
#: request; ``answer``: sending the answer).
FILL_OPS = frozenset({"ensure", "supply"})

#: Seconds between two progress frames of a long request (scrub).
PROGRESS_INTERVAL = 0.25


@dataclass(frozen=True, slots=True)
class WithDescriptors:
    """A handler's result that travels with descriptors (ops with ``reply_fds``). The server
    owns them once the handler returns: it sends them with the response (or not, when the
    client is gone) and always closes its own copies."""

    result: Any
    fds: list[int]


@dataclass(slots=True)
class MountRecord:
    """A registered mount (or any registered user of a dataset)."""

    id: int
    dataset: str
    digest: str | None
    mountpoint: str | None
    pid: int
    uid: int
    since: float
    connection: int

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class Server:
    """Answers protocol requests with a :class:`mountd.store.cache.Cache`.

    ``coop`` is the session layer (job sessions and claims, docs/substitutable-reads.md), made
    by the daemon (:func:`mountd.daemon.make_server`), which also starts its tick loop; None
    serves no session op (they fail with ``ProtocolError``). ``shutdown`` is an event the
    daemon waits on; the ``shutdown`` op sets it after answering. Requests are dispatched by
    :data:`mountd.rpc.protocol.OPERATIONS` to :attr:`handlers`, one per operation.
    """

    def __init__(self, cache: Cache, cache_dir: str | os.PathLike[str], *,
                 coop: CoopService | None = None, owner_uid: int | None = None,
                 fill_uid: int | None = None, socket_mode: int = 0o600,
                 socket_group: str | None = None, cluster: Cluster | None = None) -> None:
        self.cache = cache
        self.coop = coop
        #: This node's cluster (docs/cluster.md), for ``stats``; None: not in one.
        self.cluster = cluster
        #: What left the store, for mounts to drop from the kernel's page cache.
        self.evictions = EvictionJournal()
        cache.add_listener(self.evictions)
        self.cache_dir = Path(cache_dir)
        self.owner_uid = os.getuid() if owner_uid is None else owner_uid
        #: The uid whose rights mountd's own reads have (see :meth:`fills_for`).
        self.fill_uid = os.geteuid() if fill_uid is None else fill_uid
        #: Who may connect, as :func:`bind_socket` was asked (reported by ``hello``).
        self.socket_mode = socket_mode
        self.socket_group = socket_group
        self.started_at = time.time()
        self.shutdown = trio.Event()
        self.mounts: dict[int, MountRecord] = {}
        self._dataset_refs: dict[str, int] = defaultdict(int)
        #: Dataset (None: requests without one) → URL schemes its fills used, for cost estimates.
        self.schemes: dict[str | None, set[str]] = defaultdict(set)
        self._next_connection = 0
        self._next_mount = 0
        self.connections: dict[int, Connection] = {}
        self.requests_served = 0
        self.protocol_errors = 0
        #: Requests per uid (``stats`` → ``users``).
        self.users = UserStats()
        #: operation name → handler: exactly the names of mountd.rpc.protocol.OPERATIONS
        self.handlers: dict[str, Callable[[Connection, Request], Awaitable[Any]]] = {
            "hello": self._op_hello,
            "ensure": self._op_ensure,
            "supply": self._op_supply,
            "release": self._op_release,
            "prefetch": self._op_prefetch,
            "register": self._op_register,
            "unregister": self._op_unregister,
            "hits": self._op_hits,
            "open": self._op_open,
            "evictions": self._op_evictions,
            "stats": self._op_stats,
            "usage": self._op_usage,
            "ls": self._op_ls,
            "evict": self._op_evict,
            "scrub": self._op_scrub,
            "shutdown": self._op_shutdown,
            "session_open": self._op_session_open,
            "claim": self._op_claim,
            "next_epoch": self._op_next_epoch,
            "session_close": self._op_session_close,
            "report_batch": self._op_report_batch,
            "report_epoch": self._op_report_epoch,
            "timings": self._op_timings,
            "sessions": self._op_sessions,
        }
        if set(self.handlers) != set(OPERATIONS):
            raise AssertionError("mountd.rpc.server handlers and mountd.rpc.protocol.OPERATIONS disagree")

    # -- accepting ------------------------------------------------------------------------------

    async def serve(self, listener_socket: trio.socket.SocketType, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Accept connections on a listening socket until cancelled."""
        listener = trio.SocketListener(listener_socket)
        async with listener, trio.open_nursery() as nursery:
            task_status.started()
            while True:
                stream = await listener.accept()
                nursery.start_soon(self.handle_connection, stream)

    async def handle_connection(self, stream: trio.SocketStream) -> None:
        """Serve one connection until the client closes it; never raises for client faults."""
        try:
            peer = peer_credentials(stream.socket)
        except OSError:  # not a unix socket (tests) or the peer vanished already
            peer = Peer(0, -1, -1)
        self._next_connection += 1
        conn = Connection(self._next_connection, stream, peer, self.is_admin(peer.uid),
                          fills=self.fills_for(peer.uid))
        if hasattr(getattr(stream, "socket", None), "recvmsg"):
            conn.descriptors = DescriptorStream(stream.socket)
        self.connections[conn.id] = conn
        try:
            async with stream, trio.open_nursery() as nursery:
                with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                    await self._read_loop(conn, nursery)
                for scope in conn.waits:
                    scope.cancel()  # their answers would go nowhere
                # After EOF the requests already read still run and answer (a client may
                # half-close); their fills are useful to the cache whoever waits.
        except Exception:
            log.exception("connection %d from pid %d failed", conn.id, peer.pid)
        finally:
            conn.closed = True
            del self.connections[conn.id]
            if conn.descriptors is not None:
                conn.descriptors.close()
            with contextlib.suppress(QuiverError):
                self.cache.release(conn)  # its leases go to the next requester
            for mount_id in list(conn.mounts):
                self._drop_mount(mount_id)

    def is_admin(self, uid: int) -> bool:
        """Admin operations are for root and the uid that owns mountd."""
        return uid == 0 or uid == self.owner_uid

    def fills_for(self, uid: int) -> bool:
        """Whether mountd reads sources with its own rights for a peer: only when the peer
        runs as mountd's own (effective) uid, whose rights are mountd's anyway. Every other
        user supplies the bytes it read with its own rights (docs/operations.md
        "Security"): a shared mountd never lends its authority."""
        return uid == self.fill_uid

    async def _read_loop(self, conn: Connection, nursery: trio.Nursery) -> None:
        reader = protocol.ExactReader(conn.descriptors or conn.stream)
        while True:
            try:
                header = await reader.read_exactly(protocol.HEADER.size, eof_ok=True)
                if header is None:
                    return
                body = await reader.read_exactly(protocol.frame_length(header), eof_ok=False)
                assert body is not None
            except ProtocolError as exc:
                # An oversized or truncated frame: the byte stream cannot be resynchronised.
                self.protocol_errors += 1
                await conn.send(protocol.error_response(None, exc))
                return
            rid: protocol.RequestId = None
            wall, cpu = time.perf_counter(), time.thread_time()
            try:
                message = protocol.decode_body(body)
                rid = protocol.request_id_of(message)
                request = protocol.parse_request(message)
                if request.op in FILL_OPS:  # the "rpc" stage of fill_stages
                    self.cache.counters.stages.add("rpc", time.perf_counter() - wall,
                                                   time.thread_time() - cpu)
                wanted = protocol.fds_wanted(request)
                if wanted:
                    if conn.descriptors is None:
                        raise ProtocolError("this connection cannot carry descriptors")
                    request = dataclasses.replace(request, fds=conn.descriptors.take(wanted))
            except ProtocolError as exc:
                self.protocol_errors += 1
                await conn.send(protocol.error_response(rid, exc))
                continue
            await conn.slots.acquire()
            nursery.start_soon(self._run_request, conn, request)

    async def _run_request(self, conn: Connection, request: Request) -> None:
        user = self.users[conn.peer.uid]
        user.requests += 1
        reply_fds: list[int] = []
        try:
            try:
                if OPERATIONS[request.op].admin and not conn.admin:
                    user.refused += 1
                    raise PermissionDenied(
                        f"{request.op} needs root or uid {self.owner_uid} (mountd's owner); "
                        f"the caller is uid {conn.peer.uid}"
                    )
                result = await self.handlers[request.op](conn, request)
                if isinstance(result, WithDescriptors):
                    result, reply_fds = result.result, result.fds
                response = protocol.ok_response(request.id, result, len(reply_fds))
            except QuiverError as exc:
                if isinstance(exc, ProtocolError):
                    self.protocol_errors += 1
                response = protocol.error_response(request.id, exc)
            except Exception as exc:
                log.exception("%s request failed", request.op)
                response = protocol.error_response(request.id, exc)
            self.requests_served += 1
            if request.wants_response:
                wall = time.perf_counter()
                await conn.send(response, reply_fds)
                if request.op in FILL_OPS:  # the "answer" stage of fill_stages (wall only)
                    self.cache.counters.stages.add("answer", time.perf_counter() - wall)
            elif not response["ok"]:
                log.warning("notification %s failed: %s", request.op, response["error"]["message"])
        finally:
            close_all(request.fds)  # handlers dup what they keep
            close_all(reply_fds)  # sent (the client has its own copies), or the client is gone
            conn.slots.release()
        if request.op == "shutdown" and response["ok"]:
            self.shutdown.set()

    # -- operations -------------------------------------------------------------------------

    async def _op_hello(self, conn: Connection, request: Request) -> dict[str, Any]:
        version = check_int(request.args, "version")
        if version != PROTOCOL_VERSION:
            raise ProtocolError(
                f"client speaks mountd protocol {version}, this mountd speaks {PROTOCOL_VERSION}: "
                "run the same quiverfs version on both sides"
            )
        return {
            "version": PROTOCOL_VERSION,
            "server": __version__,
            "pid": os.getpid(),
            "uid": self.owner_uid,
            "cache_dir": str(self.cache_dir),
            "cache_size": self.cache.config.cache_size,
            "capacity": self.cache.capacity,
            "started_at": self.started_at,
            "ops": sorted(OPERATIONS),
            "peer": dataclasses.asdict(conn.peer),
            "admin": conn.admin,
            # Who reads sources on a miss: mountd ("mountd"), or the client, which supplies
            # the bytes ("client": the answer to ``ensure`` may be ``{"supply": true}``).
            "fills": "mountd" if conn.fills else "client",
            "socket": {"mode": f"{self.socket_mode:04o}", "group": self.socket_group,
                       "shared": bool(self.socket_mode & stat.S_IWOTH)},
            "store_access": self.cache.config.store_modes.name,
            # How files fetched ahead are kept until read (docs/store-layout.md "Holds and
            # protection"): a mount's bounded sweep sizes itself by ``sweep_share`` and its
            # renewals by ``protect_seconds``.
            "protect_share": self.cache.config.protect_share,
            "sweep_share": self.cache.config.sweep_share,
            "protect_seconds": self.cache.config.protect_seconds,
        }

    def _note_scheme(self, dataset: str | None, url: str) -> None:
        self.schemes[dataset].add(scheme_of(url))

    async def _op_ensure(self, conn: Connection, request: Request) -> dict[str, Any]:
        digest, size, where = check_item(request.args)
        dataset = check_text(request.args, "dataset", optional=True)
        self._note_scheme(dataset, where["url"])
        self.users[conn.peer.uid].ensures += 1
        if not conn.fills:
            # Served from the cache by hash (the capability), or the caller must supply the
            # bytes it reads with its own rights; mountd never reads for it.
            path = await self.cache.lease(digest, size, dataset, holder=conn, uid=conn.charge_uid)
            return {"supply": True} if path is None else {"path": os.fspath(path)}
        path = await self.cache.ensure(digest, size, Location(**where), dataset,
                                       uid=conn.charge_uid)
        return {"path": os.fspath(path)}

    async def _op_supply(self, conn: Connection, request: Request) -> dict[str, Any]:
        digest, size, where = check_item(request.args)
        dataset = check_text(request.args, "dataset", optional=True)
        offset = check_int(request.args, "offset", default=0)
        if len(request.fds) != 1:
            raise ProtocolError("supply carries exactly one descriptor (fds: 1)")
        self._note_scheme(dataset, where["url"])
        source = SuppliedBytes(os.dup(request.fds[0]), offset, holder=conn)
        path = await self.cache.ensure_supplied(digest, size, Location(**where), source, dataset,
                                                uid=conn.charge_uid)
        if source.adopted:  # its bytes were stored (a hit, or another's fill, leaves it unused)
            user = self.users[conn.peer.uid]
            user.supplied += 1
            user.supplied_bytes += size
        return {"path": os.fspath(path)}

    async def _op_release(self, conn: Connection, request: Request) -> dict[str, Any]:
        hashes = [check_hash(h) for h in check_list(request.args, "hashes")]
        return {"released": self.cache.release(conn, hashes)}

    async def _op_prefetch(self, conn: Connection, request: Request) -> dict[str, Any]:
        dataset = check_text(request.args, "dataset", optional=True)
        if not conn.fills:
            # Prefetch would read with mountd's rights: clients that supply their own
            # bytes prefetch by supplying them (the mount does).
            check_list(request.args, "items")
            return {"queued": 0}
        renew = request.args.get("renew", False)
        if not isinstance(renew, bool):
            raise ProtocolError("'renew' must be true or false")
        items = []
        for raw in check_list(request.args, "items"):
            digest, size, where = check_item(raw)
            items.append((digest, size, Location(**where)))
        for url in {loc.url for _, _, loc in items}:
            self._note_scheme(dataset, url)
        return {"queued": self.cache.prefetch(items, dataset, uid=conn.charge_uid, renew=renew)}

    async def _op_hits(self, conn: Connection, request: Request) -> dict[str, Any]:
        dataset = check_text(request.args, "dataset", optional=True)
        if "packed" in request.args:
            hashes = check_packed_hashes(request.args, "packed")
        else:
            hashes = [check_hash(h) for h in check_list(request.args, "hashes")]
        nbytes = check_int(request.args, "bytes")
        self.cache.record_hits(dataset, hashes, nbytes)
        if "done" in request.args:  # read for this epoch (after the hits: they touch them)
            self.cache.record_read_done(check_packed_hashes(request.args, "done"))
        if "opened" in request.args:
            opened = check_packed_hashes(request.args, "opened")
            self.cache.record_opened(dataset, opened)
            if self.coop is not None:
                self.coop.record_opened(dataset, opened)
        user = self.users[conn.peer.uid]
        user.reported_hits += len(hashes)
        user.reported_hit_bytes += nbytes
        return {"recorded": len(hashes)}

    async def _op_open(self, conn: Connection, request: Request) -> WithDescriptors:
        """Descriptor hand-off: the store files of cached hashes, opened by mountd for a
        client that may not open them itself (a private store). Anyone connected may ask: a
        hash is the capability to its content (DESIGN.md "Many users, one cache"), and only
        hashes the store holds, verified, are ever opened."""
        args = _known_args(request, {"dataset", "hashes", "sizes"})
        dataset = check_text(args, "dataset", optional=True)
        raw = check_list(args, "hashes")
        if len(raw) > MAX_OPEN:
            raise ProtocolError(f"open takes at most {MAX_OPEN} hashes per request, not {len(raw)}")
        hashes = [check_hash(h) for h in raw]
        sizes: list[int | None] = [None] * len(hashes)
        if args.get("sizes") is not None:
            given = check_list(args, "sizes")
            if len(given) != len(hashes):
                raise ProtocolError("'sizes' must give one size per hash")
            sizes = [check_int({"size": v}, "size") for v in given]
        if conn.descriptors is None:
            raise ProtocolError("this connection cannot carry descriptors")
        opened = self.cache.open_cached(hashes, sizes, dataset)
        fds = [item[0] for item in opened if item is not None]
        user = self.users[conn.peer.uid]
        user.opens += 1
        user.opened += len(fds)
        user.reported_hits += len(fds)
        user.reported_hit_bytes += sum(item[1] for item in opened if item is not None)
        return WithDescriptors({"sizes": [None if item is None else item[1] for item in opened]}, fds)

    async def _op_evictions(self, conn: Connection, request: Request) -> dict[str, Any]:
        seq = None if request.args.get("since") is None else check_int(request.args, "since")
        journal = check_text(request.args, "journal", optional=True)
        wait = check_int(request.args, "wait_ms", default=0)
        if wait > MAX_WAIT_MS:
            raise ProtocolError(f"'wait_ms' must be at most {MAX_WAIT_MS}, not {wait}")
        changed = self.evictions.changed(seq, journal) if wait else None
        if changed is not None:
            # Nothing new yet: answer at the next eviction (a mount closes the evicted
            # files it holds open at once: docs/mount.md "Kept descriptors").
            with trio.move_on_after(wait / 1000) as scope:
                conn.waits.add(scope)
                try:
                    await changed.wait()
                finally:
                    conn.waits.discard(scope)
        return self.evictions.since(seq, journal)

    async def _op_register(self, conn: Connection, request: Request) -> dict[str, Any]:
        args = request.args
        dataset = check_text(args, "dataset")
        digest = check_text(args, "digest", optional=True)
        mountpoint = check_text(args, "mountpoint", optional=True)
        pid = check_int(args, "pid", default=conn.peer.pid)
        raw_sources = check_list(args, "sources") if args.get("sources") is not None else []
        sources = [check_text({"source": s}, "source") for s in raw_sources]
        assert dataset is not None
        if digest is not None and not conn.fills:
            try:
                _check_opened(digest, request.fds, conn.peer)
            except PermissionDenied:
                self.users[conn.peer.uid].refused += 1
                raise
        for url in sources:
            self._note_scheme(dataset, url)
        if conn.fills:  # mountd reads this dataset's sources for it: have them ready
            self.cache.warm_backends(sources)
        self._next_mount += 1
        record = MountRecord(
            self._next_mount, dataset, digest, mountpoint, pid, conn.peer.uid, time.time(), conn.id
        )
        if self._dataset_refs[dataset] == 0:
            info = {"digest": digest, "mountpoint": mountpoint, "pid": pid, "uid": conn.peer.uid,
                    "sources": sources}
            self.cache.register_dataset(dataset, info)
        if self.coop is not None:
            self.coop.dataset_registered(dataset, digest, fills=conn.fills)
        self._dataset_refs[dataset] += 1
        self.mounts[record.id] = record
        conn.mounts.add(record.id)
        return {"mount": record.id}

    def _drop_mount(self, mount_id: int) -> bool:
        record = self.mounts.pop(mount_id, None)
        if record is None:
            return False
        conn = self.connections.get(record.connection)
        if conn is not None:
            conn.mounts.discard(mount_id)
        self._dataset_refs[record.dataset] -= 1
        if self._dataset_refs[record.dataset] <= 0:
            del self._dataset_refs[record.dataset]
            try:
                self.cache.unregister_dataset(record.dataset)
            except QuiverError as exc:
                log.warning("unregister %s: %s", record.dataset, exc)
            if self.coop is not None:
                self.coop.dataset_unregistered(record.dataset)
        return True

    async def _op_unregister(self, conn: Connection, request: Request) -> dict[str, Any]:
        args = request.args
        if ("mount" in args) == ("dataset" in args):
            raise ProtocolError("unregister needs exactly one of 'mount' or 'dataset'")
        if "mount" in args:
            ids = [check_int(args, "mount")]
        else:
            dataset = check_text(args, "dataset")
            ids = [m.id for m in self.mounts.values() if m.dataset == dataset]
        removed = sum(self._drop_mount(i) for i in ids)
        return {"removed": removed}

    def _schemes_json(self) -> dict[str, Any]:
        total: set[str] = set()
        for found in self.schemes.values():
            total |= found
        return {
            "total": sorted(total),
            "datasets": {k: sorted(self.schemes[k]) for k in sorted(k for k in self.schemes if k is not None)},
        }

    async def _op_stats(self, conn: Connection, request: Request) -> dict[str, Any]:
        return self.stats_snapshot()

    def stats_snapshot(self) -> dict[str, Any]:
        """The ``stats`` answer: cache counters, URL schemes per dataset, server gauges, and
        the cluster's membership and counters when in one."""
        cluster = {} if self.cluster is None else {"cluster": self.cluster.snapshot()}
        return {
            **cluster,
            "counters": self.cache.counters.snapshot(),
            "users": self.users.snapshot(self.cache.charges.snapshot(self.users.by_uid)),
            "schemes": self._schemes_json(),
            # Each remote source opened: requests, retries, failures, how reads go.
            "sources": self.cache.backend_counters(),
            # Layout problems found at registration (a packed chunk too large for the cache).
            "warnings": sorted(self.coop.warnings.values()) if self.coop is not None else [],
            "server": {
                "pid": os.getpid(),
                "uptime": time.time() - self.started_at,
                "connections": len(self.connections),
                "mounts": len(self.mounts),
                "requests_served": self.requests_served,
                "protocol_errors": self.protocol_errors,
            },
            # Who gets the cache: per dataset mode, bytes, G_D and why; per job b and g.
            "allocation": self.coop.allocation_json() if self.coop is not None else None,
        }

    async def _op_usage(self, conn: Connection, request: Request) -> dict[str, Any]:
        return self.cache.usage()

    async def _op_ls(self, conn: Connection, request: Request) -> dict[str, Any]:
        return {
            "usage": self.cache.usage(),
            "mounts": [m.to_json() for m in sorted(self.mounts.values(), key=lambda m: m.id)],
            "datasets": sorted(self._dataset_refs),
        }

    async def _op_evict(self, conn: Connection, request: Request) -> dict[str, Any]:
        args = request.args
        everything = args.get("all", False)
        if not isinstance(everything, bool):
            raise ProtocolError("'all' must be true or false")
        dataset = check_text(args, "dataset", optional=True)
        if everything == (dataset is not None):
            raise ProtocolError("evict needs exactly one of 'dataset' or 'all': true")
        files, nbytes = self.cache.evict(None if everything else dataset)
        return {"files": files, "bytes": nbytes}

    async def _op_scrub(self, conn: Connection, request: Request) -> Any:
        latest: list[Any] = [None]
        sent: list[Any] = [None]

        def progress(*args: Any, **kwargs: Any) -> None:
            # May be called from a worker thread: only store (list item assignment is atomic).
            latest[0] = protocol.progress_value(args, kwargs)

        async def ticker() -> None:
            while True:
                await trio.sleep(PROGRESS_INTERVAL)
                if latest[0] is not None and latest[0] != sent[0] and request.wants_response:
                    sent[0] = latest[0]
                    await conn.send(protocol.progress_message(request.id, latest[0]))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(ticker)
            report = await self.cache.scrub(progress=progress)
            nursery.cancel_scope.cancel()
        return protocol.json_value(report)

    # -- job sessions (docs/control-protocol.md; errors carry errno: mountd.coop.requests) ----------

    def _coop(self) -> CoopService:
        if self.coop is None:
            raise ProtocolError("this mountd has no session layer")
        return self.coop

    async def _op_session_open(self, conn: Connection, request: Request) -> dict[str, Any]:
        a = _known_args(request, {"dataset", "job", "rank", "world_size", "epoch", "seed", "lookahead",
                                    "scope"})
        dataset, job = a.pop("dataset", None), a.pop("job", None)
        return await self._coop().open_session(dataset, job, **a)

    async def _op_claim(self, conn: Connection, request: Request) -> dict[str, Any]:
        a = _known_args(request, {"dataset", "job", "rank", "n", "epoch", "batch"})
        return self._coop().claim(a.get("dataset"), a.get("job"), a.get("rank"), a.get("n"),
                                  a.get("epoch"), a.get("batch"))

    async def _op_next_epoch(self, conn: Connection, request: Request) -> dict[str, Any]:
        a = _known_args(request, {"dataset", "job", "rank", "epoch"})
        coop = self._coop()
        info = coop.registry.next_epoch(a.get("dataset"), a.get("job"), a.get("rank"), a.get("epoch"))
        coop.wake()
        return info_json(info)

    async def _op_session_close(self, conn: Connection, request: Request) -> dict[str, Any]:
        a = _known_args(request, {"dataset", "job", "rank", "seconds"})
        coop = self._coop()
        coop.registry.close_session(a.get("dataset"), a.get("job"), a.get("rank"), seconds=a.get("seconds"))
        coop.wake()
        return {"closed": True}

    async def _op_report_batch(self, conn: Connection, request: Request) -> dict[str, Any]:
        a = _known_args(request, {"dataset", "job", "rank", "seconds", "files", "misses"})
        self._coop().registry.report_batch(a.get("dataset"), a.get("job"), a.get("rank"), a.get("seconds"),
                                           a.get("files"), a.get("misses"))
        return {"recorded": 1}

    async def _op_report_epoch(self, conn: Connection, request: Request) -> dict[str, Any]:
        a = _known_args(request, {"dataset", "job", "rank", "epoch", "seconds"})
        self._coop().registry.report_epoch(
            a.get("dataset"), a.get("job"), a.get("rank"), a.get("epoch"), a.get("seconds")
        )
        return {"recorded": 1}

    async def _op_timings(self, conn: Connection, request: Request) -> dict[str, Any]:
        a = _known_args(request, {"dataset", "job"})
        return protocol.json_value(self._coop().registry.timings(a.get("dataset"), a.get("job")))

    async def _op_sessions(self, conn: Connection, request: Request) -> dict[str, Any]:
        return {"sessions": self._coop().sessions()}

    async def _op_shutdown(self, conn: Connection, request: Request) -> dict[str, Any]:
        log.info("shutdown requested by uid %d (pid %d)", conn.peer.uid, conn.peer.pid)
        return {"stopping": True, "pid": os.getpid()}


def _check_opened(digest: str, fds: tuple[int, ...], peer: Peer) -> None:
    """A peer mountd does not read for may register a digest only by showing it opened it:
    the descriptor it sent must be the file at ``digest`` (same device and inode). Otherwise
    mountd would load, with its own rights, a digest the peer may not read."""
    try:
        same = bool(fds) and os.path.samestat(os.fstat(fds[0]), os.stat(digest))
    except OSError:
        same = False
    if not same:
        raise PermissionDenied(
            f"uid {peer.uid} may register digest {digest} only with the file opened "
            "(the mount sends it); this user cannot open it")


def _known_args(request: Request, allowed: set[str]) -> dict[str, Any]:
    """A request's arguments; unknown ones are a :class:`ProtocolError`. A session request's
    values are checked by :class:`mountd.coop.sessions.SessionRegistry` (``InvalidRequest``,
    errno EINVAL)."""
    unknown = set(request.args) - allowed
    if unknown:
        raise ProtocolError(f"unknown arguments of {request.op}: {', '.join(sorted(unknown))[:200]}")
    return dict(request.args)
