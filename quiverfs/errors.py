"""The small error vocabulary every part of quiverfs speaks.

Backends translate their SDK's exceptions into these (keeping ``__cause__``), the filesystem
maps them to errno in one place, and the command line prints ``str(exc)`` as one line with
the class's ``exit_code``. Messages say what went wrong and, where it helps, what to do.
"""

from __future__ import annotations


class QuiverError(Exception):
    """Base of every error quiverfs reports to a user; ``str()`` is one readable line."""

    exit_code = 1


class UsageError(QuiverError):
    """Bad input from the user (an unknown URL scheme, a missing file, a bad option value)."""

    exit_code = 2


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
    """The credentials from the SDK's standard chain are missing or not allowed to do this."""


class TemporaryFailure(BackendError):
    """A failure worth retrying: timeouts, 5xx, throttling, connection resets."""


class PermanentFailure(BackendError):
    """A failure that retrying will not fix and that fits no narrower class (e.g. 400, 416)."""


class CorruptObject(BackendError):
    """Bytes read from the remote do not match what the digest says (size or content hash)."""


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
