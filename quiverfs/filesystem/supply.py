"""Misses filled with the mount's own rights, for a mountd shared by every user.

A mountd that runs as another user (root or a ``quiverfs`` system user, one per machine)
never reads a source on a user's behalf (docs/operations.md "Security"): it answers the
mount's ``ensure`` with the cached file, or asks the mount to supply the bytes. The
:class:`Supplier` does that with this process's own rights and credentials:

* ``file://``: it opens the source file itself and passes the descriptor (one ``supply``
  request: mountd reads the content at the location's offset, or finds it cached already).
  When this user may not open the file, the content can still be served if it is cached (the
  hash is the capability: another user fetched it), so it asks once more by hash;
* cloud sources: ``ensure`` first (a hit, or another user's fill in flight, costs nothing);
  when mountd leases the hash to us, it fetches the range with the SDK's own credential chain
  into an anonymous ``memfd`` and passes that. A failed fetch gives the lease back at once,
  so other users waiting for the same content try with their own rights.

mountd verifies every byte it is given (size and blake3) before storing it, so a mount can
never poison the cache, whatever it supplies.
"""

from __future__ import annotations

import errno
import logging
import os
from contextlib import suppress

import trio

from quiverfs.base.backends import Backend, BackendOptions, open_backend
from quiverfs.base.backends.base import DEFAULT_CHUNK, Location
from quiverfs.base.backends.file import FileBackend
from quiverfs.base.errors import QuiverError

log = logging.getLogger("quiverfs.supply")


class Supplier:
    """Fills misses of one dataset for a mountd that does not read sources for us.

    ``client`` is the mount's :class:`mountd.rpc.async_client.AsyncClient`; ``concurrency`` bounds
    this mount's own remote reads (mountd's remote limits do not apply to them).
    """

    def __init__(self, client, dataset: str, concurrency: int = 16) -> None:
        self.client = client
        self.dataset = dataset
        self._backends: dict[str, Backend] = {}
        self._options = BackendOptions(concurrency=concurrency)
        self._limiter = trio.CapacityLimiter(concurrency)
        #: Fills this mount supplied, and their bytes (``user.quiver.stats``).
        self.supplied = 0
        self.supplied_bytes = 0

    def _backend(self, url: str) -> Backend:
        backend = self._backends.get(url)
        if backend is None:
            backend = self._backends[url] = open_backend(url, self._options)
        return backend

    async def ensure(self, entry) -> str:
        """Path of the verified store file holding ``entry``'s content."""
        location: Location = entry.location
        backend = self._backend(location.url)
        if isinstance(backend, FileBackend):
            return await self._supply_file(backend, entry)
        path = await self.client.lease(entry.hash, entry.size, location, self.dataset)
        if path is not None:
            return path
        return await self._supply_fetched(backend, entry)

    async def _supply_file(self, backend: FileBackend, entry) -> str:
        location: Location = entry.location
        try:
            fd = await trio.to_thread.run_sync(
                os.open, backend.path_of(location.key), os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            # Not ours to read; a hit by hash needs no right to the source.
            path = await self.client.lease(entry.hash, entry.size, location, self.dataset)
            if path is not None:
                return path
            await self._give_back(entry.hash)
            raise backend.error_of(exc, location.key) from None
        try:
            path = await self.client.supply(entry.hash, entry.size, location, fd,
                                            location.offset, self.dataset)
        finally:
            os.close(fd)
        self._count(entry.size)
        return path

    async def _supply_fetched(self, backend: Backend, entry) -> str:
        location: Location = entry.location
        try:
            async with self._limiter:
                fd = await self._fetch_to_memfd(backend, location, entry.size)
        except BaseException:
            await self._give_back(entry.hash)
            raise
        try:
            path = await self.client.supply(entry.hash, entry.size, location, fd, 0, self.dataset)
        finally:
            os.close(fd)
        self._count(entry.size)
        return path

    async def _fetch_to_memfd(self, backend: Backend, location: Location, size: int) -> int:
        """The range's bytes in a new ``memfd`` (chunk by chunk: memory stays bounded by
        the chunk while fetching; the memfd holds the whole content until mountd stored it)."""
        fd = os.memfd_create("quiverfs-supply", os.MFD_CLOEXEC)
        try:
            offset = 0
            while offset < size:
                n = min(DEFAULT_CHUNK, size - offset)
                data = await backend.read_range(location.key, location.offset + offset, n)
                if not data:
                    break  # short object: mountd's size check says so
                await trio.to_thread.run_sync(_write_all, fd, data, offset)
                offset += len(data)
        except BaseException:
            os.close(fd)
            raise
        return fd

    async def _give_back(self, hash: bytes) -> None:
        """Release our lease of ``hash`` so the next user tries (advisory, never raises)."""
        with trio.CancelScope(shield=True), suppress(QuiverError, OSError):
            await self.client.release([hash])

    def _count(self, size: int) -> None:
        self.supplied += 1
        self.supplied_bytes += size

    async def prefetch(self, entries) -> None:
        """Fill ``entries`` ourselves in the background (read-ahead on a shared mountd);
        advisory: errors are logged at debug level only."""
        async def one(entry) -> None:
            try:
                await self.ensure(entry)
            except (QuiverError, OSError) as exc:
                log.debug("read-ahead of %s failed: %s", entry.hash.hex(), exc)

        async with trio.open_nursery() as nursery:
            for entry in entries:
                nursery.start_soon(one, entry)

    async def aclose(self) -> None:
        """Close the backends this mount opened."""
        for backend in self._backends.values():
            with suppress(Exception):
                await backend.aclose()
        self._backends.clear()


def _write_all(fd: int, data: bytes, offset: int) -> None:
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        if n <= 0:
            raise OSError(errno.EIO, "short write to a memfd")
        view, offset = view[n:], offset + n
