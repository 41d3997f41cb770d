"""A mountd cache that makes one durable checkpoint, fills more, and waits to be SIGKILLed.

Usage: python durability_worker.py CACHE_DIR SOURCE_DIR SYNCED UNSYNCED
Fills the first SYNCED files of SOURCE_DIR (sorted), takes a checkpoint, prints ``synced``;
fills the next UNSYNCED ones (no checkpoint comes: the interval is an hour), waits until
their rows are committed, prints ``filled``, then sleeps until killed.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import blake3
import trio

from mountd.store.cache import Cache, CacheConfig
from quiverfs.base.backends.base import Location


async def main(cache_dir: Path, source: Path, synced: int, unsynced: int) -> None:
    cache = Cache(CacheConfig(cache_dir=cache_dir, cache_size=1 << 30, sync_interval=3600))
    await cache.open()
    url = "file://" + str(source)
    names = sorted(os.listdir(source))[: synced + unsynced]

    async def fill(batch: list[str]) -> None:
        for name in batch:
            data = (source / name).read_bytes()
            await cache.ensure(blake3.blake3(data).digest(), len(data), Location(url, name, 0, len(data)))

    async with trio.open_nursery() as nursery:
        await nursery.start(cache.run)
        await fill(names[:synced])
        assert await cache.checkpoint()
        print("synced", flush=True)
        await fill(names[synced:])
        # The group commit is flushed within milliseconds, in a worker thread: wait for its
        # flight to land too (pending alone is 0 while the rows are being committed).
        while cache.index.uncommitted:
            await trio.sleep(0.01)
        print("filled", flush=True)
        await trio.sleep_forever()


if __name__ == "__main__":
    trio.run(main, Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
