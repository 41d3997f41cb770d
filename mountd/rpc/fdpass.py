"""Descriptors over mountd's socket (``SCM_RIGHTS``), next to the JSON frames.

A request that carries descriptors (ops with ``fds`` in :data:`mountd.rpc.protocol.OPERATIONS`;
its ``fds`` argument says how many) is sent with one ``sendmsg`` whose ancillary data holds
them. On a unix stream socket the kernel hands ancillary data to the ``recvmsg`` that reads the
first byte sent with it, and never merges two senders' ancillary data into one read; so the
server queues descriptors in arrival order and each request takes its count from the front
when it is parsed, which is always after its own descriptors arrived.

A client that sends descriptors it does not announce only confuses its own connection; the
queue is bounded, and everything left in it is closed with the connection.
"""

from __future__ import annotations

import array
import contextlib
import os
import socket
from collections import deque
from collections.abc import Sequence
from typing import Any

from mountd.errors import ProtocolError
from mountd.rpc.protocol import MAX_FDS

#: Descriptors a connection may have received and not yet claimed by a request.
MAX_QUEUED = 64

_INT = array.array("i").itemsize
ANCILLARY_SPACE = socket.CMSG_SPACE(MAX_FDS * _INT)


def unpack_rights(ancillary: Sequence[tuple[int, int, bytes]]) -> list[int]:
    """The descriptors in ``recvmsg``'s ancillary data."""
    fds: list[int] = []
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            numbers = array.array("i")
            numbers.frombytes(payload[: len(payload) - len(payload) % _INT])
            fds.extend(numbers)
    return fds


def close_all(fds: Sequence[int]) -> None:
    """Close descriptors, ignoring errors (never raises)."""
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


class DescriptorStream:
    """``receive_some`` over a trio unix socket that also queues descriptors that arrive.

    Wraps the socket of a ``trio.SocketStream`` for :class:`mountd.rpc.protocol.ExactReader`;
    :meth:`take` gives a request its descriptors; :meth:`close` closes unclaimed ones.
    """

    def __init__(self, sock: Any) -> None:
        self.sock = sock
        self.fds: deque[int] = deque()

    async def receive_some(self, max_bytes: int) -> bytes:
        data, ancillary, flags, _ = await self.sock.recvmsg(
            max_bytes, ANCILLARY_SPACE, socket.MSG_CMSG_CLOEXEC)
        received = unpack_rights(ancillary)
        if received:
            self.fds.extend(received)
            while len(self.fds) > MAX_QUEUED:  # never claimed: a confused client
                close_all([self.fds.popleft()])
        return data

    def take(self, count: int) -> tuple[int, ...]:
        """The next ``count`` descriptors; :class:`ProtocolError` when fewer arrived."""
        if count > len(self.fds):
            raise ProtocolError(
                f"the request announces {count} descriptors but {len(self.fds)} came with it")
        return tuple(self.fds.popleft() for _ in range(count))

    def close(self) -> None:
        """Close every descriptor no request claimed."""
        close_all(list(self.fds))
        self.fds.clear()


async def send_with_fds(sock: Any, frame: bytes, fds: Sequence[int]) -> None:
    """Send ``frame`` on a trio socket with ``fds`` attached to its first byte."""
    rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())]
    sent = await sock.sendmsg([frame], rights)
    view = memoryview(frame)[sent:]
    while view:
        sent = await sock.send(view)
        view = view[sent:]


def send_with_fds_blocking(sock: socket.socket, frame: bytes, fds: Sequence[int]) -> None:
    """:func:`send_with_fds` for a blocking stdlib socket."""
    sent = socket.send_fds(sock, [frame], list(fds))
    if sent < len(frame):
        sock.sendall(memoryview(frame)[sent:])
