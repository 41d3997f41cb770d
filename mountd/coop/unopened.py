"""Files a chunked dataset's claims gave out that no reader has opened yet, counted per chunk.

Why: a marked chunk stays resident for its *grace* so that the files its jobs were given last
are still there when their DataLoaders read them (mountd/coop/chunks.py). Until the mounts
reported opens, mountd could only guess when that was: a fixed second, or "the job was given
a window more since" (:meth:`mountd.coop.claims.EpochPool._drained`), and both guesses are
wrong in one regime or another. Held too long, the next chunk cannot load (two slots) and the
jobs run ahead into misses; ended too soon, the given files go before they are read and are
read on demand (docs/benchmark-history.md, `shim_vs_lru.py` at 600 files). CPython's
``open()`` sends the mount an ``isatty`` ioctl on every open, even one the kernel's pages
serve, and the mount reports those opens (docs/mount.md "Zero-message opens"): so a chunk
whose every given file has been opened as many times as it was given has nothing left to
keep for anyone, and its grace can end at once.

Counts, not identities: a file given to four jobs is kept until four opens of it were seen.
Opens are not attributed to jobs (a DataLoader worker's open names only its process), so a
job that opens a file twice stands in for one that has not opened it yet; an open of a file
nobody was given counts for nothing. A give whose open never comes (a job killed, a reader
that sends no ioctl) keeps its chunk's count above zero until the chunk is evicted
(:meth:`forget`): the grace's time then decides, as before.

Pure bookkeeping, no I/O; runs in mountd's trio thread with its :class:`DatasetState`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from mountd.coop.plans import Moves


class Unopened:
    """Per file, reads given out and not opened yet; per chunk, their sum.

    ``chunk_of`` maps a compact id to its chunk *now* (chunks are re-drawn: :meth:`moved`
    keeps the sums in step); ``chunks`` is the plan's chunk count."""

    def __init__(self, chunk_of: Callable[[int], int], chunks: int) -> None:
        self._chunk_of = chunk_of
        self._files: dict[int, int] = {}
        self._chunks = [0] * chunks

    def given(self, file_id: int) -> None:
        """``file_id`` was given to a job: one more open of it to wait for."""
        self._files[file_id] = self._files.get(file_id, 0) + 1
        self._chunks[self._chunk_of(file_id)] += 1

    def opened(self, ids: Iterable[int]) -> int:
        """Readers opened ``ids`` (one open each); returns how many were waited for."""
        files, chunks, chunk_of = self._files, self._chunks, self._chunk_of
        counted = 0
        for i in ids:
            n = files.get(i)
            if not n:
                continue
            if n == 1:
                del files[i]
            else:
                files[i] = n - 1
            chunks[chunk_of(i)] -= 1
            counted += 1
        return counted

    def all_opened(self, chunk: int) -> bool:
        """Whether every file given out of ``chunk`` has been opened as often as given."""
        return self._chunks[chunk] == 0

    def waiting(self, chunk: int) -> int:
        """Opens ``chunk`` still waits for."""
        return self._chunks[chunk]

    def total(self) -> int:
        """Opens every chunk together still waits for."""
        return sum(self._chunks)

    def moved(self, moves: Moves) -> None:
        """Files changed chunk (free chunks re-drawn): their waits move with them."""
        files, chunks = self._files, self._chunks
        for (old, new), ids in moves.items():
            n = sum(files.get(i, 0) for i in ids)
            chunks[old] -= n
            chunks[new] += n

    def forget(self, ids: Iterable[int]) -> None:
        """Stop waiting for opens of ``ids`` (their chunk was evicted: whoever reads one
        now reads it as a miss, and a stale wait would keep the chunk's next residency in
        its grace for the full time)."""
        files, chunks, chunk_of = self._files, self._chunks, self._chunk_of
        for i in ids:
            n = files.pop(i, 0)
            if n:
                chunks[chunk_of(i)] -= n
