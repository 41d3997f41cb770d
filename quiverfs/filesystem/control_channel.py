"""The mount side of the control channel (docs/control-protocol.md).

:class:`ControlChannel` is called by ``QuiverOperations.getxattr`` (quiverfs/filesystem/fs.py) for
names starting with :data:`~quiverfs.protocol.control.CONTROL_PREFIX` on the root inode. It parses
the name (:func:`quiverfs.protocol.control.parse_name`), forwards the request to mountd's session
layer over the mount's async client, and returns the response bytes or raises ``FsError(errno)``.
Everything runs in the mount's main process, in its trio thread.

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
import time
from array import array
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Protocol

import trio

from digests.digest import Digest
from quiverfs.base.errors import FsError, errno_for
from quiverfs.protocol.control import OPS, PAGE_BYTES, ControlRequestError, parse_name

#: Seconds a request's outcome is remembered (replayed for a repeated name).
REPLAY_SECONDS = 60.0

#: Outcomes remembered at most, and bytes of paged responses kept at most.
REPLAY_ENTRIES = 20_000
PAGED_BYTES = 64 << 20

#: Seconds the id → path table is kept after its last use (rebuilt on demand).
PATHS_IDLE_SECONDS = 600.0

#: Paths read from the digest between two checkpoints while building the table.
PATHS_SLICE = 5000

#: Control argument → mountd argument, where they differ.
_RENAME = {"world": "world_size", "s": "seconds"}


class SessionClient(Protocol):
    """What the channel needs of mountd: one async request (mountd.rpc.async_client.AsyncClient)."""

    async def call(self, op: str, args: dict[str, Any] | None = None) -> Any:
        """mountd's result for ``op``; raises the rebuilt server error."""
        ...


def _dumps(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()


class _Pending:
    """A request being executed; repeats of its name wait for it."""

    def __init__(self) -> None:
        self.done = trio.Event()
        self.outcome: bytes | int = errno.EIO


class ControlChannel:
    """The mount side of the control channel (see the module docstring).

    ``client``: the mount's async mountd client, or None (every session request is then
    ENOTSUP). ``dataset``: the mount's dataset id. ``digest``: the mount's
    :class:`~digests.digest.Digest` (the id → path table comes from its canonical order).
    """

    def __init__(self, client: SessionClient | None, dataset: str, digest: Digest,
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
        #: when the last request came (``clock``), None before the first
        self.last_request: float | None = None

    def used_within(self, seconds: float) -> bool:
        """Whether a request came in the last ``seconds``: a sampler (the shim) is reading
        this mount and tells mountd its order itself."""
        return self.last_request is not None and self.clock() - self.last_request <= seconds

    def names(self) -> list[bytes]:
        """Attribute names to list on the root: none (control names are not listed)."""
        return []

    async def getxattr(self, name: bytes) -> bytes:
        """The response to the request ``name``; :class:`~quiverfs.base.errors.FsError` on
        failure."""
        outcome = await self.handle(name)
        if isinstance(outcome, int):
            raise FsError(outcome)
        return outcome

    async def handle(self, name: bytes) -> bytes | int:
        """Response bytes or an errno (the core of :meth:`getxattr`)."""
        now = self.last_request = self.clock()
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
                outcome = errno_for(exc)
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
