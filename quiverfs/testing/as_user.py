"""Running test code as another local user: throwaway accounts and forked children.

The multi-user tests (one mountd shared by every user, docs/operations.md "Security") need
real uids. CI runs as root, so a test creates throwaway users with ``useradd`` and runs code
as them in a **forked** child that drops to their uid/gid before doing anything: no ``exec``,
because the interpreter may live where other users cannot reach it (``/root/.pyenv``). Modules
the child needs must therefore be imported before the fork (the child may not be able to read
the source tree either).
"""

from __future__ import annotations

import json
import os
import pwd
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class User:
    """A local account: its name, uid, primary gid and an empty home it owns."""

    name: str
    uid: int
    gid: int
    home: Path


def make_user(name: str, home_root: Path) -> User:
    """Create (or reuse) the throwaway user ``name`` with a home under ``home_root``."""
    try:
        pwd.getpwnam(name)
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin",
                        "--user-group", name], check=True, capture_output=True)
    entry = pwd.getpwnam(name)
    home = home_root / name
    home.mkdir(parents=True, exist_ok=True)
    os.chown(home, entry.pw_uid, entry.pw_gid)
    return User(name, entry.pw_uid, entry.pw_gid, home)


def remove_user(user: User) -> None:
    """Delete the account (its files are the test's to remove)."""
    subprocess.run(["userdel", user.name], check=False, capture_output=True)


def _become(user: User) -> None:
    os.setgroups([])
    os.setgid(user.gid)
    os.setuid(user.uid)
    os.environ["HOME"] = str(user.home)
    os.environ["USER"] = user.name
    os.chdir(user.home)


def run_as(user: User, fn: Callable[[], Any], timeout: float = 120.0) -> Any:
    """``fn()`` run as ``user`` in a forked child; its JSON-able result. An exception in the
    child is raised here as an AssertionError with the child's traceback."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: never return into the caller
        status = 0
        try:
            os.close(read_fd)
            _become(user)
            payload = {"result": fn()}
        except BaseException:  # report anything, assertion errors included
            payload = {"error": traceback.format_exc()}
            status = 1
        try:
            os.write(write_fd, json.dumps(payload).encode())
        finally:
            os._exit(status)
    os.close(write_fd)
    deadline = time.monotonic() + timeout
    with os.fdopen(read_fd, "rb") as pipe:
        data = pipe.read()
    while os.waitpid(pid, os.WNOHANG) == (0, 0):
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
        time.sleep(0.01)
    payload = json.loads(data or b'{"error": "the child died without a word"}')
    if "error" in payload:
        raise AssertionError(f"as {user.name}: {payload['error']}")
    return payload["result"]


def spawn_as(user: User, argv: list[str], log: Path) -> int:
    """``quiverfs ARGV`` (the CLI, in-process) as ``user`` in a forked child, with stdout and
    stderr appended to ``log``; the child's pid (reap it with :func:`stop`)."""
    from quiverfs.cli import main  # imported here, in the parent, before the fork

    log_fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.dup2(log_fd, 1)
            os.dup2(log_fd, 2)
            null = os.open(os.devnull, os.O_RDONLY)
            os.dup2(null, 0)
            os.setsid()
            _become(user)
            sys.argv = ["quiverfs", *argv]
            try:
                main()
                code = 0
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else 1
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    os.close(log_fd)
    return pid


def exit_status(pid: int, timeout: float = 60.0) -> int | None:
    """The exit code of child ``pid`` once it ended within ``timeout`` (None: still running)."""
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            return None
        time.sleep(0.02)


def stop(pid: int, timeout: float = 20.0) -> None:
    """SIGTERM, then SIGKILL after ``timeout``; reaped."""
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    if exit_status(pid, timeout) is None:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
