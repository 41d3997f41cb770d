"""What policy eviction must pass over: files just answered, and files fetched ahead (protection).

Both live here, in memory only, and both are exceptions to the eviction policy's order, never
to an admin's ``evict`` or a full disk. Co-ordinated chunk eviction (a chunk every job was
given) passes over protected files but cuts their protection short (:meth:`Holds.shorten`).
A pin (the index's ``pinned`` column, owned by the session layer's chunks) is a different
thing: it is durable, and nothing but an unpin ends it.

**Answer holds.** ``ensure``, ``ensure_supplied`` and ``lease`` answer with a store path; the
client (a mount, a loader) opens it one round trip later. Once open, the file is safe: on
Linux an open descriptor keeps an unlinked file's data, so the only window in which an
eviction can hurt a reader is answer → open. On a busy cache, in that window, other fills make
room: a chunk fill stores dozens of members at once, and when pinned chunks take most of the
cache, the few unpinned entries are the newest ones, the very file just answered among them.
Measured: with packed 64-file chunks, a cache of 20% and four jobs, readers met the file gone
three times in a row and failed with EIO (scripts/bench/packed_training.py, 2026-11-23). So
for :data:`HOLD_SECONDS` after an answer, policy eviction skips that file; a reservation that
cannot make room without held entries waits for the hold of the first of them (in the
policy's order) to end, then evicts it, instead of failing with ``CacheFull``.

**Protection** of files fetched ahead. A claim's misses and the packed members it brings, and
the mounts' prefetch queue, fetch files that a job will read a little later (DELI §III: data
pre-fetched is kept until it is consumed; Brand §3.2: never evict an unconsumed file). Plain
LRU evicts exactly those first once the cache is a little smaller than what is fetched ahead
(docs/benchmarks.md, the DELI threshold sweep). A protection names the hash, its size and the
*owners* that asked (e.g. a job's epoch pool; None: nobody in particular). It ends when

* the file is **read** (:meth:`Holds.consumed`: a hit report, a descriptor hand-off, an
  answer; reads are not attributed to jobs, so anyone's read ends it),
* its last owner **releases** it (:meth:`Holds.release`: the job's epoch pool closed), or
* :attr:`Holds.protect_seconds` **pass** (a job that died, a file nobody reads), or the
  shorter time its chunk's eviction left it (:meth:`Holds.shorten`).

Protected bytes are bounded by :attr:`Holds.protect_bytes` (``--protect-share`` of the room
that pinned files leave, a loading chunk's files counted from its start: the cache sets it
as pins come and go, ``Cache._cap_protection``):
:meth:`Holds.fits` is the gate that *new* prefetches ask before they start, and they wait
when it says no (Brand: load a chunk only into a free slot) instead of evicting protected
files. On-demand misses never wait for protection: a reader's fill evicts unprotected
entries first and, when only protected ones are left, ends the **newest protections** and
evicts those (``ended["demand"]``, :meth:`Holds.displace`): a reader is never starved and
never told ``CacheFull`` for protection's sake (the reverted "unread last" LRU starved them:
commit 921a01b). The cache fetches a displaced file again for its owners as room frees
(``source``: what it needs for that; mountd/store/space.py says why the newest).

Protections are counted as they start and end, in files and bytes, per reason
(:meth:`Holds.snapshot`): what was fetched ahead, what of it was read, what waits unread and
what ended unread, the figures ``quiverfs stats`` prints as "fetched ahead".
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Iterable, Iterator
from typing import NamedTuple

import trio

#: Seconds an answered file is kept from eviction (its client opens it within milliseconds;
#: this covers a machine so loaded that the client's next step waits that long).
HOLD_SECONDS = 0.5
#: Share of the cache that holds may keep at most: past it the oldest holds end early, so
#: fills can always make room and a small cache under a storm of misses is not throttled to
#: one cache's worth of fills per HOLD_SECONDS.
HOLD_SHARE = 0.5
#: Seconds a file fetched ahead stays protected when nobody reads it and its owner does not
#: release it (``--protect-seconds``): far above a sampler's look-ahead (a few seconds of
#: mini-batches), short enough that a dead job's prefetches free their share soon.
PROTECT_SECONDS = 30.0
#: Share of the cache that protections may take (``--protect-share``): the rest stays for
#: files read on demand and for what the policy keeps.
PROTECT_SHARE = 0.5

#: Share of the room pins leave that protections may reach with the files a mount's bounded
#: sweep fetches ahead (``prefetch`` with ``renew``; docs/mount.md "The sweep"), when that is
#: more than ``--protect-share``. A shuffled reader of a dataset larger than the cache reads
#: each of them this epoch, and finds a file there with chance about B/N (1 + ln N/B) for B
#: kept of N: at a 20% cache, 0.31 of its reads with 45% of the cache, 0.45 with 80%
#: (``peers.py`` (b), plain ``ImageFolder``: 174-177 against 200 images/s). Claims keep
#: their ``--protect-share``: the shim's balance with its chunks' pins is not this one's.
SWEEP_SHARE = 0.8

#: Why protections ended, the keys of :attr:`Holds.ended`.
ENDINGS = ("read", "released", "timeout", "demand", "removed")


class _Protection:
    __slots__ = ("deadline", "kept", "owners", "size", "source")

    def __init__(self, deadline: float, size: int, kept: bool = False) -> None:
        self.deadline = deadline
        self.size = size
        #: a cached file kept for the job it was handed to (a claim's hit), not fetched ahead
        self.kept = kept
        self.owners: set[Hashable] = set()
        #: What the cache needs to fetch the file again (opaque here), or None.
        self.source: object = None


class _Tally:
    """One kind of protection counted: files and bytes protected now, protections started,
    and ended by reason (:data:`ENDINGS`), in files and in bytes. ``started == sum(ended) +
    protected now`` (files and bytes alike), so what was protected and never read is
    ``started`` less ``ended["read"]`` and what is protected now."""

    __slots__ = ("bytes", "ended", "ended_bytes", "files", "started", "started_bytes")

    def __init__(self) -> None:
        self.files = self.bytes = self.started = self.started_bytes = 0
        self.ended = dict.fromkeys(ENDINGS, 0)
        self.ended_bytes = dict.fromkeys(ENDINGS, 0)

    def start(self, size: int) -> None:
        self.files += 1
        self.bytes += size
        self.started += 1
        self.started_bytes += size

    def end(self, reason: str, size: int) -> None:
        self.files -= 1
        self.bytes -= size
        self.ended[reason] += 1
        self.ended_bytes[reason] += size

    def snapshot(self) -> dict:
        return {"files": self.files, "bytes": self.bytes,
                "started": self.started, "started_bytes": self.started_bytes,
                "ended": dict(self.ended), "ended_bytes": dict(self.ended_bytes)}


class Displaced(NamedTuple):
    """A protection an on-demand miss ended (:meth:`Holds.displace`): what the cache needs
    to fetch the file again for its owners."""

    hash: bytes
    size: int
    owners: frozenset[Hashable]
    source: object


class Holds:
    """Answer holds and protections (see the module docstring); trio time throughout.

    Insertion order is expiry order for both kinds: every hold lasts :attr:`seconds` and every
    protection :attr:`protect_seconds`, and a renewed one moves to the end."""

    def __init__(self, max_bytes: int, seconds: float = HOLD_SECONDS, *,
                 protect_bytes: int | None = None,
                 protect_seconds: float = PROTECT_SECONDS) -> None:
        self.seconds = seconds
        self.max_bytes = max_bytes
        #: hash -> (trio time its hold ends, bytes), oldest first
        self._held: dict[bytes, tuple[float, int]] = {}
        self._bytes = 0
        self.protect_seconds = protect_seconds
        self.protect_bytes = max_bytes if protect_bytes is None else protect_bytes
        #: the cap for a mount's bounded sweep (:data:`SWEEP_SHARE`): at least protect_bytes
        self.sweep_bytes = self.protect_bytes
        #: hash -> its protection, oldest first
        self._protected: dict[bytes, _Protection] = {}
        self._by_owner: dict[Hashable, set[bytes]] = {}
        #: (deadline, hash) of protections cut short (:meth:`shorten`), oldest first: they
        #: end before their place in ``_protected`` says, so :meth:`expire` looks here too
        self._shortened: deque[tuple[float, bytes]] = deque()
        self.protected_bytes = 0
        #: The protections of files fetched ahead, and apart those of cached files kept for
        #: their readers (``kept``: a claim's hits), which fetched nothing; both kinds count
        #: against :attr:`protect_bytes`.
        self._fetched = _Tally()
        self._kept = _Tally()

    # -- answer holds ---------------------------------------------------------------------------

    def hold(self, content_hash: bytes, size: int) -> None:
        """Keep ``content_hash`` (``size`` bytes) from eviction for the next :attr:`seconds`,
        ending the oldest holds early when more than :attr:`max_bytes` would be held."""
        self._drop(content_hash)
        self._held[content_hash] = (trio.current_time() + self.seconds, size)
        self._bytes += size
        while self._bytes > self.max_bytes and self._held:
            self._drop(next(iter(self._held)))

    def _drop(self, content_hash: bytes) -> None:
        held = self._held.pop(content_hash, None)
        if held is not None:
            self._bytes -= held[1]

    def __contains__(self, content_hash: object) -> bool:
        return self.deadline(content_hash) is not None  # type: ignore[arg-type]

    def count(self) -> int:
        """How many hashes are held now (``usage``'s ``held``)."""
        self.expire()
        return len(self._held)

    def expire(self) -> None:
        """Forget the holds and protections whose time is up."""
        now = trio.current_time()
        held = self._held
        while held:
            first = next(iter(held))
            if held[first][0] > now:
                break
            self._drop(first)
        protected = self._protected
        while protected:
            first = next(iter(protected))
            if protected[first].deadline > now:
                break
            self._end(first, "timeout")
        shortened = self._shortened
        while shortened and shortened[0][0] <= now:
            _, content_hash = shortened.popleft()
            protection = protected.get(content_hash)
            if protection is not None and protection.deadline <= now:  # else renewed since
                self._end(content_hash, "timeout")

    def deadline(self, content_hash: bytes | None) -> float | None:
        """When the hold of ``content_hash`` ends (trio time), None when it is not held."""
        held = self._held.get(content_hash) if content_hash is not None else None
        return held[0] if held is not None and held[0] > trio.current_time() else None

    # -- protections ----------------------------------------------------------------------------

    def fits(self, size: int, *, sweep: bool = False) -> bool:
        """Whether a new prefetch of ``size`` bytes may be protected now (the gate new
        prefetches wait on; ``sweep``: one of a mount's bounded sweep, up to
        :attr:`sweep_bytes`). Always true while nothing is protected, so one file larger
        than the share still makes progress."""
        self.expire()
        cap = self.sweep_cap if sweep else self.protect_bytes
        return self.protected_bytes == 0 or self.protected_bytes + size <= cap

    @property
    def sweep_cap(self) -> int:
        """Bytes protections may reach with a mount's bounded sweep's files."""
        return max(self.protect_bytes, self.sweep_bytes)

    def room(self) -> int:
        """Bytes protections may still take."""
        self.expire()
        return max(0, self.protect_bytes - self.protected_bytes)

    @property
    def ended(self) -> dict[str, int]:
        """Protections of files fetched ahead ended so far, by reason (:data:`ENDINGS`)."""
        return self._fetched.ended

    def protect(self, content_hash: bytes, size: int, owner: Hashable = None,
                source: object = None, *, kept: bool = False) -> None:
        """Protect ``content_hash`` (``size`` bytes) for ``owner`` (None: nobody in
        particular) for :attr:`protect_seconds` from now; ``source`` is what the cache
        needs to fetch it again should an on-demand miss take its room (:meth:`displace`);
        ``kept``: a cached file kept for its reader rather than one fetched ahead (counted
        apart; a protection keeps the kind it started with). Does not check
        :meth:`fits`: the caller decided (an overshoot is bounded by what one decision
        admits)."""
        protection = self._protected.pop(content_hash, None)
        if protection is None:
            protection = _Protection(0.0, size, kept)
            self.protected_bytes += size
            (self._kept if kept else self._fetched).start(size)
        protection.deadline = trio.current_time() + self.protect_seconds
        self._protected[content_hash] = protection
        if source is not None:
            protection.source = source
        if owner is not None:
            protection.owners.add(owner)
            self._by_owner.setdefault(owner, set()).add(content_hash)

    def protected(self, content_hash: bytes) -> bool:
        """Whether ``content_hash`` is protected now."""
        protection = self._protected.get(content_hash)
        return protection is not None and protection.deadline > trio.current_time()

    def shorten(self, hashes: Iterable[bytes], seconds: float) -> int:
        """Let the protections of ``hashes`` last at most ``seconds`` more (their chunk was
        evicted: a job reads what it was given within its DataLoader's window, and a read the
        kernel's page cache answered for another job never reaches us, so such a protection
        would otherwise hold its share until its pool closes). Returns how many were cut."""
        until = trio.current_time() + seconds
        cut = 0
        for content_hash in hashes:
            protection = self._protected.get(content_hash)
            if protection is not None and protection.deadline > until:
                protection.deadline = until
                self._shortened.append((until, content_hash))
                cut += 1
        return cut

    def owned(self, owner: Hashable) -> int:
        """How many files ``owner`` protects now (expired ones included until
        :meth:`expire` runs)."""
        return len(self._by_owner.get(owner, ()))

    def consumed(self, hashes: Iterable[bytes]) -> int:
        """These files were read: their protections end. Returns how many ended."""
        return self.forget(hashes, "read")

    def release(self, owner: Hashable) -> int:
        """``owner`` is gone (a job's epoch pool closed): it no longer protects anything;
        protections left without owners end. Returns how many ended."""
        hashes = self._by_owner.pop(owner, ())
        ended = 0
        for content_hash in hashes:
            protection = self._protected.get(content_hash)
            if protection is None:
                continue
            protection.owners.discard(owner)
            if not protection.owners:
                self._end(content_hash, "released")
                ended += 1
        return ended

    def forget(self, hashes: Iterable[bytes], reason: str = "removed") -> int:
        """End the protections of ``hashes`` (they left the store, their fill failed, or an
        on-demand miss needs their room: ``reason``). Returns how many ended."""
        if not self._protected:  # the usual case on the hit path: nothing to look up
            return 0
        ended = 0
        for content_hash in hashes:
            if content_hash in self._protected:
                self._end(content_hash, reason)
                ended += 1
        return ended

    def newest_protected(self) -> Iterator[tuple[bytes, int]]:
        """Protected ``(hash, size)``, newest protection first (a snapshot): the files whose
        readers come last."""
        return iter([(h, p.size) for h, p in reversed(self._protected.items())])

    def displace(self, hashes: Iterable[bytes]) -> list[Displaced]:
        """End the protections of ``hashes`` for an on-demand miss that needs their room
        (``ended["demand"]``); returns what it takes to fetch each again."""
        displaced = []
        for content_hash in hashes:
            protection = self._protected.get(content_hash)
            if protection is None:
                continue
            displaced.append(Displaced(content_hash, protection.size,
                                       frozenset(protection.owners), protection.source))
            self._end(content_hash, "demand")
        return displaced

    def next_protection_deadline(self) -> float | None:
        """When the next protection ends by time (trio time), None when there is none."""
        first = next(iter(self._protected.values()), None)
        ends = [] if first is None else [first.deadline]
        if self._shortened:
            ends.append(self._shortened[0][0])
        return min(ends, default=None)

    def protected_count(self) -> int:
        """How many files are protected now."""
        self.expire()
        return len(self._protected)

    def _end(self, content_hash: bytes, reason: str) -> None:
        protection = self._protected.pop(content_hash)
        self.protected_bytes -= protection.size
        (self._kept if protection.kept else self._fetched).end(reason, protection.size)
        for owner in protection.owners:
            mine = self._by_owner.get(owner)
            if mine is not None:
                mine.discard(content_hash)
                if not mine:
                    del self._by_owner[owner]

    def snapshot(self) -> dict:
        """``usage``'s ``protection``: files and bytes fetched ahead and protected now, the
        budget, the protections started and why they ended (files, and bytes in
        ``*_bytes``); under ``kept`` the same for the cached files kept for their readers
        (both kinds count against ``cap_bytes``)."""
        self.expire()
        return {
            **self._fetched.snapshot(),
            "cap_bytes": self.protect_bytes, "sweep_cap_bytes": self.sweep_cap,
            "seconds": self.protect_seconds,
            "kept": self._kept.snapshot(),
        }
