"""A mountd cache doing many rate-limited fills, to be killed with SIGKILL by a test.

Usage: python crash_worker.py CACHE_DIR SOURCE_DIR BANDWIDTH CHUNK_SIZE
Prints ``ready`` after open, then ``filled <hex>`` after each fill (flushed), forever-ish.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import blake3
import trio

from mountd.store.cache import Cache, CacheConfig
from quiverfs.base.backends.base import Location


async def main(cache_dir: Path, source: Path, bandwidth: float, chunk_size: int) -> None:
    cache = Cache(
        CacheConfig(
            cache_dir=cache_dir,
            cache_size=1 << 30,
            remote_bandwidth=bandwidth,
            fill_concurrency=16,
            chunk_size=chunk_size,
        )
    )
    await cache.open()
    print("ready", flush=True)
    items = []
    for name in sorted(os.listdir(source)):
        data = (source / name).read_bytes()
        items.append((blake3.blake3(data).digest(), len(data), name))
    url = "file://" + str(source)
    limiter = trio.CapacityLimiter(16)

    async def one(h: bytes, size: int, name: str) -> None:
        async with limiter:
            await cache.ensure(h, size, Location(url, name, 0, size), "crash")
        print("filled", h.hex(), flush=True)

    async with trio.open_nursery() as nursery:
        await nursery.start(cache.run)
        async with trio.open_nursery() as fills:
            for h, size, name in items:
                fills.start_soon(one, h, size, name)
        print("all-done", flush=True)
        await cache.aclose()


if __name__ == "__main__":
    trio.run(main, Path(sys.argv[1]), Path(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4]))
