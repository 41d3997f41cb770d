"""Opening a FUSE connection: mount through ``fusermount3``, answer INIT, unmount.

``fusermount3`` (setuid, from the fuse3 package) does the mount for root and for users alike:
it opens ``/dev/fuse``, mounts it with our options and hands the descriptor back over a
unix socket (the ``_FUSE_COMMFD`` protocol libfuse uses). The kernel's first request on the
new connection is INIT, which :func:`handshake` answers before anything else is served.
:func:`clone` gives each serving process a descriptor of its own on the same connection.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import socket
import struct
import subprocess
from collections.abc import Iterable

from quiverfs.base.errors import QuiverError
from quiverfs.protocol import fuse_wire

log = logging.getLogger("quiverfs.fuse")

FUSERMOUNT = "fusermount3"

#: ``_IOR(229, 0, uint32_t)``: attach a fresh ``/dev/fuse`` descriptor to a connection.
FUSE_DEV_IOC_CLONE = 0x8004E500
#: ``_IOW(229, 1, struct fuse_backing_map)``: register an open file as a passthrough backing
#: file of the connection; returns its backing id (Linux 6.9; needs ``CAP_SYS_ADMIN``).
FUSE_DEV_IOC_BACKING_OPEN = 0x4010E501
#: ``_IOW(229, 2, uint32_t)``: drop a backing id (the files opened with it keep their file).
FUSE_DEV_IOC_BACKING_CLOSE = 0x4004E502
#: ``struct fuse_backing_map``: fd, flags, padding.
_BACKING_MAP = struct.Struct("<iIQ")


class FuseMountError(QuiverError):
    """The kernel or fusermount3 refused the mount."""


def mount(mountpoint: str | os.PathLike[str], options: Iterable[str]) -> int:
    """Mount a FUSE filesystem at ``mountpoint``; the connection's ``/dev/fuse`` descriptor."""
    mountpoint = os.fspath(mountpoint)
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with ours:
        try:
            env = dict(os.environ, _FUSE_COMMFD=str(theirs.fileno()))
            proc = subprocess.run(
                [FUSERMOUNT, "-o", ",".join(sorted(options)), "--", mountpoint],
                env=env, pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL,
                capture_output=True, text=True, timeout=30, check=False,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise FuseMountError(f"cannot run {FUSERMOUNT}: {exc}") from None
        finally:
            theirs.close()
        _, fds, _, _ = socket.recv_fds(ours, 8, 1)
    if proc.returncode != 0 or not fds:
        for fd in fds:
            os.close(fd)
        detail = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}"
        raise FuseMountError(f"cannot mount at {mountpoint}: {detail}")
    os.set_inheritable(fds[0], False)
    return fds[0]


def send(fd: int, out: bytes | list[bytes], what: str = "a FUSE request") -> bool:
    """Write one reply (or notification) to the connection ``fd`` in one ``write``/``writev``.

    The one writer to ``/dev/fuse`` of every serving process. Returns False when the
    connection is gone (``ENODEV``: unmounted), True otherwise. ``ENOENT`` is not a failure:
    the kernel no longer waits for that request (it was interrupted, or its process killed)
    or, for a notification, no longer knows that inode. Anything else is logged and dropped:
    a reply that cannot be written cannot be answered any other way (``what`` names it in
    the log line).
    """
    try:
        if type(out) is list:
            os.writev(fd, out)
        else:
            os.write(fd, out)  # type: ignore[arg-type]
    except OSError as exc:
        if exc.errno == errno.ENODEV:
            return False
        if exc.errno != errno.ENOENT:
            log.warning("cannot answer %s: %s", what, exc)
    return True


def handshake(fd: int, passthrough: bool = False) -> tuple[int, int, bool]:
    """Read the kernel's INIT from ``fd`` and answer it; ``(minor, flags, passthrough)``
    agreed on. ``passthrough``: ask for passthrough opens where the kernel offers them
    (docs/mount.md "Passthrough")."""
    while True:
        try:
            request = os.read(fd, fuse_wire.REQUEST_BUFFER)
            break
        except InterruptedError:
            continue
    _, opcode, unique, _ = fuse_wire.parse_header(request)
    if opcode != fuse_wire.INIT:
        raise FuseMountError(f"the kernel's first FUSE request was {fuse_wire.opcode_name(opcode)}, not INIT")
    major, minor, max_readahead, flags = fuse_wire.INIT_IN.unpack_from(request, fuse_wire.HEADER_SIZE)
    if major != fuse_wire.KERNEL_MAJOR or minor < fuse_wire.MIN_KERNEL_MINOR:
        # Refuse rather than fall back to pyfuse3 on our own: the fallback is an optional
        # extra that may not be installed, and it is several times slower, which an operator
        # should choose knowingly (docs/mount.md "Front ends").
        send(fd, fuse_wire.error(unique, errno.EPROTO), "INIT")
        raise FuseMountError(
            f"the kernel speaks FUSE {major}.{minor}; the native front end needs "
            f"{fuse_wire.KERNEL_MAJOR}.{fuse_wire.MIN_KERNEL_MINOR} or a later "
            f"{fuse_wire.KERNEL_MAJOR}.x (Linux 5.1+): mount with --frontend pyfuse3")
    passthrough = passthrough and fuse_wire.offers_passthrough(request)
    body = fuse_wire.init_body(minor, flags, max_readahead, passthrough)
    if not send(fd, fuse_wire.reply(unique, body), "INIT"):
        raise FuseMountError("the kernel closed the FUSE connection during INIT")
    agreed_minor = min(minor, fuse_wire.KERNEL_MINOR)
    log.debug("FUSE %d.%d, flags %#x, passthrough %s", major, agreed_minor,
              flags & fuse_wire.WANTED_FLAGS, passthrough)
    return agreed_minor, flags & fuse_wire.WANTED_FLAGS, passthrough


#: Read-ahead the mount's device gets (KiB; the kernel's default is 128): the largest READ the
#: mount asks for.
READ_AHEAD_KIB = fuse_wire.MAX_READ_BYTES >> 10


def widen_read_ahead(device: str, kib: int = READ_AHEAD_KIB) -> bool:
    """Raise the read-ahead of the mount whose device is ``device`` (``major:minor``) to
    ``kib``, through ``/sys/class/bdi`` (root only; the INIT reply can only lower it, so this
    comes after INIT); whether it is that wide now.

    Why: a file's first read asks for its ``st_blksize`` (quiverfs/filesystem/tree.py
    ``io_block``: up to 1 MiB), but the kernel cuts a read into read-ahead windows of at most
    this many KiB, each a READ to the mount: a 200 KiB JPEG cost two round trips at 128.
    """
    path = f"/sys/class/bdi/{device}/read_ahead_kb"
    try:
        with open(path) as f:
            if int(f.read()) >= kib:
                return True
        with open(path, "w") as f:
            f.write(str(kib))
        return True
    except (OSError, ValueError) as exc:
        log.debug("cannot widen the read-ahead of %s: %s", path, exc)
        return False


def backing_open(fuse_fd: int, fd: int) -> int:
    """Register the open file ``fd`` as a passthrough backing file of the connection of
    ``fuse_fd``; its backing id, for one OPEN reply (then :func:`backing_close`). Raises
    OSError (``EPERM`` without ``CAP_SYS_ADMIN``, ``EOPNOTSUPP`` without passthrough)."""
    # A mutable buffer makes fcntl.ioctl return the call's result (the id), not the buffer.
    return fcntl.ioctl(fuse_fd, FUSE_DEV_IOC_BACKING_OPEN, bytearray(_BACKING_MAP.pack(fd, 0, 0)), True)


def backing_close(fuse_fd: int, backing_id: int) -> None:
    """Drop ``backing_id``: the files the kernel opened with it keep their backing file."""
    try:
        fcntl.ioctl(fuse_fd, FUSE_DEV_IOC_BACKING_CLOSE, struct.pack("<I", backing_id))
    except OSError as exc:
        log.warning("cannot close passthrough backing id %d: %s", backing_id, exc)


def clone(session_fd: int) -> int:
    """A new ``/dev/fuse`` descriptor on the connection of ``session_fd`` (Linux >= 4.5).

    Requests are handed to readers of any descriptor of the connection, but each request
    read is answered through the descriptor it was read from, and closing the last copy of
    a descriptor ends the requests read from it and not yet answered (the reader gets
    ECONNABORTED). That is why every worker has one: when a worker dies, closing its
    descriptor answers whatever it took with it (quiverfs/fuse/worker_pool.py).
    """
    fd = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)
    try:
        fcntl.ioctl(fd, FUSE_DEV_IOC_CLONE, struct.pack("I", session_fd))
    except OSError as exc:
        os.close(fd)
        raise FuseMountError(f"cannot clone the FUSE connection: {os.strerror(exc.errno or errno.EIO)}") from None
    return fd


def unmount(mountpoint: str | os.PathLike[str], *, lazy: bool = True) -> bool:
    """Unmount ``mountpoint`` (lazily by default: files still open keep working until closed)."""
    args = [FUSERMOUNT, "-u", "-q", *(["-z"] if lazy else []), "--", os.fspath(mountpoint)]
    try:
        done = subprocess.run(args, stdin=subprocess.DEVNULL, capture_output=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        log.warning("cannot unmount %s: %s", mountpoint, exc)
        return False
    return done.returncode == 0
