"""The test harness itself: emulators always stop, the fault proxy relays and counts."""

from __future__ import annotations

import http.client

import pytest

from quiverfs.testing.emulators import MotoEmulator, run_moto
from quiverfs.testing.faultproxy import FaultProxy

pytestmark = pytest.mark.backends


def test_emulator_is_stopped_when_the_body_raises() -> None:
    with pytest.raises(RuntimeError, match="boom"), run_moto() as emulator:
        process = emulator.process
        assert emulator.is_alive()
        raise RuntimeError("boom")
    assert process.poll() is not None  # reaped, not left running


def test_fault_proxy_hits_the_next_request_on_a_kept_alive_connection(moto: MotoEmulator) -> None:
    with FaultProxy(moto.port, flavor="s3") as proxy:
        conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=10)
        conn.request("GET", "/")
        first = conn.getresponse()
        first.read()
        assert first.status == 200
        proxy.arm("503", count=1)
        conn.request("GET", "/")  # same connection: the proxy parsed the first request
        second = conn.getresponse()
        body = second.read()
        assert second.status == 503
        assert b"<Code>SlowDown</Code>" in body
        assert second.getheader("Connection") == "close"
        conn.close()
        assert (proxy.faults_injected, proxy.requests_seen, proxy.armed) == (1, 2, False)

        proxy.arm("reset", count=1)
        conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=10)
        conn.request("GET", "/")
        with pytest.raises(ConnectionResetError):
            conn.getresponse()
        conn.close()
        assert proxy.faults_injected == 2
