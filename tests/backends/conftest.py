"""Fixtures for the backend contract suite: one emulator per store, one seeded object set each.

Every emulator starts once per session and is always stopped. The ``store`` fixture is
parametrised over the four backends (``file``, ``s3``, ``az``, ``gs``); each gets a freshly
seeded bucket (container, directory) holding :data:`STANDARD_OBJECTS` under ``root/``, plus a
few objects outside the root that a backend rooted there must never see. The tests only read,
so the set is seeded once per session.

Backends are opened with explicit settings (``open_backend(url, options, settings)``);
``os.environ`` is not changed, except that the ``open_at`` fixture gives boto3's credential
chain moto's dummy keys for the duration of one test (``monkeypatch``, undone afterwards).
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from quiverfs.base.backends import (
    Backend,
    BackendOptions,
    RemoteSettings,
    RetryPolicy,
    open_backend,
)
from quiverfs.testing.emulators import (
    MOTO_ACCESS_KEY,
    MOTO_REGION,
    MOTO_SECRET_KEY,
    AzuriteEmulator,
    Emulator,
    GCSEmulator,
    MotoEmulator,
    run_azurite,
    run_gcs_emulator,
    run_moto,
)
from quiverfs.testing.faultproxy import FaultProxy

SCHEMES = ["file", "s3", "az", "gs"]

#: More than one listing page (1,000 objects) on every store that pages.
MANY = 1001

# Retries that give up, for tests of what a caller sees when a fault outlasts the deadline. The
# deadline counts from the first attempt, whose latency on a loaded 2-core CI machine has passed
# 0.3 s (a fresh connection, the emulators sharing the cores): 2 s leaves room for it and short
# sleeps still retry several times before giving up.
GIVE_UP_SOON = RetryPolicy(deadline=2.0, initial_delay=0.01, max_delay=0.1)


def _pattern(size: int, seed: int) -> bytes:
    """``size`` deterministic, non-repeating-looking bytes."""
    return bytes((i * 31 + seed * 7 + (i >> 8)) % 251 for i in range(size))


#: The object set every store holds under ``root/``. Keys are relative to the backend root.
STANDARD_OBJECTS: dict[str, bytes] = {
    "a.bin": _pattern(1000, 1),
    "sub/b.txt": b"hello world\n",
    "sub/deeper/c.bin": _pattern(3000, 2),
    "subway.txt": b"not under sub/\n",
    "empty": b"",
    "dir with space/naïve ☃.jpg": b"\xff\xd8\xff\xe0" + _pattern(200, 3),
    **{f"many/{i:04d}": str(i).encode() for i in range(MANY)},
}

#: Objects next to the root, which a backend rooted at ``root`` must not list.
OUTSIDE_OBJECTS: dict[str, bytes] = {"rootless.txt": b"outside", "root2/x": b"outside too"}

ROOT = "root"


@dataclass
class Store:
    """One seeded store: where the standard set lives and how to reach it."""

    scheme: str
    #: Backend URL of the root holding :data:`STANDARD_OBJECTS`.
    url: str
    #: A URL on the same store whose bucket (container, directory) does not exist.
    missing_url: str
    settings: RemoteSettings
    emulator: Emulator | None
    #: Concurrency to open backends with (the GCS emulator is single-threaded, backlog 5).
    concurrency: int
    #: Whether the store honours page sizes (gcp-storage-emulator returns one page).
    paginates: bool = True

    def options(self, **changes: object) -> BackendOptions:
        """Backend options for this store, with ``changes`` applied."""
        fields = {"concurrency": self.concurrency, "timeout": 10.0, **changes}
        return BackendOptions(**fields)


# -- emulators, once per session -------------------------------------------------------------


@pytest.fixture(scope="session")
def moto() -> Iterator[MotoEmulator]:
    with run_moto() as emulator:
        yield emulator


@pytest.fixture(scope="session")
def azurite(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AzuriteEmulator]:
    with run_azurite(tmp_path_factory.mktemp("azurite")) as emulator:
        yield emulator


@pytest.fixture(scope="session")
def gcs_emulator() -> Iterator[GCSEmulator]:
    with run_gcs_emulator() as emulator:
        yield emulator


EMULATOR_FIXTURES = {"s3": "moto", "az": "azurite", "gs": "gcs_emulator"}


def _seed_directory(base: Path) -> None:
    for key, data in {
        **{f"{ROOT}/{k}": v for k, v in STANDARD_OBJECTS.items()},
        **OUTSIDE_OBJECTS,
    }.items():
        path = base / key
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)


@pytest.fixture(scope="session", params=SCHEMES)
def store(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Store:
    """A store of each kind, seeded with the standard object set under ``root/``."""
    scheme = request.param
    if scheme == "file":
        base = tmp_path_factory.mktemp("filestore")
        _seed_directory(base)
        return Store(
            scheme="file",
            url=(base / ROOT).as_uri(),
            missing_url=(base / "no-such-dir").as_uri(),
            settings=RemoteSettings(),
            emulator=None,
            concurrency=4,
        )
    emulator: Emulator = request.getfixturevalue(EMULATOR_FIXTURES[scheme])
    bucket = f"contract-{uuid.uuid4().hex[:12]}"
    emulator.create_bucket(bucket)
    objects = {f"{ROOT}/{k}": v for k, v in STANDARD_OBJECTS.items()} | OUTSIDE_OBJECTS
    emulator.upload_many(bucket, objects)
    return Store(
        scheme=scheme,
        url=emulator.root_url(bucket, ROOT),
        missing_url=emulator.root_url(f"missing-{uuid.uuid4().hex[:12]}", ROOT),
        settings=emulator.settings(),
        emulator=emulator,
        concurrency=2 if scheme == "gs" else 8,
        paginates=scheme != "gs",
    )


# -- opening backends -------------------------------------------------------------------------

OpenAt = Callable[..., Backend]


@pytest.fixture
async def open_at(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[OpenAt]:
    """``open_at(url, options, settings)``: open a backend, closed when the test ends."""
    # boto3 takes credentials only from its chain; give it moto's dummies for this test.
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", MOTO_ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", MOTO_SECRET_KEY)
    monkeypatch.setenv("AWS_DEFAULT_REGION", MOTO_REGION)
    opened: list[Backend] = []

    def _open(url: str, options: BackendOptions, settings: RemoteSettings) -> Backend:
        backend = open_backend(url, options, settings)
        opened.append(backend)
        return backend

    yield _open
    for backend in opened:
        await backend.aclose()


@pytest.fixture
def backend(store: Store, open_at: OpenAt) -> Backend:
    """A backend rooted at the store's standard object set."""
    return open_at(store.url, store.options(), store.settings)


@pytest.fixture
def proxy(store: Store) -> Iterator[FaultProxy | None]:
    """A fault proxy in front of the store's emulator (``None`` for ``file``)."""
    if store.emulator is None:
        yield None
        return
    with FaultProxy(store.emulator.port, flavor=store.scheme) as fault_proxy:
        yield fault_proxy
