"""Bytes a client hands to mountd as a descriptor, so a fill never uses mountd's authority.

On a machine where one mountd serves every user, mountd must not read a source with its own
rights on a user's behalf (docs/operations.md "Security"). Instead the client supplies the
bytes as an open file descriptor, passed over the unix socket with ``SCM_RIGHTS``:

* a ``file://`` source: the file itself, opened by the mount with the user's own rights (an
  ``open`` the kernel refused never reaches mountd); the content lies at the location's offset;
* a cloud source: an anonymous ``memfd`` the mount filled with what it fetched using its own
  credential chain; the content lies at offset 0.

mountd trusts nothing about those bytes: the fill verifies size and blake3 exactly as for a
fill it fetched itself (:mod:`mountd.store.fillwork`, in a fill process that receives a copy
of the descriptor). A :class:`SuppliedBytes` owns the descriptor: whoever ends up holding it
(the request, or the fill it started) closes it exactly once with :meth:`SuppliedBytes.close`.
"""

from __future__ import annotations

import contextlib
import errno
import os

from quiverfs.base.errors import AccessDenied, BackendError, PermanentFailure

#: URL shown in errors about supplied bytes (they have no remote location of their own).
SUPPLIED_URL = "supplied://"


class SuppliedBytes:
    """Content at ``offset`` of descriptor ``fd`` (or, for a peer's small file, the bytes in
    :attr:`inline`), which a fill reads with ``pread`` (mountd/store/fillwork.py).

    ``holder`` is the client's lease key (its connection: :meth:`mountd.store.cache.Cache.lease`).
    ``adopted`` is set when a fill took it over: the fill then closes it, not the request.
    """

    url = SUPPLIED_URL
    #: The content itself, when it is held in memory rather than behind a descriptor.
    inline: bytes | None = None

    def __init__(self, fd: int, offset: int, holder: object | None = None) -> None:
        self.fd = fd
        self.offset = offset
        self.holder = holder
        self.adopted = False

    def close(self) -> None:
        """Close the descriptor; safe to call again (the number is never closed twice)."""
        fd, self.fd = self.fd, -1
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)


def pread_all(fd: int, offset: int, length: int, url: str = SUPPLIED_URL) -> bytes:
    """Up to ``length`` bytes at ``offset`` of ``fd`` (short only at the end), read errors in
    the backends' vocabulary (``url`` names the source in them)."""
    if fd < 0:
        raise PermanentFailure("the supplied descriptor is closed", url=url, key="")
    parts: list[bytes] = []
    position, left = offset, length
    while left > 0:
        try:
            data = os.pread(fd, left, position)
        except OSError as exc:
            raise _translate(exc, url) from None
        if not data:
            break
        parts.append(data)
        position += len(data)
        left -= len(data)
    return parts[0] if len(parts) == 1 else b"".join(parts)


def _translate(exc: OSError, url: str) -> BackendError:
    """A read error on a supplied descriptor, in the backends' vocabulary."""
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EBADF):  # e.g. opened without read access
        return AccessDenied(f"cannot read the supplied descriptor: {exc.strerror}",
                            url=url, key="")
    return PermanentFailure(f"cannot read the supplied descriptor: {exc.strerror}",
                            url=url, key="")
