"""Starting a mount, in the foreground or detached, and the directories it needs.

``quiverfs mount`` (docs/mount.md) comes in two shapes:

* :func:`run_foreground` serves in this process until the filesystem is unmounted or the
  process gets SIGTERM/SIGINT (then it unmounts itself). For systemd units and containers.
* :func:`mount_detached` forks a detached child that serves (as ``--foreground`` would), waits
  until the child says the mount answers (or failed), checks ``/proc/mounts`` and a ``stat``
  of the root itself, and returns. A child that fails reports its one-line error through a
  status pipe; the parent raises it.

The serving itself is quiverfs/mount/serve.py; the mount point and unmounting,
quiverfs/mount/mountpoint.py.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time
from contextlib import suppress
from pathlib import Path

import trio

from mountd.store.layout import runtime_dir
from quiverfs.base.errors import QuiverError, UsageError, first_error
from quiverfs.filesystem.snapshot import Snapshot
from quiverfs.mount.mountpoint import (
    FSTYPE,
    MountError,
    MountIdentity,
    check_mountpoint,
    fuse_unavailable,
    mounted_fstype,
    unmount_own,
)
from quiverfs.mount.serve import MountOptions, Status, serve

log = logging.getLogger("quiverfs.mount")

#: Seconds :func:`mount_detached` waits for the child to serve.
READY_TIMEOUT = 60.0

#: Log of detached mount processes, in the cache directory.
LOG_FILE = "mount.log"


def mount_state_dir(cache_dir: Path) -> Path:
    """Where a mount keeps its digest snapshot and log: the cache directory when it is this
    user's own (a personal mountd), else a private folder of this user's, because a mountd
    shared by every user (docs/operations.md "Security") lets nobody else write there:
    ``mounts-<cache dir hash>`` in :func:`mountd.store.layout.runtime_dir` (``$XDG_RUNTIME_DIR``,
    ``~/.cache``, or a private folder under the temporary directory for an account without a
    home). Raises :class:`UsageError` (one line) when it cannot be made."""
    try:
        if cache_dir.stat().st_uid == os.geteuid():
            return cache_dir
    except FileNotFoundError:
        return cache_dir  # created by us, below
    tag = hashlib.blake2b(os.fsencode(cache_dir.resolve()), digest_size=6).hexdigest()
    state = runtime_dir() / f"mounts-{tag}"
    try:
        state.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError as exc:
        raise UsageError(f"cannot create {state} for the mount's digest copy and log: "
                         f"{os.strerror(exc.errno or errno.EIO)} (set XDG_RUNTIME_DIR to a "
                         "directory of yours)") from None
    return state


def check_cache_dir(cache_dir: Path) -> None:
    """Raise :class:`UsageError` when ``cache_dir`` exists but is not a directory."""
    if cache_dir.exists() and not cache_dir.is_dir():
        raise UsageError(f"cache directory {cache_dir} is not a directory")


def make_cache_dir(cache_dir: Path) -> None:
    """Create ``cache_dir`` (private to its owner) if missing; :class:`UsageError` in one line
    when it cannot be (a ``--cache-dir`` or ``$XDG_CACHE_HOME`` this user cannot write)."""
    check_cache_dir(cache_dir)
    try:
        cache_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError as exc:
        raise UsageError(f"cannot create the cache directory {cache_dir}: "
                         f"{os.strerror(exc.errno or errno.EIO)} (pass --cache-dir, or set "
                         "XDG_CACHE_HOME, to a directory you can write)") from None


def preflight(options: MountOptions) -> MountOptions:
    """``options`` resolved, once FUSE is there, the mount point can take a mount and the
    cache directory exists: what a foreground and a detached mount check before anything
    starts, each failure a one-line :class:`~quiverfs.base.errors.QuiverError`."""
    options = options.resolved()
    reason = fuse_unavailable()
    if reason:
        raise MountError(f"FUSE is not available: {reason}")
    check_mountpoint(options.mountpoint, options.nonempty)
    assert options.cache_dir is not None
    make_cache_dir(options.cache_dir)
    return options


def run_foreground(options: MountOptions, status_fd: int | None = None) -> None:
    """Validate, mount and serve in this process; returns after the unmount.

    With ``status_fd`` (set by :func:`mount_detached`), writes ``ready`` or ``error: ...``
    on it. Raises :class:`~quiverfs.base.errors.QuiverError` subclasses with one-line messages.
    """
    status = Status(status_fd)
    try:
        options = preflight(options)
        assert options.cache_dir is not None
        # Serve a private copy: the user's file may be changed or truncated under the mount.
        snapshot = Snapshot.take(options.digest, mount_state_dir(options.cache_dir))
        try:
            digest = snapshot.open()
            try:
                trio.run(serve, options, digest, status)
            except BaseExceptionGroup as group:
                # Nurseries wrap what their tasks raise; a user wants the one error, not a group.
                raise first_error(group) from None
            finally:
                digest.close()
        finally:
            snapshot.remove()
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
    options = preflight(options)
    assert options.cache_dir is not None
    log_path = mount_state_dir(options.cache_dir) / LOG_FILE
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
        line, mine = _read_status(read_fd, proc, deadline)
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
        _stop_child(proc, options.mountpoint, mine)
        raise
    return proc.pid


def _read_status(fd: int, proc: _Child, deadline: float) -> tuple[str, MountIdentity | None]:
    """The child's last word (``ready``, ``error: ...`` or "" when none came) and the mount
    it said it made (None: it made none, or died before saying)."""
    data = b""
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.05)
        if ready:
            chunk = os.read(fd, 4096)
            if not chunk:  # the child closed the pipe: it exited (or said all it had to say)
                break
            data += chunk
            if data.endswith(b"\n") and not data.splitlines()[-1].startswith(b"mounted "):
                break
        elif proc.poll() is not None:
            # Dead; drain anything that raced with its exit.
            ready, _, _ = select.select([fd], [], [], 0)
            if not ready:
                break
    mine, last = None, ""
    for line in data.decode(errors="replace").splitlines():
        words = line.split()
        if len(words) == 3 and words[0] == "mounted" and words[1].isdigit():
            mine = (int(words[1]), words[2])
        elif line.strip():
            last = line.strip()
    return last, mine


def _stop_child(proc: _Child, mountpoint: Path, mine: MountIdentity | None) -> None:
    """Stop the child and remove its mount if it left one: never another process's."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
    unmount_own(mountpoint, mine)
