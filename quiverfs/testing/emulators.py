"""Bucket emulators on loopback, for tests, the README demo and benchmarks.

Each context manager starts one emulator on a free ``127.0.0.1`` port, waits (with a deadline,
no fixed sleeps) until it answers, yields an :class:`Emulator` handle, and always stops the
process on the way out (terminate, then kill), exceptions included::

    with run_moto() as s3:
        s3.create_bucket("data")
        s3.upload_many("data", {"train/0.jpg": b"...", "train/1.jpg": b"..."})
        backend = open_backend(s3.root_url("data", "train"), settings=s3.settings())

The same works from a pytest fixture (``with run_azurite(tmp) as az: yield az``) and from a
plain script. ``handle.env`` holds the environment variables that point our backends (and the
SDKs' standard credential chains) at the emulator; ``handle.settings()`` is the
:class:`~quiverfs.base.backends.settings.RemoteSettings` built from them, so tests need not touch
``os.environ``. Emulator output goes to log files in a temporary directory
(``handle.log_path``), never to a pipe that could fill up.

Binaries: ``moto_server`` and ``gcp-storage-emulator`` from the running virtual environment,
``azurite-blob`` from ``<repo>/.tools/azurite`` (all installed by ``scripts/setup.sh``).
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from quiverfs.base.backends.settings import RemoteSettings

__all__ = [
    "AZURITE_ACCOUNT",
    "AZURITE_KEY",
    "AzuriteEmulator",
    "Emulator",
    "EmulatorError",
    "GCSEmulator",
    "MOTO_ACCESS_KEY",
    "MOTO_REGION",
    "MOTO_SECRET_KEY",
    "MotoEmulator",
    "azurite_connection_string",
    "free_port",
    "root_url",
    "run_azurite",
    "run_gcs_emulator",
    "run_moto",
]

#: Azurite's built-in development account and its well-known (public, documented) key.
AZURITE_ACCOUNT = "devstoreaccount1"
AZURITE_KEY = (
    "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
)

#: Dummy credentials for moto (it accepts any); real ones must never be sent to an emulator.
MOTO_ACCESS_KEY = "quiverfs-test"
MOTO_SECRET_KEY = "quiverfs-test-secret"
MOTO_REGION = "us-east-1"
GCS_PROJECT = "quiverfs-emulator"

#: Seconds to wait for an emulator to answer after start.
START_DEADLINE = 30.0

REPO_ROOT = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent


class EmulatorError(RuntimeError):
    """An emulator is not installed, exited early, or did not become ready in time."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the kernel picks it)."""
    return free_ports(1)[0]


def free_ports(count: int) -> list[int]:
    """``count`` distinct TCP ports on 127.0.0.1 that were free a moment ago: each socket
    stays bound until all are picked, since one picked and closed before the next can be
    picked again (two calls of :func:`free_port` once gave nginx the same port twice)."""
    with contextlib.ExitStack() as stack:
        ports = []
        for _ in range(count):
            sock = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            sock.bind(("127.0.0.1", 0))
            ports.append(sock.getsockname()[1])
        return ports


def azurite_connection_string(blob_endpoint: str) -> str:
    """A connection string for the dev account at ``blob_endpoint`` (``http://host:port``)."""
    return (
        "DefaultEndpointsProtocol=http;"
        f"AccountName={AZURITE_ACCOUNT};AccountKey={AZURITE_KEY};"
        f"BlobEndpoint={blob_endpoint.rstrip('/')}/{AZURITE_ACCOUNT};"
    )


def root_url(scheme: str, bucket: str, prefix: str = "") -> str:
    """Our backend URL for ``bucket`` (Azure: container) and ``prefix`` on an emulator.

    ``s3://b/p``, ``az://devstoreaccount1/c/p``, ``gs://b/p``.
    """
    prefix = prefix.strip("/")
    tail = f"/{prefix}" if prefix else ""
    if scheme == "az":
        return f"az://{AZURITE_ACCOUNT}/{bucket}{tail}"
    if scheme in ("s3", "gs"):
        return f"{scheme}://{bucket}{tail}"
    raise ValueError(f"no emulator for scheme {scheme!r}")


@dataclass
class Emulator:
    """A running emulator: where it listens, how to point our backends at it, and seeding.

    Subclasses fill in :meth:`env_for` and the SDK calls of :meth:`create_bucket` and
    :meth:`upload`.
    """

    #: ``s3``, ``az`` or ``gs``: the URL scheme of our backend for this store.
    scheme: str
    #: ``http://127.0.0.1:PORT`` (Azurite: without the account path).
    endpoint: str
    port: int
    process: subprocess.Popen[bytes]
    log_path: Path
    #: Threads used by :meth:`upload_many`.
    upload_threads: int = 8
    _client: Any = field(default=None, repr=False)

    @property
    def env(self) -> dict[str, str]:
        """Environment variables that point our backends at this emulator."""
        return self.env_for(self.endpoint)

    def env_for(self, endpoint: str) -> dict[str, str]:
        """Like :attr:`env` but for another endpoint (e.g. a fault proxy in front of this one)."""
        raise NotImplementedError

    def settings(self, endpoint: str | None = None) -> RemoteSettings:
        """Backend settings for this emulator, or for ``endpoint`` (a proxy) in front of it."""
        return RemoteSettings.from_environ(self.env_for(endpoint or self.endpoint))

    def root_url(self, bucket: str, prefix: str = "") -> str:
        """Our backend URL for ``bucket`` and ``prefix`` on this emulator."""
        return root_url(self.scheme, bucket, prefix)

    def create_bucket(self, name: str) -> None:
        """Create a bucket (Azure: a container) named ``name``."""
        raise NotImplementedError

    def upload(self, bucket: str, key: str, data: bytes) -> None:
        """Store ``data`` as object ``key`` in ``bucket`` (Azure: container)."""
        raise NotImplementedError

    def upload_many(
        self, bucket: str, objects: Mapping[str, bytes] | Iterable[tuple[str, bytes]]
    ) -> int:
        """Store many objects, ``upload_threads`` at a time; returns how many were stored."""
        items = list(objects.items() if isinstance(objects, Mapping) else objects)
        if self.upload_threads <= 1:
            for key, data in items:
                self.upload(bucket, key, data)
            return len(items)
        with ThreadPoolExecutor(self.upload_threads) as pool:
            # list() re-raises the first upload error here.
            list(pool.map(lambda item: self.upload(bucket, *item), items))
        return len(items)

    def is_alive(self) -> bool:
        """True while the emulator process runs."""
        return self.process.poll() is None

    def log_tail(self, limit: int = 2000) -> str:
        """The last ``limit`` characters of the emulator's log, for error messages."""
        try:
            return self.log_path.read_text(errors="replace")[-limit:]
        except OSError:
            return ""


class MotoEmulator(Emulator):
    """moto's S3 server."""

    def env_for(self, endpoint: str) -> dict[str, str]:
        return {
            "AWS_ENDPOINT_URL": endpoint,
            "AWS_ACCESS_KEY_ID": MOTO_ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": MOTO_SECRET_KEY,
            "AWS_DEFAULT_REGION": MOTO_REGION,
        }

    @property
    def client(self) -> Any:
        """A boto3 S3 client for seeding (explicit dummy credentials, not the env chain)."""
        if self._client is None:
            import boto3
            from botocore.config import Config

            self._client = boto3.session.Session().client(
                "s3",
                endpoint_url=self.endpoint,
                aws_access_key_id=MOTO_ACCESS_KEY,
                aws_secret_access_key=MOTO_SECRET_KEY,
                region_name=MOTO_REGION,
                config=Config(max_pool_connections=max(10, self.upload_threads)),
            )
        return self._client

    def create_bucket(self, name: str) -> None:
        self.client.create_bucket(Bucket=name)

    def upload(self, bucket: str, key: str, data: bytes) -> None:
        self.client.put_object(Bucket=bucket, Key=key, Body=data)


class AzuriteEmulator(Emulator):
    """Azurite's blob service, with the dev account ``devstoreaccount1``."""

    def env_for(self, endpoint: str) -> dict[str, str]:
        return {"AZURE_STORAGE_CONNECTION_STRING": azurite_connection_string(endpoint)}

    @property
    def client(self) -> Any:
        """An azure-storage-blob service client for seeding."""
        if self._client is None:
            from azure.storage.blob import BlobServiceClient

            self._client = BlobServiceClient.from_connection_string(
                azurite_connection_string(self.endpoint)
            )
        return self._client

    def create_bucket(self, name: str) -> None:
        self.client.create_container(name)

    def upload(self, bucket: str, key: str, data: bytes) -> None:
        self.client.get_blob_client(bucket, key).upload_blob(data, overwrite=True)


class GCSEmulator(Emulator):
    """gcp-storage-emulator, in memory. Single-threaded HTTP/1.0 with a listen backlog of 5:
    uploads go one at a time, and clients should keep their concurrency low."""

    def env_for(self, endpoint: str) -> dict[str, str]:
        return {"STORAGE_EMULATOR_HOST": endpoint, "GOOGLE_CLOUD_PROJECT": GCS_PROJECT}

    @property
    def client(self) -> Any:
        """A google-cloud-storage client for seeding (anonymous, like our backend's)."""
        if self._client is None:
            from google.auth.credentials import AnonymousCredentials
            from google.cloud import storage

            self._client = storage.Client(
                project=GCS_PROJECT,
                credentials=AnonymousCredentials(),
                client_options={"api_endpoint": self.endpoint},
            )
        return self._client

    def create_bucket(self, name: str) -> None:
        self.client.create_bucket(name)

    def upload(self, bucket: str, key: str, data: bytes) -> None:
        blob = self.client.bucket(bucket).blob(key)
        blob.upload_from_string(data, content_type="application/octet-stream")


# -- process management ------------------------------------------------------------------


def _require(path: Path, what: str) -> Path:
    if not path.exists():
        raise EmulatorError(f"{what} not found at {path}: run scripts/setup.sh")
    return path


def _http_ready(url: str) -> bool:
    """True once anything answers HTTP at ``url`` (any status: the server is up)."""
    try:
        with urllib.request.urlopen(url, timeout=2):
            return True
    except urllib.error.HTTPError:
        return True
    except (OSError, urllib.error.URLError):
        return False


def _stop(process: subprocess.Popen[bytes], grace: float = 5.0) -> None:
    """Terminate ``process``, then kill it if it has not exited after ``grace`` seconds."""
    if process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(grace)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


#: Start attempts: the free port may be taken by someone else before the emulator binds it.
START_ATTEMPTS = 3


@contextlib.contextmanager
def _running(
    name: str,
    argv_for: Callable[[int], list[str]],
    ready_path: str,
    *,
    cwd: Path | None = None,
    deadline: float = START_DEADLINE,
) -> Iterator[tuple[subprocess.Popen[bytes], int, Path]]:
    """Run ``argv_for(port)`` on a free port with output to a log file, wait until
    ``http://127.0.0.1:PORT{ready_path}`` answers, and always stop it.

    Yields ``(process, port, log_path)``. An emulator that exits before it is ready is started
    again on another port (at most :data:`START_ATTEMPTS` times): that is how losing the race
    for a free port looks.
    """
    with tempfile.TemporaryDirectory(prefix=f"quiverfs-{name}-") as logdir:
        log_path = Path(logdir) / f"{name}.log"
        for attempt in range(1, START_ATTEMPTS + 1):
            port = free_port()
            with open(log_path, "ab") as log:
                log.write(f"--- {name} attempt {attempt} on port {port}\n".encode())
                log.flush()
                process = subprocess.Popen(
                    argv_for(port),
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    cwd=cwd,
                    start_new_session=True,  # a Ctrl-C in the terminal reaches us, not it
                )
            try:
                ready = _wait_ready(
                    name, process, f"http://127.0.0.1:{port}{ready_path}", log_path, deadline
                )
            except BaseException:
                _stop(process)
                raise
            if ready:
                break
            _stop(process)
            if attempt == START_ATTEMPTS:
                tail = log_path.read_text(errors="replace")[-2000:]
                raise EmulatorError(f"{name} exited {START_ATTEMPTS} times before ready:\n{tail}")
        try:
            yield process, port, log_path
        finally:
            _stop(process)


def _wait_ready(
    name: str, process: subprocess.Popen[bytes], url: str, log_path: Path, deadline: float
) -> bool:
    """Poll ``url`` until it answers (True) or the process exits (False); error past deadline."""
    until = time.monotonic() + deadline
    delay = 0.02
    while not _http_ready(url):
        if process.poll() is not None:
            return False
        if time.monotonic() > until:
            tail = log_path.read_text(errors="replace")[-2000:]
            raise EmulatorError(f"{name} not ready after {deadline:.0f} s:\n{tail}")
        time.sleep(delay)  # polling interval, bounded by the deadline above
        delay = min(delay * 2, 0.2)
    return True


@contextlib.contextmanager
def run_moto(*, deadline: float = START_DEADLINE) -> Iterator[MotoEmulator]:
    """moto's S3 server on a free loopback port."""
    binary = _require(VENV_BIN / "moto_server", "moto_server")

    def argv(port: int) -> list[str]:
        return [str(binary), "-H", "127.0.0.1", "-p", str(port)]

    with _running("moto", argv, "/", deadline=deadline) as (process, port, log_path):
        handle = MotoEmulator("s3", f"http://127.0.0.1:{port}", port, process, log_path)
        try:
            yield handle
        finally:
            if handle._client is not None:
                handle._client.close()


@contextlib.contextmanager
def run_azurite(
    workdir: str | Path | None = None, *, deadline: float = START_DEADLINE
) -> Iterator[AzuriteEmulator]:
    """Azurite's blob service on a free loopback port.

    Data lives under ``workdir`` (``--location``); with ``None`` it is kept in memory
    (``--inMemoryPersistence``; Azurite refuses both at once).
    """
    binary = _require(
        REPO_ROOT / ".tools" / "azurite" / "node_modules" / ".bin" / "azurite-blob", "azurite-blob"
    )
    if workdir is None:
        storage = ["--inMemoryPersistence"]
        cwd = None
    else:
        Path(workdir).mkdir(parents=True, exist_ok=True)
        storage = ["--location", str(workdir)]
        cwd = Path(workdir)

    def argv(port: int) -> list[str]:
        return [
            str(binary),
            "--blobHost", "127.0.0.1",
            "--blobPort", str(port),
            "--skipApiVersionCheck",  # current SDKs send API versions Azurite does not know yet
            "--disableTelemetry",
            *storage,
        ]  # fmt: skip

    ready = f"/{AZURITE_ACCOUNT}?comp=list"
    with _running("azurite", argv, ready, cwd=cwd, deadline=deadline) as (process, port, log_path):
        handle = AzuriteEmulator("az", f"http://127.0.0.1:{port}", port, process, log_path)
        try:
            yield handle
        finally:
            if handle._client is not None:
                handle._client.close()


@contextlib.contextmanager
def run_gcs_emulator(*, deadline: float = START_DEADLINE,
                     program: Sequence[str] | None = None) -> Iterator[GCSEmulator]:
    """gcp-storage-emulator, in memory, on a free loopback port.

    Its server is single-threaded with a listen backlog of 5, so :meth:`Emulator.upload_many`
    uploads one object at a time here. ``program``: the command that runs the emulator's
    command line instead of its own script (a benchmark that patches it first).
    """
    command = list(program) if program is not None else [
        str(_require(VENV_BIN / "gcp-storage-emulator", "gcp-storage-emulator"))]

    def argv(port: int) -> list[str]:
        return [*command, "start", "--host", "127.0.0.1", "--port", str(port), "--in-memory"]

    ready = f"/storage/v1/b?project={GCS_PROJECT}"
    with _running("gcs", argv, ready, deadline=deadline) as (process, port, log_path):
        endpoint = f"http://127.0.0.1:{port}"
        handle = GCSEmulator("gs", endpoint, port, process, log_path, upload_threads=1)
        try:
            yield handle
        finally:
            if handle._client is not None:
                handle._client.close()
