"""``digests verify``: read every file back from its location and compare with the digest.

Reports every object that is missing, unreadable, of the wrong length or with other content;
never stops at the first, except on AccessDenied (missing or refused credentials), which would
fail every object alike and ends the run with one line. Reads go through the same backends as the mount, ``workers`` at a
time; each file's bytes are hashed as they arrive, so memory stays at ``workers`` chunks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import blake3
import trio

from digests.digest import Digest, FileEntry
from digests.progress import Progress
from quiverfs.base.backends import Backend, BackendOptions, RemoteSettings, open_backend
from quiverfs.base.backends.base import DEFAULT_CHUNK
from quiverfs.base.errors import AccessDenied, BackendError, NotFound, first_error


@dataclass
class VerifyResult:
    """Counts and every problem found, as ``(path, reason)``."""

    checked: int = 0
    bytes: int = 0
    missing: list[tuple[str, str]] = field(default_factory=list)
    mismatched: list[tuple[str, str]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.missing and not self.mismatched


async def verify(
    digest: Digest,
    *,
    workers: int = 16,
    progress: Progress | None = None,
    settings: RemoteSettings | None = None,
    options: BackendOptions | None = None,
    backend_factory: Callable[[str], Backend] | None = None,
) -> VerifyResult:
    """Check every file of ``digest`` against its location; see :class:`VerifyResult`.

    ``backend_factory(url)`` opens the backend of a source URL (default:
    :func:`open_backend` with ``options`` and ``settings``); backends opened here are closed
    here. ``digest`` is used from the trio thread only.
    """
    progress = progress or Progress()
    result = VerifyResult()
    backends: dict[str, Backend] = {}

    def backend_for(url: str) -> Backend:
        if url not in backends:
            backends[url] = (
                backend_factory(url) if backend_factory else open_backend(url, options, settings)
            )
        return backends[url]

    progress.add_total(digest.file_count, digest.total_bytes)
    progress.totals_known()

    async def feeder(send: trio.MemorySendChannel[FileEntry]) -> None:
        async with send:
            for entry in digest.iter_files():
                await send.send(entry)

    async def worker(recv: trio.MemoryReceiveChannel[FileEntry]) -> None:
        async with recv:
            async for entry in recv:
                await _check_one(backend_for(entry.location.url), entry, result)
                result.checked += 1
                result.bytes += entry.size
                progress.advance(1, entry.size)

    send, recv = trio.open_memory_channel[FileEntry](workers)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(feeder, send)
            for _ in range(max(1, workers)):
                nursery.start_soon(worker, recv.clone())
            await recv.aclose()
    except BaseExceptionGroup as group:
        raise first_error(group) from None
    finally:
        for backend in backends.values():
            await backend.aclose()
    result.missing.sort()
    result.mismatched.sort()
    return result


async def _check_one(backend: Backend, entry: FileEntry, result: VerifyResult) -> None:
    loc = entry.location
    hasher = blake3.blake3()
    seen = 0
    try:
        while seen < loc.length:
            want = min(DEFAULT_CHUNK, loc.length - seen)
            data = await backend.read_range(loc.key, loc.offset + seen, want)
            if len(data) >= (1 << 20):
                await trio.to_thread.run_sync(hasher.update, data)
            else:
                hasher.update(data)
            seen += len(data)
            if len(data) < want:
                break
    except AccessDenied:
        # Missing or refused credentials fail every object alike: stop with one line rather
        # than report each file.
        raise
    except NotFound:
        result.missing.append((entry.path, f"missing: {loc.url}/{loc.key}"))
        return
    except BackendError as exc:
        result.mismatched.append((entry.path, f"unreadable: {exc}"))
        return
    if seen != entry.size:
        result.mismatched.append((entry.path, f"size {seen} bytes, digest says {entry.size}"))
    elif hasher.digest() != entry.hash:
        result.mismatched.append((entry.path, "content differs (blake3 mismatch)"))
