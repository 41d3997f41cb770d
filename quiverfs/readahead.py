"""Read-ahead for plain readers: during a scan in digest order, name the files that come next.

Why: a reader without the shim (``cp -r``, ``tar``, a framework's loader walking a directory)
reads one file after another and waits for each miss's fetch in turn, while mountd could run
``prefetch_concurrency`` fills at once if it knew what comes next. File ids are the mount's
inode numbers and follow digest order (digests/schema.py: a directory's files are one
contiguous id range, in name order: the order a listing gives them and ``cp -r``, ``tar`` and
``ImageFolder`` read them), so a scan shows as ids growing in small steps, and "what comes
next" is the next ids.

This module is pure: ids in, ids out. quiverfs/fs.py feeds it what the mount sees read and
asks mountd to ``prefetch`` what it answers. It sees two kinds of reads:

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

**The window** is ``window`` files (``--readahead``), fewer when that many files of the
dataset's mean size would hold more than an eighth of mountd's cache or 512 MiB
(:func:`window_bytes`, :func:`window_for`).

**Runs.** A scan position is a *run*: its frontier (the highest id read) and
the highest id asked for. While the reads are a scan, a read within :data:`LAG` behind a
run's frontier or up to :data:`AHEAD` past what it asked for advances that run's frontier,
and the run is topped up to ``frontier + window`` (never past the last file): the ids
returned are only those beyond what it asked for already. A sequential step outside every
run starts a new run there (a second scan elsewhere, a scan starting over); runs that reach
each other merge, and an id a run has asked for is not asked for again while it lies within
:data:`LAG` of that run's frontier (a reader further behind may ask again: the caller leaves
out files already in the store, and mountd those being fetched or queued). At most
:data:`RUNS` runs are followed, the least recently used going first. When the verdict turns
random, the runs are dropped and nothing more is asked for.

A reported hit only advances a run it lands in; late reports (behind the frontier) are simply
ignored, so how late they are does not matter, only how often they come.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

#: Files asked for ahead of the scan frontier, by default (``--readahead``). mountd fills
#: ``prefetch_concurrency`` at once (by default its ``--remote-concurrency``, 16); 64 keeps
#: each of those slots 4 files deep, enough for the fills to stay busy between two hit
#: reports. 64 ImageNet files are ~7 MB of cache.
WINDOW = 64

#: Most bytes the window may hold, as a number of files of the dataset's mean size (see
#: :func:`window_for`): a window of 64 multi-GB files would push out of a small cache the
#: very files the scan is about to read.
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


def window_bytes(cache_bytes: int | None) -> int:
    """The most bytes a window may hold with a cache of ``cache_bytes`` (None: unknown)."""
    if cache_bytes is None:
        return WINDOW_BYTES
    return max(1, min(WINDOW_BYTES, cache_bytes // CACHE_SHARE))


def window_for(files: int, total_bytes: int, file_count: int, max_bytes: int = WINDOW_BYTES) -> int:
    """The window in files: ``files``, fewer when that many files of the dataset's mean size
    would exceed ``max_bytes`` (at least 1; 0 stays 0: read-ahead off)."""
    if files <= 0:
        return 0
    mean = total_bytes // file_count if file_count else 0
    if mean <= 0:
        return files
    return max(1, min(files, max_bytes // mean))


@dataclass
class _Run:
    """One scan position: ``frontier`` is the highest id read, ``asked`` the highest id asked
    for (``asked >= frontier`` once topped up), and every id in ``[start, asked]`` was read or
    asked for (``start`` is kept within LAG of the frontier); ``used`` orders runs by use."""

    start: int
    frontier: int
    asked: int
    used: int


class ReadAhead:
    """Detects scans in digest order among the file ids ``first .. last`` and names the ids to
    prefetch, ``window`` ahead of each scan's frontier.

    Not thread-safe; in the mount it lives in the main process's trio thread.
    """

    def __init__(self, first: int, last: int, window: int = WINDOW) -> None:
        if window < 1:
            raise ValueError(f"the read-ahead window must be at least 1 file, not {window}")
        self.first = first
        self.last = last
        self.window = window
        #: whether the recent reads are a scan (read-ahead is on)
        self.sequential = False
        #: ids handed out so far
        self.requested = 0
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
        run = _Run(file_id, file_id, file_id, self._tick)
        self._runs.append(run)
        return run

    def _advance(self, run: _Run, file_id: int) -> list[int]:
        """Move ``run``'s frontier to ``file_id`` (if ahead) and top it up to ``frontier +
        window``; the ids no run has asked for yet (merging the runs it reaches)."""
        self._tick += 1
        run.used = self._tick
        if file_id > run.frontier:
            run.frontier = file_id
            run.start = max(run.start, file_id - LAG)
        target = min(run.frontier + self.window, self.last)
        if target <= run.asked:
            return []
        out: list[int] = []
        low = run.asked + 1
        for other in sorted(self._runs, key=lambda r: r.start):
            # Another run whose ids [start, asked] meet the ones to ask for now: ask for the
            # ids before it, skip its, and make the two one run.
            if other is run or other.asked < low or other.start > target:
                continue
            out.extend(range(low, other.start))
            low = max(low, other.asked + 1)
            run.start = min(run.start, other.start)
            run.frontier = max(run.frontier, other.frontier)
            run.asked = max(run.asked, other.asked)
            target = max(target, min(run.frontier + self.window, self.last))
            self._runs.remove(other)
        out.extend(range(low, target + 1))
        run.asked = max(run.asked, target)
        self.requested += len(out)
        return out
