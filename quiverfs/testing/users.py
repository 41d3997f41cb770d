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
others). Names must not be shared with tests that make and remove accounts on their own
(tests/mount/test_multiuser.py, with :mod:`quiverfs.testing.as_user`, uses ``qfs_test_a``
and ``qfs_test_b``): one would remove the other's user while it is still in use. Commands run as a user with exactly its uid, primary gid and supplementary groups
(``subprocess.run(user=, group=, extra_groups=)``), never with root's.
"""

from __future__ import annotations

import grp
import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Sequence
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
