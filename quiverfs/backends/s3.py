"""``s3://bucket/prefix``: Amazon S3 and S3-compatible stores through boto3.

Credentials come from boto3's standard chain (environment, shared config and credentials files,
SSO, container and instance metadata); this module never sees or logs them. The endpoint can be
overridden (``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL``, read by
:class:`~quiverfs.backends.settings.RemoteSettings`) for S3-compatible stores and moto.

botocore's own retries are switched off (``total_max_attempts=1``): the base class retries with
its deadline, and two retry layers would multiply.
"""

from __future__ import annotations

import boto3
import botocore.exceptions as bce
import urllib3.exceptions as u3e
from botocore.config import Config

from quiverfs.backends.base import Backend, BackendOptions, ObjectInfo, split_root
from quiverfs.backends.settings import RemoteSettings
from quiverfs.errors import AccessDenied, BackendError, NotFound, TemporaryFailure

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

    def _full_key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

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
        try:
            answer = self.client.get_object(
                Bucket=self.bucket,
                Key=self._full_key(key),
                Range=f"bytes={offset}-{offset + length - 1}",
            )
        except bce.ClientError as exc:
            # S3 answers 416 InvalidRange for a range starting at or after the end (and for
            # any range of an empty object); pread semantics say that is b"". A missing key
            # is a 404 first, so this never hides NotFound.
            code, status = _client_error_parts(exc)
            if status == 416 or code == "InvalidRange":
                return b""
            raise
        with answer["Body"] as body:
            return body.read()

    def _write_object(self, key: str, data: bytes) -> None:
        # One PutObject (S3 takes up to 5 GB in one); botocore sends Content-MD5 or a
        # checksum, so a body damaged on the way is refused by S3, never stored.
        self.client.put_object(Bucket=self.bucket, Key=self._full_key(key), Body=data)

    def _close(self) -> None:
        self.client.close()

    def _translate(self, exc: BaseException, key: str) -> BackendError | None:
        return translate_error(exc, self.url, key)
