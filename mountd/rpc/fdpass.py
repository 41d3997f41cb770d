"""Descriptors over mountd's socket (``SCM_RIGHTS``), next to the JSON frames, both ways.

A request that carries descriptors (ops with ``fds`` in :data:`mountd.rpc.protocol.OPERATIONS`;
its ``fds`` argument says how many) is sent with one ``sendmsg`` whose ancillary data holds
them; so is a response that carries descriptors (ops with ``reply_fds``: ``open``; its
top-level ``fds`` says how many). On a unix stream socket the kernel hands ancillary data to
the ``recvmsg`` that reads the first byte sent with it, and a ``recvmsg`` that took
descriptors reads nothing past the bytes sent with them, so one read never holds two sends'
descriptors. A sender writes a frame and its descriptors under one lock (frames never
interleave), so the receiver queues descriptors in arrival order and each message takes its
count from the front when it is parsed, which is always after its own descriptors arrived
(with its first byte) and after every earlier message took its own.

A read whose ancillary buffer was too small (``MSG_CTRUNC``: the kernel closed what did not
fit) is a :class:`~mountd.errors.ProtocolError`: the queue no longer matches the messages,
so the connection must go. A client that sends descriptors it does not announce only
confuses its own connection; the queue is bounded, and everything left in it is closed with
the connection.
"""

from __future__ import annotations

import array
import contextlib
import os
import socket
from collections import deque
from collections.abc import Sequence
from typing import Any

import trio

from mountd.errors import ProtocolError
from mountd.rpc.protocol import MAX_FDS

#: Descriptors a connection may have received and not yet claimed by a request.
MAX_QUEUED = 64

_INT = array.array("i").itemsize


def ancillary_space(max_fds: int) -> int:
    """Bytes of ancillary buffer a ``recvmsg`` needs to take ``max_fds`` descriptors."""
    return socket.CMSG_SPACE(max_fds * _INT)


#: The ancillary buffer of mountd's reads (a request carries at most MAX_FDS).
ANCILLARY_SPACE = ancillary_space(MAX_FDS)


def unpack_rights(ancillary: Sequence[tuple[int, int, bytes]]) -> list[int]:
    """The descriptors in ``recvmsg``'s ancillary data."""
    fds: list[int] = []
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            numbers = array.array("i")
            numbers.frombytes(payload[: len(payload) - len(payload) % _INT])
            fds.extend(numbers)
    return fds


def _checked(ancillary: Sequence[tuple[int, int, bytes]], flags: int) -> list[int]:
    """The descriptors of one ``recvmsg``; :class:`ProtocolError` (those closed) when the
    kernel had to drop some for lack of room (``MSG_CTRUNC``)."""
    received = unpack_rights(ancillary)
    if flags & socket.MSG_CTRUNC:
        close_all(received)
        raise ProtocolError(
            "descriptors were truncated (more came with one message than the protocol allows)")
    return received


def close_all(fds: Sequence[int]) -> None:
    """Close descriptors, ignoring errors (never raises)."""
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


class DescriptorStream:
    """``receive_some`` over a trio unix socket that also queues descriptors that arrive.

    Wraps the socket of a ``trio.SocketStream`` for :class:`mountd.rpc.protocol.ExactReader`;
    :meth:`take` gives a message its descriptors; :meth:`close` closes unclaimed ones.
    ``max_fds``: most descriptors one message carries (mountd reads requests, at most
    :data:`~mountd.rpc.protocol.MAX_FDS`; a client reads responses, at most
    :data:`~mountd.rpc.protocol.MAX_OPEN`). ``max_queued``: most kept unclaimed (the oldest
    are closed beyond it). The blocking client reads with :func:`receive_with_fds_blocking`
    and uses only the queue (:meth:`queue`, :meth:`take`, :meth:`close`).
    """

    def __init__(self, sock: Any, max_fds: int = MAX_FDS, max_queued: int = MAX_QUEUED) -> None:
        self.sock = sock
        self.fds: deque[int] = deque()
        self._space = ancillary_space(max_fds)
        self._max_queued = max_queued

    async def receive_some(self, max_bytes: int) -> bytes:
        """Up to ``max_bytes`` (b"" at EOF), their descriptors queued. A peer that vanished
        with bytes unread (``ECONNRESET``) raises ``trio.BrokenResourceError``, as a
        ``trio.SocketStream`` does: an ordinary disconnect, not a failure to log."""
        try:
            data, ancillary, flags, _ = await self.sock.recvmsg(
                max_bytes, self._space, socket.MSG_CMSG_CLOEXEC)
        except (ConnectionResetError, BrokenPipeError) as exc:
            raise trio.BrokenResourceError(f"peer gone: {exc}") from exc
        self.queue(_checked(ancillary, flags))
        return data

    def queue(self, received: Sequence[int]) -> None:
        """Append descriptors that arrived (the oldest beyond the bound are closed)."""
        if received:
            self.fds.extend(received)
            while len(self.fds) > self._max_queued:  # never claimed: a confused peer
                close_all([self.fds.popleft()])

    def take(self, count: int) -> tuple[int, ...]:
        """The next ``count`` descriptors; :class:`ProtocolError` when fewer arrived."""
        if count > len(self.fds):
            raise ProtocolError(
                f"a message announces {count} descriptors but {len(self.fds)} came with it")
        return tuple(self.fds.popleft() for _ in range(count))

    def close(self) -> None:
        """Close every descriptor no request claimed."""
        close_all(list(self.fds))
        self.fds.clear()


async def send_frame(stream: trio.SocketStream, lock: trio.Lock, frame: bytes) -> None:
    """Send ``frame`` on ``stream``, frames never interleaved (``lock``): at once, without a
    trip through trio's scheduler, when the lock is free and the socket takes the whole frame
    (the usual case); else in line.

    Why: every ``await`` of trio's yields to every other ready task first. Under load mountd
    had dozens, and an answer to a miss waited ~6 ms for its turn to be written (the
    ``answer`` stage of ``fill_stages``, 2026-11-28).

    Cancellation can only come before the first byte (while waiting for the lock): once part
    of the frame is written, the rest is written shielded, so the stream never holds half a
    frame. Errors are ``send_all``'s (``trio.BrokenResourceError``,
    ``trio.ClosedResourceError``) or the socket's ``OSError``."""
    try:
        lock.acquire_nowait()
    except trio.WouldBlock:
        await lock.acquire()
    try:
        try:
            sent = os.write(stream.socket.fileno(), frame)  # the socket is non-blocking
        except BlockingIOError:
            sent = 0
        if sent < len(frame):
            with trio.CancelScope(shield=True):
                await stream.send_all(memoryview(frame)[sent:])
    finally:
        lock.release()


async def send_with_fds(sock: Any, frame: bytes, fds: Sequence[int]) -> None:
    """Send ``frame`` on a trio socket with ``fds`` attached to its first byte. An error of
    the first ``sendmsg`` (``ETOOMANYREFS``, say) leaves nothing sent."""
    rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())]
    sent = await sock.sendmsg([frame], rights)
    view = memoryview(frame)[sent:]
    while view:
        sent = await sock.send(view)
        view = view[sent:]


def receive_with_fds_blocking(sock: socket.socket, max_bytes: int, max_fds: int) -> tuple[bytes, list[int]]:
    """One ``recvmsg`` on a blocking stdlib socket: the bytes and the descriptors that came
    with them (close-on-exec); :class:`ProtocolError` on ``MSG_CTRUNC``."""
    data, ancillary, flags, _ = sock.recvmsg(max_bytes, ancillary_space(max_fds),
                                             socket.MSG_CMSG_CLOEXEC)
    return data, _checked(ancillary, flags)


def send_with_fds_blocking(sock: socket.socket, frame: bytes, fds: Sequence[int]) -> None:
    """:func:`send_with_fds` for a blocking stdlib socket."""
    sent = socket.send_fds(sock, [frame], list(fds))
    if sent < len(frame):
        sock.sendall(memoryview(frame)[sent:])
