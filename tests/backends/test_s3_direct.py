"""S3 reads without boto3's per-call pipeline (quiverfs.backends.s3.DirectGet): the same
request, signed as botocore signs it, with every answer meaning what it means through boto3.

Against moto for the reads, and against a small scripted HTTP server on loopback for what
moto cannot be made to do (answers that ignore ``Range``, bodies cut short, redirects) and
to see the request exactly as it arrives (moto does not check signatures).
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from botocore.auth import S3SigV4Auth, _host_from_url
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials

from quiverfs.backends import BackendOptions, RemoteSettings, RetryPolicy
from quiverfs.backends.s3 import S3Backend
from quiverfs.backends.s3_sign import host_header
from quiverfs.errors import AccessDenied, NotFound, TemporaryFailure
from quiverfs.testing.emulators import MOTO_ACCESS_KEY, MOTO_REGION, MOTO_SECRET_KEY, MotoEmulator
from tests.backends.conftest import GIVE_UP_SOON, OpenAt

DATA = bytes(range(256)) * 40  # 10,240 bytes

#: What the scripted server answers: (status, headers, body) for a request's headers.
Script = Callable[[dict[str, str]], tuple[int, dict[str, str], bytes]]


@dataclass
class Seen:
    """One request as the scripted server received it."""

    method: str
    path: str
    headers: dict[str, str]


@dataclass
class Scripted:
    endpoint: str
    script: Script
    seen: list[Seen] = field(default_factory=list)


def partial_answer(headers: dict[str, str]) -> tuple[int, dict[str, str], bytes]:
    """S3's answer to a ranged GET of :data:`DATA`."""
    first, _, last = headers["range"].removeprefix("bytes=").partition("-")
    part = DATA[int(first) : int(last) + 1]
    return 206, {"Content-Range": f"bytes {first}-{last}/{len(DATA)}"}, part


def is_boto3(headers: dict[str, str]) -> bool:
    return "Botocore" in headers.get("user-agent", "")


@pytest.fixture
def scripted() -> Iterator[Scripted]:
    state = Scripted("", partial_answer)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            headers = {k.lower(): v for k, v in self.headers.items()}
            state.seen.append(Seen("GET", self.path, headers))
            status, extra, body = state.script(headers)
            self.send_response(status)
            length = extra.pop("Content-Length", str(len(body)))
            for name, value in extra.items():
                self.send_header(name, value)
            self.send_header("Content-Length", length)
            if int(length) != len(body):
                self.send_header("Connection", "close")
                self.close_connection = True
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    state.endpoint = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        yield state
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def _open_scripted(open_at: OpenAt, scripted: Scripted,
                   retry: RetryPolicy = RetryPolicy()) -> S3Backend:
    options = BackendOptions(concurrency=2, timeout=5.0, retry=retry)
    backend = open_at("s3://bucket/root", options, RemoteSettings(s3_endpoint_url=scripted.endpoint))
    assert isinstance(backend, S3Backend) and backend.direct is not None
    return backend


def _no_boto3_reads(backend: S3Backend) -> None:
    def refuse(**kwargs: object) -> None:
        raise AssertionError(f"boto3's get_object was called: {kwargs}")

    backend.client.get_object = refuse  # type: ignore[method-assign]


async def test_reads_from_moto_never_call_get_object(moto: MotoEmulator, open_at: OpenAt):
    bucket = f"direct-{uuid.uuid4().hex[:12]}"
    moto.create_bucket(bucket)
    moto.upload_many(bucket, {"root/a b/naïve ☃.bin": DATA, "root/empty": b""})
    backend = open_at(moto.root_url(bucket, "root"), BackendOptions(), moto.settings())
    assert isinstance(backend, S3Backend) and backend.direct is not None
    assert backend.direct.base_url == f"{moto.endpoint}/{bucket}/"
    assert (backend.direct.region, backend.direct.service) == (MOTO_REGION, "s3")
    _no_boto3_reads(backend)
    assert await backend.read_range("a b/naïve ☃.bin", 0, len(DATA)) == DATA
    assert await backend.read_range("a b/naïve ☃.bin", 100, 50) == DATA[100:150]
    assert await backend.read_range("a b/naïve ☃.bin", len(DATA) - 5, 100) == DATA[-5:]
    assert await backend.read_range("a b/naïve ☃.bin", len(DATA), 10) == b""
    assert await backend.read_range("empty", 0, 10) == b""
    with pytest.raises(NotFound, match="NoSuchKey"):
        await backend.read_range("missing", 0, 10)
    assert backend.counters.requests["GET"] == 6 and backend.direct is not None


@pytest.mark.parametrize("token", [None, "FwoGZXIvYXdzE/temporary+token=="])
async def test_signature_covers_the_request_as_it_arrives(
    open_at: OpenAt, scripted: Scripted, monkeypatch: pytest.MonkeyPatch, token: str | None
):
    if token is not None:
        monkeypatch.setenv("AWS_SESSION_TOKEN", token)
    backend = _open_scripted(open_at, scripted)
    _no_boto3_reads(backend)
    assert await backend.read_range("dir/x y+z.bin", 10, 20) == DATA[10:30]
    assert await backend.read_range("dir/x y+z.bin", 0, 5) == DATA[:5]  # the kept key signs too
    for seen in scripted.seen:
        assert seen.path == "/bucket/root/dir/x%20y%2Bz.bin"
        authorization = seen.headers["authorization"]
        signed = authorization.split("SignedHeaders=")[1].split(",")[0].split(";")
        assert signed == ["host", "range", "x-amz-content-sha256", "x-amz-date"] + (
            ["x-amz-security-token"] if token else [])
        assert seen.headers.get("x-amz-security-token") == token
        # Sign what arrived, as S3 does, with botocore's signer and the same timestamp.
        request = AWSRequest("GET", f"http://{seen.headers['host']}{seen.path}",
                             headers={name: seen.headers[name] for name in signed if name != "host"})
        request.context["timestamp"] = seen.headers["x-amz-date"]
        signer = S3SigV4Auth(Credentials(MOTO_ACCESS_KEY, MOTO_SECRET_KEY, token), "s3", MOTO_REGION)
        expected = signer.signature(
            signer.string_to_sign(request, signer.canonical_request(request)), request)
        assert authorization.endswith(f"Signature={expected}")
        assert f"Credential={MOTO_ACCESS_KEY}/{seen.headers['x-amz-date'][:8]}/{MOTO_REGION}/s3/" \
            in authorization
    assert [s.headers["range"] for s in scripted.seen] == ["bytes=10-29", "bytes=0-4"]


@pytest.mark.parametrize(("url", "host"), [
    ("http://127.0.0.1:9000/b/", "127.0.0.1:9000"),
    ("https://My-Bucket.S3.eu-west-1.amazonaws.com/", "my-bucket.s3.eu-west-1.amazonaws.com"),
    ("https://s3.example.com:443/b/", "s3.example.com"),
    ("http://s3.example.com:80/b/", "s3.example.com"),
    ("https://s3.example.com:80/b/", "s3.example.com:80"),
    ("http://[::1]:9000/b/", "[::1]:9000"),
])
def test_host_header_is_signed_as_botocore_signs_it(url: str, host: str):
    assert host_header(url) == host == _host_from_url(url)


async def test_a_store_that_ignores_range_gives_the_range(open_at: OpenAt, scripted: Scripted):
    scripted.script = lambda headers: (200, {}, DATA)
    backend = _open_scripted(open_at, scripted)
    _no_boto3_reads(backend)
    assert await backend.read_range("k", 1000, 24) == DATA[1000:1024]
    assert await backend.read_range("k", len(DATA) - 4, 24) == DATA[-4:]


async def test_a_body_cut_short_is_a_temporary_failure(open_at: OpenAt, scripted: Scripted):
    scripted.script = lambda headers: (206, {"Content-Length": "100"}, DATA[:60])
    backend = _open_scripted(open_at, scripted, GIVE_UP_SOON)
    _no_boto3_reads(backend)
    with pytest.raises(TemporaryFailure, match="IncompleteReadError"):
        await backend.read_range("k", 0, 100)
    assert backend.counters.retries >= 1


@pytest.mark.parametrize(
    ("status", "code", "error", "retried"),
    [(403, "AccessDenied", AccessDenied, False), (404, "NoSuchKey", NotFound, False),
     (503, "SlowDown", TemporaryFailure, True)],
)
async def test_error_answers_are_ours_from_one_request(
    open_at: OpenAt, scripted: Scripted, status: int, code: str, error: type, retried: bool
):
    body = f"<?xml version='1.0'?><Error><Code>{code}</Code><Message>m</Message></Error>".encode()
    scripted.script = lambda headers: (status, {"Content-Type": "application/xml"}, body)
    backend = _open_scripted(open_at, scripted, GIVE_UP_SOON)
    _no_boto3_reads(backend)
    with pytest.raises(error, match=f"S3 {code} \\(HTTP {status}\\)"):
        await backend.read_range("k", 0, 10)
    assert (len(scripted.seen) > 1) == retried
    assert backend.direct is not None


async def test_an_unfamiliar_answer_hands_reads_to_boto3(open_at: OpenAt, scripted: Scripted):
    body = b"<Error><Code>PermanentRedirect</Code><Message>use another endpoint</Message></Error>"

    def redirect_all_but_boto3(headers: dict[str, str]) -> tuple[int, dict[str, str], bytes]:
        if is_boto3(headers):
            return partial_answer(headers)
        return 301, {"Content-Type": "application/xml"}, body

    scripted.script = redirect_all_but_boto3
    backend = _open_scripted(open_at, scripted)
    assert backend.read_path() == "direct"
    assert await backend.read_range("k", 5, 10) == DATA[5:15]
    assert backend.direct is None and backend.read_path() == "boto3"
    assert await backend.read_range("k", 0, 4) == DATA[:4]
    assert [is_boto3(s.headers) for s in scripted.seen] == [False, True, True]
    assert backend.counters.requests["GET"] == 2
