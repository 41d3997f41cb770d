"""Eviction policies: which entries to remove when a fill needs room.

A policy only *chooses*; the cache removes the files and rows, keeps the byte accounting and
never offers pinned entries (the index query excludes them) or fills in flight (not indexed
yet). Add a policy by subclassing :class:`EvictionPolicy` and calling :func:`register_policy`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from typing import ClassVar

from mountd.index import Index


class EvictionPolicy(ABC):
    """Chooses victims among the evictable (unpinned, indexed) entries.

    All methods run in the trio thread, between awaits.
    """

    name: ClassVar[str]

    def __init__(self, index: Index) -> None:
        self.index = index

    @abstractmethod
    def victims(self) -> Iterator[tuple[bytes, int]]:
        """Evictable ``(hash, size)`` in the order to evict; the caller stops when it has room."""

    def on_insert(self, hash: bytes, size: int, unread: bool = False) -> None:  # noqa: B027 - optional hook
        """A file was stored; ``unread``: fetched ahead (prefetch, claim, preload), nobody
        has read it yet."""

    def on_access(self, hashes: Sequence[bytes]) -> None:  # noqa: B027 - optional hook
        """Files were read (the index's last_use is already updated)."""

    def on_remove(self, hashes: Sequence[bytes]) -> None:  # noqa: B027 - optional hook
        """Files were removed (evicted, scrubbed or dropped by recovery)."""


class LRUPolicy(EvictionPolicy):
    """Least recently used first, by the index's ``last_use`` column (hits and fills update it),
    except that files fetched ahead and not read yet go last.

    A file prefetched for a job (a claim's miss, a DELI-style fetch ahead) is needed soon: if
    plain LRU evicted it before files already read, a cache a little larger than the
    look-ahead would throw away exactly what the job is about to read (DELI §III-B keeps
    prefetched data until it is consumed). Such files are tracked here until their first read
    (a hit report or an ``ensure``); after a mountd restart every file is plain LRU again.
    """

    name = "lru"
    page = 256

    def __init__(self, index: Index) -> None:
        super().__init__(index)
        self._unread: set[bytes] = set()

    def on_insert(self, hash: bytes, size: int, unread: bool = False) -> None:
        if unread:
            self._unread.add(hash)

    def on_access(self, hashes: Sequence[bytes]) -> None:
        self._unread.difference_update(hashes)

    def on_remove(self, hashes: Sequence[bytes]) -> None:
        self._unread.difference_update(hashes)

    def victims(self) -> Iterator[tuple[bytes, int]]:
        unread = self._unread
        yield from self._in_lru_order(lambda h: h not in unread)
        if unread:
            yield from self._in_lru_order(lambda h: h in unread)

    def _in_lru_order(self, wanted) -> Iterator[tuple[bytes, int]]:
        after: tuple[int, bytes] = (-1, b"")
        while True:
            rows = self.index.lru(self.page, after)
            if not rows:
                return
            for hash, size, last_use in rows:
                after = (last_use, hash)
                if wanted(hash):
                    yield hash, size


#: Policy name → class; :class:`mountd.config.CacheConfig.policy` picks one.
POLICIES: dict[str, type[EvictionPolicy]] = {"lru": LRUPolicy}


def register_policy(cls: type[EvictionPolicy]) -> type[EvictionPolicy]:
    """Make ``cls`` selectable by ``cls.name`` (usable as a class decorator)."""
    POLICIES[cls.name] = cls
    return cls


def make_policy(name: str, index: Index) -> EvictionPolicy:
    """The policy called ``name``; :class:`UsageError` for an unknown name."""
    from quiverfs.errors import UsageError

    try:
        cls = POLICIES[name]
    except KeyError:
        raise UsageError(
            f"unknown eviction policy {name!r} (known: {', '.join(sorted(POLICIES))})"
        ) from None
    return cls(index)
