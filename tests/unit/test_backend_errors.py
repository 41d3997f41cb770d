"""Each backend's error table, the retry policy and URL normalisation, without any network.

The SDK exception objects are built the way each SDK builds them; backends are constructed
with explicit settings (constructing a client sends no request).
"""

from __future__ import annotations

import errno
import functools
import random
from types import SimpleNamespace

import azure.core.exceptions as ace
import botocore.exceptions as bce
import google.api_core.exceptions as gae
import google.auth.exceptions as gue
import pytest
import requests.exceptions as rqe
import trio
import urllib3.exceptions as u3e
from azure.storage.blob._generated.models import StorageErrorCode
from google.cloud.storage.exceptions import DataCorruption

from quiverfs.base.backends import (
    Backend,
    BackendOptions,
    RemoteSettings,
    RetryPolicy,
    normalize_url,
    open_backend,
)
from quiverfs.base.errors import (
    AccessDenied,
    BackendError,
    CorruptObject,
    NotFound,
    PermanentFailure,
    TemporaryFailure,
    UsageError,
)
from quiverfs.testing.emulators import azurite_connection_string

SETTINGS = RemoteSettings(
    s3_endpoint_url="http://127.0.0.1:9",
    azure_connection_string=azurite_connection_string("http://127.0.0.1:9"),
    gcs_emulator_host="http://127.0.0.1:9",
    gcs_project="unit-tests",
)
URLS = {
    "s3": "s3://bucket/prefix",
    "az": "az://devstoreaccount1/container/prefix",
    "gs": "gs://bucket/prefix",
}


@functools.cache
def _backend(scheme: str) -> Backend:
    # Cached: building an SDK client takes tens of milliseconds; classifying needs no state.
    return open_backend(URLS[scheme], BackendOptions(), SETTINGS)


def _classify(scheme: str, exc: BaseException) -> BackendError:
    return _backend(scheme)._classify(exc, "some/key")


@pytest.fixture(params=list(URLS))
def cloud(request: pytest.FixtureRequest) -> Backend:
    return _backend(request.param)


# -- S3 ----------------------------------------------------------------------------------------


def _client_error(code: str, status: int, operation: str = "GetObject") -> bce.ClientError:
    body = {"Error": {"Code": code, "Message": "m"}, "ResponseMetadata": {"HTTPStatusCode": status}}
    return bce.ClientError(body, operation)


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        (_client_error("NoSuchKey", 404), NotFound),
        (_client_error("NoSuchBucket", 404), NotFound),
        (_client_error("404", 404, "HeadObject"), NotFound),  # HEAD has no body to parse
        (_client_error("AccessDenied", 403), AccessDenied),
        (_client_error("InvalidAccessKeyId", 403), AccessDenied),
        (_client_error("403", 403, "HeadObject"), AccessDenied),
        (_client_error("SlowDown", 503), TemporaryFailure),
        (_client_error("RequestTimeout", 400), TemporaryFailure),  # code wins over status
        (_client_error("InternalError", 500), TemporaryFailure),
        (_client_error("", 502), TemporaryFailure),
        (_client_error("SomethingNew", 429), TemporaryFailure),
        (_client_error("InvalidRange", 416), PermanentFailure),
        (_client_error("InvalidArgument", 400), PermanentFailure),
        (bce.EndpointConnectionError(endpoint_url="http://x"), TemporaryFailure),
        (bce.ConnectTimeoutError(endpoint_url="http://x"), TemporaryFailure),
        (bce.ReadTimeoutError(endpoint_url="http://x"), TemporaryFailure),
        (bce.ConnectionClosedError(endpoint_url="http://x"), TemporaryFailure),
        (bce.ResponseStreamingError(error=ConnectionResetError()), TemporaryFailure),
        (bce.IncompleteReadError(actual_bytes=1, expected_bytes=2), TemporaryFailure),
        (u3e.ProtocolError("Connection aborted.", ConnectionResetError()), TemporaryFailure),
        (bce.NoCredentialsError(), AccessDenied),
        (bce.ParamValidationError(report="bad"), PermanentFailure),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_s3_error_table(exc: BaseException, expected: type[BackendError]) -> None:
    error = _classify("s3", exc)
    assert type(error) is expected
    assert error.url == "s3://bucket/prefix" and error.key == "some/key"
    assert "s3://bucket/prefix/some/key" in str(error)


# -- Azure -------------------------------------------------------------------------------------


def _azure_response(status: int) -> SimpleNamespace:
    return SimpleNamespace(
        status_code=status, reason="r", headers={}, text=lambda: "", content_type="text/plain"
    )


def _azure_error(cls: type[ace.HttpResponseError], status: int, code: object = None):
    exc = cls(message="m", response=_azure_response(status))
    if code is not None:
        exc.error_code = code  # what azure-storage-blob's process_storage_error sets
    return exc


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        (_azure_error(ace.ResourceNotFoundError, 404, "BlobNotFound"), NotFound),
        (
            _azure_error(ace.ResourceNotFoundError, 404, StorageErrorCode.CONTAINER_NOT_FOUND),
            NotFound,
        ),
        (ace.ResourceNotFoundError("no response at all"), NotFound),
        (_azure_error(ace.ClientAuthenticationError, 403, "AuthenticationFailed"), AccessDenied),
        (_azure_error(ace.HttpResponseError, 403, "AuthorizationPermissionMismatch"), AccessDenied),
        (_azure_error(ace.HttpResponseError, 503, StorageErrorCode.SERVER_BUSY), TemporaryFailure),
        (_azure_error(ace.HttpResponseError, 500, "OperationTimedOut"), TemporaryFailure),
        (_azure_error(ace.HttpResponseError, 503), TemporaryFailure),
        (_azure_error(ace.HttpResponseError, 429), TemporaryFailure),
        (_azure_error(ace.HttpResponseError, 416, "InvalidRange"), PermanentFailure),
        (_azure_error(ace.HttpResponseError, 400, "InvalidQueryParameterValue"), PermanentFailure),
        (ace.ServiceRequestError("connect failed"), TemporaryFailure),
        (ace.ServiceRequestTimeoutError("connect timeout"), TemporaryFailure),
        (ace.ServiceResponseError("connection reset"), TemporaryFailure),
        (ace.ServiceResponseTimeoutError("read timeout"), TemporaryFailure),
        (rqe.ConnectionError("reset"), TemporaryFailure),
        (rqe.ChunkedEncodingError("broken"), TemporaryFailure),
    ],
)
def test_azure_error_table(exc: BaseException, expected: type[BackendError]) -> None:
    error = _classify("az", exc)
    assert type(error) is expected


def test_azure_message_uses_the_plain_error_code() -> None:
    error = _classify("az", _azure_error(ace.HttpResponseError, 503, StorageErrorCode.SERVER_BUSY))
    assert "ServerBusy (HTTP 503)" in str(error)
    assert "StorageErrorCode" not in str(error)


def test_azure_connection_string_for_another_account_is_a_usage_error() -> None:
    settings = RemoteSettings(azure_connection_string=azurite_connection_string("http://h:1"))
    with pytest.raises(UsageError, match="devstoreaccount1.*otheraccount"):
        open_backend("az://otheraccount/container", BackendOptions(), settings)


# -- GCS ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        (gae.NotFound("m"), NotFound),
        (gae.Forbidden("m"), AccessDenied),
        (gae.Unauthorized("m"), AccessDenied),
        (gae.TooManyRequests("m"), TemporaryFailure),
        (gae.InternalServerError("m"), TemporaryFailure),
        (gae.BadGateway("m"), TemporaryFailure),
        (gae.ServiceUnavailable("m"), TemporaryFailure),
        (gae.GatewayTimeout("m"), TemporaryFailure),
        (gae.from_http_status(408, "m"), TemporaryFailure),
        (gae.from_http_status(507, "m"), PermanentFailure),
        (gae.RequestRangeNotSatisfiable("m"), PermanentFailure),
        (gae.BadRequest("m"), PermanentFailure),
        (gue.DefaultCredentialsError("no ADC"), AccessDenied),
        (gue.RefreshError("token refresh failed"), AccessDenied),
        (gue.TransportError("metadata server unreachable"), TemporaryFailure),
        (rqe.ConnectionError("reset"), TemporaryFailure),
        (rqe.ReadTimeout("slow"), TemporaryFailure),
        (rqe.ChunkedEncodingError("broken"), TemporaryFailure),
        (DataCorruption(None, "md5 mismatch"), CorruptObject),
    ],
)
def test_gcs_error_table(exc: BaseException, expected: type[BackendError]) -> None:
    assert type(_classify("gs", exc)) is expected


# -- every backend -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        (ConnectionResetError(errno.ECONNRESET, "reset"), TemporaryFailure),
        (TimeoutError("timed out"), TemporaryFailure),
        (ValueError("a bug"), PermanentFailure),
    ],
)
def test_generic_fallbacks(cloud: Backend, exc: BaseException, expected: type) -> None:
    assert type(cloud._classify(exc, "k")) is expected
    assert cloud.is_temp_failure(exc) == (expected is TemporaryFailure)


def test_our_own_errors_pass_through(cloud: Backend) -> None:
    error = NotFound("gone", url=cloud.url, key="k")
    assert cloud._classify(error, "k") is error


@pytest.mark.parametrize(
    ("err", "expected"),
    [
        (errno.ENOENT, NotFound),
        (errno.EACCES, AccessDenied),
        (errno.EIO, TemporaryFailure),
        (errno.ESTALE, TemporaryFailure),
        (errno.ENOSPC, PermanentFailure),
    ],
)
def test_file_errno_table(tmp_path, err: int, expected: type) -> None:
    backend = open_backend(str(tmp_path), BackendOptions(), RemoteSettings())
    assert type(backend._classify(OSError(err, "x"), "k")) is expected


# -- retry policy and the retry loop -----------------------------------------------------------


def test_backoff_is_full_jitter_under_an_exponential_cap() -> None:
    policy = RetryPolicy(initial_delay=0.1, max_delay=1.0, multiplier=2.0)
    rng = random.Random(42)
    for attempt, cap in [(0, 0.1), (1, 0.2), (2, 0.4), (3, 0.8), (4, 1.0), (10, 1.0)]:
        delays = [policy.delay(attempt, rng) for _ in range(500)]
        assert all(0 <= d <= cap for d in delays)
        assert max(delays) > 0.9 * cap  # the whole range is used ...
        assert min(delays) < 0.1 * cap  # ... from near zero: full jitter


def _flaky_file_backend(tmp_path, policy: RetryPolicy, failures: int | None, exc: OSError):
    (tmp_path / "obj").write_bytes(b"payload")
    backend = open_backend(str(tmp_path), BackendOptions(retry=policy), RemoteSettings())
    real = backend._stat
    calls = 0

    def flaky(key: str):
        nonlocal calls
        calls += 1
        if failures is None or calls <= failures:
            raise exc
        return real(key)

    backend._stat = flaky
    return backend, lambda: calls


async def test_temporary_failures_are_retried_until_success(tmp_path) -> None:
    policy = RetryPolicy(deadline=30, initial_delay=0.001, max_delay=0.01)
    backend, calls = _flaky_file_backend(tmp_path, policy, 3, OSError(errno.EIO, "eio"))
    assert (await backend.stat("obj")).size == 7
    assert calls() == 4
    assert backend.counters.retries == 3
    assert backend.counters.requests["HEAD"] == 4
    assert backend.counters.failures["TemporaryFailure"] == 3


async def test_retries_stop_at_the_deadline(tmp_path) -> None:
    policy = RetryPolicy(deadline=0.2, initial_delay=0.001, max_delay=0.01)
    backend, calls = _flaky_file_backend(tmp_path, policy, None, OSError(errno.EIO, "eio"))
    start = trio.current_time()
    with pytest.raises(TemporaryFailure) as failure:
        await backend.stat("obj")
    elapsed = trio.current_time() - start
    assert isinstance(failure.value.__cause__, OSError)
    assert failure.value.__cause__.errno == errno.EIO
    assert backend.counters.retries >= 3
    assert calls() == backend.counters.retries + 1
    assert elapsed <= 0.2 + 1.0  # no retry starts after the deadline (slack for a slow box)


async def test_permanent_failures_are_not_retried(tmp_path) -> None:
    policy = RetryPolicy(deadline=30, initial_delay=0.001, max_delay=0.01)
    backend, calls = _flaky_file_backend(tmp_path, policy, None, OSError(errno.EACCES, "no"))
    with pytest.raises(AccessDenied) as failure:
        await backend.stat("obj")
    assert isinstance(failure.value.__cause__, PermissionError)
    assert calls() == 1
    assert backend.counters.retries == 0


# -- URLs --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("s3://bucket", "s3://bucket"),
        ("S3://bucket/some/prefix/", "s3://bucket/some/prefix"),
        ("gs://bucket//prefix//", "gs://bucket/prefix"),
        ("az://account/container", "az://account/container"),
        ("az://account/container/pre/fix/", "az://account/container/pre/fix"),
        ("file:///data/set/", "file:///data/set"),
        ("file://localhost/data", "file:///data"),
        ("file:///data/with%20space", "file:///data/with%20space"),
        ("/abs/path with space", "file:///abs/path%20with%20space"),
    ],
)
def test_normalize_url_good(url: str, expected: str) -> None:
    assert normalize_url(url) == expected


def test_normalize_url_relative_path_becomes_absolute(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert normalize_url("data") == (tmp_path / "data").as_uri()


@pytest.mark.parametrize(
    "url",
    [
        "ftp://host/x",
        "s3:///prefix-without-bucket",
        "gs://",
        "az://account",
        "az://account/",
        "file://host/path",
        "file://relative",
    ],
)
def test_normalize_url_bad(url: str) -> None:
    with pytest.raises(UsageError):
        normalize_url(url)
