"""The one error a digest problem raises."""

from __future__ import annotations

from quiverfs.base.errors import QuiverError


class DigestError(QuiverError):
    """A digest file is missing, not a digest, broken or hostile; ``str()`` is one line.

    Exit code 4 (see :mod:`quiverfs.base.console`). The message names the file and the first
    problem found, e.g. ``invalid digest a.qd: file 17: path component '..' is not allowed``.
    """

    exit_code = 4


class Interrupted(QuiverError):
    """Ctrl-C during long work; says how to go on. Exit code 130, like a shell."""

    exit_code = 130
