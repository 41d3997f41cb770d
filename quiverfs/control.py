"""The control channel: job sessions and claims as extended attributes of the mount root.

A training process (the PyTorch sampler in :mod:`quiverfs.torch`, or any program) talks to
mountd's session layer through the mount it reads from, with one ``getxattr`` per request::

    getxattr(MOUNT, "user.quiver.ctl.<nonce>.<op>?k=v&k=v")  ->  JSON response

The *name* carries the whole request, so a request is one system call: atomic, stateless for
the caller, and safe from DataLoader worker processes and the main process alike (no file
handle, no pid; sessions are keyed by job id and rank). Grammar, ops, paging and errors are
specified in docs/control-protocol.md; this module holds both ends:

* :class:`ControlChannel` — the mount side, called by ``QuiverOperations.getxattr`` for names
  starting with :data:`CONTROL_PREFIX` on the root inode (:func:`control_for` makes one per
  mount). It parses the name, forwards the request to mountd over the mount's async client,
  and returns the response bytes or raises ``FsError(errno)``.
* :class:`ControlClient` — the caller side (no pyfuse3, no trio): builds names with a fresh
  nonce, follows paged responses, and raises ``OSError(errno)``.

**Exactly once.** ``os.getxattr`` may issue ``getxattr(2)`` twice for one call (a 128-byte
buffer first, then ``XATTR_SIZE_MAX`` after ``ERANGE``) and the kernel forwards each to the
mount. The channel therefore remembers each request's outcome (response or errno) by its
full name for :data:`REPLAY_SECONDS`: a repeated name is answered from memory, never executed
again; a repeat that arrives while the first is still running waits for it. Callers use a
fresh random nonce per request.
"""

from __future__ import annotations

import errno
import json
import math
import os
import re
import secrets
import time
import weakref
from array import array
from collections import OrderedDict
from collections.abc import Callable
from typing import Any
from urllib.parse import quote, unquote

#: Every control attribute name starts with this (on the mount root only).
CONTROL_PREFIX = b"user.quiver.ctl."

#: Longest attribute name (XATTR_NAME_MAX).
NAME_MAX = 255

#: Largest response sent in one value; longer ones are paged. XATTR_SIZE_MAX is 65536; a
#: margin keeps the page clear of it whatever the kernel adds.
PAGE_BYTES = 65536 - 1024

#: Seconds a request's outcome is remembered (replayed for a repeated name).
REPLAY_SECONDS = 60.0

#: Outcomes remembered at most, and bytes of paged responses kept at most.
REPLAY_ENTRIES = 20_000
PAGED_BYTES = 64 << 20

#: Seconds the id → path table is kept after its last use (rebuilt on demand).
PATHS_IDLE_SECONDS = 600.0

#: Paths read from the digest between two checkpoints while building the table.
PATHS_SLICE = 5000

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
    "claim": ("claim", {"job": (_S, True), "rank": (_I, True), "n": (_I, True), "epoch": (_I, False)}),
    "next": ("next_epoch", {"job": (_S, True), "rank": (_I, True), "epoch": (_I, False)}),
    "close": ("session_close", {"job": (_S, True), "rank": (_I, True), "s": (_F, False)}),
    "batch": ("report_batch", {"job": (_S, True), "rank": (_I, True), "s": (_F, True)}),
    "epoch": ("report_epoch", {"job": (_S, True), "rank": (_I, True), "epoch": (_I, True),
                               "s": (_F, True)}),
    "timings": ("timings", {"job": (_S, True)}),
}

#: Control argument → mountd argument, where they differ.
_RENAME = {"world": "world_size", "s": "seconds"}


class ControlRequestError(ValueError):
    """A control name that does not parse; ``errno`` is what the caller gets."""

    def __init__(self, message: str, code: int = errno.EINVAL) -> None:
        super().__init__(message)
        self.errno = code


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


def _dumps(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()


def errno_of(exc: BaseException) -> int:
    """The errno a failed request reports: the session errors' own ``errno`` (EINVAL,
    ENOENT, EBUSY, ESTALE), EINVAL for a refused argument, EIO for anything else (mountd
    away, a bug)."""
    from mountd.protocol import ProtocolError
    from mountd.requests import SessionError

    if isinstance(exc, ControlRequestError | SessionError):
        return exc.errno
    if isinstance(exc, ProtocolError):
        return errno.EINVAL
    return errno.EIO


class _Pending:
    """A request being executed; repeats of its name wait for it."""

    def __init__(self) -> None:
        import trio

        self.done = trio.Event()
        self.outcome: bytes | int = errno.EIO


class ControlChannel:
    """The mount side of the control channel (see the module docstring).

    ``client``: the mount's async mountd client (anything with ``async call(op, args)``), or
    None (every session request is then ENOTSUP). ``dataset``: the mount's dataset id.
    ``digest``: the mount's :class:`~digests.digest.Digest` (the id → path table comes from
    its canonical order). Runs in the FUSE process's trio thread.
    """

    def __init__(self, client: Any, dataset: str, digest: Any,
                 *, clock: Callable[[], float] = time.monotonic) -> None:
        self.client = client
        self.dataset = dataset
        self.digest = digest
        self.clock = clock
        #: name → (time, response bytes or errno)
        self._done: OrderedDict[bytes, tuple[float, bytes | int]] = OrderedDict()
        self._running: dict[bytes, _Pending] = {}
        #: nonce → (time, full response) of paged responses
        self._paged: OrderedDict[bytes, tuple[float, bytes]] = OrderedDict()
        self._paged_bytes = 0
        self._paths: tuple[bytes, array] | None = None
        self._paths_used = 0.0
        self._paths_building: Any = None
        #: requests executed (not replayed), for tests and stats
        self.executed = 0

    def names(self) -> list[bytes]:
        """Attribute names to list on the root: none (control names are not listed)."""
        return []

    async def getxattr(self, name: bytes) -> bytes:
        """The response to the request ``name``; :class:`~quiverfs.tree.FsError` on failure."""
        from quiverfs.tree import FsError

        outcome = await self.handle(name)
        if isinstance(outcome, int):
            raise FsError(outcome)
        return outcome

    async def handle(self, name: bytes) -> bytes | int:
        """Response bytes or an errno (the core of :meth:`getxattr`)."""
        now = self.clock()
        self._expire(now)
        done = self._done.get(name)
        if done is not None:
            return done[1]
        pending = self._running.get(name)
        if pending is not None:
            await pending.done.wait()
            return pending.outcome
        pending = self._running[name] = _Pending()
        try:
            try:
                nonce, op, args = parse_name(name)
                self.executed += 1
                outcome: bytes | int = await self._execute(nonce, op, args)
            except Exception as exc:
                outcome = errno_of(exc)
            pending.outcome = outcome
        finally:
            del self._running[name]
            pending.done.set()
        self._done[name] = (self.clock(), outcome)
        while len(self._done) > REPLAY_ENTRIES:
            self._done.popitem(last=False)
        return outcome

    def _expire(self, now: float) -> None:
        while self._done and now - next(iter(self._done.values()))[0] > REPLAY_SECONDS:
            self._done.popitem(last=False)
        while self._paged and now - next(iter(self._paged.values()))[0] > REPLAY_SECONDS:
            _, (_, data) = self._paged.popitem(last=False)
            self._paged_bytes -= len(data)
        if self._paths is not None and now - self._paths_used > PATHS_IDLE_SECONDS:
            self._paths = None

    async def _execute(self, nonce: bytes, op: str, args: dict[str, Any]) -> bytes:
        if op == "page":
            return self._page(args["of"].encode(), args["i"])
        if op == "info":
            body = _dumps({"dataset": self.dataset, "files": self.digest.file_count,
                           "page_bytes": PAGE_BYTES, "version": 1})
        elif op == "paths":
            body = await self._paths_page(args["start"])
        else:
            if self.client is None:
                raise ControlRequestError("this mount has no mountd session layer", errno.ENOTSUP)
            rpc = OPS[op][0]
            assert rpc is not None
            call = {_RENAME.get(k, k): v for k, v in args.items()}
            call["dataset"] = self.dataset
            result = await self.client.call(rpc, call)
            body = _dumps(result)
        if len(body) <= PAGE_BYTES:
            return body
        return self._stash(nonce, body)

    # -- paging -----------------------------------------------------------------------------

    def _stash(self, nonce: bytes, body: bytes) -> bytes:
        self._paged[nonce] = (self.clock(), body)
        self._paged_bytes += len(body)
        while self._paged_bytes > PAGED_BYTES and len(self._paged) > 1:
            _, (_, old) = self._paged.popitem(last=False)
            self._paged_bytes -= len(old)
        pages = -(-len(body) // PAGE_BYTES)
        return _dumps({"paged": {"nonce": nonce.decode(), "pages": pages, "bytes": len(body)}})

    def _page(self, of: bytes, i: int) -> bytes:
        stashed = self._paged.get(of)
        if stashed is None:
            raise ControlRequestError("no paged response under that nonce (expired?)", errno.ENOENT)
        body = stashed[1]
        if i * PAGE_BYTES >= len(body):
            raise ControlRequestError("page index out of range")
        return body[i * PAGE_BYTES : (i + 1) * PAGE_BYTES]

    # -- the id → path table ----------------------------------------------------------------

    async def _paths_page(self, start: int) -> bytes:
        blob, offsets = await self._path_table()
        count = len(offsets) - 1
        if start > count:
            raise ControlRequestError(f"start must be at most {count}")
        # Guess the page from the paths' byte lengths (+3: quotes and comma), then shrink
        # until the JSON fits: only escapes ('"', '\\', control characters) make it longer.
        budget = PAGE_BYTES - 128
        stop = start
        used = 0
        while stop < count and used + offsets[stop + 1] - offsets[stop] + 3 <= budget:
            used += offsets[stop + 1] - offsets[stop] + 3
            stop += 1
        while True:
            raw = blob[offsets[start] : offsets[stop]]
            paths = raw.decode("utf-8", "surrogateescape").split("\0") if stop > start else []
            if paths and paths[-1] == "":
                paths.pop()
            body = json.dumps(
                {"start": start, "next": stop if stop < count else None, "files": count,
                 "paths": paths},
                separators=(",", ":"), ensure_ascii=False,
            ).encode("utf-8", "surrogateescape")
            if len(body) <= PAGE_BYTES or stop - start <= 1:
                return body
            stop = start + (stop - start) // 2

    async def _path_table(self) -> tuple[bytes, array]:
        """Relative paths in compact-id order, packed (built on demand, dropped when idle)."""
        import trio

        self._paths_used = self.clock()
        if self._paths is not None:
            return self._paths
        if self._paths_building is not None:
            await self._paths_building.wait()
            if self._paths is not None:
                return self._paths
        self._paths_building = trio.Event()
        try:
            blob = bytearray()
            offsets = array("q", [0])
            for n, (path, _size, _hash) in enumerate(self.digest.iter_canonical(), 1):
                blob += path.encode("utf-8", "surrogateescape")
                blob += b"\0"  # NUL never occurs in a path: the separator
                offsets.append(len(blob))
                if n % PATHS_SLICE == 0:
                    await trio.lowlevel.checkpoint()  # keep serving the mount meanwhile
            self._paths = (bytes(blob), offsets)
            return self._paths
        finally:
            self._paths_building.set()
            self._paths_building = None


_channels: weakref.WeakKeyDictionary[Any, ControlChannel] = weakref.WeakKeyDictionary()


def control_for(ops: Any) -> ControlChannel:
    """The :class:`ControlChannel` of a ``QuiverOperations`` (made on first use): its
    fetcher's mountd client, dataset id and digest."""
    channel = _channels.get(ops)
    if channel is None:
        client = getattr(getattr(ops, "fetcher", None), "client", None)
        channel = _channels[ops] = ControlChannel(client, ops.dataset_id, ops.digest)
    return channel


# -- the caller side --------------------------------------------------------------------------


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
