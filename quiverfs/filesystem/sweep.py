"""The sweep: a shuffled reader's files fetched ahead in digest order, paced by its reads.

Why: a training job that shuffles (``ImageFolder`` with a ``DataLoader(shuffle=True)``) reads
every file of the dataset once per epoch in an order nobody can guess, so read-ahead
(quiverfs/filesystem/readahead.py) never sees a scan, and on a cold cache every read is a miss
on demand: a message from the worker to the main process, an ``ensure`` to mountd, a fill of
its own, an answer, each reader waiting for each. That costs two to three times the CPU of a
fill that read-ahead asked for (measured, issue 34: ~1.0 ms of all quiverfs processes a file
shuffled against ~0.5 ms in digest order, where mountd fills the queue in batches). The
order of the epoch is random, but its *set* is not: the files in the range the reads cover.
So when the reads are not a scan, the sweep asks mountd to ``prefetch`` the files of that range
in digest order, the cheap path, and the reads that land on files it brought are hits.

**When.** Only while the reads are not a scan (read-ahead has those), and only after
:data:`START_READS` reads. For a dataset larger than mountd's cache the sweep is
**bounded** (``bound_bytes``): what it asked for and was not read yet stays within the
bound (:meth:`outstanding`, which the caller has mountd keep until read), so it keeps a
share of the cache filled with files the reader has yet to read this epoch, where an
unbounded sweep would push out the ones about to be read; and its caller uses it only while
the reads look like one reader's (:attr:`one_reader`). docs/mount.md "A dataset larger than
the cache".

**What.** The ids between the lowest and the highest id read so far, never one read or asked
for before (a bitmap of the dataset's files, one byte each), from where the sweep stopped
last, wrapping round to the low end (the range grows as reads land outside it). A reader of
one folder in random order sweeps that folder; a shuffle over the dataset sweeps the dataset.

**How much.** At most ``factor`` (``--sweep``, default :data:`FACTOR`) times the files and
the bytes read so far for the first time since the sweep started (plus read-ahead's
``START_BYTES``): a reader that stops, stops the sweep, and what it left fetched and unread is
bounded by what it read (the rule of read-ahead's window, with more room: a shuffled reader
reads the range in no order). Reading a file again does not count, so a job that reads only
a random subset of the dataset, epoch after epoch, has at most ``factor`` times that subset
swept, once. A bound in time was tried instead (what was asked and not read yet within ten
seconds of the reader's reads) and taken back: in a shuffled epoch a swept file is read at a
random moment of the rest of the epoch, so most of what is swept waits far longer than that,
and the bound stalled the sweep (a 20,000-image epoch from a bucket: 151 images/s with it,
264 without, docs/benchmark-history.md). With fills that land at once,
a shuffled epoch then reads ~7% of its files as misses (a simulation of uniformly random
reads; 14% with a factor of 4, 30% with 2); measured through the mount, 8 shuffled readers of
2,000 files went from 0.22–0.25 to 0.42–0.49 of the bare fill loop (docs/benchmark-history.md,
`mount_cold.py` on 2026-11-30). The
sweep asks in steps of at least :data:`STEP` files and at most :data:`MAX_STEP`, so that mountd
gets a few notifications, not one per read.

**Again.** Once every file of the dataset was read or asked for, the sweep is done. A miss
after that on a file read since the sweep started (:meth:`Sweep.lost`: the cache lost it, to
evictions or to a mountd restarted on another cache; a file only asked for may simply not
have landed yet) makes the caller start it over (:meth:`Sweep.start_over`) with an empty
bitmap. The caller leaves out files that are in the store, and mountd those it
holds or fetches, so a sweep over cached files costs a ``stat`` each and no fetch.

Pure: ids in, ids out; the caller (quiverfs/filesystem/fs.py) feeds it every first read of a
file (misses as they come, the workers' hits as they report them) and sends what it names.
Not thread-safe; in the mount it lives in the main process's trio thread.
"""

from __future__ import annotations

from collections.abc import Sequence

# START_BYTES: what the sweep may ask for beyond ``factor`` times the bytes read, as read-ahead's
# window before any read (the first steps of a sweep over large files).
from quiverfs.filesystem.readahead import START_BYTES, Sizes

#: Files and bytes the sweep may ask for per file and byte read (see the module docstring).
FACTOR = 8

#: Reads seen before the sweep asks for anything: enough for the range they cover to say
#: what the reader reads (16 uniform reads of a dataset span ~88% of it).
START_READS = 16

#: Fewest files one step asks for (unless fewer are left in the range), and most.
STEP = 32
MAX_STEP = 1024

#: A bounded sweep asks again once reads freed this fraction of its bound (steps of a
#: 32nd of it), not after every read of a file it asked for.
BOUND_STEPS = 32

#: One read in this many of a file read before in the same sweep is still one reader's epoch
#: (a read the kernel sends again after dropping a page); more is several readers.
REREADS = 20

#: A file's state in the sweep's bitmap (0: neither).
_ASKED = 1
_READ = 2
_ASKED_RUN = bytes([_ASKED])


class Sweep:
    """The sweep over the file ids ``first .. last`` (see the module docstring). ``sizes``
    gives the files' sizes, asked about the ranges a step takes. ``bound_bytes``: the most
    bytes asked for and not read yet at any time (a dataset larger than the cache; None: no
    such bound)."""

    def __init__(self, first: int, last: int, sizes: Sizes, factor: int = FACTOR,
                 bound_bytes: int | None = None) -> None:
        if factor < 1:
            raise ValueError(f"the sweep factor must be at least 1, not {factor}")
        if bound_bytes is not None and bound_bytes <= 0:
            raise ValueError(f"the sweep's bound must be positive, not {bound_bytes}")
        self.first = first
        self.last = last
        self.factor = factor
        self.bound_bytes = bound_bytes
        self._sizes = sizes
        #: ids asked for by the sweep since the mount started, and their bytes
        self.requested = 0
        self.requested_bytes = 0
        #: sweeps started over (a file read in a finished sweep missed again: :meth:`lost`)
        self.restarts = 0
        #: first reads of a file in its sweep, over every sweep (a reader's sign of life)
        self.reads_seen = 0
        #: whether the last sweep's reads looked like one reader's (:attr:`one_reader`)
        self._was_one_reader = True
        self._start()

    def _start(self) -> None:
        self._covered = bytearray(self.last - self.first + 1)  # _ASKED or _READ, else 0
        self._left = len(self._covered)  # ids not covered yet
        self._low = self._high = -1  # the range read, as offsets (-1: nothing read yet)
        self._cursor = 0  # where the next step looks first
        self._reads = self._read_bytes = 0  # files read for the first time, and their bytes
        self._rereads = 0  # reads of files read before in this sweep
        self._asked = self._asked_bytes = 0
        #: bounded only: offset -> size of each file asked for and not read yet
        self._outstanding: dict[int, int] = {}
        self.outstanding_bytes = 0

    @property
    def done(self) -> bool:
        """Every file was read or asked for."""
        return self._left == 0

    def lost(self, file_id: int) -> bool:
        """Whether a miss of ``file_id`` means that the cache lost files the sweep is done
        with: it is done, and ``file_id`` was read since it started."""
        if self._left or not self.first <= file_id <= self.last:
            return False
        return self._covered[file_id - self.first] == _READ

    def start_over(self) -> None:
        """Sweep again, with nothing read yet (the cache lost files: :meth:`lost`)."""
        self.restarts += 1
        self._was_one_reader = self.one_reader
        self._start()

    def read(self, file_id: int, size: int) -> bool:
        """Note a read of ``file_id`` (``size`` bytes); whether it is its first since the
        sweep started (only those widen the sweep)."""
        if not self.first <= file_id <= self.last:
            return False
        offset = file_id - self.first
        state = self._covered[offset]
        if state == _READ:
            self._rereads += 1
            return False
        if not state:
            self._left -= 1
        elif self._outstanding:
            self.outstanding_bytes -= self._outstanding.pop(offset, 0)
        self._covered[offset] = _READ
        self._reads += 1
        self.reads_seen += 1
        self._read_bytes += size
        if self._low < 0:
            self._low = self._high = self._cursor = offset
        elif offset < self._low:
            self._low = offset
        elif offset > self._high:
            self._high = offset
        return True

    def read_many(self, file_ids: Sequence[int], nbytes: int) -> None:
        """Note reads of ``file_ids`` (hits the workers reported), ``nbytes`` in all; the
        bytes count in the share of the files read for the first time (a report gives only
        their sum)."""
        if file_ids:
            first = sum(self.read(file_id, 0) for file_id in file_ids)
            self._read_bytes += nbytes * first // len(file_ids)

    def _byte_budget(self) -> int:
        """Bytes a step may ask for: ``factor`` times the bytes read, and for a bounded sweep
        no more than its bound leaves, nothing until reads freed a step's worth of it (not a
        file at a time)."""
        budget = self.factor * self._read_bytes + START_BYTES - self._asked_bytes
        if self.bound_bytes is None:
            return budget
        room = self.bound_bytes - self.outstanding_bytes
        return 0 if room < self.bound_bytes // BOUND_STEPS else min(budget, room)

    @property
    def one_reader(self) -> bool:
        """Whether the reads look like one reader's epoch, each file read once: at most one
        in :data:`REREADS` reads of this sweep was of a file read before in it. Several jobs
        reading the dataset through one mount read each file once each, which shows only
        as their reads meet (a tenth into their epoch): so after a sweep that did not look
        like one reader's, the next is not taken for one until a quarter of the files were
        read with as few rereads."""
        if self._rereads * REREADS > self._reads + self._rereads:
            return False
        return self._was_one_reader or self._reads * 4 >= len(self._covered)

    def outstanding(self) -> list[int]:
        """The ids asked for and not read yet, for a bounded sweep (oldest first; empty for
        an unbounded one): what the caller renews mountd's protection of."""
        first = self.first
        return [first + offset for offset in self._outstanding]

    def step(self) -> list[int]:
        """The ids to ask for now, ascending runs from the cursor on (usually none: fewer
        reads than :data:`START_READS`, the budget used, or nothing left in the range)."""
        if self._reads < START_READS or self._left == 0:
            return []
        budget = min(MAX_STEP, self.factor * self._reads - self._asked)
        byte_budget = self._byte_budget()
        if budget < min(STEP, self._left) or byte_budget <= 0:
            return []
        out: list[int] = []
        covered, first = self._covered, self.first
        wrapped = False
        while budget > 0 and byte_budget > 0:
            offset = covered.find(0, self._cursor, self._high + 1)
            if offset < 0:
                if wrapped:
                    break
                wrapped = True
                self._cursor = self._low
                continue
            # The run of uncovered ids from here, as far as the budget reaches.
            end = offset + 1
            limit = min(self._high + 1, offset + budget)
            while end < limit and not covered[end]:
                end += 1
            sizes = self._sizes(first + offset, first + end - 1)
            for i, size in enumerate(sizes):
                if size > byte_budget and (out or i):
                    end = offset + i
                    byte_budget = 0
                    break
                byte_budget -= size
                self._asked_bytes += size
                self.requested_bytes += size
                if self.bound_bytes is not None and size:  # an empty file is never fetched
                    self._outstanding[offset + i] = size
                    self.outstanding_bytes += size
            covered[offset:end] = _ASKED_RUN * (end - offset)
            out.extend(range(first + offset, first + end))
            self._left -= end - offset
            budget -= end - offset
            self._cursor = end
        self._asked += len(out)
        self.requested += len(out)
        return out
