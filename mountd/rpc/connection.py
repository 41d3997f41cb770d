"""One client connection of mountd's server: who is on the other end (:class:`Peer`, from
``SO_PEERCRED``) and how answers go back to it (:meth:`Connection.send`, with descriptors or
without, never an error when the client has gone).

Apart from :mod:`mountd.rpc.server`, which reads requests and runs the operations: this is
the per-connection state and the sending side the server's operations write to.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import struct
from dataclasses import dataclass, field
from typing import Any

import trio

from mountd.errors import CacheError, ProtocolError
from mountd.rpc import protocol
from mountd.rpc.fdpass import DescriptorStream, send_frame, send_with_fds

__all__ = ["MAX_IN_FLIGHT", "Connection", "Peer", "peer_credentials"]

log = logging.getLogger("mountd.rpc.connection")

#: Requests one connection may have in flight; the reader stops reading beyond this, which
#: pushes back on a client that pipelines faster than fills complete.
MAX_IN_FLIGHT = 1024

_PEERCRED = struct.Struct("3i")  # struct ucred { pid_t pid; uid_t uid; gid_t gid; }

#: Errors of a send that mean the client went away.
_PEER_GONE = frozenset({errno.EPIPE, errno.ECONNRESET, errno.ENOTCONN, errno.EBADF})


@dataclass(frozen=True, slots=True)
class Peer:
    """Who is on the other end of a connection, as the kernel saw it at ``connect()``."""

    pid: int
    uid: int
    gid: int


def peer_credentials(sock: Any) -> Peer:
    """``SO_PEERCRED`` of a connected unix socket (Linux)."""
    data = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
    return Peer(*_PEERCRED.unpack(data))


@dataclass(eq=False)
class Connection:
    """One client connection: its stream, peer, send lock and the mounts it registered."""

    id: int
    stream: trio.SocketStream
    peer: Peer
    admin: bool
    #: mountd may read sources with its own rights for this peer (same uid as mountd): see
    #: :meth:`mountd.rpc.server.Server.fills_for`. Otherwise the peer supplies the bytes (``supply``).
    fills: bool = True
    #: Receives the descriptors requests carry (None: not a unix socket, e.g. in tests).
    descriptors: DescriptorStream | None = None
    send_lock: trio.Lock = field(default_factory=trio.Lock)
    slots: trio.Semaphore = field(default_factory=lambda: trio.Semaphore(MAX_IN_FLIGHT))
    mounts: set[int] = field(default_factory=set)
    closed: bool = False
    #: Requests waiting for news (``evictions`` with ``wait_ms``): cancelled when the client
    #: stops sending (end of stream), so a closed connection is let go at once.
    waits: set[trio.CancelScope] = field(default_factory=set)

    @property
    def charge_uid(self) -> int | None:
        """The uid the fills this peer causes are charged to (mountd/store/quota.py); None
        when the kernel reported none (not a unix socket)."""
        return self.peer.uid if self.peer.uid >= 0 else None

    async def send(self, message: dict[str, Any], fds: list[int] | tuple[int, ...] = ()) -> None:
        """Send one frame (with ``fds`` attached to its first byte: the message says how
        many); a client that went away is not an error (its answers are dropped). The
        caller still closes ``fds``: the kernel passes copies."""
        try:
            frame = protocol.encode_frame(message)
        except ProtocolError as exc:  # a result too large for a frame: say so instead
            frame = protocol.encode_frame(protocol.error_response(message.get("id"), exc))
            fds = ()
        if self.closed:
            return
        if not fds:
            try:
                await send_frame(self.stream, self.send_lock, frame)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                self.closed = True  # the client left
            return
        async with self.send_lock:
            try:
                if fds:
                    try:
                        await send_with_fds(self.stream.socket, frame, fds)
                    except OSError as exc:
                        if exc.errno in _PEER_GONE:
                            raise
                        # Refused before a byte went (ETOOMANYREFS: too many descriptors in
                        # flight to readers that do not read): the client must still get an
                        # answer, or it would wait forever; it reads through its mount.
                        log.warning("cannot send %d descriptors: %s", len(fds), exc)
                        frame = protocol.encode_frame(protocol.error_response(message.get("id"), CacheError(
                            f"mountd could not hand over descriptors ({os.strerror(exc.errno or 0)})")))
                        await self.stream.send_all(frame)
                else:
                    await self.stream.send_all(frame)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                # OSError: sendmsg on the raw socket (EPIPE, ECONNRESET: the client left).
                self.closed = True
