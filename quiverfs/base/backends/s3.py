"""``s3://bucket/prefix``: Amazon S3 and S3-compatible stores; reads through obstore, the rest
through boto3.

Credentials come from boto3's standard chain (environment, shared config and credentials files,
SSO, ``credential_process``, container and instance metadata); this module never sees or logs
them. The endpoint can be overridden (``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL``, read by
:class:`~quiverfs.base.backends.settings.RemoteSettings`) for S3-compatible stores and moto.

Ranged reads (``_read_range``, every fill of mountd) go through obstore's ``S3Store``
(quiverfs/base/backends/obstore_reads.py), built on the first read from what the boto3 client uses:
its endpoint, region and addressing style (:func:`obstore_addressing`), the backend's timeouts,
boto3's CA bundle, and boto3's credentials (static keys as they are; refreshable ones, from SSO,
roles, ``credential_process`` or instance metadata, through obstore's ``Boto3CredentialProvider``,
so obstore follows boto3's refreshes). Listing, ``HEAD`` and ``PUT`` stay on boto3, and so do the
reads obstore cannot do: keys it would not send as they are
(:func:`~quiverfs.base.backends.obstore_reads.exact_key`), a backend without credentials, and a
store whose answers obstore does not understand (a region redirect: boto3 follows it).

Retries are the base class's alone: botocore's are switched off (``total_max_attempts=1``) and
so are obstore's.
"""

from __future__ import annotations

import ipaddress
import re
from datetime import timedelta
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import boto3
import botocore.exceptions as bce
import obstore.exceptions as obe
import urllib3.exceptions as u3e
from botocore.config import Config
from botocore.credentials import RefreshableCredentials

from quiverfs.base.backends.base import Backend, BackendOptions, ObjectInfo, split_root
from quiverfs.base.backends.obstore_reads import (
    NO_RETRIES,
    NoAnswer,
    ObstoreReads,
    ObstoreUnavailable,
    client_options,
    failure_of,
)
from quiverfs.base.backends.settings import RemoteSettings
from quiverfs.base.errors import AccessDenied, BackendError, NotFound, TemporaryFailure

#: Objects per ``ListObjectsV2`` page (S3's maximum).
PAGE_SIZE = 1000

#: The one table, for boto3's errors and obstore's. Keys are S3 error codes (``<Code>`` in the
#: error body, or the HTTP status as a string for bodiless HEAD answers), HTTP status codes, and
#: exception classes (matched along the exception's MRO). Looked up in that order; anything not
#: here is a permanent failure.
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
    # obstore's reads: the code and status of its answer are looked up above; these are its
    # classes, and (NoAnswer) the failures where no answer came
    FileNotFoundError: NotFound,  # what obstore raises for a 404
    obe.NotFoundError: NotFound,
    obe.PermissionDeniedError: AccessDenied,  # 403
    obe.UnauthenticatedError: AccessDenied,  # 401
    NoAnswer: TemporaryFailure,  # connection refused or reset, timeout, body cut short
}


def _client_error_parts(exc: bce.ClientError) -> tuple[str, int]:
    error = exc.response.get("Error", {})
    status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
    return str(error.get("Code", "")), int(status or 0)


def translate_error(exc: BaseException, url: str, key: str) -> BackendError | None:
    """``exc`` (boto3's or obstore's) as one of our errors, by :data:`ERROR_TABLE`; ``None``
    when it has no entry."""
    failure = failure_of(exc)  # nothing set unless exc is obstore's
    if isinstance(exc, bce.ClientError) or failure.status:
        code, status = (_client_error_parts(exc) if isinstance(exc, bce.ClientError)
                        else (failure.code, failure.status))
        cls = ERROR_TABLE.get(code) or ERROR_TABLE.get(status)
        if cls is None:
            return None
        # HEAD answers have no body: botocore then uses the status as the code.
        what = f"{code} (HTTP {status})" if code and code != str(status) else f"HTTP {status}"
        return cls(f"S3 {what}", url=url, key=key)
    if failure.transport:
        return ERROR_TABLE[NoAnswer](
            f"S3 request failed (obstore: {failure.transport}: {failure.summary})",
            url=url, key=key)
    for klass in type(exc).__mro__:
        cls = ERROR_TABLE.get(klass)
        if cls is not None:
            # botocore's own messages ("Unable to locate credentials", "Could not connect to
            # the endpoint URL: ...") tell the user what to fix and never carry secrets.
            detail = f": {exc}" if isinstance(exc, bce.BotoCoreError) else ""
            return cls(f"S3 request failed ({type(exc).__name__}{detail})", url=url, key=key)
    return None


#: How long obstore may use credentials it got from a refreshable boto3 set before asking
#: again. botocore hands out a set only while it has at least 10 minutes left (its mandatory
#: refresh), so 5 minutes never outlives one; obstore's ``Boto3CredentialProvider`` would say
#: 30, longer than a role session's last quarter hour.
CREDENTIAL_TTL = timedelta(minutes=5)

#: A bucket name boto3 addresses virtual-hosted on AWS: one DNS label, no dots (a dotted name
#: would not match the ``*.s3.amazonaws.com`` certificate, so boto3 uses the path there).
_DNS_BUCKET = re.compile(r"[a-z0-9][a-z0-9-]{1,61}[a-z0-9]")


def obstore_addressing(endpoint_url: str, custom: bool, style: str | None,
                       bucket: str) -> tuple[str, bool]:
    """obstore's ``endpoint`` and ``virtual_hosted_style_request`` for a bucket that a boto3
    client with ``endpoint_url`` (``client.meta.endpoint_url``; ``custom``: an override, not
    AWS's own) and addressing ``style`` (``"path"``, ``"virtual"``, ``"auto"`` or ``None``)
    reaches: the same URLs as boto3's endpoint rules give.

    boto3 addresses a bucket whose name is not one DNS label (``my.data``) by path, and so
    does this (one exception: boto3 told ``virtual`` puts a dotted name in the host of a plain
    ``http://`` endpoint; this keeps the path); an IP address by path; an override by path
    unless told ``virtual``; AWS virtual-hosted unless told ``path``.
    """
    parts = urlsplit(endpoint_url)
    host = parts.hostname or ""
    try:
        ipaddress.ip_address(host)
        is_ip = True
    except ValueError:
        is_ip = False
    if style == "path" or is_ip or _DNS_BUCKET.fullmatch(bucket) is None:
        virtual = False
    else:
        virtual = style == "virtual" or not custom
    if not virtual:
        return endpoint_url.rstrip("/"), False
    return f"{parts.scheme}://{bucket}.{parts.netloc}{parts.path.rstrip('/')}", True


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
        self.session = boto3.session.Session()
        self.client = self.session.client(
            "s3", endpoint_url=settings.s3_endpoint_url, config=config)
        #: Ranged reads through obstore (boto3 where it cannot).
        self.reads = ObstoreReads(url, "boto3", self._obstore_store)

    def _full_key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def read_path(self) -> str:
        """``"obstore"``, or ``"boto3"`` once every read goes through boto3: obstore could not
        be set up (no credentials, say), or boto3 read an answer obstore did not understand
        (:attr:`reads` has the reason, and logged it)."""
        return self.reads.path

    def _obstore_store(self) -> Any:
        """obstore's ``S3Store`` for the bucket, reaching what :attr:`client` reaches, as it.

        Runs once, on the first read (in a worker thread: boto3's chain may ask the instance
        metadata service). Raises :class:`ObstoreUnavailable` where boto3 has no credentials
        (reads then go through boto3, which says so).
        """
        from obstore.auth.boto3 import Boto3CredentialProvider
        from obstore.store import S3Store

        credentials = self.session.get_credentials()
        if credentials is None:
            raise ObstoreUnavailable("boto3 found no credentials")
        auth: dict[str, Any]
        if isinstance(credentials, RefreshableCredentials):
            auth = {"credential_provider": Boto3CredentialProvider(self.session,
                                                                   ttl=CREDENTIAL_TTL)}
        else:
            frozen = credentials.get_frozen_credentials()
            auth = {"access_key_id": frozen.access_key, "secret_access_key": frozen.secret_key}
            if frozen.token:
                auth["session_token"] = frozen.token
        meta = self.client.meta
        endpoint, virtual = obstore_addressing(
            meta.endpoint_url, self.settings.s3_endpoint_url is not None,
            (meta.config.s3 or {}).get("addressing_style"), self.bucket)
        options = client_options(self.options.timeout, endpoint)
        # boto3's CA bundle (AWS_CA_BUNDLE, the profile's ca_bundle), added to the system's.
        ca_bundle = self.session._session.get_config_variable("ca_bundle")
        if ca_bundle:
            try:
                options["root_certificate"] = Path(ca_bundle).read_bytes()
            except OSError as exc:
                raise ObstoreUnavailable(f"cannot read the CA bundle {ca_bundle}: {exc}") from exc
        # obstore also reads AWS_* variables of its own; what decides a GET is given here, so
        # they cannot make it differ from boto3's.
        return S3Store(
            self.bucket, endpoint=endpoint, region=meta.region_name or "us-east-1",
            virtual_hosted_style_request=virtual, skip_signature=False, request_payer=False,
            client_options=options, retry_config=NO_RETRIES, **auth,
        )

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
        return self.reads.read(self._full_key(key), offset, length, self._client_read,
                               lambda exc: translate_error(exc, self.url, key) is not None)

    def _client_read(self, full_key: str, offset: int, length: int) -> bytes:
        """A ranged read through boto3's ``get_object`` (what obstore does not read)."""
        try:
            answer = self.client.get_object(
                Bucket=self.bucket, Key=full_key, Range=f"bytes={offset}-{offset + length - 1}"
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
            data = body.read()
        # A store that ignores Range answers 200 with the whole object.
        if answer["ResponseMetadata"]["HTTPStatusCode"] == 200:
            return data[offset : offset + length]
        return data

    def _write_object(self, key: str, data: bytes) -> None:
        # One PutObject (S3 takes up to 5 GB in one); botocore sends Content-MD5 or a
        # checksum, so a body damaged on the way is refused by S3, never stored.
        self.client.put_object(Bucket=self.bucket, Key=self._full_key(key), Body=data)

    def _close(self) -> None:
        self.client.close()

    def _translate(self, exc: BaseException, key: str) -> BackendError | None:
        return translate_error(exc, self.url, key)
