"""``gs://bucket/prefix``: Google Cloud Storage through google-cloud-storage.

Credentials are Application Default Credentials (``GOOGLE_APPLICATION_CREDENTIALS``, gcloud's
user credentials, the metadata server). When an emulator is configured
(``STORAGE_EMULATOR_HOST``, read by :class:`~quiverfs.base.backends.settings.RemoteSettings`) the
client talks to it anonymously instead.

Every SDK call passes ``retry=None`` so that only the base class retries. Versions are object
generations.

Reads stay on google-cloud-storage, unlike S3 and Azure (quiverfs/base/backends/obstore_reads.py):
obstore's GCS client requires an ``ETag`` and a ``Last-Modified`` header on every GET answer,
and gcp-storage-emulator, where every test of this backend runs, sends neither, so obstore
cannot read from it at all (scripts/bench/remote_clients.py shows its error). Real GCS sends
both; moving GCS reads to obstore waits for an emulator the tests can run it against.
"""

from __future__ import annotations

import google.api_core.exceptions as gae
import google.auth.exceptions as gue
import requests
import requests.exceptions as rqe
import urllib3.exceptions as u3e
from google.cloud import storage
from google.cloud.storage.exceptions import DataCorruption
from urllib3.util.retry import Retry

from quiverfs.base.backends.base import Backend, BackendOptions, ObjectInfo, split_root
from quiverfs.base.backends.settings import RemoteSettings
from quiverfs.base.errors import (
    AccessDenied,
    BackendError,
    CorruptObject,
    NotFound,
    TemporaryFailure,
)

#: Objects per ``objects.list`` page (the service's maximum).
PAGE_SIZE = 1000

#: Project name given to the client when talking to an emulator without GOOGLE_CLOUD_PROJECT.
EMULATOR_PROJECT = "quiverfs-emulator"

#: The one table. Keys are exception classes, matched along the exception's MRO (google-api-core
#: already turns HTTP statuses into one class each), then HTTP status codes for the other
#: ``GoogleAPICallError`` subclasses. Anything not here is a permanent failure.
ERROR_TABLE: dict[int | type[BaseException], type[BackendError]] = {
    gae.NotFound: NotFound,
    gae.Unauthorized: AccessDenied,
    gae.Forbidden: AccessDenied,
    gue.DefaultCredentialsError: AccessDenied,
    gue.RefreshError: AccessDenied,
    gae.TooManyRequests: TemporaryFailure,
    gae.InternalServerError: TemporaryFailure,
    gae.BadGateway: TemporaryFailure,
    gae.ServiceUnavailable: TemporaryFailure,
    gae.GatewayTimeout: TemporaryFailure,
    gae.DeadlineExceeded: TemporaryFailure,
    gae.RetryError: TemporaryFailure,
    gue.TransportError: TemporaryFailure,
    DataCorruption: CorruptObject,
    rqe.ConnectionError: TemporaryFailure,
    rqe.Timeout: TemporaryFailure,
    rqe.ChunkedEncodingError: TemporaryFailure,
    u3e.ProtocolError: TemporaryFailure,
    u3e.TimeoutError: TemporaryFailure,
    ConnectionError: TemporaryFailure,
    TimeoutError: TemporaryFailure,
    # statuses of GoogleAPICallErrors without a class of their own above
    408: TemporaryFailure,
    429: TemporaryFailure,
    500: TemporaryFailure,
    502: TemporaryFailure,
    503: TemporaryFailure,
    504: TemporaryFailure,
}


def translate_error(exc: BaseException, url: str, key: str) -> BackendError | None:
    """``exc`` as one of our errors, by :data:`ERROR_TABLE`; ``None`` when it has no entry."""
    status = f" (HTTP {exc.code})" if isinstance(exc, gae.GoogleAPICallError) and exc.code else ""
    for klass in type(exc).__mro__:
        cls = ERROR_TABLE.get(klass)
        if cls is not None:
            return cls(f"GCS {type(exc).__name__}{status}", url=url, key=key)
    if isinstance(exc, gae.GoogleAPICallError) and exc.code is not None:
        cls = ERROR_TABLE.get(int(exc.code))
        if cls is not None:
            return cls(f"GCS {type(exc).__name__} (HTTP {exc.code})", url=url, key=key)
    return None


def _session(concurrency: int, session: requests.Session | None = None) -> requests.Session:
    """A requests session whose pool holds ``concurrency`` connections and never retries."""
    session = session or requests.Session()
    adapter = requests.adapters.HTTPAdapter(
        pool_connections=1,
        pool_maxsize=concurrency,
        max_retries=Retry(total=False, redirect=False, raise_on_status=False),
    )
    session.mount("https://", adapter)
    session.mount("http://", adapter)
    return session


class GCSBackend(Backend):
    """Objects under ``gs://bucket/prefix``; versions are generations."""

    scheme = "gs"

    def __init__(self, url: str, options: BackendOptions, settings: RemoteSettings) -> None:
        super().__init__(url, options, settings)
        self.bucket_name, self.prefix = split_root(url[len("gs://") :])
        host = settings.gcs_emulator_host
        if host:
            from google.auth.credentials import AnonymousCredentials

            if "://" not in host:
                host = "http://" + host
            self.client = storage.Client(
                project=settings.gcs_project or EMULATOR_PROJECT,
                credentials=AnonymousCredentials(),
                client_options={"api_endpoint": host},
                _http=_session(options.concurrency),
            )
        else:
            import google.auth
            from google.auth.transport.requests import AuthorizedSession

            try:
                credentials, project = google.auth.default(scopes=storage.Client.SCOPE)
            except gue.DefaultCredentialsError as exc:
                raise AccessDenied(
                    "no Google Application Default Credentials found (run `gcloud auth "
                    "application-default login` or set GOOGLE_APPLICATION_CREDENTIALS)",
                    url=url,
                ) from exc
            self.client = storage.Client(
                project=settings.gcs_project or project,
                credentials=credentials,
                _http=_session(options.concurrency, AuthorizedSession(credentials)),
            )
        # google-cloud-storage >= 3.x fetches bucket metadata in a background thread, with the
        # SDK's default retries, the first time a bucket is used (for tracing attributes). That
        # is an uncounted, SDK-retried request per client; switch the cache off (its users all
        # check it for truthiness; the SDK's own switch is the environment variable
        # DISABLE_GCS_PYTHON_CLIENT_OTEL_BUCKET_METADATA).
        if getattr(self.client, "_bucket_metadata_cache", None) is not None:
            self.client._bucket_metadata_cache = None
        self.bucket = self.client.bucket(self.bucket_name)

    def _full_key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def _list_page(self, prefix: str, token: str | None) -> tuple[list[ObjectInfo], str | None]:
        root = f"{self.prefix}/" if self.prefix else ""
        iterator = self.client.list_blobs(
            self.bucket,
            prefix=root + prefix,
            page_token=token,
            page_size=PAGE_SIZE,
            timeout=self.options.timeout,
            retry=None,
        )
        page = next(iterator.pages, None)
        blobs = list(page) if page is not None else []
        infos = [
            ObjectInfo(key=b.name[len(root) :], size=int(b.size or 0), version=str(b.generation))
            for b in blobs
        ]
        return infos, iterator.next_page_token or None

    def _stat(self, key: str) -> ObjectInfo:
        blob = self.bucket.blob(self._full_key(key))
        blob.reload(timeout=self.options.timeout, retry=None)
        return ObjectInfo(key=key, size=int(blob.size or 0), version=str(blob.generation))

    def _read_range(self, key: str, offset: int, length: int) -> bytes:
        # A fresh Blob has no media link, so the download URL is built from the client's
        # endpoint (an emulator's media links may name another host).
        blob = self.bucket.blob(self._full_key(key))
        try:
            return blob.download_as_bytes(
                start=offset,
                end=offset + length - 1,
                checksum=None,  # a range has no checksum to check; digests verify content
                timeout=self.options.timeout,
                retry=None,
            )
        except gae.RequestRangeNotSatisfiable:
            # 416: the range starts at or after the end; pread semantics say b"". A missing
            # object is a 404 first, so this never hides NotFound.
            return b""

    def _write_object(self, key: str, data: bytes) -> None:
        # A fresh Blob: its upload URL comes from the client's endpoint. GCS makes the
        # object visible only once the upload completes.
        blob = self.bucket.blob(self._full_key(key))
        blob.upload_from_string(
            data,
            content_type="application/octet-stream",
            timeout=self.options.timeout,
            retry=None,
        )

    def _close(self) -> None:
        self.client.close()

    def _translate(self, exc: BaseException, key: str) -> BackendError | None:
        return translate_error(exc, self.url, key)
