"""Choosing a front end without mounting: the native front end's minimum kernel (a crafted
INIT on a socket stands in for /dev/fuse) and the pyfuse3 front end's missing-package line."""

from __future__ import annotations

import errno
import os
import socket
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from quiverfs.base.errors import UsageError
from quiverfs.cli.mount_cli import mount
from quiverfs.fuse import frontend_pyfuse3
from quiverfs.fuse.channel import FuseMountError, handshake
from quiverfs.protocol import fuse_wire

REPO = Path(__file__).resolve().parents[2]
UNIQUE = 1


def _init_request(major: int, minor: int, flags: int = fuse_wire.WANTED_FLAGS, flags2: int = 0) -> bytes:
    body = fuse_wire.INIT_IN.pack(major, minor, 128 * 1024, flags) + struct.pack("<I", flags2) + bytes(44)
    head = fuse_wire.IN_HEADER.pack(fuse_wire.HEADER_SIZE + len(body), fuse_wire.INIT, UNIQUE,
                                    0, 0, 0, 0, 0, 0)
    return head + body


def _handshake_with(request: bytes, passthrough: bool = False) -> tuple[tuple[int, int, bool] | Exception, bytes]:
    """Run :func:`handshake` against ``request``; its result (or error) and the reply."""
    kernel, ours = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with kernel, ours:
        kernel.send(request)
        try:
            result: tuple[int, int, bool] | Exception = handshake(ours.fileno(), passthrough)
        except FuseMountError as exc:
            result = exc
        return result, kernel.recv(4096)


def test_a_kernel_older_than_7_29_is_refused_with_a_pointer_to_pyfuse3() -> None:
    result, reply = _handshake_with(_init_request(7, fuse_wire.MIN_KERNEL_MINOR - 1))
    assert isinstance(result, FuseMountError)
    message = str(result)
    assert "\n" not in message and "--frontend pyfuse3" in message and "FUSE 7.28;" in message
    # The kernel is told no (EPROTO) rather than left waiting for its INIT.
    length, error, unique = fuse_wire.OUT_HEADER.unpack(reply)
    assert (length, error, unique) == (fuse_wire.OUT_HEADER.size, -errno.EPROTO, UNIQUE)


def test_another_major_is_refused_too() -> None:
    result, reply = _handshake_with(_init_request(8, 40))
    assert isinstance(result, FuseMountError) and "--frontend pyfuse3" in str(result)
    assert fuse_wire.OUT_HEADER.unpack(reply)[1] == -errno.EPROTO


@pytest.mark.parametrize("minor", [fuse_wire.MIN_KERNEL_MINOR, fuse_wire.KERNEL_MINOR, 44])
def test_a_kernel_at_or_above_the_minimum_is_answered(minor: int) -> None:
    result, reply = _handshake_with(_init_request(7, minor))
    assert result == (min(minor, fuse_wire.KERNEL_MINOR), fuse_wire.WANTED_FLAGS, False)
    length, error, unique = fuse_wire.OUT_HEADER.unpack_from(reply)
    assert error == 0 and unique == UNIQUE and length == len(reply)
    major, agreed = fuse_wire.INIT_OUT.unpack_from(reply, fuse_wire.OUT_HEADER.size)[:2]
    assert (major, agreed) == (7, min(minor, fuse_wire.KERNEL_MINOR))


def _init_reply_flags(reply: bytes) -> tuple[int, int, int]:
    """(flags, flags2, max_stack_depth) of an INIT reply."""
    fields = fuse_wire.INIT_OUT.unpack_from(reply, fuse_wire.OUT_HEADER.size)
    return fields[3], fields[10], fields[11]


def test_passthrough_is_asked_for_only_where_the_kernel_offers_it() -> None:
    offered = _init_request(7, 40, fuse_wire.WANTED_FLAGS | fuse_wire.INIT_EXT, fuse_wire.PASSTHROUGH_FLAGS2)
    result, reply = _handshake_with(offered, passthrough=True)
    assert result == (fuse_wire.KERNEL_MINOR, fuse_wire.WANTED_FLAGS, True)
    flags, flags2, depth = _init_reply_flags(reply)
    assert flags == fuse_wire.WANTED_FLAGS | fuse_wire.INIT_EXT
    assert (flags2, depth) == (fuse_wire.PASSTHROUGH_FLAGS2, 1)
    # Offered but not wanted (the default), or wanted and not offered: the INIT reply of before.
    for request, wanted in ((offered, False), (_init_request(7, 40, fuse_wire.WANTED_FLAGS | fuse_wire.INIT_EXT), True),
                            (_init_request(7, 40, fuse_wire.WANTED_FLAGS, fuse_wire.PASSTHROUGH_FLAGS2), True)):
        result, reply = _handshake_with(request, passthrough=wanted)
        assert result == (fuse_wire.KERNEL_MINOR, fuse_wire.WANTED_FLAGS, False)
        assert _init_reply_flags(reply) == (fuse_wire.WANTED_FLAGS, 0, 0)


def test_pyfuse3_missing_is_one_usage_line(monkeypatch, tmp_path) -> None:
    monkeypatch.setattr(frontend_pyfuse3, "pyfuse3", None)
    with pytest.raises(UsageError) as caught:
        mount(tmp_path / "d.qd", tmp_path, frontend="pyfuse3")
    assert str(caught.value) == frontend_pyfuse3.MISSING
    assert "pip install 'quiverfs[pyfuse3]'" in str(caught.value)


def test_pyfuse3_missing_from_the_command_line(tmp_path) -> None:
    # A fresh interpreter in which `import pyfuse3` fails, as where the extra is not installed.
    code = ("import sys; sys.modules['pyfuse3'] = None; from quiverfs.cli.main import main; "
            "sys.argv = ['quiverfs', 'mount', '--frontend', 'pyfuse3', sys.argv[1], sys.argv[2]]; main()")
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path / "d.qd"), str(tmp_path)],
                          capture_output=True, text=True, cwd=REPO, timeout=60,
                          env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert done.returncode == UsageError.exit_code
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "pip install 'quiverfs[pyfuse3]'" in lines[0], done.stderr
    assert "Traceback" not in done.stderr


def test_an_unknown_front_end_is_refused(tmp_path) -> None:
    with pytest.raises(UsageError, match="--frontend must be one of native, pyfuse3"):
        mount(tmp_path / "d.qd", tmp_path, frontend="fuse2")


def test_passthrough_with_pyfuse3_is_one_usage_line(tmp_path) -> None:
    with pytest.raises(UsageError) as caught:
        mount(tmp_path / "d.qd", tmp_path, frontend="pyfuse3", passthrough=True)
    assert str(caught.value) == "--passthrough needs the native front end (--frontend native)"
