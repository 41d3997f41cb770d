"""mountd's listening socket: a unix socket at a path short enough, with exactly the
permissions asked and no moment with wider ones (:func:`bind_socket`).

Apart from the server because it is about the socket *file* (its path, its mode and group,
the umask around ``bind()``), which the daemon makes once at start-up, before any
connection exists (:mod:`mountd.daemon`); the server only accepts on it.
"""

from __future__ import annotations

import contextlib
import os
import socket
import stat

import trio

from quiverfs.base.errors import UsageError

__all__ = ["MAX_SOCKET_PATH", "bind_socket", "check_socket_path"]

#: sizeof(sockaddr_un.sun_path) on Linux, including the terminating NUL.
MAX_SOCKET_PATH = 108


def check_socket_path(path: str | os.PathLike[str]) -> None:
    """:class:`UsageError` when ``path`` cannot be a unix socket address (too long)."""
    if len(os.fsencode(path)) >= MAX_SOCKET_PATH:
        raise UsageError(
            f"socket path {os.fspath(path)!r} is too long for a unix socket "
            f"({len(os.fsencode(path))} bytes, at most {MAX_SOCKET_PATH - 1}): use a shorter --cache-dir"
        )


def bind_socket(path: str | os.PathLike[str], backlog: int = 128, *, mode: int = 0o600,
                gid: int | None = None) -> trio.socket.SocketType:
    """A listening unix socket at ``path`` with ``mode`` (and group ``gid``), never wider.

    ``bind()`` creates the socket file with the process umask applied, so the umask is set
    around it to leave only ``mode``'s owner bits: there is no moment at which the file is
    reachable by anyone else. Then the group is changed (still owner-only), and only then is
    the final mode set, so the group that may connect is never the wrong one (mountd's own).
    The socket listens last: until then a connect is refused whatever the mode. The umask is
    process-wide; nothing else here creates files between the two ``umask`` calls (no
    ``await`` in between). A stale socket file must have been removed by the caller, who
    knows (holding the cache-dir lock) that no other mountd can own it. Changing the group
    needs root or membership of it: :class:`UsageError` otherwise.
    """
    check_socket_path(path)
    if mode & ~0o777:
        raise UsageError(f"socket mode {mode:o} is not a permission mode (0 to 0777)")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    bound = False
    try:
        old = os.umask(0o777 & ~(mode & stat.S_IRWXU))
        try:
            sock.bind(os.fspath(path))  # the blocking stdlib bind: no await in the umask window
        finally:
            os.umask(old)
        bound = True
        if gid is not None:
            try:
                os.chown(path, -1, gid)
            except PermissionError:
                raise UsageError(
                    f"cannot give the socket {os.fspath(path)} to group {gid}: mountd's user "
                    f"(uid {os.geteuid()}) is not a member of it; add it, or run mountd as root"
                ) from None
        os.chmod(path, mode)  # explicit, whatever the umask was
        sock.listen(backlog)
    except BaseException:
        sock.close()
        if bound:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        raise
    return trio.socket.from_stdlib_socket(sock)
