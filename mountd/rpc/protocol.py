"""The mountd wire protocol: framing, messages, argument checks and error transport.

Pure code (no sockets, no trio), shared by :mod:`mountd.rpc.server` and the clients
(:mod:`mountd.rpc.calls`) and documented for other implementations in
``docs/mountd-protocol.md``.

**Framing.** Every message is one *frame*: a 4-byte big-endian unsigned length ``N`` followed
by ``N`` bytes of UTF-8 JSON encoding one object. ``N`` is at most :data:`MAX_FRAME`; a larger
length cannot be skipped safely, so the server answers with a ``ProtocolError`` and closes
that connection (only that one).

**Requests** are ``{"id": ID, "op": NAME, "args": {...}}``. ``ID`` is an integer or a string
chosen by the client; responses carry it back, so one connection carries many concurrent
requests and responses may arrive in any order. A request without ``id`` is a
*notification*: it is executed but never answered (used for ``hits`` and ``prefetch``).

**Responses** are ``{"id": ID, "ok": true, "result": ...}`` or ``{"id": ID, "ok": false,
"error": {"type": CLASS, "bases": [...], "message": TEXT, ...attributes}}``. A long request
(``scrub``) may first send any number of ``{"id": ID, "progress": {...}}`` frames.
A request that cannot even be parsed is answered with ``"id": null``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mountd.errors import WIRE_ERRORS, MountdInternalError, ProtocolError
from quiverfs.base.errors import BackendError, QuiverError

#: Protocol version; ``hello`` refuses a client whose major version differs.
PROTOCOL_VERSION = 1

#: Largest frame body accepted, in bytes (a prefetch of ~50k items fits comfortably).
MAX_FRAME = 16 * 1024 * 1024

#: Frame header: the body's length as a big-endian unsigned 32-bit integer.
HEADER = struct.Struct(">I")

#: Length of a content hash (blake3, 32 bytes = 64 hex digits).
HASH_BYTES = 32

#: Most items one ``prefetch`` or ``hits`` request may carry.
MAX_ITEMS = 100_000

#: Longest dataset id, mountpoint, URL or key accepted, in characters.
MAX_TEXT = 4096

#: Most descriptors one request may carry, and one ``recvmsg`` of mountd's may take.
MAX_FDS = 4

#: Most hashes one ``open`` request may name, so most descriptors one response carries (and
#: one ``recvmsg`` of a client's may take). The kernel allows 253 per message (SCM_MAX_FD);
#: 64 keeps the ancillary buffer small and bounds what a client holds open per request.
MAX_OPEN = 64

#: Longest an ``evictions`` request may wait for news (``wait_ms``), in milliseconds.
MAX_WAIT_MS = 60_000

@dataclass(frozen=True, slots=True)
class Operation:
    """One mountd operation and the properties every side reads from :data:`OPERATIONS`:
    the server's dispatch and admin check, the request parser, the clients' retries."""

    name: str
    #: Safe to send again when the connection dropped before its answer (the client retries
    #: it once on a new connection).
    idempotent: bool
    #: Only root or the uid that owns mountd may call it (checked with SO_PEERCRED).
    admin: bool = False
    #: May be sent as a notification (no ``id``, never answered): advisory traffic only.
    notification: bool = False
    #: Part of job sessions (substitutable, co-operative reads; docs/control-protocol.md).
    session: bool = False
    #: May carry file descriptors (``SCM_RIGHTS``; the request says how many in ``fds``):
    #: bytes or a digest a client opened with its own rights (mountd/store/supplied.py).
    fds: bool = False
    #: Its response may carry file descriptors (``SCM_RIGHTS``, attached to the response's
    #: first byte; the response says how many in its top-level ``fds``): store files mountd
    #: opened for a client that may not open them itself (descriptor hand-off).
    reply_fds: bool = False


#: Every operation the server knows, declared once (docs/mountd-protocol.md "Operations");
#: tests/unit/test_mountd_protocol.py checks the server has exactly one handler for each.
OPERATIONS: dict[str, Operation] = {
    op.name: op
    for op in (
        Operation("hello", idempotent=True),
        Operation("ensure", idempotent=True),
        Operation("supply", idempotent=False, fds=True),
        Operation("release", idempotent=True),
        Operation("prefetch", idempotent=True, notification=True),
        Operation("register", idempotent=True, fds=True),
        Operation("unregister", idempotent=True),
        Operation("hits", idempotent=False, notification=True),
        # Not retried: each descriptor handed over counts as a hit, as a ``hits`` report would.
        Operation("open", idempotent=False, reply_fds=True),
        Operation("evictions", idempotent=False),
        Operation("stats", idempotent=True),
        Operation("usage", idempotent=True),
        Operation("ls", idempotent=True),
        Operation("evict", idempotent=False, admin=True),
        Operation("scrub", idempotent=False, admin=True),
        Operation("shutdown", idempotent=False, admin=True),
        Operation("session_open", idempotent=True, session=True),
        Operation("claim", idempotent=False, session=True),
        Operation("next_epoch", idempotent=False, session=True),
        Operation("session_close", idempotent=False, session=True),
        Operation("report_batch", idempotent=False, session=True),
        Operation("report_epoch", idempotent=False, session=True),
        Operation("timings", idempotent=True, session=True),
        Operation("sessions", idempotent=True, session=True),
    )
}


# -- framing ----------------------------------------------------------------------------------


def encode_frame(message: Mapping[str, Any]) -> bytes:
    """One frame: the length header and the compact JSON of ``message``.

    Raises :class:`ProtocolError` when the message is not JSON-able or larger than
    :data:`MAX_FRAME`.
    """
    try:
        body = json.dumps(message, separators=(",", ":"), ensure_ascii=False).encode()
    except (TypeError, ValueError) as exc:  # not JSON-able (a bug in whoever built it)
        raise ProtocolError(f"message cannot be encoded as JSON: {exc}") from None
    if len(body) > MAX_FRAME:
        raise ProtocolError(f"message of {len(body)} bytes exceeds the {MAX_FRAME}-byte frame limit")
    return HEADER.pack(len(body)) + body


def frame_length(header: bytes) -> int:
    """The body length announced by a 4-byte header; :class:`ProtocolError` when too large."""
    (length,) = HEADER.unpack(header)
    if length > MAX_FRAME:
        raise ProtocolError(f"frame of {length} bytes exceeds the {MAX_FRAME}-byte limit")
    return length


def decode_body(body: bytes) -> dict[str, Any]:
    """The JSON object in a frame body; :class:`ProtocolError` for anything else."""
    try:
        message = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ProtocolError(f"frame is not UTF-8 JSON: {exc}") from None
    if not isinstance(message, dict):
        raise ProtocolError(f"frame must hold a JSON object, not {type(message).__name__}")
    return message


class FrameDecoder:
    """Incremental decoder: feed bytes as they arrive, take complete frame bodies out.

    Used by the blocking client; the async side reads exact lengths instead. Raises
    :class:`ProtocolError` from :meth:`feed` when a header announces an oversized frame.
    """

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        """Append ``data``; return the bodies of every frame now complete."""
        self._buffer += data
        bodies = []
        while len(self._buffer) >= HEADER.size:
            length = frame_length(bytes(self._buffer[: HEADER.size]))
            end = HEADER.size + length
            if len(self._buffer) < end:
                break
            bodies.append(bytes(self._buffer[HEADER.size : end]))
            del self._buffer[:end]
        return bodies

    @property
    def pending(self) -> int:
        """Bytes received but not yet part of a complete frame."""
        return len(self._buffer)


class ExactReader:
    """Exact-length reads over an async stream with ``receive_some`` (trio's streams).

    Frames may span several ``receive_some`` results or share one; this buffers the rest.
    """

    def __init__(self, stream: Any) -> None:
        self._stream = stream
        self._buffer = bytearray()

    async def read_exactly(self, n: int, *, eof_ok: bool) -> bytes | None:
        """``n`` bytes; None at a clean end of stream when ``eof_ok`` and nothing is buffered.

        Raises :class:`ProtocolError` when the stream ends inside a frame.
        """
        while len(self._buffer) < n:
            data = await self._stream.receive_some(max(65536, n - len(self._buffer)))
            if not data:
                if eof_ok and not self._buffer:
                    return None
                raise ProtocolError("connection closed in the middle of a frame")
            self._buffer += data
        out = bytes(self._buffer[:n])
        del self._buffer[:n]
        return out

    async def read_frame(self) -> dict[str, Any] | None:
        """The next message, or None at a clean end of stream."""
        header = await self.read_exactly(HEADER.size, eof_ok=True)
        if header is None:
            return None
        body = await self.read_exactly(frame_length(header), eof_ok=False)
        assert body is not None
        return decode_body(body)


# -- requests ---------------------------------------------------------------------------------


RequestId = int | str | None


@dataclass(frozen=True, slots=True)
class Request:
    """A parsed request. ``id`` is None for a notification (no response is sent)."""

    id: RequestId
    op: str
    args: dict[str, Any]
    #: Descriptors that came with the request (ops with ``fds``); the server closes them.
    fds: tuple[int, ...] = ()

    @property
    def wants_response(self) -> bool:
        return self.id is not None


def request_id_of(message: Mapping[str, Any]) -> RequestId:
    """The id to answer a (possibly malformed) message with: its id when valid, else None."""
    rid = message.get("id")
    if isinstance(rid, bool) or not isinstance(rid, int | str):
        return None
    if isinstance(rid, str) and len(rid) > 128:
        return None
    return rid


def parse_request(message: Mapping[str, Any]) -> Request:
    """Check the envelope of a request; arguments are checked per op by the ``check_*`` helpers."""
    rid = message.get("id")
    if rid is not None and request_id_of(message) is None:
        raise ProtocolError("request id must be an integer or a string of at most 128 characters")
    op = message.get("op")
    if not isinstance(op, str):
        raise ProtocolError("request needs an 'op' string")
    operation = OPERATIONS.get(op)
    if operation is None:
        raise ProtocolError(f"unknown op {op[:64]!r} (known: {', '.join(sorted(OPERATIONS))})")
    if rid is None and not operation.notification:
        raise ProtocolError(f"{op} needs an 'id': only advisory ops may be sent as notifications")
    args = message.get("args", {})
    if args is None:
        args = {}
    if not isinstance(args, dict):
        raise ProtocolError(f"'args' of {op} must be an object")
    unknown = set(message) - {"id", "op", "args"}
    if unknown:
        raise ProtocolError(f"unknown request fields: {', '.join(sorted(unknown))}")
    return Request(rid, op, args)


def fds_wanted(request: Request) -> int:
    """How many descriptors ``request`` says it carries (its ``fds`` argument; 0 if none)."""
    if "fds" not in request.args:
        return 0
    count = check_int(request.args, "fds")
    if count and not OPERATIONS[request.op].fds:
        raise ProtocolError(f"{request.op} carries no descriptors")
    if count > MAX_FDS:
        raise ProtocolError(f"at most {MAX_FDS} descriptors per request, not {count}")
    return count


def make_request(rid: RequestId, op: str, args: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """A request message (``rid=None`` makes a notification, for ops that allow it)."""
    message: dict[str, Any] = {"op": op, "args": dict(args or {})}
    if rid is not None:
        message["id"] = rid
    return message


# -- argument checks (the server calls these; each raises ProtocolError) ---------------------


def check_int(args: Mapping[str, Any], name: str, *, minimum: int = 0, default: int | None = None) -> int:
    """``args[name]`` as a non-negative integer (bools refused)."""
    value = args.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ProtocolError(f"{name!r} must be an integer")
    if value < minimum:
        raise ProtocolError(f"{name!r} must be at least {minimum}, not {value}")
    return value


def check_text(
    args: Mapping[str, Any], name: str, *, optional: bool = False, empty: bool = False
) -> str | None:
    """``args[name]`` as a string of at most :data:`MAX_TEXT` characters, without NUL."""
    value = args.get(name)
    if value is None and optional:
        return None
    if not isinstance(value, str):
        raise ProtocolError(f"{name!r} must be a string")
    if not value and not empty:
        raise ProtocolError(f"{name!r} must not be empty")
    if len(value) > MAX_TEXT or "\x00" in value:
        raise ProtocolError(f"{name!r} is too long or contains NUL")
    return value


def check_hash(value: Any, name: str = "hash") -> bytes:
    """A content hash given as 64 hex digits, returned as 32 bytes."""
    if not isinstance(value, str) or len(value) != 2 * HASH_BYTES:
        raise ProtocolError(f"{name!r} must be {2 * HASH_BYTES} hex digits")
    try:
        return bytes.fromhex(value)
    except ValueError:
        raise ProtocolError(f"{name!r} must be {2 * HASH_BYTES} hex digits") from None


def check_location(value: Any) -> dict[str, Any]:
    """A location object ``{url, key, offset, length}``; returned with the same fields."""
    if not isinstance(value, dict):
        raise ProtocolError("'location' must be an object {url, key, offset, length}")
    unknown = set(value) - {"url", "key", "offset", "length"}
    if unknown:
        raise ProtocolError(f"unknown location fields: {', '.join(sorted(unknown))}")
    return {
        "url": check_text(value, "url"),
        "key": check_text(value, "key", empty=True),
        "offset": check_int(value, "offset"),
        "length": check_int(value, "length"),
    }


def check_item(value: Any) -> tuple[bytes, int, dict[str, Any]]:
    """One ``{hash, size, location}`` item of ``ensure`` or ``prefetch``."""
    if not isinstance(value, dict):
        raise ProtocolError("each item must be an object {hash, size, location}")
    return check_hash(value.get("hash")), check_int(value, "size"), check_location(value.get("location"))


def check_packed_hashes(args: Mapping[str, Any], name: str) -> list[bytes]:
    """``args[name]``: content hashes written back to back as one string of hex digits
    (64 per hash; at most :data:`MAX_ITEMS`), returned as 32-byte hashes. One string
    costs a sender and mountd a fraction of a list of hex strings, which matters for hit
    reports: a DataLoader sends tens of thousands a second."""
    value = args.get(name)
    if not isinstance(value, str) or len(value) % (2 * HASH_BYTES):
        raise ProtocolError(f"{name!r} must be hex digits, {2 * HASH_BYTES} per hash")
    if len(value) > MAX_ITEMS * 2 * HASH_BYTES:
        raise ProtocolError(f"{name!r} has {len(value) // (2 * HASH_BYTES)} hashes; at most {MAX_ITEMS} per request")
    try:
        packed = bytes.fromhex(value)
    except ValueError:
        raise ProtocolError(f"{name!r} must be hex digits, {2 * HASH_BYTES} per hash") from None
    return [packed[i:i + HASH_BYTES] for i in range(0, len(packed), HASH_BYTES)]


def check_list(args: Mapping[str, Any], name: str) -> list[Any]:
    """``args[name]`` as a list of at most :data:`MAX_ITEMS` elements."""
    value = args.get(name)
    if not isinstance(value, list):
        raise ProtocolError(f"{name!r} must be a list")
    if len(value) > MAX_ITEMS:
        raise ProtocolError(f"{name!r} has {len(value)} items; at most {MAX_ITEMS} per request")
    return value


# -- responses and error transport ------------------------------------------------------------


def ok_response(rid: RequestId, result: Any, fds: int = 0) -> dict[str, Any]:
    """A successful response; ``fds``: how many descriptors are sent with it (ops with
    ``reply_fds``), said in a top-level ``fds`` field so that a client takes them from its
    queue of received descriptors whether or not anybody still waits for the answer."""
    response: dict[str, Any] = {"id": rid, "ok": True, "result": result}
    if fds:
        response["fds"] = fds
    return response


def response_fds(message: Mapping[str, Any]) -> int:
    """How many descriptors came with a response (its ``fds``; 0 if none), for a client.

    Raises :class:`ProtocolError` for a count that is not an integer from 0 to
    :data:`MAX_OPEN`: the client's descriptors can then no longer be matched to responses.
    """
    count = message.get("fds", 0)
    if isinstance(count, bool) or not isinstance(count, int) or not 0 <= count <= MAX_OPEN:
        raise ProtocolError(f"a response announces {count!r} descriptors")
    return count


def progress_message(rid: RequestId, progress: Any) -> dict[str, Any]:
    """An interim progress frame for a long request."""
    return {"id": rid, "progress": progress}


def json_value(value: Any) -> Any:
    """Dataclasses, tuples and paths as JSON-ready values."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: json_value(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(k): json_value(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [json_value(v) for v in value]
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    return value


def progress_value(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Whatever the cache's progress callback was given, as one JSON value."""
    if kwargs and not args:
        return json_value(kwargs)
    if len(args) == 1 and not kwargs:
        value = json_value(args[0])
        return value if isinstance(value, dict) else {"done": value}
    if len(args) == 2 and not kwargs and all(isinstance(a, int) for a in args):
        return {"done": args[0], "total": args[1]}
    return {"args": json_value(list(args)), **json_value(kwargs)}


def error_payload(exc: BaseException) -> dict[str, Any]:
    """How an exception travels: class name, its QuiverError ancestry, message, attributes.

    Exceptions outside our vocabulary are reported as ``MountdInternalError`` so a bug in the
    server never leaks arbitrary class names (or tracebacks) to clients.
    """
    if not isinstance(exc, QuiverError):
        exc = MountdInternalError(f"{type(exc).__name__}: {exc}")
    bases = [
        cls.__name__
        for cls in type(exc).__mro__[1:]
        if isinstance(cls, type) and issubclass(cls, QuiverError)
    ]
    payload: dict[str, Any] = {"type": type(exc).__name__, "bases": bases, "message": str(exc)}
    if isinstance(exc, BackendError):
        payload["url"] = exc.url
        payload["key"] = exc.key
    return payload


def error_response(rid: RequestId, exc: BaseException) -> dict[str, Any]:
    """A failed response carrying :func:`error_payload`."""
    return {"id": rid, "ok": False, "error": error_payload(exc)}


def exception_from_payload(payload: Any) -> QuiverError:
    """Rebuild the server's exception from :func:`error_payload` output.

    The class is the one of that name in :data:`mountd.errors.WIRE_ERRORS`, else the nearest
    registered class among ``bases`` (a newer mountd's class), else :class:`QuiverError`; the
    message is kept verbatim.
    """
    if not isinstance(payload, dict):
        return ProtocolError("malformed error in a mountd response")
    message = str(payload.get("message", "mountd reported an error"))
    names = [payload.get("type")] + list(payload.get("bases") or [])
    cls: type[QuiverError] = QuiverError
    for name in names:
        if isinstance(name, str) and name in WIRE_ERRORS:
            cls = WIRE_ERRORS[name]
            break
    # Bypass the subclass __init__ (BackendError formats its own message): keep the text the
    # server produced and restore the attributes that travelled with it.
    exc = cls.__new__(cls)
    Exception.__init__(exc, message)
    if issubclass(cls, BackendError):
        exc.url = str(payload.get("url", ""))
        exc.key = str(payload.get("key", ""))
    return exc
