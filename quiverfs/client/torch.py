"""PyTorch shim: a batch sampler that reads what is cached first (substitutable reads).

``QuiverBatchSampler`` replaces ``shuffle=True`` for a dataset whose files live on a quiverfs mount:
every epoch it claims batches from mountd through the mount's control channel
(:mod:`quiverfs.client.control_client`), so each file is read exactly once per epoch, cached files
first, and the misses it claims are already being fetched when the DataLoader's workers open them::

    from torch.utils.data import DataLoader
    from torchvision.datasets import ImageFolder
    from quiverfs.torch import QuiverBatchSampler

    dataset = ImageFolder("/mnt/imagenet/train", transform=...)
    sampler = QuiverBatchSampler(dataset, batch_size=256)       # rank/world from torch.distributed
    loader = DataLoader(dataset, batch_sampler=sampler, num_workers=8)
    for epoch in range(90):
        sampler.set_epoch(epoch)
        for images, labels in loader:
            ...
    sampler.close()

Claims happen in the process that iterates the sampler (the DataLoader's main process); the
workers only open files, so any number of workers works.

Cached files can also be read without FUSE, straight from the store (:mod:`quiverfs.client.direct`:
from a traversable store, else by descriptors mountd hands over; misses and evicted files go
through the mount)::

    dataset = ImageFolder("/mnt/imagenet/train", transform=..., loader=direct_loader)
    dataset = DirectDataset(paths_or_samples, decode=my_decoder)    # any path-based dataset

This module imports torch; quiverfs itself never does. See docs/shim.md.
"""

from __future__ import annotations

import contextlib
import errno
import math
import os
import random
import secrets
import sys
import time
import warnings
import weakref
from array import array
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from types import FrameType
from typing import Any, BinaryIO

import torch
from torch.utils.data import Dataset, Sampler

from quiverfs.client.control_client import ControlClient, find_mount_root
from quiverfs.client.direct import DirectReader
from quiverfs.client.timing_reports import CLOSE_WAIT, TimingReports
from quiverfs.plan.stagger import epoch_order

__all__ = ["DirectDataset", "QuiverBatchSampler", "direct_loader", "direct_reader", "pil_rgb"]

_warned_off_mount = False


def _dataset_paths(dataset: Any, paths: Sequence[str | os.PathLike[str]] | None) -> list[str]:
    if paths is not None:
        return [os.fspath(p) for p in paths]
    samples = getattr(dataset, "samples", None) or getattr(dataset, "imgs", None)
    if samples is None:
        raise TypeError(
            "QuiverBatchSampler needs the dataset's file paths: pass an ImageFolder-like dataset "
            "(with .samples) or paths=[one path per dataset index]"
        )
    return [os.fspath(s[0]) if isinstance(s, tuple | list) else os.fspath(s) for s in samples]


#: Most id ranges sent as a job's scope: it travels in an xattr name of at most 255 bytes.
MAX_SCOPE_RANGES = 6

#: Seconds a sampler first waits before claiming again when mountd said ``wait`` (no room to
#: protect more misses until the job's readers read theirs); doubled while it keeps saying
#: so, up to :data:`CLAIM_PAUSE_MAX`.
CLAIM_PAUSE = 0.002
CLAIM_PAUSE_MAX = 0.05


class _Wait:
    """The type of :data:`WAIT`."""


#: What :meth:`QuiverBatchSampler._claim` returns for a claim that says ``wait``.
WAIT = _Wait()


def _scope_of(mapping: array) -> str | None:
    """The compact ids this dataset maps to, as ``start-stop`` ranges for the session's
    ``scope`` (so mountd never gives, nor fetches, files the dataset would skip); None when
    they are too scattered to send (the files outside are then claimed and skipped)."""
    ranges: list[str] = []
    start = None
    for cid, index in enumerate(mapping):
        if index >= 0 and start is None:
            start = cid
        elif index < 0 and start is not None:
            ranges.append(f"{start}-{cid}")
            start = None
    if start is not None:
        ranges.append(f"{start}-{len(mapping)}")
    if not ranges or len(ranges) > MAX_SCOPE_RANGES:
        return None
    return ",".join(ranges)


def _distributed() -> tuple[int, int] | None:
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return None


def _shared_job_id() -> str:
    """A fresh job id, the same on every rank (broadcast from rank 0 under DDP)."""
    job = [f"job-{secrets.token_hex(8)}"]
    if _distributed() is not None:
        torch.distributed.broadcast_object_list(job, src=0)
    return job[0]


class QuiverBatchSampler(Sampler[list[int]]):
    """Batches of dataset indices claimed from mountd (see the module docstring).

    ``dataset``: an ImageFolder-like dataset (``.samples`` paths), or pass ``paths`` (one per
    dataset index). ``job``: unique per job and equal on every rank (default: random,
    broadcast from rank 0 when torch.distributed is initialised). ``rank``/``world_size``:
    default from torch.distributed, else 0/1. ``fetch_size``: files per claim — DELI's fetch
    size; the next claim is made when fewer than ``threshold × fetch_size`` claimed files
    are left (DELI's pre-fetch threshold; 0.5 is the 50/50 rule). Default: ``4 ×
    batch_size``, but no more than the fetch size mountd advises for a chunked dataset (a
    quarter of a chunk between the job's ranks, at least a batch), so that the job's
    look-ahead does not outrun the chunks the cache holds. ``report``: send each mini-batch's
    time (measured between two batches taken from this sampler, so it includes data wait and
    compute) and each epoch's time to mountd. A batch report also says how many files that
    batch had and how many of them its claim gave as misses (``fetch``), so mountd sorts it
    exactly into a hit or a miss sample and scales a short batch to a full one (the
    benefit-aware policy, docs/substitutable-reads.md).
    ``report_lag``: batches the loader takes from this sampler ahead of the training step that
    ends the measured interval — 0 with ``num_workers=0``, ``num_workers × prefetch_factor``
    with worker processes (a DataLoader with 8 workers: 16): the report then names the batch
    that interval trained on. ``None`` (the default): read from the DataLoader that iterates
    this sampler, at each epoch's start (0 when something else iterates it). With ``world_size > 1`` every rank yields exactly ``len(self)`` batches (padding
    with repeats or dropping the excess), as DDP needs equal step counts.

    Off a quiverfs mount (or on a mount without a control channel) it warns once and behaves
    like a seeded shuffled sampler (``DistributedSampler``-style split across ranks).

    Staggered jobs (docs/staggering.md): ``order="shared"`` reads in that seeded shuffled order
    on the mount too, without claims, so every job with the same ``seed`` visits the files in
    one order and a job started later reads what an earlier one cached (the HiPC'23 premise;
    the cache's own policy keeps the files, as in mountd's ``lru`` mode). ``hold_until`` (a
    ``time.time()`` value, e.g. from :func:`quiverfs.plan.start_record.planned_start`) holds the
    first batch until then, so the job can build its model and workers meanwhile.
    """

    def __init__(
        self,
        dataset: Any = None,
        batch_size: int = 32,
        *,
        paths: Sequence[str | os.PathLike[str]] | None = None,
        job: str | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        seed: int = 0,
        epoch: int = 0,
        fetch_size: int | None = None,
        threshold: float = 0.5,
        drop_last: bool = False,
        lookahead: int = 10,
        report: bool = True,
        report_lag: int | None = None,
        order: str = "claims",
        hold_until: float | None = None,
    ) -> None:
        if order not in ("claims", "shared"):
            raise ValueError(f"order must be 'claims' or 'shared', not {order!r}")
        if batch_size < 1:
            raise ValueError("batch_size must be at least 1")
        if not 0 <= threshold <= 1:
            raise ValueError("threshold must be in [0, 1]")
        if report_lag is not None and report_lag < 0:
            raise ValueError("report_lag must be >= 0")
        self.paths = _dataset_paths(dataset, paths)
        if not self.paths:
            raise ValueError("the dataset is empty")
        dist = _distributed()
        self.rank = rank if rank is not None else (dist[0] if dist else 0)
        self.world_size = world_size if world_size is not None else (dist[1] if dist else 1)
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is not below world_size {self.world_size}")
        self.batch_size = batch_size
        self.fetch_size = fetch_size or 4 * batch_size
        #: Whether ``fetch_size`` was left to its default (mountd's advice then bounds it)
        self._fetch_default = not fetch_size
        #: The fetch size mountd advised in its last claim answer (None: none given)
        self.advised_fetch: int | None = None
        self.threshold = threshold
        self.drop_last = drop_last
        self.seed = seed
        self.lookahead = lookahead
        self.report = report
        self.report_lag = report_lag
        #: The report lag of the current (or last) epoch: ``report_lag``, or the DataLoader's
        #: depth when that is None (:func:`_loader_depth`)
        self.lag = report_lag or 0
        #: The last epoch a claim found over for the job (``ESTALE``), to warn when a rank
        #: got nothing of it
        self._stale_epoch: int | None = None
        #: False once the mount refused a claim's batch size (a mount or mountd older than
        #: it: EINVAL); later claims go without it (and never say ``wait``)
        self._send_batch = True
        #: Claims mountd answered with ``wait`` so far (no room to protect more misses until
        #: this job's readers read theirs): a cache too small for the loaders' look-ahead
        self.claim_waits = 0
        self.order = order
        self.hold_until = hold_until
        self.job = job or _shared_job_id()
        self._start_epoch = epoch
        self._epoch: int | None = None  # set_epoch's value for the next __iter__
        self._last_epoch: int | None = None
        self._started = time.monotonic()
        self.root = find_mount_root(os.path.dirname(self.paths[0]))
        self.control: ControlClient | None = None
        self.session: dict[str, Any] = {}
        #: the compact id ranges of this dataset's files, sent as the job's scope (None: all)
        self.scope: str | None = None
        self._cid_to_index = array("q")
        self.mapped = len(self.paths)
        if self.root is not None and order == "claims":
            self._open_on_mount(epoch)
        self._finalizer: weakref.finalize | None = None
        #: The thread making claims ahead (:meth:`_claims_ahead`), and its process
        self._claimer: ThreadPoolExecutor | None = None
        self._claimer_pid = 0
        #: Timing reports, sent by a thread so that the training loop never waits for them
        #: (quiverfs/client/timing_reports.py); None off a mount
        self._reports: TimingReports | None = None
        if self.control is None:
            if order == "claims":
                _warn_off_mount(self.paths[0])
        else:
            self._reports = TimingReports(self.control, self.job, self.rank)
            self._finalizer = weakref.finalize(self, _close_session, self.control, self.job,
                                               self.rank, None, self._reports)

    # -- set-up -------------------------------------------------------------------------------

    def _open_on_mount(self, epoch: int) -> None:
        control = ControlClient(self.root)  # type: ignore[arg-type]
        try:
            table = control.paths()
        except OSError as exc:
            if exc.errno in (errno.ENODATA, errno.ENOTSUP, errno.EOPNOTSUPP):
                return  # a mount without a control channel: fall back
            raise
        index = {os.path.relpath(p, self.root): i for i, p in enumerate(self.paths)}
        mapping = array("q", [-1]) * len(table)
        mapped = 0
        for cid, rel in enumerate(table):
            i = index.get(rel)
            if i is not None:
                mapping[cid] = i
                mapped += 1
        self._cid_to_index = mapping
        self.mapped = mapped
        self.scope = _scope_of(mapping) if mapped < len(table) else None
        self.session = self._open(control, epoch)
        self.control = control

    def _open(self, control: ControlClient, epoch: int) -> dict[str, Any]:
        return control.request(
            "open", job=self.job, rank=self.rank, world=self.world_size, epoch=epoch,
            seed=self.seed, lookahead=self.lookahead, scope=self.scope,
        )

    @property
    def on_quiver(self) -> bool:
        """Whether claims come from mountd (False: the shuffled fallback)."""
        return self.control is not None

    # -- the Sampler protocol -----------------------------------------------------------------

    def set_epoch(self, epoch: int) -> None:
        """The epoch the next iteration reads (otherwise: the previous one + 1)."""
        self._epoch = epoch

    def _samples_per_rank(self) -> int:
        return math.ceil(self.mapped / self.world_size)

    def __len__(self) -> int:
        n = self._samples_per_rank()
        return n // self.batch_size if self.drop_last else math.ceil(n / self.batch_size)

    def __iter__(self) -> Iterator[list[int]]:
        if self._epoch is not None:
            epoch = self._epoch
        elif self._last_epoch is not None:
            epoch = self._last_epoch + 1
        else:
            epoch = self._start_epoch
        self._epoch = None
        self._last_epoch = epoch
        lag = self.report_lag if self.report_lag is not None else _loader_depth(sys._getframe(1))
        self.lag = lag
        batches = self._claimed(epoch) if self.control is not None else self._shuffled(epoch)
        if self.hold_until is not None:
            hold, self.hold_until = self.hold_until, None  # only before the first batch
            while (left := hold - time.time()) > 0:
                time.sleep(min(left, 1.0))
        yield from self._timed(batches, epoch, lag)

    def _timed(self, batches: Iterator[tuple[list[int], int | None]], epoch: int,
               lag: int) -> Iterator[list[int]]:
        """Yield the batches; at each request for the next one, report the interval since the
        previous request with what the batch it trained on read (``lag`` batches back): the
        loader asks for batch ``k+1`` when step ``k - lag`` is done.

        An epoch's first ``lag + 1`` intervals are not reported. The first ``lag`` are the
        loader filling its queue (no step ended: near 0 s), and the next one is step 0's,
        which waited for the workers to start. Both are the loader's start-up, the same
        whether the reads hit or miss; as samples they moved a CPU-bound job's ``b`` from
        1.09 to 1.37 at an epoch's start and turned its dataset back on for 5 s (peers.py
        (b), 2026-11-30). Without workers (``lag`` 0) step 0 is not reported either."""
        started = last = time.monotonic()
        reads: deque[tuple[int, int | None]] = deque(maxlen=lag + 1)
        for k, (batch, misses) in enumerate(batches):
            reads.append((len(batch), misses))
            yield batch
            now = time.monotonic()
            if k > lag and self.report and self._reports is not None:
                files, missed = reads[0]
                self._reports.put("batch", **_batch_args(now - last, files, missed))
            last = now
        if self.report and self._reports is not None:
            self._reports.put("epoch", epoch=epoch, s=_seconds(time.monotonic() - started))

    def _shuffled(self, epoch: int) -> Iterator[tuple[list[int], int | None]]:
        order = epoch_order(len(self.paths), self.seed, epoch)
        if self.world_size > 1:
            total = self._samples_per_rank() * self.world_size
            order += order[: total - len(order)]
            order = order[self.rank : total : self.world_size]
        for start in range(0, len(order), self.batch_size):
            batch = order[start : start + self.batch_size]
            if len(batch) < self.batch_size and self.drop_last:
                return
            yield batch, None  # read through the mount, or off it: nothing known of hits

    def _claimed(self, epoch: int) -> Iterator[tuple[list[int], int | None]]:
        """Batches of claimed indices, each with how many of them the claim gave as misses
        (None for DDP padding: repeats, read again whatever the claim said)."""
        target = len(self) if self.world_size > 1 else None
        buffer: deque[tuple[int, bool]] = deque()  # (dataset index, given as a miss)
        recent: list[int] = []
        produced = 0
        claims = _Claims()
        try:
            while True:
                self._top_up(epoch, buffer, claims)
                if not buffer or (len(buffer) < self.batch_size and self.drop_last):
                    break
                taken = [buffer.popleft() for _ in range(min(self.batch_size, len(buffer)))]
                recent = [i for i, _ in taken]
                yield recent, sum(1 for _, miss in taken if miss)
                produced += 1
                if target is not None and produced >= target:
                    return  # DDP: the same step count on every rank (the rest stays unread)
        finally:
            if claims.ahead is not None:  # left early: the claim's end (its files stay unread)
                with contextlib.suppress(Exception):
                    claims.ahead.result()
        if produced == 0 and self._stale_epoch == epoch:
            warnings.warn(
                f"QuiverBatchSampler: epoch {epoch} of job {self.job} was over before rank "
                f"{self.rank} claimed anything (its other ranks are more than an epoch ahead: "
                "keep ranks in step, as DDP does); this rank reads nothing this epoch",
                RuntimeWarning, stacklevel=2,
            )
        rng = random.Random(f"pad:{self.seed}:{epoch}:{self.rank}")
        while target is not None and produced < target and recent:
            yield [rng.choice(recent) for _ in range(self.batch_size)], None
            produced += 1

    def fetch_now(self) -> int:
        """The fetch size of the next claim: ``fetch_size``, or when that is the default and
        mountd advised one, the advice (at least a batch, at most the default)."""
        if not self._fetch_default or self.advised_fetch is None:
            return self.fetch_size
        return max(self.batch_size, min(self.fetch_size, self.advised_fetch))

    def _top_up(self, epoch: int, buffer: deque[tuple[int, bool]], claims: _Claims) -> None:
        """Claim until ``buffer`` holds ``threshold × fetch size`` files (at least a batch) or
        the epoch is given out; return early while a batch is left and the claim is still in
        flight, or mountd says ``wait``."""
        while not claims.end and len(buffer) < max(self.batch_size,
                                                   int(self.threshold * self.fetch_now())):
            if claims.ahead is None:
                claims.ahead = self._claims_ahead().submit(self._claim, epoch)
            if len(buffer) >= self.batch_size and not claims.ahead.done():
                return  # a batch is here: the claim lands while it is read
            claimed, claims.ahead = claims.ahead.result(), None
            if claimed is None:
                claims.end = True
            elif claimed is WAIT:
                self.claim_waits += 1
                # No room for more misses until this job's readers read what they have
                # (mountd/coop/claims.py): yield a batch if there is one, else let the
                # DataLoader's workers read for a moment.
                if len(buffer) >= self.batch_size:
                    return
                time.sleep(claims.pause)
                claims.pause = min(2 * claims.pause, CLAIM_PAUSE_MAX)
            else:
                claims.pause = CLAIM_PAUSE
                for cids, miss in ((claimed[0], False), (claimed[1], True)):
                    buffer.extend((i, miss) for i in (self._cid_to_index[c] for c in cids)
                                  if i >= 0)

    def _claims_ahead(self) -> ThreadPoolExecutor:
        """The thread that makes this process's claims (:meth:`_claimed`): a claim is a
        control-channel request (~4 ms on the 2-core VM), and the sampler runs inside the
        training loop's wait for its next batch. Made once the buffer falls below the
        threshold, as before, it is no longer waited for while a batch is left to yield
        (14 claims of a DELI job: 0.057 s of its 0.28 s data wait, papers.py)."""
        if self._claimer is None or self._claimer_pid != os.getpid():
            self._claimer = ThreadPoolExecutor(1, thread_name_prefix="quiverfs-claims")
            self._claimer_pid = os.getpid()
        return self._claimer

    def _claim(self, epoch: int) -> tuple[list[int], list[int]] | _Wait | None:
        """The next claim's compact ids, ``(hits, fetch)``; :data:`WAIT` when mountd has no
        room for more misses yet; None at the end of the epoch."""
        assert self.control is not None
        for _attempt in range(3):
            args: dict[str, Any] = {"job": self.job, "rank": self.rank, "n": self.fetch_now(),
                                    "epoch": epoch}
            if self._send_batch:
                args["batch"] = self.batch_size
            try:
                answer = self.control.request("claim", **args)
            except OSError as exc:
                if exc.errno == errno.ENOENT:  # reaped, or mountd restarted: open again
                    self.session = self._open(self.control, epoch)
                    continue
                if exc.errno == errno.ESTALE:  # this epoch is over for the job
                    self._stale_epoch = epoch
                    return None
                if exc.errno == errno.EINVAL and self._send_batch:
                    self._send_batch = False  # an older mount or mountd: claim without it
                    continue
                raise
            self.advised_fetch = answer.get("advised_fetch")
            if not answer["hits"] and not answer["fetch"]:
                return WAIT if answer.get("wait") else None
            return answer["hits"], answer["fetch"]
        raise OSError(errno.ENOENT, "the session keeps disappearing; is mountd restarting?")

    # -- timing reports and closing -----------------------------------------------------------

    def report_batch(self, seconds: float, *, files: int | None = None,
                     misses: int | None = None) -> None:
        """Report one mini-batch's time (data wait + compute) now; best effort. ``files`` and
        ``misses`` (together): the batch's files and how many of them its claim gave as
        misses (mountd then classifies the report exactly, docs/control-protocol.md). The
        sampler's own reports go through a thread instead (``_timed``)."""
        if self._reports is not None:
            self._reports.send("batch", **_batch_args(seconds, files, misses))

    def report_epoch(self, epoch: int, seconds: float) -> None:
        """Report one epoch's time now; best effort."""
        if self._reports is not None:
            self._reports.send("epoch", epoch=epoch, s=_seconds(seconds))

    def flush_reports(self, timeout: float = CLOSE_WAIT) -> bool:
        """Wait up to ``timeout`` seconds until the timing reports queued so far were sent
        (before reading mountd's view of the job, e.g. ``quiverfs stats``); whether they
        were."""
        return self._reports is None or self._reports.flush(timeout)

    def close(self) -> None:
        """Send the reports still queued, then close this rank's session (with its run
        time). Also done at exit."""
        if self._claimer is not None and self._claimer_pid == os.getpid():
            self._claimer.shutdown(wait=True)
            self._claimer = None
        if self._finalizer is not None and self._finalizer.detach() is not None:
            assert self.control is not None
            _close_session(self.control, self.job, self.rank, time.monotonic() - self._started,
                           self._reports)


@dataclass
class _Claims:
    """One epoch's claims in :meth:`QuiverBatchSampler._claimed`: the claim in flight, the
    pause after a ``wait``, and whether the epoch is given out."""

    ahead: Future | None = None
    pause: float = CLAIM_PAUSE
    end: bool = False


def _seconds(seconds: float) -> str:
    return f"{max(0.0, seconds):.6f}"


def _batch_args(seconds: float, files: int | None, misses: int | None) -> dict[str, Any]:
    """A ``batch`` report's arguments: the time, and what the batch read when known."""
    if misses is None or files is None:
        return {"s": _seconds(seconds)}
    return {"s": _seconds(seconds), "files": files, "misses": misses}


def _loader_depth(frame: FrameType | None) -> int:
    """Batches the DataLoader iterating a sampler keeps in flight ahead of the training
    loop (``num_workers × prefetch_factor``; 0 without workers, or when no DataLoader is
    found): the report lag that makes a batch report name the batch its interval trained on.

    torch has no public handle from a sampler to the loader that drives it, so this looks at
    the caller: a DataLoader iterator asks its batch sampler for the next batch from its own
    method (``_next_index``), whose ``self`` carries ``_num_workers`` and ``_prefetch_factor``.
    Without it every report named a batch ``depth`` steps late, and a job that waited on its
    misses most of the time was measured insensitive (15 workers: 30 batches late)."""
    for _ in range(4):  # the generator's caller, or a wrapper or two above it
        if frame is None:
            break
        owner = frame.f_locals.get("self")
        workers = getattr(owner, "_num_workers", None)
        if isinstance(workers, int) and hasattr(owner, "_prefetch_factor"):
            return workers * (getattr(owner, "_prefetch_factor", 0) or 0)
        frame = frame.f_back
    return 0


def _close_session(control: ControlClient, job: str, rank: int, seconds: float | None = None,
                   reports: TimingReports | None = None) -> None:
    if reports is not None:
        reports.flush()  # the last batch and epoch reports before the session goes
    with contextlib.suppress(OSError):  # already closed, unmounted, or mountd gone
        control.request("close", job=job, rank=rank, s=None if seconds is None else _seconds(seconds))


def _warn_off_mount(path: str) -> None:
    global _warned_off_mount
    if not _warned_off_mount:
        _warned_off_mount = True
        warnings.warn(
            f"QuiverBatchSampler: {path} is not on a quiverfs mount with a control channel; "
            "reading in a seeded shuffled order instead",
            RuntimeWarning, stacklevel=3,
        )


# -- direct reads: cached files straight from the store ------------------------------------------

#: The reader behind :func:`direct_loader` and, by default, :class:`DirectDataset`: one per
#: process (its state is per process: workers open their own digest and mountd connection).
_reader = DirectReader()


def direct_reader() -> DirectReader:
    """The shared :class:`~quiverfs.client.direct.DirectReader` (``flush()``, ``counts()``)."""
    return _reader


def pil_rgb(f: BinaryIO) -> Any:
    """An open image file decoded as torchvision's default loader does (PIL, RGB)."""
    from PIL import Image  # pillow comes with torchvision, which this module does not need

    image = Image.open(f)
    return image.convert("RGB")


def direct_loader(path: str | os.PathLike[str]) -> Any:
    """torchvision's default image loader, reading cached files from the store:
    ``ImageFolder(root, loader=direct_loader)`` (misses and evicted files through the mount)."""
    with _reader.open(path) as f:
        return pil_rgb(f)


class DirectDataset(Dataset):
    """A path-based dataset whose files are read from the store when cached (docs/shim.md).

    ``samples``: one path per index, or ``(path, target)`` pairs (an ``ImageFolder``'s
    ``.samples``). Item ``i`` is ``transform(decode(file))``, with
    ``target_transform(target)`` beside it when the samples carry targets. ``decode`` takes
    the open file (default :func:`pil_rgb`, as ``ImageFolder``; ``lambda f: f.read()`` for
    bytes). :meth:`of` wraps a dataset that has ``.samples`` (or ``.imgs``), keeping its
    transforms. The mount's digest is opened, and the samples' directories mapped, here in
    the process that builds the dataset, so that forked DataLoader workers share them.
    """

    def __init__(self, samples: Sequence[Any], decode: Callable[[BinaryIO], Any] = pil_rgb,
                 transform: Callable[[Any], Any] | None = None,
                 target_transform: Callable[[Any], Any] | None = None,
                 reader: DirectReader | None = None) -> None:
        pairs = [(os.fspath(s[0]), s[1]) if isinstance(s, tuple | list) else (os.fspath(s), None)
                 for s in samples]
        self.has_targets = bool(samples) and isinstance(samples[0], tuple | list)
        self.samples = pairs
        self.targets = [t for _, t in pairs] if self.has_targets else []
        self.decode = decode
        self.transform = transform
        self.target_transform = target_transform
        self.reader = reader or _reader
        for directory in dict.fromkeys(os.path.dirname(path) for path, _ in pairs):
            if not self.reader.prepare(directory):
                break  # on no mount read directly here: most likely the rest neither

    @classmethod
    def of(cls, dataset: Any, decode: Callable[[BinaryIO], Any] = pil_rgb,
           reader: DirectReader | None = None) -> DirectDataset:
        """``dataset`` (an ``ImageFolder``, any dataset with ``.samples`` or ``.imgs``) read
        directly, with its ``transform`` and ``target_transform``."""
        samples = getattr(dataset, "samples", None) or getattr(dataset, "imgs", None)
        if samples is None:
            raise TypeError("DirectDataset.of needs a dataset with .samples (path, target) pairs")
        return cls(samples, decode, getattr(dataset, "transform", None),
                   getattr(dataset, "target_transform", None), reader)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> Any:
        path, target = self.samples[index]
        with self.reader.open(path) as f:
            return self._item(self.decode(f), target)

    def __getitems__(self, indices: Sequence[int]) -> list[Any]:
        """Items ``indices``, as a DataLoader worker fetches a whole batch (PyTorch calls
        this instead of ``__getitem__`` per index): the files are opened together
        (:meth:`~quiverfs.client.direct.DirectReader.open_many`), so a reader that asks mountd for
        descriptors (hand-off) sends one request per batch (of up to 64 files)."""
        samples = [self.samples[i] for i in indices]
        files = self.reader.open_many([path for path, _ in samples])
        try:
            decoded = [self.decode(f) for f in files]
        finally:
            for f in files:
                f.close()
        return [self._item(item, target) for item, (_, target) in zip(decoded, samples, strict=True)]

    def _item(self, item: Any, target: Any) -> Any:
        """A decoded file as the dataset gives it: transformed, with its target if any."""
        if self.transform is not None:
            item = self.transform(item)
        if not self.has_targets:
            return item
        if self.target_transform is not None:
            target = self.target_transform(target)
        return item, target
