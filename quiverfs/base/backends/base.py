"""The one interface every remote store is used through.

A :class:`Backend` is rooted at a URL (``s3://bucket/prefix``, ``az://account/container/prefix``,
``gs://bucket/prefix``, ``file:///path``); every key it takes or returns is relative to that root,
with ``/`` separators. The public API is async (trio). Subclasses implement a handful of
*blocking* methods (``_list_page``, ``_stat``, ``_read_range``, ``_write_object``, ``_close``)
that call their SDK;
this base class runs them in worker threads under a per-backend :class:`trio.CapacityLimiter`
sized to the SDK's connection pool, translates SDK exceptions with the subclass's one table
(:meth:`Backend._translate`), and retries :class:`TemporaryFailure` with exponential backoff and
full jitter until a deadline. SDK-level retries are switched off by each subclass so the two
layers never multiply.
"""

from __future__ import annotations

import random
import time
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field
from functools import partial
from typing import Any, ClassVar, TypeVar

import trio

from quiverfs.base.backends.settings import RemoteSettings
from quiverfs.base.errors import BackendError, PermanentFailure, TemporaryFailure

T = TypeVar("T")

#: Reads larger than this are split into ranged requests by :meth:`Backend.iter_chunks`.
DEFAULT_CHUNK = 8 * 1024 * 1024


#: :attr:`ObjectInfo.kind` of an object: bytes to read.
OBJECT = "object"
#: :attr:`ObjectInfo.kind` of a directory that exists whether or not objects lie below it: a
#: bucket's directory marker (a zero-byte key ending in ``/``; Azure's ``hdi_isfolder``
#: blob), a ``file://`` directory. ``key`` is its path without the trailing ``/``.
DIRECTORY = "directory"
#: :attr:`ObjectInfo.kind` of a ``file://`` symbolic link whose target lies outside the root:
#: listed, so a build can say what it leaves out, and readable like an object.
EXTERNAL_LINK = "external-link"


@dataclass(frozen=True, slots=True)
class ObjectInfo:
    """One object (or directory, see :attr:`kind`) as a listing or stat sees it.

    ``key`` is relative to the backend root; ``version`` is the store's change tag (S3/Azure
    ETag, GCS generation, file mtime in ns) or ``""`` when the store gives none.
    """

    key: str
    size: int
    version: str = ""
    #: :data:`OBJECT`, :data:`DIRECTORY` or :data:`EXTERNAL_LINK`.
    kind: str = OBJECT


def classify_marker(info: ObjectInfo) -> ObjectInfo:
    """``info``, or the :data:`DIRECTORY` it stands for when it is a directory marker.

    Every store's consoles and tools (S3, GCS, Azure) create "folders" as zero-byte keys
    ending in ``/``; they name a directory, never a file's bytes.
    """
    if info.kind == OBJECT and info.size == 0 and info.key.endswith("/"):
        return ObjectInfo(info.key[:-1], 0, info.version, DIRECTORY)
    return info


@dataclass(frozen=True, slots=True)
class Location:
    """Where content lives remotely: ``length`` bytes at ``offset`` of object ``key`` under the
    backend root ``url``. The one location type: a digest's files carry it
    (docs/digest-format.md), mountd fills from it, and it travels in mountd's protocol as
    ``{url, key, offset, length}`` (docs/mountd-protocol.md)."""

    #: Backend root URL (normalised, never credentials), e.g. ``"s3://bucket/imagenet"``.
    url: str
    #: Object key relative to ``url`` (``/`` separators).
    key: str
    #: Byte offset of the content inside the object (non-zero for members of packed shards).
    offset: int
    #: Bytes of content; equals the content size named in the digest.
    length: int


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """Exponential backoff with full jitter, bounded by a total deadline.

    Attempt *n* (0-based) waits ``uniform(0, min(max_delay, initial_delay * multiplier**n))``
    before retrying; no retry starts after ``deadline`` seconds from the first attempt.
    """

    deadline: float = 60.0
    initial_delay: float = 0.05
    max_delay: float = 5.0
    multiplier: float = 2.0

    def delay(self, attempt: int, rng: random.Random) -> float:
        """The sleep before retry number ``attempt`` (0-based)."""
        cap = min(self.max_delay, self.initial_delay * self.multiplier**attempt)
        return rng.uniform(0, cap)


@dataclass
class RemoteCounters:
    """What this backend asked of the remote: requests by kind, bytes received, retries.

    Kinds are ``GET`` (reads), ``HEAD`` (stat), ``LIST`` (one per listing page) and ``PUT``
    (whole-object writes, one per attempt). Counted in the trio thread after each attempt
    returns, so reads of these fields need no lock.
    """

    requests: Counter[str] = field(default_factory=Counter)
    bytes_read: int = 0
    #: Bytes of the writes that succeeded (a retried write counts once).
    bytes_written: int = 0
    retries: int = 0
    failures: Counter[str] = field(default_factory=Counter)

    @classmethod
    def total(cls, parts: Iterable[RemoteCounters]) -> RemoteCounters:
        """The sum of ``parts`` (one source's counters kept in several places: mountd's own
        backend, each fill process's)."""
        out = cls()
        for part in parts:
            out.requests.update(part.requests)
            out.bytes_read += part.bytes_read
            out.bytes_written += part.bytes_written
            out.retries += part.retries
            out.failures.update(part.failures)
        return out


@dataclass(frozen=True, slots=True)
class BackendOptions:
    """Tuning shared by all backends; credentials are never here (each SDK's chain has them)."""

    #: Concurrent SDK calls, and the size of the SDK connection pool.
    concurrency: int = 16
    #: Per-request socket timeout in seconds.
    timeout: float = 30.0
    retry: RetryPolicy = RetryPolicy()


class Backend(ABC):
    """A remote object store rooted at one URL. Use :func:`quiverfs.base.backends.open_backend`."""

    #: URL scheme served by the subclass (``"s3"``, ``"az"``, ``"gs"``, ``"file"``).
    scheme: ClassVar[str]

    def __init__(self, url: str, options: BackendOptions, settings: RemoteSettings) -> None:
        self.url = url
        self.options = options
        self.settings = settings
        self.limiter = trio.CapacityLimiter(options.concurrency)
        self.counters = RemoteCounters()
        self._rng = random.Random()

    # -- what subclasses implement (blocking; called in worker threads) -------------------

    @abstractmethod
    def _list_page(self, prefix: str, token: str | None) -> tuple[list[ObjectInfo], str | None]:
        """One page of objects whose relative key starts with ``prefix``, and the next token.

        Keys are relative to the root; pages come in ascending key order where the store
        gives one. ``None`` as the returned token means this was the last page.
        """

    @abstractmethod
    def _stat(self, key: str) -> ObjectInfo:
        """Size and version of one object; raises the SDK's not-found error when absent."""

    @abstractmethod
    def _read_range(self, key: str, offset: int, length: int) -> bytes:
        """``length`` bytes from ``offset`` (fewer only where the object ends), ``length > 0``."""

    def _write_object(self, key: str, data: bytes) -> None:
        """Store ``data`` as the whole object ``key``, replacing any object there.

        Readers see the old object or the new one, never a part (object stores put atomically;
        ``file://`` renames a complete temporary file). The bucket (container, root directory)
        must exist: a missing one is the SDK's not-found error, never created here. Every
        store of the registry implements it; the default is for read-only test doubles.
        """
        raise PermanentFailure(f"the {self.scheme} backend cannot write", url=self.url, key=key)

    def _close(self) -> None:  # noqa: B027 (optional hook, deliberately not abstract)
        """Release SDK clients and pools. Default: nothing to release."""

    @abstractmethod
    def _translate(self, exc: BaseException, key: str) -> BackendError | None:
        """Map an SDK exception to our vocabulary with the backend's one table.

        Return ``None`` for exceptions the table does not know; :meth:`_classify` then falls
        back to the generic network rules and finally to :class:`PermanentFailure`.
        """

    # -- the async API ---------------------------------------------------------------------

    async def list(self, prefix: str = "") -> AsyncIterator[ObjectInfo]:
        """Every object whose relative key starts with ``prefix``, page by page.

        Each page is one ``LIST`` request, retried on its own, so a long listing survives a
        transient fault in the middle without starting over. Directory markers come out as
        :data:`DIRECTORY` entries (:func:`classify_marker`), whichever backend lists them.
        """
        token: str | None = None
        while True:
            page, token = await self._call(
                "LIST", prefix, self._list_page, prefix, token, count_bytes=False
            )
            for info in page:
                yield classify_marker(info)
            if token is None:
                return

    async def stat(self, key: str) -> ObjectInfo:
        """Size and version of one object (``NotFound`` when absent)."""
        return await self._call("HEAD", key, self._stat, key, count_bytes=False)

    async def read_range(self, key: str, offset: int, length: int) -> bytes:
        """Up to ``length`` bytes at ``offset``, like ``pread``: short only at the object's end.

        ``offset`` at or past the end gives ``b""``; ``length == 0`` sends no request.
        """
        if offset < 0 or length < 0:
            raise ValueError(f"negative offset or length: {offset}, {length}")
        if length == 0:
            return b""
        return await self._call("GET", key, self._read_range, key, offset, length)

    async def read_range_then(
        self, key: str, offset: int, length: int, then: Callable[[bytes], T]
    ) -> T:
        """:meth:`read_range`, then ``then(bytes)`` in the same worker thread; its result.

        For a caller whose next step blocks too (mountd verifies and stores what it read):
        one thread hop per object instead of two. ``then`` runs once, after a successful
        read; what it raises is not translated or retried, and the call is never abandoned
        on cancellation (``then`` may write), unlike a plain read.
        """
        if offset < 0 or length < 0:
            raise ValueError(f"negative offset or length: {offset}, {length}")
        return await self._call("GET", key, self._read_range, key, offset, length, then=then)

    async def read(self, key: str) -> bytes:
        """The whole object. Costs a ``HEAD`` then one ``GET`` per :data:`DEFAULT_CHUNK`."""
        parts = [part async for part in self.iter_chunks(key)]
        return b"".join(parts)

    async def iter_chunks(
        self, key: str, size: int | None = None, chunk: int = DEFAULT_CHUNK
    ) -> AsyncIterator[bytes]:
        """The object's bytes in order, one ranged ``GET`` per ``chunk``.

        Pass ``size`` when a listing already gave it, to save the ``HEAD``. Stops early if the
        object turns out shorter than ``size`` (the caller's size check catches that).
        """
        if size is None:
            size = (await self.stat(key)).size
        offset = 0
        while offset < size:
            data = await self.read_range(key, offset, min(chunk, size - offset))
            if not data:
                return
            yield data
            offset += len(data)

    async def write_object(self, key: str, data: bytes) -> None:
        """Store ``data`` as the whole object ``key`` (one ``PUT``), replacing what is there.

        Retried on :class:`TemporaryFailure` like a read: a whole-object put is idempotent,
        so a retry after an answer that got lost writes the same bytes again. The bucket must
        exist (:class:`NotFound` otherwise). Cancellation: never abandoned; a put in flight
        finishes (or fails) in its thread before the cancellation goes on.
        """
        if not key or key.endswith("/"):
            raise ValueError(f"not an object key: {key!r}")
        await self._call("PUT", key, self._write_object, key, data, count_bytes=False, writes=True)
        self.counters.bytes_written += len(data)

    async def aclose(self) -> None:
        """Release the SDK's clients and connection pools."""
        await trio.to_thread.run_sync(self._close)

    async def __aenter__(self) -> Backend:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def read_path(self) -> str | None:
        """How reads reach the store, for a backend that has more than one way (``quiverfs
        stats`` shows it); None: one way only."""
        return None

    def is_temp_failure(self, exc: BaseException) -> bool:
        """True when ``exc`` (ours or the SDK's) is worth retrying."""
        return isinstance(self._classify(exc, ""), TemporaryFailure)

    # -- retry and translation ---------------------------------------------------------------

    def _classify(self, exc: BaseException, key: str) -> BackendError:
        if isinstance(exc, BackendError):
            return exc
        mapped = self._translate(exc, key)
        if mapped is not None:
            return mapped
        if isinstance(exc, ConnectionError | TimeoutError):
            return TemporaryFailure(f"network error ({type(exc).__name__})", url=self.url, key=key)
        return PermanentFailure(
            f"unexpected {type(exc).__name__} from {self.scheme} backend", url=self.url, key=key
        )

    async def _call(
        self, kind: str, key: str, fn: Callable[..., Any], *args: object, count_bytes: bool = True,
        then: Callable[[Any], T] | None = None, writes: bool = False,
    ) -> T:
        """Run blocking ``fn(*args)`` in a thread, counting, translating and retrying it;
        with ``then``, run ``then(result)`` after it in the same thread (see
        :meth:`read_range_then`).

        Cancellation: plain reads are abandoned by a cancelled caller
        (``abandon_on_cancel=True``); the SDK call finishes in the background and is dropped.
        Calls that write (``writes``, or a ``then`` step) are waited for.
        """
        start = trio.current_time()
        attempt = 0
        work = fn if then is None else partial(_then, fn, then)
        while True:
            self.counters.requests[kind] += 1
            try:
                result = await trio.to_thread.run_sync(
                    work, *args, limiter=self.limiter,
                    abandon_on_cancel=then is None and not writes,
                )
            except _ThenFailed as failed:
                raise failed.error from None
            except Exception as exc:
                delay = self._retry_delay(exc, key, attempt, trio.current_time() - start)
                attempt += 1
                await trio.sleep(delay)
                continue
            if then is not None:
                nbytes, result = result
                self.counters.bytes_read += nbytes
            elif count_bytes and isinstance(result, bytes | bytearray):
                self.counters.bytes_read += len(result)
            return result

    def call_blocking(self, kind: str, key: str, fn: Callable[..., T], *args: object,
                      count_bytes: bool = True) -> T:
        """:meth:`_call` for a caller that is a thread already (a fill process's worker,
        mountd/store/fillpool.py): ``fn(*args)`` here, counted, translated and retried with the
        same policy, sleeping between attempts. Not under :attr:`limiter` (the caller bounds
        its own threads). The counters are this backend's, updated from several threads:
        ``Counter`` updates and integer adds are atomic under the interpreter lock."""
        start = time.monotonic()
        attempt = 0
        while True:
            self.counters.requests[kind] += 1
            try:
                result = fn(*args)
            except Exception as exc:
                delay = self._retry_delay(exc, key, attempt, time.monotonic() - start)
                attempt += 1
                time.sleep(delay)
                continue
            if count_bytes and isinstance(result, bytes | bytearray | memoryview):
                self.counters.bytes_read += len(result)
            return result

    def _retry_delay(self, exc: Exception, key: str, attempt: int, elapsed: float) -> float:
        """One failed attempt (number ``attempt``, ``elapsed`` seconds after the first began):
        counted, translated, and either the seconds to wait before the next (a
        :class:`TemporaryFailure` with time left before the deadline) or raised, translated."""
        error = self._classify(exc, key)
        self.counters.failures[type(error).__name__] += 1
        delay = self.options.retry.delay(attempt, self._rng)
        if not isinstance(error, TemporaryFailure) or elapsed + delay > self.options.retry.deadline:
            if error is exc:
                raise error
            raise error from exc
        self.counters.retries += 1
        return delay


class _ThenFailed(Exception):
    """Carries what a ``then`` step raised past the backend's translation and retries."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(error)
        self.error = error


def _then(fn: Callable[..., Any], then: Callable[[Any], T], *args: object) -> tuple[int, T]:
    """``fn(*args)`` (a backend call: its errors are the backend's), then ``then`` on its result
    (the caller's: its errors are wrapped so they pass through untouched)."""
    result = fn(*args)
    try:
        return len(result), then(result)
    except Exception as exc:
        raise _ThenFailed(exc) from exc


def join_key(prefix: str, key: str) -> str:
    """``prefix`` and ``key`` joined with exactly one ``/`` (either may be empty)."""
    if not prefix:
        return key
    if not key:
        return prefix
    return prefix.rstrip("/") + "/" + key


def split_root(rest: str) -> tuple[str, str]:
    """``"bucket/some/prefix"`` → ``("bucket", "some/prefix")``; the prefix may be empty."""
    head, _, tail = rest.partition("/")
    return head, tail.strip("/")

