"""mountd.store.fillchild.Helpers: the threads that run a batch's members in a fill process.

Their number is fixed from the start: a ThreadPoolExecutor started one more whenever none was
idle, and the 30-minute soak saw a fill process's threads creep up after every fault."""

from __future__ import annotations

import threading

import pytest

from mountd.store.fillchild import Helpers


def _named(prefix: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(prefix)]


def test_every_helper_starts_at_once_and_no_burst_adds_one():
    helpers = Helpers(4, "test-burst")
    assert len(_named("test-burst-")) == 4
    gate = threading.Event()
    running = threading.Semaphore(0)

    def wait() -> int:
        running.release()
        gate.wait(10)
        return 7

    futures = [helpers.submit(wait) for _ in range(12)]  # three times as many calls as threads
    for _ in range(4):
        assert running.acquire(timeout=10)
    assert not running.acquire(timeout=0.2)  # four at once: the rest wait in the queue
    assert len(_named("test-burst-")) == 4
    gate.set()
    assert [f.result(10) for f in futures] == [7] * 12
    assert len(_named("test-burst-")) == 4


def test_a_call_that_raises_gives_its_exception_to_the_future_and_the_thread_goes_on():
    helpers = Helpers(1, "test-raise")

    def boom() -> None:
        raise OSError(5, "bad member")

    failed = helpers.submit(boom)
    with pytest.raises(OSError, match="bad member"):
        failed.result(10)
    assert helpers.submit(lambda: "next").result(10) == "next"
    cancelled = helpers.submit(lambda: None)
    cancelled.cancel()  # may lose the race with the thread: either way nothing hangs
    assert helpers.submit(lambda: 3).result(10) == 3


def test_a_pool_needs_a_thread():
    with pytest.raises(ValueError):
        Helpers(0, "test-none")
