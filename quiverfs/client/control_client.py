"""The caller side of the control channel (docs/control-protocol.md): requests as ``getxattr``.

* :class:`ControlClient` — blocking, any process (no trio: the shim imports it into every
  DataLoader worker): builds names with a fresh nonce (:func:`quiverfs.protocol.control.make_name`),
  follows paged responses, and raises ``OSError(errno)``.
* :func:`find_mount_root` — the quiverfs mount a path is on.
"""

from __future__ import annotations

import errno
import json
import os
import secrets
from typing import Any

from quiverfs.protocol.control import make_name


class ControlClient:
    """Requests over the control channel of the mount at ``root`` (blocking; any process).

    ``request(op, **args)`` returns the decoded JSON response and raises ``OSError`` with the
    errno (EINVAL, ENOENT, ESTALE, EBUSY, ENOTSUP, EIO, or ENODATA/ENOTSUP from a mount
    without a control channel).
    """

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = os.fspath(root)

    def request(self, op: str, **args: Any) -> Any:
        nonce = secrets.token_hex(8)
        value = os.getxattr(self.root, make_name(op, nonce, **args))
        response = json.loads(value)
        if isinstance(response, dict) and set(response) == {"paged"}:
            paged = response["paged"]
            parts = [
                os.getxattr(self.root, make_name("page", of=paged["nonce"], i=i))
                for i in range(paged["pages"])
            ]
            body = b"".join(parts)
            if len(body) != paged["bytes"]:
                raise OSError(errno.EIO, "paged control response arrived incomplete")
            response = json.loads(body)
        return response

    def paths(self) -> list[str]:
        """Every file's relative path, in compact-id order (paged ``paths`` requests)."""
        out: list[str] = []
        start: int | None = 0
        while start is not None:
            page = self.request("paths", start=start)
            out.extend(page["paths"])
            start = page["next"]
        return out


def find_mount_root(path: str | os.PathLike[str]) -> str | None:
    """The root of the quiverfs mount holding ``path`` (the nearest mount point above it that
    answers ``user.quiver.dataset``), or None when ``path`` is not on one."""
    current = os.path.abspath(os.fspath(path))
    while True:
        if os.path.ismount(current):
            try:
                os.getxattr(current, "user.quiver.dataset")
                return current
            except OSError:
                return None
        parent = os.path.dirname(current)
        if parent == current:
            return None
        current = parent
