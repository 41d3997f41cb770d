"""Throwaway local users and groups, for tests of what *other* users of a machine can do.

One mountd serves every user of a machine (docs/operations.md "Security"), so some tests must
act as somebody else: list the store, read a store file by its hash, connect to the socket.
They need real accounts (``SO_PEERCRED``, group membership and file modes all come from the
kernel), made with ``useradd``/``groupadd`` as root and removed afterwards::

    with LocalUsers() as users:                     # or the session fixture ``local_users``
        group = users.group("qfs_test_socket")
        member = users.user("qfs_test_member", groups=[group])
        outsider = users.user("qfs_test_other")
        [listing, content] = outsider.probe(["listdir", store], ["read", path])
        assert listing == {"errno": "EACCES"} and content == {"ok": data.hex()}

Every name must start with :data:`PREFIX`, so nothing but test accounts is ever removed. An
account left by an earlier run that was killed is reused (and removed at the end like the
others). Commands run as a user with exactly its uid, primary gid and supplementary groups
(``subprocess.run(user=, group=, extra_groups=)``), never with root's.

Whole quiverfs commands (a mount, the admin CLI) run as a user with :func:`spawn_as` once
:func:`interpreter_reachable` let every user traverse to the interpreter (pyenv puts it under
``/root``, ``0700``); small checks that need the project's imports run in a forked child that
drops to the user's ids first (:func:`run_as`: only what the caller already imported is used).
"""

from __future__ import annotations

import grp
import json
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: Every throwaway user and group name starts with this.
PREFIX = "qfs_test_"

#: Seconds a command run as a throwaway user may take.
TIMEOUT = 60.0

#: Run by :meth:`LocalUser.probe` as the user, with the standard library only (a user other
#: than root may not reach the project's virtual environment). Takes a JSON list of
#: operations, prints one JSON result per operation: ``{"ok": value}`` or ``{"errno": name}``.
#:
#: * ``["listdir", path]`` → sorted names;
#: * ``["read", path]`` → the file's bytes as hex;
#: * ``["open", path]`` → true (opened for reading, then closed);
#: * ``["hello", socket_path, version]`` → mountd's ``hello`` response (the whole frame).
PROBE = r"""
import errno, json, os, socket, struct, sys

def hello(path, version):
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(30)
        s.connect(path)
        body = json.dumps({"id": 1, "op": "hello", "args": {"version": version}}).encode()
        s.sendall(struct.pack(">I", len(body)) + body)
        def exact(n):
            data = b""
            while len(data) < n:
                chunk = s.recv(n - len(data))
                if not chunk:
                    raise ConnectionError("mountd closed the connection")
                data += chunk
            return data
        (n,) = struct.unpack(">I", exact(4))
        return json.loads(exact(n))

def read(path):
    with open(path, "rb") as f:
        return f.read().hex()

def opened(path):
    os.close(os.open(path, os.O_RDONLY))
    return True

OPS = {"listdir": lambda p: sorted(os.listdir(p)), "read": read, "open": opened, "hello": hello}
results = []
for op, *args in json.loads(sys.argv[1]):
    try:
        results.append({"ok": OPS[op](*args)})
    except OSError as exc:
        results.append({"errno": errno.errorcode.get(exc.errno, str(exc.errno))})
print(json.dumps(results))
"""


def unavailable_reason() -> str | None:
    """Why throwaway users cannot be made here (None: they can): for ``pytest.skip``."""
    if os.geteuid() != 0:
        return "needs root to create throwaway local users (useradd)"
    for tool in ("useradd", "usermod", "userdel", "groupadd", "groupdel"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    return None


def _check_name(name: str) -> None:
    if not name.startswith(PREFIX) or len(name) > 32:
        raise ValueError(f"throwaway account names start with {PREFIX!r} (at most 32 characters), not {name!r}")


def _run_root(argv: Sequence[str]) -> None:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=TIMEOUT, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()}")


@dataclass(frozen=True)
class LocalGroup:
    """A throwaway group."""

    name: str
    gid: int


@dataclass(frozen=True)
class LocalUser:
    """A throwaway user: commands run with exactly these ids."""

    name: str
    uid: int
    #: Primary group (the user's own, same name).
    gid: int
    #: Supplementary groups, as the group database lists them.
    groups: tuple[int, ...]

    def run(self, argv: Sequence[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        """``subprocess.run(argv)`` as this user (text output captured, no check, cwd ``/``)."""
        options: dict[str, Any] = {"capture_output": True, "text": True, "timeout": TIMEOUT,
                                   "check": False, "stdin": subprocess.DEVNULL, "cwd": "/"}
        options.update(kwargs)
        return subprocess.run(list(argv), user=self.uid, group=self.gid,
                              extra_groups=list(self.groups), **options)

    def python(self, code: str, *args: str) -> subprocess.CompletedProcess[str]:
        """Run Python ``code`` as this user, with an interpreter this user may execute."""
        return self.run([python_for(self), "-c", code, *args])

    def probe(self, *operations: Sequence[Any]) -> list[dict[str, Any]]:
        """Run :data:`PROBE`'s ``operations`` as this user; one result per operation."""
        done = self.python(PROBE, json.dumps([list(op) for op in operations]))
        if done.returncode != 0:
            raise AssertionError(f"the probe failed as {self.name}: {done.stderr.strip()}")
        return json.loads(done.stdout)


_interpreters: dict[int, str] = {}


def python_for(user: LocalUser) -> str:
    """A Python 3 interpreter ``user`` can execute: this one, else the system's (a virtual
    environment under root's home is out of other users' reach)."""
    if user.uid not in _interpreters:
        for candidate in (sys.executable, shutil.which("python3"), "/usr/bin/python3"):
            try:
                usable = bool(candidate) and user.run([candidate, "-c", "pass"]).returncode == 0
            except OSError:  # exec refused: not this one
                usable = False
            if usable:
                _interpreters[user.uid] = candidate
                break
        else:
            raise RuntimeError(f"no Python interpreter that {user.name} may execute")
    return _interpreters[user.uid]


class LocalUsers:
    """Makes throwaway users and groups; :meth:`close` (or leaving the ``with``) removes them."""

    def __init__(self) -> None:
        self._users: list[str] = []
        self._groups: list[str] = []

    def __enter__(self) -> LocalUsers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def group(self, name: str) -> LocalGroup:
        """The group ``name``, made (``groupadd --system``) unless it exists."""
        _check_name(name)
        try:
            entry = grp.getgrnam(name)
        except KeyError:
            _run_root(["groupadd", "--system", name])
            entry = grp.getgrnam(name)
        if name not in self._groups:
            self._groups.append(name)
        return LocalGroup(entry.gr_name, entry.gr_gid)

    def user(self, name: str, groups: Iterable[LocalGroup] = ()) -> LocalUser:
        """The user ``name``, a member of exactly ``groups`` besides its own, made
        (``useradd --system --no-create-home``) unless it exists."""
        _check_name(name)
        extra = ",".join(g.name for g in groups)
        try:
            pwd.getpwnam(name)
        except KeyError:
            _run_root(["useradd", "--system", "--no-create-home", "--user-group",
                       "--home-dir", "/nonexistent", "--shell", "/usr/sbin/nologin",
                       *(["--groups", extra] if extra else []), name])
        else:  # left by an earlier run: make its groups the ones asked for
            _run_root(["usermod", "--groups", extra, name])
        if name not in self._users:
            self._users.append(name)
        entry = pwd.getpwnam(name)
        supplementary = tuple(sorted(set(os.getgrouplist(name, entry.pw_gid)) - {entry.pw_gid}))
        return LocalUser(name, entry.pw_uid, entry.pw_gid, supplementary)

    def close(self) -> None:
        """Remove every user, then every group, this object made or reused (errors ignored:
        the next run reuses what is left)."""
        for name in reversed(self._users):
            subprocess.run(["userdel", name], capture_output=True, timeout=TIMEOUT, check=False)
        for name in reversed(self._groups):
            subprocess.run(["groupdel", name], capture_output=True, timeout=TIMEOUT, check=False)
        self._users.clear()
        self._groups.clear()


def traversable_tmpdir(prefix: str = "quiverfs-users-") -> Path:
    """A new folder under the system's temporary directory that other users may traverse
    (``0711``; pytest's ``tmp_path`` lies under a ``0700`` folder of root's)."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    path.chmod(0o711)
    return path


# -- quiverfs itself as a user ------------------------------------------------------------------


@contextmanager
def fuse_for_every_user() -> Iterator[None]:
    """/dev/fuse as every distribution's udev rules make it (0666), so that throwaway users
    can mount (their workers open it to clone the connection); some containers give it 0600.
    Its mode is restored afterwards."""
    mode = os.stat("/dev/fuse").st_mode & 0o777
    os.chmod("/dev/fuse", 0o666)
    try:
        yield
    finally:
        os.chmod("/dev/fuse", mode)


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


def spawn_as(user: LocalUser, home: Path, argv: list[str], log: Path) -> subprocess.Popen:
    """``quiverfs ARGV`` as ``user`` with ``HOME=home`` (see :func:`interpreter_reachable`),
    stdout and stderr appended to ``log``."""
    env = dict(os.environ, HOME=str(home), USER=user.name, LOGNAME=user.name)
    env.pop("XDG_RUNTIME_DIR", None)
    with open(log, "ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "quiverfs.cli", *argv], stdin=subprocess.DEVNULL, stdout=out,
            stderr=out, cwd=home, env=env, user=user.uid, group=user.gid,
            extra_groups=list(user.groups), start_new_session=True)


def run_as(user: LocalUser, fn: Callable[[], Any], timeout: float = 120.0) -> Any:
    """``fn()`` run as ``user`` in a forked child; its JSON-able result. An exception in the
    child is raised here as an AssertionError with the child's traceback."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: never return into the caller
        status = 0
        try:
            os.close(read_fd)
            os.setgroups(list(user.groups))
            os.setgid(user.gid)
            os.setuid(user.uid)
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
