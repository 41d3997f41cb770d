"""Timing reports of jobs: recent mini-batch times, epoch and session times, and the hit and
miss samples of the benefit-aware policy (Quiver §5.3, :mod:`mountd.coop.benefit`).

**Classifying a report.** A batch report does not say which files the batch read, so each one
is classified by what the job's last :data:`CLASSIFY_CLAIMS` claims gave it (all ranks
together; the shim's buffer and the DataLoader's prefetch read a few claims behind): at least
:data:`PURE` of their files cached at claim time makes it a *hit* sample, at least
:data:`PURE` uncached a *miss* sample, anything between is not used. A claim's misses are
fetched at once (sampler-informed prefetch), so a miss sample is what the job gets from an
uncached dataset here — the right ``t_miss`` for deciding whether to cache it. ``t_hit`` and
``t_miss`` are the means of their samples (a DataLoader hands batches over in bursts, and a
claim's wait falls on its first batch: :attr:`JobTimings.t_hit`, :attr:`JobTimings.t_miss`).

**Probes.** A job whose ``t_hit`` is known but whose ``t_miss`` is not (or was measured
:data:`~mountd.coop.benefit.PROBE_PERIOD` ago, or only by its cold start while a larger
``b`` could make its dataset ``full``: :meth:`JobTimings.early_probe_due`) is probed: for a
while its claims give only uncached unread files
(:meth:`mountd.coop.claims.EpochPool.claim_uncached`; still files of its epoch not given
yet, so exactly once holds), and its miss samples are collected apart
until :data:`~mountd.coop.benefit.PROBE_BATCHES` are in (or the probe times out); they then
replace the job's miss samples, and from then on only probes refresh them (natural misses
of a cached dataset are prefetched or co-operative, nearly as fast as hits: they measure
the cache working, not what the job would get without it). A wholly cached dataset has
nothing uncached to give: its job's probe ends at once and its cold start stands
(:meth:`JobTimings.cannot_probe`).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from mountd.coop.benefit import (
    HIT_SAMPLES,
    MISS_SAMPLES,
    PROBE_BATCHES,
    PROBE_MAX_CLAIMS,
    PROBE_MAX_S,
    JobBenefit,
)

__all__ = ["CLASSIFY_CLAIMS", "COLD_MISS_SAMPLES", "PURE", "SETTLE_REPORTS", "JobTimings", "Probe", "TimingSummary", "classify_batch"]

#: Claims whose hit share classifies a batch report.
CLASSIFY_CLAIMS = 4
#: Share of hits (or misses) over those claims that makes a report a hit (or miss) sample.
PURE = 0.9
#: Hit and miss samples kept per job.
SAMPLES = 64
#: Reports per rank a job's samples skip after its dataset's mode changed
#: (:meth:`JobTimings.settle`): the batches in flight then (a DataLoader holds workers x
#: prefetch_factor of them, 8 with 4 workers, and the shim reports that many behind) were
#: claimed under the old mode and are read under the new one, and the first of them pays for
#: the change (chunks released or drawn again). In peers.py (b), 2026-11-30, the batch right
#: after a dataset went ``off`` took 5.2 s against 0.12 s, its one miss sample raised the
#: job's ``b`` from 0.91 to 5.95, and the dataset went off and on twice in 0.54 s.
SETTLE_REPORTS = 16
#: Natural miss samples kept of a job whose dataset its mode caches (its cold start; see
#: :meth:`JobTimings.on_batch`): several claims' worth, so that the mean spans their waits.
COLD_MISS_SAMPLES = 16


def classify_batch(files: int, misses: int) -> str | None:
    """"hit" (no file of the batch was given uncached), "miss" (at least :data:`PURE` of its
    files were) or None (mixed, or an empty batch) for a batch whose reporter knows which of
    its files its claims gave as hits and which as fetches."""
    if files <= 0:
        return None
    if misses == 0:
        return "hit"
    if misses >= PURE * files:
        return "miss"
    return None


@dataclass
class Probe:
    """A running probe: the job's claims give only uncached files until it ends."""

    started: float
    claims: int = 0
    samples: list[float] = field(default_factory=list)

    def done(self, now: float) -> bool:
        return (len(self.samples) >= PROBE_BATCHES or self.claims >= PROBE_MAX_CLAIMS
                or now - self.started >= PROBE_MAX_S)


@dataclass(frozen=True)
class TimingSummary:
    """What a job reported (kept for the benefit-aware policy, Quiver §5.3)."""

    batches: int  # mini-batch reports ever
    recent: tuple[float, ...]  # the last ``ring`` mini-batch times, oldest first
    mean: float | None  # of ``recent``
    median: float | None  # of ``recent``
    epochs: tuple[tuple[int, int, float], ...]  # recent (epoch, rank, seconds)
    closed: int  # sessions closed
    session_seconds: tuple[float, ...]  # run times reported at close, recent ones


@dataclass
class JobTimings:
    """One job's reports; ``ring`` recent mini-batch times are kept."""

    ring: int
    batches: int = 0
    recent: deque = field(init=False)
    epochs: deque = field(default_factory=lambda: deque(maxlen=64))
    closed: int = 0
    session_seconds: deque = field(default_factory=lambda: deque(maxlen=64))
    #: The job's world size (its GPUs), set when it opens.
    world_size: int = 1
    hit_times: deque = field(default_factory=lambda: deque(maxlen=SAMPLES))
    miss_times: deque = field(default_factory=lambda: deque(maxlen=SAMPLES))
    #: (hits, misses) of the job's last claims.
    given: deque = field(default_factory=lambda: deque(maxlen=CLASSIFY_CLAIMS))
    probe: Probe | None = None
    probes: int = 0
    #: Clock when ``t_miss`` was last measured (by a probe, or first from natural misses), or
    #: a probe last ended without measuring it: when the next probe is due counts from here.
    miss_measured: float | None = None
    #: True once a probe measured ``t_miss``: from then on only probes refresh it.
    probed: bool = False
    #: True when a probe found nothing uncached to give (the dataset wholly cached: no probe
    #: can measure the job while it stays so): ``t_miss`` then stands on the cold start's
    #: natural misses even when fewer than :data:`MISS_SAMPLES` (:meth:`cannot_probe`).
    cold_only: bool = False
    #: ``b`` as the last allocation saw it (None: not measured then).
    allocated_b: float | None = None
    #: The most files a report said its batch had: the job's batch size, to which a shorter
    #: batch's time is scaled (an epoch's last batch is not a fast full one).
    batch_files: int = 0
    #: Reports still to skip since the dataset's mode changed (:meth:`settle`).
    settling: int = 0
    #: Files the job's claims gave, and files its batch reports said they read (reports
    #: that say): the difference is what the job holds ahead of its training step.
    given_files: int = 0
    reported_files: int = 0
    #: The most files the job held ahead of its training step when a report came in:
    #: claimed, not yet reported read (the shim's buffer, the DataLoader's ``num_workers x
    #: prefetch_factor`` batches, the reports' lag). None until a report says how many files
    #: its batch read. The misses among them must fit the cache's protection room to be
    #: fetched ahead (:class:`mountd.coop.benefit.DatasetDemand` ``max_pinned``).
    ahead_files: int | None = None

    def __post_init__(self) -> None:
        self.recent = deque(maxlen=self.ring)

    # -- benefit samples ---------------------------------------------------------------------

    def settle(self) -> None:
        """The job's dataset changed mode: skip its next :data:`SETTLE_REPORTS` reports per
        rank (none for a job that has reported nothing yet: nothing of it was in flight)."""
        if self.batches:
            self.settling = SETTLE_REPORTS * self.world_size

    def on_claim(self, hits: int, misses: int) -> None:
        """A claim gave the job ``hits`` cached and ``misses`` uncached files."""
        if hits or misses:
            self.given.append((hits, misses))
        self.given_files += hits + misses
        if self.probe is not None:
            self.probe.claims += 1

    def classify(self) -> str | None:
        """"hit", "miss" or None (mixed, or no claims yet) for a batch reported now."""
        hits = sum(h for h, _ in self.given)
        total = hits + sum(m for _, m in self.given)
        if not total:
            return None
        if hits >= PURE * total:
            return "hit"
        if total - hits >= PURE * total:
            return "miss"
        return None

    def on_batch(self, seconds: float, now: float, read: tuple[int, int] | None = None, *,
                 cached: bool = False, off: bool = False) -> bool:
        """Sort a mini-batch time into the hit or miss samples (or the probe's); True when
        this report made the job measured (both ``t_hit`` and ``t_miss`` known) for the
        first time, so that the allocation can use its ``b`` at once.

        ``read``: ``(files, misses)`` of this very batch when the reporter knows them (exact:
        :func:`classify_batch`); else the job's last claims decide (:meth:`classify`). A
        batch of fewer files than the job's largest reported one counts as a full batch at
        the same time per file, so that hit and miss samples compare per file.

        ``cached``: the job's dataset is held by its mode (``full`` or ``chunked``). Its
        first :data:`COLD_MISS_SAMPLES` natural misses count (the cold start), later ones
        not: they are claims' prefetched or co-operative misses, nearly hit-fast, and
        measure the cache working, not what the job would get without it.

        ``off``: the job's dataset is ``off``. Its hits then are files left cached from
        before, read while nothing is loaded for the dataset: they measure neither regime and
        are not samples. ``t_hit`` is the batch time with the cache, chunk loads included:
        on two cores a CPU-bound job's hits took 0.25-0.29 s a batch while its chunks loaded
        and 0.14-0.17 s once its dataset was off, and those later hits alone, against its
        misses (0.22 s), measured ``b`` 1.5 and turned the dataset back on, where it was
        slower (peers.py (b), 2026-11-30).
        """
        kind = self.classify() if read is None else classify_batch(*read)
        if read is not None:
            self.batch_files = max(self.batch_files, read[0])
            self.reported_files += read[0]
            ahead = max(0, self.given_files - self.reported_files)
            self.ahead_files = ahead if self.ahead_files is None else max(self.ahead_files, ahead)
        if self.settling:
            self.settling -= 1
            return False
        if kind is None:
            return False
        if read is not None and 0 < read[0] < self.batch_files:
            seconds = seconds * self.batch_files / read[0]
        was = self.measured
        if kind == "hit":
            if not off:
                self.hit_times.append(seconds)
        elif self.probe is not None:
            self.probe.samples.append(seconds)
        elif not self.probed and not (cached and len(self.miss_times) >= COLD_MISS_SAMPLES):
            # Natural misses stand in until a probe measures t_miss: all of them while the
            # dataset is uncached (``off``: each is a fetch from the bucket, the signal
            # that can turn it back on), only the cold start's while it is cached. After
            # that they are a different regime (a cached dataset's claims prefetch their
            # misses, a job's co-operative misses ride on others' fills: nearly hit-fast),
            # and letting them in drifted b towards 1: a sensitive dataset turned off
            # mid-run (benefit_aware.py at 15%, 2026-11-27), and at 90% the medium jobs,
            # 12x faster with the cache, measured b 1.0-1.4 and their wholly cached
            # dataset went off (2026-11-28); Quiver measures t_miss by probing.
            self.miss_times.append(seconds)
            if self.miss_measured is None and len(self.miss_times) >= MISS_SAMPLES:
                self.miss_measured = now
        return not was and self.measured

    @property
    def measured(self) -> bool:
        """Both ``t_hit`` and ``t_miss`` known: the job has a ``b``."""
        return self.t_hit is not None and self.t_miss is not None

    @property
    def t_hit(self) -> float | None:
        """The *mean* of the hit samples. A DataLoader's workers hand their batches over in
        turns, so the intervals between a job's reports come in bursts: with 4 workers three
        of 0.005–0.05 s, then one of 0.3–2.2 s (peers.py (b), 2026-11-30). Their median fell
        on either side by chance, and the same CPU-bound job measured ``b`` 0.42 in one run
        and 5.5 in another; the mean is the job's time per batch, as for ``t_miss``.

        Known from :data:`HIT_SAMPLES` samples."""
        if len(self.hit_times) < HIT_SAMPLES:
            return None
        return sum(self.hit_times) / len(self.hit_times)

    @property
    def t_miss(self) -> float | None:
        """The *mean* of the miss samples: a claim's misses are fetched together, so the
        first batch of a claim waits for all of them and the batches after it find their
        files landed: one slow sample, then hit-fast ones. Their median gave two of three
        sensitive jobs ``b`` 0.99–1.16 at a 90% cache, jobs that the cache makes 65x faster
        (benefit_aware.py, 2026-11-28). The mean is the time per batch the job averages
        without the cache, which is what its throughput follows.

        Known from :data:`MISS_SAMPLES` samples, or from any after :meth:`cannot_probe`."""
        if len(self.miss_times) < (1 if self.cold_only else MISS_SAMPLES):
            return None
        return sum(self.miss_times) / len(self.miss_times)

    def probe_due(self, now: float, period: float) -> bool:
        """Whether to start a probe now: ``t_hit`` known, and ``t_miss`` unknown or ``period``
        old; a probe that ended without settling ``t_miss`` (too few samples, or nothing
        uncached to give) is tried again :data:`PROBE_MAX_S` later, not at the next claim.

        A ``t_miss`` from the cold start waits its period too, although a chunked dataset's
        cold misses ride on other jobs' fills and understate it: probing every job as soon as
        its ``t_hit`` is known cost the chunked datasets of benefit_aware.py 2-7% at 15% and
        30% (a probe's uncached files come from outside the loaded chunks, fetched for one
        job at the bucket's pace; 2026-11-28), more than the better ``b`` gained."""
        if self.probe is not None or self.t_hit is None:
            return False
        if self.miss_measured is None:
            return True
        wait = period if self.t_miss is not None else min(period, PROBE_MAX_S)
        return now - self.miss_measured >= wait

    def early_probe_due(self) -> bool:
        """Whether to probe now, before :meth:`probe_due` would, when a measured ``b`` could
        win the job's dataset more cache (mountd.coop.benefit.could_be_full): ``t_hit``
        known, ``t_miss`` known only from natural misses (its cold start), never probed."""
        return self.probe is None and self.probes == 0 and self.measured

    def start_probe(self, now: float) -> None:
        self.probe = Probe(now)
        self.probes += 1

    def finish_probe(self, now: float) -> bool:
        """End the probe if it is done; True when it ended (its samples replace the miss
        samples when there are enough of them; either way the next probe waits a period)."""
        probe = self.probe
        if probe is None or not probe.done(now):
            return False
        self.probe = None
        if len(probe.samples) >= MISS_SAMPLES:
            self.miss_times = deque(probe.samples, maxlen=SAMPLES)
            self.probed = True
        self.miss_measured = now
        return True

    def cannot_probe(self, now: float) -> None:
        """End the probe at once: its dataset has no uncached file to give (wholly cached).
        Quiver probes by rejecting cache lookups; ours gives uncached files, so a wholly
        cached dataset's job (a small dataset that a ``full`` mode loaded before the job
        read it) can only be measured by its cold start: the first claim's batches, of which
        the shim reports all but the first (start-up), fewer than :data:`MISS_SAMPLES`.
        Without this its ``b`` stayed unknown, counted at the assumed 2.0, and kept an
        insensitive dataset cached (benefit_aware.py with datasets of 1200, 600 and 60
        files, 2026-11-28). The next probe is due after the period, or after
        :data:`PROBE_MAX_S` if the job has no miss sample at all."""
        self.probe = None
        self.cold_only = True
        self.miss_measured = now

    def benefit(self, job: str) -> JobBenefit:
        """The job's measured times as the allocator sees them."""
        return JobBenefit(job, self.world_size, self.t_hit, self.t_miss, self.probe is not None)

    def summary(self) -> TimingSummary:
        recent = tuple(self.recent)
        ordered = sorted(recent)
        median = None
        if ordered:
            mid = len(ordered) // 2
            median = ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2
        return TimingSummary(
            batches=self.batches,
            recent=recent,
            mean=sum(recent) / len(recent) if recent else None,
            median=median,
            epochs=tuple(self.epochs),
            closed=self.closed,
            session_seconds=tuple(self.session_seconds),
        )
