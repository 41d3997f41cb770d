"""The cache's typed configuration, validated in one place."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from mountd.store.access import StoreModes, store_modes
from mountd.store.holds import SWEEP_SHARE
from quiverfs.base.errors import UsageError


@dataclass(frozen=True)
class CacheConfig:
    """Everything :class:`mountd.store.cache.Cache` needs; the CLI/daemon fill it from flags/config.

    Sizes are bytes (use :func:`mountd.store.layout.parse_size` for ``"10G"``/``"20%"``); rates are
    per second; ``None`` means unlimited.
    """

    cache_dir: Path
    #: Cap on the bytes of verified content in the store (temp files of fills count too).
    cache_size: int
    #: Remote bytes/s across all fills (token bucket); None = unlimited.
    remote_bandwidth: float | None = None
    #: Remote requests/s across all fills (token bucket); None = unlimited.
    remote_requests: float | None = None
    #: Remote reads in flight at once, per source (mountd/store/limits.py ``SourceSlots``).
    #: 64 (16 until 2026-11-30): a bucket answers a GET in 10–50 ms, so the sweep of a
    #: shuffled epoch fetches at most this many ÷ the latency files a second (S), and the
    #: epoch's random order misses about R ÷ 2S of its files at a reading rate R; through an
    #: nginx bucket with 20 ms a GET, a cold epoch of ``peers.py`` (a) ran at 314 images/s
    #: with 64 against 246–284 with 16 (docs/benchmark-history.md).
    remote_concurrency: int = 64
    #: Seconds each remote request waits before its first byte (``--remote-latency-ms``): a
    #: bucket's latency for benchmarks against a loopback emulator; 0 = none.
    remote_latency: float = 0.0
    #: Most bytes one ranged GET of a packed object may span (a chunk fill,
    #: mountd/store/span.py); 0 turns chunk fills off (one GET per file, as for loose files).
    span_max_bytes: int = 4 * 1024 * 1024
    #: Largest run of unwanted bytes (cached members, headers) a chunk fill's span may cross
    #: to reach one more member still wanted.
    span_max_gap: int = 256 * 1024
    #: Fills (ensure + prefetch) writing at once; bounds memory to about fill_concurrency × chunk.
    #: None: 32, or ``remote_concurrency`` if larger (fills must not cap the remote reads).
    fill_concurrency: int | None = None
    #: Background prefetch workers. None: ``remote_concurrency`` (a preload alone can keep
    #: every allowed remote read busy).
    prefetch_concurrency: int | None = None
    #: Queued prefetch items beyond which :meth:`Cache.prefetch` drops the rest.
    prefetch_queue: int = 100_000
    #: Eviction policy name in :data:`mountd.store.policy.POLICIES`.
    policy: str = "lru"
    #: Bytes per remote request when streaming a large object (bounded memory per fill).
    chunk_size: int = 8 * 1024 * 1024
    #: Threads hashing/writing/fsyncing at once (disk work, not network).
    io_threads: int = 8
    #: Token-bucket burst, in seconds of the configured rate.
    burst_seconds: float = 0.1
    #: Seconds between durable checkpoints while fills land (one ``syncfs`` each; after a
    #: power cut, recovery re-verifies at most this much of the newest fills).
    sync_interval: float = 1.0
    #: Keep the store private to mountd's user (folders ``0700``, files ``0400``) instead of
    #: traversable by every local user (``0711``, ``0444``): ``--private-store``
    #: (mountd/store/access.py, docs/operations.md "Security").
    private_store: bool = False
    #: Cap on the bytes charged to each uid (``--user-quota``; mountd/store/quota.py): a fill
    #: for a user at its quota evicts that user's own entries first. None: no quota.
    user_quota: int | None = None
    #: Seconds a file fetched ahead (a claim's misses and brought members, a prefetch) stays
    #: protected from policy eviction when nobody reads it (``--protect-seconds``;
    #: mountd/store/holds.py). 0 turns protection off.
    protect_seconds: float = 30.0
    #: Share of the cache's unpinned room that protected files may take (``--protect-share``);
    #: past it new prefetches wait.
    protect_share: float = 0.5

    @property
    def sweep_share(self) -> float:
        """Share of the room pins leave that a mount's bounded sweep may protect (with
        everyone else's protections): :data:`~mountd.store.holds.SWEEP_SHARE`, or
        ``protect_share`` when that is larger."""
        return max(SWEEP_SHARE, self.protect_share)

    @property
    def store_modes(self) -> StoreModes:
        """The modes the store is given on open (:mod:`mountd.store.access`)."""
        return store_modes(self.private_store)

    def __post_init__(self) -> None:
        object.__setattr__(self, "cache_dir", Path(self.cache_dir))
        if self.fill_concurrency is None:
            object.__setattr__(self, "fill_concurrency", max(32, self.remote_concurrency))
        if self.prefetch_concurrency is None:
            object.__setattr__(self, "prefetch_concurrency", self.remote_concurrency)
        if self.cache_size <= 0:
            raise UsageError(f"cache size must be positive, got {self.cache_size}")
        if self.user_quota is not None and self.user_quota <= 0:
            raise UsageError(f"user quota must be positive or unset, got {self.user_quota}")
        for name in ("remote_bandwidth", "remote_requests"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise UsageError(f"{name.replace('_', ' ')} must be positive or unset, got {value}")
        for name in (
            "remote_concurrency",
            "fill_concurrency",
            "prefetch_concurrency",
            "chunk_size",
            "io_threads",
        ):
            if getattr(self, name) < 1:
                raise UsageError(
                    f"{name.replace('_', ' ')} must be at least 1, got {getattr(self, name)}"
                )
        if not 0 <= self.remote_latency <= 60:  # also refuses NaN
            raise UsageError(f"remote latency must be in [0, 60] seconds, got {self.remote_latency}")
        if self.span_max_bytes < 0 or self.span_max_gap < 0:
            raise UsageError("span max bytes and span max gap must be >= 0")
        if self.prefetch_queue < 0 or self.burst_seconds <= 0:
            raise UsageError("prefetch queue must be >= 0 and burst seconds > 0")
        if not 0 <= self.protect_seconds <= 3600:  # also refuses NaN
            raise UsageError(f"protect seconds must be in [0, 3600], got {self.protect_seconds}")
        if not 0 < self.protect_share <= 1:
            raise UsageError(f"protect share must be in (0, 1], got {self.protect_share}")
        if not 0 < self.sync_interval <= 3600:
            raise UsageError(f"sync interval must be in (0, 3600] seconds, got {self.sync_interval}")
