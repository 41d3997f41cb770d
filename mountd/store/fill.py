"""One fill: fetch a hash's bytes through the remote limits, verify them, store them.

Small objects (one chunk) are read, verified in memory and stored in **one worker thread**
(:meth:`Backend.read_range_then`): one thread hop per fill, and bad bytes never touch the
disk. Larger ones stream chunk by chunk (memory bounded by ``chunk_size``), hashed
incrementally and written to the temp file at explicit offsets; a mismatch at the end unlinks
the temp file. Either way nothing reaches a final name unverified. Nothing is fsynced here:
the cache's checkpoints make fills durable in groups (:mod:`mountd.store.durability`).

Disk full: a write that fails with ENOSPC asks the cache to evict (``free_space``), then
rewrites the same range once (``pwrite`` makes the retry idempotent). A second ENOSPC, or
ENOSPC from ``fsync`` (after which the page cache may have dropped the data, so retrying the
fsync would lie), fails the fill with :class:`CacheFull`; the temp file is always removed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial
from pathlib import Path

import blake3
import trio

from mountd.errors import CacheFull
from mountd.stats.counters import Counters
from mountd.store import disk
from mountd.store.limits import RemoteLimits
from mountd.store.span import Span
from mountd.store.supplied import SuppliedBytes
from quiverfs.backends import Backend
from quiverfs.backends.base import Location
from quiverfs.errors import CorruptObject

log = logging.getLogger("mountd.store.fill")

class Filler:
    """Runs fills for the cache; holds no per-fill state."""

    def __init__(
        self,
        cache_dir: Path,
        limits: RemoteLimits,
        counters: Counters,
        io_limiter: trio.CapacityLimiter,
        chunk_size: int,
        free_space: Callable[[int], int],
    ) -> None:
        self.cache_dir = cache_dir
        self.limits = limits
        self.counters = counters
        self.io = io_limiter
        self.chunk_size = chunk_size
        self.free_space = free_space
        self.fanout = disk.Fanout()

    async def fill(
        self, backend: Backend | SuppliedBytes, hash: bytes, size: int, location: Location,
        dataset: str | None,
    ) -> Path:
        """Fetch, verify and store; returns the final path. Raises CorruptObject, CacheFull,
        backend errors. The caller has reserved ``size`` bytes and indexes the result.

        ``backend`` may be bytes a client supplied (:class:`SuppliedBytes`): they are verified
        the same way, but neither pass the remote limits nor count as requests (the client
        did the remote read, under its own rights)."""
        if location.length != size:
            raise self._corrupt(
                hash, location, f"digest says {size} bytes but its location has {location.length}"
            )
        limited = not isinstance(backend, SuppliedBytes)
        if size <= self.chunk_size:
            return await self._fill_small(backend, hash, size, location, dataset, limited)
        return await self._stream(backend, hash, size, location, dataset, limited)

    # -- pieces ------------------------------------------------------------------------------

    async def _fill_small(
        self, backend: Backend | SuppliedBytes, hash: bytes, size: int, location: Location,
        dataset: str | None, limited: bool,
    ) -> Path:
        """Read, verify and store a one-chunk object in one worker thread."""
        received: list[int] = []
        store = partial(self._verify_and_store, hash, location, size, received)
        try:
            if size == 0:  # nothing to fetch: no request
                return await trio.to_thread.run_sync(store, b"", limiter=self.io)
            if not limited:
                return await backend.read_range_then(location.key, 0, size, store)
            async with self.limits.request(size):
                try:
                    return await backend.read_range_then(location.key, location.offset, size, store)
                finally:
                    if received:  # the GET itself succeeded, whatever came of its bytes
                        self.counters.add_request(dataset, "GET", received[0])
        except _NoSpace as full:
            self._make_room(size, full.error)
            data = full.data
        try:
            return await trio.to_thread.run_sync(
                disk.write_file, self.cache_dir, hash, data, self.fanout, limiter=self.io
            )
        except OSError as exc:
            if disk.is_enospc(exc):
                raise self._disk_full(size) from exc
            raise

    async def fill_span(
        self, backend: Backend, span: Span, dataset: str | None
    ) -> list[Path | Exception]:
        """A chunk fill (:mod:`mountd.store.span`): one ranged GET of ``span`` under the remote
        limits, then every member cut out of it, verified and stored exactly as :meth:`fill`
        stores one file, in the same worker thread (one thread hop for the whole span).

        Returns, for each of ``span.members``, its final path or the error that member alone
        failed with (:class:`CorruptObject`: its bytes do not verify; :class:`CacheFull`;
        ``OSError``): a bad member never spoils its neighbours. Raises what the GET raised
        (every member failed with it). The caller has reserved ``span.content_bytes``."""
        received: list[int] = []
        split = partial(self._split_and_store, span, received)
        async with self.limits.request(span.length):
            try:
                results = await backend.read_range_then(span.key, span.start, span.length, split)
            finally:
                if received:  # the GET itself succeeded, whatever came of its bytes
                    self.counters.add_request(dataset, "GET", received[0])
        # Shielded: the other members are at their final names already, and the caller must
        # get to index them (a cancellation here would leave them unaccounted until recovery).
        with trio.CancelScope(shield=True):
            for i, result in enumerate(results):
                if isinstance(result, _NoSpace):  # disk full: evict, write once more
                    member = span.members[i]
                    self._make_room(member.size, result.error)
                    try:
                        results[i] = await trio.to_thread.run_sync(
                            disk.write_file, self.cache_dir, member.hash, result.data,
                            self.fanout, limiter=self.io)
                    except OSError as exc:
                        results[i] = self._disk_full(member.size) if disk.is_enospc(exc) else exc
        return results

    def _split_and_store(self, span: Span, received: list[int], data: bytes) -> list:
        """In a worker thread: each member of ``span`` verified and stored on its own (a short
        read leaves the members past its end short, hence corrupt)."""
        received.append(len(data))
        out: list = []
        view = memoryview(data)
        for member in span.members:
            at = member.location.offset - span.start
            try:
                out.append(self._store_verified(
                    member.hash, member.location, member.size, bytes(view[at : at + member.size])))
            except (CorruptObject, _NoSpace, OSError) as exc:
                out.append(exc)
        return out

    def _verify_and_store(
        self, hash: bytes, location: Location, size: int, received: list[int], data: bytes
    ) -> Path:
        """In a worker thread: note the bytes received, then :meth:`_store_verified`."""
        received.append(len(data))
        return self._store_verified(hash, location, size, data)

    def _store_verified(self, hash: bytes, location: Location, size: int, data: bytes) -> Path:
        """In a worker thread: check size and blake3, then write and rename into the store.
        Raises CorruptObject (nothing written), :class:`_NoSpace` (disk full; the caller
        evicts in the trio thread and writes again), OSError."""
        self._check_size(hash, location, len(data), size)
        self._check_hash(hash, location, _digest(data))
        try:
            return disk.write_file(self.cache_dir, hash, data, self.fanout)
        except OSError as exc:
            if disk.is_enospc(exc):
                raise _NoSpace(data, exc) from exc
            raise

    async def _read(
        self, backend: Backend | SuppliedBytes, location: Location, offset: int, length: int,
        dataset: str | None, limited: bool,
    ) -> bytes:
        if not limited:  # supplied bytes: the content starts at the descriptor's own offset
            return await backend.read_range(location.key, offset, length)
        async with self.limits.request(length):
            data = await backend.read_range(location.key, location.offset + offset, length)
        self.counters.add_request(dataset, "GET", len(data))
        return data

    async def _stream(
        self, backend: Backend | SuppliedBytes, hash: bytes, size: int, location: Location,
        dataset: str | None, limited: bool,
    ) -> Path:
        temp = await trio.to_thread.run_sync(disk.TempFile, self.cache_dir, hash, limiter=self.io)
        committed = False
        try:
            hasher = blake3.blake3()
            retried = False
            offset = 0
            while offset < size:
                n = min(self.chunk_size, size - offset)
                data = await self._read(backend, location, offset, n, dataset, limited)
                self._check_size(hash, location, offset + len(data), size, partial=len(data) == n)
                update = True
                while True:
                    try:
                        await trio.to_thread.run_sync(
                            _update_write, hasher, temp, data, offset, update, limiter=self.io
                        )
                        break
                    except OSError as exc:
                        if not disk.is_enospc(exc):
                            raise
                        if retried:
                            raise self._disk_full(size) from exc
                        retried, update = True, False
                        self._make_room(size - offset, exc)
                offset += n
            self._check_hash(hash, location, hasher.digest())
            try:
                path = await trio.to_thread.run_sync(temp.commit, self.fanout, limiter=self.io)
            except OSError as exc:
                if disk.is_enospc(exc):
                    raise self._disk_full(size) from exc
                raise
            committed = True
            return path
        finally:
            # Failed or cancelled: the temp file goes. Synchronous so cancellation cannot skip it.
            if not committed:
                temp.discard()

    def _make_room(self, need: int, exc: OSError) -> None:
        freed = self.free_space(need)
        log.warning("disk full while filling (%s); evicted %d bytes and retrying once", exc, freed)

    def _disk_full(self, size: int) -> CacheFull:
        return CacheFull(
            f"no space left on the device holding {self.cache_dir} for a {size}-byte file, "
            "even after evicting; lower the cache size or free disk space"
        )

    def _check_size(
        self, hash: bytes, location: Location, got: int, size: int, partial: bool = False
    ) -> None:
        if partial and got <= size:
            return
        if got != size:
            raise self._corrupt(hash, location, f"remote returned {got} bytes, digest says {size}")

    def _check_hash(self, hash: bytes, location: Location, digest: bytes) -> None:
        if digest != hash:
            raise self._corrupt(
                hash,
                location,
                f"blake3 of the bytes is {digest.hex()[:16]}…, expected {hash.hex()[:16]}…",
            )

    def _corrupt(self, hash: bytes, location: Location, why: str) -> CorruptObject:
        return CorruptObject(
            f"content of {hash.hex()} does not verify ({why}; {location.length} bytes at offset "
            f"{location.offset}); not cached",
            url=location.url,
            key=location.key,
        )


class _NoSpace(Exception):
    """ENOSPC while storing verified bytes in a worker thread; carries them back so the trio
    thread can evict and write them again without fetching twice."""

    def __init__(self, data: bytes, error: OSError) -> None:
        super().__init__(error)
        self.data = data
        self.error = error


def _digest(data: bytes) -> bytes:
    return blake3.blake3(
        data, max_threads=blake3.blake3.AUTO if len(data) >= 1 << 20 else 1
    ).digest()


def _update_write(hasher, temp: disk.TempFile, data: bytes, offset: int, update: bool) -> None:
    # Hash once per chunk (a retry after ENOSPC only rewrites); the write is idempotent.
    if update:
        hasher.update(data)
    temp.write_at(data, offset)
