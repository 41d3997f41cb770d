"""Start records: how a staggered job knows when "the first job" on a mount started.

``quiverfs run --first MOUNT -- CMD`` writes one small JSON file per mount point before it
starts CMD, and marks it ended when CMD exits; ``quiverfs run --after MOUNT --stagger 40% --
CMD`` (and training code, through :func:`planned_start`) reads it and starts CMD at
``started + stagger``. The record lives outside the mount (mounts are read-only), in a state
directory: ``starts/`` in this user's runtime folder (``mountd.store.layout.runtime_dir``:
``$XDG_RUNTIME_DIR/quiverfs`` when it is this user's, else the cache folder of a usable home,
else a private ``0700`` folder under the temporary directory), keyed by the mount point's real
path. It is written to a temporary name and renamed, so a
reader sees a whole record or none. docs/staggering.md describes it.

Deliberately simple: one first job per mount point at a time (a new ``--first`` replaces the
record). A record whose job has ended, or whose process is gone, means "the first job is
over": a later job starts at once, since its planned moment is past.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mountd.store import layout
from quiverfs.base.errors import UsageError


def default_state_dir() -> Path:
    """Where records live: ``starts/`` in :func:`mountd.store.layout.runtime_dir` (the one
    rule for this user's private state, which checks a shared temporary folder's owner)."""
    return layout.runtime_dir() / "starts"


def record_path(mountpoint: str | os.PathLike[str], state_dir: Path | None = None) -> Path:
    """The record file of ``mountpoint`` (by its real path)."""
    real = os.path.realpath(mountpoint)
    key = hashlib.sha256(real.encode()).hexdigest()[:16]
    return (state_dir or default_state_dir()) / f"{key}.json"


@dataclass
class StartRecord:
    """A first job: where, who, when (``time.time()`` seconds), and its planned runtime."""

    mountpoint: str
    pid: int
    started: float
    #: the first job's standalone runtime in seconds, when its starter knew it (a plan)
    runtime: float | None = None
    #: when the job exited (None: still running, as far as the record knows)
    ended: float | None = None

    @property
    def over(self) -> bool:
        """Whether the first job has finished (or its process is gone)."""
        if self.ended is not None:
            return True
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False  # another user's live process
        return False


def _write(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".start-")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_start(mountpoint: str | os.PathLike[str], pid: int, runtime: float | None = None,
                state_dir: Path | None = None) -> StartRecord:
    """Record that the first job on ``mountpoint`` (process ``pid``) starts now."""
    record = StartRecord(os.path.realpath(mountpoint), pid, time.time(), runtime)
    _write(record_path(mountpoint, state_dir), record.__dict__)
    return record


def mark_ended(mountpoint: str | os.PathLike[str], pid: int, state_dir: Path | None = None) -> None:
    """Mark the record ended, if it is still ``pid``'s (a newer first job keeps its own)."""
    record = read_start(mountpoint, state_dir)
    if record is not None and record.pid == pid:
        record.ended = time.time()
        _write(record_path(mountpoint, state_dir), record.__dict__)


def read_start(mountpoint: str | os.PathLike[str], state_dir: Path | None = None) -> StartRecord | None:
    """The record of ``mountpoint``, or None when there is none."""
    path = record_path(mountpoint, state_dir)
    try:
        data = json.loads(path.read_text())
        return StartRecord(**data)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError) as exc:
        raise UsageError(f"unreadable start record {path}: {exc}") from exc


def planned_start(mountpoint: str | os.PathLike[str], *, stagger: float | None = None,
                  seconds: float | None = None, runtime: float | None = None,
                  state_dir: Path | None = None, wait_first: float = 0.0) -> float:
    """The ``time.time()`` at which a job staggered after the first job on ``mountpoint``
    should start: ``started + seconds``, or ``started + stagger × runtime`` (``runtime``
    defaults to the one the first job recorded). Waits up to ``wait_first`` seconds for a
    first job to appear; a first job that is over gives "now".

    Pass the result to ``QuiverBatchSampler(hold_until=...)`` to hold the first batch until
    then, or use ``quiverfs run --after``, which waits before it starts the command.
    """
    if (stagger is None) == (seconds is None):
        raise UsageError("give a stagger as a percentage of the first job's runtime or in seconds")
    deadline = time.monotonic() + wait_first
    record = read_start(mountpoint, state_dir)
    while record is None and time.monotonic() < deadline:
        time.sleep(0.05)
        record = read_start(mountpoint, state_dir)
    if record is None:
        raise UsageError(f"no first job on {os.path.realpath(mountpoint)}: start it with "
                         "`quiverfs run --first MOUNT -- CMD`")
    if record.over:
        return time.time()
    if seconds is None:
        base = runtime if runtime is not None else record.runtime
        if base is None:
            raise UsageError("a percentage stagger needs the first job's runtime: --runtime, "
                             "--plan, or a first job started with one")
        assert stagger is not None
        seconds = stagger * base
    return record.started + seconds
