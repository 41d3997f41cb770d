"""One fill, as mountd's main process runs it: remote limits, the job, the counters.

The data movement (read, verify, write, rename) runs in a fill process or a worker thread
(:mod:`mountd.store.fillwork`, :mod:`mountd.store.fillpool`); what stays here is what must
be decided in one place for the whole machine: the remote limits every remote read passes
(:mod:`mountd.store.limits`), and the counters of requests and fill stages. Nothing reaches a
final name unverified, and nothing is fsynced here: the cache's checkpoints make fills
durable in groups (:mod:`mountd.store.durability`).

A remote object is one job under one :meth:`RemoteLimits.request` (its concurrency slot and
its first read's tokens); when the job streams it in several ranged GETs (objects larger than
``chunk_size``) each later GET waits for its own tokens first (:meth:`RemoteLimits.pace`,
asked by the job through its gate). Each GET that returned bytes is counted as a request,
whatever came of its bytes.
"""

from __future__ import annotations

import trio

from mountd.errors import CacheClosed
from mountd.stats.counters import WORK_STAGES, Counters
from mountd.store.fillpool import Fills
from mountd.store.fillwork import BatchJob, FillJob, FillStopped, Outcome, SpanJob, Target
from mountd.store.limits import RemoteLimits
from mountd.store.span import Span
from mountd.store.supplied import SuppliedBytes
from quiverfs.base.backends.base import Location


class Filler:
    """Runs fills for the cache through ``fills``; holds no per-fill state."""

    def __init__(self, limits: RemoteLimits, counters: Counters, fills: Fills,
                 chunk_size: int) -> None:
        self.limits = limits
        self.counters = counters
        self.fills = fills
        self.chunk_size = chunk_size

    async def fill(
        self, source: SuppliedBytes | None, hash: bytes, size: int, location: Location,
        dataset: str | None, since: float | None = None, background: bool = False,
    ) -> str:
        """Fetch, verify and store; returns the final path. Raises CorruptObject, CacheFull,
        backend errors. The caller has reserved ``size`` bytes and indexes the result.

        ``source`` None reads ``location`` with mountd's own authority, under the remote
        limits; otherwise the bytes a client supplied (or a peer sent), verified the same
        way, neither limited nor counted as requests (the client did the remote read, under
        its own rights). ``since``: when the fill began waiting (trio time), for the
        ``queue`` stage of ``fill_stages``; ``background``: a prefetch from the queue, which
        takes a request slot only within background work's share
        (:class:`~mountd.store.limits.SourceSlots`)."""
        target = Target.of(hash, size, location)
        if source is None:
            job = FillJob(target, "remote", chunk_size=self.chunk_size)
            # The first read's limits; a streamed object's later chunks are paced by the job.
            async with self.limits.request(min(size, self.chunk_size), location.url,
                                           background):
                outcome = await self._run(job, None, since)
        elif source.inline is not None:
            job = FillJob(target, "bytes", data=source.inline, chunk_size=self.chunk_size)
            outcome = await self._run(job, None, since)
        else:
            job = FillJob(target, "fd", offset=source.offset, chunk_size=self.chunk_size)
            outcome = await self._run(job, source.fd, since)
        self._count(outcome, dataset)
        result = outcome.results[0]
        if isinstance(result, FillStopped):
            # The job stopped because this caller was cancelled: deliver that here.
            await trio.lowlevel.checkpoint()
            raise CacheClosed("the fill was stopped")
        if isinstance(result, BaseException):
            raise result
        return result

    async def fill_span(self, span: Span, dataset: str | None) -> list[str | Exception]:
        """A chunk fill (:mod:`mountd.store.span`): one ranged GET of ``span`` under the remote
        limits, then every member cut out of it, verified and stored exactly as :meth:`fill`
        stores one file.

        Returns, for each of ``span.members``, its final path or the error that member alone
        failed with (:class:`CorruptObject`: its bytes do not verify; :class:`CacheFull`;
        ``OSError``): a bad member never spoils its neighbours. Raises what the GET raised
        (every member failed with it). The caller has reserved ``span.content_bytes``."""
        members = tuple(Target.of(m.hash, m.size, m.location) for m in span.members)
        job = SpanJob(span.url, span.key, span.start, span.length, members)
        async with self.limits.request(span.length, span.url):
            outcome = await self._run(job, None, None)
        self._count(outcome, dataset)
        if outcome.error is not None:
            raise outcome.error
        return outcome.results  # type: ignore[return-value]

    async def fill_batch(self, targets: tuple[Target, ...], url: str, dataset: str | None,
                         since: float | None = None, parallel: int = 1,
                         background: bool = False) -> list[str | Exception]:
        """Several loose files of the backend at ``url`` in one job
        (:class:`~mountd.store.fillwork.BatchJob`), up to ``parallel`` of them at once:
        one remote slot for each that runs at once (the first waited for, the others only
        taken if free now, so a batch never holds more requests than it runs, nor waits
        for a second slot while holding one). Not for paced limits (the cache fills alone
        then: mountd/store/batchfill.py). Returns, for each of ``targets``, its final path
        or the error that file alone failed with (a file the job did not reach because its
        caller was cancelled: :class:`~mountd.store.fillwork.FillStopped`). The caller has
        reserved the files' bytes and indexes the results."""
        limits = self.limits
        async with limits.request(min(targets[0].size, self.chunk_size), url, background):
            extra = limits.concurrency.take_more(url, min(parallel, len(targets)) - 1,
                                                 background)
            try:
                job = BatchJob(url, targets, self.chunk_size, 1 + extra)
                outcome = await self._run(job, None, since)
            finally:
                limits.concurrency.give_back(url, extra, background)
        self._count(outcome, dataset, len(targets))
        return outcome.results  # type: ignore[return-value]

    async def _run(self, job: FillJob | SpanJob | BatchJob, fd: int | None,
                   since: float | None) -> Outcome:
        """Run ``job``; time its ``queue`` (from ``since`` to now) and ``transit`` (the time
        from sending it to its answer that the fill process did not spend working on it)."""
        stages = self.counters.stages
        sent = trio.current_time()
        if since is not None:
            stages.add("queue", sent - since)
        outcome = await self.fills.run(job, fd)
        worked = sum(outcome.stages.values[:len(WORK_STAGES)])
        stages.add("transit", max(0.0, trio.current_time() - sent - worked))
        return outcome

    def _count(self, outcome: Outcome, dataset: str | None, files: int = 1) -> None:
        """The GETs a job of ``files`` files made (each that returned bytes), and its stage
        times."""
        for nbytes in outcome.gets:
            self.counters.add_request(dataset, "GET", nbytes)
        self.counters.add_work_stages(outcome.stages.values, files)
