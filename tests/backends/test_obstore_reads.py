"""Reads through obstore (quiverfs/base/backends/obstore_reads.py) on the real emulators: S3Backend
against moto, AzureBackend against Azurite.

What the contract suite (test_contract.py) does not show: that the reads really go through
obstore (the SDK's read call is made to refuse), that the keys obstore would not send as they
are go through the SDK (and are counted), that obstore's errors mean what the SDK's mean
(moto checks signatures once its authentication is switched on), that a fault costs one request
per attempt (obstore's own retries are off), that an answer obstore does not understand hands
the reads to the SDK, and that a forked process does not hang in obstore.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import boto3
import pytest
from azure.storage.blob import ContainerSasPermissions, generate_container_sas

from quiverfs.base.backends import Backend, BackendOptions, RemoteSettings, RetryPolicy
from quiverfs.base.backends.azure import AzureBackend
from quiverfs.base.backends.s3 import S3Backend
from quiverfs.base.errors import AccessDenied, NotFound, TemporaryFailure
from quiverfs.testing.emulators import (
    AZURITE_ACCOUNT,
    AZURITE_KEY,
    MOTO_ACCESS_KEY,
    MOTO_REGION,
    MOTO_SECRET_KEY,
    AzuriteEmulator,
    Emulator,
    MotoEmulator,
    run_moto,
)
from quiverfs.testing.faultproxy import FaultProxy

from .conftest import GIVE_UP_SOON, OpenAt

pytestmark = pytest.mark.backends

DATA = bytes(range(256)) * 40  # 10,240 bytes
FAST_RETRY = RetryPolicy(deadline=30.0, initial_delay=0.01, max_delay=0.05)
OPTIONS = BackendOptions(concurrency=4, timeout=10.0, retry=FAST_RETRY)

#: Keys obstore would refuse or rewrite, each store's: read through the SDK. (Azure refuses
#: names with ``.`` or ``..`` segments itself.)
SDK_KEYS = {
    "s3": ["a//b", "dir/./x", "dir/../x", "tab\there", "del\x7fete"],
    "az": ["a//b", "tab\there", "del\x7fete"],
}


def _seed(emulator: Emulator, extra: dict[str, bytes] | None = None) -> str:
    """A fresh bucket with :data:`DATA` at ``root/a b/naïve ☃.bin``, an empty object, and
    ``extra`` (keys under ``root/``); its URL."""
    bucket = f"obstore-{uuid.uuid4().hex[:12]}"
    emulator.create_bucket(bucket)
    objects = {"a b/naïve ☃.bin": DATA, "empty": b"", **(extra or {})}
    emulator.upload_many(bucket, {f"root/{key}": data for key, data in objects.items()})
    return emulator.root_url(bucket, "root")


class SdkReads:
    """Counts (or refuses) the SDK's own read call of a backend."""

    def __init__(self, backend: Backend, refuse: bool = False) -> None:
        self.calls: list[str] = []
        self.refuse = refuse
        if isinstance(backend, S3Backend):
            real = backend.client.get_object

            def get_object(**kwargs: Any) -> Any:
                self._called(kwargs["Key"])
                return real(**kwargs)

            backend.client.get_object = get_object  # type: ignore[method-assign]
        else:
            assert isinstance(backend, AzureBackend)
            real_blob = backend.container_client.get_blob_client

            def get_blob_client(name: str) -> Any:
                self._called(name)
                return real_blob(name)

            backend.container_client.get_blob_client = get_blob_client  # type: ignore[method-assign]

    def _called(self, key: str) -> None:
        if self.refuse:
            raise AssertionError(f"the SDK read {key!r}: it should have gone through obstore")
        self.calls.append(key)


@pytest.fixture(params=["s3", "az"])
def emulator(request: pytest.FixtureRequest) -> Emulator:
    return request.getfixturevalue({"s3": "moto", "az": "azurite"}[request.param])


# -- reads go through obstore ------------------------------------------------------------------


async def test_reads_go_through_obstore(emulator: Emulator, open_at: OpenAt) -> None:
    backend = open_at(_seed(emulator), OPTIONS, emulator.settings())
    SdkReads(backend, refuse=True)
    key = "a b/naïve ☃.bin"
    assert await backend.read_range(key, 0, len(DATA)) == DATA
    assert await backend.read_range(key, 100, 50) == DATA[100:150]
    assert await backend.read_range(key, len(DATA) - 5, 100) == DATA[-5:]  # short at the end
    assert await backend.read_range(key, len(DATA), 10) == b""  # at the end
    assert await backend.read_range(key, len(DATA) + 100, 10) == b""  # past it
    assert await backend.read_range("empty", 0, 10) == b""
    with pytest.raises(NotFound) as missing:
        await backend.read_range("missing", 0, 10)
    assert "(HTTP 404)" in str(missing.value) and missing.value.__cause__ is not None
    assert backend.read_path() == "obstore"
    assert backend.reads.sdk_reads == 0
    assert backend.counters.requests["GET"] == 7 and backend.counters.retries == 0
    assert backend.counters.bytes_read == len(DATA) + 50 + 5


async def test_a_missing_bucket_is_not_found(emulator: Emulator, open_at: OpenAt) -> None:
    url = emulator.root_url(f"missing-{uuid.uuid4().hex[:12]}", "root")
    backend = open_at(url, OPTIONS, emulator.settings())
    SdkReads(backend, refuse=True)
    with pytest.raises(NotFound):
        await backend.read_range("a", 0, 10)


async def test_keys_obstore_would_not_send_as_they_are_go_through_the_sdk(
    emulator: Emulator, open_at: OpenAt
) -> None:
    keys = SDK_KEYS[emulator.scheme]
    objects = {key: f"object {key!r}".encode() for key in keys}
    backend = open_at(_seed(emulator, objects), OPTIONS, emulator.settings())
    sdk = SdkReads(backend)
    for key, data in objects.items():
        assert await backend.read_range(key, 0, 100) == data
        assert await backend.read_range(key, 2, 4) == data[2:6]
    assert sdk.calls == [f"root/{key}" for key in keys for _ in range(2)]
    assert backend.reads.sdk_reads == 2 * len(keys)
    assert await backend.read_range("a b/naïve ☃.bin", 0, 10) == DATA[:10]  # obstore again
    assert len(sdk.calls) == 2 * len(keys)
    assert backend.read_path() == "obstore"


# -- faults: one request per attempt -------------------------------------------------------


@pytest.mark.parametrize("mode", ["503", "reset"])
async def test_a_fault_costs_one_request_per_attempt(
    emulator: Emulator, open_at: OpenAt, mode: str
) -> None:
    url = _seed(emulator)
    with FaultProxy(emulator.port, flavor=emulator.scheme) as proxy:
        backend = open_at(url, OPTIONS, emulator.settings(proxy.endpoint))
        SdkReads(backend, refuse=True)
        assert await backend.read_range("a b/naïve ☃.bin", 0, 10) == DATA[:10]  # warm
        seen = proxy.requests_seen
        proxy.arm(mode, count=2)
        assert await backend.read_range("a b/naïve ☃.bin", 100, 2000) == DATA[100:2100]
        # obstore's own retries are off: the base class's two retries are the only ones.
        assert proxy.faults_injected == 2
        assert proxy.requests_seen - seen == 3
        assert backend.counters.requests["GET"] == 1 + 3
        assert backend.counters.retries == 2
        assert backend.counters.failures["TemporaryFailure"] == 2
        assert backend.read_path() == "obstore"


@pytest.mark.parametrize("mode", ["503", "reset"])
async def test_a_fault_past_the_deadline_is_a_temporary_failure(
    emulator: Emulator, open_at: OpenAt, mode: str
) -> None:
    url = _seed(emulator)
    options = BackendOptions(concurrency=4, timeout=10.0, retry=GIVE_UP_SOON)
    with FaultProxy(emulator.port, flavor=emulator.scheme) as proxy:
        backend = open_at(url, options, emulator.settings(proxy.endpoint))
        SdkReads(backend, refuse=True)
        proxy.arm(mode, count=None)
        with pytest.raises(TemporaryFailure) as failure:
            await backend.read_range("a b/naïve ☃.bin", 0, 10)
        proxy.disarm()
        assert type(failure.value.__cause__).__module__.startswith("obstore")
        assert backend.counters.retries >= 1
        assert proxy.faults_injected == proxy.requests_seen == backend.counters.requests["GET"]
        assert await backend.read_range("a b/naïve ☃.bin", 0, 10) == DATA[:10]
        assert backend.read_path() == "obstore"


# -- credentials ---------------------------------------------------------------------------


def _moto_api(emulator: MotoEmulator, path: str, body: bytes) -> None:
    request = urllib.request.Request(f"{emulator.endpoint}/moto-api/{path}", data=body,
                                     method="POST", headers={"Content-Type": "text/plain"})
    with urllib.request.urlopen(request, timeout=10) as answer:
        answer.read()


@pytest.fixture(scope="module")
def moto_checking() -> Iterator[tuple[MotoEmulator, str, dict[str, str]]]:
    """A moto of its own that checks credentials and signatures (its authentication on), with
    one object and the access key of a user allowed to read it: (emulator, URL, key)."""
    with run_moto() as emulator:
        url = _seed(emulator)
        iam = boto3.session.Session().client(
            "iam", endpoint_url=emulator.endpoint, region_name=MOTO_REGION,
            aws_access_key_id=MOTO_ACCESS_KEY, aws_secret_access_key=MOTO_SECRET_KEY)
        iam.create_user(UserName="reader")
        iam.put_user_policy(UserName="reader", PolicyName="read", PolicyDocument=json.dumps({
            "Version": "2012-10-17",
            "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}))
        key = iam.create_access_key(UserName="reader")["AccessKey"]
        iam.close()
        _moto_api(emulator, "reset-auth", b"0")  # every request from now on is checked
        yield emulator, url, {"id": key["AccessKeyId"], "secret": key["SecretAccessKey"]}


@pytest.mark.parametrize(("which", "code"), [
    ("right", ""), ("wrong secret", "SignatureDoesNotMatch"), ("unknown key", "InvalidAccessKeyId"),
])
async def test_s3_credentials_are_checked_and_wrong_ones_are_access_denied(
    moto_checking: tuple[MotoEmulator, str, dict[str, str]], open_at: OpenAt,
    monkeypatch: pytest.MonkeyPatch, which: str, code: str,
) -> None:
    emulator, url, key = moto_checking
    access, secret = {"right": (key["id"], key["secret"]), "wrong secret": (key["id"], "nope"),
                      "unknown key": ("AKIAQUIVERFSUNKNOWN0", "nope")}[which]
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", access)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    backend = open_at(url, OPTIONS, emulator.settings())
    SdkReads(backend, refuse=True)
    if not code:
        assert await backend.read_range("a b/naïve ☃.bin", 5, 10) == DATA[5:15]
    else:
        with pytest.raises(AccessDenied, match=f"S3 {code} \\(HTTP 403\\)"):
            await backend.read_range("a b/naïve ☃.bin", 5, 10)
        assert backend.counters.requests["GET"] == 1  # not retried
    assert backend.read_path() == "obstore"


async def test_s3_refreshable_credentials_come_from_boto3s_chain(
    moto_checking: tuple[MotoEmulator, str, dict[str, str]], open_at: OpenAt,
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
) -> None:
    """A profile's ``credential_process`` gives botocore refreshable credentials, which obstore
    gets through ``Boto3CredentialProvider`` (and moto checks the signature made with them)."""
    emulator, url, key = moto_checking
    expiry = (datetime.now(UTC) + timedelta(hours=1)).strftime("%Y-%m-%dT%H:%M:%SZ")
    output = json.dumps({"Version": 1, "AccessKeyId": key["id"],
                         "SecretAccessKey": key["secret"], "Expiration": expiry})
    script = tmp_path / "credentials.py"
    script.write_text(f"print({output!r})\n")
    config = tmp_path / "config"
    config.write_text(f"[default]\ncredential_process = {sys.executable} {script}\n")
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(config))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    backend = open_at(url, OPTIONS, emulator.settings())
    SdkReads(backend, refuse=True)
    assert await backend.read_range("a b/naïve ☃.bin", 0, 100) == DATA[:100]
    assert await backend.read_range("a b/naïve ☃.bin", 100, 100) == DATA[100:200]
    provider = backend.reads._store.credential_provider
    assert type(provider).__name__ == "Boto3CredentialProvider"


async def test_s3_without_credentials_reads_go_through_boto3(
    moto: MotoEmulator, open_at: OpenAt, monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    url = _seed(moto)
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name)
    for name in ("AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE"):
        monkeypatch.setenv(name, str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.delenv("AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", raising=False)
    monkeypatch.delenv("AWS_CONTAINER_CREDENTIALS_FULL_URI", raising=False)
    backend = open_at(url, OPTIONS, moto.settings())
    with caplog.at_level(logging.WARNING, logger="quiverfs.backends.obstore"):
        with pytest.raises(AccessDenied, match="NoCredentialsError"):
            await backend.read_range("a b/naïve ☃.bin", 0, 10)
        with pytest.raises(AccessDenied):
            await backend.read_range("a b/naïve ☃.bin", 0, 10)
    assert backend.read_path() == "boto3"
    assert backend.reads.sdk_reads == 2
    [line] = [r.getMessage() for r in caplog.records if "obstore" in r.getMessage()]
    assert "boto3 found no credentials" in line and url in line


async def test_azure_a_wrong_account_key_is_access_denied(
    azurite: AzuriteEmulator, open_at: OpenAt
) -> None:
    url = _seed(azurite)
    settings = azurite.settings()
    wrong = "QUJD" + AZURITE_KEY[4:]
    assert settings.azure_connection_string is not None
    settings = RemoteSettings(
        azure_connection_string=settings.azure_connection_string.replace(AZURITE_KEY, wrong))
    backend = open_at(url, OPTIONS, settings)
    SdkReads(backend, refuse=True)
    # Azure says AuthenticationFailed; Azurite, AuthorizationFailure.
    with pytest.raises(AccessDenied, match=r"Azure Auth\w+ \(HTTP 403\)"):
        await backend.read_range("a b/naïve ☃.bin", 0, 10)
    assert backend.counters.requests["GET"] == 1 and backend.read_path() == "obstore"


async def test_azure_a_shared_access_signature_reads_through_obstore(
    azurite: AzuriteEmulator, open_at: OpenAt
) -> None:
    url = _seed(azurite)
    container = url.split("/")[3]
    sas = generate_container_sas(
        AZURITE_ACCOUNT, container, account_key=AZURITE_KEY,
        permission=ContainerSasPermissions(read=True),
        expiry=datetime.now(UTC) + timedelta(hours=1))
    settings = RemoteSettings(azure_connection_string=(
        f"AccountName={AZURITE_ACCOUNT};BlobEndpoint={azurite.endpoint}/{AZURITE_ACCOUNT};"
        f"SharedAccessSignature={sas}"))
    backend = open_at(url, OPTIONS, settings)
    SdkReads(backend, refuse=True)
    assert await backend.read_range("a b/naïve ☃.bin", 7, 70) == DATA[7:77]
    assert backend.read_path() == "obstore"


# -- an answer obstore does not understand -------------------------------------------------


class IgnoresRange(BaseHTTPRequestHandler):
    """A store that answers every GET with the whole of :data:`DATA` (200, no ``Range``
    honoured), as some S3-compatible servers do: obstore refuses such an answer to a ranged
    request; boto3 takes it, and the backend cuts the range out."""

    protocol_version = "HTTP/1.1"
    user_agents: list[str] = []

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self.user_agents.append(self.headers.get("User-Agent", ""))
        self.send_response(200)
        self.send_header("Content-Length", str(len(DATA)))
        self.send_header("ETag", '"1"')
        self.send_header("Last-Modified", "Wed, 21 Oct 2026 07:28:00 GMT")
        self.end_headers()
        self.wfile.write(DATA)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def ignores_range() -> Iterator[tuple[str, list[str]]]:
    """``(endpoint, user agents of the GETs it answered)``."""
    agents: list[str] = []
    handler = type("Handler", (IgnoresRange,), {"user_agents": agents})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", agents
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


async def test_an_answer_obstore_does_not_understand_hands_the_reads_to_boto3(
    open_at: OpenAt, ignores_range: tuple[str, list[str]], caplog: pytest.LogCaptureFixture
) -> None:
    endpoint, agents = ignores_range
    backend = open_at("s3://bucket/root", OPTIONS, RemoteSettings(s3_endpoint_url=endpoint))
    assert backend.read_path() == "obstore"
    with caplog.at_level(logging.WARNING, logger="quiverfs.backends.obstore"):
        assert await backend.read_range("k", 5, 10) == DATA[5:15]
    assert backend.read_path() == "boto3"
    [line] = [r.getMessage() for r in caplog.records if r.name == "quiverfs.backends.obstore"]
    assert "non-partial response" in line and "boto3 read" in line
    assert await backend.read_range("k", len(DATA) - 4, 10) == DATA[-4:]
    assert ["Botocore" in agent for agent in agents] == [False, True, True]
    assert backend.counters.requests["GET"] == 2 and backend.reads.sdk_reads == 2


# -- forks -------------------------------------------------------------------------------------


def _in_a_forked_child(work: Callable[[], dict[str, Any]], deadline: float = 60.0) -> dict:
    """``work()``'s result, run in a child forked from this process (killed past
    ``deadline``: a child that hangs fails the test instead of stopping the run)."""
    reader, writer = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            os.close(reader)
            os.write(writer, json.dumps(work()).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(writer)
    until = time.monotonic() + deadline
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > until:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            os.close(reader)
            pytest.fail(f"the forked child did not finish within {deadline:.0f} s")
        time.sleep(0.05)  # polling a child, bounded by the deadline above
    with os.fdopen(reader, "rb") as pipe:
        output = pipe.read()
    assert os.waitstatus_to_exitcode(status) == 0, output
    return json.loads(output)


async def test_a_process_forked_after_obstore_ran_reads_through_the_sdk(
    emulator: Emulator, open_at: OpenAt
) -> None:
    """obstore's runtime cannot run in a child forked after it started (every call would
    block forever): such a child's reads go through the SDK."""
    backend = open_at(_seed(emulator), OPTIONS, emulator.settings())
    assert await backend.read_range("a b/naïve ☃.bin", 0, 10) == DATA[:10]  # runtime started

    def child() -> dict[str, Any]:
        data = backend.call_blocking("GET", "k", backend._read_range, "a b/naïve ☃.bin", 3, 30)
        return {"ok": data == DATA[3:33], "path": backend.read_path(),
                "sdk_reads": backend.reads.sdk_reads}

    sdk = {"s3": "boto3", "az": "azure-storage-blob"}[emulator.scheme]
    assert _in_a_forked_child(child) == {"ok": True, "path": sdk, "sdk_reads": 1}
    assert backend.read_path() == "obstore"  # the parent still reads through obstore
    assert await backend.read_range("a b/naïve ☃.bin", 0, 10) == DATA[:10]
