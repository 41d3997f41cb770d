"""Forking a helper process that lives and dies with its parent.

Two parts of quiverfs serve through forked children: a mount's FUSE workers
(quiverfs/fuse/worker.py) and mountd's fill processes (mountd/store/fillpool.py). Both fork
from a process that may be running trio, and both want the same child: one that leaves the
parent's event loop behind, leaves signals from the terminal to the parent, is told by the
kernel when the parent dies, and never returns into the parent's code.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
from collections.abc import Callable, Iterable

log = logging.getLogger("quiverfs.forking")

#: ``prctl`` options (Linux): the signal the kernel sends a process when its parent dies, and
#: the process's name (``comm``: what ``top`` and ``ps -o comm`` show, at most 15 bytes).
_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15


def _prctl(option: int, value: object) -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(option, value, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def die_with_parent() -> None:
    """Ask the kernel to SIGTERM us when our parent dies (Linux ``prctl``; elsewhere nothing)."""
    _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def set_name(name: str) -> None:
    """Name this process ``name`` for ``top`` and ``ps -o comm`` (its command line, which
    ``ps -f`` shows, stays its parent's)."""
    _prctl(_PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]))


def close_inherited(keep: Iterable[int]) -> None:
    """Close every descriptor this process inherited except stdin, stdout, stderr and
    ``keep``: a child must not hold its parent's sockets open (a client's connection would
    not end when the parent closes it), nor its locks."""
    wanted = {0, 1, 2, *keep}
    try:
        fds = [int(name) for name in os.listdir("/proc/self/fd")]
    except OSError:
        return
    for fd in fds:
        if fd not in wanted:
            with contextlib.suppress(OSError):  # the descriptor listdir itself used, already closed
                os.close(fd)


def fork_child(target: Callable[[], None], what: str, name: str | None = None) -> int:
    """Fork a process running ``target()``; its pid.

    The child leaves the parent's trio run behind: no wakeup fd, default SIGTERM (the
    parent stops it with it), SIGINT/SIGHUP ignored (a terminal's ^C goes to the whole
    process group; the parent decides what happens), and it exits when the parent dies:
    0 when ``target`` returns, 1 after an error (logged with ``what``). ``name``: the
    child's process name (:func:`set_name`).
    """
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child
        code = 0
        try:
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            signal.signal(signal.SIGHUP, signal.SIG_IGN)
            die_with_parent()
            if name is not None:
                set_name(name)
            if os.getppid() == parent:
                target()
        except BaseException:
            log.exception("%s failed", what)
            code = 1
        finally:
            logging.shutdown()
            os._exit(code)
    return pid
