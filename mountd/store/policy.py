"""Eviction policies: which entries to remove when a fill needs room.

A policy only *chooses*; the cache removes the files and rows, keeps the byte accounting and
never offers pinned entries (the index query excludes them) or fills in flight (not indexed
yet). Add a policy by subclassing :class:`EvictionPolicy` and calling :func:`register_policy`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import ClassVar

from mountd.store.index import Index
from quiverfs.base.errors import UsageError


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

    def on_insert(self, hash: bytes, size: int) -> None:  # noqa: B027 - optional hook
        """A file was stored."""

    def on_access(self, hashes: Sequence[bytes]) -> None:  # noqa: B027 - optional hook
        """Files were read (the index has noted their recency already)."""

    def on_remove(self, hashes: Sequence[bytes]) -> None:  # noqa: B027 - optional hook
        """Files were removed (evicted, scrubbed or dropped by recovery)."""


class LRUPolicy(EvictionPolicy):
    """Least recently used first: the index's ``last_use`` column (fills write it) and the
    recency of hits the index keeps in memory (``Index.least_recent``)."""

    name = "lru"
    page = 256

    def victims(self) -> Iterator[tuple[bytes, int]]:
        return self.index.least_recent(self.page)


#: Kept entries :func:`keep_last` passes over at most before it gives them back in the
#: policy's order: bounds the scan of one eviction when nearly everything is kept (a
#: cache smaller than this node's share of the cluster's data).
KEEP_LOOKAHEAD = 4096


def keep_last(victims: Iterator[tuple[bytes, int]], keeps: Callable[[bytes], bool],
              lookahead: int = KEEP_LOOKAHEAD) -> Iterator[tuple[bytes, int, bool]]:
    """``victims`` as ``(hash, size, kept)``, those that ``keeps(hash)`` says to keep after
    all the others (each group in the policy's order): a node of a cluster evicts the files
    other nodes own before its own share (docs/cluster.md "What a node keeps").

    At most ``lookahead`` kept entries are held back; past that the oldest held back comes
    out in its turn, so one eviction never reads a whole cache of kept files."""
    held_back: deque[tuple[bytes, int]] = deque()
    for hash, size in victims:
        if not keeps(hash):
            yield hash, size, False
            continue
        held_back.append((hash, size))
        if len(held_back) > lookahead:
            yield (*held_back.popleft(), True)
    for hash, size in held_back:
        yield hash, size, True


#: Policy name → class; :class:`mountd.store.config.CacheConfig.policy` picks one.
POLICIES: dict[str, type[EvictionPolicy]] = {"lru": LRUPolicy}


def register_policy(cls: type[EvictionPolicy]) -> type[EvictionPolicy]:
    """Make ``cls`` selectable by ``cls.name`` (usable as a class decorator)."""
    POLICIES[cls.name] = cls
    return cls


def make_policy(name: str, index: Index) -> EvictionPolicy:
    """The policy called ``name``; :class:`UsageError` for an unknown name."""
    try:
        cls = POLICIES[name]
    except KeyError:
        raise UsageError(
            f"unknown eviction policy {name!r} (known: {', '.join(sorted(POLICIES))})"
        ) from None
    return cls(index)
