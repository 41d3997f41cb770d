"""Free ports for the servers tests and benchmarks start (quiverfs/testing/emulators.py).

The kernel may hand out a port again as soon as the socket that held it is closed: two
ports picked one after the other once came out the same, and nginx refused its config
("duplicate listen options"). ``free_ports`` keeps each socket bound until all are picked.
The real kernel re-picks a port only by chance, so a fake one that always re-picks the lowest
free port makes the difference certain."""

from __future__ import annotations

import socket

import pytest

from quiverfs.testing import emulators


class _LowestFirstKernel:
    """Hands out the lowest port no open socket holds."""

    def __init__(self) -> None:
        self.held: set[int] = set()

    def socket(self, *_args):
        kernel = self

        class Sock:
            port = 0

            def bind(self, address):
                assert address == ("127.0.0.1", 0)
                self.port = min(set(range(40000, 40100)) - kernel.held)
                kernel.held.add(self.port)

            def getsockname(self):
                return ("127.0.0.1", self.port)

            def close(self):
                kernel.held.discard(self.port)

            def __enter__(self):
                return self

            def __exit__(self, *_exc):
                self.close()

        return Sock()


def test_ports_picked_together_are_distinct_even_when_the_kernel_reuses_them(
        monkeypatch: pytest.MonkeyPatch):
    kernel = _LowestFirstKernel()
    monkeypatch.setattr(emulators.socket, "socket", kernel.socket)
    assert [emulators.free_port(), emulators.free_port()] == [40000, 40000]  # the old way
    assert emulators.free_ports(3) == [40000, 40001, 40002]
    assert kernel.held == set()  # every socket closed again


def test_free_ports_can_be_listened_on():
    ports = emulators.free_ports(4)
    assert len(set(ports)) == 4
    for port in ports:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", port))
            sock.listen()
