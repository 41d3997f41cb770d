"""BackingFiles (quiverfs/fuse/passthrough.py): one backing id per open inode, counted.

The kernel's ioctls are replaced by a recorder (registering a backing file needs a real FUSE
connection and CAP_SYS_ADMIN: tests/mount/test_passthrough.py does it for real); replies go
to a socket standing in for ``/dev/fuse``.
"""

from __future__ import annotations

import errno
import os
import socket

import pytest

from quiverfs.fuse import channel, passthrough
from quiverfs.fuse.passthrough import PASSTHROUGH_FH, BackingFiles
from quiverfs.protocol import fuse_wire as w


class Kernel:
    """Records registrations and drops; hands out ids 1, 2, ..."""

    def __init__(self) -> None:
        self.registered: list[int] = []  # ids, in order
        self.closed: list[int] = []
        self.refuse: OSError | None = None

    def backing_open(self, fuse_fd: int, fd: int) -> int:
        os.fstat(fd)  # a descriptor still open when registered
        if self.refuse is not None:
            raise self.refuse
        self.registered.append(len(self.registered) + 1)
        return self.registered[-1]

    def backing_close(self, fuse_fd: int, backing_id: int) -> None:
        self.closed.append(backing_id)


@pytest.fixture
def kernel(monkeypatch) -> Kernel:
    k = Kernel()
    monkeypatch.setattr(channel, "backing_open", k.backing_open)
    monkeypatch.setattr(channel, "backing_close", k.backing_close)
    return k


@pytest.fixture
def device():
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with ours, theirs:
        yield ours, theirs


def opener(tmp_path, calls: list[int]):
    def open_store() -> int:
        calls.append(1)
        path = tmp_path / "store-file"
        path.write_bytes(b"x")
        return os.open(path, os.O_RDONLY)
    return open_store


def reply_of(theirs: socket.socket) -> tuple[int, int, int, int]:
    """(error, fh, open_flags, backing_id) of the OPEN reply written."""
    data = theirs.recv(4096)
    _, error, unique = w.OUT_HEADER.unpack_from(data)
    assert unique == 7
    if error:
        return error, 0, 0, 0
    return (0, *w.OPEN_OUT.unpack_from(data, w.OUT_HEADER.size))


def test_one_registration_per_inode_while_open_and_dropped_with_its_last_release(kernel, device, tmp_path) -> None:
    ours, theirs = device
    backing, calls = BackingFiles(10), []
    for _ in range(3):
        assert backing.reply_open(ours.fileno(), 7, 5, opener(tmp_path, calls))
        assert reply_of(theirs) == (0, PASSTHROUGH_FH, w.FOPEN_PASSTHROUGH, 1)
    assert kernel.registered == [1] and calls == [1]  # the store file opened once
    assert backing.open_count(5) == 3
    backing.release(ours.fileno(), 5)
    backing.release(ours.fileno(), 5)
    assert kernel.closed == [] and backing.open_count(5) == 1
    backing.release(ours.fileno(), 5)
    assert kernel.closed == [1] and backing.open_count(5) == 0
    backing.release(ours.fileno(), 5)  # a RELEASE with nothing open: nothing to drop
    assert kernel.closed == [1]
    # The next open registers afresh (the store file may be another one by now).
    assert backing.reply_open(ours.fileno(), 7, 5, opener(tmp_path, calls))
    assert reply_of(theirs)[3] == 2 and calls == [1, 1]


def test_a_miss_registers_nothing_and_leaves_the_lock_free(kernel, device) -> None:
    ours, _ = device
    backing = BackingFiles(10)

    def missing() -> int:
        raise FileNotFoundError(errno.ENOENT, "not in the store")

    with pytest.raises(FileNotFoundError):
        backing.reply_open(ours.fileno(), 7, 3, missing)
    assert kernel.registered == [] and backing.open_count(3) == 0
    backing.release(ours.fileno(), 4)  # takes the lock: it was let go


def test_a_refused_backing_file_is_answered_as_a_direct_io_open(kernel, device, tmp_path, caplog) -> None:
    ours, theirs = device
    backing = BackingFiles(10)
    kernel.refuse = PermissionError(errno.EPERM, "Operation not permitted")
    assert not backing.reply_open(ours.fileno(), 7, 2, opener(tmp_path, []))
    assert reply_of(theirs) == (0, 0, w.FOPEN_DIRECT_IO, 0)
    assert backing.open_count(2) == 0
    assert "refused a passthrough backing file" in caplog.text


def test_an_open_whose_opener_is_gone_is_not_counted(kernel, device, tmp_path, monkeypatch) -> None:
    """The reply's write fails with ENOENT when the opener was interrupted: no RELEASE will
    come for that open, so its use of the backing file ends here."""
    ours, _ = device
    backing = BackingFiles(10)

    def gone(fd: int, data: bytes) -> int:
        raise FileNotFoundError(errno.ENOENT, "no such request")

    monkeypatch.setattr(passthrough.os, "write", gone)
    assert backing.reply_open(ours.fileno(), 7, 6, opener(tmp_path, []))
    assert backing.open_count(6) == 0 and kernel.closed == [1]
