"""The control channel: job sessions and claims as extended attributes of the mount root.

A training process (the PyTorch sampler in :mod:`quiverfs.torch`, or any program) talks to
mountd's session layer through the mount it reads from, with one ``getxattr`` per request::

    getxattr(MOUNT, "user.quiver.ctl.<nonce>.<op>?k=v&k=v")  ->  JSON response

The *name* carries the whole request, so a request is one system call: atomic, stateless for
the caller, and safe from DataLoader worker processes and the main process alike (no file
handle, no pid; sessions are keyed by job id and rank). Grammar, ops, paging and errors are
specified in docs/control-protocol.md. This module holds what both ends share, the grammar:
:func:`parse_name`, :func:`make_name`, :data:`OPS`.

The caller side, :class:`quiverfs.client.control_client.ControlClient`, builds names with a fresh
nonce and follows paged responses; the mount side,
:class:`quiverfs.filesystem.control_channel.ControlChannel`, parses each name, forwards the request
to mountd and answers it exactly once.
"""

from __future__ import annotations

import errno
import math
import re
import secrets
from typing import Any
from urllib.parse import quote, unquote

from quiverfs.base.errors import FsError

#: Every control attribute name starts with this (on the mount root only).
CONTROL_PREFIX = b"user.quiver.ctl."

#: Longest attribute name (XATTR_NAME_MAX).
NAME_MAX = 255

#: Largest response sent in one value; longer ones are paged. XATTR_SIZE_MAX is 65536; a
#: margin keeps the page clear of it whatever the kernel adds.
PAGE_BYTES = 65536 - 1024

_NONCE = re.compile(rb"[A-Za-z0-9_-]{1,64}")
_KEY = re.compile(r"[a-z_]{1,16}")
_INT = re.compile(r"[0-9]{1,20}")
_FLOAT = re.compile(r"[0-9]{1,15}(\.[0-9]{1,15})?([eE][-+]?[0-9]{1,3})?")
_ENCODED = re.compile(r"(?:[A-Za-z0-9._~-]|%[0-9A-Fa-f]{2})+")
MAX_JOB = 128

_I, _F, _S, _R = "int", "float", "str", "ranges"
_RANGES = re.compile(r"[0-9]{1,12}-[0-9]{1,12}(?:,[0-9]{1,12}-[0-9]{1,12}){0,63}")

#: op → (mountd op or None for local, {arg: (type, required)})
OPS: dict[str, tuple[str | None, dict[str, tuple[str, bool]]]] = {
    "info": (None, {}),
    "paths": (None, {"start": (_I, True)}),
    "page": (None, {"of": (_S, True), "i": (_I, True)}),
    "open": ("session_open", {"job": (_S, True), "rank": (_I, False), "world": (_I, False),
                              "epoch": (_I, False), "seed": (_I, False), "lookahead": (_I, False),
                              "scope": (_R, False)}),
    "claim": ("claim", {"job": (_S, True), "rank": (_I, True), "n": (_I, True), "epoch": (_I, False),
                        "batch": (_I, False)}),
    "next": ("next_epoch", {"job": (_S, True), "rank": (_I, True), "epoch": (_I, False)}),
    "close": ("session_close", {"job": (_S, True), "rank": (_I, True), "s": (_F, False)}),
    "batch": ("report_batch", {"job": (_S, True), "rank": (_I, True), "s": (_F, True),
                               "files": (_I, False), "misses": (_I, False)}),
    "epoch": ("report_epoch", {"job": (_S, True), "rank": (_I, True), "epoch": (_I, True),
                               "s": (_F, True)}),
    "timings": ("timings", {"job": (_S, True)}),
}


class ControlRequestError(FsError):
    """A control request refused before it reaches mountd; ``errno`` is what the caller gets
    (EINVAL for a name that does not parse)."""

    def __init__(self, message: str, code: int = errno.EINVAL) -> None:
        super().__init__(code, message)

    def __str__(self) -> str:
        return str(self.args[1])


def parse_name(name: bytes) -> tuple[bytes, str, dict[str, Any]]:
    """``(nonce, op, args)`` of a control attribute name; :class:`ControlRequestError` (EINVAL)
    for anything malformed: not ASCII, too long, bad nonce, unknown op, unknown, repeated,
    missing or ill-typed argument."""
    if not isinstance(name, bytes) or not name.startswith(CONTROL_PREFIX):
        raise ControlRequestError("not a control name")
    if len(name) > NAME_MAX:
        raise ControlRequestError(f"control name longer than {NAME_MAX} bytes")
    rest = name[len(CONTROL_PREFIX):]
    head, _, query = rest.partition(b"?")
    nonce, dot, op_raw = head.rpartition(b".")
    if not dot or not _NONCE.fullmatch(nonce):
        raise ControlRequestError("control name needs <nonce>.<op> (nonce: 1-64 of A-Za-z0-9_-)")
    try:
        op = op_raw.decode("ascii")
        text = query.decode("ascii")
    except UnicodeDecodeError:
        raise ControlRequestError("control names are ASCII (percent-encode values)") from None
    if op not in OPS:
        raise ControlRequestError(f"unknown control op {op[:32]!r}")
    spec = OPS[op][1]
    args: dict[str, Any] = {}
    for part in text.split("&") if text else []:
        key, eq, raw = part.partition("=")
        if not eq or not _KEY.fullmatch(key):
            raise ControlRequestError(f"malformed argument {part[:32]!r}")
        if key not in spec:
            raise ControlRequestError(f"unknown argument {key!r} of {op}")
        if key in args:
            raise ControlRequestError(f"argument {key!r} given twice")
        args[key] = _value(key, spec[key][0], raw)
    missing = [k for k, (_, required) in spec.items() if required and k not in args]
    if missing:
        raise ControlRequestError(f"{op} needs {', '.join(missing)}")
    return nonce, op, args


def _value(key: str, kind: str, raw: str) -> Any:
    if kind == _I:
        if not _INT.fullmatch(raw):
            raise ControlRequestError(f"{key} must be a decimal integer >= 0")
        return int(raw)
    if kind == _R:
        text = unquote(raw)
        if not _RANGES.fullmatch(text):
            raise ControlRequestError(f"{key} must be id ranges START-STOP[,START-STOP...]")
        return [[int(a), int(b)] for a, b in (r.split("-") for r in text.split(","))]
    if kind == _F:
        if not _FLOAT.fullmatch(raw) or not math.isfinite(float(raw)):
            raise ControlRequestError(f"{key} must be a finite decimal number >= 0")
        return float(raw)
    if not _ENCODED.fullmatch(raw):
        raise ControlRequestError(f"{key} must be percent-encoded (RFC 3986 unreserved + %XX)")
    try:
        value = unquote(raw, errors="strict")
    except UnicodeDecodeError:
        raise ControlRequestError(f"{key} is not UTF-8 once decoded") from None
    if not value or len(value) > MAX_JOB or not value.isprintable():
        raise ControlRequestError(f"{key} must be 1..{MAX_JOB} printable characters")
    return value


def make_name(op: str, nonce: str | None = None, **args: Any) -> str:
    """The attribute name of a request (``None`` arguments are left out)."""
    nonce = nonce or secrets.token_hex(8)
    parts = [f"{k}={quote(str(v), safe='')}" for k, v in args.items() if v is not None]
    name = f"{CONTROL_PREFIX.decode()}{nonce}.{op}" + ("?" + "&".join(parts) if parts else "")
    if len(name.encode()) > NAME_MAX:
        raise ValueError(f"control request too long for an attribute name: {name[:80]}...")
    return name
