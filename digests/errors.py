"""The one error a digest problem raises."""

from __future__ import annotations

from quiverfs.errors import QuiverError


class DigestError(QuiverError):
    """A digest file is missing, not a digest, broken or hostile; ``str()`` is one line.

    Exit code 4 (see :mod:`quiverfs.console`). The message names the file and the first
    problem found, e.g. ``invalid digest a.qd: file 17: path component '..' is not allowed``.
    """

    exit_code = 4


class Interrupted(QuiverError):
    """Ctrl-C during long work; says how to go on. Exit code 130, like a shell."""

    exit_code = 130


def single_error(group: BaseExceptionGroup) -> BaseException:
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
