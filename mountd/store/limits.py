"""Remote limits shared by every fill: bytes/s, requests/s, requests in flight, and latency.

Each backend ``read_range`` goes through :meth:`RemoteLimits.request` (the length is known up
front, so the bandwidth tokens are taken before the request, not after the bytes arrive).

``latency`` is not a limit a real bucket needs but one benchmarks need: a loopback emulator
answers in a fraction of a millisecond, where a cloud bucket takes 10–50 ms to the first byte,
and that latency is what makes one request per small file slow (issue 14). Each request
waits it out while holding its concurrency slot, as a real request holds a connection;
concurrent requests wait side by side (it models latency, not a lock).

Slots are shared between **sources** (:class:`SourceSlots`): one bucket answering ``503`` for
a minute makes each of its fills retry until the backend's deadline (60 s), holding its fill
slot and its request slot all the while; with every slot one source's, the fills of every
other dataset waited behind them (a soak, 2026-11-29: a ``file://`` dataset's jobs read
nothing while an S3 bucket was down). So one source may hold at most the configured number
of slots, and a quarter more are there for the others.
"""

from __future__ import annotations

import heapq
from collections import deque

import trio


class TokenBucket:
    """``rate`` tokens per second, at most ``burst`` saved up; requests may go into debt.

    ``acquire(n)`` takes ``n`` tokens at once and sleeps until the balance is non-negative
    again, so a request larger than the burst still passes (after waiting ``n / rate``) and the
    long-run rate is exactly ``rate``. Callers queue in order: each later caller sees the debt of
    the earlier ones. Code between awaits is atomic in trio, so no lock is needed.

    Cancellation: a caller cancelled while it waits gives its tokens back.
    """

    def __init__(self, rate: float, burst: float | None = None, *, clock=trio.current_time) -> None:
        if rate <= 0:
            raise ValueError(f"rate must be positive, got {rate}")
        self.rate = float(rate)
        self.burst = float(burst if burst is not None else rate * 0.1)
        self._clock = clock
        self._tokens = self.burst
        self._stamp: float | None = None

    def _refill(self) -> None:
        now = self._clock()
        if self._stamp is not None:
            self._tokens = min(self.burst, self._tokens + (now - self._stamp) * self.rate)
        self._stamp = now

    def take(self, n: float) -> float:
        """Take ``n`` tokens now; return the seconds to wait before using them (0 if none)."""
        self._refill()
        self._tokens -= n
        return 0.0 if self._tokens >= 0 else -self._tokens / self.rate

    async def acquire(self, n: float) -> None:
        """Take ``n`` tokens and wait until they are paid for."""
        if n <= 0:
            return
        wait = self.take(n)
        if wait <= 0:
            return
        try:
            await trio.sleep(wait)
        except trio.Cancelled:
            self._tokens += n
            raise


class Turns:
    """Lets fills started together take their fill slots (and so the remote limits, which
    they reach straight from the slot) in the order they were asked for, not the order trio
    happens to run their tasks in (trio runs a batch of new tasks in either order, on
    purpose). A claim's misses are read in claim order: with the bucket's bandwidth capped,
    the first mini-batch's files must be fetched first, or the job waits for the whole claim
    (DELI's 50/50 setting waited twice as long as a plain loader).

    Each fill gets a :meth:`ticket` when it is asked for; when it wants its slot it arrives
    (:meth:`arrive`), lets the other tasks of its batch arrive too (one trip through the
    scheduler), and goes once it has the lowest ticket of those waiting; it leaves
    (:meth:`leave`) as soon as it holds its slot (or gives up). Only fills waiting for a slot
    wait for each other: one that joined another's fill never arrives, and one that then
    waits for room in the cache has left already, so it holds nobody up (a claim's fill
    waiting for room that only the job's next reads free must not stop the fetches of those
    reads: the first version, which kept the order until the limits, hung a chunked job)."""

    def __init__(self) -> None:
        self._issued = 0
        #: A heap of the tickets at the limits; a ticket that left stays in it until it
        #: reaches the top (:meth:`_first`), so leaving costs no re-heapify.
        self._heap: list[int] = []
        self._waiting: set[int] = set()  # the tickets at the limits that have not left
        #: The tickets that found another first, each with the event that wakes it.
        self._wakers: dict[int, trio.Event] = {}

    def ticket(self) -> int:
        """The next ticket, in the order of the calls."""
        self._issued += 1
        return self._issued - 1

    async def arrive(self, ticket: int) -> None:
        """Wait at the limits until ``ticket`` is the lowest of the tickets waiting there."""
        heapq.heappush(self._heap, ticket)
        self._waiting.add(ticket)
        try:
            await trio.lowlevel.checkpoint()  # the rest of this batch of tasks arrives
            while self._first() != ticket:
                woken = self._wakers[ticket] = trio.Event()
                await woken.wait()
        except BaseException:
            self.leave(ticket)
            raise

    def leave(self, ticket: int) -> None:
        """``ticket`` holds its limits, or gave up; the next may go. Safe to call again.

        Only the ticket that is first now is woken: waking every waiter on every leave
        (one shared event, as before) made each fill of a claim's fetches wake all the
        fetches behind it, and a cold epoch through the shim spent ~0.9 ms of mountd's CPU
        a fill, a fifth of it here (docs/benchmark-history.md, issue 34)."""
        if ticket not in self._waiting:
            return
        self._waiting.discard(ticket)
        self._wakers.pop(ticket, None)
        first = self._first()
        if first is not None and first in self._wakers:
            self._wakers.pop(first).set()

    def _first(self) -> int | None:
        """The lowest ticket still waiting (None: none), dropping those that left."""
        heap = self._heap
        while heap and heap[0] not in self._waiting:
            heapq.heappop(heap)
        return heap[0] if heap else None


def spare_slots(per_source: int) -> int:
    """The slots :class:`SourceSlots` keeps for other sources beyond one's ``per_source``."""
    return max(2, per_source // 4)


class Slots:
    """``size`` interchangeable slots, taken one at a time by waiting tasks (in the order they
    came) or several at once without waiting (:meth:`take_free`), and given back by number.

    What :class:`trio.CapacityLimiter` does for one token per task, without its borrower
    bookkeeping: a fill takes a slot of its source, of every source and, for background work,
    of its share, plus one more of each for every file of its batch that runs at once; with
    a limiter that was a ``set`` insertion, a parking-lot check and on release a wake-up
    pass per slot, a fifth of mountd's main process's CPU per cold fill (issue 34, measured
    with cProfile on 2026-12-02). Code between awaits is atomic in trio: no lock."""

    __slots__ = ("size", "held", "_waiting")

    def __init__(self, size: int) -> None:
        self.size = size
        #: slots taken and not given back
        self.held = 0
        #: tasks waiting for a slot, first come first served
        self._waiting: deque[trio.lowlevel.Task] = deque()

    def free(self) -> int:
        """Slots a caller may take now without waiting: none while anyone waits in line."""
        return 0 if self._waiting else self.size - self.held

    def take_free(self, n: int) -> None:
        """Take ``n`` of the :meth:`free` slots (the caller checked that there are)."""
        self.held += n

    async def take(self) -> None:
        """One slot: at once (no trip through trio's scheduler) when one is free and nobody
        waits, else in line. A waiter cancelled before its turn takes nothing; once handed a
        slot it is no longer cancellable here, so a slot is never lost."""
        if not self._waiting and self.held < self.size:
            self.held += 1
            return
        task = trio.lowlevel.current_task()
        self._waiting.append(task)

        def abort(_: object) -> trio.lowlevel.Abort:
            self._waiting.remove(task)
            return trio.lowlevel.Abort.SUCCEEDED

        await trio.lowlevel.wait_task_rescheduled(abort)  # woken holding its slot (give)

    def give(self, n: int = 1) -> None:
        """Give back ``n`` slots, handing each to the longest waiter, if any."""
        self.held -= n
        waiting = self._waiting
        while waiting and self.held < self.size:
            self.held += 1
            trio.lowlevel.reschedule(waiting.popleft())


class SourceSlots:
    """``per_source`` slots for each source, and ``per_source + spare`` in all (``spare``
    default: a quarter of ``per_source``, at least 2): what one source's work can hold, when
    it hangs, leaves ``spare`` slots to every other (see the module docstring). A source
    alone gets exactly ``per_source``, as a single limiter of that size would give it.

    **Background work** (``background=True``: the prefetch queue's fills, that is read-ahead
    and the sweep) holds at most :attr:`background` of a source's slots, so the last
    ``spare`` of them are always free for a reader's miss. Why: the sweep keeps the prefetch
    queue full for a whole cold epoch, and with every slot a prefetch batch's, each miss
    waited in line behind them: a ResNet-50 cold epoch on 16 cores (2026-11-30) missed
    13% of its files at 32 ms a miss (p50) and ran at 0.67 of a local directory.

    A source's :class:`Slots` are dropped when nothing holds or waits for them."""

    def __init__(self, per_source: int, spare: int | None = None) -> None:
        if per_source < 1:
            raise ValueError(f"a source needs at least one slot, not {per_source}")
        self.per_source = per_source
        self.spare = spare_slots(per_source) if spare is None else spare
        #: the most slots of one source that background work holds (at least one)
        self.background = max(1, per_source - self.spare)
        self.total = Slots(per_source + self.spare)
        self._sources: dict[str, Slots] = {}
        self._background: dict[str, Slots] = {}

    async def take(self, source: str, background: bool = False) -> None:
        """A slot of ``source`` and one of the total, in that order (always: no two tasks
        can each hold what the other waits for); for ``background`` work one of the
        source's background share before them."""
        if background:
            await self._slots(self._background, source, self.background).take()
        try:
            await self._slots(self._sources, source, self.per_source).take()
            try:
                await self.total.take()
            except BaseException:
                self._give_back(self._sources, source, 1)
                raise
        except BaseException:
            if background:
                self._give_back(self._background, source, 1)
            raise

    def release(self, source: str, background: bool = False) -> None:
        self.total.give()
        self._give_back(self._sources, source, 1)
        if background:
            self._give_back(self._background, source, 1)

    @staticmethod
    def _slots(slots: dict[str, Slots], source: str, size: int) -> Slots:
        mine = slots.get(source)
        if mine is None:
            mine = slots[source] = Slots(size)
        return mine

    @staticmethod
    def _give_back(slots: dict[str, Slots], source: str, n: int) -> None:
        mine = slots[source]
        mine.give(n)
        if not mine.held:  # a give hands its slot to the next waiter: none held, none waiting
            del slots[source]

    def take_more(self, source: str, most: int, background: bool = False) -> int:
        """Up to ``most`` more slots of ``source`` (and of the total; for ``background``
        work, of its share too) that are free now, for a holder of one that runs several
        reads side by side (a batch of files); never waits, and takes none while anyone
        waits in line. Returns how many it took, for :meth:`give_back`."""
        mine = self._sources.get(source)
        share = self._background.get(source) if background else None
        if mine is None or (background and share is None) or most <= 0:
            return 0  # the caller holds no slot of it
        n = min(most, mine.free(), self.total.free())
        if share is not None:
            n = min(n, share.free())
        if n <= 0:
            return 0
        mine.take_free(n)
        self.total.take_free(n)
        if share is not None:
            share.take_free(n)
        return n

    def give_back(self, source: str, n: int, background: bool = False) -> None:
        """The ``n`` slots :meth:`take_more` took (the caller still holds its own)."""
        if n <= 0:
            return
        self.total.give(n)
        self._sources[source].give(n)
        if background:
            self._background[source].give(n)

    def slot(self, source: str) -> _Slot:
        """``async with slots.slot(source):`` :meth:`take`, then :meth:`release` at the end."""
        return _Slot(self, source)

    def held(self, source: str) -> int:
        """Slots ``source`` holds now."""
        mine = self._sources.get(source)
        return 0 if mine is None else mine.held


class _Slot:
    __slots__ = ("slots", "source")

    def __init__(self, slots: SourceSlots, source: str) -> None:
        self.slots, self.source = slots, source

    async def __aenter__(self) -> None:
        await self.slots.take(self.source)

    async def __aexit__(self, *exc_info: object) -> None:
        self.slots.release(self.source)


class Request:
    """One request under :class:`RemoteLimits` (:meth:`RemoteLimits.request`): a plain
    class, not a generator-based context manager, because every fill enters one."""

    __slots__ = ("background", "length", "limits", "source")

    def __init__(self, limits: RemoteLimits, length: int, source: str,
                 background: bool) -> None:
        self.limits = limits
        self.length = length
        self.source = source
        self.background = background

    async def __aenter__(self) -> None:
        limits = self.limits
        await limits.concurrency.take(self.source, self.background)
        try:
            if limits.paced:
                await limits.pace(self.length)
        except BaseException:
            limits.concurrency.release(self.source, self.background)
            raise

    async def __aexit__(self, *exc_info: object) -> None:
        self.limits.concurrency.release(self.source, self.background)


class RemoteLimits:
    """The limits every remote read is placed under; ``None`` (or a latency of 0) disables one."""

    def __init__(
        self,
        bandwidth: float | None,
        requests: float | None,
        concurrency: int,
        burst_seconds: float = 0.1,
        latency: float = 0.0,
    ) -> None:
        self.bandwidth = TokenBucket(bandwidth, bandwidth * burst_seconds) if bandwidth else None
        # At least one request of burst so a lone request never waits.
        self.requests = (
            TokenBucket(requests, max(1.0, requests * burst_seconds)) if requests else None
        )
        #: requests in flight: ``concurrency`` per source, a quarter more in all
        self.concurrency = SourceSlots(concurrency)
        #: Seconds added before each request's first byte (benchmarks; 0: none).
        self.latency = latency
        #: Requests that waited out ``latency`` (tests read it instead of a clock).
        self.delayed = 0

    def request(self, length: int, source: str = "", background: bool = False) -> Request:
        """``async with limits.request(length, source):`` one remote request to ``source`` (a
        backend's URL): hold a concurrency slot (:class:`SourceSlots`; ``background``: within
        the share background work may hold), then pay one request token and ``length`` byte
        tokens, then wait out the configured latency (:meth:`pace`).

        Tokens are taken while holding the slot so waiting requests do not bank tokens and
        then burst together when slots free up. The latency is waited in the slot too (a
        request in flight holds its connection while it waits for its first byte).
        """
        return Request(self, length, source, background)

    @property
    def paced(self) -> bool:
        """Whether a request pays anything beyond its slot (a rate, or a latency)."""
        return self.requests is not None or self.bandwidth is not None or self.latency > 0

    async def pace(self, length: int) -> None:
        """Pay one request token and ``length`` byte tokens, and wait out the latency: one
        more read of a request that holds its slot already (the next chunk of a streamed
        object, mountd/store/fillwork.py)."""
        if self.requests is not None:
            await self.requests.acquire(1)
        if self.bandwidth is not None:
            await self.bandwidth.acquire(length)
        if self.latency > 0:
            await trio.sleep(self.latency)
            self.delayed += 1
