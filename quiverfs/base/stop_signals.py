"""How the long-running processes (mountd, a mount) receive the signals that ask them to stop.

Both run trio and take their stop signals through trio's signal receiver, which, when it
ends, puts back the handlers it found. Found as the default action, a stop signal that came
while the process wound down (closing its cache and index, stopping its children) killed it
half-way: exit -15 and no "stopped" line (the soak's remount on 2026-12-01: an unmount, then
SIGTERM at once; any service manager's stop followed by a user's kill, or Ctrl-C twice). So
the signals are set to be ignored before the receiver opens, and ignoring is what it puts
back: a process that is winding down was asked to stop already, and SIGKILL still ends one
that hangs. The cost is the instant between the two calls, in which a stop signal is lost
rather than acted on; the process is just starting then.

Forked helpers (quiverfs/base/forking.py) set the default actions back in the child.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import AsyncIterator, Iterator

import trio


@contextlib.contextmanager
def stop_signal_receiver(*signums: int) -> Iterator[AsyncIterator[int]]:
    """trio's receiver of ``signums`` (call from the main thread), after which they are
    ignored, not given their default action (see the module docstring)."""
    for signum in signums:
        signal.signal(signum, signal.SIG_IGN)
    with trio.open_signal_receiver(*signums) as received:
        yield received
