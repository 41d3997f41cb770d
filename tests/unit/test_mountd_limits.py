"""mountd.store.limits: token buckets and the combined remote limits, on trio's virtual clock."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from mountd.store.limits import RemoteLimits, Slots, SourceSlots, TokenBucket, Turns
from quiverfs.testing.clock import FakeClock


def test_bucket_starts_full_then_charges_debt():
    clock = FakeClock()
    bucket = TokenBucket(100.0, burst=10.0, clock=clock)
    assert bucket.take(10) == 0.0  # the burst
    assert bucket.take(50) == pytest.approx(0.5)  # 50 tokens of debt at 100/s
    assert bucket.take(50) == pytest.approx(1.0)  # queued behind the first
    clock.now = 1.0
    assert bucket.take(0) == pytest.approx(0.0)  # debt paid


def test_bucket_caps_savings_at_burst():
    clock = FakeClock()
    bucket = TokenBucket(10.0, burst=5.0, clock=clock)
    bucket.take(5)
    clock.now = 100.0  # a long idle time saves only `burst`
    assert bucket.take(5) == 0.0
    assert bucket.take(10) == pytest.approx(1.0)


def test_request_larger_than_burst_still_passes():
    bucket = TokenBucket(1000.0, burst=1.0, clock=FakeClock())
    assert bucket.take(5000) == pytest.approx(4.999)


def test_rate_must_be_positive():
    with pytest.raises(ValueError):
        TokenBucket(0)


async def test_bandwidth_rate_on_virtual_clock(autojump_clock: trio.testing.MockClock):
    limits = RemoteLimits(bandwidth=1_000_000, requests=None, concurrency=64, burst_seconds=0.1)
    start = trio.current_time()
    sent = 0

    async def one() -> None:
        nonlocal sent
        async with limits.request(100_000):
            sent += 100_000

    async with trio.open_nursery() as nursery:
        for _ in range(100):
            nursery.start_soon(one)
    elapsed = trio.current_time() - start
    # 10 MB at 1 MB/s with a 0.1 s burst: 9.9 s.
    assert elapsed == pytest.approx(9.9, rel=0.01)
    assert sent == 10_000_000


async def test_request_rate_on_virtual_clock(autojump_clock: trio.testing.MockClock):
    limits = RemoteLimits(bandwidth=None, requests=50, concurrency=8, burst_seconds=0.1)
    stamps: list[float] = []

    async def one() -> None:
        async with limits.request(1):
            stamps.append(trio.current_time())

    async with trio.open_nursery() as nursery:
        for _ in range(251):
            nursery.start_soon(one)
    # 5 burst requests at t=0, then 50/s: the 251st starts at (251 - 5) / 50 s.
    assert max(stamps) == pytest.approx(246 / 50, rel=0.01)
    window = [t for t in stamps if 1.0 <= t < 3.0]
    assert len(window) == pytest.approx(100, abs=2)


@pytest.mark.parametrize("source", ["", "s3://only"])
async def test_concurrency_limit_holds(autojump_clock: trio.testing.MockClock, source: str):
    """A source alone gets exactly ``concurrency`` requests in flight (the spare slots are
    for other sources: SourceSlots)."""
    limits = RemoteLimits(bandwidth=None, requests=None, concurrency=3)
    active = peak = 0

    async def one() -> None:
        nonlocal active, peak
        async with limits.request(1, source):
            active += 1
            peak = max(peak, active)
            await trio.sleep(1)
            active -= 1

    async with trio.open_nursery() as nursery:
        for _ in range(10):
            nursery.start_soon(one)
    assert peak == 3


async def test_cancelled_waiter_returns_its_tokens(autojump_clock: trio.testing.MockClock):
    bucket = TokenBucket(10.0, burst=0.0)
    with trio.move_on_after(0.5):
        await bucket.acquire(100)  # would wait 10 s
    start = trio.current_time()
    await bucket.acquire(10)  # only its own second of debt, not the abandoned 10 s
    assert trio.current_time() - start == pytest.approx(1.0, abs=0.01)


async def test_latency_delays_every_request_and_requests_overlap(
    autojump_clock: trio.testing.MockClock,
):
    """``--remote-latency-ms``: each request waits the latency before its bytes, in its slot;
    eight at once (within the concurrency) all wait the same 20 ms side by side, not 8 × 20."""
    limits = RemoteLimits(None, None, concurrency=16, latency=0.02)
    served: list[float] = []

    async def one() -> None:
        async with limits.request(16384):
            served.append(trio.current_time())

    start = trio.current_time()
    async with trio.open_nursery() as nursery:
        for _ in range(8):
            nursery.start_soon(one)
    assert served == [pytest.approx(start + 0.02)] * 8
    assert limits.delayed == 8


async def test_latency_waits_inside_the_concurrency_slot(autojump_clock: trio.testing.MockClock):
    """A request waiting for its first byte holds its connection: with 2 slots, 4 requests of
    10 ms latency take two rounds."""
    limits = RemoteLimits(None, None, concurrency=2, latency=0.01)
    served: list[float] = []

    async def one() -> None:
        async with limits.request(1):
            served.append(trio.current_time())

    start = trio.current_time()
    async with trio.open_nursery() as nursery:
        for _ in range(4):
            nursery.start_soon(one)
    assert sorted(served) == [pytest.approx(start + t) for t in (0.01, 0.01, 0.02, 0.02)]


def test_no_latency_by_default():
    limits = RemoteLimits(None, None, concurrency=1)
    assert limits.latency == 0.0 and limits.delayed == 0


async def _through_turns(turns: Turns, tickets: list[int]) -> list[int]:
    """One task per ticket, started last first, each arriving, then leaving a scheduler
    round later; the tickets in the order they got through."""
    passed: list[int] = []

    async def one(ticket: int) -> None:
        await turns.arrive(ticket)
        passed.append(ticket)
        await trio.sleep(0)  # others run meanwhile: only leave() lets the next through
        turns.leave(ticket)

    async with trio.open_nursery() as nursery:
        for ticket in reversed(tickets):  # started last first
            nursery.start_soon(one, ticket)
    return passed


async def test_turns_let_tasks_through_in_ticket_order_whatever_order_they_run_in():
    turns = Turns()
    tickets = [turns.ticket() for _ in range(6)]
    assert await _through_turns(turns, tickets) == tickets


async def test_each_leave_wakes_only_the_next_ticket(monkeypatch):
    """A claim's fetches wait for their turn together: a leave must wake the one ticket that
    is first now, not every waiter (that cost each fill of a cold epoch through the shim a
    wake-up of every fetch behind it: quadratic in the claim)."""
    waits = 0
    real_event = trio.Event

    class CountingEvent:
        def __init__(self) -> None:
            self._event = real_event()

        def set(self) -> None:
            self._event.set()

        def is_set(self) -> bool:
            return self._event.is_set()

        async def wait(self) -> None:
            nonlocal waits
            waits += 1
            await self._event.wait()

    monkeypatch.setattr(trio, "Event", CountingEvent)
    turns = Turns()
    tickets = [turns.ticket() for _ in range(40)]
    assert await _through_turns(turns, tickets) == tickets
    assert waits == len(tickets) - 1  # each but the first waited once, and was woken once


async def test_a_ticket_that_never_arrives_holds_nobody_up():
    """A fill that joined another's, or waits elsewhere, never arrives: the later ones go."""
    turns = Turns()
    absent, later = turns.ticket(), turns.ticket()
    with trio.fail_after(1):
        await turns.arrive(later)
    turns.leave(later)
    turns.leave(later)  # again: nothing happens
    turns.leave(absent)  # never arrived: nothing happens


async def test_a_cancelled_arrival_leaves_its_place():
    turns = Turns()
    first, second = turns.ticket(), turns.ticket()
    await turns.arrive(first)  # at the front, holding it
    with trio.move_on_after(0.05) as waited:
        await turns.arrive(second)
    assert waited.cancelled_caught  # first holds the front: second waited, then gave up
    turns.leave(first)
    third = turns.ticket()
    with trio.fail_after(1):
        await turns.arrive(third)  # second left when cancelled: third goes at once


async def test_slots_go_to_waiters_in_the_order_they_came_and_a_cancelled_one_takes_none():
    slots = Slots(2)
    slots.take_free(slots.free())  # both taken
    assert (slots.held, slots.free()) == (2, 0)
    order: list[str] = []

    async def wait(name: str) -> None:
        await slots.take()
        order.append(name)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(wait, "a")
        await trio.testing.wait_all_tasks_blocked()
        with trio.CancelScope() as gave_up:
            nursery.start_soon(_cancel_soon, gave_up)
            await slots.take()  # second in line, cancelled while it waits: takes nothing
        assert gave_up.cancelled_caught and slots.held == 2
        for name in ("b", "c"):
            nursery.start_soon(wait, name)
            await trio.testing.wait_all_tasks_blocked()
        assert slots.free() == 0  # nothing free while anyone waits in line
        for expected in (["a"], ["a", "b"], ["a", "b", "c"]):
            slots.give(1)  # handed straight to the longest waiter
            await trio.testing.wait_all_tasks_blocked()
            assert order == expected and slots.held == 2
        slots.give(2)  # nobody waits: both free
        assert (slots.held, slots.free()) == (0, 2)
        slots.take_free(2)
    slots.give(2)
    assert (slots.held, slots.free()) == (0, 2)


async def _cancel_soon(scope: trio.CancelScope) -> None:
    await trio.testing.wait_all_tasks_blocked()
    scope.cancel()


async def test_take_more_takes_what_is_free_and_nothing_while_anyone_waits():
    slots = SourceSlots(4)  # 2 spare: 6 in all
    await slots.take("s3://a")
    assert slots.take_more("s3://a", 8) == 3  # the source's share: 4
    assert slots.take_more("s3://b", 1) == 0  # holds no slot of its own
    assert slots.held("s3://a") == 4 and slots.total.held == 4

    async def wait() -> None:
        await slots.take("s3://a")
        slots.release("s3://a")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(wait)
        await trio.testing.wait_all_tasks_blocked()
        slots.give_back("s3://a", 1)  # to the waiter, who runs and gives it back
        await trio.testing.wait_all_tasks_blocked()
    assert slots.held("s3://a") == 3 and slots.take_more("s3://a", 5) == 1
    slots.give_back("s3://a", 3)
    slots.release("s3://a")
    assert slots._sources == {} and slots.total.held == 0


async def test_one_source_holds_its_share_and_the_spare_slots_are_the_others():
    slots = SourceSlots(4)  # a quarter more for other sources: 2
    assert (slots.spare, slots.total.size) == (2, 6)
    held: list[str] = []
    done = trio.Event()

    async def hold(source: str) -> None:
        await slots.take(source)
        held.append(source)
        await done.wait()
        slots.release(source)

    async with trio.open_nursery() as nursery:
        for _ in range(6):
            nursery.start_soon(hold, "s3://a")
        await trio.testing.wait_all_tasks_blocked()
        assert held.count("s3://a") == 4 and slots.held("s3://a") == 4  # its share, no more
        for _ in range(3):
            nursery.start_soon(hold, "file:///b")
        await trio.testing.wait_all_tasks_blocked()
        assert held.count("file:///b") == 2  # the spare slots; the third waits for the total
        done.set()
    assert held.count("s3://a") == 6 and held.count("file:///b") == 3
    assert slots.held("s3://a") == 0 and slots._sources == {}  # idle sources are forgotten
    assert slots.total.held == 0


async def test_background_work_leaves_a_sources_last_slots_to_readers():
    """Background work (the prefetch queue) holds at most ``background`` of a source's slots,
    extra ones of a batch included; a reader's take then goes at once, and every limiter is
    forgotten once idle."""
    slots = SourceSlots(6)  # 2 spare, so 4 for background work
    assert slots.background == 4
    held: list[str] = []
    done = trio.Event()

    async def hold(kind: str) -> None:
        background = kind == "prefetch"
        await slots.take("s3://a", background)
        extra = slots.take_more("s3://a", 3, background)
        held.extend([kind] * (1 + extra))
        await done.wait()
        slots.give_back("s3://a", extra, background)
        slots.release("s3://a", background)

    async with trio.open_nursery() as nursery:
        for _ in range(3):
            nursery.start_soon(hold, "prefetch")
        await trio.testing.wait_all_tasks_blocked()
        assert held.count("prefetch") == 4  # the first took 3 more; the others wait
        nursery.start_soon(hold, "miss")
        await trio.testing.wait_all_tasks_blocked()
        assert held.count("miss") == 2  # at once, and one more of the free two
        done.set()
    assert held.count("prefetch") >= 4 + 2 and slots.held("s3://a") == 0  # the two waiters ran
    assert slots._sources == {} and slots._background == {}
    assert slots.total.held == 0


def test_one_slot_is_background_works_too():
    assert SourceSlots(1).background == 1  # a source of one slot is not starved of prefetches
    assert SourceSlots(16).background == 12 and SourceSlots(32).background == 24
