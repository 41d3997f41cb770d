#!/usr/bin/env python3
"""Client CPU per ranged GET: obstore vs. our backends vs. plain SDK calls, side by side.

A cold pass is CPU-bound in mountd, and most of that CPU is the client library's work per GET
(docs/backends.md "Reads through obstore"). This measures, for each bucket emulator on
loopback, what one blocking ranged GET of a 110 KiB object costs the *client process* in CPU,
and how many GETs/s its threads reach:

* S3 (moto server, ``run_moto``): obstore's ``S3Store`` on its own; our
  ``S3Backend._read_range`` (through obstore since 2026-11-28: its row says the read path it
  took, and costs what the backend adds to obstore); plain boto3 ``get_object(Range=)``, the
  baseline (what ``S3Backend`` read through before).
* Azure (Azurite, ``run_azurite``): obstore's ``AzureStore``; our ``AzureBackend._read_range``
  (through obstore too); plain azure-storage-blob ``download_blob(offset=, length=)``, the
  baseline (what ``AzureBackend`` read through before).
* GCS (gcp-storage-emulator): obstore's ``GCSStore``; our ``GCSBackend._read_range``
  (google-cloud-storage: GCS reads stay on it, docs/backends.md). obstore
  cannot read from the stock emulator (its GET answers carry no ``ETag`` and no
  ``Last-Modified``, which object_store requires on every GCS GET); the section says so, with
  obstore's own error, and measures both clients on the same emulator started with a few lines
  that add those two headers to its download answers (:data:`GCS_HEADERS_SHIM`).

Every client is opened once per section the way its users open it (our backends through
``open_backend(url, BackendOptions(concurrency=T), settings)``, as mountd does). A pass is
T threads, started together, each GETting its interleaved share of all objects (thread k:
objects k, k+T, ...), every object exactly once, the whole object as one range. For each pass:

* GETs/s: objects ÷ wall time from the start barrier to the last thread's end;
* client CPU per GET: ``time.process_time()`` over the pass ÷ GETs. The emulators run in other
  processes, so this is the client's CPU: every thread of this process, obstore's Rust runtime
  threads included, less the CPU of the wake probe below (its own ``thread_time``);
* in flight: the sum of the GETs' latencies ÷ wall, the calls in progress on average (at most
  T; a client that held the GIL through its calls would stay near 1);
* loop wake p50/p99: a probe thread sleeps 2 ms again and again during the pass and records
  how late it wakes. That is how long a trio thread in mountd would wait for the GIL (and a
  core) while the client works; the idle line above each table is the same probe with nothing
  running. A client whose calls release the GIL (obstore's ``get_range`` runs in
  ``py.detach``) leaves it near the idle value at any thread count.

Rows run with 1 thread and with T threads. Rounds interleave the clients (round 1: every row,
round 2: every row, ...), and each number is the best of ``--rounds`` (most GETs/s; least CPU
per GET, taken separately: noise on this 2-core VM only ever adds). "CPU ÷ obstore" is a row's
CPU per GET over obstore's at the same thread count. Every GET's bytes are checked (length and
blake3 against what was uploaded) after its pass, outside the timed loop.

    .venv/bin/python scripts/bench/remote_clients.py [--rounds 3] [--objects 800] [--threads 8]
    .venv/bin/python scripts/bench/remote_clients.py --quick --only s3

What the emulators do to the numbers: moto and gcp-storage-emulator answer every request with
``Connection: close``, so there every GET of every client opens a new TCP connection (and its
CPU is in the numbers); Azurite keeps connections alive. On a 2-core machine the emulator, not
the client, mostly bounds GETs/s; CPU per GET is the number to compare.

``--only s3|azure|gcs`` runs one section; a section whose emulator does not start is skipped
with the reason. Every emulator is stopped on the way out, Ctrl-C included.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import blake3  # noqa: E402
import obstore  # noqa: E402
import trio  # noqa: E402
from obstore.store import AzureStore, GCSStore, S3Store  # noqa: E402

from quiverfs.base.backends import Backend, BackendOptions, RemoteSettings, open_backend  # noqa: E402
from quiverfs.testing import emulators  # noqa: E402
from quiverfs.testing.emulators import (  # noqa: E402
    AZURITE_ACCOUNT,
    AZURITE_KEY,
    MOTO_ACCESS_KEY,
    MOTO_REGION,
    MOTO_SECRET_KEY,
    Emulator,
    EmulatorError,
    GCSEmulator,
)

FILE_SIZE = 110 * 1024
#: The bucket (Azure: container) on every emulator. Letters and digits only: object_store
#: percent-encodes every other character of a GCS bucket name in the URL path
#: (``remote-clients`` → ``remote%2Dclients``), which gcp-storage-emulator's routes do not match
#: (it answers 501); real GCS decodes it.
BUCKET = "remoteclients"
PREFIX = "bench"
OBSTORE = "obstore"
#: The wake probe's sleep, seconds.
PROBE_INTERVAL = 0.002
#: Seconds the idle wake probe runs before each section's passes.
IDLE_PROBE_S = 1.0
#: GETs per thread before a client's first pass, untimed: connections open, pools fill.
WARMUP_PER_THREAD = 2

#: gcp-storage-emulator, with ``ETag`` (the generation) and ``Last-Modified`` (``updated``)
#: added to its download answers. object_store requires both on every GCS GET
#: (``HeaderConfig { etag_required: true, last_modified_required: true }`` in its
#: gcp/client.rs) and the emulator sends neither; real GCS always sends both. Run as
#: ``python -c GCS_HEADERS_SHIM start ...``: the patch must be in place before the emulator's
#: server module builds its routing table from ``objects.download``.
GCS_HEADERS_SHIM = """
import sys
from datetime import datetime, timezone
from email.utils import format_datetime
from http import HTTPStatus

from gcp_storage_emulator.handlers import objects

_download = objects.download

def download(request, response, storage, *args, **kwargs):
    _download(request, response, storage, *args, **kwargs)
    if response.status in (HTTPStatus.OK, HTTPStatus.PARTIAL_CONTENT):
        obj = storage.get_file_obj(request.params["bucket_name"], request.params["object_id"])
        response["ETag"] = '"%s"' % obj.get("generation", "0")
        try:
            updated = datetime.fromisoformat(obj["updated"])
        except (KeyError, TypeError, ValueError):
            updated = datetime.now(timezone.utc)
        response["Last-Modified"] = format_datetime(updated.astimezone(timezone.utc), usegmt=True)

objects.download = download

from gcp_storage_emulator.__main__ import main

sys.exit(main())
"""


def progress(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# -- the objects ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Dataset:
    """``count`` objects of :data:`FILE_SIZE` random bytes, keyed ``00000.bin`` ... under
    :data:`PREFIX`, and their blake3 digests."""

    names: list[str]
    hashes: list[bytes]

    @classmethod
    def make(cls, count: int, seed: int = 7) -> tuple[Dataset, dict[str, bytes]]:
        """The dataset and its objects (full keys → bytes) to upload."""
        rng = random.Random(seed)
        names, hashes, objects = [], [], {}
        for i in range(count):
            data = rng.randbytes(FILE_SIZE)
            name = f"{i:05d}.bin"
            names.append(name)
            hashes.append(blake3.blake3(data).digest())
            objects[f"{PREFIX}/{name}"] = data
        return cls(names, hashes), objects

    def verify(self, results: Sequence[Any], client: str) -> None:
        """Raise unless every result has the length and blake3 of its object."""
        for i, data in enumerate(results):
            view = memoryview(data)
            if view.nbytes != FILE_SIZE or blake3.blake3(view).digest() != self.hashes[i]:
                raise RuntimeError(
                    f"{client}: object {self.names[i]} read back {view.nbytes} bytes that do "
                    "not match what was uploaded"
                )


# -- clients ----------------------------------------------------------------------------------


@dataclass
class Client:
    """One way of reading: ``read(name)`` GETs the whole object ``PREFIX/name`` as one range
    and returns a bytes-like object; ``close()`` releases it."""

    name: str
    read: Callable[[str], Any]
    close: Callable[[], None] = lambda: None
    #: One line on how it was opened, printed under the table.
    setup: str = ""


def backend_client(name: str, url: str, threads: int, settings: RemoteSettings) -> Client:
    """Our backend for ``url``, opened as mountd opens it, read through ``_read_range`` (the
    blocking call a fill process's threads make, through ``call_blocking``). Its label says
    how its reads go (``read_path()``, after one read: the path is set up on the first)."""
    backend: Backend = open_backend(url, BackendOptions(concurrency=threads), settings)
    backend._read_range("00000.bin", 0, 1)
    path = backend.read_path() or ""

    def read(key: str) -> bytes:
        return backend._read_range(key, 0, FILE_SIZE)

    def close() -> None:
        trio.run(backend.aclose)

    setup = f"open_backend({url!r}, BackendOptions(concurrency={threads}), settings)"
    label = f"{name} ({path})" if path else name
    return Client(label, read, close, setup)


def obstore_client(store: Any, setup: str) -> Client:
    """obstore's blocking ``get_range`` on ``store``."""
    get_range = obstore.get_range

    def read(key: str) -> Any:
        return get_range(store, f"{PREFIX}/{key}", start=0, length=FILE_SIZE)

    return Client(OBSTORE, read, setup=setup)


def boto3_client(endpoint: str, threads: int) -> Client:
    """A plain boto3 S3 client: ``get_object(Range=...)`` and ``Body.read()``."""
    import boto3
    from botocore.config import Config

    client = boto3.session.Session().client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id=MOTO_ACCESS_KEY,
        aws_secret_access_key=MOTO_SECRET_KEY,
        region_name=MOTO_REGION,
        config=Config(max_pool_connections=threads, retries={"total_max_attempts": 1}),
    )

    def read(key: str) -> bytes:
        answer = client.get_object(
            Bucket=BUCKET, Key=f"{PREFIX}/{key}", Range=f"bytes=0-{FILE_SIZE - 1}"
        )
        with answer["Body"] as body:
            return body.read()

    setup = f"boto3 client('s3', endpoint_url=..., Config(max_pool_connections={threads}))"
    return Client("boto3 get_object", read, client.close, setup)


def azure_sdk_client(connection_string: str, threads: int) -> Client:
    """A plain azure-storage-blob client: ``download_blob(offset=, length=).readall()``, as
    ``AzureBackend`` read before its reads went through obstore (its pool sized to
    ``threads``, no retries)."""
    import requests
    from azure.core.pipeline.transport import RequestsTransport
    from azure.storage.blob import BlobServiceClient

    session = requests.Session()
    adapter = requests.adapters.HTTPAdapter(pool_connections=1, pool_maxsize=threads)
    session.mount("http://", adapter)
    transport = RequestsTransport(session=session, session_owner=True)
    service = BlobServiceClient.from_connection_string(
        connection_string, retry_total=0, transport=transport)
    container = service.get_container_client(BUCKET)

    def read(key: str) -> bytes:
        blob = container.get_blob_client(f"{PREFIX}/{key}")
        return blob.download_blob(offset=0, length=FILE_SIZE, max_concurrency=1).readall()

    setup = f"BlobServiceClient.from_connection_string(..., retry_total=0), pool of {threads}"
    return Client("azure-storage-blob", read, service.close, setup)


# -- one pass ---------------------------------------------------------------------------------


class WakeProbe:
    """A thread that sleeps :data:`PROBE_INTERVAL` again and again and records how late it
    wakes (GIL and CPU waits); its own CPU time is kept apart so a pass can leave it out."""

    def __init__(self) -> None:
        self.lateness: list[float] = []
        self.cpu = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="wake-probe", daemon=True)

    def _run(self) -> None:
        cpu0 = time.thread_time()
        late = self.lateness
        while not self._stop.is_set():
            t0 = time.perf_counter()
            time.sleep(PROBE_INTERVAL)
            late.append(time.perf_counter() - t0 - PROBE_INTERVAL)
        self.cpu = time.thread_time() - cpu0

    def __enter__(self) -> WakeProbe:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join()

    def percentiles_ms(self) -> tuple[float, float]:
        """p50 and p99 of the lateness, milliseconds."""
        if len(self.lateness) < 2:
            return float("nan"), float("nan")
        cuts = statistics.quantiles(self.lateness, n=100)
        return cuts[49] * 1e3, cuts[98] * 1e3


@dataclass(frozen=True)
class Pass:
    """What one pass measured."""

    gets: int
    wall: float
    cpu: float
    in_flight: float
    wake_p50_ms: float
    wake_p99_ms: float

    @property
    def rate(self) -> float:
        return self.gets / self.wall

    @property
    def cpu_ms_per_get(self) -> float:
        return self.cpu / self.gets * 1e3


def run_pass(client: Client, names: list[str], threads: int) -> tuple[Pass, list[Any]]:
    """``threads`` threads GET their interleaved shares of ``names`` once each; the pass's
    numbers and every result, in ``names`` order."""
    results: list[Any] = [None] * len(names)
    latencies = [0.0] * threads
    errors: list[BaseException] = []
    start = threading.Barrier(threads + 1)
    read = client.read

    def worker(k: int) -> None:
        start.wait()
        spent = 0.0
        try:
            for i in range(k, len(names), threads):
                t0 = time.perf_counter()
                results[i] = read(names[i])
                spent += time.perf_counter() - t0
        except BaseException as exc:  # reported by the main thread, with the client's name
            errors.append(exc)
        latencies[k] = spent

    workers = [threading.Thread(target=worker, args=(k,)) for k in range(threads)]
    for thread in workers:
        thread.start()
    with WakeProbe() as probe:
        cpu0, t0 = time.process_time(), time.perf_counter()
        start.wait()
        for thread in workers:
            thread.join()
        wall, cpu1 = time.perf_counter() - t0, time.process_time()
    if errors:
        first = str(errors[0]).splitlines()[0] if str(errors[0]) else ""
        raise RuntimeError(f"{client.name}: a GET failed: {type(errors[0]).__name__}: {first}"
                           ) from errors[0]
    p50, p99 = probe.percentiles_ms()
    # The probe stops after cpu1 was read; its CPU up to then is all but a few microseconds.
    cpu = max(0.0, cpu1 - cpu0 - probe.cpu)
    measured = Pass(len(names), wall, cpu, sum(latencies) / wall, p50, p99)
    return measured, results


def idle_wake_ms(seconds: float = IDLE_PROBE_S) -> tuple[float, float]:
    """The wake probe's p50 and p99 with nothing else running in this process."""
    with WakeProbe() as probe:
        time.sleep(seconds)
    return probe.percentiles_ms()


# -- a section --------------------------------------------------------------------------------


@dataclass
class Row:
    """One client at one thread count, over the rounds."""

    client: str
    threads: int
    passes: list[Pass] = field(default_factory=list)
    error: str = ""

    def best_rate(self) -> Pass:
        return max(self.passes, key=lambda p: p.rate)

    def best_cpu(self) -> Pass:
        return min(self.passes, key=lambda p: p.cpu)


def measure(
    clients: list[Client], dataset: Dataset, thread_counts: list[int], rounds: int
) -> list[Row]:
    """Every client at every thread count, ``rounds`` times, interleaved; bytes verified."""
    rows = {(c.name, t): Row(c.name, t) for t in thread_counts for c in clients}
    warm = dataset.names[: WARMUP_PER_THREAD * max(thread_counts)]
    for client in clients:
        try:
            run_pass(client, warm, max(thread_counts))
        except Exception as exc:
            for t in thread_counts:
                rows[client.name, t].error = str(exc).splitlines()[0]
    for r in range(1, rounds + 1):
        for threads in thread_counts:
            for client in clients:
                row = rows[client.name, threads]
                if row.error:
                    continue
                try:
                    measured, results = run_pass(client, dataset.names, threads)
                    dataset.verify(results, client.name)
                except Exception as exc:
                    row.error = str(exc).splitlines()[0]
                    continue
                del results
                row.passes.append(measured)
                progress(
                    f"round {r}: {client.name}, {threads} threads: {measured.rate:.0f} GETs/s, "
                    f"{measured.cpu_ms_per_get:.3f} ms CPU/GET, in flight "
                    f"{measured.in_flight:.1f}"
                )
    return list(rows.values())


def print_table(title: str, rows: list[Row], idle: tuple[float, float], notes: list[str]) -> None:
    """One table: a row per client and thread count, best of the rounds."""
    baseline = {r.threads: r.best_cpu().cpu_ms_per_get for r in rows if r.client == OBSTORE
                and r.passes}
    header = (f"{'client':<26} {'threads':>7} {'GETs/s':>8} {'CPU ms/GET':>11} "
              f"{'CPU ÷ obstore':>14} {'in flight':>10} {'loop wake p50/p99 ms':>21}")
    print(f"\n{title}")
    print(f"  loop wake p50/p99 with nothing running: {idle[0]:.2f} / {idle[1]:.2f} ms")
    print("  " + header)
    print("  " + "-" * len(header))
    for row in rows:
        if not row.passes:
            print(f"  {row.client:<26} {row.threads:>7}  not measured: {row.error}")
            continue
        fast, lean = row.best_rate(), row.best_cpu()
        base = baseline.get(row.threads)
        ratio = f"{lean.cpu_ms_per_get / base:.2f}x" if base else "-"
        wake = f"{fast.wake_p50_ms:.2f} / {fast.wake_p99_ms:.2f}"
        print(f"  {row.client:<26} {row.threads:>7} {fast.rate:>8.0f} {lean.cpu_ms_per_get:>11.3f} "
              f"{ratio:>14} {fast.in_flight:>10.1f} {wake:>21}")
        if row.error:
            print(f"  {'':<26} {'':>7}  (a later pass failed: {row.error})")
    for note in notes:
        print(f"  {note}")
    sys.stdout.flush()


def run_section(
    title: str,
    emulator: Emulator,
    dataset: Dataset,
    objects: dict[str, bytes],
    open_clients: Callable[[int], list[Client]],
    thread_counts: list[int],
    rounds: int,
    notes: list[str],
) -> None:
    """Seed ``emulator``, open the clients (sized for the most threads), measure, print."""
    progress(f"{title}: uploading {len(objects)} objects of {FILE_SIZE // 1024} KiB")
    emulator.create_bucket(BUCKET)
    emulator.upload_many(BUCKET, objects)
    clients = open_clients(max(thread_counts))
    try:
        idle = idle_wake_ms()
        rows = measure(clients, dataset, thread_counts, rounds)
    finally:
        for client in clients:
            client.close()
    setups = [f"{c.name}: {c.setup}" for c in clients if c.setup]
    print_table(title, rows, idle, setups + notes)


@contextlib.contextmanager
def environ(updates: dict[str, str], remove: Sequence[str] = ()) -> Iterator[None]:
    """``os.environ`` with ``updates`` and without ``remove``, restored afterwards."""
    saved = {name: os.environ.get(name) for name in (*updates, *remove)}
    try:
        for name in remove:
            os.environ.pop(name, None)
        os.environ.update(updates)
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


# -- S3 ---------------------------------------------------------------------------------------


def section_s3(count: int, threads: int, rounds: int) -> None:
    dataset, objects = Dataset.make(count)
    with emulators.run_moto() as s3:

        def open_clients(pool: int) -> list[Client]:
            clients = []
            store = S3Store(
                BUCKET,
                endpoint=s3.endpoint,
                access_key_id=MOTO_ACCESS_KEY,
                secret_access_key=MOTO_SECRET_KEY,
                region=MOTO_REGION,
                virtual_hosted_style_request=False,
                client_options={"allow_http": True},
            )
            clients.append(obstore_client(store, (
                f"S3Store({BUCKET!r}, endpoint={s3.endpoint!r}, access_key_id=..., "
                f"secret_access_key=..., region={MOTO_REGION!r}, "
                "virtual_hosted_style_request=False, client_options={'allow_http': True})")))
            # S3Backend takes credentials from boto3's chain only: moto's dummies, here.
            clients.append(backend_client("S3Backend", s3.root_url(BUCKET, PREFIX), pool,
                                          s3.settings()))
            clients.append(boto3_client(s3.endpoint, pool))
            return clients

        # S3Backend's boto3 session reads its credentials from the environment when opened.
        env = {"AWS_ACCESS_KEY_ID": MOTO_ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": MOTO_SECRET_KEY,
               "AWS_DEFAULT_REGION": MOTO_REGION}
        with environ(env, remove=("AWS_PROFILE", "AWS_SESSION_TOKEN")):
            run_section("S3 (moto server)", s3, dataset, objects, open_clients,
                        [1, threads], rounds, [])


# -- Azure ------------------------------------------------------------------------------------


def section_azure(count: int, threads: int, rounds: int) -> None:
    dataset, objects = Dataset.make(count)
    with emulators.run_azurite() as az:

        def open_clients(pool: int) -> list[Client]:
            clients = []
            # Not use_emulator=True: that takes the address from AZURITE_BLOB_STORAGE_URL
            # only (else 127.0.0.1:10000). An endpoint with the account in its path is
            # Azurite's path-style addressing.
            endpoint = f"{az.endpoint}/{AZURITE_ACCOUNT}"
            store = AzureStore(
                BUCKET,
                account_name=AZURITE_ACCOUNT,
                account_key=AZURITE_KEY,
                endpoint=endpoint,
                client_options={"allow_http": True},
            )
            clients.append(obstore_client(store, (
                f"AzureStore({BUCKET!r}, account_name={AZURITE_ACCOUNT!r}, "
                f"account_key=<Azurite's well-known key>, endpoint={endpoint!r}, "
                "client_options={'allow_http': True})")))
            clients.append(backend_client("AzureBackend", az.root_url(BUCKET, PREFIX), pool,
                                          az.settings()))
            clients.append(azure_sdk_client(az.settings().azure_connection_string or "", pool))
            return clients

        run_section("Azure (Azurite)", az, dataset, objects, open_clients, [1, threads],
                    rounds, [])


# -- GCS --------------------------------------------------------------------------------------


def gcs_store(endpoint: str, **extra: Any) -> Any:
    """obstore's store for :data:`BUCKET` on a GCS emulator at ``endpoint``: no credentials
    (``skip_signature``; no service account, no ADC lookup needed), plain HTTP."""
    return GCSStore(BUCKET, base_url=endpoint, skip_signature=True,
                    client_options={"allow_http": True}, **extra)


def obstore_gcs_problem(gs: GCSEmulator) -> str:
    """Why obstore cannot read one object from ``gs`` (``""`` when it can)."""
    gs.create_bucket(BUCKET)
    gs.upload(BUCKET, f"{PREFIX}/probe", b"probe" * 100)
    store = gcs_store(gs.endpoint, retry_config={"max_retries": 0})
    try:
        data = obstore.get_range(store, f"{PREFIX}/probe", start=0, length=5)
    except Exception as exc:  # obstore's GenericError: its message is the reason
        return f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
    return "" if bytes(data) == b"probe" else f"read back {bytes(data)!r}, not b'probe'"


def run_gcs_emulator_with_get_headers() -> contextlib.AbstractContextManager[GCSEmulator]:
    """gcp-storage-emulator, in memory, with :data:`GCS_HEADERS_SHIM`'s two headers."""
    return emulators.run_gcs_emulator(program=[sys.executable, "-c", GCS_HEADERS_SHIM])


def section_gcs(count: int, threads: int, rounds: int) -> None:
    dataset, objects = Dataset.make(count)
    notes: list[str] = []
    with emulators.run_gcs_emulator() as stock:
        problem = obstore_gcs_problem(stock)
    emulator = run_gcs_emulator_with_get_headers if problem else emulators.run_gcs_emulator
    if problem:
        notes += [f"obstore against the stock emulator: {problem}",
                  "so both clients here read from the emulator with ETag and Last-Modified "
                  "added to its GET answers (GCS_HEADERS_SHIM)"]
    title = "GCS (gcp-storage-emulator" + (", GET headers added)" if problem else ")")
    with emulator() as gs:

        def open_clients(pool: int) -> list[Client]:
            clients = []
            clients.append(obstore_client(gcs_store(gs.endpoint), (
                f"GCSStore({BUCKET!r}, base_url={gs.endpoint!r}, skip_signature=True, "
                "client_options={'allow_http': True})")))
            clients.append(backend_client("GCSBackend", gs.root_url(BUCKET, PREFIX), pool,
                                          gs.settings()))
            return clients

        run_section(title, gs, dataset, objects, open_clients, [1, threads], rounds, notes)


# -- main -------------------------------------------------------------------------------------

SECTIONS = {"s3": section_s3, "azure": section_azure, "gcs": section_gcs}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="example: .venv/bin/python scripts/bench/remote_clients.py --quick --only s3",
    )
    parser.add_argument("--only", choices=sorted(SECTIONS), help="run one section")
    parser.add_argument("--rounds", type=int, default=3, help="passes per row (best counts)")
    parser.add_argument("--objects", type=int, default=800, help="objects, S3 and Azure")
    parser.add_argument("--gcs-objects", type=int, default=400, help="objects, GCS")
    parser.add_argument("--threads", type=int, default=8, help="threads, S3 and Azure")
    parser.add_argument("--gcs-threads", type=int, default=2,
                        help="threads, GCS (its emulator serves one request at a time)")
    parser.add_argument("--quick", action="store_true",
                        help="a small run: 160 objects (GCS 80), 1 round")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.objects, args.gcs_objects = 1, 160, 80
    plan = {
        "s3": (args.objects, args.threads),
        "azure": (args.objects, args.threads),
        "gcs": (args.gcs_objects, args.gcs_threads),
    }
    print(f"client CPU per ranged GET of {FILE_SIZE // 1024} KiB objects on loopback "
          f"emulators; best of {args.rounds} round(s); {os.cpu_count()} CPUs; "
          f"obstore {obstore.__version__}")
    for name, section in SECTIONS.items():
        if args.only and name != args.only:
            continue
        count, threads = plan[name]
        try:
            section(count, threads, args.rounds)
        except EmulatorError as exc:
            first = str(exc).splitlines()[0]
            print(f"\n{name}: skipped, its emulator did not start: {first}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
