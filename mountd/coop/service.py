"""Substitutable, co-operative reads inside mountd: the registry wired to the cache.

:class:`CoopService` owns mountd's :class:`~mountd.coop.sessions.SessionRegistry` and one
:class:`~mountd.coop.datasets.DatasetView` per dataset registered with a digest, and does what
docs/substitutable-reads.md ("What the caller must do") asks of mountd:

* **Datasets.** A ``register`` that carries a digest path loads the dataset's compact-id view
  (in the background) and adds it to the registry with the ids already in the store, the
  cache budget (:attr:`CoopService.budget`, ``budget_fraction`` of the cache: headroom above
  two chunks for misses of jobs running ahead) and the mode — fixed by mountd's
  ``--dataset-mode`` (``lru`` for comparisons), or else chosen by benefit.
* **Benefit-aware allocation** (Quiver §5.3, :mod:`mountd.coop.benefit`). Without
  ``--dataset-mode``, each tick where the registry says an allocation is due (a job arrived
  or left, a probe ended, a dataset came or went, or every 30 s) :meth:`CoopService.tick`
  lets the registry choose every dataset's mode and budget by ``G_D`` per byte and performs
  the changes: the chunks an old chunked mode held are unpinned, a dataset the allocation
  makes ``full`` has its files pinned (as they land, too) so that other datasets' misses
  cannot evict it, and one that stops being ``full`` is unpinned. Unpins come before pins.
  The other policies (budget-only: ``registry.benefit_aware = False``; manual:
  ``--dataset-mode``) deal one budget among the datasets in registration order, again at the
  tick after a dataset came or went (:meth:`CoopService.policy` names the one in force).
* **Notifications.** As a :class:`~mountd.store.cache.CacheListener` it forwards every fill,
  removal and failed fill to ``on_cached`` / ``on_evicted`` / ``on_fetch_failed`` for every
  compact id of that hash in every dataset. Events that arrive while a view loads are kept
  and replayed after it is added (the cached set is a snapshot taken before loading).
* **Claims.** A claim's misses start filling at once (:meth:`Cache.fetch_now`: ahead of the
  prefetch queue, under the remote limits), protected until read for the claiming job's
  epoch pool (its owner key ``(dataset, job, epoch)``; mountd/store/holds.py); when the pool
  closes, the next tick releases them (:meth:`SessionRegistry.take_closed`).
* **Peers** (a cluster, docs/cluster.md "Claims"). Every :data:`PEER_ASK_SECONDS` it asks
  the cluster which uncached files of each dataset being read other mountds hold
  (:meth:`mountd.cluster.service.Cluster.held_elsewhere`) and records the answer in the
  dataset's ``peer_held`` bitmap, so that claims give those misses (peer hits) first.
* **Chunk fills.** It names the members of a packed dataset's chunks to the cache
  (:meth:`CoopService.chunk_members`, :meth:`Cache.set_chunk_members`), so every fill mountd
  starts of a packed file (a miss, a claim's miss, a preload, a prefetch) fetches the wanted
  members of its chunk with the same GET (mountd/store/span.py).
* **Ticks.** About every second, right after claims and notifications, and when a marked
  chunk's grace ends (:meth:`SessionRegistry.next_deadline`),
  :meth:`CoopService.tick` performs the registry's actions: ``Preload`` pins the chunk's
  cached files and starts the pull-model preload (DELI's 50/50 rule: windows of
  ``preload_window`` files, the next one pulled when half of the previous is in), files of a
  loading or resident chunk are pinned as they land (so LRU pressure from other datasets
  cannot evict them), and ``Evict`` unpins the chunk and removes exactly its files with
  :meth:`Cache.evict_hashes`, except those another resident chunk or dataset still holds
  and those the dataset keeps across epochs (the allocation's ``retain`` bytes, chosen at
  random among an evicted chunk's files, unpinned: :meth:`CoopService._retain`).
* **Packed datasets (Brand).** A claim's misses come a packed chunk at a time; the other
  wanted members of those packed chunks (``Claim.brought``) are fetched with them and
  protected like the misses, as many as the protection share has room for (the registry
  asks :meth:`Holds.room <mountd.store.holds.Holds.room>`). A packed chunk larger than a few
  percent of the cache is warned about at registration (:data:`PACKED_CHUNK_WARN_SHARE`).

Everything runs in mountd's trio thread; each method is atomic between awaits.
"""

from __future__ import annotations

import logging
import random
from collections import deque
from collections.abc import Iterator, Sequence
from typing import Any

import trio

from mountd.cluster.service import Cluster
from mountd.coop.benefit import BENEFIT_AWARE, BUDGET_ONLY, MANUAL, DatasetDemand, counted_benefits
from mountd.coop.chunks import ChunkReady, Evict, Preload
from mountd.coop.dataset_state import DatasetState, protection_owner
from mountd.coop.datasets import DatasetView, load_view
from mountd.coop.jobs import OUT_OF_PHASE, SessionInfo, widest_phase
from mountd.coop.plans import Mode
from mountd.coop.sessions import SessionRegistry
from mountd.errors import UnknownDataset
from mountd.store.cache import Cache
from mountd.store.span import Member
from quiverfs.base.backends.base import Location
from quiverfs.base.errors import QuiverError

log = logging.getLogger("mountd.coop.service")

#: Seconds between two ticks when nothing wakes the loop earlier.
TICK_INTERVAL = 1.0

#: Seconds a tick waits after the store changed (a fill landed, files left), so that the
#: changes of the next few milliseconds share it; claims and notifications tick at once.
TICK_COALESCE = 0.002

#: Share of the cache given to managed datasets as their budget (the rest is headroom for
#: misses outside the two resident chunks).
BUDGET_FRACTION = 0.8

#: Seconds after which a preload never reported filled or failed is presumed lost.
PRELOAD_TTL = 120.0

#: A packed chunk of more than this share of the cache is warned about: every claim miss
#: brings up to a chunk, so a few jobs' chunks fill the protection share and claims stop
#: bringing members (one GET per file again), or, unprotected, they are evicted unread
#: (256-file chunks on a 20% cache fetched 12x the dataset an epoch: packed_training.py).
PACKED_CHUNK_WARN_SHARE = 0.05

#: In a cluster: seconds between two rounds of asking the peers what they hold, and the most
#: uncached files of one dataset asked about per round (32 bytes each on the wire).
PEER_ASK_SECONDS = 2.0
PEER_ASK_FILES = 16384


def _uncached_from(cached: bytearray, start: int, limit: int) -> list[int]:
    """Up to ``limit`` ids whose ``cached`` byte is 0, from ``start`` on and round (a C-speed
    search between them: a mostly cached dataset costs no Python step per cached file)."""
    out: list[int] = []
    for low, high in ((start, len(cached)), (0, start)):
        position = cached.find(0, low, high)
        while position >= 0 and len(out) < limit:
            out.append(position)
            position = cached.find(0, position + 1, high)
    return out


def info_json(info: SessionInfo) -> dict[str, Any]:
    """A :class:`SessionInfo` as sent over the wire."""
    return {
        "dataset": info.dataset, "job": info.job, "rank": info.rank,
        "world_size": info.world_size, "epoch": info.epoch, "seed": info.seed,
        "lookahead": info.lookahead, "files": info.files, "quota": info.quota,
        "mode": str(info.mode),
    }


class CoopService:
    """The session layer of one mountd (see the module docstring).

    ``cache`` is the :class:`~mountd.store.cache.Cache`; ``mode`` None chooses each dataset's mode
    from the budget, else forces it (``"lru"``, ``"off"``, ``"full"``, ``"chunked"``);
    ``preload_window`` bounds the preload fills in flight per dataset (default: half the
    cache's fill concurrency, so claimed misses always find fill slots).
    """

    def __init__(
        self,
        cache: Cache,
        *,
        registry: SessionRegistry | None = None,
        mode: str | None = None,
        budget: int | None = None,
        budget_fraction: float = BUDGET_FRACTION,
        preload_window: int | None = None,
        tick_interval: float = TICK_INTERVAL,
        cluster: Cluster | None = None,
    ) -> None:
        self.cache = cache
        #: The cluster this mountd is in (None: alone): claims prefer files peers hold.
        self.cluster = cluster
        self.registry = registry or SessionRegistry()
        if self.registry.protect_room is None:
            self.registry.protect_room = cache.protect_room
        if self.registry.protect_pending is None:
            self.registry.protect_pending = cache.protect_pending
        if self.registry.reports_opens is None:
            self.registry.reports_opens = cache.reports_opens
        self.mode = Mode(mode) if mode is not None else None
        self.registry.benefit_aware = self.mode is None
        config = cache.config
        self.budget = budget if budget is not None else int(config.cache_size * budget_fraction)
        # a dataset read by one job leaves room for its look-ahead (SessionRegistry._max_pinned)
        self.registry.cache_bytes = config.cache_size
        self.registry.protect_share = config.protect_share
        self.preload_window = preload_window or max(2, config.fill_concurrency // 2)
        self.tick_interval = tick_interval
        self.views: dict[str, DatasetView] = {}
        #: Datasets some mount running as mountd's own user registered: mountd may read their
        #: sources itself (claims' misses, preloads). Other users' mounts supply their bytes.
        self.mountd_fills: set[str] = set()
        self.digests: dict[str, str] = {}
        #: dataset being loaded → set when its load ended; in the order the loads started,
        #: which is the order datasets enter the registry (:meth:`_earlier_loads`)
        self._loading: dict[str, trio.Event] = {}
        self._load_errors: dict[str, QuiverError] = {}
        self._pending: dict[str, list[tuple[str, Any]]] = {}
        #: dataset → hash → clock when its preload was started
        self._preloading: dict[str, dict[bytes, float]] = {}
        self._wake = trio.Event()
        #: A wake that must not wait for others to share its tick (see :meth:`wake`).
        self._urgent = False
        self._nursery: trio.Nursery | None = None
        #: (dataset, chunk, files removed, forced) of the last co-ordinated evictions
        self.evictions: deque[tuple[str, int, int, bool]] = deque(maxlen=1000)
        #: dataset -> a warning about its layout for this cache (``stats``' ``warnings``)
        self.warnings: dict[str, str] = {}
        #: dataset -> hash -> size of the files a chunked dataset keeps across epochs (chosen
        #: at chunk evictions up to the allocation's ``retain`` bytes, :meth:`_retain`; not
        #: pinned: the cache's LRU takes them after every other evictable file
        #: (``Cache.set_retained``), and then they are forgotten here)
        self.retained: dict[str, dict[bytes, int]] = {}
        self._retain_rng = random.Random()
        cache.add_listener(self)
        cache.set_chunk_members(self.chunk_members)
        cache.set_retained(self._is_retained)

    # -- lifetime ----------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The tick loop and the home of background view loads; until cancelled."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            if self.cluster is not None:
                nursery.start_soon(self._ask_peers)
            try:
                task_status.started()
                while True:
                    with trio.move_on_after(self._until_next_tick()):
                        await self._wake.wait()
                    if self._wake.is_set() and not self._urgent:
                        # Only the store changed: let the fills landing meanwhile share this
                        # tick (a tick per fill was a fifth of mountd's CPU on a cold pass).
                        await trio.sleep(TICK_COALESCE)
                    self._wake = trio.Event()
                    self._urgent = False
                    try:
                        self.tick()
                    except Exception:  # a bug in one tick must not stop the loop
                        log.exception("tick failed")
            finally:
                self._nursery = None

    async def _ask_peers(self) -> None:
        """Keep each read dataset's :attr:`~mountd.coop.dataset_state.DatasetState.peer_held`
        current: every :data:`PEER_ASK_SECONDS`, ask the cluster which of up to
        :data:`PEER_ASK_FILES` uncached files (the next ones after those asked last time,
        round the dataset) other mountds hold, so that claims give those misses first."""
        offsets: dict[str, int] = {}
        while True:
            await trio.sleep(PEER_ASK_SECONDS)
            for name, view in list(self.views.items()):
                try:
                    await self._ask_peers_about(name, view, offsets)
                except Exception:  # a bug here must not stop mountd: claims just lose the hint
                    log.exception("asking the peers about dataset %s failed", name)

    async def _ask_peers_about(self, name: str, view: DatasetView, offsets: dict[str, int]) -> None:
        assert self.cluster is not None
        try:
            state = self.registry.dataset(name)
        except QuiverError:
            return
        if not state.pools:
            return
        start = offsets.get(name, 0) % max(1, state.count)
        ids = _uncached_from(state.cached, start, PEER_ASK_FILES)
        offsets[name] = (ids[-1] + 1) if ids else 0
        if not ids:
            return
        held = await self.cluster.held_elsewhere(view.hashes_of(ids))
        try:
            current = self.registry.dataset(name)
        except QuiverError:
            return  # removed meanwhile
        if self.views.get(name) is view and current is state:  # nor replaced
            state.set_peer_held(ids, held)

    def _until_next_tick(self) -> float:
        """Seconds to the next tick: the tick interval, or less when a chunk's grace ends
        sooner (its eviction lets the next chunk preload; waiting a whole interval more
        would stretch every grace by up to a second)."""
        deadline = self.registry.next_deadline()
        if deadline is None:
            return self.tick_interval
        return max(0.005, min(self.tick_interval, deadline - self.registry.clock() + 0.001))

    def wake(self) -> None:
        """Run a tick now (after claims and notifications)."""
        self._urgent = True
        self._wake.set()

    def wake_soon(self) -> None:
        """Run a tick within :data:`TICK_COALESCE` (the store changed: many fills land
        together, and one tick serves them all)."""
        self._wake.set()

    def close(self) -> None:
        """Stop listening to the cache and close the digests."""
        self.cache.remove_listener(self)
        self.cache.set_chunk_members(None)
        self.cache.set_retained(None)
        for view in self.views.values():
            view.close()
        self.views.clear()

    # -- datasets ----------------------------------------------------------------------------

    def dataset_registered(self, dataset: str, digest: str | None, *, fills: bool = True) -> None:
        """A mount registered ``dataset`` with its digest path: load its view (in the
        background when :meth:`run` is running, else on the first session).

        ``fills``: the mount runs as mountd's own user, so mountd may read the dataset's
        sources itself (claims' misses and preloads start fills). For other users' datasets
        it never does: their mounts supply what they read (docs/operations.md "Security")."""
        if fills:
            self.mountd_fills.add(dataset)
        if digest is None or dataset in self.views or dataset in self._loading:
            return
        self.digests[dataset] = digest
        self._load_errors.pop(dataset, None)
        if self._nursery is not None:
            self._start_load(dataset)

    def dataset_unregistered(self, dataset: str) -> None:
        """The last registration of ``dataset`` went: forget it unless sessions are open."""
        self.mountd_fills.discard(dataset)
        view = self.views.get(dataset)
        if view is None:
            return
        try:
            self.registry.remove_dataset(dataset)
        except QuiverError:
            return  # sessions still read it: keep it until they are done
        del self.views[dataset]
        self._preloading.pop(dataset, None)
        self.retained.pop(dataset, None)
        self._unpin(view.hashes)
        view.close()

    def _start_load(self, dataset: str) -> trio.Event:
        event = self._loading[dataset] = trio.Event()
        self._pending[dataset] = []
        assert self._nursery is not None
        self._nursery.start_soon(self._load, dataset, event)
        return event

    async def _load(self, dataset: str, event: trio.Event) -> None:
        try:
            # Snapshot first, then buffer events until the view is in the registry.
            present = self.cache.index.all_hashes()
            view = await load_view(dataset, self.digests[dataset])
            try:
                cached = await trio.to_thread.run_sync(lambda: list(view.cached_ids(present)))
                await self._earlier_loads(dataset)
                mode = self.registry.add_dataset(
                    dataset, view.sizes, budget=self.budget, mode=self.mode, cached=cached,
                    packing=view.packing,
                )
            except BaseException:
                view.close()
                raise
            self.views[dataset] = view
            log.info("dataset %s: %d files, %d cached, mode %s", dataset, view.count, len(cached), mode)
            self._check_packing(dataset, view)
            for event_name, arg in self._pending.pop(dataset, []):
                self._forward(event_name, arg, only=dataset)
            self.wake()
        except QuiverError as exc:
            log.warning("cannot load dataset %s: %s", dataset, exc)
            self._load_errors[dataset] = exc
        except Exception as exc:
            log.exception("loading dataset %s failed", dataset)
            self._load_errors[dataset] = UnknownDataset(f"dataset {dataset} could not be loaded: {exc}")
        finally:
            self._pending.pop(dataset, None)
            self._loading.pop(dataset, None)
            event.set()

    async def _earlier_loads(self, dataset: str) -> None:
        """Wait for the loads started before ``dataset``'s to end (added or failed): datasets
        enter the registry in the order they were registered, whichever view loads faster,
        as the budget-only and manual policies deal the budget in registration order (a small
        dataset registered second loaded first and took the first share:
        benefit_aware.py's budget-only runs changed modes from one run to the next)."""
        for other, event in list(self._loading.items()):
            if other == dataset:
                return
            await event.wait()

    def _check_packing(self, dataset: str, view: DatasetView) -> None:
        """Warn (log and ``stats``) when ``dataset``'s largest packed chunk is more than
        :data:`PACKED_CHUNK_WARN_SHARE` of the cache."""
        packing = view.packing
        if packing is None or packing.chunks == 0:
            return
        sizes = view.sizes
        largest = max(sum(sizes[i] for i in packing.members_of(c)) for c in range(packing.chunks))
        cap = self.cache.config.cache_size
        if largest > PACKED_CHUNK_WARN_SHARE * cap:
            text = (f"dataset {dataset}: its largest packed chunk ({largest} bytes) is "
                    f"{largest / cap:.0%} of the cache ({cap} bytes); chunks of more than "
                    f"{PACKED_CHUNK_WARN_SHARE:.0%} fetch members that cannot be kept until "
                    "read: pack smaller chunks (digests pack --chunk-size) or raise --cache-size")
            self.warnings[dataset] = text
            log.warning("%s", text)

    async def ensure_view(self, dataset: str) -> DatasetView:
        """The loaded view of ``dataset``, waiting for (or starting) its load;
        :class:`UnknownDataset` when no mount registered it with a digest."""
        if not isinstance(dataset, str):
            raise UnknownDataset("dataset must be a string")
        while True:
            view = self.views.get(dataset)
            if view is not None:
                return view
            event = self._loading.get(dataset)
            if event is None:
                if dataset in self._load_errors:
                    raise self._load_errors[dataset]
                if dataset not in self.digests:
                    raise UnknownDataset(
                        f"dataset {dataset} is not registered with a digest (mount it first)"
                    )
                if self._nursery is None:
                    event = trio.Event()
                    self._loading[dataset] = event
                    self._pending[dataset] = []
                    await self._load(dataset, event)
                    continue
                event = self._start_load(dataset)
            await event.wait()

    def chunk_members(self, dataset: str | None, content_hash: bytes,
                      location: Location) -> list[Member] | None:
        """The members of the chunk that holds ``content_hash`` at ``location`` in
        ``dataset`` (:meth:`DatasetView.chunk_members`), or None: no view of ``dataset``
        (unknown, not loaded yet, no digest), a loose dataset or file."""
        view = self.views.get(dataset) if dataset is not None else None
        return None if view is None else view.chunk_members(content_hash, location)

    # -- cache events (CacheListener) ----------------------------------------------------------

    def filled(self, hashes: Sequence[bytes]) -> None:
        self._forward("filled", list(hashes))

    def removed(self, hashes: Sequence[bytes]) -> None:
        for kept in self.retained.values():  # a scrub, say: kept no more
            for h in hashes:
                kept.pop(h, None)
        self._forward("removed", list(hashes))

    def fill_failed(self, hash: bytes) -> None:
        self._forward("fill_failed", hash)

    def record_opened(self, dataset: str | None, hashes: Sequence[bytes]) -> None:
        """Readers of ``dataset`` opened ``hashes`` (its mounts' reports, ``hits.opened``,
        told after the cache's :meth:`~mountd.store.protection.Protection.record_opened`):
        a marked chunk whose given files are all opened ends its grace
        (mountd/coop/unopened.py), so tick now."""
        view = self.views.get(dataset) if dataset is not None else None
        if view is None:
            return
        try:
            state = self.registry.dataset(dataset)
        except UnknownDataset:  # unregistered meanwhile
            return
        if state.unopened is None:  # no chunks: nothing waits for opens, no ids to look up
            return
        if state.opened([i for h in hashes for i in view.ids_of(h)]):
            self.wake()

    def _forward(self, event: str, arg: Any, only: str | None = None) -> None:
        for pending in self._pending.values():
            pending.append((event, arg))
        reg = self.registry
        for name, view in list(self.views.items()):
            if only is not None and name != only:
                continue
            if event == "removed":
                ids = [i for h in arg for i in view.ids_of(h)]
                if ids:
                    reg.on_evicted(name, ids)
                continue
            if event == "filled":
                self._filled(name, view, arg)
                continue
            ids = view.ids_of(arg)
            if not ids:
                continue
            self._preloading.get(name, {}).pop(arg, None)
            reg.on_fetch_failed(name, ids)
        if reg.watches_the_store:
            self.wake_soon()

    def _filled(self, name: str, view: DatasetView, hashes: list[bytes]) -> None:
        """``hashes`` landed: the files of dataset ``name`` they hold are cached now, told
        to its jobs in one report per batch; the pinned ones are pinned in the cache."""
        preloading = self._preloading.get(name, {})
        ids: list[int] = []
        pinned: list[bytes] = []
        is_pinned = None
        for h in hashes:
            of = view.ids_of(h)
            if not of:
                continue
            preloading.pop(h, None)
            ids.extend(of)
            if is_pinned is None:
                is_pinned = self.registry.dataset(name).pinned
            if any(map(is_pinned, of)):
                pinned.append(h)
        if ids:
            self.registry.on_cached(name, ids)
        if pinned:
            self.cache.pin(pinned)

    # -- requests ------------------------------------------------------------------------------

    async def open_session(self, dataset: str, job: str, **kw: Any) -> dict[str, Any]:
        """``session_open``: load the dataset if needed, open (idempotently) the session."""
        await self.ensure_view(dataset)
        info = self.registry.open_session(dataset, job, **kw)
        self.wake()
        return info_json(info)

    def claim(self, dataset: str, job: str, rank: int, n: int, epoch: int | None,
              batch: int | None = None) -> dict[str, Any]:
        """``claim``: the registry's claim; its misses start filling now."""
        claim = self.registry.claim(dataset, job, rank, n, epoch=epoch, batch=batch)
        if (claim.fetch or claim.hits) and dataset in self.mountd_fills:
            view = self.views[dataset]
            owner = protection_owner(dataset, job, claim.epoch)
            if claim.hits:
                self.cache.protect_hits(view.items(claim.hits), dataset, owner=owner)
            if claim.fetch:
                self.cache.fetch_now(view.items(claim.fetch + claim.brought), dataset,
                                     owner=owner)
        self.wake()
        answer = {
            "epoch": claim.epoch, "hits": list(claim.hits), "fetch": list(claim.fetch),
            "chunk": claim.chunk, "remaining": claim.remaining, "wait": claim.wait,
        }
        if claim.advised_fetch is not None:
            answer["advised_fetch"] = claim.advised_fetch
        return answer

    def sessions(self) -> list[dict[str, Any]]:
        """Every open session."""
        return [info_json(i) for i in self.registry.sessions()]

    # -- ticks ---------------------------------------------------------------------------------

    def tick(self, now: float | None = None) -> list[Any]:
        """Allocate the cache by benefit when due, perform the registry's chunk actions, then
        top up the preload windows."""
        if self.registry.allocation_due(now):
            self.reallocate(now)
        actions = self.registry.tick(now)
        for action in actions:
            view = self.views.get(action.dataset)
            if view is None:
                continue
            if isinstance(action, Preload):
                state = self.registry.dataset(action.dataset)
                ids = state.plan.ids_of(action.chunk)
                self.cache.pin(view.hashes_of(i for i in ids if state.is_cached(i)))
                self.cache.expect_pins((h, size) for h, size, _ in view.items(action.ids))
                log.info("dataset %s: loading chunk %d (%d files to fetch)",
                         action.dataset, action.chunk, len(action.ids))
            elif isinstance(action, ChunkReady):
                log.info("dataset %s: chunk %d loaded", action.dataset, action.chunk)
            elif isinstance(action, Evict):
                self._evict(view, action)
        self._release_protections()
        self._pump_preloads()
        return actions

    def _release_protections(self) -> None:
        """Release what the cache protects for the epoch pools that closed."""
        for name in list(self.views):
            for owner in self.registry.take_closed(name):
                self.cache.release_protection(owner)

    @property
    def policy(self) -> str:
        """The allocation policy in force: ``benefit-aware``, ``budget-only`` or ``manual``."""
        if self.mode is not None:
            return MANUAL
        return BENEFIT_AWARE if self.registry.benefit_aware else BUDGET_ONLY

    def reallocate(self, now: float | None = None) -> None:
        """Let the registry choose every dataset's mode (by benefit, or by the shared budget
        for the other policies) and perform the changes
        (see the module docstring): unpin the chunks old modes held.

        A dataset made full is not pinned whole: pins are chunk management's, and pinning a
        whole dataset took its files from ``quiverfs evict`` and from its users' quota
        eviction (both skip pinned files). The cache's policy keeps a full dataset that its
        jobs read; another dataset's misses may push out its least recent files."""
        reg = self.registry
        changes = reg.allocate(self.budget, now)
        allocation = reg.allocation()
        unpin: list[bytes] = []
        for change in changes:
            view = self.views.get(change.dataset)
            self._preloading.pop(change.dataset, None)
            if view is not None and change.released:
                unpin.extend(view.hashes_of(change.released))
            log.info("dataset %s: mode %s -> %s (%d bytes): %s", change.dataset, change.old,
                     change.new, change.budget, allocation[change.dataset].reason)
        if unpin:
            self._unpin([h for h in unpin if not self._pinned_for(h)])
        self._trim_retained()

    def _trim_retained(self) -> None:
        """Forget kept files beyond each dataset's ``retain`` bytes now (all of them for a
        dataset no longer chunked): a later chunk eviction removes them, or LRU does."""
        for name, kept in self.retained.items():
            target = self.registry.retain_bytes(name) if name in self.views else 0
            total = sum(kept.values())
            while kept and total > target:
                total -= kept.popitem()[1]

    def allocation_json(self) -> dict[str, Any]:
        """The policy in force; per dataset: mode, bytes allocated, ``G_D`` and why; per open
        job: ``t_hit``, ``t_miss``, ``b``, ``g`` (None until measured), ``b_counted`` (what
        the allocation counts: its ``b``, else the median of the dataset's measured jobs, else
        the assumed value) and whether it is being probed (``quiverfs stats``, metrics)."""
        reg = self.registry
        allocation = reg.allocation()
        out: dict[str, Any] = {}
        for name in sorted(self.views):
            a = allocation.get(name)
            benefits = reg.benefits(name)
            counted = counted_benefits(DatasetDemand(name, 0, 0, jobs=tuple(j for j, _ in benefits)))
            positions = reg.positions(name)
            jobs = [{"job": j.job, "gpus": j.gpus, "t_hit": j.t_hit, "t_miss": j.t_miss,
                     "b": j.b, "g": j.g, "b_counted": b, "probing": j.probing, "probes": probes,
                     "position": positions.get(j.job)}
                    for (j, probes), b in zip(benefits, counted, strict=True)]
            widest = widest_phase(positions) if reg.mode(name) is Mode.CHUNKED else None
            out[name] = {
                "mode": str(reg.mode(name)),
                "bytes": a.budget + a.retain if a is not None else None,
                "retained_bytes": sum(self.retained.get(name, {}).values()),
                "benefit": a.benefit if a is not None else None,
                "reason": a.reason if a is not None else (
                    "fixed by --dataset-mode" if self.mode is not None else "not allocated yet"),
                "jobs": jobs,
                "out_of_phase": None if widest is None or widest[2] <= OUT_OF_PHASE else {
                    "jobs": [widest[0], widest[1]], "epochs": round(widest[2], 3)},
                "unopened": reg.dataset(name).unopened_total(),
            }
        return {"policy": self.policy, "benefit_aware": reg.benefit_aware, "budget": self.budget,
                "datasets": out}

    def _holding(self, content_hash: bytes) -> Iterator[tuple[str, DatasetState, list[int]]]:
        """Every dataset whose files include ``content_hash``: its name, its state and the
        compact ids of that content in it."""
        for name, view in self.views.items():
            ids = view.ids_of(content_hash)
            if ids:
                yield name, self.registry.dataset(name), ids

    def _pinned_for(self, content_hash: bytes) -> bool:
        """Whether some dataset holds ``content_hash`` pinned: in a loading or resident chunk."""
        return any(any(map(state.pinned, ids)) for _, state, ids in self._holding(content_hash))

    def _evict(self, view: DatasetView, action: Evict) -> None:
        self.registry.dataset(action.dataset).chunk_evicted(action.members)
        self._retain(action.dataset, view, action.ids)
        self._unpin(view.hashes_of(action.members))

        def keep(content_hash: bytes) -> bool:  # the files kept across epochs too
            return self._held_elsewhere(content_hash, action.dataset, action.chunk)

        files, nbytes = self.cache.evict_hashes(view.hashes_of(action.ids), keep=keep)
        self.evictions.append((action.dataset, action.chunk, files, action.forced))
        log.info("dataset %s: evicted chunk %d (%d files, %d bytes%s)", action.dataset,
                 action.chunk, files, nbytes, ", forced" if action.forced else "")

    def _retain(self, dataset: str, view: DatasetView, ids: Sequence[int]) -> dict[bytes, int]:
        """The files ``dataset`` keeps across epochs, topped up from ``ids`` (the cached files
        of a chunk being evicted) to the allocation's ``retain`` bytes.

        Why: a chunked dataset otherwise fetches all of itself every epoch, whatever the
        budget beyond its two chunks (benefit_aware.py at a 30% cache: a third of the budget
        held nothing its jobs could hit, and plain LRU beat it). Kept files are not removed
        with their chunk; each epoch's chunk draws place them at random like any file, so
        they are hits wherever they fall and the order stays random. They are *not pinned*:
        pinned, they took the unpinned room that claims' prefetches are protected in, and the
        other chunked dataset's jobs lost what this one gained (benefit_aware.py, 2026-11-27:
        sensitive +15–20%, medium −3 to −33%); unpinned, the cache's LRU takes them back when
        that room is needed, but only after every other evictable file (``Cache.set_retained``:
        in plain LRU order they went first, before the files the epoch had just read).
        Picked at random among ``ids``: the ids come in digest order."""
        kept = self.retained.setdefault(dataset, {})
        room = self.registry.retain_bytes(dataset) - sum(kept.values())
        if room <= 0:
            return kept
        candidates = list(ids)
        self._retain_rng.shuffle(candidates)
        for i in candidates:
            size = view.sizes[i]
            content_hash = view.hash_of(i)
            if 0 < size <= room and content_hash not in kept:
                kept[content_hash] = size
                room -= size
                if not room:
                    break  # no file of size > 0 fits: skip the rest of a large chunk
        return kept

    def _is_retained(self, content_hash: bytes) -> bool:
        return any(content_hash in kept for kept in self.retained.values())

    def _held_elsewhere(self, content_hash: bytes, dataset: str, chunk: int) -> bool:
        """Whether another resident (or loading) chunk, another managed-whole dataset, or a
        dataset's retained files hold ``content_hash``."""
        if self._is_retained(content_hash):
            return True
        for name, state, ids in self._holding(content_hash):
            if state.manager is None:
                if name != dataset:
                    return True
            elif any(state.pinned(i) and (name, state.plan.chunk_of(i)) != (dataset, chunk)
                     for i in ids):
                return True
        return False

    def _unpin(self, hashes: Sequence[bytes] | bytes) -> None:
        if isinstance(hashes, bytes):  # a view's packed hashes
            hashes = [hashes[i : i + 32] for i in range(0, len(hashes), 32)]
        try:
            self.cache.unpin(list(hashes))
        except QuiverError as exc:
            log.warning("unpin failed: %s", exc)

    def _pump_preloads(self) -> None:
        """DELI's 50/50 rule: pull the next window once half of the previous one is in."""
        now = trio.current_time()
        for name, view in self.views.items():
            state = self.registry.dataset(name)
            if state.manager is None or state.manager.loading is None:
                self._preloading.pop(name, None)
                continue
            outstanding = self._preloading.setdefault(name, {})
            for h in [h for h, t in outstanding.items() if now - t > PRELOAD_TTL]:
                del outstanding[h]
            if len(outstanding) > self.preload_window // 2:
                continue
            if name not in self.mountd_fills:
                continue  # only the users' own mounts read their sources
            ids = self.registry.next_preload(name, self.preload_window - len(outstanding))
            items = [item for item in view.items(ids) if item[0] not in outstanding]
            if not items:
                continue
            for h, _, _ in items:
                outstanding[h] = now
            # Not protected: the loading chunk's pin keeps what lands (its slot is free).
            self.cache.fetch_now(items, name, protect=False)

