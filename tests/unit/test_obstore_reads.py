"""Reads through obstore, without any network: which keys go to obstore, what its errors say
and how the backends' tables map them, how a store is set up from the SDK client's settings,
and the fork guard. tests/backends/test_obstore_reads.py runs the same paths on the emulators.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from typing import Any

import boto3
import obstore.exceptions as obe
import pytest
from botocore.config import Config

from quiverfs.base.backends import BackendOptions, RemoteSettings, obstore_reads, open_backend
from quiverfs.base.backends.azure import AzureBackend, obstore_settings
from quiverfs.base.backends.base import Backend
from quiverfs.base.backends.obstore_reads import (
    ObstoreReads,
    ObstoreUnavailable,
    exact_key,
    failure_of,
)
from quiverfs.base.backends.s3 import CREDENTIAL_TTL, S3Backend, obstore_addressing
from quiverfs.base.errors import AccessDenied, NotFound, PermanentFailure, TemporaryFailure
from quiverfs.testing.emulators import AZURITE_KEY, azurite_connection_string

# -- which keys obstore reads ------------------------------------------------------------------


@pytest.mark.parametrize(("key", "exact"), [
    ("a.bin", True),
    ("dir with space/naïve ☃.jpg", True),
    ("a%20b", True), ("a%2Fb", True), ("a+b", True), ("a#b", True), ("a?b=c&d", True),
    ("a\\b", True), ("~x", True), ("...", True), ("..a", True), (".hidden/x", True),
    ("a.", True), ("a\u0085b", True), ("\u00a0", True), ("😀", True),
    ("a//b", False), ("/lead", False), ("trail/", False), ("dir/./x", False),
    ("dir/../x", False), ("a/.", False), ("..", False), ("tab\there", False),
    ("new\nline", False), ("del\x7fete", False), ("nul\x00", False), ("", False),
])
def test_exact_key(key: str, exact: bool) -> None:
    assert exact_key(key) is exact


# -- what obstore's errors say ---------------------------------------------------------------

# Its messages as the emulators made it say them (object_store's Display, then "Debug source:").
_DEBUG = "\n\nDebug source:\nGeneric {\n    store: \"S3\",\n    source: RetryError(...)\n}"
S3_416 = obe.GenericError(
    "Generic S3 error: Error performing GET http://127.0.0.1:5/b/a in 3.4ms - Server returned "
    "non-2xx status code: 416 Range Not Satisfiable: <?xml version=\"1.0\" encoding=\"utf-8\"?>"
    "\n<Error><Code>InvalidRange</Code><Message>The requested range is not satisfiable"
    "</Message></Error>\n" + _DEBUG)
S3_503 = obe.GenericError(
    "Generic S3 error: Error performing GET http://127.0.0.1:5/b/a in 545µs - Server returned "
    "non-2xx status code: 503 Service Unavailable: <?xml version=\"1.0\" encoding=\"UTF-8\"?>\n"
    "<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>"
    + _DEBUG)
S3_404 = FileNotFoundError(
    "Object at location a not found: Error performing GET http://127.0.0.1:5/b/a in 2.3ms - "
    "Server returned non-2xx status code: 404 Not Found: <?xml version=\"1.0\"?>\n<Error>"
    "<Code>NoSuchKey</Code><Message>The specified key does not exist.</Message></Error>")
S3_403 = obe.PermissionDeniedError(
    "The operation lacked the necessary privileges to complete for path a: Error performing GET "
    "http://127.0.0.1:5/b/a in 21ms - Server returned non-2xx status code: 403 Forbidden: "
    "<?xml version=\"1.0\"?>\n<Error><Code>SignatureDoesNotMatch</Code><Message>m</Message>"
    "</Error>")
S3_400 = obe.GenericError(
    "Generic S3 error: Error performing GET http://127.0.0.1:5/b/a in 1ms - Server returned "
    "non-2xx status code: 400 Bad Request: <Error><Code>AuthorizationHeaderMalformed</Code>"
    "<Message>the region 'us-east-1' is wrong; expecting 'eu-west-1'</Message></Error>")
REFUSED = obe.GenericError(
    "Generic S3 error: Error performing GET http://127.0.0.1:1/b/a in 327µs - HTTP error: error "
    "sending request\n\nDebug source:\nGeneric {\n    store: \"S3\",\n    source: RetryError(\n"
    "        RetryErrorImpl {\n            method: GET,\n            inner: Http(\n"
    "                HttpError {\n                    kind: Connect,\n")
TIMEOUT = obe.GenericError(
    "Generic MicrosoftAzure error: Error performing GET http://127.0.0.1:5/acct/c/a in 2.0s - "
    "HTTP error: error sending request\n\nDebug source:\n ... inner: Http(\n"
    "                HttpError {\n                    kind: Timeout,\n")
CUT_SHORT = obe.GenericError(
    "Generic S3 error: HTTP error: request or response body error\n\nDebug source:\nGeneric {\n"
    "    store: \"S3\",\n    source: HttpError {\n        kind: Interrupted,\n")
REDIRECT = obe.GenericError(
    "Generic S3 error: Error performing GET http://127.0.0.1:5/b/a in 439µs - Received "
    "redirect without LOCATION, this normally indicates an incorrectly configured region"
    "\n\nDebug source:\nGeneric {\n    store: \"S3\",\n    source: RetryError( ... inner: "
    "BareRedirect,\n")
NOT_PARTIAL = obe.GenericError(
    "Generic S3 error: Received non-partial response when range requested\n\nDebug source:\n"
    "Generic {\n    store: \"S3\",\n    source: NotPartial,\n}")
AZURE_AT_END = obe.GenericError(
    "Generic MicrosoftAzure error: Wanted range starting at 10, but object was only 10 bytes "
    "long\n\nDebug source:\n...")
AZURE_503 = obe.GenericError(
    "Generic MicrosoftAzure error: Error performing GET http://127.0.0.1:5/acct/c/a in 837µs - "
    "Server returned non-2xx status code: 503 Service Unavailable: <?xml version=\"1.0\" "
    "encoding=\"utf-8\"?><Error><Code>ServerBusy</Code><Message>m</Message></Error>")
AZURE_403 = obe.PermissionDeniedError(
    "The operation lacked the necessary privileges to complete for path a: Error performing GET "
    "http://127.0.0.1:5/acct/c/a?sig=SECRET in 3.9ms - Server returned non-2xx status code: 403 "
    "Forbidden: <?xml version=\"1.0\"?>\n<Error>\n  <Code>AuthenticationFailed</Code>\n</Error>")


@pytest.mark.parametrize(("exc", "status", "code", "transport", "past_end"), [
    (S3_416, 416, "InvalidRange", "", True),
    (S3_503, 503, "SlowDown", "", False),
    (S3_404, 404, "NoSuchKey", "", False),
    (S3_403, 403, "SignatureDoesNotMatch", "", False),
    (REFUSED, 0, "", "Connect", False),
    (TIMEOUT, 0, "", "Timeout", False),
    (CUT_SHORT, 0, "", "Interrupted", False),
    (REDIRECT, 0, "", "", False),
    (NOT_PARTIAL, 0, "", "", False),
    (AZURE_AT_END, 0, "", "", True),
    (AZURE_403, 403, "AuthenticationFailed", "", False),
    (ValueError("not obstore's"), 0, "", "", False),
])
def test_failure_of(exc: BaseException, status: int, code: str, transport: str,
                    past_end: bool) -> None:
    failure = failure_of(exc)
    assert (failure.status, failure.code, failure.transport, failure.past_end) == (
        status, code, transport, past_end)


def test_a_failure_summary_has_no_url_and_no_body() -> None:
    assert failure_of(REDIRECT).summary == ("Received redirect without LOCATION, this normally "
                                            "indicates an incorrectly configured region")
    assert failure_of(NOT_PARTIAL).summary == "Received non-partial response when range requested"
    assert failure_of(AZURE_403).summary == ("Server returned non-2xx status code: 403 Forbidden")
    assert "SECRET" not in failure_of(AZURE_403).summary
    assert failure_of(REFUSED).summary == "HTTP error: error sending request"


# -- the backends' tables --------------------------------------------------------------------

SETTINGS = RemoteSettings(
    s3_endpoint_url="http://127.0.0.1:9",
    azure_connection_string=azurite_connection_string("http://127.0.0.1:9"),
)
URLS = {"s3": "s3://bucket/prefix", "az": "az://devstoreaccount1/container/prefix"}


@functools.cache
def _backend(scheme: str) -> Backend:
    return open_backend(URLS[scheme], BackendOptions(), SETTINGS)


@pytest.mark.parametrize(("scheme", "exc", "expected", "says"), [
    ("s3", S3_404, NotFound, "S3 NoSuchKey (HTTP 404)"),
    ("s3", S3_403, AccessDenied, "S3 SignatureDoesNotMatch (HTTP 403)"),
    ("s3", S3_503, TemporaryFailure, "S3 SlowDown (HTTP 503)"),
    ("s3", S3_416, PermanentFailure, ""),  # a read never raises it: past the end is b""
    ("s3", S3_400, PermanentFailure, ""),
    ("s3", REFUSED, TemporaryFailure, "obstore: Connect"),
    ("s3", CUT_SHORT, TemporaryFailure, "obstore: Interrupted"),
    ("s3", REDIRECT, PermanentFailure, ""),
    ("s3", obe.UnauthenticatedError("401"), AccessDenied, "UnauthenticatedError"),
    ("s3", obe.PermissionDeniedError("no status in it"), AccessDenied, ""),
    ("az", AZURE_503, TemporaryFailure, "Azure ServerBusy (HTTP 503)"),
    ("az", AZURE_403, AccessDenied, "Azure AuthenticationFailed (HTTP 403)"),
    ("az", TIMEOUT, TemporaryFailure, "obstore: Timeout"),
    ("az", FileNotFoundError("Object at location a not found"), NotFound, ""),
    ("az", NOT_PARTIAL, PermanentFailure, ""),
])
def test_the_backends_tables_map_obstores_errors(
    scheme: str, exc: BaseException, expected: type, says: str
) -> None:
    backend = _backend(scheme)
    error = backend._classify(exc, "some/key")
    assert type(error) is expected
    assert says in str(error) and "127.0.0.1" not in str(error) and "SECRET" not in str(error)
    # What the read path asks: is this an error the table knows (raise it), or an answer
    # obstore did not understand (ask the SDK)?
    known = backend._translate(exc, "some/key") is not None
    assert known == (expected is not PermanentFailure)


# -- setting a store up from the SDK's settings -----------------------------------------------


class _Addressed(Exception):
    """Stops a boto3 request in ``before-send`` and carries its URL out."""


def _boto3_object_url(endpoint_url: str | None, region: str, style: str | None,
                      bucket: str) -> str:
    """The URL boto3's ``get_object`` sends for ``bucket``/``k``, without sending it."""
    config = Config(s3={"addressing_style": style} if style else None)
    client = boto3.session.Session().client(
        "s3", endpoint_url=endpoint_url, region_name=region, config=config,
        aws_access_key_id="a", aws_secret_access_key="b")

    def stop(request: Any, **_: Any) -> None:
        raise _Addressed(request.url)

    client.meta.events.register_first("before-send.s3.GetObject", stop)
    try:
        client.get_object(Bucket=bucket, Key="k")
    except _Addressed as addressed:
        return addressed.args[0]
    finally:
        client.close()
    raise AssertionError("the request was not stopped")


@pytest.mark.parametrize("endpoint_url", [
    None, "http://127.0.0.1:9000", "http://localhost:9000", "https://s3.example.com",
    "https://minio.internal:9000/",
])
@pytest.mark.parametrize("style", [None, "auto", "path", "virtual"])
@pytest.mark.parametrize(("bucket", "region"), [
    ("my-bucket", "us-east-1"), ("my-bucket", "eu-west-1"), ("my.dotted.bucket", "eu-west-1"),
])
def test_obstore_reaches_the_url_boto3_reaches(
    endpoint_url: str | None, style: str | None, bucket: str, region: str
) -> None:
    # boto3 told "virtual" puts a dotted name in the host of a plain http:// endpoint;
    # obstore_addressing keeps the path there (its docstring): checked below, not compared.
    keeps_path = style == "virtual" and "." in bucket and (endpoint_url or "").startswith("http://")
    client = boto3.session.Session().client(
        "s3", endpoint_url=endpoint_url, region_name=region, aws_access_key_id="a",
        aws_secret_access_key="b", config=Config(s3={"addressing_style": style} if style else None))
    endpoint, virtual = obstore_addressing(
        client.meta.endpoint_url, endpoint_url is not None,
        (client.meta.config.s3 or {}).get("addressing_style"), bucket)
    client.close()
    # object_store's URLs: {endpoint}/{key} virtual-hosted, {endpoint}/{bucket}/{key} by path.
    obstore_url = f"{endpoint}/k" if virtual else f"{endpoint}/{bucket}/k"
    if keeps_path:
        assert not virtual and obstore_url == f"{endpoint_url}/{bucket}/k"
        return
    assert obstore_url == _boto3_object_url(endpoint_url, region, style, bucket)


def _s3_backend(monkeypatch: pytest.MonkeyPatch, **env: str) -> S3Backend:
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_CA_BUNDLE", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "eu-west-1")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    backend = open_backend("s3://bucket/prefix", BackendOptions(timeout=7.0), SETTINGS)
    assert isinstance(backend, S3Backend)
    return backend


def test_s3_static_credentials_are_given_as_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    backend = _s3_backend(monkeypatch, AWS_ACCESS_KEY_ID="AKIAKEY", AWS_SECRET_ACCESS_KEY="s3cr3t",
                          AWS_SESSION_TOKEN="tok")
    store = backend._obstore_store()
    config = store.config
    assert (config["access_key_id"], config["secret_access_key"], config["session_token"]) == (
        "AKIAKEY", "s3cr3t", "tok")
    assert store.credential_provider is None
    assert config["endpoint"] == "http://127.0.0.1:9" and config["region"] == "eu-west-1"
    assert config["virtual_hosted_style_request"] in (False, "false")
    assert store.retry_config["max_retries"] == 0
    options = store.client_options
    assert options["read_timeout"] == options["connect_timeout"] == "7s"
    assert options["allow_http"] in (True, "true")


def test_s3_refreshable_credentials_go_through_boto3(monkeypatch: pytest.MonkeyPatch,
                                                     tmp_path) -> None:
    script = tmp_path / "creds.py"
    script.write_text('print(\'{"Version": 1, "AccessKeyId": "AKIAROLE", "SecretAccessKey": "x",'
                      ' "SessionToken": "t", "Expiration": "2099-01-01T00:00:00Z"}\')\n')
    config = tmp_path / "config"
    config.write_text(f"[default]\ncredential_process = {sys.executable} {script}\n")
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name, raising=False)
    backend = _s3_backend(monkeypatch, AWS_CONFIG_FILE=str(config),
                          AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "none"))
    store = backend._obstore_store()
    provider = store.credential_provider
    assert type(provider).__name__ == "Boto3CredentialProvider"
    assert provider.ttl == CREDENTIAL_TTL
    assert provider()["access_key_id"] == "AKIAROLE"
    assert "access_key_id" not in store.config


def test_s3_uses_boto3s_ca_bundle(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    missing = tmp_path / "no-such-bundle.pem"
    backend = _s3_backend(monkeypatch, AWS_ACCESS_KEY_ID="k", AWS_SECRET_ACCESS_KEY="s",
                          AWS_CA_BUNDLE=str(missing))
    with pytest.raises(ObstoreUnavailable, match="cannot read the CA bundle"):
        backend._obstore_store()


@pytest.mark.parametrize(("connection_string", "expected"), [
    (azurite_connection_string("http://127.0.0.1:9"),
     {"endpoint": "http://127.0.0.1:9/devstoreaccount1", "account_key": AZURITE_KEY}),
    ("DefaultEndpointsProtocol=https;AccountName=acct;AccountKey=a2V5==;"
     "EndpointSuffix=core.chinacloudapi.cn",
     {"endpoint": "https://acct.blob.core.chinacloudapi.cn", "account_key": "a2V5=="}),
    ("AccountName=acct;SharedAccessSignature=sv=2024-01-01&sig=abc%3D;"
     "BlobEndpoint=https://acct.blob.core.windows.net/",
     {"endpoint": "https://acct.blob.core.windows.net", "sas_key": "sv=2024-01-01&sig=abc%3D"}),
])
def test_azure_settings_from_a_connection_string(connection_string: str,
                                                  expected: dict[str, str]) -> None:
    assert obstore_settings("acct", connection_string) == expected


def test_azure_a_connection_string_without_key_or_sas_stays_on_the_sdk() -> None:
    with pytest.raises(ObstoreUnavailable, match="neither AccountKey nor SharedAccessSignature"):
        obstore_settings("acct", "AccountName=acct;BlobEndpoint=https://acct.example")


def test_azure_store_from_the_backends_settings() -> None:
    backend = _backend("az")
    assert isinstance(backend, AzureBackend)
    store = backend._obstore_store()
    assert store.config["account_name"] == "devstoreaccount1"
    assert store.config["endpoint"] == "http://127.0.0.1:9/devstoreaccount1"
    assert store.retry_config["max_retries"] == 0


# -- the fork guard and the lazy store -------------------------------------------------------


def test_a_store_is_built_once_on_first_use() -> None:
    built: list[int] = []
    reads = ObstoreReads("s3://b", "boto3", lambda: built.append(1) or "store")
    assert built == [] and reads.path == "obstore"
    assert reads.store_for("a") == "store" and reads.store_for("b") == "store"
    assert built == [1]
    assert reads.store_for("a//b") is None and reads.sdk_reads == 1


def test_a_store_that_cannot_be_set_up_sends_reads_to_the_sdk(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def build() -> None:
        raise ObstoreUnavailable("no credentials")

    reads = ObstoreReads("s3://b", "boto3", build)
    with caplog.at_level(logging.WARNING, logger="quiverfs.backends.obstore"):
        assert reads.store_for("a") is None and reads.store_for("b") is None
    assert reads.path == "boto3" and reads.sdk_reads == 2
    [line] = [r.getMessage() for r in caplog.records]
    assert line == "reads of s3://b go through boto3: obstore could not be set up (no credentials)"


def test_a_forked_process_reads_through_the_sdk(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    reads = ObstoreReads("az://a/c", "azure-storage-blob", lambda: "store")
    monkeypatch.setattr(obstore_reads, "_runtime_pid", os.getpid())
    assert reads.store_for("a") == "store"
    monkeypatch.setattr(obstore_reads, "_runtime_pid", os.getpid() + 1)  # a parent's runtime
    with caplog.at_level(logging.WARNING, logger="quiverfs.backends.obstore"):
        assert reads.store_for("a") is None and reads.store_for("b") is None
    assert reads.path == "azure-storage-blob" and reads.sdk_reads == 2
    [line] = [r.getMessage() for r in caplog.records]
    assert "forked" in line
