"""The serving process of a mount: the filesystem, the FUSE machinery and mountd, joined.

The serving process owns, in order (teardown in reverse): a private copy of the digest
(quiverfs/filesystem/snapshot.py: the user may change the file under the mount, taken by
quiverfs/mount/start.py), opened and validated first, so a bad digest fails before anything is
mounted; a mountd client (a mountd is started on demand when none answers), the registration
of the dataset with mountd, the FUSE session, the worker pool (quiverfs/fuse/worker_pool.py: a
worker that dies is replaced and its request answered), and a nursery with the hit reporter,
the read-ahead sender and the signal watcher.

mountd going away does not stop the mount: hits need no mountd, misses and control requests
wait up to ``--mountd-wait`` seconds for it to answer again (quiverfs/mount/mountd_wait.py) and
fail with EIO after that, and the client reconnects (and registers again) on the next request. A
mountd that this mount started on demand is started again on demand; one that was already
running (a service) is left to its supervisor.
"""

from __future__ import annotations

import dataclasses
import errno
import gc
import logging
import os
import signal
import socket
import struct
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import trio

from quiverfs.base.errors import QuiverError
from quiverfs.base.stop_signals import stop_signal_receiver
from quiverfs.filesystem import reads
from quiverfs.filesystem.fs import KeepTerms, QuiverOperations, StoreFileOpen
from quiverfs.filesystem.readahead import WINDOW, WINDOW_BYTES
from quiverfs.filesystem.supply import Supplier
from quiverfs.filesystem.sweep import FACTOR
from quiverfs.fuse import channel as fuse_channel
from quiverfs.fuse import passthrough
from quiverfs.fuse import worker as fuse_worker
from quiverfs.fuse.worker_pool import MAX_RESTARTS, RESTART_WINDOW, WorkerPool
from quiverfs.mount.mountd_wait import MOUNTD_WAIT, MountdWait, PatientSessions
from quiverfs.mount.mountpoint import (
    MountError,
    MountIdentity,
    claim_mountpoint,
    mount_identity,
    unmount_own,
)
from quiverfs.protocol import fuse_wire, worker_messages

log = logging.getLogger("quiverfs.mount")

#: Seconds between two batches of hit reports to mountd. A report is also what ends the
#: protection of a file fetched ahead (mountd/store/holds.py): at 1 s, a job reading 160
#: files/s kept a second of files already read protected, most of a small cache's share.
HITS_INTERVAL = 0.25

#: Milliseconds a question to mountd's eviction journal waits for news: mountd answers as
#: soon as it evicts (docs/mountd-protocol.md ``evictions``), or after this with none.
EVICTIONS_WAIT_MS = 10_000

#: Seconds between an answer of the eviction journal and the next question: evictions in
#: between come in one answer (a burst costs mountd a few answers, not one per file).
EVICTIONS_BATCH = 0.02

#: Seconds before asking again when mountd is away, or answers without waiting.
EVICTIONS_RETRY = 0.5

#: Most hashes mountd answers at once (mountd.store.evictions.MAX_ANSWER): a full page asks again.
EVICTIONS_PAGE = 20_000

#: Hashes per ``hits`` notification (well under the protocol's MAX_ITEMS).
HITS_BATCH = 50_000

#: Who can speak FUSE for a mount (docs/mount.md "Front ends"): our own protocol code with
#: forked workers, or pyfuse3 in the main process (quiverfs/fuse/frontend_pyfuse3.py).
NATIVE, PYFUSE3 = FRONTENDS = ("native", "pyfuse3")


@dataclass(frozen=True)
class MountOptions:
    """What ``quiverfs mount`` was asked for."""

    digest: Path
    mountpoint: Path
    cache_dir: Path | None = None  #: None: the default cache directory
    cache_size: str | None = None  #: for a mountd started on demand; None: mountd's default
    allow_other: bool = False  #: let other users read the mount (root, or user_allow_other)
    debug: bool = False  #: log every failure with details
    workers: int = 0  #: processes serving FUSE requests; 0: one per core, 2 to 4
    frontend: str = NATIVE  #: who speaks FUSE, one of FRONTENDS
    nonempty: bool = False  #: mount over a directory that has entries (hiding them)
    readahead: int = WINDOW  #: files read ahead of a scan in digest order; 0: off
    sweep: int = FACTOR  #: files fetched ahead of reads that are not a scan, per file read; 0: off
    mountd_wait: float = MOUNTD_WAIT  #: seconds a miss or control request waits for mountd
    #: cached files read by the kernel from their store files (quiverfs/fuse/passthrough.py);
    #: None: where the kernel allows it and the dataset's files are large (PASSTHROUGH_MEAN_BYTES)
    passthrough: bool | None = None

    def resolved(self) -> MountOptions:
        """The same options with absolute paths (a detached child runs in ``/``); the mount
        point without symbolic links, as the kernel lists it in ``/proc/mounts``."""
        from mountd.rpc.client import resolve_socket

        cache_dir, _ = resolve_socket(self.cache_dir)
        return dataclasses.replace(
            self,
            digest=Path(os.path.abspath(os.path.expanduser(self.digest))),
            mountpoint=Path(os.path.realpath(os.path.expanduser(self.mountpoint))),
            cache_dir=cache_dir,
        )


def store_bytes(info: dict) -> int | None:
    """What mountd's store holds at most, as its ``hello`` answer (``info``) says: its
    ``capacity`` (the cap, or the filesystem holding the store when that is smaller), else
    its ``cache_size``; None when it says neither."""
    for key in ("capacity", "cache_size"):
        size = info.get(key)
        if isinstance(size, int) and not isinstance(size, bool) and size > 0:
            return size
    return None


class MountdFetcher:
    """The :class:`quiverfs.filesystem.fs.Fetcher` and :class:`quiverfs.filesystem.fs.Prefetcher` of
    a mount: mountd's ``ensure`` and ``prefetch`` for one dataset."""

    def __init__(self, client, dataset: str, wait: MountdWait | None = None) -> None:
        self.client = client
        self.dataset = dataset
        #: how long a miss waits for a mountd that is away (restarting)
        self.wait = wait or MountdWait(0)
        #: Fills with this process's own rights, for a mountd that runs as another user.
        self.supplier = Supplier(client, dataset)

    @property
    def supplies(self) -> bool:
        """mountd does not read sources for us (it said so in ``hello``): we supply them."""
        return self.client.info.get("fills") == "client"

    async def ensure(self, entry) -> str:
        return await self.wait.call(lambda: self._ensure(entry), "a read")

    async def _ensure(self, entry) -> str:
        if self.supplies:
            return await self.supplier.ensure(entry)
        path = await self.client.lease(entry.hash, entry.size, entry.location, self.dataset)
        if path is None:  # mountd (restarted as another user?) asks us to supply
            return await self.supplier.ensure(entry)
        return path

    async def cache_bytes(self) -> int | None:
        size = store_bytes(self.client.info)
        if size is not None:
            return size
        log.info("read-ahead does not know the cache's size: windows up to %d MiB",
                 WINDOW_BYTES >> 20)
        return None

    async def keep_terms(self) -> KeepTerms | None:
        info = self.client.info
        share, seconds = info.get("sweep_share"), info.get("protect_seconds")
        if self.supplies or not isinstance(share, (int, float)) or not isinstance(seconds, (int, float)):
            return None  # our own fills are not protected; or a mountd that does not say
        return KeepTerms(float(share), float(seconds))

    async def prefetch(self, entries, *, renew: bool = False) -> None:
        from mountd.errors import MountdUnavailable

        if self.supplies:
            await self.supplier.prefetch(entries)
            return
        items = [(entry.hash, entry.size, entry.location) for entry in entries]
        try:
            await self.client.prefetch(items, self.dataset, wait=False, renew=renew)
        except (MountdUnavailable, QuiverError, OSError) as exc:
            # Read-ahead is advisory: the reads fetch what it could not.
            log.debug("dropped read-ahead of %d files: %s", len(items), exc)


class Status:
    """The write end of a detached mount's status pipe: ``mounted ID DEV`` once the mount
    exists, then ``ready`` or ``error: MESSAGE``, then closed."""

    def __init__(self, fd: int | None) -> None:
        self.fd = fd

    def mounted(self, mine: MountIdentity | None) -> None:
        """Tell the parent which mount is ours, so that it never removes another one."""
        if self.fd is not None and mine is not None:
            with suppress(OSError):
                os.write(self.fd, f"mounted {mine[0]} {mine[1]}\n".encode())

    def send(self, line: str) -> None:
        if self.fd is None:
            return
        with suppress(OSError):
            os.write(self.fd, (line.replace("\n", " ") + "\n").encode())
        with suppress(OSError):
            os.close(self.fd)
        self.fd = None


async def _report_hits(ops, client, dataset: str) -> None:
    """Every HITS_INTERVAL, send the hits queued by ``ops`` to mountd (dropped if it is away)."""
    from mountd.errors import MountdUnavailable

    while True:
        await trio.sleep(HITS_INTERVAL)
        ops.refresh_open_reports()
        hashes, nbytes = ops.take_hits()
        done = ops.take_read_done()  # a bounded sweep's reads: mountd evicts these first
        opened = ops.take_opened()  # files opened, read from the kernel's pages or not
        if not hashes and not done and not opened:
            continue
        try:
            for start in range(0, max(len(hashes), len(done), len(opened)), HITS_BATCH):
                batch = hashes[start:start + HITS_BATCH]
                # Bytes go with the first batch; mountd only sums them.
                await client.hits(dataset, batch, nbytes if start == 0 else 0,
                                  done[start:start + HITS_BATCH],
                                  opened[start:start + HITS_BATCH])
        except (MountdUnavailable, QuiverError, OSError) as exc:
            # Hit reports are advisory (they feed mountd's recency and statistics).
            log.debug("dropped %d hit reports: %s", len(hashes), exc)


async def _forget_evicted(ops, client, invalidate: Callable[[list[int]], None],
                          sweep: Callable[[], None] | None = None) -> None:
    """As mountd evicts, drop from the kernel the pages of the files it evicted, and close
    the store files the mount's processes still hold open (``sweep`` signals the workers).

    The kernel keeps every file's pages (zero-message opens); without this, a file evicted
    from the store would go on being read from RAM, and the mount would cache more than the
    budget says (mountd/store/evictions.py). An evicted file a process holds open keeps its
    blocks: on a disk no larger than the cache, a fill waits for them. The question waits
    for news (``wait_ms``), so both happen as soon as mountd evicts. Advisory: while mountd
    is away nothing is evicted.
    """
    from mountd.errors import MountdUnavailable

    journal: str | None = None
    seq: int | None = None
    while True:
        try:
            args = {} if seq is None else {"since": seq, "journal": journal,
                                           "wait_ms": EVICTIONS_WAIT_MS}
            asked = trio.current_time()
            answer = await client.call("evictions", args)
        except (MountdUnavailable, QuiverError, OSError) as exc:
            log.debug("eviction journal unavailable: %s", exc)
            await trio.sleep(EVICTIONS_RETRY)
            continue
        if seq is not None and not answer["complete"]:
            log.info("lost track of mountd's evictions (restarted, or too far behind): "
                     "pages of evicted files may be served from the kernel's cache until it drops them")
        journal, seq = answer["journal"], answer["seq"]
        hashes = answer["hashes"]
        inodes = ops.evicted([bytes.fromhex(h) for h in hashes])
        if hashes and sweep is not None:
            sweep()
        if inodes:
            # From a thread: dropping a page waits for a READ of it in flight, which this
            # very thread may be the one to answer (a miss).
            await trio.to_thread.run_sync(invalidate, inodes)
        if "wait_ms" in args and not hashes and answer["complete"] and \
                trio.current_time() - asked < EVICTIONS_WAIT_MS / 2000:
            await trio.sleep(EVICTIONS_RETRY)  # a mountd that does not wait: ask at its pace
        elif len(hashes) < EVICTIONS_PAGE:
            await trio.sleep(EVICTIONS_BATCH)


def _invalidate(fuse_fd: int, inodes: list[int]) -> None:
    for inode in inodes:
        if not fuse_channel.send(fuse_fd, fuse_wire.inval_inode(inode), f"the invalidation of inode {inode}"):
            return  # unmounted


#: What asks a mount to stop.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


async def _watch_signals(stop: Callable[[], None], *,
                         task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """Unmount at the first stop signal; started (``nursery.start``) before the mount says it
    is ready, so a signal sent once it is ready always unmounts. Later ones, as the mount
    winds down, are ignored (quiverfs/base/stop_signals.py)."""
    with stop_signal_receiver(*STOP_SIGNALS) as signals:
        task_status.started()
        async for signum in signals:
            log.info("%s: unmounting", signal.Signals(signum).name)
            stop()
            return


async def _announce_ready(mountpoint: Path, status: Status, dataset: str) -> None:
    # A failed kernel handshake only shows at the first access: stat our own root (from a
    # thread, since this very thread serves the request).
    try:
        await trio.to_thread.run_sync(os.stat, mountpoint, abandon_on_cancel=True)
    except OSError as exc:
        message = f"the kernel did not accept the mount at {mountpoint}: {os.strerror(exc.errno or errno.EIO)}"
        status.send(f"error: {message}")
        raise MountError(message) from None
    log.info("serving dataset %s at %s (pid %d)", dataset, mountpoint, os.getpid())
    status.send("ready")


async def serve(options: MountOptions, digest, status: Status | None = None) -> None:
    """Mount ``digest`` at ``options.mountpoint`` and serve until unmounted or signalled."""
    from mountd.rpc.async_client import open_client
    from mountd.rpc.client import probe

    status = status or Status(None)
    cache_dir = options.cache_dir
    assert cache_dir is not None, "use MountOptions.resolved()"
    mountpoint = options.mountpoint
    dataset = digest.dataset_id
    mountd_options = ["--cache-size", options.cache_size] if options.cache_size else []
    # A mountd that answers now is someone's service: reconnect to it, never start another.
    # None answering: start one now, and again later if it dies (it is ours to keep alive).
    on_demand = await trio.to_thread.run_sync(probe, cache_dir) is None
    async with open_client(cache_dir, start=on_demand, options=mountd_options) as client:
        await client.register(
            dataset, digest=os.fspath(digest.path), mountpoint=os.fspath(mountpoint),
            sources=list(digest.sources.values()),
        )

        kernel_reads = {"passthrough": False}  # set once the kernel has answered INIT

        def extra_stats() -> dict:
            # cache_dir and digest let a process read hits from the store itself, bypassing
            # FUSE (quiverfs/client/direct.py); both are paths, never contents. ``digest`` is the
            # private copy served (and registered with mountd); ``mounted_digest`` the file the
            # user mounted, which `quiverfs mounts` shows.
            return {"pid": os.getpid(), "mountpoint": os.fspath(mountpoint),
                    "workers": len(pool.workers) if pool else 0, "frontend": options.frontend,
                    "cache_dir": os.fspath(cache_dir), "digest": os.fspath(digest.path),
                    "mounted_digest": os.fspath(options.digest), **kernel_reads}

        workers = 0 if options.frontend == PYFUSE3 else (
            options.workers or fuse_worker.default_workers())
        counters = reads.SharedCounters(workers + 1, digest.dir_count + digest.file_count + 1)
        # What the mount's processes keep open, together, is a share of what mountd's store
        # holds (its ``hello`` says it): evicted files stay allocated while open
        # (quiverfs/filesystem/reads.py).
        kept = reads.kept_bytes(store_bytes(client.info), workers + 1)
        wait = MountdWait(options.mountd_wait)
        fetcher = MountdFetcher(client, dataset, wait)
        ops = QuiverOperations(digest, cache_dir, fetcher, counters,
                               sessions=PatientSessions(client, wait),
                               extra_stats=extra_stats, prefetcher=fetcher,
                               readahead=options.readahead, sweep=options.sweep,
                               kept_bytes=kept)
        fuse_options = {"ro", "nosuid", "nodev", "default_permissions",
                        f"fsname=quiverfs:{dataset[:16]}", "subtype=quiverfs"}
        if options.allow_other:
            fuse_options.add("allow_other")
        pool: WorkerPool | None = None
        if options.frontend == PYFUSE3:
            await _serve_pyfuse3(ops, client, dataset, options, fuse_options, status)
            return
        try:
            with claim_mountpoint(mountpoint, options.nonempty):
                try:
                    fuse_fd = fuse_channel.mount(mountpoint, fuse_options)
                except QuiverError as exc:
                    raise MountError(str(exc)) from None
                mine = mount_identity(mountpoint)
                if mine is None:
                    log.warning("%s is not in /proc/self/mountinfo after mounting: it will not be "
                                "unmounted by this process", mountpoint)
        except BaseException:
            ops.close()
            raise
        status.mounted(mine)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        ours.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)  # who forwarded: see _sender
        try:
            backing = _handshake(fuse_fd, digest, options.passthrough, mine)
            kernel_reads["passthrough"] = backing is not None
            # Everything allocated so far lives as long as the mount: keep it out of the
            # collector's scans (and out of copy-on-write faults in the workers).
            gc.collect()
            gc.freeze()
            # The main process keeps ``theirs`` for the replacements of workers that die, so
            # the end of the mount is the pool's last worker leaving, not the socket's EOF.
            target = partial(_worker_main, digest, cache_dir, counters, kept, backing, ours, theirs)
            pool = WorkerPool(workers, target, counters, fuse_fd)
            pool.start()
            stop = partial(_stop_serving, mountpoint, mine, pool)
            invalidate = partial(_invalidate, fuse_fd)
            async with trio.open_nursery() as nursery:
                await nursery.start(_watch_signals, stop)
                nursery.start_soon(_report_hits, ops, client, dataset)
                nursery.start_soon(ops.send_prefetches, invalidate)
                nursery.start_soon(_forget_evicted, ops, client, invalidate, pool.sweep)
                nursery.start_soon(_announce_ready, mountpoint, status, dataset)
                nursery.start_soon(_serve_forwarded, ops, trio.socket.from_stdlib_socket(ours), pool, backing)
                await pool.watch()
                nursery.cancel_scope.cancel()
            if pool.gave_up and not pool.stopping:
                raise MountError(f"the FUSE workers kept dying ({MAX_RESTARTS} replaced within "
                                 f"{RESTART_WINDOW:g}s, see the log): unmounted {mountpoint}")
        finally:
            # Unmounts if we are leaving for any reason other than an external unmount (and
            # only the mount we made). The last second of hit reports is dropped: they are
            # advisory, and sending them could mean waiting for a mountd to start.
            unmount_own(mountpoint, mine)
            if pool is not None:
                pool.close()
            ours.close()
            theirs.close()
            os.close(fuse_fd)
            ops.close()
            log.info("unmounted %s", mountpoint)


async def _serve_pyfuse3(ops, client, dataset: str, options: MountOptions, fuse_options: set[str],
                         status: Status) -> None:
    """The pyfuse3 front end (quiverfs/fuse/frontend_pyfuse3.py): the same operations, served by
    libfuse in this process; the mount point claimed, hit reports, evictions, signals and
    readiness as below."""
    # Imported here, not at the top: an optional extra, and ~80 ms that umount does not need.
    from quiverfs.fuse.frontend_pyfuse3 import Session

    mountpoint = options.mountpoint
    session = Session(ops)
    mine: MountIdentity | None = None
    try:
        with claim_mountpoint(mountpoint, options.nonempty):
            try:
                session.open(mountpoint, fuse_options)
            except RuntimeError as exc:  # pyfuse3's word for "libfuse could not mount"
                raise MountError(f"cannot mount at {mountpoint} with pyfuse3: {exc}") from None
            mine = mount_identity(mountpoint)
        status.mounted(mine)
        async with trio.open_nursery() as nursery:
            await nursery.start(_watch_signals, partial(unmount_own, mountpoint, mine))
            nursery.start_soon(_report_hits, ops, client, dataset)
            nursery.start_soon(ops.send_prefetches, session.invalidate)
            nursery.start_soon(_forget_evicted, ops, client, session.invalidate)
            nursery.start_soon(_announce_ready, mountpoint, status, dataset)
            await session.serve()
            nursery.cancel_scope.cancel()
    finally:
        unmount_own(mountpoint, mine)
        session.close()
        ops.close()
        log.info("unmounted %s", mountpoint)


#: Mean file size from which a mount uses passthrough unless told (``--passthrough`` /
#: ``--no-passthrough``). Passthrough trades the READs of a file for an OPEN and a RELEASE
#: per ``open()``: a win for large files (a first pass over 64 MiB files 3.5x faster, over
#: 1 MiB files 2.7x), even for 110 KiB ones on a first pass (1.19x), and a loss when the
#: kernel still has the mount's copy of their pages (a second pass over 110 KiB files 0.34x,
#: 1 MiB 0.67x), which it keeps beside the store's only while both fit in memory.
#: scripts/bench/passthrough.py, 2026-11-30, 2-core VM (docs/mount.md "Passthrough").
PASSTHROUGH_MEAN_BYTES = 1 << 20


def wants_passthrough(asked: bool | None, digest) -> bool:
    """Whether a mount of ``digest`` asks the kernel for passthrough: as ``asked``, or (None)
    when its files are PASSTHROUGH_MEAN_BYTES or larger on average."""
    if asked is not None:
        return asked
    return digest.file_count > 0 and digest.total_bytes / digest.file_count >= PASSTHROUGH_MEAN_BYTES


def _handshake(fuse_fd: int, digest, asked: bool | None,
               mine: MountIdentity | None) -> passthrough.BackingFiles | None:
    """Answer the kernel's INIT, then widen the mount's read-ahead (the INIT reply sets the
    read-ahead it may only lower); the mount's passthrough backing files when it answers
    OPEN with passthrough (``asked``, or the dataset's size: :func:`wants_passthrough`)."""
    wanted = wants_passthrough(asked, digest)
    _, _, agreed = fuse_channel.handshake(fuse_fd, wanted)
    if mine is not None:
        fuse_channel.widen_read_ahead(mine[1])
    if wanted and _check_passthrough(fuse_fd, digest.path, asked, agreed):
        return passthrough.BackingFiles(digest.dir_count + digest.file_count + 1)
    return None


def _check_passthrough(fuse_fd: int, probe: Path, asked: bool | None, agreed: bool) -> bool:
    """Whether the mount answers opens with passthrough: the kernel agreed at INIT and takes
    a backing file (registering ``probe`` once); else the mount serves reads itself, as
    without it, and says why (a warning when ``--passthrough`` asked for it, a debug line
    when it was the default's choice)."""
    say = log.warning if asked else log.debug
    if not agreed:
        say("passthrough: this kernel does not offer FUSE passthrough (Linux 6.9+ with "
            "CONFIG_FUSE_PASSTHROUGH); the mount serves reads itself")
        return False
    with open(probe, "rb") as f:
        refused = passthrough.available(fuse_fd, f.fileno())
    if refused is not None:
        say("passthrough: the kernel refuses backing files (%s; it needs CAP_SYS_ADMIN); "
            "the mount serves reads itself", refused.strerror or refused)
        return False
    return True


def _worker_main(digest, cache_dir: Path, counters, kept: int, backing: passthrough.BackingFiles | None,
                 ours: socket.socket, theirs: socket.socket, slot: int, fuse_fd: int) -> None:
    """A forked worker (quiverfs/fuse/worker.py) serving on its channel ``fuse_fd``: its own
    digest connection, then serve, keeping at most ``kept`` bytes of store files open, with
    passthrough opens through ``backing`` or none."""
    from quiverfs.filesystem.tree import Tree

    ours.close()
    # The parent's connection must not be used here (nor closed: it is the parent's).
    with digest.reopen() as own:
        tree = Tree(own, cache_dir)
        fuse_worker.Worker(fuse_fd, tree, theirs, counters.slot(slot), counters.in_flight(slot),
                           kept, counters.misses_past_start(), backing,
                           counters.report_opens()).run()


#: Ancillary space for the sender's credentials (SO_PASSCRED: pid, uid, gid).
_CREDENTIALS = socket.CMSG_SPACE(struct.calcsize("3i"))


async def _serve_forwarded(ops, sock, pool: WorkerPool, backing: passthrough.BackingFiles | None) -> None:
    """Answer what the workers forward, each through the sender's channel (a request must be
    answered through the descriptor it was read from; the kernel names the sender); a
    passthrough OPEN's with a backing file of ``backing``."""
    async with trio.open_nursery() as nursery:
        while True:
            message, ancillary, _, _ = await sock.recvmsg(fuse_wire.REQUEST_BUFFER + 64, _CREDENTIALS)
            if not message:
                return
            kind, body = message[:1], message[1:]
            if kind == worker_messages.HITS:
                ops.add_hits(body)
            elif kind == worker_messages.SERVED:
                ops.add_hits(body, report=False)
            elif kind == worker_messages.OPENED:
                ops.add_opened(body)
            elif kind == worker_messages.FORWARD:
                channel = pool.channel_of(_sender(ancillary))
                if channel is not None:  # else its worker died, and the request with it
                    nursery.start_soon(_answer, ops, body, channel, backing)


def _sender(ancillary: list[tuple[int, int, bytes]]) -> int:
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
            return struct.unpack_from("3i", data)[0]
    return 0


async def _answer(ops, request: bytes, channel, backing: passthrough.BackingFiles | None) -> None:
    out = await ops.answer(request)
    if not isinstance(out, StoreFileOpen):
        channel.send(out)
        return
    try:
        assert backing is not None  # workers forward OPEN only with passthrough
        # A copy to register, if the inode has no backing file yet (else its own serves).
        backing.reply_open(channel.fd, out.unique, out.inode, partial(os.dup, out.fd))
    finally:
        os.close(out.fd)


def _stop_serving(mountpoint: Path, mine: MountIdentity | None, pool: WorkerPool) -> None:
    """Unmount our mount (lazily: open files do not block it) and stop the workers."""
    unmount_own(mountpoint, mine)
    pool.stop()
