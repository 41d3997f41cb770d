"""Read-ahead for plain readers: during a scan in digest order, name the files that come next.

Why: a reader without the shim (``cp -r``, ``tar``, a framework's loader walking a directory)
reads one file after another and waits for each miss's fetch in turn, while mountd could run
``prefetch_concurrency`` fills at once if it knew what comes next. File ids are the mount's
inode numbers and follow digest order (digests/schema.py: a directory's files are one
contiguous id range, in name order: the order a listing gives them and ``cp -r``, ``tar`` and
``ImageFolder`` read them), so a scan shows as ids growing in small steps, and "what comes
next" is the next ids.

This module is pure: ids in, ids out (the files' sizes come from a function the caller gives).
quiverfs/filesystem/fs.py feeds it what the mount sees read and asks mountd to ``prefetch`` what it
answers. It sees two kinds of reads:

* **Reads the main process serves** (:meth:`ReadAhead.observe`): misses, as they arrive, each
  with the reading process's pid. These decide whether the reads are a scan. They come
  without delay and in each reader's own order, and a scan that read-ahead does not keep up
  with shows up here first.
* **Hits the workers report** (:meth:`ReadAhead.reported`): batched per worker, a fraction
  of a second late, several workers' batches interleaved. Once read-ahead works, a scan's
  reads are mostly these, so they move the window along; they never start anything.

**Verdict.** A reader's *step* is the distance from its previous read (a reader never seen
before, such as a shell loop's new ``cat`` per file, is compared with the last read from
anyone). A step is *sequential* when it moves forward by at most :data:`AHEAD` ids or back by
at most :data:`BACK`: room for interleaved shares (8 readers taking files ``k, k+8, …``) and
for readers drifting a little apart. While read-ahead runs, a read inside a scan's run (see
below) counts as sequential too (the reader hit the files in between, so its own step is long). The
reads are a scan once :data:`START` of the last :data:`HISTORY` of these verdicts are
sequential, and stop being one when fewer than :data:`STOP` are (hysteresis: a directory
boundary or a stray read does not stop a scan). A shuffled order over ``F`` files makes a
sequential step with probability about ``(AHEAD + BACK) / F`` (0.24 for 400 files), so 14 of
16 practically never happens by chance, while a scan makes almost only sequential steps.

**Runs.** A scan position is a *run*: its frontier (the highest id read) and the highest id
asked for. While the reads are a scan, a read within :data:`LAG` behind a run's frontier or up
to :data:`AHEAD` past what it asked for advances that run's frontier, and the run is topped up
(its window, below): the ids returned are only those beyond what it asked for already, in
order. The frontier moving past ids nobody asked for (the reader outran the window, or read a
file the window would not take) does not ask for them: the reader is reading them now. A
sequential step outside every run starts a new run there (a second scan elsewhere, a scan
starting over); runs that reach each other merge, and an id a run has asked for is not asked
for again while it lies within :data:`LAG` of that run's frontier (a reader further behind may
ask again: the caller leaves out files already in the store, and mountd those being fetched
or queued). At most :data:`RUNS` runs are followed, the least recently used going first.

**The window** of a run is what it may have asked for past its frontier, in files and in
bytes, and both grow with what the run's reader has read (slow start, like TCP's window or
the Linux page cache's read-ahead): a new run may ask for :data:`START_FILES` files and
:data:`START_BYTES` bytes, and each file its frontier passes adds one file and that file's
bytes, so the window doubles with each window's worth read, up to ``window`` files
(``--readahead``) and :func:`window_bytes` (an eighth of mountd's cache, at most 512 MiB).
A top-up asks for the next ids in order while both bounds hold and stops at the first file
that would break the byte bound: the run waits there until its frontier passes that file (the
reader reads it on demand) or passes enough of what was asked. So what was asked and not read
stays small next to what was read: a reader that read 2.5 MB of small files and stopped left
at most 4 MiB + 2.5 MB asked ahead of it, and a 30 MB file after them is fetched only if read.

**Stopping.** Nothing is asked for but on a read: a reader that stops, stops its run. When the
verdict turns random (the reader left the order), the runs are dropped and nothing more is
asked for until a scan is seen again, with windows starting small again.

A reported hit only advances a run it lands in; late reports (behind the frontier) are simply
ignored, so how late they are does not matter, only how often they come.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

#: Most files a run asks for ahead of its frontier, by default (``--readahead``). mountd's
#: ``prefetch_concurrency`` workers (by default its ``--remote-concurrency``: 16 when this was
#: measured, 64 since) each fill up to 8 queued files as one batch (docs/store-layout.md
#: "Batched prefetches"); 256 kept 16 workers two full batches deep between two hit reports
#: (with 64, batches held 5.6 files on
#: average and a cold scan of 10,000 files ran at 2,287 files/s, mountd 0.151 ms of CPU a
#: fill; with 256, 7.5 files, 2,631-2,735 files/s, 0.113-0.118 ms: 2026-11-30). The window
#: grows to it only as the scan goes on, one file per file read, and its bytes stay within
#: what the scan read plus START_BYTES. 256 ImageNet files are ~28 MB of cache.
WINDOW = 256

#: A new run's window: this many files and this many bytes past its frontier. Every file the
#: frontier passes adds one file and its bytes (see the module docstring). 4 files keep a few
#: fills going from the first read on, and files of up to 1 MiB each fit 4 MiB; 4 MiB is the
#: most a scan that stops at once leaves fetched for nothing (a reader of 2.5 MB of small
#: files made mountd fetch 52.9 MB with the fixed window of before).
START_FILES = 4
START_BYTES = 4 << 20

#: Most bytes a window may hold, whatever the reader read: a window of 64 multi-GB files
#: would push out of a small cache the very files the scan is about to read.
WINDOW_BYTES = 512 << 20

#: And at most this share of mountd's cache (1/8): files fetched ahead wait in the cache
#: until they are read, and the rest of it keeps what this and other readers just read. A
#: window as large as the cache evicts a file between its fetch and its read (measured: an
#: 8 MiB cache with 1 MiB files failed reads with EIO after three evictions in a row).
CACHE_SHARE = 8


#: Verdicts remembered, and how many of them must be sequential to start read-ahead and to
#: keep it going (see the module docstring).
HISTORY = 16
START = 14
STOP = 8

#: Largest forward and backward step still counted as sequential, in ids.
AHEAD = 64
BACK = 32

#: How far behind its frontier a run still takes reads, in ids: readers of interleaved shares
#: that drifted apart, a slow one among fast ones.
LAG = 256

#: Scan positions followed at once.
RUNS = 8

#: Readers whose last read is remembered; the least recently seen are forgotten first.
READERS = 1024

#: ``sizes(first, last)``: the sizes in bytes of the files with ids ``first .. last``, one per
#: id, in id order.
Sizes = Callable[[int, int], Sequence[int]]


def window_bytes(cache_bytes: int | None) -> int:
    """The most bytes a window may hold with a cache of ``cache_bytes`` (None: unknown)."""
    if cache_bytes is None:
        return WINDOW_BYTES
    return max(1, min(WINDOW_BYTES, cache_bytes // CACHE_SHARE))


@dataclass
class _Run:
    """One scan position: ``frontier`` is the highest id read, ``asked`` the highest id asked
    for or passed (``asked >= frontier``), and every id in ``[start, asked]`` was read, asked
    for or passed over (``start`` is kept within LAG of the frontier); ``used`` orders runs by
    use. Its window: ``files`` (ids past the frontier it may have asked for), and bytes
    ``START_BYTES + read_bytes`` (the bytes of the files its frontier passed, the first read
    included); ``ahead`` holds the sizes of the ids ``(frontier, asked]`` (all asked for), and
    ``ahead_bytes`` their sum."""

    start: int
    frontier: int
    asked: int
    used: int
    files: int
    read_bytes: int
    ahead: deque[int] = field(default_factory=deque)
    ahead_bytes: int = 0


class ReadAhead:
    """Detects scans in digest order among the file ids ``first .. last`` and names the ids to
    prefetch: ahead of each scan's frontier, within a window that grows as the scan goes on, up
    to ``window`` files and ``max_bytes`` bytes (see the module docstring). ``sizes`` gives the
    files' sizes (:data:`Sizes`); it is asked about the ids a frontier passes and the ids a
    top-up considers, a few at a time.

    Not thread-safe; in the mount it lives in the main process's trio thread.
    """

    def __init__(self, first: int, last: int, sizes: Sizes, window: int = WINDOW,
                 max_bytes: int = WINDOW_BYTES) -> None:
        if window < 1:
            raise ValueError(f"the read-ahead window must be at least 1 file, not {window}")
        if max_bytes < 1:
            raise ValueError(f"the read-ahead window must be at least 1 byte, not {max_bytes}")
        self.first = first
        self.last = last
        self.window = window
        self.max_bytes = max_bytes
        self._sizes = sizes
        #: whether the recent reads are a scan (read-ahead is on)
        self.sequential = False
        #: ids handed out so far, and their bytes
        self.requested = 0
        self.requested_bytes = 0
        self._prev: dict[int, int] = {}  # reader → its last id, least recently seen first
        self._last = 0  # the last id read by anyone (ids start at 1: 0 is none)
        self._verdicts: deque[bool] = deque(maxlen=HISTORY)
        self._good = 0  # sequential verdicts in _verdicts
        self._runs: list[_Run] = []
        self._tick = 0

    def observe(self, file_id: int, reader: int = 0) -> list[int]:
        """Note that process ``reader`` read ``file_id`` (a read the main process serves);
        the ids to prefetch now, ascending (usually none: the window is full, or the reads
        are not a scan)."""
        if not self.first <= file_id <= self.last:
            return []
        step = self._step(file_id, reader)
        if step is None:
            return []
        run = self._run_of(file_id)
        self._judge(step or run is not None)
        if not self.sequential:
            return []
        if run is None:
            if not step:
                return []  # a stray read
            run = self._new_run(file_id)
        return self._advance(run, file_id)

    def reported(self, file_id: int) -> list[int]:
        """Note a hit a worker reported: it moves the window of the run it lands in, if any;
        the ids to prefetch now."""
        if not self.sequential:
            return []
        run = self._run_of(file_id)
        return [] if run is None else self._advance(run, file_id)

    def windows(self) -> tuple[int, int]:
        """The largest window of the runs now, in files and in bytes ((0, 0): no run)."""
        return (max((run.files for run in self._runs), default=0),
                max((self._byte_window(run) for run in self._runs), default=0))

    # -- the verdict ---------------------------------------------------------------------------

    def _step(self, file_id: int, reader: int) -> bool | None:
        """Whether ``reader``'s step to ``file_id`` is sequential; None for no step (its
        very first read, or the same file again)."""
        prev = self._prev.pop(reader, self._last)  # popped and put back: least recent first
        self._prev[reader] = file_id
        if len(self._prev) > READERS:
            del self._prev[next(iter(self._prev))]
        self._last = file_id
        if prev == 0 or prev == file_id:
            return None
        return -BACK <= file_id - prev <= AHEAD

    def _judge(self, sequential: bool) -> None:
        verdicts = self._verdicts
        if len(verdicts) == HISTORY:
            self._good -= verdicts[0]
        verdicts.append(sequential)
        self._good += sequential
        if self.sequential and self._good < STOP:
            self.sequential = False
            self._runs.clear()
        elif not self.sequential and self._good >= START:
            self.sequential = True

    # -- runs ----------------------------------------------------------------------------------

    def _run_of(self, file_id: int) -> _Run | None:
        for run in self._runs:
            if run.frontier - LAG <= file_id <= run.asked + AHEAD:
                return run
        return None

    def _new_run(self, file_id: int) -> _Run:
        if len(self._runs) >= RUNS:
            self._runs.remove(min(self._runs, key=lambda r: r.used))
        (size,) = self._sizes(file_id, file_id)
        run = _Run(file_id, file_id, file_id, self._tick, min(START_FILES, self.window), size)
        self._runs.append(run)
        return run

    def _byte_window(self, run: _Run) -> int:
        return min(self.max_bytes, START_BYTES + run.read_bytes)

    def _advance(self, run: _Run, file_id: int) -> list[int]:
        """Move ``run``'s frontier to ``file_id`` (if ahead) and top its window up; the ids
        no run has asked for yet (merging the runs it reaches)."""
        self._tick += 1
        run.used = self._tick
        if file_id > run.frontier:
            self._pass(run, file_id)
        return self._top_up(run)

    def _pass(self, run: _Run, file_id: int) -> None:
        """The frontier of ``run`` moves on to ``file_id``: the files it passes count as read
        and leave what is asked ahead; the window grows by as many files."""
        ahead = run.ahead
        passed = 0
        for _ in range(min(file_id - run.frontier, len(ahead))):
            passed += ahead.popleft()
        run.ahead_bytes -= passed
        if file_id > run.asked:  # past what was asked: sizes not known yet
            passed += sum(self._sizes(run.asked + 1, file_id))
        run.read_bytes += passed
        run.files = min(self.window, run.files + file_id - run.frontier)
        run.frontier = file_id
        run.asked = max(run.asked, file_id)  # ids passed without being asked: read now
        run.start = max(run.start, file_id - LAG)

    def _top_up(self, run: _Run) -> list[int]:
        """Ask for the ids after ``run.asked`` in order while the run's window holds them
        (stopping at the first file that would break its byte bound), skipping and merging
        the runs it reaches; the ids asked for."""
        out: list[int] = []
        while True:
            low = run.asked + 1
            target = min(run.frontier + run.files, self.last)
            if low > target:
                break
            # The nearest other run whose ids [start, asked] meet the ones to ask for now:
            # ask for the ids before it, then make the two one run and go on after it.
            other = None
            for candidate in self._runs:
                if (candidate is not run and candidate.asked >= low and candidate.start <= target
                        and (other is None or candidate.start < other.start)):
                    other = candidate
            end = target if other is None else other.start - 1
            if end >= low:
                room = self._byte_window(run) - run.ahead_bytes
                for file_id, size in zip(range(low, end + 1), self._sizes(low, end), strict=True):
                    if size > room:
                        other = None  # the run waits here: it does not reach the other yet
                        break
                    out.append(file_id)
                    room -= size
                    run.ahead.append(size)
                    run.ahead_bytes += size
                    run.asked = file_id
                    self.requested_bytes += size
            if other is None:
                break
            self._merge(run, other)
        self.requested += len(out)
        return out

    def _merge(self, run: _Run, other: _Run) -> None:
        """Make ``other`` (whose ids follow what ``run`` asked for) part of ``run``."""
        self._runs.remove(other)
        run.start = min(run.start, other.start)
        run.frontier = max(run.frontier, other.frontier)
        run.asked = max(run.asked, other.asked)
        run.files = max(run.files, other.files)
        run.read_bytes += other.read_bytes
        run.ahead = deque(self._sizes(run.frontier + 1, run.asked) if run.asked > run.frontier else ())
        run.ahead_bytes = sum(run.ahead)
