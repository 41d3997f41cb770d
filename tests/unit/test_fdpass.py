"""Descriptors that come with mountd's answers (``open``), as the blocking client receives them:
matched to their answer by order, truncation and miscounts refused, nothing left open.

The server's end is a real unix socketpair played by the test (a real mountd's answers are
tested in tests/mountd/test_handoff.py).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from mountd.errors import ProtocolError
from mountd.rpc import protocol
from mountd.rpc.client import SyncClient
from quiverfs.testing.soak import fd_count

HASHES = [bytes([i]) * 32 for i in range(3)]



@pytest.fixture
def pair() -> Iterator[tuple[SyncClient, socket.socket]]:
    """A blocking client and the socket that plays mountd."""
    ours, theirs = socket.socketpair()
    client = SyncClient(ours, Path("/nonexistent/mountd.sock"))
    yield client, theirs
    client.close()
    theirs.close()


def files(tmp_path: Path, contents: list[bytes]) -> list[int]:
    """Descriptors of new files holding ``contents`` (the caller closes them)."""
    fds = []
    for i, data in enumerate(contents):
        path = tmp_path / f"f{i}"
        path.write_bytes(data)
        fds.append(os.open(path, os.O_RDONLY))
    return fds


def answer(sock: socket.socket, rid: int, result: dict, fds: list[int], announce: int | None = None) -> None:
    """Send one answer, with ``fds`` on its first byte (``announce``: another count to claim)."""
    frame = protocol.encode_frame(protocol.ok_response(rid, result, len(fds) if announce is None else announce))
    if fds:
        socket.send_fds(sock, [frame], fds)
    else:
        sock.sendall(frame)


def test_descriptors_go_to_the_answer_they_came_with(pair, tmp_path: Path) -> None:
    client, server = pair
    fds = files(tmp_path, [b"late", b"zero", b"two"])
    baseline = fd_count()
    # A late answer to an earlier request (with a descriptor), then the awaited one: its own
    # descriptors are the second and third, not the first.
    answer(server, 99, {"sizes": [4]}, fds[:1])
    answer(server, 1, {"sizes": [4, None, 3]}, fds[1:])
    for fd in fds:
        os.close(fd)
    opened = client.open(HASHES)  # its request (id 1) waits unread in the test's socket
    assert opened[1] is None
    assert [(os.pread(fd, 10, 0), size) for fd, size in (opened[0], opened[2])] == [(b"zero", 4), (b"two", 3)]
    for fd, _ in (opened[0], opened[2]):
        os.close(fd)
    assert fd_count() == baseline - 3  # the late answer's descriptor was closed too


def test_a_truncated_set_of_descriptors_is_a_protocol_error_and_ends_the_connection(pair, tmp_path) -> None:
    client, server = pair
    fds = files(tmp_path, [b"x"])
    many = [os.dup(fds[0]) for _ in range(protocol.MAX_OPEN + 1)]
    baseline = fd_count()
    answer(server, 1, {"sizes": [1] * len(many)}, many, announce=protocol.MAX_OPEN)
    for fd in [*many, *fds]:
        os.close(fd)
    with pytest.raises(ProtocolError, match="truncated"):
        client.open(HASHES[:1])
    assert fd_count() == baseline - len(many) - 2  # nothing kept, and the client's socket is closed


def test_an_answer_announcing_more_descriptors_than_came_is_refused(pair, tmp_path) -> None:
    client, server = pair
    fds = files(tmp_path, [b"a"])
    baseline = fd_count()
    answer(server, 1, {"sizes": [1, 1]}, fds, announce=2)
    os.close(fds[0])
    with pytest.raises(ProtocolError, match="announces 2 descriptors but 1"):
        client.open(HASHES[:2])
    assert fd_count() == baseline - 2


def test_sizes_that_do_not_match_the_descriptors_are_refused_and_closed(pair, tmp_path) -> None:
    client, server = pair
    fds = files(tmp_path, [b"a", b"b"])
    baseline = fd_count()
    answer(server, 1, {"sizes": [1, None]}, fds)  # two descriptors, one size
    for fd in fds:
        os.close(fd)
    with pytest.raises(ProtocolError, match="does not match"):
        client.open(HASHES[:2])
    assert fd_count() == baseline - 2


def test_a_call_that_expects_no_descriptors_closes_any_that_come(pair, tmp_path) -> None:
    client, server = pair
    fds = files(tmp_path, [b"a"])
    baseline = fd_count()
    answer(server, 1, {"counters": {}}, fds)
    os.close(fds[0])
    assert client.call("stats") == {"counters": {}}
    assert fd_count() == baseline - 1


@pytest.mark.parametrize("count", [-1, True, "2", protocol.MAX_OPEN + 1])
def test_response_fds_must_be_a_small_count(count) -> None:
    with pytest.raises(ProtocolError):
        protocol.response_fds({"id": 1, "ok": True, "fds": count})
    assert protocol.response_fds({"id": 1, "ok": True}) == 0
