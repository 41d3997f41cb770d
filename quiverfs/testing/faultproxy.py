"""A small TCP proxy on loopback that injects transient faults in front of an emulator.

The contract tests put it between a backend and a bucket emulator to prove that retries work
through the real SDK's error parsing::

    with FaultProxy(emulator.port, flavor="s3") as proxy:
        backend = open_backend(url, settings=emulator.settings(proxy.endpoint))
        proxy.arm("503", count=2)        # the next two requests get HTTP 503 SlowDown
        data = await backend.read(key)   # retried by the base class, then succeeds
        assert proxy.faults_injected == 2

Modes:

``"503"``
    Answer the request with ``HTTP 503`` and ``Connection: close`` (body in the store's own
    error format when ``flavor`` is given: S3 ``SlowDown``, Azure ``ServerBusy``, GCS JSON).
``"reset"``
    Close the client's connection abruptly with a TCP RST (``SO_LINGER`` 0) after reading the
    request, as a load balancer dropping a connection would.

Keep-alive: the proxy is HTTP-request-aware. It reads each request head (and a
``Content-Length`` body) from the client before forwarding it, so an armed fault hits the *next
request*, also on a connection the SDK pool already holds; no fresh backend is needed after
arming. It relies on clients not pipelining (no HTTP SDK here does), so a new request on a
connection means the previous response has been relayed in full. A request with a chunked body
switches its connection to plain relaying (no more faults on that connection).
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
from collections.abc import Iterable
from typing import Literal

__all__ = ["ERROR_FLAVORS", "FaultProxy", "Mode"]

Mode = Literal["503", "reset"]

#: Per store: (content type, body, extra headers) of the 503 answer, so each SDK parses it as
#: the throttling error its real service sends.
ERROR_FLAVORS: dict[str, tuple[str, bytes, dict[str, str]]] = {
    "s3": (
        "application/xml",
        b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
        b"<Message>Please reduce your request rate.</Message></Error>",
        {},
    ),
    "az": (
        "application/xml",
        b'<?xml version="1.0" encoding="utf-8"?><Error><Code>ServerBusy</Code>'
        b"<Message>The server is busy (injected by quiverfs faultproxy).</Message></Error>",
        {"x-ms-error-code": "ServerBusy"},
    ),
    "gs": (
        "application/json",
        b'{"error": {"code": 503, "message": "Service unavailable (injected by quiverfs '
        b'faultproxy)", "errors": [{"reason": "backendError"}]}}',
        {},
    ),
    "": ("text/plain", b"service unavailable (injected by quiverfs faultproxy)\n", {}),
}

_MAX_HEAD = 64 * 1024


class FaultProxy:
    """A threaded TCP proxy from ``127.0.0.1:<port>`` to ``upstream_host:upstream_port``.

    Use as a context manager (or :meth:`start` / :meth:`stop`). ``faults_injected`` and
    ``requests_seen`` count what happened; both are safe to read from any thread.
    """

    def __init__(
        self, upstream_port: int, upstream_host: str = "127.0.0.1", *, flavor: str = ""
    ) -> None:
        if flavor not in ERROR_FLAVORS:
            raise ValueError(f"unknown flavor {flavor!r} (known: {sorted(ERROR_FLAVORS)})")
        self.upstream = (upstream_host, upstream_port)
        self.flavor = flavor
        self.faults_injected = 0
        self.requests_seen = 0
        self._lock = threading.Lock()
        self._mode: Mode | None = None
        self._remaining: int | None = 0  # None: every request until disarmed
        self._methods: frozenset[str] | None = None
        self._listener: socket.socket | None = None
        self._sockets: set[socket.socket] = set()
        self._threads: list[threading.Thread] = []
        self.port = 0

    # -- control -----------------------------------------------------------------------------

    @property
    def endpoint(self) -> str:
        """``http://127.0.0.1:PORT``: give this to the backend instead of the emulator's."""
        return f"http://127.0.0.1:{self.port}"

    def arm(self, mode: Mode, count: int | None = 1, methods: Iterable[str] | None = None) -> None:
        """Inject ``mode`` into the next ``count`` requests (``None``: all, until disarmed).

        ``methods`` (e.g. ``{"GET"}``) limits faults to requests with those HTTP methods.
        """
        if mode not in ("503", "reset"):
            raise ValueError(f"unknown fault mode {mode!r} (known: '503', 'reset')")
        with self._lock:
            self._mode = mode
            self._remaining = count
            self._methods = frozenset(m.upper() for m in methods) if methods else None

    def disarm(self) -> None:
        """Stop injecting faults; requests pass through again."""
        with self._lock:
            self._mode = None
            self._remaining = 0

    @property
    def armed(self) -> bool:
        """True while some fault is still to be injected."""
        with self._lock:
            return self._mode is not None and self._remaining != 0

    def start(self) -> FaultProxy:
        """Listen on a free loopback port and serve in background threads."""
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", 0))
        listener.listen(64)
        self._listener = listener
        self.port = listener.getsockname()[1]
        self._spawn(self._accept_loop, listener)
        return self

    def stop(self) -> None:
        """Close the listener and every open connection, and wait for the threads."""
        if self._listener is not None:
            with contextlib.suppress(OSError):
                self._listener.shutdown(socket.SHUT_RDWR)
            self._listener.close()
            self._listener = None
        with self._lock:
            sockets = list(self._sockets)
        for sock in sockets:
            _close(sock)
        with self._lock:
            threads = list(self._threads)
        for thread in threads:
            thread.join(timeout=5)

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    # -- serving -----------------------------------------------------------------------------

    def _spawn(self, target, *args) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True, name="faultproxy")
        with self._lock:  # connection threads spawn their pumps concurrently
            self._threads = [t for t in self._threads if t.is_alive()]
            self._threads.append(thread)
        thread.start()

    def _track(self, sock: socket.socket) -> socket.socket:
        with self._lock:
            self._sockets.add(sock)
        return sock

    def _forget(self, *socks: socket.socket | None) -> None:
        for sock in socks:
            if sock is None:
                continue
            with self._lock:
                self._sockets.discard(sock)
            _close(sock)

    def _accept_loop(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # listener closed by stop()
            self._spawn(self._serve, self._track(client))

    def _take_fault(self, method: str) -> Mode | None:
        """The fault to inject into this request, if any; counts it."""
        with self._lock:
            self.requests_seen += 1
            if self._mode is None or self._remaining == 0:
                return None
            if self._methods is not None and method not in self._methods:
                return None
            if self._remaining is not None:
                self._remaining -= 1
            self.faults_injected += 1
            return self._mode

    def _serve(self, client: socket.socket) -> None:
        upstream: socket.socket | None = None
        buffer = b""
        try:
            while True:
                head, buffer = _read_head(client, buffer)
                if head is None:
                    return  # client closed the connection
                method, length, chunked = _parse_head(head)
                body, buffer = _read_exactly(client, buffer, length)
                fault = None if chunked else self._take_fault(method)
                if fault == "503":
                    client.sendall(self._error_response(method))
                    with contextlib.suppress(OSError):
                        client.shutdown(socket.SHUT_WR)
                    return
                if fault == "reset":
                    # Linger 0 makes close() send RST instead of FIN; no shutdown() first.
                    client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    with self._lock:
                        self._sockets.discard(client)
                    client.close()
                    return
                if upstream is None:
                    upstream = self._track(socket.create_connection(self.upstream, timeout=30))
                    upstream.settimeout(None)
                    self._spawn(self._pump, upstream, client)
                upstream.sendall(head + body + buffer)
                buffer = b""
                if chunked:
                    # Relay the rest of this connection verbatim.
                    while data := client.recv(65536):
                        upstream.sendall(data)
                    return
        except OSError:
            return
        finally:
            self._forget(client, upstream)

    def _pump(self, upstream: socket.socket, client: socket.socket) -> None:
        """Relay the server's answers to the client until either side closes."""
        try:
            while data := upstream.recv(65536):
                client.sendall(data)
        except OSError:
            pass
        finally:
            # The server closed (HTTP/1.0 emulators do after each answer): the client must
            # see that too, or its next request would go to a dead upstream.
            self._forget(client, upstream)

    def _error_response(self, method: str) -> bytes:
        content_type, body, headers = ERROR_FLAVORS[self.flavor]
        lines = [
            "HTTP/1.1 503 Service Unavailable",
            f"Content-Type: {content_type}",
            f"Content-Length: {len(body)}",
            "Connection: close",
            "Retry-After: 0",
        ]
        lines += [f"{name}: {value}" for name, value in headers.items()]
        raw = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
        return raw if method == "HEAD" else raw + body


def _close(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(OSError):
        sock.close()


def _read_head(sock: socket.socket, buffer: bytes) -> tuple[bytes | None, bytes]:
    """One request head (through the blank line) and what follows it; ``None`` at EOF."""
    while b"\r\n\r\n" not in buffer:
        if len(buffer) > _MAX_HEAD:
            raise OSError("request head too large")
        data = sock.recv(65536)
        if not data:
            return None, b""
        buffer += data
    end = buffer.index(b"\r\n\r\n") + 4
    return buffer[:end], buffer[end:]


def _parse_head(head: bytes) -> tuple[str, int, bool]:
    """(method, Content-Length, chunked?) of a request head."""
    lines = head.decode("latin-1").split("\r\n")
    method = lines[0].split(" ", 1)[0].upper()
    length, chunked = 0, False
    for line in lines[1:]:
        name, _, value = line.partition(":")
        name = name.strip().lower()
        if name == "content-length":
            length = int(value.strip() or 0)
        elif name == "transfer-encoding" and "chunked" in value.lower():
            chunked = True
    return method, length, chunked


def _read_exactly(sock: socket.socket, buffer: bytes, length: int) -> tuple[bytes, bytes]:
    """``length`` body bytes (from ``buffer`` first, then the socket) and the leftover."""
    while len(buffer) < length:
        data = sock.recv(65536)
        if not data:
            raise OSError("client closed mid-body")
        buffer += data
    return buffer[:length], buffer[length:]
