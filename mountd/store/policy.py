"""Eviction policies: which entries to remove when a fill needs room.

A policy only *chooses*; the cache removes the files and rows, keeps the byte accounting and
never offers pinned entries (the index query excludes them) or fills in flight (not indexed
yet). Add a policy by subclassing :class:`EvictionPolicy` and calling :func:`register_policy`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from itertools import islice
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

    def on_read_done(self, files: Iterable[tuple[bytes, int]]) -> None:  # noqa: B027 - optional hook
        """Files (``(hash, size)``, indexed) a reader read and will not read again until its
        next epoch (a mount's bounded sweep, docs/mount.md "The sweep")."""


class LRUPolicy(EvictionPolicy):
    """Least recently used first: the index's ``last_use`` column (fills write it) and the
    recency of hits the index keeps in memory (``Index.least_recent``).

    Except for files a reader is done with for its epoch (:meth:`on_read_done`): those go
    first, the most recently read first. A shuffled reader of a dataset larger than the
    cache reads every file once an epoch, so LRU would keep what it just read and evict what
    it read an epoch ago, the files it is about to read again: it finds none of them (0 hits
    at a 20% cache). Evicting what it is done with, newest first, keeps the files of its
    last epoch that it has not read again yet (docs/mount.md "The sweep"). Anyone's access
    to such a file makes it an ordinary one again."""

    name = "lru"
    page = 256
    #: Files one pinned-or-not query looks up at a time, from the newest done file on.
    DONE_PAGE = 64

    def __init__(self, index: Index) -> None:
        super().__init__(index)
        #: hash -> size of the files readers are done with, the most recently read last
        self.done: OrderedDict[bytes, int] = OrderedDict()

    def victims(self) -> Iterator[tuple[bytes, int]]:
        if not self.done:
            return self.index.least_recent(self.page)
        return self._done_first()

    def _done_first(self) -> Iterator[tuple[bytes, int]]:
        # A page at a time, each read off the dict whole: the caller removes its victims
        # from ``done`` after it has chosen them all (and a page is one pinned query).
        done = self.done
        seen = 0
        while page := list(islice(reversed(done.items()), seen, seen + self.DONE_PAGE)):
            seen += len(page)
            pinned = self.index.pinned_of([h for h, _ in page])
            yield from ((h, size) for h, size in page if h not in pinned)
        for hash, size in self.index.least_recent(self.page):
            if hash not in done:
                yield hash, size

    def on_access(self, hashes: Sequence[bytes]) -> None:
        if self.done:
            for hash in hashes:
                self.done.pop(hash, None)

    def on_remove(self, hashes: Sequence[bytes]) -> None:
        if self.done:
            for hash in hashes:
                self.done.pop(hash, None)

    def on_read_done(self, files: Iterable[tuple[bytes, int]]) -> None:
        done = self.done
        for hash, size in files:
            done.pop(hash, None)
            done[hash] = size


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
