"""The mountd process: one nursery and one exit stack own the cache, the socket and metrics.

Start-up order (each step registers its teardown, which runs in reverse):

1. ``Cache.open()`` takes the cache directory's lock and recovers from any crash; a second
   mountd on the same directory stops here with :class:`AlreadyRunning` (exit status 75).
2. The socket file is (re)created at ``layout.socket_path`` with the mode and group of
   :class:`SocketAccess` (``0600`` by default) — any old file is stale, since we hold the
   lock — and removed again on the way out. A socket other users may connect to needs a
   cache directory they can traverse: a private store's (``0700``) is opened to ``0711``.
3. ``cache.run`` (background workers) starts with ``nursery.start``, then, with ``--cluster``,
   the cluster (its peer server and heartbeat: docs/cluster.md), handed to the cache as the
   source its misses ask before the bucket; then the server and the optional metrics
   endpoint; only then is the process ready.

SIGTERM and SIGINT (and the ``shutdown`` request) cancel the nursery: in-flight requests are
cancelled, the socket is removed, the cache is closed (its lock released). Their watcher
starts before the socket answers, and later ones, while mountd winds down, are ignored
(quiverfs/base/stop_signals.py). A ``kill -9``
leaves the socket file behind; the next mountd removes it, and the cache's crash recovery
deals with half-written fills.
"""

from __future__ import annotations

import contextlib
import grp
import logging
import os
import signal
import stat
import sys
from contextlib import AsyncExitStack
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import trio

from mountd.cluster.config import ClusterConfig
from mountd.cluster.service import Cluster
from mountd.coop.chunks import DEFAULT_GRACE
from mountd.coop.service import CoopService
from mountd.coop.sessions import SessionRegistry
from mountd.errors import AlreadyRunning, CacheLocked
from mountd.rpc.listener import bind_socket, check_socket_path
from mountd.rpc.server import Server
from mountd.stats.metrics import serve_metrics
from mountd.store import access, layout
from mountd.store.cache import Cache, CacheConfig
from mountd.store.fillpool import ProcessFills
from mountd.store.limits import spare_slots
from quiverfs.base.backends import BackendOptions, open_backend
from quiverfs.base.errors import UsageError
from quiverfs.base.stop_signals import stop_signal_receiver

log = logging.getLogger("mountd")


@dataclass(frozen=True)
class SocketAccess:
    """Who may connect to mountd's socket (docs/operations.md "Security"): its mode and group.

    ``connect()`` on a unix socket needs write permission on its file (and search permission
    on the folders above it). Whoever connects may ask for fills and read mountd's counters;
    admin operations still need root or mountd's uid (``SO_PEERCRED``).
    """

    #: Permission bits of the socket file; read/write bits only, mountd's own user included.
    mode: int = 0o600
    #: Group of the socket file (None: mountd's primary group, untouched).
    gid: int | None = None
    #: That group's name, for messages and ``hello`` (None: no group given).
    group: str | None = None

    def __post_init__(self) -> None:
        if self.mode & ~0o666 or self.mode & 0o600 != 0o600:
            raise UsageError(
                f"--socket-mode {self.mode:04o}: give read/write bits only (at most 0666), "
                "with 0600 for mountd's own user (e.g. 0600, 0660, 0666)")
        if self.gid is not None and not self.mode & stat.S_IWGRP:
            raise UsageError(
                f"--socket-group {self.group or self.gid} needs a --socket-mode that lets the "
                f"group connect (group write, e.g. 0660), not {self.mode:04o}")

    @property
    def admits_others(self) -> bool:
        """True when users other than mountd's (and root) may connect."""
        return bool(self.mode & (stat.S_IWGRP | stat.S_IWOTH))

    @property
    def shared(self) -> bool:
        """True when every local user may connect."""
        return bool(self.mode & stat.S_IWOTH)

    def describe(self) -> str:
        """``"0660, group ml"``, ``"0600"`` …: for the log and ``hello``."""
        return f"{self.mode:04o}" + (f", group {self.group}" if self.gid is not None else "")

    @classmethod
    def from_options(cls, mode: str | None = None, group: str | None = None,
                     shared: bool = False) -> SocketAccess:
        """From ``--socket-mode`` (octal text), ``--socket-group`` (name or number) and
        ``--shared``: a group alone means ``0660``, ``--shared`` ``0666``, nothing ``0600``."""
        if shared and (mode is not None or group is not None):
            raise UsageError("--shared lets every local user connect: give it alone, "
                             "or --socket-group/--socket-mode instead")
        bits = 0o666 if shared else 0o660 if group is not None else 0o600
        if mode is not None:
            text = mode.strip().lower().removeprefix("0o")
            try:
                bits = int(text, 8)
            except ValueError:
                raise UsageError(f"--socket-mode must be octal (e.g. 0660), not {mode!r}") from None
        if group is None:
            return cls(bits)
        gid, name = _group(group)
        return cls(bits, gid, name)


def _group(group: str) -> tuple[int, str]:
    """``(gid, name)`` of a group given by name or number; :class:`UsageError` if unknown."""
    try:
        entry = grp.getgrgid(int(group)) if group.isdigit() else grp.getgrnam(group)
    except (KeyError, OverflowError):
        if group.isdigit():
            return int(group), group  # a gid without a name is still a gid
        raise UsageError(f"--socket-group {group!r}: no such group") from None
    return entry.gr_gid, entry.gr_name


@dataclass(frozen=True)
class DaemonConfig:
    """What ``quiverfs mountd`` was asked for: the cache's config plus serving options."""

    cache: CacheConfig
    #: Port for the Prometheus endpoint on 127.0.0.1; None = no endpoint, 0 = any free port.
    metrics_port: int | None = None
    #: Force every dataset's residency mode ("lru" for comparisons); None = chosen from the
    #: cache budget (docs/substitutable-reads.md).
    dataset_mode: str | None = None
    #: Chunk slots of a chunked dataset: 2 = the paper's double buffering, 3 = the next chunk
    #: preloads while a marked one drains (docs/substitutable-reads.md, "Chunks").
    chunk_slots: int = 2
    #: Seconds a marked chunk stays resident after the last job finished it, so that the files
    #: each job was given last are still cached when its DataLoader reads them
    #: (docs/substitutable-reads.md, "Grace").
    chunk_grace: float = DEFAULT_GRACE
    #: Who may connect to the socket (``--socket-mode``, ``--socket-group``, ``--shared``).
    socket: SocketAccess = SocketAccess()
    #: Join a cluster of mountds (``--cluster``; docs/cluster.md); None: serve alone.
    cluster: ClusterConfig | None = None
    #: Fill processes (``--fill-processes``, mountd/store/fillpool.py): None one per core,
    #: 0 none (fills run in mountd's own threads).
    fill_processes: int | None = None

    def __post_init__(self) -> None:
        if not self.chunk_grace >= 0:  # also refuses NaN
            raise UsageError(f"chunk grace must be >= 0 seconds, got {self.chunk_grace}")
        if self.fill_processes is not None and self.fill_processes < 0:
            raise UsageError(f"--fill-processes must be 0 or more, not {self.fill_processes}")

    @property
    def processes(self) -> int:
        """The fill processes to fork: as asked, or one per core this process may run on."""
        if self.fill_processes is not None:
            return self.fill_processes
        return len(os.sched_getaffinity(0))


def make_fills(config: DaemonConfig) -> ProcessFills | None:
    """The fill processes ``config`` asks for, not started (None: fills in mountd's threads).
    Each process opens its own backends, with as many connections as it has threads."""
    processes = config.processes
    if not processes:
        return None
    cache = config.cache
    assert cache.fill_concurrency is not None
    # A thread for every fill slot: a source's own and the spare ones the others keep
    # (mountd/store/limits.py SourceSlots).
    threads = ProcessFills.threads_for(processes, cache.fill_concurrency
                                       + spare_slots(cache.fill_concurrency))
    options = BackendOptions(concurrency=threads)
    return ProcessFills(Path(cache.cache_dir), processes, threads,
                        partial(open_backend, options=options))


@dataclass(frozen=True)
class Running:
    """What :func:`serve` hands to ``nursery.start`` callers once ready."""

    server: Server
    socket_path: Path
    metrics_port: int | None
    #: The cluster's peer port (None: not in a cluster).
    peer_port: int | None = None


def make_server(cache: Cache, config: DaemonConfig, cluster: Cluster | None = None) -> Server:
    """The server of ``cache`` with its session layer (and ``cluster``), as ``config`` asks."""
    registry = SessionRegistry(chunk_slots=config.chunk_slots)
    # Before any dataset registers: each dataset's chunk manager takes it from here.
    registry.chunk_grace = config.chunk_grace
    coop = CoopService(cache, mode=config.dataset_mode, registry=registry, cluster=cluster)
    return Server(cache, config.cache.cache_dir, coop=coop, socket_mode=config.socket.mode,
                  socket_group=config.socket.group, cluster=cluster)


def _remove_socket(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()


async def _watch_signals(shutdown: trio.Event, *,
                         task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """Shut down at SIGTERM or SIGINT; started before the socket answers, so a signal sent
    once mountd answers always stops it. Those that come while it winds down are ignored
    (quiverfs/base/stop_signals.py): they used to kill it before its cache was closed."""
    with stop_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        task_status.started()
        async for signum in signals:
            log.info("%s: shutting down", signal.Signals(signum).name)
            shutdown.set()


async def serve(config: DaemonConfig, *, handle_signals: bool = True,
                fills: ProcessFills | None = None,
                task_status: trio.TaskStatus[Running] = trio.TASK_STATUS_IGNORED) -> None:
    """Run mountd until SIGTERM/SIGINT or a ``shutdown`` request; see the module doc.

    ``fills``: fill processes forked already (:func:`main` forks them before trio starts);
    without, the ones ``config`` asks for are forked here, and stopped on the way out."""
    cache_dir = Path(config.cache.cache_dir)
    socket_path = layout.socket_path(cache_dir)
    check_socket_path(socket_path)  # before touching the cache directory
    async with AsyncExitStack() as stack:
        if fills is None and (fills := make_fills(config)) is not None:
            stack.callback(fills.close)
        cache = Cache(config.cache, fills=fills)
        try:
            await cache.open()
        except CacheLocked as exc:
            if isinstance(exc, AlreadyRunning):
                raise
            raise AlreadyRunning(f"{exc} (another mountd serves {cache_dir}; use it)") from exc
        stack.push_async_callback(cache.aclose)

        _remove_socket(socket_path)  # stale from a killed mountd: we hold the lock, nobody owns it
        listener = bind_socket(socket_path, mode=config.socket.mode, gid=config.socket.gid)
        stack.callback(_remove_socket, socket_path)
        stack.callback(listener.close)
        if config.socket.admits_others:
            # Those it admits must reach it: a private store's cache directory is 0700.
            access.allow_traversal(cache_dir)

        cluster = None if config.cluster is None else Cluster(config.cluster, cache)
        server = make_server(cache, config, cluster)
        nursery = await stack.enter_async_context(trio.open_nursery())
        if handle_signals:
            await nursery.start(_watch_signals, server.shutdown)
        await nursery.start(cache.run)
        if cluster is not None:
            await nursery.start(cluster.run)
            cache.peers = cluster
        if server.coop is not None:
            stack.callback(server.coop.close)
            await nursery.start(server.coop.run)
        await nursery.start(server.serve, listener)
        metrics_port = None
        if config.metrics_port is not None:
            metrics_port = await nursery.start(serve_metrics, server, config.metrics_port)
            log.info("metrics on http://127.0.0.1:%d/metrics", metrics_port)
        log.info("mountd %d ready: cache %s (%s store), socket %s (%s), user quota %s", os.getpid(),
                 cache_dir, config.cache.store_modes.name, socket_path, config.socket.describe(),
                 "none" if config.cache.user_quota is None else f"{config.cache.user_quota} bytes")
        task_status.started(Running(server, socket_path, metrics_port,
                                    None if cluster is None else cluster.port))
        await server.shutdown.wait()
        nursery.cancel_scope.cancel()
    log.info("mountd %d stopped", os.getpid())


def main(config: DaemonConfig) -> None:
    """Run mountd in the foreground (``quiverfs mountd``); logs go to stderr.

    The fill processes are forked first, while this process has one thread and no open
    cache: they inherit no lock another thread holds, and nothing of the cache."""
    logging.basicConfig(
        level=logging.INFO, stream=sys.stderr,
        format="%(asctime)s mountd[%(process)d] %(levelname)s %(name)s: %(message)s",
    )
    fills = make_fills(config)
    if fills is not None:
        fills.start()
    try:
        trio.run(partial(serve, config, fills=fills))
    finally:
        if fills is not None:
            fills.close()
