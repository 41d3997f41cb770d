"""The data movement of a fill: read, verify, write, rename. Blocking; no trio, no index.

This is the part of a fill that scales with the cores. mountd's main process decides *what*
to fill (single-flight, reservations, quotas, limits, holds: :mod:`mountd.store.cache`) and
hands each fill to a fill process as a :class:`FillJob`; the fill process runs
:func:`execute` in one of its threads (:mod:`mountd.store.fillpool`). The same function runs
in mountd's own worker threads when mountd has no fill processes (``--fill-processes 0``, and
the cache's unit tests), so there is one implementation of the steps, whoever runs them:

1. read the content: a ranged GET of the backend (retried there,
   :meth:`~quiverfs.base.backends.base.Backend.call_blocking`), a descriptor a client supplied
   (``pread``), or bytes a peer sent;
2. check its size and blake3 against the hash (bad bytes never reach a final name);
3. write a temp file in ``tmp/`` (:class:`~mountd.store.disk.TempFile`);
4. give it the store's mode and rename it into ``store/ab/cd/<hex>``.

Objects larger than ``chunk_size`` stream chunk by chunk (memory bounded by the chunk),
hashed as they arrive, and renamed only once the whole hash matched. A chunk fill (a
:class:`SpanJob`) reads one byte range of a packed object and stores each member on its own.

The main process indexes what lands, in the trio thread; a file at its final name is
complete and verified whether or not it is indexed yet (recovery adopts such a file after a
crash: docs/store-layout.md).

Disk full: a write that fails with ENOSPC asks the main process for room (``room(bytes)``:
it evicts, outside its own accounting, until the disk has that much free), then writes the
same range once more, as often as the main process says the room is there (:class:`RoomWait`:
other fills met the same wall and may take the room first). When the main process cannot
make the room, or a write fails :data:`ROOM_TRIES` times with the room there, or
:data:`ROOM_WAIT` seconds pass, that file fails with :class:`~mountd.errors.CacheFull`. The
temp file is always removed when a file fails.

Each job measures its stages (wall and CPU seconds of ``read``, ``hash``, ``write``,
``rename``) for the fill breakdown ``quiverfs stats`` shows (:class:`StageTimes`).
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

import blake3

from mountd.errors import CacheFull
from mountd.stats.counters import WORK_STAGES
from mountd.store import disk
from mountd.store.supplied import pread_all
from quiverfs.base.backends.base import Location
from quiverfs.base.errors import CorruptObject


class Target(NamedTuple):
    """One file a job stores: its content hash and size, and where it lies (for messages).

    Jobs are tuples: they cross to a fill process for every fill, and a tuple pickles in a
    fraction of the time a dataclass takes."""

    hash: bytes
    size: int
    url: str
    key: str
    offset: int
    length: int

    @classmethod
    def of(cls, hash: bytes, size: int, location: Location) -> Target:
        return cls(hash, size, location.url, location.key, location.offset, location.length)

    @property
    def location(self) -> Location:
        return Location(self.url, self.key, self.offset, self.length)


class FillJob(NamedTuple):
    """Fill one file from ``source``:

    * ``"remote"``: ``target``'s location, of the backend at ``target.url``;
    * ``"fd"``: the job's descriptor (bytes a client supplied, or a peer's spool file), the
      content at ``offset`` of it;
    * ``"bytes"``: ``data`` (a peer's small file).
    """

    target: Target
    source: str = "remote"
    offset: int = 0
    data: bytes = b""
    chunk_size: int = 8 << 20


class SpanJob(NamedTuple):
    """A chunk fill (:mod:`mountd.store.span`): bytes ``[start, start + length)`` of ``key``
    under ``url`` in one GET, then each of ``members`` cut out, verified and stored."""

    url: str
    key: str
    start: int
    length: int
    members: tuple[Target, ...]


class BatchJob(NamedTuple):
    """Several loose files of the backend at ``url``, each filled exactly as a
    :class:`FillJob` of its own (one GET, verified, stored, a bad file never spoiling the
    others), ``parallel`` of them at once (:meth:`Store.fill_batch`).

    Read-ahead queues files by the dozen; sending them as one job costs mountd's main process
    one message, one wait and one answer for the lot, instead of one each (issue 34). The
    main process holds a remote slot for each file it lets run at once (``parallel``), so
    as many requests overlap as if each file were a job; it sends no batch while the remote
    limits pace requests (each file then takes its tokens in its turn)."""

    url: str
    members: tuple[Target, ...]
    chunk_size: int = 8 << 20
    parallel: int = 1


class StageTimes:
    """Wall and CPU seconds a job spent in each of :data:`WORK_STAGES`: ``values`` holds the
    wall seconds of each stage, then the CPU seconds of each (a flat list travels cheaply
    between processes)."""

    __slots__ = ("values",)

    def __init__(self, values: list[float] | None = None) -> None:
        self.values = values if values is not None else [0.0] * (2 * len(WORK_STAGES))

    @staticmethod
    def clock() -> tuple[float, float]:
        """Now, as (wall, thread CPU) seconds."""
        return time.perf_counter(), time.thread_time()

    def merge(self, other: StageTimes) -> None:
        """Add ``other``'s times to these."""
        values = self.values
        for k, value in enumerate(other.values):
            values[k] += value

    def add(self, stage: int, since: tuple[float, float]) -> tuple[float, float]:
        """Charge the time from ``since`` to now to stage number ``stage``; returns now."""
        now = time.perf_counter(), time.thread_time()
        values = self.values
        values[stage] += now[0] - since[0]
        values[stage + len(WORK_STAGES)] += now[1] - since[1]
        return now


READ, HASH, WRITE, RENAME = range(len(WORK_STAGES))

#: Writes of one range that failed with the room for it free on the disk (a quota, no inodes
#: left: evicting does not help), each after the main process said the room was there,
#: before the file fails.
ROOM_TRIES = 8

#: Seconds one write or rename goes on asking for room and trying again while other fills
#: take the room made for it first (:class:`RoomWait`). A CI run had a 1 MiB fill fail after 8
#: such losses in a row, each with the room made a moment before (2026-11-30).
ROOM_WAIT = 30.0

#: Bytes asked for when a rename meets a full disk (a new fan-out folder's first block).
FOLDER_ROOM = 64 << 10


@dataclass(slots=True)
class Outcome:
    """What a job did: for each of its targets, the final path or the error that file failed
    with; the size of each GET that returned bytes (counted as requests whatever came of
    the bytes); its stage times. ``error`` is set when a chunk fill's read failed: every
    member failed with it."""

    results: list[str | BaseException]
    gets: list[int] = field(default_factory=list)
    stages: StageTimes = field(default_factory=StageTimes)
    error: BaseException | None = None


class FillStopped(Exception):
    """The fill's caller was cancelled while the job streamed: it stopped between two chunks
    and its temp file is gone (nothing of it reached the store)."""


class RoomWait:
    """The tries of one write or rename that met a full disk.

    Fills that meet a full disk together all ask for room; the main process makes it for
    each in turn and says so, and the first to write takes it: on a loaded machine a fill
    lost that race 7 times in a row. Losing is no reason to fail, so a try counts only when
    the room was there and the write still failed (the disk shows ``need`` bytes free after
    it: a quota or the inodes, which no eviction helps); losses are retried until
    :data:`ROOM_WAIT` seconds after the first full disk."""

    def __init__(self, cache_dir: str) -> None:
        self.cache_dir = cache_dir
        self.deadline: float | None = None
        self.futile = 0

    def again(self, need: int, gate: Gate) -> bool:
        """After a write of ``need`` more bytes failed for want of space: ask ``gate`` for
        the room; True to write again, False when the file fails."""
        now = time.monotonic()
        if self.deadline is None:
            self.deadline = now + ROOM_WAIT
        elif disk.space(self.cache_dir)[1] >= need:
            self.futile += 1
        if self.futile >= ROOM_TRIES or now >= self.deadline:
            return False
        return gate.room(need)


class Gate(Protocol):
    """What a running job asks of whoever runs it (mountd's main process, over the fill
    process's socket, or through trio from a worker thread)."""

    def room(self, need: int) -> bool:
        """The disk is full: have ``need`` bytes made free (blocks until done); False when
        they could not be (the file fails)."""
        ...

    def next_read(self, nbytes: int, remote: bool) -> None:
        """Before each read of a streamed job after its first: a ``remote`` read waits for
        the remote limits (its request and ``nbytes`` of bandwidth, as a read of its own
        would); any read raises :class:`FillStopped` when the fill was cancelled."""
        ...


class Reader(Protocol):
    """Where a job's bytes come from: a backend (``call_blocking`` around ``_read_range``)
    or a descriptor."""

    def read(self, offset: int, length: int) -> bytes:
        """Up to ``length`` bytes at ``offset`` (short only at the end)."""
        ...


class BackendReader:
    """A backend's blocking ranged reads of one key, retried and counted by the backend."""

    def __init__(self, backend, key: str) -> None:
        self.backend = backend
        self.key = key

    def read(self, offset: int, length: int) -> bytes:
        if length == 0:
            return b""
        backend = self.backend
        return backend.call_blocking("GET", self.key, backend._read_range, self.key, offset,
                                     length)


class FdReader:
    """``pread`` of a descriptor (bytes a client supplied, a peer's spool file)."""

    def __init__(self, fd: int, url: str) -> None:
        self.fd = fd
        self.url = url

    def read(self, offset: int, length: int) -> bytes:
        return pread_all(self.fd, offset, length, self.url)


class BytesReader:
    """Bytes already in memory (a peer's small file)."""

    def __init__(self, data: bytes) -> None:
        self.data = data

    def read(self, offset: int, length: int) -> bytes:
        return self.data[offset:offset + length]


class Store:
    """Where a process's fills land: the cache directory and the fan-out folders it knows.
    Shared by the threads of a process."""

    def __init__(self, cache_dir: str | os.PathLike[str]) -> None:
        self.cache_dir = os.fspath(cache_dir)
        self.fanout = disk.Fanout()

    # -- one file ------------------------------------------------------------------------------

    def fill(self, job: FillJob, reader: Reader, gate: Gate) -> Outcome:
        """Run ``job`` (one file) with its bytes from ``reader``."""
        target = job.target
        out = Outcome([""])
        remote = job.source == "remote"
        base = target.offset if remote else job.offset
        try:
            if target.length != target.size:
                raise corrupt(target, f"digest says {target.size} bytes but its location has "
                                      f"{target.length}")
            if target.size <= job.chunk_size:
                t = out.stages.clock()
                data = reader.read(base, target.size) if target.size else b""
                t = out.stages.add(READ, t)
                if remote and target.size:
                    out.gets.append(len(data))
                out.results[0] = self._store_small(target, data, out.stages, t, gate)
            else:
                out.results[0] = self._stream(job, reader, base, out, gate)
        except Exception as exc:  # noqa: BLE001 - every failure is this file's answer
            out.results[0] = exc
        return out

    def _store_small(self, target: Target, data: bytes, stages: StageTimes,
                     t: tuple[float, float], gate: Gate) -> str:
        """Verify ``data`` (one chunk) and store it."""
        check_size(target, len(data), target.size)
        check_hash(target, digest(data))
        t = stages.add(HASH, t)
        return self._write(target, data, stages, t, gate)

    def _write(self, target: Target, data: bytes | memoryview, stages: StageTimes,
               t: tuple[float, float], gate: Gate) -> str:
        """Write verified bytes to a temp file and rename it into the store; one retry after
        asking for room when the disk is full."""
        temp = disk.TempFile(self.cache_dir, target.hash)
        try:
            self._write_at(temp, data, 0, target.size, gate)
            t = stages.add(WRITE, t)
            path = self._commit(temp, target.size, gate)
            stages.add(RENAME, t)
            return path
        except BaseException:
            temp.discard()
            raise

    def _stream(self, job: FillJob, reader: Reader, base: int, out: Outcome, gate: Gate) -> str:
        """A file larger than one chunk: read, hash and write chunk by chunk."""
        target, chunk = job.target, job.chunk_size
        size = target.size
        stages = out.stages
        t = stages.clock()
        temp = disk.TempFile(self.cache_dir, target.hash)
        committed = False
        try:
            hasher = blake3.blake3()  # one thread: see digest()
            offset = 0
            while offset < size:
                n = min(chunk, size - offset)
                if offset:
                    gate.next_read(n, job.source == "remote")
                    t = stages.clock()  # waiting for the limits is not reading
                data = reader.read(base + offset, n)
                t = stages.add(READ, t)
                if job.source == "remote":
                    out.gets.append(len(data))
                if len(data) != n:
                    check_size(target, offset + len(data), size)
                hasher.update(data)
                t = stages.add(HASH, t)
                self._write_at(temp, data, offset, size, gate)
                t = stages.add(WRITE, t)
                offset += n
            check_hash(target, hasher.digest())
            path = self._commit(temp, size, gate)
            stages.add(RENAME, t)
            committed = True
            return path
        finally:
            if not committed:
                temp.discard()

    # -- several files -------------------------------------------------------------------------

    def fill_batch(self, job: BatchJob, backend, gate: Gate,
                   spawn: Callable[[Callable[[], object]], Future] | None = None) -> Outcome:
        """Run a :class:`BatchJob`: each member as :meth:`fill` runs one file, up to
        ``job.parallel`` at once: this thread and ``parallel - 1`` more started by ``spawn``
        (a thread pool's ``submit``; None: this thread alone), each taking the next member
        not taken yet. A member after the first first asks ``gate.next_read`` whether to go
        on (:class:`FillStopped` once the job's caller was cancelled: that member and the
        rest are not read)."""
        members = job.members
        out = Outcome([""] * len(members))
        turns = itertools.count()  # next() of a count is atomic: one member per taker
        stopped: list[FillStopped] = []

        def take_turns() -> StageTimes:
            stages = StageTimes()
            for i in turns:
                if i >= len(members):
                    break
                member = members[i]
                if i and not stopped:
                    try:
                        gate.next_read(min(member.size, job.chunk_size), False)
                    except FillStopped as exc:
                        stopped.append(exc)
                    except Exception as exc:  # noqa: BLE001 - this member's answer, the
                        out.results[i] = exc  # others' files must still be reported
                        continue
                if stopped:
                    out.results[i] = stopped[0]
                    continue
                one = self.fill(FillJob(member, "remote", chunk_size=job.chunk_size),
                                BackendReader(backend, member.key), gate)
                out.results[i] = one.results[0]
                out.gets.extend(one.gets)
                stages.merge(one.stages)
            return stages

        helpers = [] if spawn is None else [
            spawn(take_turns) for _ in range(min(job.parallel, len(members)) - 1)]
        out.stages.merge(take_turns())
        for helper in helpers:
            out.stages.merge(helper.result())
        return out

    # -- a chunk fill ----------------------------------------------------------------------------

    def fill_span(self, job: SpanJob, reader: Reader, gate: Gate) -> Outcome:
        """Run a chunk fill: one read of the span, then each member on its own (a bad member
        never spoils its neighbours; a failed read fails them all)."""
        out = Outcome([""] * len(job.members))
        stages = out.stages
        t = stages.clock()
        try:
            data = reader.read(job.start, job.length)
        except Exception as exc:  # noqa: BLE001 - every member's answer
            out.error = exc
            out.results = [exc] * len(job.members)
            return out
        t = stages.add(READ, t)
        out.gets.append(len(data))
        view = memoryview(data)
        for i, member in enumerate(job.members):
            at = member.offset - job.start
            try:
                out.results[i] = self._store_small(member, bytes(view[at:at + member.size]),
                                                   stages, t, gate)
            except Exception as exc:  # noqa: BLE001 - this member's answer
                out.results[i] = exc
            t = stages.clock()
        return out

    def _write_at(self, temp: disk.TempFile, data: bytes | memoryview, offset: int, size: int,
                  gate: Gate) -> None:
        """Write ``data`` at ``offset`` of ``temp`` (a ``size``-byte file); on a full disk ask
        ``gate`` for room for the rest of the file and write again (see the module
        docstring)."""
        waits = RoomWait(self.cache_dir)
        while True:
            try:
                temp.write_at(data, offset)
                return
            except OSError as exc:
                if not disk.is_enospc(exc):
                    raise
                temp.truncate(offset)  # hold nothing of this range while waiting for room
                if not waits.again(size - offset, gate):
                    raise self.disk_full(size) from exc

    def _commit(self, temp: disk.TempFile, size: int, gate: Gate) -> str:
        """Rename ``temp`` (a ``size``-byte file) into the store; on a full disk (no room
        for a new fan-out folder) ask ``gate`` for :data:`FOLDER_ROOM` and rename again."""
        waits = RoomWait(self.cache_dir)
        while True:
            try:
                return temp.commit(self.fanout)
            except OSError as exc:
                if not disk.is_enospc(exc):
                    raise
                if not waits.again(FOLDER_ROOM, gate):
                    raise self.disk_full(size) from exc

    def disk_full(self, size: int) -> CacheFull:
        return CacheFull(
            f"no space left on the device holding {self.cache_dir} for a {size}-byte file, "
            "even after evicting; lower the cache size or free disk space"
        )


def digest(data: bytes | memoryview) -> bytes:
    """The blake3 of ``data``, in this thread only.

    Never with blake3's own thread pool (``max_threads=AUTO``, rayon): the fills of a fill
    process already run side by side, and that pool does not survive ``fork``: a fill
    process forked after its parent had hashed with it (a replacement, or one forked in a
    test process) hung in its first large hash (2026-11-28)."""
    return blake3.blake3(data).digest()


def check_size(target: Target, got: int, size: int) -> None:
    if got != size:
        raise corrupt(target, f"remote returned {got} bytes, digest says {size}")


def check_hash(target: Target, got: bytes) -> None:
    if got != target.hash:
        raise corrupt(target, f"blake3 of the bytes is {got.hex()[:16]}…, expected "
                              f"{target.hash.hex()[:16]}…")


def corrupt(target: Target, why: str) -> CorruptObject:
    """The error of bytes that do not verify: nothing of them is cached."""
    location = target.location
    return CorruptObject(
        f"content of {target.hash.hex()} does not verify ({why}; {location.length} bytes at "
        f"offset {location.offset}); not cached",
        url=location.url,
        key=location.key,
    )


