"""Ranged reads through obstore (Python bindings of Rust's ``object_store``): the read path of
:class:`~quiverfs.base.backends.s3.S3Backend` and
:class:`~quiverfs.base.backends.azure.AzureBackend`.

Why: a cold pass is CPU-bound in mountd, and most of a fill's CPU is the client library's
work per GET. For one 110 KiB ranged GET the backends spend 0.50-0.60 ms of the reading
process's CPU through obstore against moto, where boto3's ``get_object`` spends 1.3-1.6 ms, and
0.25-0.29 ms against Azurite, where azure-storage-blob spends 2.1-2.7 ms; and obstore releases
the GIL for the whole request (docs/backends.md "Reads through obstore",
scripts/bench/remote_clients.py). Listing, ``stat`` and writes stay on each SDK, and GCS on
google-cloud-storage (quiverfs/base/backends/gcs.py says why).

What this module holds, the same for both backends:

* :func:`exact_key`: whether obstore sends a key exactly as it is (it refuses or rewrites some);
  a key it would not is read through the SDK instead, for that read only.
* :class:`ObstoreReads`: one backend's store, built on its first read (obstore's settings come
  from the backend's SDK client, so both reach the same endpoint with the same credentials),
  and the rules for handing a read to the SDK: a key :func:`exact_key` refuses, a store that
  could not be built, a forked process (below), or an answer obstore does not understand that
  the SDK then reads (every read goes to the SDK from then on, logged once).
* :func:`failure_of`: what an obstore exception says (HTTP status and store error code of the
  answer, or the transport failure when no answer came), which each backend looks up in its
  one error table.

obstore's own retries are off (:data:`NO_RETRIES`): the base class retries, and two layers
would multiply.

Forks: obstore runs its requests on a tokio runtime that starts with the first request of a
process and is not fork-safe: in a child forked after that, every obstore call blocks forever
(a new store too). :meth:`ObstoreReads.store_for` notices a process whose runtime was started
by its parent and sends that process's reads through the SDK, with a warning. mountd's fill
processes open their own backends after the fork, so they read through obstore as long as the
process that forks them has never read through it.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import obstore
import obstore.exceptions as obe

log = logging.getLogger("quiverfs.backends.obstore")

#: obstore's ``retry_config``: no retries of its own (the base class retries).
NO_RETRIES: dict[str, Any] = {"max_retries": 0}

#: obstore's bound on a whole request (its default is 30 s), which boto3 and azure-core do not
#: have: a large range on a slow link must not be cut off while bytes still flow. A stalled
#: connection is caught by the read timeout (``BackendOptions.timeout``), as with the SDKs.
WHOLE_REQUEST_TIMEOUT = timedelta(minutes=10)

#: The process whose obstore runtime has served a request (``None``: none has yet). A child
#: forked from it inherits the value and so knows that obstore cannot run there.
_runtime_pid: int | None = None


class ObstoreUnavailable(Exception):
    """Raised by a store builder: obstore cannot be set up for this backend (the message says
    why, without secrets); its reads go through the SDK."""


class NoAnswer(Exception):
    """Stands, in the backends' error tables, for an obstore error where no complete HTTP
    answer came: a connection refused or reset, a timeout, a body cut short. Never raised."""


def client_options(timeout: float, endpoint: str) -> dict[str, Any]:
    """obstore's HTTP client options for a backend whose SDK uses ``timeout`` (seconds) as its
    connect and read timeout, talking to ``endpoint`` (plain HTTP allowed only for an
    ``http://`` endpoint, as for an emulator)."""
    return {
        "connect_timeout": timedelta(seconds=timeout),
        "read_timeout": timedelta(seconds=timeout),
        "timeout": WHOLE_REQUEST_TIMEOUT,
        "allow_http": endpoint.startswith("http://"),
    }


def exact_key(key: str) -> bool:
    """True when obstore sends ``key`` exactly as it is.

    obstore refuses (``ValueError``) a key with an empty segment (``a//b``), a ``.`` or ``..``
    segment (``dir/./x``) or an ASCII control character, and strips a leading or trailing
    ``/`` (so ``/x`` would read ``x``). Everything else (spaces, ``%``, ``+``, ``#``, ``?``,
    ``\\``, any Unicode) it percent-encodes as the stores expect.
    """
    if not key:
        return False
    if any(ch < " " or ch == "\x7f" for ch in key):
        return False
    return all(segment not in ("", ".", "..") for segment in key.split("/"))


@dataclass(frozen=True, slots=True)
class Failure:
    """What an obstore exception says."""

    #: HTTP status of the answer; 0 when none came.
    status: int = 0
    #: The store's error code from the answer's body (``SlowDown``, ``AuthenticationFailed``).
    code: str = ""
    #: When no answer came: the transport failure (``Connect``, ``Timeout``, ``Request``,
    #: ``Interrupted``: reqwest's error kinds as object_store names them); else ``""``.
    transport: str = ""
    #: The read started at or past the object's end: a 416, or object_store's own check of a
    #: 206 answer ("Wanted range starting at N, but object was only M bytes long"; Azurite).
    past_end: bool = False
    #: One line for logs and messages: obstore's reason, without URLs or the answer's body.
    summary: str = ""


# object_store's texts (its Display and Debug forms, the only place the status, the error code
# and the transport failure are kept). The tests check them against the emulators' answers.
_STATUS = re.compile(r"status code: (\d{3})|Status \{\s*status: (\d{3})")
_CODE = re.compile(r"<Code>([^<]{1,100})</Code>")
_TRANSPORT = re.compile(r"HttpError \{\s*kind: (Connect|Timeout|Request|Interrupted)\b")
_START_TOO_LARGE = re.compile(r"Wanted range starting at (\d+), but object was only (\d+) bytes")


def failure_of(exc: BaseException) -> Failure:
    """What obstore's exception ``exc`` says (a :class:`Failure` with nothing set for any other
    exception)."""
    if not isinstance(exc, obe.BaseError | FileNotFoundError):
        return Failure()
    text = str(exc)
    found = _STATUS.search(text)
    status = int(found.group(1) or found.group(2)) if found else 0
    code = _CODE.search(text)
    transport = _TRANSPORT.search(text) if not status else None
    too_large = _START_TOO_LARGE.search(text)
    past_end = status == 416 or (too_large is not None
                                 and int(too_large.group(1)) >= int(too_large.group(2)))
    return Failure(status, code.group(1).strip() if code else "",
                   transport.group(1) if transport else "", past_end, _summary(text))


def _summary(text: str) -> str:
    """obstore's reason from its message's first line: after "... in 2ms - " or "... error: ",
    without the answer's body or any URL (a SAS would be in its query)."""
    first = text.split("\n", 1)[0]
    reason = first.rsplit(" - ", 1)[1] if " - " in first else first.partition("error: ")[2]
    reason = (reason or first).split(": <", 1)[0]
    return re.sub(r"https?://\S+", "<url>", reason).strip()[:200]


class ObstoreReads:
    """One backend's reads through obstore, with the SDK where obstore cannot do one.

    ``build()`` makes the store; it runs once, on the first read (so opening a backend that
    only lists stays cheap, and a fill process forked before any read starts its own runtime),
    under a lock. It raises :class:`ObstoreUnavailable` (or obstore's error) when obstore
    cannot be set up; then every read goes through the SDK and :attr:`path` says so. Thread-
    safe: the fill processes' threads call :meth:`read` at once.
    """

    def __init__(self, url: str, sdk: str, build: Callable[[], Any]) -> None:
        self.url = url
        #: The SDK's name, as :attr:`path` gives it (``"boto3"``, ``"azure-storage-blob"``).
        self.sdk = sdk
        self._build = build
        self._lock = threading.Lock()
        self._store: Any = None
        self._built = False
        #: Why reads go through the SDK, once they all do (``None``: obstore reads).
        self.off_reason: str | None = None
        #: Reads that went through the SDK: keys :func:`exact_key` refuses, answers obstore did
        #: not understand, and every read once obstore is off.
        self.sdk_reads = 0

    @property
    def path(self) -> str:
        """``"obstore"``, or the SDK's name once reads go through it."""
        return "obstore" if self.off_reason is None else self.sdk

    def read(
        self, key: str, offset: int, length: int, sdk_read: Callable[[str, int, int], bytes],
        known: Callable[[BaseException], bool],
    ) -> bytes:
        """``length`` bytes at ``offset`` of ``key`` (the full key in the bucket), fewer at
        the object's end, ``b""`` from a start at or past the end.

        Through obstore where it can; else through ``sdk_read(key, offset, length)`` (which
        answers like this method). An obstore error that ``known`` (the backend's error table)
        maps is raised for the base class to translate; one it does not is asked again through
        the SDK, and if the SDK reads it, every read goes through the SDK from then on.
        """
        store = self.store_for(key)
        if store is None:
            return sdk_read(key, offset, length)
        try:
            return bytes(obstore.get_range(store, key, start=offset, length=length))
        except Exception as exc:
            failure = failure_of(exc)
            if failure.past_end:
                # A range starting at or past the end (also any range of an empty object):
                # pread says b"". A missing object is a 404 first, so this never hides it.
                return b""
            if known(exc):
                raise
            self._count_sdk_read()
            data = sdk_read(key, offset, length)
            self.turn_off(f"obstore did not understand an answer ({failure.summary or exc!r}) "
                          f"that {self.sdk} read")
            return data

    def store_for(self, key: str) -> Any | None:
        """The store to read ``key`` through, or ``None``: read it through the SDK (counted)."""
        if not self._built:
            self._build_once()
        store = self._store
        if store is not None and self.off_reason is None and exact_key(key):
            if _runtime_here():
                return store
            self.turn_off("this process was forked after its parent had read through obstore, "
                          "whose runtime cannot run in a forked child")
        self._count_sdk_read()
        return None

    def turn_off(self, reason: str) -> None:
        """Send every read through the SDK from now on; logged once."""
        with self._lock:
            if self.off_reason is not None:
                return
            self.off_reason = reason
        log.warning("reads of %s go through %s from now on: %s", self.url, self.sdk, reason)

    def _build_once(self) -> None:
        with self._lock:
            if self._built:
                return
            try:
                self._store = self._build()
            except (ObstoreUnavailable, obe.BaseError, ValueError) as exc:
                first = str(exc).split("\n", 1)[0][:200]
                self.off_reason = f"obstore could not be set up ({first})"
                log.warning("reads of %s go through %s: %s", self.url, self.sdk, self.off_reason)
            self._built = True

    def _count_sdk_read(self) -> None:
        with self._lock:
            self.sdk_reads += 1


def _runtime_here() -> bool:
    """False in a process forked after its parent's obstore runtime started (the runtime's
    threads are not in the child); True otherwise, and this process's runtime is the one."""
    global _runtime_pid
    pid = os.getpid()
    if _runtime_pid is None:
        _runtime_pid = pid
    return _runtime_pid == pid
