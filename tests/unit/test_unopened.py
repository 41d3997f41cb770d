"""Files given out of a chunk and not opened yet (mountd/coop/unopened.py), and how a
finished chunk's grace ends by them once the dataset's mounts report opens."""

from __future__ import annotations

from mountd.coop.sessions import SessionRegistry
from mountd.coop.unopened import Unopened
from quiverfs.testing.clock import FakeClock


def test_a_chunk_waits_for_as_many_opens_as_gives():
    chunk_of = {1: 0, 2: 0, 3: 1}.__getitem__
    waits = Unopened(chunk_of, 2)
    assert waits.all_opened(0) and waits.all_opened(1)
    waits.given(1)
    waits.given(1)  # a second job given the same file
    waits.given(2)
    waits.given(3)
    assert (waits.waiting(0), waits.waiting(1)) == (3, 1)
    assert waits.opened([1, 2]) == 2
    assert not waits.all_opened(0)  # the second job has not opened file 1 yet
    assert waits.opened([1, 1, 9]) == 1  # one wait was left for 1; 9 was never given
    assert waits.all_opened(0) and waits.waiting(0) == 0
    assert not waits.all_opened(1)


def test_waits_follow_their_files_to_another_chunk_and_end_with_an_eviction():
    where = {1: 0, 2: 0, 3: 1}
    waits = Unopened(where.__getitem__, 3)
    for i in (1, 2, 2, 3):
        waits.given(i)
    where[2] = 2  # the plan moved file 2 to chunk 2
    waits.moved({(0, 2): [2]})
    assert [waits.waiting(c) for c in range(3)] == [1, 1, 2]
    waits.forget([1, 3, 7])  # chunks 0 and 1 evicted; 7 never given
    assert [waits.waiting(c) for c in range(3)] == [0, 0, 2]
    assert waits.opened([1, 3]) == 0  # nobody waits for them any more
    assert waits.opened([2, 2]) == 2 and waits.all_opened(2)


def chunked_registry(reporting: list[bool]) -> SessionRegistry:
    """A chunked dataset "ds" whose mounts report opens while ``reporting[0]``."""
    registry = SessionRegistry(clock=FakeClock(), reports_opens=lambda name: reporting[0])
    assert registry.add_dataset("ds", [100] * 200, budget=200 * 100 // 4,
                                fraction=0.1).value == "chunked"
    return registry


def finish_a_chunk(registry: SessionRegistry, job: str = "job"):
    """Claims of one single-rank job until it finishes a chunk: (the chunk, the finisher's
    ``drained`` test, the ids given)."""
    manager = registry.dataset("ds").manager
    finished = []
    real = manager.finished

    def spy(holder, chunk, now, drained=None):
        finished.append((chunk, drained))
        real(holder, chunk, now, drained)

    manager.finished = spy
    registry.open_session("ds", job)
    given = []
    while not finished:
        given.extend(registry.claim("ds", job, 0, 4, batch=2).ids)
    manager.finished = real
    chunk, drained = finished[0]
    return chunk, drained, given


def test_with_opens_reported_a_finished_chunk_is_read_past_once_its_given_files_are_opened():
    registry = chunked_registry([True])
    state = registry.dataset("ds")
    chunk, drained, given = finish_a_chunk(registry)
    of_chunk = [i for i in given if state.plan.chunk_of(i) == chunk]
    assert len(of_chunk) >= 2 and drained is not None
    assert not drained()
    state.opened(of_chunk[:-1])
    assert not drained()  # one given file of the chunk is still unopened
    state.opened([i for i in given if i not in of_chunk])
    assert not drained()  # opens of other chunks' files do not count for it
    assert state.opened(of_chunk[-1:]) == 1
    assert drained()


def test_where_no_opens_are_reported_the_window_decides_as_before():
    registry = chunked_registry([False])
    state = registry.dataset("ds")
    chunk, drained, given = finish_a_chunk(registry)
    pool = registry.pool("ds", "job", 0)
    state.opened(given)  # counted, but not trusted: the mounts are not known to report
    assert not drained()  # the test is the window's: a window more must be given
    mark = pool.given_by_rank[0] + pool.windows[0]
    while pool.given_by_rank[0] < mark:
        registry.claim("ds", "job", 0, 4, batch=2)
    assert drained()


def test_opens_reported_only_after_the_finish_still_end_the_grace():
    """A job's first chunk is given out before its mounts' first report of opens arrives:
    the opens must decide all the same (chosen at the finish, the window did, and a
    DataLoader held the first chunk for its whole grace)."""
    reporting = [False]
    registry = chunked_registry(reporting)
    state = registry.dataset("ds")
    chunk, drained, given = finish_a_chunk(registry)
    pool = registry.pool("ds", "job", 0)
    given_then = pool.given_by_rank[0]
    assert not drained()
    reporting[0] = True  # the first report comes in
    of_chunk = [i for i in given if state.plan.chunk_of(i) == chunk]
    state.opened(of_chunk[:-1])
    assert not drained()
    state.opened(of_chunk[-1:])
    assert drained() and pool.given_by_rank[0] == given_then  # no window more was given
    reporting[0] = False  # reports stop (60 s quiet): the window is the test again
    assert not drained()
