"""Test and benchmark helpers: a real mountd in a subprocess, and a small file:// dataset.

``running_mountd(cache_dir)`` starts ``quiverfs mountd`` in the foreground as a child, polls
its socket with a deadline (failing at once, with the log, if it exits), and always stops it:
SIGTERM, wait, then SIGKILL. No fixed sleeps anywhere.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import blake3

from mountd.rpc.client import probe
from mountd.store import layout


@dataclass
class MountdProcess:
    """A mountd child process and where it lives."""

    proc: subprocess.Popen
    cache_dir: Path
    log_path: Path

    @property
    def socket_path(self) -> Path:
        return layout.socket_path(self.cache_dir)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout: float = 10.0) -> int:
        """SIGTERM, wait up to ``timeout``, then SIGKILL; the exit status."""
        return stop_process(self.proc, timeout)


def stop_process(proc: subprocess.Popen, timeout: float = 10.0) -> int:
    """Terminate ``proc`` gently, then by force; its exit status."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
    return proc.wait()


def log_tail(path: Path, lines: int = 15) -> str:
    """The last ``lines`` lines of a log file ("" when it cannot be read): for error messages
    about a child process that died."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def wait_until(predicate: Callable[[], object], timeout: float, what: str,
               alive: Callable[[], bool] | None = None) -> object:
    """Poll ``predicate`` with growing intervals until it is truthy; AssertionError on timeout."""
    deadline = time.monotonic() + timeout
    delay = 0.005
    while True:
        value = predicate()
        if value:
            return value
        if alive is not None and not alive():
            raise AssertionError(f"gave up waiting for {what}: the process died")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(delay)
        delay = min(delay * 1.5, 0.1)


def mountd_argv(cache_dir: Path, *options: str) -> list[str]:
    """``python -m quiverfs.cli mountd --cache-dir DIR OPTIONS``."""
    return [sys.executable, "-m", "quiverfs.cli", "mountd", "--cache-dir", os.fspath(cache_dir), *options]


@contextmanager
def running_mountd(cache_dir: Path, *options: str, cache_size: str | None = "256M",
                   timeout: float = 30.0) -> Iterator[MountdProcess]:
    """A mountd for ``cache_dir`` in a child process, ready when entered, stopped on exit
    (``cache_size=None``: no ``--cache-size``, e.g. when a ``--config`` file sets it)."""
    cache_dir = Path(cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    log_path = cache_dir.parent / f"{cache_dir.name}.mountd.log"
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            mountd_argv(cache_dir, *(() if cache_size is None else ("--cache-size", cache_size)),
                        *options),
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
        )
    daemon = MountdProcess(proc, cache_dir, log_path)
    try:
        try:
            wait_until(lambda: probe(cache_dir, timeout=2.0), timeout, "mountd to answer",
                       alive=lambda: proc.poll() is None)
        except AssertionError as exc:
            raise AssertionError(f"{exc}; mountd log:\n{daemon.log()}") from None
        yield daemon
    finally:
        daemon.stop()


@dataclass(frozen=True)
class SampleFile:
    """One file of a sample dataset: its key, bytes and blake3 hash."""

    key: str
    data: bytes
    hash: bytes

    @property
    def size(self) -> int:
        return len(self.data)


def make_dataset(root: Path, count: int, size: int = 4096, seed: int = 0,
                 prefix: str = "f") -> tuple[str, list[SampleFile]]:
    """``count`` distinct files of ``size`` bytes under ``root``; ``(file:// url, files)``."""
    root.mkdir(parents=True, exist_ok=True)
    files = []
    for i in range(count):
        data = seed.to_bytes(4, "big") + i.to_bytes(4, "big") + os.urandom(max(0, size - 8))
        key = f"{prefix}{i:05d}.bin"
        (root / key).write_bytes(data)
        files.append(SampleFile(key, data, blake3.blake3(data).digest()))
    return "file://" + os.fspath(root.absolute()), files


def location(url: str, f: SampleFile) -> dict:
    """The protocol's location object for a whole-file ``f`` under ``url``."""
    return {"url": url, "key": f.key, "offset": 0, "length": f.size}
