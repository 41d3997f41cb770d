"""The small error vocabulary every part of quiverfs speaks (the base layer: imports nothing
of ours).

Backends translate their SDK's exceptions into these (keeping ``__cause__``); each package adds
its own in one module (``digests/errors.py``, ``mountd/errors.py``). Every class says, as class
attributes, what it means to the two kinds of callers:

* ``exit_code``: the status a command exits with after printing ``str(exc)`` as one line
  (docs/operations.md "Exit codes": 1 failure, 2 usage, 3 remote, 4 invalid digest, 5 cache);
* ``errno``: what a file operation on a mount reports for it (a read, a control-channel
  request); :func:`errno_for` is the one mapping.

Class attributes (not ``__init__`` arguments) are what survive mountd's error transport, which
rebuilds a class by name without calling its ``__init__`` (mountd/rpc/protocol.py).
"""

from __future__ import annotations

import errno as _errno
import os


class QuiverError(Exception):
    """Base of every error quiverfs reports to a user; ``str()`` is one readable line."""

    exit_code = 1
    #: What a read or a control request on a mount fails with: EIO unless a class knows better.
    errno = _errno.EIO


class UsageError(QuiverError):
    """Bad input from the user (an unknown URL scheme, a missing file, a bad option value)."""

    exit_code = 2
    errno = _errno.EINVAL


class BackendError(QuiverError):
    """A remote operation failed; ``url`` and ``key`` say where (never credentials)."""

    exit_code = 3

    def __init__(self, message: str, *, url: str = "", key: str = "") -> None:
        self.url = url
        self.key = key
        where = f"{url.rstrip('/')}/{key}" if key else url
        super().__init__(f"{message}: {where}" if where else message)


class NotFound(BackendError):
    """The object (or bucket, container) does not exist."""


class AccessDenied(BackendError):
    """The credentials from the SDK's standard chain are missing or not allowed to do this
    (or, on a shared mountd, the reading user may not open the ``file://`` source)."""

    errno = _errno.EACCES


class TemporaryFailure(BackendError):
    """A failure worth retrying: timeouts, 5xx, throttling, connection resets."""


class PermanentFailure(BackendError):
    """A failure that retrying will not fix and that fits no narrower class (e.g. 400, 416)."""


class CorruptObject(BackendError):
    """Bytes read from the remote do not match what the digest says (size or content hash)."""


class FsError(Exception):
    """A file operation on a mount fails with ``errno`` (positive); raised where the errno is
    already decided (a missing name, a directory read as a file, a malformed control name)."""

    def __init__(self, code: int, message: str | None = None) -> None:
        super().__init__(code, message or os.strerror(code))
        self.errno = code


def errno_for(exc: BaseException) -> int:
    """The errno a failed file operation reports for ``exc``: the one mapping (docs/mount.md).

    :class:`FsError` carries its own; our vocabulary's classes say theirs (``errno`` class
    attribute: ``ENOSPC`` for a full cache, ``EACCES`` for a refused caller, the session
    errors' ``ENOENT``/``EBUSY``/``ESTALE``/``EINVAL``); anything else (an ``OSError`` on a store
    file, a bug) is ``EIO``: the operation fails cleanly and the mount keeps serving.
    """
    if isinstance(exc, FsError | QuiverError):
        return exc.errno
    return _errno.EIO


def first_error(group: BaseExceptionGroup) -> BaseException:
    """The exception to report for a nursery's exception group.

    trio groups the errors of concurrent tasks; a user wants the first real one, as one line.
    Our own errors win over others; cancellations are never the story.
    """
    leaves: list[BaseException] = []

    def walk(exc: BaseException) -> None:
        if isinstance(exc, BaseExceptionGroup):
            for inner in exc.exceptions:
                walk(inner)
        else:
            leaves.append(exc)

    walk(group)
    for exc in leaves:
        if isinstance(exc, KeyboardInterrupt):
            return exc
    for exc in leaves:
        if isinstance(exc, QuiverError):
            return exc
    return leaves[0] if leaves else group
