"""Descriptor hand-off: cached files opened by mountd and passed over its socket.

A store that is traversable lets any local process that knows a hash open its store file
(docs/store-layout.md "Access"); a deployment that does not want that runs mountd with
``--private-store``, and then only mountd's user can. :class:`HandOff` lets everybody else
still read hits without FUSE: it asks mountd to open the store files of a batch of hashes
(the ``open`` operation, docs/mountd-protocol.md) and receives their descriptors in one
answer (``SCM_RIGHTS``). mountd counts each descriptor it hands over as a hit, so nothing
is reported afterwards. :class:`quiverfs.client.direct.DirectReader` uses it for the mounts whose
store it cannot open itself, or for every mount when asked to (docs/shim.md "Hand-off").

Torch-free, one object per cache directory and process; the connections are per thread (a
blocking client answers one request at a time).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Sequence

from mountd.rpc.client import Opened, SyncClient
from mountd.rpc.fdpass import close_all
from mountd.rpc.protocol import MAX_OPEN
from quiverfs.base.errors import QuiverError

__all__ = ["HandOff", "can_open_store"]

log = logging.getLogger("quiverfs.direct")

#: Seconds to connect to mountd; seconds after a failure before it is asked again (files
#: read through the mount in between, rather than waiting on a mountd that does not answer).
CONNECT_TIMEOUT = 1.0
RETRY_SECONDS = 5.0


def can_open_store(store: str) -> bool:
    """Whether this process may open store files of ``store`` (``CACHE_DIR/store``) itself:
    False when it may not search the store's folders (``EACCES``: a ``--private-store``, or
    a store out of this process's reach). One ``stat`` of a fan-out folder; a folder that is
    not there yet says yes (the store was searched to find that out)."""
    try:
        os.stat(os.path.join(store, "00"))
    except PermissionError:
        return False
    except OSError:
        return True  # missing, or another trouble: store files will say, one by one
    return True


class HandOff:
    """Asks the mountd of ``cache_dir`` for the descriptors of cached files, for one process.

    :meth:`open` never fails for mountd's sake: while mountd cannot be reached, or refuses,
    every file is answered None (read it through the mount), logged once per process and
    cache; it is asked again :data:`RETRY_SECONDS` later.
    """

    def __init__(self, cache_dir: str, reader: str = "direct reads",
                 fallback: str = "reading through the mount") -> None:
        self.cache_dir = cache_dir
        #: who asks and what it does meanwhile, for the one warning when mountd does not answer
        self._reader, self._fallback = reader, fallback
        self._local = threading.local()
        self._lock = threading.Lock()
        self._clients: list[SyncClient] = []
        #: bumped by close(): a thread's client of an earlier generation is closed
        self._generation = 0
        self._retry_at = 0.0
        self._warned = False
        self.requests = 0  #: ``open`` requests answered
        self.handed = 0  #: descriptors received

    def open(self, hashes: Sequence[bytes], sizes: Sequence[int],
             dataset: str | None) -> list[Opened]:
        """For each hash (of the digest row's size), ``(descriptor, size)`` of its store file
        or None (not cached, or mountd not asked): one request per :data:`MAX_OPEN` hashes.
        The caller owns the descriptors; none is left open when this raises."""
        out: list[Opened] = []
        try:
            for start in range(0, len(hashes), MAX_OPEN):
                part = slice(start, start + MAX_OPEN)
                out.extend(self._ask(hashes[part], sizes[part], dataset))
        except BaseException:
            close_all([item[0] for item in out if item is not None])
            raise
        return out

    def _ask(self, hashes: Sequence[bytes], sizes: Sequence[int], dataset: str | None) -> list[Opened]:
        client = self._client()
        if client is not None:
            try:
                opened = client.open(hashes, dataset, sizes)
            except (QuiverError, OSError) as exc:
                self._failed(exc)
            else:
                self.requests += 1
                self.handed += sum(item is not None for item in opened)
                return opened
        return [None] * len(hashes)

    def _client(self) -> SyncClient | None:
        """This thread's connection (made now if it has none and mountd may be asked)."""
        local = self._local
        client = getattr(local, "client", None)
        if client is not None and local.generation == self._generation:
            return client
        if time.monotonic() < self._retry_at:
            return None
        try:
            client = SyncClient.connect(self.cache_dir, timeout=CONNECT_TIMEOUT)
        except (QuiverError, OSError) as exc:
            self._failed(exc)
            return None
        with self._lock:
            self._clients.append(client)
            local.client, local.generation = client, self._generation
        return client

    def _failed(self, exc: BaseException) -> None:
        if not self._warned:
            self._warned = True
            log.warning("%s: mountd of %s does not hand over descriptors (%s); %s meanwhile",
                        self._reader, self.cache_dir, exc, self._fallback)
        self._retry_at = time.monotonic() + RETRY_SECONDS
        client = getattr(self._local, "client", None)
        if client is not None:
            self._local.client = None
            self._drop(client)

    def _drop(self, client: SyncClient) -> None:
        client.close()
        with self._lock:
            if client in self._clients:
                self._clients.remove(client)

    def close(self) -> None:
        """Close this process's connections (a thread that asks again connects anew)."""
        with self._lock:
            clients, self._clients = self._clients, []
            self._generation += 1
        for client in clients:
            client.close()
