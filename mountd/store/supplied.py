"""Bytes a client hands to mountd as a descriptor, so a fill never uses mountd's authority.

On a machine where one mountd serves every user, mountd must not read a source with its own
rights on a user's behalf (docs/operations.md "Security"). Instead the client supplies the
bytes as an open file descriptor, passed over the unix socket with ``SCM_RIGHTS``:

* a ``file://`` source: the file itself, opened by the mount with the user's own rights (an
  ``open`` the kernel refused never reaches mountd); the content lies at the location's offset;
* a cloud source: an anonymous ``memfd`` the mount filled with what it fetched using its own
  credential chain; the content lies at offset 0.

mountd trusts nothing about those bytes: the fill verifies size and blake3 exactly as for a
fill it fetched itself (:mod:`mountd.store.fill`). A :class:`SuppliedBytes` looks like the part
of a :class:`~quiverfs.backends.Backend` a fill uses (``read_range`` and ``read_range_then``),
and it owns the descriptor: whoever ends up holding it (the request, or the fill it started)
closes it exactly once with :meth:`SuppliedBytes.close`.
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Callable
from typing import TypeVar

import trio

from quiverfs.errors import AccessDenied, BackendError, PermanentFailure

T = TypeVar("T")

#: URL shown in errors about supplied bytes (they have no remote location of their own).
SUPPLIED_URL = "supplied://"


class SuppliedBytes:
    """Content at ``offset`` of descriptor ``fd``, read with ``pread`` in worker threads.

    ``holder`` is the client's lease key (its connection: :meth:`mountd.store.cache.Cache.lease`).
    ``adopted`` is set when a fill took it over: the fill then closes it, not the request.
    """

    url = SUPPLIED_URL

    def __init__(self, fd: int, offset: int, holder: object | None = None) -> None:
        self.fd = fd
        self.offset = offset
        self.holder = holder
        self.adopted = False

    def _pread(self, offset: int, length: int) -> bytes:
        """Up to ``length`` bytes at ``self.offset + offset`` (short only at the end)."""
        if self.fd < 0:
            raise PermanentFailure("the supplied descriptor is closed", url=SUPPLIED_URL, key="")
        parts: list[bytes] = []
        position, left = self.offset + offset, length
        while left > 0:
            try:
                data = os.pread(self.fd, left, position)
            except OSError as exc:
                raise _translate(exc) from None
            if not data:
                break
            parts.append(data)
            position += len(data)
            left -= len(data)
        return b"".join(parts)

    async def read_range(self, key: str, offset: int, length: int) -> bytes:
        """Like :meth:`Backend.read_range` (``key`` is ignored: the descriptor is the object).
        Never abandoned on cancellation, so the descriptor is not closed under a read."""
        return await trio.to_thread.run_sync(self._pread, offset, length)

    async def read_range_then(self, key: str, offset: int, length: int,
                              then: Callable[[bytes], T]) -> T:
        """:meth:`read_range`, then ``then(bytes)`` in the same worker thread."""
        return await trio.to_thread.run_sync(lambda: then(self._pread(offset, length)))

    def close(self) -> None:
        """Close the descriptor; safe to call again (the number is never closed twice)."""
        fd, self.fd = self.fd, -1
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)


def _translate(exc: OSError) -> BackendError:
    """A read error on a supplied descriptor, in the backends' vocabulary."""
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EBADF):  # e.g. opened without read access
        return AccessDenied(f"cannot read the supplied descriptor: {exc.strerror}",
                            url=SUPPLIED_URL, key="")
    return PermanentFailure(f"cannot read the supplied descriptor: {exc.strerror}",
                            url=SUPPLIED_URL, key="")
