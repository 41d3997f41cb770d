"""Choosing a front end without mounting: the native front end's minimum kernel (a crafted
INIT on a socket stands in for /dev/fuse) and the pyfuse3 front end's missing-package line."""

from __future__ import annotations

import errno
import os
import socket
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


def _init_request(major: int, minor: int, flags: int = fuse_wire.WANTED_FLAGS) -> bytes:
    body = fuse_wire.INIT_IN.pack(major, minor, 128 * 1024, flags) + bytes(48)  # + flags2, unused
    head = fuse_wire.IN_HEADER.pack(fuse_wire.HEADER_SIZE + len(body), fuse_wire.INIT, UNIQUE,
                                    0, 0, 0, 0, 0, 0)
    return head + body


def _handshake_with(request: bytes) -> tuple[tuple[int, int] | Exception, bytes]:
    """Run :func:`handshake` against ``request``; its result (or error) and the reply."""
    kernel, ours = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with kernel, ours:
        kernel.send(request)
        try:
            result: tuple[int, int] | Exception = handshake(ours.fileno())
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
    assert result == (min(minor, fuse_wire.KERNEL_MINOR), fuse_wire.WANTED_FLAGS)
    length, error, unique = fuse_wire.OUT_HEADER.unpack_from(reply)
    assert error == 0 and unique == UNIQUE and length == len(reply)
    major, agreed = fuse_wire.INIT_OUT.unpack_from(reply, fuse_wire.OUT_HEADER.size)[:2]
    assert (major, agreed) == (7, min(minor, fuse_wire.KERNEL_MINOR))


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
