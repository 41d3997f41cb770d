"""The blocking client of mountd, for the CLI and tests, and starting a mountd on demand.

:class:`SyncClient` holds one connection and makes one request at a time.
:func:`ensure_running` (and, for trio code, :func:`mountd.rpc.async_client.connect_or_start`)
starts a mountd when none answers on the socket: ``quiverfs mountd --cache-dir DIR``
detached, its log appended to ``DIR/mountd.log``. Clients racing to do this serialise on an
``flock`` of ``DIR/mountd.start.lock``, so they start exactly one; the loser finds the
winner's mountd answering and just connects. (mountd's own lock on ``DIR/lock`` still guards
against a second mountd started by hand: that one exits with status 75.) Starting lives with
the blocking client because it probes with it.

The async client of FUSE processes is :mod:`mountd.rpc.async_client`; what the two share
(request arguments, reading answers) is :mod:`mountd.rpc.calls`.
"""

from __future__ import annotations

import errno
import fcntl
import itertools
import os
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from mountd.errors import EXIT_ALREADY_RUNNING, MountdUnavailable, ProtocolError
from mountd.rpc import protocol
from mountd.rpc.calls import (
    MAX_QUEUED_FDS,
    Opened,
    ProgressFn,
    connect_error,
    ensure_args,
    open_args,
    opened_files,
    path_of,
    resolve_socket,
    result_with_fds,
)
from mountd.rpc.fdpass import (
    DescriptorStream,
    close_all,
    receive_with_fds_blocking,
    send_with_fds_blocking,
)
from mountd.rpc.protocol import MAX_OPEN, PROTOCOL_VERSION
from mountd.store import layout
from quiverfs.base.backends.base import Location

#: Seconds a blocking client waits for mountd to accept and answer ``hello``.
CONNECT_TIMEOUT = 5.0

#: Seconds :func:`ensure_running` waits for a started mountd to answer.
START_TIMEOUT = 30.0


#: File in the cache directory that clients starting a mountd serialise on.
START_LOCK = "mountd.start.lock"

#: Log file of a mountd started on demand, in the cache directory.
LOG_FILE = "mountd.log"


class SyncClient:
    """One blocking connection, one request at a time; for the CLI and tests.

    >>> with SyncClient.connect("/var/cache/quiverfs") as client:   # doctest: +SKIP
    ...     print(client.stats()["counters"]["total"]["hits"])
    """

    def __init__(self, sock: socket.socket, path: Path) -> None:
        self._sock = sock
        self.path = path
        self._decoder = protocol.FrameDecoder()
        self._ids = itertools.count(1)
        self._ready: list[bytes] = []
        #: descriptors received with responses (``open``), in arrival order
        self._descriptors = DescriptorStream(sock, MAX_OPEN, MAX_QUEUED_FDS)
        #: mountd's answer to ``hello`` when connected with ``handshake=True``.
        self.hello_info: dict[str, Any] = {}

    @classmethod
    def connect(
        cls, cache_dir: str | os.PathLike[str] | None = None, *, socket_path: str | os.PathLike[str] | None = None,
        timeout: float | None = CONNECT_TIMEOUT, handshake: bool = True,
    ) -> SyncClient:
        """Connect to the mountd of ``cache_dir`` (or at ``socket_path``) and say hello.

        ``timeout`` bounds the connect and the handshake; later calls wait as long as they
        take (a scrub may take hours). Raises :class:`MountdUnavailable` when nobody answers.
        """
        path = Path(socket_path) if socket_path is not None else resolve_socket(cache_dir)[1]
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        sock.settimeout(timeout)
        try:
            sock.connect(os.fspath(path))
        except OSError as exc:
            sock.close()
            raise connect_error(path, exc) from None
        client = cls(sock, path)
        try:
            if handshake:
                client.hello_info = client.hello()
        except BaseException:
            client.close()
            raise
        sock.settimeout(None)
        return client

    def close(self) -> None:
        """Close the connection (and any descriptor received that no response claimed)."""
        self._sock.close()
        self._descriptors.close()

    def __enter__(self) -> SyncClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def send_raw(self, data: bytes) -> None:
        """Send bytes as they are (tests use this to send malformed frames)."""
        self._sock.sendall(data)

    def receive(self) -> dict[str, Any]:
        """The next message from mountd (descriptors that came with it are closed)."""
        message, fds = self._receive()
        close_all(fds)
        return message

    def _receive(self) -> tuple[dict[str, Any], tuple[int, ...]]:
        """The next message from mountd and the descriptors it carries (the caller's).

        Every message takes its own (its top-level ``fds`` says how many) from the front of
        the queue of received ones, in order (mountd/rpc/fdpass.py): they came with its
        first byte, so they are there once the message is complete. A message whose
        descriptors cannot be matched closes the connection (:class:`ProtocolError`).
        """
        while not self._ready:
            try:
                data, fds = receive_with_fds_blocking(self._sock, 65536, MAX_OPEN)
            except TimeoutError:
                raise MountdUnavailable(f"mountd at {self.path} did not answer in time") from None
            except ProtocolError:
                self.close()  # descriptors lost: the rest cannot be matched to messages
                raise
            except OSError as exc:
                raise MountdUnavailable(f"lost the connection to mountd at {self.path}: {exc}") from None
            self._descriptors.queue(fds)
            if not data:
                raise MountdUnavailable(f"mountd at {self.path} closed the connection")
            self._ready.extend(self._decoder.feed(data))
        message = protocol.decode_body(self._ready.pop(0))
        try:
            return message, self._descriptors.take(protocol.response_fds(message))
        except ProtocolError:
            self.close()
            raise

    def call(self, op: str, args: Mapping[str, Any] | None = None, *, progress: ProgressFn | None = None,
             fds: Sequence[int] = ()) -> Any:
        """Send one request (with ``fds`` attached: ops that carry descriptors) and wait for
        its answer; mountd's errors are raised here."""
        result, received = self.call_with_fds(op, args, progress=progress, fds=fds)
        close_all(received)  # none expected
        return result

    def call_with_fds(self, op: str, args: Mapping[str, Any] | None = None, *,
                      progress: ProgressFn | None = None,
                      fds: Sequence[int] = ()) -> tuple[Any, tuple[int, ...]]:
        """:meth:`call`, also giving the descriptors that came with the answer (ops with
        ``reply_fds``): the caller owns them. An error answer carries none."""
        rid = next(self._ids)
        if fds:
            args = {**(args or {}), "fds": len(fds)}
        try:
            frame = protocol.encode_frame(protocol.make_request(rid, op, args))
            if fds:
                send_with_fds_blocking(self._sock, frame, fds)
            else:
                self._sock.sendall(frame)
        except OSError as exc:
            raise MountdUnavailable(f"lost the connection to mountd at {self.path}: {exc}") from None
        while True:
            message, received = self._receive()
            if message.get("id") != rid:
                close_all(received)
                if message.get("id") is None and message.get("ok") is False:
                    raise protocol.exception_from_payload(message.get("error"))
                continue  # a late answer to something else: not ours
            if "progress" in message:
                close_all(received)
                if progress is not None:
                    progress(message["progress"])
                continue
            return result_with_fds(message, received)

    def notify(self, op: str, args: Mapping[str, Any] | None = None) -> None:
        """Send a request that gets no answer (``hits``, ``prefetch``)."""
        self._sock.sendall(protocol.encode_frame(protocol.make_request(None, op, args)))

    # The operations, named as in the protocol.

    def hello(self) -> dict[str, Any]:
        return self.call("hello", {"version": PROTOCOL_VERSION, "client": "quiverfs-sync"})

    def ensure(self, hash: bytes, size: int, location: Location | Mapping[str, Any],
               dataset: str | None = None) -> str:
        return path_of(self.call("ensure", ensure_args(hash, size, location, dataset)))

    def lease(self, hash: bytes, size: int, location: Location | Mapping[str, Any],
              dataset: str | None = None) -> str | None:
        """``ensure`` for a client that supplies its own bytes: the path, or None when this
        client must :meth:`supply` them (it holds the hash's lease until it does)."""
        return self.call("ensure", ensure_args(hash, size, location, dataset)).get("path")

    def supply(self, hash: bytes, size: int, location: Location | Mapping[str, Any], fd: int,
               offset: int, dataset: str | None = None) -> str:
        """Hand mountd the content of ``hash``: ``size`` bytes at ``offset`` of descriptor
        ``fd`` (opened with this process's rights); mountd verifies them. The store path."""
        args = {**ensure_args(hash, size, location, dataset), "offset": offset}
        return self.call("supply", args, fds=[fd])["path"]

    def release(self, hashes: Sequence[bytes]) -> int:
        """Give up leases: this client will not supply these hashes."""
        return self.call("release", {"hashes": [bytes(h).hex() for h in hashes]})["released"]

    def open(self, hashes: Sequence[bytes], dataset: str | None = None,
             sizes: Sequence[int] | None = None) -> list[Opened]:
        """Descriptor hand-off: the store files of up to :data:`MAX_OPEN` hashes, opened by
        mountd (read-only, close-on-exec) and sent in one answer. For each hash, in order,
        ``(descriptor, size)`` (the caller closes the descriptor) or None: not cached, or
        cached with another size than ``sizes`` gives (read those through the mount). Each
        descriptor counts as a hit of ``dataset``: report no hit for it."""
        result, fds = self.call_with_fds("open", open_args(hashes, dataset, sizes))
        return opened_files(result, fds, hashes)

    def stats(self) -> dict[str, Any]:
        return self.call("stats")

    def usage(self) -> dict[str, Any]:
        return self.call("usage")

    def ls(self) -> dict[str, Any]:
        return self.call("ls")

    def evict(self, dataset: str | None = None, *, all: bool = False) -> dict[str, int]:
        return self.call("evict", {"all": True} if all else {"dataset": dataset})

    def scrub(self, progress: ProgressFn | None = None) -> Any:
        return self.call("scrub", progress=progress)

    def shutdown(self) -> dict[str, Any]:
        return self.call("shutdown")


# -- starting mountd on demand --------------------------------------------------------------------


def probe(cache_dir: str | os.PathLike[str] | None = None, timeout: float = CONNECT_TIMEOUT) -> dict[str, Any] | None:
    """mountd's ``hello`` answer when one answers for ``cache_dir``, else None."""
    try:
        with SyncClient.connect(cache_dir, timeout=timeout) as client:
            return client.hello_info
    except MountdUnavailable:
        return None


def _owner_of(path: Path) -> str:
    try:
        return str(path.stat().st_uid)
    except OSError:
        return "?"


@contextmanager
def _start_lock(cache_dir: Path, deadline: float) -> Any:
    fd = os.open(cache_dir / START_LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        delay = 0.005
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise MountdUnavailable(
                        f"timed out waiting for another client starting mountd in {cache_dir}"
                    ) from None
                time.sleep(delay)
                delay = min(delay * 2, 0.1)
        yield
    finally:
        os.close(fd)  # releases the lock


def mountd_command(cache_dir: Path, options: Sequence[str] = ()) -> list[str]:
    """The command that runs mountd in the foreground for ``cache_dir``."""
    return [sys.executable, "-m", "quiverfs.cli", "mountd", "--cache-dir", os.fspath(cache_dir), *options]


def _log_tail(path: Path, lines: int = 3) -> str:
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return " | ".join(line.strip() for line in text[-lines:])


def ensure_running(
    cache_dir: str | os.PathLike[str] | None = None,
    *,
    options: Sequence[str] = (),
    timeout: float = START_TIMEOUT,
) -> dict[str, Any]:
    """Make sure a mountd answers for ``cache_dir``, starting one if needed; its ``hello``.

    ``options`` are extra ``quiverfs mountd`` flags for a mountd started here (e.g.
    ``["--cache-size", "20%"]``); a mountd already running keeps its own. Blocking: polls the
    socket with growing intervals until ``timeout``. Raises :class:`MountdUnavailable` with
    the end of the log when the started mountd exits or stays silent.
    """
    directory, _ = resolve_socket(cache_dir)
    info = probe(directory)
    if info is not None:
        return info
    deadline = time.monotonic() + timeout
    try:
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        if not os.access(directory, os.W_OK | os.X_OK):
            raise PermissionError(errno.EACCES, "not writable", os.fspath(directory))
    except PermissionError:
        # Another user's cache dir (a shared mountd's, docs/operations.md "Security"): a
        # mountd of ours cannot serve it, and starting one would only fail later.
        raise MountdUnavailable(
            f"no mountd is serving {directory}, and uid {os.geteuid()} may not start one "
            f"there (it belongs to uid {_owner_of(directory)}): start the machine's shared "
            f"mountd (docs/operations.md), or pass a --cache-dir of your own"
        ) from None
    with _start_lock(directory, deadline):
        info = probe(directory)  # someone may have started it while we waited for the lock
        if info is not None:
            return info
        log_path = directory / LOG_FILE
        log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        try:
            proc = subprocess.Popen(
                mountd_command(directory, options),
                stdin=subprocess.DEVNULL, stdout=log_fd, stderr=log_fd,
                start_new_session=True,  # detached: no signals from the starter's terminal
                close_fds=True, cwd="/",
            )
        finally:
            os.close(log_fd)
        delay = 0.01
        while True:
            info = probe(directory)
            if info is not None:
                return info
            status = proc.poll()
            if status is not None and status != EXIT_ALREADY_RUNNING:
                raise MountdUnavailable(
                    f"mountd exited with status {status} before it was ready "
                    f"(log {log_path}: {_log_tail(log_path)})"
                )
            # status 75: a mountd started by hand owns the directory and is still coming up.
            if time.monotonic() > deadline:
                raise MountdUnavailable(
                    f"mountd did not answer on {layout.socket_path(directory)} within {timeout:g}s "
                    f"(log {log_path}: {_log_tail(log_path)})"
                )
            time.sleep(delay)
            delay = min(delay * 1.5, 0.2)
