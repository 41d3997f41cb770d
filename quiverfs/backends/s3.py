"""``s3://bucket/prefix``: Amazon S3 and S3-compatible stores through boto3.

Credentials come from boto3's standard chain (environment, shared config and credentials files,
SSO, container and instance metadata); this module never sees or logs them. The endpoint can be
overridden (``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL``, read by
:class:`~quiverfs.backends.settings.RemoteSettings`) for S3-compatible stores and moto.

botocore's own retries are switched off (``total_max_attempts=1``): the base class retries with
its deadline, and two retry layers would multiply.

Ranged reads go out through :class:`DirectGet` where it can be set up: the request boto3's
``get_object`` would send, signed by quiverfs/backends/s3_sign.py and sent on the client's own
HTTP session, without boto3's per-call pipeline (docs/backends.md "S3 reads").
"""

from __future__ import annotations

import logging
import re
from typing import Any
from urllib.parse import quote, urlsplit

import boto3
import botocore.exceptions as bce
import urllib3.exceptions as u3e
from botocore.awsrequest import AWSPreparedRequest
from botocore.config import Config

from quiverfs.backends.base import Backend, BackendOptions, ObjectInfo, split_root
from quiverfs.backends.s3_sign import GetSigner, host_header
from quiverfs.backends.settings import RemoteSettings
from quiverfs.errors import AccessDenied, BackendError, NotFound, TemporaryFailure

log = logging.getLogger("quiverfs.backends.s3")

#: Objects per ``ListObjectsV2`` page (S3's maximum).
PAGE_SIZE = 1000

#: The one table. Keys are S3 error codes (``<Code>`` in the error body, or the HTTP status as a
#: string for bodiless HEAD answers), HTTP status codes, and exception classes (matched along
#: the exception's MRO). Looked up in that order; anything not here is a permanent failure.
ERROR_TABLE: dict[str | int | type[BaseException], type[BackendError]] = {
    # error codes
    "NoSuchKey": NotFound,
    "NoSuchBucket": NotFound,
    "NotFound": NotFound,
    "404": NotFound,
    "AccessDenied": AccessDenied,
    "AllAccessDisabled": AccessDenied,
    "InvalidAccessKeyId": AccessDenied,
    "SignatureDoesNotMatch": AccessDenied,
    "ExpiredToken": AccessDenied,
    "InvalidToken": AccessDenied,
    "403": AccessDenied,
    "SlowDown": TemporaryFailure,
    "RequestTimeout": TemporaryFailure,
    "InternalError": TemporaryFailure,
    "ServiceUnavailable": TemporaryFailure,
    "Throttling": TemporaryFailure,
    "ThrottlingException": TemporaryFailure,
    "RequestLimitExceeded": TemporaryFailure,
    # HTTP status codes (when the code is missing or unknown)
    401: AccessDenied,
    403: AccessDenied,
    404: NotFound,
    408: TemporaryFailure,
    429: TemporaryFailure,
    500: TemporaryFailure,
    502: TemporaryFailure,
    503: TemporaryFailure,
    504: TemporaryFailure,
    # exceptions raised before or while reading an answer
    bce.NoCredentialsError: AccessDenied,
    bce.PartialCredentialsError: AccessDenied,
    bce.ConnectionError: TemporaryFailure,  # EndpointConnectionError, ConnectTimeoutError, ...
    bce.HTTPClientError: TemporaryFailure,  # ConnectionClosedError, ReadTimeoutError, streaming
    bce.IncompleteReadError: TemporaryFailure,
    u3e.ProtocolError: TemporaryFailure,
    u3e.TimeoutError: TemporaryFailure,
    ConnectionError: TemporaryFailure,
    TimeoutError: TemporaryFailure,
}


def _client_error_parts(exc: bce.ClientError) -> tuple[str, int]:
    error = exc.response.get("Error", {})
    status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
    return str(error.get("Code", "")), int(status or 0)


def translate_error(exc: BaseException, url: str, key: str) -> BackendError | None:
    """``exc`` as one of our errors, by :data:`ERROR_TABLE`; ``None`` when it has no entry."""
    if isinstance(exc, bce.ClientError):
        code, status = _client_error_parts(exc)
        cls = ERROR_TABLE.get(code) or ERROR_TABLE.get(status)
        if cls is not None:
            # HEAD answers have no body: botocore then uses the status as the code.
            what = f"{code} (HTTP {status})" if code and code != str(status) else f"HTTP {status}"
            return cls(f"S3 {what}", url=url, key=key)
        return None
    for klass in type(exc).__mro__:
        cls = ERROR_TABLE.get(klass)
        if cls is not None:
            # botocore's own messages ("Unable to locate credentials", "Could not connect to
            # the endpoint URL: ...") tell the user what to fix and never carry secrets.
            detail = f": {exc}" if isinstance(exc, bce.BotoCoreError) else ""
            return cls(f"S3 request failed ({type(exc).__name__}{detail})", url=url, key=key)
    return None


#: The key :meth:`DirectGet.learn` has the client address; the request never leaves.
PROBE_KEY = "quiverfs-probe"

#: The signing scope in a SigV4 ``Authorization`` header: region, then service.
_SIGV4_SCOPE = re.compile(r"^AWS4-HMAC-SHA256 Credential=[^/,]+/\d{8}/([^/,]+)/([^/,]+)/aws4_request")
#: An S3 error body's code.
_ERROR_CODE = re.compile(rb"<Code>([^<]*)</Code>")


class _Addressed(Exception):
    """Stops :meth:`DirectGet.learn`'s probe in ``before-send`` and carries its request out."""


class UnfamiliarAnswer(Exception):
    """An answer :class:`DirectGet` leaves to boto3 (a redirect, an error code with no entry
    in :data:`ERROR_TABLE`): the caller asks the client, whose handling decides."""


def _byte_range(offset: int, length: int) -> str:
    """The ``Range`` header of ``length > 0`` bytes at ``offset``."""
    return f"bytes={offset}-{offset + length - 1}"


def _within_range(status: int, body: bytes, offset: int, length: int) -> bytes:
    """The requested part of a successful answer: a store that ignores ``Range`` answers 200
    with the whole object."""
    return body[offset : offset + length] if status == 200 else body


class DirectGet:
    """Ranged ``GetObject`` requests without boto3's per-call machinery.

    Why: a cold pass is CPU-bound in mountd, and boto3 spends ~1.5 ms of CPU on one GET of a
    110 KiB object, of which signing and sending the request take ~0.6 ms; the rest is events,
    parameter validation, serialisation, endpoint rules and response parsing (docs/backends.md
    "S3 reads"). This sends the request the client would send: the object URL and signing
    scope are learnt once from the client itself (:meth:`learn`), each request is signed with
    the session's credentials (refreshed as boto3 refreshes them; quiverfs/backends/s3_sign.py)
    and sent on the client's own HTTP session (its pool, TLS settings, proxies, timeouts; its
    exceptions are botocore's, which :data:`ERROR_TABLE` knows).
    """

    def __init__(
        self, base_url: str, region: str, service: str, credentials: Any, http_session: Any
    ) -> None:
        #: The URL of the bucket's keys: an object's URL is this plus its quoted key.
        self.base_url = base_url
        self.region = region
        self.service = service
        self.http_session = http_session
        self.signer = GetSigner(credentials, region, service)
        parts = urlsplit(base_url)
        self._origin = f"{parts.scheme}://{parts.netloc}"
        self._base_path = parts.path
        self._host = host_header(base_url)

    @classmethod
    def learn(cls, client: Any, credentials: Any, bucket: str) -> DirectGet | None:
        """One for ``client``'s ``bucket``, or ``None`` (every read then goes through boto3)
        where there are no credentials, the client does not sign with SigV4, or its request
        is not laid out as expected.

        The client addresses a probe ``GetObject`` (its endpoint rules: region, addressing
        style, custom endpoint) and signs it; a ``before-send`` hook stops it before it leaves.
        """
        http_session = getattr(getattr(client, "_endpoint", None), "http_session", None)
        if credentials is None or not callable(getattr(http_session, "send", None)):
            return None

        def stop(request: Any, **_: Any) -> None:
            raise _Addressed(request)

        event = "before-send.s3.GetObject"
        client.meta.events.register_first(event, stop)
        try:
            client.get_object(Bucket=bucket, Key=PROBE_KEY, Range="bytes=0-0")
        except _Addressed as addressed:
            request = addressed.args[0]
        except Exception as exc:  # boto3 raises it again, properly, on the first read
            log.debug("direct S3 reads off for %s: probe failed (%s)", bucket, exc)
            return None
        else:  # pragma: no cover (the hook always stops it)
            return None
        finally:
            client.meta.events.unregister(event, stop)
        authorization = request.headers.get("Authorization", b"")
        if isinstance(authorization, bytes):
            authorization = authorization.decode("ascii", "replace")
        scope = _SIGV4_SCOPE.match(authorization)
        url = request.url
        if scope is None or "?" in url or not url.endswith("/" + PROBE_KEY):
            log.debug("direct S3 reads off for %s: request not as expected", bucket)
            return None
        region, service = scope.groups()
        return cls(url[: -len(PROBE_KEY)], region, service, credentials, http_session)

    def get(self, full_key: str, offset: int, length: int) -> bytes:
        """``length`` bytes at ``offset`` of ``full_key`` (fewer at the object's end).

        Raises botocore's ``ClientError`` for error answers :data:`ERROR_TABLE` knows (and 416),
        as boto3 would, and :class:`UnfamiliarAnswer` for any other answer.
        """
        path = self._base_path + quote(full_key, safe="/~")
        headers = self.signer.headers(self._host, path, _byte_range(offset, length))
        answer = self.http_session.send(
            AWSPreparedRequest("GET", self._origin + path, headers, None, False))
        status, body = answer.status_code, answer.content
        if status in (200, 206):
            expected = answer.headers.get("content-length")
            if expected is not None and len(body) != int(expected):
                raise bce.IncompleteReadError(actual_bytes=len(body), expected_bytes=int(expected))
            return _within_range(status, body, offset, length)
        found = _ERROR_CODE.search(body)
        code = found.group(1).decode("utf-8", "replace") if found else ""
        if status == 416 or code in ERROR_TABLE or status in ERROR_TABLE:
            error = {"Code": code or str(status), "Message": ""}
            raise bce.ClientError(
                {"Error": error, "ResponseMetadata": {"HTTPStatusCode": status}}, "GetObject"
            )
        raise UnfamiliarAnswer(f"HTTP {status} {code}".strip())


class S3Backend(Backend):
    """Objects under ``s3://bucket/prefix``; versions are ETags (without quotes)."""

    scheme = "s3"

    def __init__(self, url: str, options: BackendOptions, settings: RemoteSettings) -> None:
        super().__init__(url, options, settings)
        self.bucket, self.prefix = split_root(url[len("s3://") :])
        config = Config(
            max_pool_connections=options.concurrency,
            retries={"total_max_attempts": 1},
            connect_timeout=options.timeout,
            read_timeout=options.timeout,
        )
        # A private session: boto3's default session is shared module state, and creating
        # clients from it is not thread-safe.
        session = boto3.session.Session()
        self.client = session.client("s3", endpoint_url=settings.s3_endpoint_url, config=config)
        self.direct = DirectGet.learn(self.client, session.get_credentials(), self.bucket)

    def _full_key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def read_path(self) -> str:
        """``"direct"`` (:class:`DirectGet`) or ``"boto3"`` (never set up, or boto3 took over
        after an answer the direct path did not know)."""
        return "boto3" if self.direct is None else "direct"

    def _list_page(self, prefix: str, token: str | None) -> tuple[list[ObjectInfo], str | None]:
        # The root prefix gets its "/" even when ``prefix`` is empty, so that
        # s3://b/train never lists s3://b/train2/...
        root = f"{self.prefix}/" if self.prefix else ""
        kwargs = {"Bucket": self.bucket, "Prefix": root + prefix, "MaxKeys": PAGE_SIZE}
        if token is not None:
            kwargs["ContinuationToken"] = token
        answer = self.client.list_objects_v2(**kwargs)
        page = [
            ObjectInfo(
                key=item["Key"][len(root) :],
                size=int(item["Size"]),
                version=item.get("ETag", "").strip('"'),
            )
            for item in answer.get("Contents", [])
        ]
        next_token = answer.get("NextContinuationToken") if answer.get("IsTruncated") else None
        return page, next_token

    def _stat(self, key: str) -> ObjectInfo:
        answer = self.client.head_object(Bucket=self.bucket, Key=self._full_key(key))
        return ObjectInfo(
            key=key, size=int(answer["ContentLength"]), version=answer.get("ETag", "").strip('"')
        )

    def _read_range(self, key: str, offset: int, length: int) -> bytes:
        full_key = self._full_key(key)
        try:
            direct = self.direct
            if direct is None:
                return self._client_read(full_key, offset, length)
            try:
                return direct.get(full_key, offset, length)
            except UnfamiliarAnswer as answer:
                data = self._client_read(full_key, offset, length)
                # boto3 read it where the direct request could not (a region redirect, say):
                # its way is the one that works with this store.
                self.direct = None
                log.warning("S3 reads of %s go through boto3 from now on (%s)", self.url, answer)
                return data
        except bce.ClientError as exc:
            # S3 answers 416 InvalidRange for a range starting at or after the end (and for
            # any range of an empty object); pread semantics say that is b"". A missing key
            # is a 404 first, so this never hides NotFound.
            code, status = _client_error_parts(exc)
            if status == 416 or code == "InvalidRange":
                return b""
            raise

    def _client_read(self, full_key: str, offset: int, length: int) -> bytes:
        answer = self.client.get_object(
            Bucket=self.bucket, Key=full_key, Range=_byte_range(offset, length)
        )
        with answer["Body"] as body:
            data = body.read()
        return _within_range(answer["ResponseMetadata"]["HTTPStatusCode"], data, offset, length)

    def _write_object(self, key: str, data: bytes) -> None:
        # One PutObject (S3 takes up to 5 GB in one); botocore sends Content-MD5 or a
        # checksum, so a body damaged on the way is refused by S3, never stored.
        self.client.put_object(Bucket=self.bucket, Key=self._full_key(key), Body=data)

    def _close(self) -> None:
        self.client.close()

    def _translate(self, exc: BaseException, key: str) -> BackendError | None:
        return translate_error(exc, self.url, key)
