"""Running test code as another local user: throwaway accounts and forked children.

The multi-user tests (one mountd shared by every user, docs/operations.md "Security") need
real uids. CI runs as root, so a test creates throwaway users with ``useradd`` and runs code
as them: small checks (reads, a request to mountd) in a **forked** child that drops to their
uid/gid first (:func:`run_as`: only what the caller already imported is used), whole CLI
commands as subprocesses (:func:`spawn_as`) once :func:`interpreter_reachable` let every user
traverse to the interpreter (pyenv puts it under ``/root``, ``0700``).
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
from collections.abc import Callable, Iterator
from contextlib import contextmanager
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


@contextmanager
def interpreter_reachable(*paths: Path) -> Iterator[None]:
    """Let every user traverse the folders above this interpreter and ``paths`` (``o+x``,
    never ``o+r``) for the duration, so children of other users can run the CLI: the
    interpreter often lives under ``/root`` (pyenv), which is ``0700``. Modes are restored."""
    changed: dict[Path, int] = {}
    targets = [Path(os.path.realpath(sys.executable)), Path(sys.prefix), *paths]
    for target in targets:
        for folder in [target, *target.parents] if target.is_dir() else list(target.parents):
            mode = folder.stat().st_mode
            if not mode & 0o001 and folder not in changed:
                changed[folder] = mode & 0o7777
                folder.chmod((mode & 0o7777) | 0o001)
    try:
        yield
    finally:
        for folder, mode in changed.items():
            folder.chmod(mode)


def spawn_as(user: User, argv: list[str], log: Path) -> subprocess.Popen:
    """``quiverfs ARGV`` as ``user`` (see :func:`interpreter_reachable`), with stdout and
    stderr appended to ``log``."""
    env = dict(os.environ, HOME=str(user.home), USER=user.name, LOGNAME=user.name)
    env.pop("XDG_RUNTIME_DIR", None)
    with open(log, "ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "quiverfs.cli", *argv], stdin=subprocess.DEVNULL, stdout=out,
            stderr=out, cwd=user.home, env=env, user=user.uid, group=user.gid, extra_groups=[],
            start_new_session=True)


def exit_status(proc: subprocess.Popen, timeout: float = 60.0) -> int | None:
    """The exit code of ``proc`` once it ended within ``timeout`` (None: still running)."""
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        return None


def stop(proc: subprocess.Popen, timeout: float = 20.0) -> None:
    """SIGTERM, then SIGKILL after ``timeout``; reaped."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    if exit_status(proc, timeout) is None:
        proc.kill()
        proc.wait()
