"""Progress reporting for long digest work (build, verify): a rich bar or periodic lines.

Commands pick :func:`make_progress`: a rich bar (files, bytes, rate, ETA) on stderr when it is
a terminal, one line every few seconds otherwise (logs, CI), nothing with ``--quiet``. The
work functions only call the :class:`Progress` methods, so tests pass a recorder.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    TaskProgressColumn,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)
from rich.progress import Progress as RichBar


class Progress:
    """Counts of planned and finished work; the base class draws nothing.

    Totals grow while a listing streams in (``total_known`` turns true at its end). Methods
    are called from the trio thread only.
    """

    def __init__(self) -> None:
        self.total_files = 0
        self.total_bytes = 0
        self.done_files = 0
        self.done_bytes = 0
        self.total_known = False
        self.notes: list[str] = []

    def add_total(self, files: int, nbytes: int) -> None:
        """More work discovered (a listed object)."""
        self.total_files += files
        self.total_bytes += nbytes
        self._draw()

    def totals_known(self) -> None:
        """The listing finished: the totals are final."""
        self.total_known = True
        self._draw()

    def advance(self, files: int, nbytes: int) -> None:
        """Work finished (hashed, reused or verified)."""
        self.done_files += files
        self.done_bytes += nbytes
        self._draw()

    def note(self, message: str) -> None:
        """A warning worth showing to the user now (and kept in ``notes``)."""
        self.notes.append(message)

    def close(self) -> None:
        """Stop drawing, after a final update."""

    def abort(self) -> None:
        """Stop drawing without a final update (the work failed; its error says why)."""

    def _draw(self) -> None:
        pass


class BarProgress(Progress):
    """A rich progress bar on a terminal."""

    def __init__(self, label: str, stream: TextIO | None = None, unit: str = "files") -> None:
        super().__init__()
        self._unit = unit
        self._console = Console(file=stream or sys.stderr)
        self._bar = RichBar(
            TextColumn("{task.description}"),
            BarColumn(),
            TaskProgressColumn(),
            DownloadColumn(),
            TransferSpeedColumn(),
            TimeRemainingColumn(),
            console=self._console,
            transient=False,
        )
        self._label = label
        self._task = self._bar.add_task(label, total=None)
        self._bar.start()

    def note(self, message: str) -> None:
        super().note(message)
        self._console.print(f"[yellow]warning:[/] {message}")

    def _draw(self) -> None:
        # The bar, rate and ETA count bytes; the description counts files.
        of = f"/{self.total_files}" if self.total_known else f"/{self.total_files}+"
        self._bar.update(
            self._task,
            completed=self.done_bytes,
            total=self.total_bytes if self.total_known else None,
            description=f"{self._label} {self.done_files}{of} {self._unit}",
        )

    def close(self) -> None:
        self._draw()
        self._bar.stop()

    def abort(self) -> None:
        self._bar.stop()


class LineProgress(Progress):
    """One line every ``interval`` seconds, for logs."""

    def __init__(
        self, label: str, stream: TextIO | None = None, interval: float = 5.0, unit: str = "files"
    ) -> None:
        super().__init__()
        self._unit = unit
        self._label = label
        self._stream = stream or sys.stderr
        self._interval = interval
        self._start = time.monotonic()
        self._last = self._start

    def note(self, message: str) -> None:
        super().note(message)
        print(f"{self._label}: warning: {message}", file=self._stream, flush=True)

    def _draw(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last < self._interval:
            return
        self._last = now
        rate = self.done_bytes / max(now - self._start, 1e-9)
        of = f"/{self.total_files}" if self.total_known else ""
        print(
            f"{self._label}: {self.done_files}{of} {self._unit}, {_size(self.done_bytes)} of "
            f"{_size(self.total_bytes)}{'' if self.total_known else '+'}, {_size(rate)}/s",
            file=self._stream,
            flush=True,
        )

    def close(self) -> None:
        self._draw(force=True)


def make_progress(
    label: str, quiet: bool = False, stream: TextIO | None = None, unit: str = "files"
) -> Progress:
    """The right reporter for ``stream`` (default stderr): bar on a TTY, lines otherwise.

    ``unit`` names what the counts count (``files``; ``objects`` for a build that reads tar
    shards, where one shard is one unit however many members it holds).
    """
    stream = stream or sys.stderr
    if quiet:
        return Progress()
    if stream.isatty():
        return BarProgress(label, stream, unit=unit)
    return LineProgress(label, stream, unit=unit)


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} PB"
