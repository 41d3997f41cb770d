"""quiverfs.mount.mountd_wait: what waits for an absent mountd, and for how long (trio's mock clock;
the real restart is in tests/mount/test_fs_mountd_down.py)."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from mountd.errors import CacheError, MountdUnavailable
from quiverfs.mount.mountd_wait import FIRST_RETRY, LONGEST_RETRY, MountdWait, PatientSessions


class Flaky:
    """Fails ``failures`` times with ``error``, then answers ``"ok"``; counts the tries."""

    def __init__(self, failures: int, error: Exception) -> None:
        self.failures, self.error, self.tries = failures, error, 0

    async def __call__(self) -> str:
        self.tries += 1
        if self.tries <= self.failures:
            raise self.error
        return "ok"


def run(fn):
    clock = trio.testing.MockClock(autojump_threshold=0)
    return trio.run(fn, clock=clock)


def test_an_absent_mountd_is_waited_for_with_growing_intervals_until_it_answers() -> None:
    wait, attempt = MountdWait(60), Flaky(8, MountdUnavailable("no socket"))

    async def main():
        started = trio.current_time()
        result = await wait.call(attempt, "a read")
        return result, trio.current_time() - started

    result, took = run(main)
    assert result == "ok" and attempt.tries == 9
    # 0.05, 0.1, 0.2, 0.4, 0.8, then 1 s each: the sum of the first eight intervals
    expected = sum(min(LONGEST_RETRY, FIRST_RETRY * 2**i) for i in range(8))
    assert took == pytest.approx(expected)
    assert (wait.outages, wait.gave_up) == (1, 0)


def test_the_wait_ends_with_the_last_failure_after_its_seconds() -> None:
    wait, attempt = MountdWait(3), Flaky(10**6, MountdUnavailable("refused"))

    async def main():
        started = trio.current_time()
        with pytest.raises(MountdUnavailable, match="refused"):
            await wait.call(attempt, "a read")
        return trio.current_time() - started

    assert run(main) == pytest.approx(3.0)
    assert wait.gave_up == 1 and attempt.tries > 3


def test_no_wait_fails_at_the_first_try_and_mountds_own_errors_are_never_retried() -> None:
    absent, refused = Flaky(1, MountdUnavailable("refused")), Flaky(1, CacheError("corrupt"))

    async def main():
        with pytest.raises(MountdUnavailable):
            await MountdWait(0).call(absent, "a read")
        with pytest.raises(CacheError):
            await MountdWait(60).call(refused, "a read")

    run(main)
    assert absent.tries == 1 and refused.tries == 1


def test_control_requests_wait_too() -> None:
    class Client:
        def __init__(self) -> None:
            self.calls: list[tuple] = []

        async def call(self, op, args=None):
            self.calls.append((op, args))
            if len(self.calls) < 3:
                raise MountdUnavailable("restarting")
            return {"op": op}

    client = Client()
    sessions = PatientSessions(client, MountdWait(60))
    assert run(lambda: sessions.call("claim", {"job": "j"})) == {"op": "claim"}
    assert client.calls == [("claim", {"job": "j"})] * 3


def test_a_negative_wait_is_refused() -> None:
    with pytest.raises(ValueError):
        MountdWait(-1)
