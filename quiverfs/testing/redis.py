"""A real ``redis-server`` on loopback, for the cluster's tests and benchmarks.

:func:`run_redis` starts the Debian package's binary (``apt-get install redis-server``;
``scripts/setup.sh`` installs it) on a free ``127.0.0.1`` port, with no persistence
(``--save ''``, no append-only file) and its own directory, waits (with a deadline) until it
answers ``PING``, and always stops it on the way out. The handle can :meth:`~RedisServer.kill`
it (SIGKILL: Redis gone, as a crash) and :meth:`~RedisServer.start` it again on the same port,
empty, which is what a restarted Redis without persistence looks like to mountd::

    with run_redis(tmp_path) as server:
        url = server.url          # redis://127.0.0.1:PORT/0
        server.kill(); server.start()
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

from quiverfs.testing.emulators import EmulatorError, free_port

#: Seconds redis-server has to answer after it is started.
START_TIMEOUT = 15.0


def redis_binary() -> str | None:
    """Path of ``redis-server`` (PATH, then /usr/bin: Debian's package), or None."""
    return shutil.which("redis-server") or (
        "/usr/bin/redis-server" if Path("/usr/bin/redis-server").exists() else None)


class RedisServer:
    """One ``redis-server`` process on ``127.0.0.1:port`` (see the module docstring)."""

    def __init__(self, directory: Path, port: int | None = None) -> None:
        self.directory = Path(directory)
        self.port = port or free_port()
        self.process: subprocess.Popen | None = None
        self.log_path = self.directory / "redis.log"

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:PORT/0``."""
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        """Start it (again, empty) on its port; returns once it answers ``PING``."""
        binary = redis_binary()
        if binary is None:
            raise EmulatorError("redis-server not found: apt-get install redis-server "
                                "(scripts/setup.sh does)")
        self.directory.mkdir(parents=True, exist_ok=True)
        command = [binary, "--port", str(self.port), "--bind", "127.0.0.1",
                   "--save", "", "--appendonly", "no", "--dir", str(self.directory),
                   "--daemonize", "no", "--protected-mode", "yes"]
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + START_TIMEOUT
        while not self.ping():
            if self.process.poll() is not None:
                raise EmulatorError(f"redis-server exited with {self.process.returncode}; "
                                    f"see {self.log_path}")
            if time.monotonic() > deadline:
                self.stop()
                raise EmulatorError(f"redis-server did not answer within {START_TIMEOUT} s; "
                                    f"see {self.log_path}")
            time.sleep(0.02)

    def ping(self) -> bool:
        """Whether it answers ``PING`` now (a raw RESP exchange: no client library needed)."""
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as conn:
                conn.sendall(b"PING\r\n")
                return conn.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def kill(self) -> None:
        """SIGKILL it (as a crash) and wait for it to be gone."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)
        self.process = None

    def stop(self) -> None:
        """Terminate it (kill after 5 s)."""
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=5)
        self.process = None


@contextlib.contextmanager
def run_redis(directory: Path) -> Iterator[RedisServer]:
    """A started :class:`RedisServer` with its files under ``directory``; stopped on exit."""
    server = RedisServer(directory)
    try:
        server.start()
        yield server
    finally:
        server.stop()
