"""The control channel without a kernel: name grammar, paging, exactly-once replay, hostile
names, errno mapping, and the blocking client over a simulated getxattr(2)."""

from __future__ import annotations

import errno
import json
import os
import random

import pytest
import trio

from mountd.errors import (
    InvalidRequest,
    MountdUnavailable,
    ProtocolError,
    SessionConflict,
    StaleEpoch,
    UnknownSession,
)
from quiverfs.base.errors import FsError
from quiverfs.client import control_client
from quiverfs.client.control_client import ControlClient
from quiverfs.filesystem.control_channel import REPLAY_SECONDS, ControlChannel
from quiverfs.protocol.control import (
    CONTROL_PREFIX,
    PAGE_BYTES,
    ControlRequestError,
    make_name,
    parse_name,
)


class FakeClient:
    """mountd's async client: records calls, answers from a table, raises on demand."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict]] = []
        self.raise_next: BaseException | None = None
        self.result: object = {"ok": True}
        self.gate: trio.Event | None = None

    async def call(self, op: str, args: dict) -> object:
        self.calls.append((op, dict(args)))
        if self.gate is not None:
            await self.gate.wait()
        if self.raise_next is not None:
            exc, self.raise_next = self.raise_next, None
            raise exc
        if op == "claim":
            return {"epoch": 0, "hits": list(range(args["n"])), "fetch": [], "chunk": 0,
                    "remaining": 100}
        return self.result


class FakeDigest:
    def __init__(self, paths: list[str]) -> None:
        self.paths = paths
        self.file_count = len(paths)

    def iter_canonical(self):
        for p in self.paths:
            yield p, 1, b"\0" * 32


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def channel(paths: list[str] | None = None, client: FakeClient | None = None, clock=None) -> ControlChannel:
    return ControlChannel(client if client is not None else FakeClient(), "ds1",
                          FakeDigest(paths or ["a.txt", "b/c.txt"]), clock=clock or Clock())


# -- grammar -------------------------------------------------------------------------------------


def test_parse_a_claim() -> None:
    nonce, op, args = parse_name(b"user.quiver.ctl.ab12_-Z.claim?job=j1&rank=3&n=64&epoch=2")
    assert (nonce, op, args) == (b"ab12_-Z", "claim", {"job": "j1", "rank": 3, "n": 64, "epoch": 2})


def test_make_name_round_trips_and_percent_encodes() -> None:
    name = make_name("open", "n1", job="my job/α&=", rank=0, world=4, epoch=None)
    assert name.isascii() and "epoch" not in name
    nonce, op, args = parse_name(name.encode())
    assert (nonce, op, args) == (b"n1", "open", {"job": "my job/α&=", "rank": 0, "world": 4})


def test_floats_are_parsed() -> None:
    assert parse_name(b"user.quiver.ctl.x.batch?job=j&rank=0&s=0.125")[2]["s"] == 0.125
    assert parse_name(b"user.quiver.ctl.x.batch?job=j&rank=0&s=1e-3")[2]["s"] == 0.001


def test_make_name_refuses_names_over_255_bytes() -> None:
    with pytest.raises(ValueError):
        make_name("open", "n", job="j" * 300)


BAD_NAMES = [
    b"user.quiver.ctl.claim",  # no nonce
    b"user.quiver.ctl..claim?job=j&rank=0&n=1",  # empty nonce
    b"user.quiver.ctl.n!.claim?job=j&rank=0&n=1",  # bad nonce character
    b"user.quiver.ctl." + b"n" * 65 + b".info",  # nonce too long
    b"user.quiver.ctl.n.rm_rf",  # unknown op
    b"user.quiver.ctl.n.claim?job=j&rank=0",  # missing n
    b"user.quiver.ctl.n.claim?job=j&rank=0&n=1&n=2",  # repeated
    b"user.quiver.ctl.n.claim?job=j&rank=0&n=1&x=1",  # unknown argument
    b"user.quiver.ctl.n.claim?job=j&rank=-1&n=1",  # negative
    b"user.quiver.ctl.n.claim?job=j&rank=0&n=1.5",  # not an integer
    b"user.quiver.ctl.n.claim?job=j&rank=0&n=" + b"9" * 21,  # too many digits
    b"user.quiver.ctl.n.claim?job=&rank=0&n=1",  # empty job
    b"user.quiver.ctl.n.claim?job=%00&rank=0&n=1",  # unprintable job
    b"user.quiver.ctl.n.claim?job=%ZZ&rank=0&n=1",  # bad escape
    b"user.quiver.ctl.n.claim?job=j&rank=0&&n=1",  # empty part
    b"user.quiver.ctl.n.batch?job=j&rank=0&s=nan",  # not finite
    b"user.quiver.ctl.n.batch?job=j&rank=0&s=inf",
    b"user.quiver.ctl.n.open?job=\xff",  # not ASCII
    b"user.quiver.ctl.n.info?" + b"a" * 250,  # over 255 bytes
]


@pytest.mark.parametrize("name", BAD_NAMES)
def test_malformed_names_are_einval(name: bytes) -> None:
    with pytest.raises(ControlRequestError) as info:
        parse_name(name)
    assert info.value.errno == errno.EINVAL


@pytest.mark.parametrize("name", BAD_NAMES)
async def test_malformed_names_give_einval_through_getxattr(name: bytes) -> None:
    client = FakeClient()
    ch = channel(client=client)
    with pytest.raises(FsError) as info:
        await ch.getxattr(name)
    assert info.value.errno == errno.EINVAL
    assert client.calls == []


# -- exactly once ----------------------------------------------------------------------------------


async def test_the_same_name_twice_runs_once() -> None:
    client = FakeClient()
    ch = channel(client=client)
    name = make_name("claim", "abc", job="j", rank=0, n=5).encode()
    first = await ch.getxattr(name)
    second = await ch.getxattr(name)
    assert first == second
    assert json.loads(first)["hits"] == [0, 1, 2, 3, 4]
    assert [op for op, _ in client.calls] == ["claim"]
    assert client.calls[0][1] == {"job": "j", "rank": 0, "n": 5, "dataset": "ds1"}
    assert ch.executed == 1


async def test_a_repeat_while_running_waits_for_the_first() -> None:
    client = FakeClient()
    client.gate = trio.Event()
    ch = channel(client=client)
    name = make_name("claim", "abc", job="j", rank=0, n=3).encode()
    results: list[bytes] = []

    async def ask() -> None:
        results.append(await ch.getxattr(name))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(ask)
        nursery.start_soon(ask)
        await trio.testing.wait_all_tasks_blocked()
        client.gate.set()
    assert len(client.calls) == 1
    assert results[0] == results[1]


async def test_errors_are_replayed_too() -> None:
    client = FakeClient()
    ch = channel(client=client)
    client.raise_next = StaleEpoch("over")
    name = make_name("claim", "e1", job="j", rank=0, n=1, epoch=0).encode()
    for _ in range(2):
        with pytest.raises(FsError) as info:
            await ch.getxattr(name)
        assert info.value.errno == errno.ESTALE
    assert len(client.calls) == 1


async def test_replay_expires() -> None:
    client = FakeClient()
    clock = Clock()
    ch = channel(client=client, clock=clock)
    name = make_name("claim", "x", job="j", rank=0, n=1).encode()
    await ch.getxattr(name)
    clock.now += REPLAY_SECONDS + 1
    await ch.getxattr(name)
    assert len(client.calls) == 2


# -- errno mapping ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("exc", "code"),
    [
        (UnknownSession("no"), errno.ENOENT),
        (StaleEpoch("old"), errno.ESTALE),
        (SessionConflict("busy"), errno.EBUSY),
        (InvalidRequest("bad"), errno.EINVAL),
        (ProtocolError("bad args"), errno.EINVAL),
        (MountdUnavailable("gone"), errno.EIO),
        (RuntimeError("bug"), errno.EIO),
    ],
)
async def test_rpc_errors_become_errno(exc: BaseException, code: int) -> None:
    client = FakeClient()
    client.raise_next = exc
    ch = channel(client=client)
    assert await ch.handle(make_name("next", job="j", rank=0).encode()) == code


async def test_no_mountd_client_is_enotsup_but_local_ops_work() -> None:
    ch = ControlChannel(None, "ds1", FakeDigest(["a"]))
    assert await ch.handle(make_name("open", job="j").encode()) == errno.ENOTSUP
    info = json.loads(await ch.handle(make_name("info").encode()))
    assert info == {"dataset": "ds1", "files": 1, "page_bytes": PAGE_BYTES, "version": 1}


async def test_hostile_names_do_not_disturb_other_sessions() -> None:
    client = FakeClient()
    ch = channel(client=client)
    rng = random.Random(7)
    good = [make_name("claim", f"g{i}", job="j", rank=0, n=2).encode() for i in range(50)]
    answers = []
    for name in good:
        for _ in range(5):  # garbage between the good requests
            junk = CONTROL_PREFIX + bytes(rng.randrange(256) for _ in range(rng.randrange(1, 200)))
            assert await ch.handle(junk) == errno.EINVAL
        answers.append(json.loads(await ch.getxattr(name)))
    assert all(a["hits"] == [0, 1] for a in answers)
    assert [op for op, _ in client.calls] == ["claim"] * 50


# -- paging ----------------------------------------------------------------------------------------


async def test_large_responses_are_paged() -> None:
    client = FakeClient()
    ch = channel(client=client)
    name = make_name("claim", "big", job="j", rank=0, n=60000).encode()
    head = json.loads(await ch.getxattr(name))
    paged = head["paged"]
    assert paged["nonce"] == "big" and paged["pages"] > 1
    body = b"".join([
        await ch.getxattr(make_name("page", of="big", i=i).encode()) for i in range(paged["pages"])
    ])
    assert len(body) == paged["bytes"]
    assert json.loads(body)["hits"] == list(range(60000))
    sizes = [len(await ch.getxattr(make_name("page", of="big", i=i).encode()))
             for i in range(paged["pages"])]
    assert max(sizes) <= PAGE_BYTES
    assert await ch.handle(make_name("page", of="big", i=paged["pages"]).encode()) == errno.EINVAL
    assert await ch.handle(make_name("page", of="nope", i=0).encode()) == errno.ENOENT


async def test_the_path_table_is_paged_in_id_order() -> None:
    paths = [f"train/class_{i % 7}/img_{i:06d}_{'x' * (i % 40)}.jpg" for i in range(6000)]
    ch = channel(paths=paths)
    got: list[str] = []
    start = 0
    pages = 0
    while start is not None:
        value = await ch.getxattr(make_name("paths", start=start).encode())
        assert len(value) <= PAGE_BYTES
        page = json.loads(value)
        assert page["start"] == start and page["files"] == 6000
        got.extend(page["paths"])
        start = page["next"]
        pages += 1
    assert got == paths and pages > 1
    assert await ch.handle(make_name("paths", start=6001).encode()) == errno.EINVAL


# -- the blocking client over a simulated kernel ---------------------------------------------------


def test_control_client_exactly_once_through_cpythons_two_syscalls(monkeypatch) -> None:
    """CPython's os.getxattr asks with a 128-byte buffer, then XATTR_SIZE_MAX on ERANGE: the
    handler sees the same name twice and must execute it once."""
    client = FakeClient()
    paths = [f"dir/file-{i:05d}.bin" for i in range(5000)]
    ch = channel(paths=paths, client=client)
    syscalls: list[bytes] = []

    def fake_getxattr(root: str, name: str) -> bytes:
        raw = name.encode()
        for size in (128, 65536):
            syscalls.append(raw)
            outcome = trio.run(ch.handle, raw)
            if isinstance(outcome, int):
                raise OSError(outcome, os.strerror(outcome))
            if len(outcome) <= size:
                return outcome
        raise OSError(errno.E2BIG, "too big")

    monkeypatch.setattr(control_client.os, "getxattr", fake_getxattr)
    cc = ControlClient("/mnt")
    answer = cc.request("claim", job="j", rank=0, n=40)
    assert answer["hits"] == list(range(40))
    assert len([c for c in client.calls if c[0] == "claim"]) == 1
    assert len(syscalls) == 2 and syscalls[0] == syscalls[1]
    big = cc.request("claim", job="j", rank=0, n=30000)  # paged transparently
    assert big["hits"] == list(range(30000))
    assert cc.paths() == paths
    with pytest.raises(OSError) as info:
        cc.request("claim", job="j", rank=0, n=0, epoch=None, x=1)
    assert info.value.errno == errno.EINVAL


def test_open_carries_a_scope_of_id_ranges() -> None:
    from quiverfs.protocol.control import ControlRequestError, make_name, parse_name

    name = make_name("open", nonce="n1", job="j", scope="0-10,20-30")
    assert parse_name(name.encode())[2]["scope"] == [[0, 10], [20, 30]]
    for bad in ("10", "0-10,", "a-b", "0-10;20-30", ",".join(f"{i}-{i + 1}" for i in range(0, 200, 2))):
        with pytest.raises(ControlRequestError) as info:
            parse_name(f"user.quiver.ctl.n2.open?job=j&scope={bad}".encode())
        assert info.value.errno == errno.EINVAL
