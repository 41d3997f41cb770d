"""A mount's life: start (in the foreground or detached), serve, and unmount.

``quiverfs mount`` (docs/mount.md) comes in two shapes:

* :func:`run_foreground` serves in this process until the filesystem is unmounted or the
  process gets SIGTERM/SIGINT (then it unmounts itself). For systemd units and containers.
* :func:`mount_detached` forks a detached child that serves (as ``--foreground`` would), waits
  until the child says the mount answers (or failed), checks ``/proc/mounts`` and a ``stat``
  of the root itself, and returns. A child that fails reports its one-line error through a
  status pipe; the parent raises it.

The serving process owns, in order (teardown in reverse): the digest (opened and validated
first, so a bad digest fails before anything is mounted), a mountd client (a mountd is started
on demand when none answers), the registration of the dataset with mountd, the FUSE session,
and a nursery with the hit reporter and the signal watcher.

mountd going away does not stop the mount: hits need no mountd, misses fail with EIO while
it is away, and the client reconnects (and registers again) on the next request. A mountd
that this mount started on demand is started again on demand; one that was already running
(a service) is left to its supervisor.
"""

from __future__ import annotations

import errno
import gc
import logging
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import trio

from quiverfs import fuse_channel, fuse_wire, fuse_worker, reads
from quiverfs.errors import QuiverError, UsageError, first_error

log = logging.getLogger("quiverfs.mount")

#: Seconds between two batches of hit reports to mountd.
HITS_INTERVAL = 1.0

#: Seconds between two questions to mountd's eviction journal.
EVICTIONS_INTERVAL = 0.5

#: Most hashes mountd answers at once (mountd.evictions.MAX_ANSWER): a full page asks again.
EVICTIONS_PAGE = 20_000

#: Hashes per ``hits`` notification (well under the protocol's MAX_ITEMS).
HITS_BATCH = 50_000

#: Seconds :func:`mount_detached` waits for the child to serve.
READY_TIMEOUT = 60.0

#: File system type in /proc/mounts (``fuse.`` + the subtype).
FSTYPE = "fuse.quiverfs"

#: Log of detached mount processes, in the cache directory.
LOG_FILE = "mount.log"

#: Who can speak FUSE for a mount (docs/mount.md "Front ends"): our own protocol code with
#: forked workers, or pyfuse3 in the main process (quiverfs/frontend_pyfuse3.py).
NATIVE, PYFUSE3 = FRONTENDS = ("native", "pyfuse3")


class MountError(QuiverError):
    """The mount could not be started or stopped; ``str()`` says why in one line."""


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

    def resolved(self) -> MountOptions:
        """The same options with absolute paths (a detached child runs in ``/``)."""
        from mountd.client import resolve_socket

        cache_dir, _ = resolve_socket(self.cache_dir)
        return MountOptions(
            Path(os.path.abspath(os.path.expanduser(self.digest))),
            Path(os.path.abspath(os.path.expanduser(self.mountpoint))),
            cache_dir, self.cache_size, self.allow_other, self.debug, self.workers,
            self.frontend,
        )


# -- /proc/mounts and FUSE availability ------------------------------------------------------


def _unescape(field: str) -> str:
    # /proc/mounts escapes space, tab, newline and backslash as \ooo octal.
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and i + 4 <= len(field) and field[i + 1:i + 4].isdigit():
            out.append(chr(int(field[i + 1:i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def mounted_fstype(mountpoint: str | os.PathLike[str]) -> str | None:
    """The file system type mounted at ``mountpoint`` per ``/proc/mounts`` (last wins), or None."""
    target = os.path.abspath(os.fspath(mountpoint))
    found = None
    try:
        with open("/proc/mounts", encoding="utf-8", errors="surrogateescape") as f:
            for line in f:
                parts = line.split(" ")
                if len(parts) >= 3 and _unescape(parts[1]) == target:
                    found = parts[2]
    except OSError:
        return None
    return found


def fuse_unavailable() -> str | None:
    """Why FUSE cannot be used here (a one-line reason), or None when it can."""
    if not os.path.exists("/dev/fuse"):
        return "/dev/fuse does not exist (load the fuse module, or give the container the device)"
    if not os.access("/dev/fuse", os.R_OK | os.W_OK):
        return "/dev/fuse is not readable and writable by this user"
    if shutil.which("fusermount3") is None:
        return "fusermount3 is not installed (apt-get install fuse3)"
    return None


def check_cache_dir(cache_dir: Path) -> None:
    """Raise :class:`UsageError` when ``cache_dir`` exists but is not a directory."""
    if cache_dir.exists() and not cache_dir.is_dir():
        raise UsageError(f"cache directory {cache_dir} is not a directory")


def check_mountpoint(mountpoint: Path) -> None:
    """Raise :class:`UsageError` unless ``mountpoint`` is an existing, unmounted directory."""
    if mounted_fstype(mountpoint) is not None:
        raise UsageError(f"{mountpoint} is already a mount point (quiverfs umount {mountpoint} first)")
    if not mountpoint.is_dir():
        what = "does not exist" if not mountpoint.exists() else "is not a directory"
        raise UsageError(f"mount point {mountpoint} {what}")


# -- serving ---------------------------------------------------------------------------------


class MountdFetcher:
    """The :class:`quiverfs.fs.Fetcher` of a mount: mountd's ``ensure`` for one dataset."""

    def __init__(self, client, dataset: str) -> None:
        self.client = client
        self.dataset = dataset

    async def ensure(self, entry) -> str:
        return await self.client.ensure(entry.hash, entry.size, entry.location, self.dataset)


class _Status:
    """The write end of a detached mount's status pipe: one line, then closed."""

    def __init__(self, fd: int | None) -> None:
        self.fd = fd

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
        hashes, nbytes = ops.take_hits()
        if not hashes:
            continue
        try:
            for start in range(0, len(hashes), HITS_BATCH):
                batch = hashes[start:start + HITS_BATCH]
                # Bytes go with the first batch; mountd only sums them.
                await client.hits(dataset, batch, nbytes if start == 0 else 0)
        except (MountdUnavailable, QuiverError, OSError) as exc:
            # Hit reports are advisory (they feed mountd's recency and statistics).
            log.debug("dropped %d hit reports: %s", len(hashes), exc)


async def _forget_evicted(ops, client, invalidate: Callable[[list[int]], None]) -> None:
    """Every EVICTIONS_INTERVAL, drop from the kernel the pages of files mountd evicted.

    The kernel keeps every file's pages (zero-message opens); without this, a file evicted
    from the store would go on being read from RAM, and the mount would cache more than the
    budget says (mountd/evictions.py). Advisory: while mountd is away nothing is evicted.
    """
    from mountd.errors import MountdUnavailable

    journal: str | None = None
    seq: int | None = None
    while True:
        try:
            args = {} if seq is None else {"since": seq, "journal": journal}
            answer = await client.call("evictions", args)
        except (MountdUnavailable, QuiverError, OSError) as exc:
            log.debug("eviction journal unavailable: %s", exc)
            await trio.sleep(EVICTIONS_INTERVAL)
            continue
        if seq is not None and not answer["complete"]:
            log.info("lost track of mountd's evictions (restarted, or too far behind): "
                     "pages of evicted files may be served from the kernel's cache until it drops them")
        journal, seq = answer["journal"], answer["seq"]
        inodes = ops.evicted([bytes.fromhex(h) for h in answer["hashes"]])
        if inodes:
            # From a thread: dropping a page waits for a READ of it in flight, which this
            # very thread may be the one to answer (a miss).
            await trio.to_thread.run_sync(invalidate, inodes)
        if len(answer["hashes"]) < EVICTIONS_PAGE:
            await trio.sleep(EVICTIONS_INTERVAL)


def _invalidate(fuse_fd: int, inodes: list[int]) -> None:
    for inode in inodes:
        if not fuse_channel.send(fuse_fd, fuse_wire.inval_inode(inode), f"the invalidation of inode {inode}"):
            return  # unmounted


async def _watch_signals(stop: Callable[[], None]) -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
        async for signum in signals:
            log.info("%s: unmounting", signal.Signals(signum).name)
            stop()
            return


async def _announce_ready(mountpoint: Path, status: _Status, dataset: str) -> None:
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


async def serve(options: MountOptions, digest, status: _Status | None = None) -> None:
    """Mount ``digest`` at ``options.mountpoint`` and serve until unmounted or signalled."""
    from mountd.client import open_client, probe
    from quiverfs.fs import QuiverOperations

    status = status or _Status(None)
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

        def extra_stats() -> dict:
            return {"pid": os.getpid(), "mountpoint": os.fspath(mountpoint), "workers": len(pids),
                    "frontend": options.frontend}

        workers = 0 if options.frontend == PYFUSE3 else (
            options.workers or fuse_worker.default_workers())
        counters = reads.SharedCounters(workers + 1)
        ops = QuiverOperations(digest, cache_dir, MountdFetcher(client, dataset), counters,
                               sessions=client, extra_stats=extra_stats)
        fuse_options = {"ro", "nosuid", "nodev", "default_permissions",
                        f"fsname=quiverfs:{dataset[:16]}", "subtype=quiverfs"}
        if options.allow_other:
            fuse_options.add("allow_other")
        pids: list[int] = []
        if options.frontend == PYFUSE3:
            await _serve_pyfuse3(ops, client, dataset, mountpoint, fuse_options, status)
            return
        try:
            fuse_fd = fuse_channel.mount(mountpoint, fuse_options)
        except QuiverError as exc:
            ops.close()
            raise MountError(str(exc)) from None
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            fuse_channel.handshake(fuse_fd)
            # Everything allocated so far lives as long as the mount: keep it out of the
            # collector's scans (and out of copy-on-write faults in the workers).
            gc.collect()
            gc.freeze()
            pids = fuse_worker.fork_workers(
                workers, partial(_worker_main, fuse_fd, digest, cache_dir, counters, ours, theirs))
            theirs.close()
            stop = partial(_stop_serving, mountpoint, pids)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_report_hits, ops, client, dataset)
                nursery.start_soon(_forget_evicted, ops, client, partial(_invalidate, fuse_fd))
                nursery.start_soon(_watch_signals, stop)
                nursery.start_soon(_announce_ready, mountpoint, status, dataset)
                await _serve_forwarded(ops, trio.socket.from_stdlib_socket(ours), fuse_fd)
                nursery.cancel_scope.cancel()
        finally:
            # Unmounts if we are leaving for any reason other than an external unmount. The
            # last second of hit reports is dropped: they are advisory, and sending them could
            # mean waiting for a mountd to start.
            if mounted_fstype(mountpoint) is not None:
                fuse_channel.unmount(mountpoint, lazy=True)
            _reap(pids)
            ours.close()
            theirs.close()
            os.close(fuse_fd)
            ops.close()
            log.info("unmounted %s", mountpoint)


async def _serve_pyfuse3(ops, client, dataset: str, mountpoint: Path, fuse_options: set[str],
                         status: _Status) -> None:
    """The pyfuse3 front end (quiverfs/frontend_pyfuse3.py): the same operations, served by
    libfuse in this process; hit reports, evictions, signals and readiness as below."""
    # Imported here, not at the top: an optional extra, and ~80 ms that umount does not need.
    from quiverfs.frontend_pyfuse3 import Session

    session = Session(ops)
    try:
        try:
            session.open(mountpoint, fuse_options)
        except RuntimeError as exc:  # pyfuse3's word for "libfuse could not mount"
            raise MountError(f"cannot mount at {mountpoint} with pyfuse3: {exc}") from None
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_report_hits, ops, client, dataset)
            nursery.start_soon(_forget_evicted, ops, client, session.invalidate)
            nursery.start_soon(_watch_signals, partial(_stop_serving, mountpoint, []))
            nursery.start_soon(_announce_ready, mountpoint, status, dataset)
            await session.serve()
            nursery.cancel_scope.cancel()
    finally:
        if mounted_fstype(mountpoint) is not None:
            fuse_channel.unmount(mountpoint, lazy=True)
        session.close()
        ops.close()
        log.info("unmounted %s", mountpoint)


def _worker_main(fuse_fd: int, digest, cache_dir: Path, counters, ours: socket.socket,
                 theirs: socket.socket, slot: int) -> None:
    """A forked worker (quiverfs/fuse_worker.py): its own digest connection, then serve."""
    from quiverfs.tree import Tree

    ours.close()
    # The parent's connection must not be used here (nor closed: it is the parent's).
    with digest.reopen() as own:
        tree = Tree(own, cache_dir)
        fuse_worker.Worker(fuse_fd, tree, theirs, counters.slot(slot)).run()


async def _serve_forwarded(ops, sock, fuse_fd: int) -> None:
    """Answer what the workers forward until the last of them is gone (the mount ended)."""
    async with trio.open_nursery() as nursery:
        while True:
            message = await sock.recv(fuse_wire.REQUEST_BUFFER + 64)
            if not message:
                return
            kind, body = message[:1], message[1:]
            if kind == fuse_worker.HITS:
                ops.add_hits(body)
            elif kind == fuse_worker.FORWARD:
                nursery.start_soon(_answer, ops, body, fuse_fd)


async def _answer(ops, request: bytes, fuse_fd: int) -> None:
    fuse_channel.send(fuse_fd, await ops.answer(request))


def _stop_serving(mountpoint: Path, pids: list[int]) -> None:
    """Unmount (lazily: open files do not block it) and stop the workers."""
    fuse_channel.unmount(mountpoint, lazy=True)
    for pid in pids:
        with suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)


def _reap(pids: list[int], timeout: float = 5.0) -> None:
    """Wait for the workers to exit (SIGTERM after ``timeout``/2, SIGKILL after ``timeout``)."""
    deadline = time.monotonic() + timeout
    alive = set(pids)
    signalled = killed = False
    while alive:
        for pid in list(alive):
            with suppress(ChildProcessError):
                done, _ = os.waitpid(pid, os.WNOHANG)
                if not done:
                    continue
            alive.discard(pid)
        if not alive:
            return
        left = deadline - time.monotonic()
        if left < timeout / 2 and not signalled:
            signalled = True
            for pid in alive:
                with suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGTERM)
        if left < 0 and not killed:
            killed = True
            for pid in alive:
                with suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        time.sleep(0.01)


def run_foreground(options: MountOptions, status_fd: int | None = None) -> None:
    """Validate, mount and serve in this process; returns after the unmount.

    With ``status_fd`` (set by :func:`mount_detached`), writes ``ready`` or ``error: ...``
    on it. Raises :class:`~quiverfs.errors.QuiverError` subclasses with one-line messages.
    """
    from digests.digest import Digest

    status = _Status(status_fd)
    try:
        options = options.resolved()
        reason = fuse_unavailable()
        if reason:
            raise MountError(f"FUSE is not available: {reason}")
        check_mountpoint(options.mountpoint)
        check_cache_dir(options.cache_dir)
        digest = Digest.open(options.digest)
        try:
            trio.run(serve, options, digest, status)
        except BaseExceptionGroup as group:
            # Nurseries wrap what their tasks raise; a user wants the one error, not a group.
            raise first_error(group) from None
        finally:
            digest.close()
    except QuiverError as exc:
        status.send(f"error: {exc}")
        raise
    except BaseException as exc:
        status.send(f"error: internal error: {type(exc).__name__}: {exc} (see the mount log)")
        raise


class _Child:
    """The forked serving process, seen from the parent (a tiny ``Popen`` look-alike)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while self.poll() is None:
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout)
            time.sleep(0.01)
        return self.returncode  # type: ignore[return-value]

    def terminate(self) -> None:
        with suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGTERM)

    def kill(self) -> None:
        with suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)


def setup_logging(debug: bool) -> None:
    """Log lines to stderr (the terminal, the journal, or a detached mount's log file)."""
    logging.basicConfig(
        stream=sys.stderr, level=logging.DEBUG if debug else logging.INFO, force=True,
        format="%(asctime)s quiverfs-mount[%(process)d] %(levelname)s %(name)s: %(message)s",
    )


def _serve_in_child(options: MountOptions, status_fd: int, log_fd: int) -> None:
    """The forked child: detach, log to the log file, serve, and never return."""
    code = 70
    try:
        os.setsid()  # no signals from the terminal that ran `quiverfs mount`
        os.chdir("/")
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        setup_logging(options.debug)
        run_foreground(options, status_fd)
        code = 0
    except QuiverError as exc:
        log.error("%s", exc)  # the parent prints it; the log keeps it too
        code = exc.exit_code
    except BaseException:
        log.exception("the mount failed")
    finally:
        with suppress(BaseException):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _stat_with_deadline(path: Path, timeout: float) -> OSError | None:
    """``os.stat(path)`` in a daemon thread; the error, None when fine, TimeoutError when stuck."""
    result: list[OSError | None] = []

    def target() -> None:
        try:
            os.stat(path)
            result.append(None)
        except OSError as exc:
            result.append(exc)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout)
    return result[0] if result else TimeoutError(f"stat of {path} did not return in {timeout:g}s")


def mount_detached(options: MountOptions, timeout: float = READY_TIMEOUT) -> int:
    """Start a detached serving process for ``options`` and wait until it serves; its pid.

    Raises :class:`MountError` (or the child's own error class, as a one-line message) when
    the child fails, dies or is not ready within ``timeout`` seconds; a child that is still
    alive then is stopped (and its mount removed).
    """
    options = options.resolved()
    reason = fuse_unavailable()
    if reason:
        raise MountError(f"FUSE is not available: {reason}")
    check_mountpoint(options.mountpoint)
    assert options.cache_dir is not None
    check_cache_dir(options.cache_dir)
    options.cache_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    log_path = options.cache_dir / LOG_FILE
    log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
    read_fd, write_fd = os.pipe()
    # Fork rather than spawn: this process has already imported everything the server needs,
    # which saves a second interpreter start (a good part of the time to ready). No thread
    # and no trio loop runs here yet, so forking is safe.
    pid = os.fork()
    if pid == 0:
        os.close(read_fd)
        _serve_in_child(options, write_fd, log_fd)
    os.close(write_fd)
    os.close(log_fd)
    proc = _Child(pid)
    deadline = time.monotonic() + timeout
    try:
        line = _read_status(read_fd, proc, deadline)
    finally:
        os.close(read_fd)
    try:
        if line.startswith("error: "):
            error = MountError(line[len("error: "):])
            with suppress(subprocess.TimeoutExpired):
                # The child is on its way out: keep its exit status (4 = bad digest, ...).
                status = proc.wait(5)
                if status > 0:
                    error.exit_code = status
            raise error
        if line != "ready":
            status = proc.poll()
            if status is not None:
                raise MountError(f"the mount process exited with status {status} before it was ready (log: {log_path})")
            raise MountError(f"the mount was not ready within {timeout:g}s (log: {log_path})")
        # Trust but verify: the kernel lists the mount and its root answers.
        if mounted_fstype(options.mountpoint) != FSTYPE:
            raise MountError(f"{options.mountpoint} is not in /proc/mounts after the mount process said ready")
        problem = _stat_with_deadline(options.mountpoint, max(1.0, deadline - time.monotonic()))
        if problem is not None:
            raise MountError(f"the mount at {options.mountpoint} does not answer: {problem}")
    except BaseException:
        _stop_child(proc, options.mountpoint)
        raise
    return proc.pid


def _read_status(fd: int, proc: _Child, deadline: float) -> str:
    data = b""
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.05)
        if ready:
            chunk = os.read(fd, 4096)
            if not chunk:  # the child closed the pipe: it exited (or said all it had to say)
                break
            data += chunk
            if data.endswith(b"\n"):
                break
        elif proc.poll() is not None and not data:
            # Dead without a word; drain anything that raced with its exit.
            ready, _, _ = select.select([fd], [], [], 0)
            if not ready:
                break
    return data.decode(errors="replace").strip()


def _stop_child(proc: _Child, mountpoint: Path) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
    if mounted_fstype(mountpoint) is not None:
        with suppress(QuiverError):
            unmount(mountpoint, lazy=True)


# -- unmounting -------------------------------------------------------------------------------


def unmount(mountpoint: str | os.PathLike[str], *, lazy: bool = False) -> None:
    """Unmount the quiverfs mount at ``mountpoint`` with ``fusermount3 -u``.

    A mount whose process died ("Transport endpoint is not connected") is detached lazily
    (``-z``); so is every mount with ``lazy=True``. Raises :class:`UsageError` when nothing
    (or something other than quiverfs) is mounted there, :class:`MountError` when it is busy.
    """
    path = os.path.abspath(os.fspath(mountpoint))
    fstype = mounted_fstype(path)
    if fstype is None:
        raise UsageError(f"{path} is not mounted")
    if fstype != FSTYPE:
        raise UsageError(f"{path} is a {fstype} mount, not quiverfs")
    tool = shutil.which("fusermount3")
    if tool is None:
        raise MountError("fusermount3 is not installed (apt-get install fuse3)")
    result = subprocess.run([tool, "-u", *(["-z"] if lazy else []), path],
                            capture_output=True, text=True, check=False)
    if result.returncode == 0:
        return
    message = (result.stderr or result.stdout).strip().splitlines()[-1:] or [f"status {result.returncode}"]
    text = message[0]
    if not lazy and "not connected" in text.lower():
        # The serving process is gone; only a lazy unmount detaches such a mount.
        unmount(path, lazy=True)
        return
    if "busy" in text.lower():
        raise MountError(f"{path} is busy (files or directories open there): close them, or use --lazy")
    raise MountError(f"cannot unmount {path}: {text}")
