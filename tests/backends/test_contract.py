"""One contract every backend keeps, run against file://, moto (s3), Azurite (az) and
gcp-storage-emulator (gs) on loopback.

Transient faults come from :class:`~quiverfs.testing.faultproxy.FaultProxy` in front of the
emulator, so the real SDK parses a real 503 or connection reset; for ``file://`` a wrapped
blocking method raises ``ConnectionResetError`` / ``EIO``.
"""

from __future__ import annotations

import errno
from collections.abc import Callable

import pytest

from quiverfs.base.backends import Backend, RetryPolicy
from quiverfs.base.errors import NotFound, TemporaryFailure
from quiverfs.testing.faultproxy import FaultProxy

from .conftest import GIVE_UP_SOON, MANY, STANDARD_OBJECTS, OpenAt, Store

pytestmark = pytest.mark.backends

UNICODE_KEY = "dir with space/naïve ☃.jpg"
FAST_RETRY = RetryPolicy(deadline=30.0, initial_delay=0.01, max_delay=0.05)


async def _list(backend: Backend, prefix: str = "") -> list:
    return [info async for info in backend.list(prefix)]


# -- listing ---------------------------------------------------------------------------------


async def test_list_everything_under_root(backend: Backend) -> None:
    infos = await _list(backend)
    keys = [info.key for info in infos]
    assert keys == sorted(STANDARD_OBJECTS)  # nothing from outside the root, nothing missing
    assert {info.key: info.size for info in infos} == {
        key: len(data) for key, data in STANDARD_OBJECTS.items()
    }
    assert all(info.version for info in infos)


async def test_list_with_prefix(backend: Backend) -> None:
    assert [i.key for i in await _list(backend, "sub/")] == ["sub/b.txt", "sub/deeper/c.bin"]
    # A prefix is a string prefix, not a directory: "sub" also matches "subway.txt".
    assert [i.key for i in await _list(backend, "sub")] == [
        "sub/b.txt",
        "sub/deeper/c.bin",
        "subway.txt",
    ]
    assert [i.key for i in await _list(backend, "dir with space/")] == [UNICODE_KEY]
    assert await _list(backend, "no-such-prefix/") == []


async def test_list_more_than_one_page(backend: Backend, store: Store) -> None:
    infos = await _list(backend, "many/")
    keys = [info.key for info in infos]
    assert len(keys) == MANY
    assert keys == [f"many/{i:04d}" for i in range(MANY)]
    assert sum(info.size for info in infos) == sum(len(str(i)) for i in range(MANY))
    if store.paginates:
        assert backend.counters.requests["LIST"] >= 2
    else:
        # gcp-storage-emulator ignores maxResults/pageToken and answers in one page.
        assert backend.counters.requests["LIST"] == 1


# -- stat and reads ----------------------------------------------------------------------------


async def test_stat_matches_listing(backend: Backend) -> None:
    listed = {info.key: info for info in await _list(backend, "sub/")}
    info = await backend.stat("sub/deeper/c.bin")
    assert info.key == "sub/deeper/c.bin"
    assert info.size == 3000
    assert info.version == listed["sub/deeper/c.bin"].version
    assert backend.counters.requests["HEAD"] == 1


async def test_read_whole_objects(backend: Backend) -> None:
    for key in ("a.bin", "sub/b.txt", "sub/deeper/c.bin"):
        assert await backend.read(key) == STANDARD_OBJECTS[key]
    assert backend.counters.bytes_read == 1000 + 12 + 3000


@pytest.mark.parametrize(
    ("offset", "length", "expected"),
    [
        pytest.param(0, 1, slice(0, 1), id="first-byte"),
        pytest.param(999, 1, slice(999, 1000), id="last-byte"),
        pytest.param(100, 250, slice(100, 350), id="middle"),
        pytest.param(990, 100, slice(990, 1000), id="crossing-end-is-short"),
        pytest.param(0, 5000, slice(0, 1000), id="longer-than-object"),
        pytest.param(1000, 5, slice(0, 0), id="offset-at-size"),
        pytest.param(1010, 5, slice(0, 0), id="offset-past-size"),
        pytest.param(10, 0, slice(0, 0), id="length-zero"),
    ],
)
async def test_ranged_read_edges(
    backend: Backend, offset: int, length: int, expected: slice
) -> None:
    data = STANDARD_OBJECTS["a.bin"]
    assert len(data) == 1000
    assert await backend.read_range("a.bin", offset, length) == data[expected]
    if length == 0:
        assert backend.counters.requests["GET"] == 0  # no request for an empty range


async def test_empty_object(backend: Backend) -> None:
    info = await backend.stat("empty")
    assert info.size == 0
    assert await backend.read("empty") == b""
    assert await backend.read_range("empty", 0, 10) == b""


async def test_key_with_space_and_unicode(backend: Backend) -> None:
    info = await backend.stat(UNICODE_KEY)
    assert info.size == len(STANDARD_OBJECTS[UNICODE_KEY])
    assert await backend.read(UNICODE_KEY) == STANDARD_OBJECTS[UNICODE_KEY]
    assert await backend.read_range(UNICODE_KEY, 0, 4) == b"\xff\xd8\xff\xe0"


# -- what is not there -----------------------------------------------------------------------


async def test_missing_key_is_not_found(backend: Backend) -> None:
    with pytest.raises(NotFound) as stat_error:
        await backend.stat("no/such/key")
    assert stat_error.value.__cause__ is not None
    with pytest.raises(NotFound):
        await backend.read_range("no/such/key", 0, 10)
    with pytest.raises(NotFound):
        await backend.read("no/such/key")
    assert backend.counters.retries == 0  # NotFound is never retried


async def test_missing_bucket_is_not_found(store: Store, open_at: OpenAt) -> None:
    backend = open_at(store.missing_url, store.options(), store.settings)
    with pytest.raises(NotFound):
        await _list(backend)
    with pytest.raises(NotFound):
        await backend.stat("a.bin")
    with pytest.raises(NotFound):
        await backend.read_range("a.bin", 0, 1)
    assert backend.counters.retries == 0


# -- transient faults --------------------------------------------------------------------------


def _faulty_file_method(backend: Backend, name: str, failures: int | None) -> Callable[[], int]:
    """Make ``backend.<name>`` raise transient OS errors ``failures`` times (None: always).

    Returns a function giving how many faults were raised.
    """
    real = getattr(backend, name)
    raised = 0
    errors = [
        ConnectionResetError(errno.ECONNRESET, "connection reset (injected)"),
        OSError(errno.EIO, "I/O error (injected)"),
    ]

    def wrapper(*args: object) -> object:
        nonlocal raised
        if failures is None or raised < failures:
            raised += 1
            raise errors[raised % 2]
        return real(*args)

    setattr(backend, name, wrapper)
    return lambda: raised


def _open_through_proxy(
    store: Store, open_at: OpenAt, proxy: FaultProxy | None, retry: RetryPolicy
) -> Backend:
    if proxy is None:
        return open_at(store.url, store.options(retry=retry), store.settings)
    assert store.emulator is not None
    settings = store.emulator.settings(proxy.endpoint)
    return open_at(store.url, store.options(retry=retry), settings)


@pytest.mark.parametrize("mode", ["503", "reset"])
async def test_transient_fault_is_retried(
    store: Store, open_at: OpenAt, proxy: FaultProxy | None, mode: str
) -> None:
    backend = _open_through_proxy(store, open_at, proxy, FAST_RETRY)
    # Warm the SDK's connection pool first, so the fault must hit a kept-alive connection.
    assert (await backend.stat("a.bin")).size == 1000
    if proxy is None:
        injected = _faulty_file_method(backend, "_read_range", 2)
    else:
        proxy.arm(mode, count=2)
        injected = lambda: proxy.faults_injected  # noqa: E731
    data = await backend.read_range("sub/deeper/c.bin", 100, 2000)
    assert data == STANDARD_OBJECTS["sub/deeper/c.bin"][100:2100]
    assert injected() == 2
    assert backend.counters.retries == 2
    assert backend.counters.failures["TemporaryFailure"] == 2
    assert backend.counters.requests["GET"] == 3


async def test_transient_fault_in_listing_is_retried(
    store: Store, open_at: OpenAt, proxy: FaultProxy | None
) -> None:
    backend = _open_through_proxy(store, open_at, proxy, FAST_RETRY)
    if proxy is None:
        injected = _faulty_file_method(backend, "_list_page", 1)
    else:
        proxy.arm("503", count=1)
        injected = lambda: proxy.faults_injected  # noqa: E731
    keys = [info.key for info in await _list(backend, "many/")]
    assert keys == [f"many/{i:04d}" for i in range(MANY)]
    assert injected() == 1
    assert backend.counters.retries >= 1


@pytest.mark.parametrize("mode", ["503", "reset"])
async def test_fault_past_deadline_raises_temporary_failure(
    store: Store, open_at: OpenAt, proxy: FaultProxy | None, mode: str
) -> None:
    backend = _open_through_proxy(store, open_at, proxy, GIVE_UP_SOON)
    if proxy is None:
        injected = _faulty_file_method(backend, "_stat", None)
    else:
        proxy.arm(mode, count=None)
        injected = lambda: proxy.faults_injected  # noqa: E731
    with pytest.raises(TemporaryFailure) as failure:
        await backend.stat("a.bin")
    assert failure.value.__cause__ is not None
    assert not isinstance(failure.value.__cause__, TemporaryFailure)  # the SDK's own error
    assert backend.counters.retries >= 1
    assert injected() == backend.counters.retries + 1 == backend.counters.requests["HEAD"]
    if proxy is not None:
        proxy.disarm()
        assert (await backend.stat("a.bin")).size == 1000  # and the store is fine again
