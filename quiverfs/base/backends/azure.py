"""``az://account/container/prefix``: Azure Blob Storage; reads through obstore, the rest
through azure-storage-blob.

The client comes from ``AZURE_STORAGE_CONNECTION_STRING`` when it is set (read by
:class:`~quiverfs.base.backends.settings.RemoteSettings`; this is also how Azurite is reached), and
must then name the URL's account. Otherwise the client talks to
``https://{account}.blob.core.windows.net`` with :class:`azure.identity.DefaultAzureCredential`
(environment, workload identity, managed identity, Azure CLI, ...). Secrets are never logged.

Ranged reads (``_read_range``, every fill of mountd) go through obstore's ``AzureStore``
(quiverfs/base/backends/obstore_reads.py), built on the first read from the same place: the
connection string's ``BlobEndpoint`` (or its protocol and endpoint suffix) and its
``AccountKey`` or ``SharedAccessSignature`` (obstore does not read connection strings itself),
or else the account URL with the same ``DefaultAzureCredential``, through obstore's
``AzureCredentialProvider``. Listing (with folder metadata), properties and uploads stay on
azure-storage-blob, and so do the reads obstore cannot do: blob names it would not send as they
are (:func:`~quiverfs.base.backends.obstore_reads.exact_key`), a connection string with neither key
nor SAS, and answers obstore does not understand.

Retries are the base class's alone: azure-core's retry policy is switched off
(``retry_total=0``) and so are obstore's. One SDK-internal loop remains for the reads that go
through the SDK: ``download_blob`` re-reads a body that breaks off mid-stream up to 3 times
(azure-storage-blob ``_download.py``); it cannot be configured.
"""

from __future__ import annotations

from typing import Any

import azure.core.exceptions as ace
import obstore.exceptions as obe
import requests
import requests.exceptions as rqe
import urllib3.exceptions as u3e
from azure.core.pipeline.transport import RequestsTransport
from azure.storage.blob import BlobServiceClient
from urllib3.util.retry import Retry

from quiverfs.base.backends.base import (
    DIRECTORY,
    OBJECT,
    Backend,
    BackendOptions,
    ObjectInfo,
    split_root,
)
from quiverfs.base.backends.obstore_reads import (
    NO_RETRIES,
    NoAnswer,
    ObstoreReads,
    ObstoreUnavailable,
    client_options,
    failure_of,
)
from quiverfs.base.backends.settings import RemoteSettings
from quiverfs.base.errors import AccessDenied, BackendError, NotFound, TemporaryFailure, UsageError

#: Blobs per ``List Blobs`` page (the service allows up to 5,000).
PAGE_SIZE = 1000

#: The one table, for azure-core's errors and obstore's. Keys are storage error codes
#: (``x-ms-error-code``; obstore: the ``<Code>`` of the answer's body), HTTP status codes and
#: exception classes (matched along the exception's MRO), looked up in that order; anything
#: not here is a permanent failure.
ERROR_TABLE: dict[str | int | type[BaseException], type[BackendError]] = {
    # error codes
    "BlobNotFound": NotFound,
    "ContainerNotFound": NotFound,
    "ResourceNotFound": NotFound,
    "AuthenticationFailed": AccessDenied,
    "AuthorizationFailure": AccessDenied,
    "AuthorizationPermissionMismatch": AccessDenied,
    "InsufficientAccountPermissions": AccessDenied,
    "ServerBusy": TemporaryFailure,
    "OperationTimedOut": TemporaryFailure,
    "InternalError": TemporaryFailure,
    # HTTP status codes
    401: AccessDenied,
    403: AccessDenied,
    404: NotFound,
    408: TemporaryFailure,
    429: TemporaryFailure,
    500: TemporaryFailure,
    502: TemporaryFailure,
    503: TemporaryFailure,
    504: TemporaryFailure,
    # exception classes (a response-less failure, or a class that says it all)
    ace.ResourceNotFoundError: NotFound,
    ace.ClientAuthenticationError: AccessDenied,  # also azure-identity's credential errors
    ace.ServiceRequestError: TemporaryFailure,  # connect failures and timeouts
    ace.ServiceResponseError: TemporaryFailure,  # resets and read timeouts
    ace.IncompleteReadError: TemporaryFailure,
    rqe.ConnectionError: TemporaryFailure,
    rqe.Timeout: TemporaryFailure,
    rqe.ChunkedEncodingError: TemporaryFailure,
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


def translate_error(exc: BaseException, url: str, key: str) -> BackendError | None:
    """``exc`` (azure-core's or obstore's) as one of our errors, by :data:`ERROR_TABLE`;
    ``None`` when it has no entry."""
    failure = failure_of(exc)  # nothing set unless exc is obstore's
    if isinstance(exc, ace.HttpResponseError) or failure.status:
        if isinstance(exc, ace.HttpResponseError):
            # error_code is a plain str or a StorageErrorCode (a str enum whose str() is its
            # name).
            raw_code = getattr(exc, "error_code", None) or ""
            code = str(getattr(raw_code, "value", raw_code))
            status = int(exc.status_code or 0)
        else:
            code, status = failure.code, failure.status
        cls = ERROR_TABLE.get(code) or ERROR_TABLE.get(status)
        if cls is not None:
            what = f"{code} (HTTP {status})" if code else f"HTTP {status}"
            return cls(f"Azure {what}", url=url, key=key)
        if failure.status:
            return None
    elif failure.transport:
        return ERROR_TABLE[NoAnswer](
            f"Azure request failed (obstore: {failure.transport}: {failure.summary})",
            url=url, key=key)
    for klass in type(exc).__mro__:
        cls = ERROR_TABLE.get(klass)
        if cls is not None:
            return cls(f"Azure request failed ({type(exc).__name__})", url=url, key=key)
    return None


def _listed(blob, root: str) -> ObjectInfo:
    """The listing entry of one blob (``BlobProperties``) under ``root``."""
    key = blob.name[len(root) :]
    version = str(blob.etag).strip('"')
    if str((blob.metadata or {}).get("hdi_isfolder", "")).lower() == "true":
        return ObjectInfo(key.removesuffix("/"), 0, version, DIRECTORY)
    return ObjectInfo(key, int(blob.size), version, OBJECT)


def connection_string_parts(connection_string: str) -> dict[str, str]:
    """A storage connection string's settings, by lower-case name (``accountname``,
    ``accountkey``, ``blobendpoint``, ...); values keep their case and any ``=``."""
    parts = {}
    for part in connection_string.split(";"):
        name, _, value = part.partition("=")
        if name.strip():
            parts[name.strip().lower()] = value.strip()
    return parts


def connection_string_account(connection_string: str) -> str:
    """The ``AccountName=`` of a storage connection string (``""`` when absent)."""
    return connection_string_parts(connection_string).get("accountname", "")


def obstore_settings(account: str, connection_string: str) -> dict[str, Any]:
    """obstore ``AzureStore`` settings for ``account`` from a connection string: ``endpoint``
    (its ``BlobEndpoint``, else its protocol and endpoint suffix, as azure-storage-blob
    builds it) and ``account_key`` or ``sas_key``.

    Raises :class:`ObstoreUnavailable` for a connection string with neither
    ``AccountKey`` nor ``SharedAccessSignature`` (anonymous access: reads stay on the SDK).
    """
    parts = connection_string_parts(connection_string)
    endpoint = parts.get("blobendpoint") or (
        f"{parts.get('defaultendpointsprotocol') or 'https'}://{account}.blob."
        f"{parts.get('endpointsuffix') or 'core.windows.net'}")
    settings: dict[str, Any] = {"endpoint": endpoint.rstrip("/")}
    if parts.get("accountkey"):
        settings["account_key"] = parts["accountkey"]
    elif parts.get("sharedaccesssignature"):
        settings["sas_key"] = parts["sharedaccesssignature"].lstrip("?")
    else:
        raise ObstoreUnavailable("the connection string has neither AccountKey nor "
                                 "SharedAccessSignature")
    return settings


class AzureBackend(Backend):
    """Blobs under ``az://account/container/prefix``; versions are ETags (without quotes)."""

    scheme = "az"

    def __init__(self, url: str, options: BackendOptions, settings: RemoteSettings) -> None:
        super().__init__(url, options, settings)
        self.account, rest = split_root(url[len("az://") :])
        self.container, self.prefix = split_root(rest)
        # azure-core's default requests pool holds 10 connections; size it to our limiter.
        session = requests.Session()
        adapter = requests.adapters.HTTPAdapter(
            pool_connections=1,
            pool_maxsize=options.concurrency,
            max_retries=Retry(total=False, redirect=False, raise_on_status=False),
        )
        session.mount("https://", adapter)
        session.mount("http://", adapter)
        transport = RequestsTransport(
            session=session,
            session_owner=True,
            connection_timeout=options.timeout,
            read_timeout=options.timeout,
        )
        common = {"retry_total": 0, "transport": transport}
        self._credential = None
        conn = settings.azure_connection_string
        if conn:
            named = connection_string_account(conn)
            if named != self.account:
                raise UsageError(
                    f"AZURE_STORAGE_CONNECTION_STRING is for account {named or '(none)'!r} but the "
                    f"URL names account {self.account!r}: fix the URL or unset the variable"
                )
            service = BlobServiceClient.from_connection_string(conn, **common)
        else:
            from azure.identity import DefaultAzureCredential

            self._credential = DefaultAzureCredential()
            service = BlobServiceClient(
                f"https://{self.account}.blob.core.windows.net",
                credential=self._credential,
                **common,
            )
        self.service = service
        self.container_client = service.get_container_client(self.container)
        #: Ranged reads through obstore (azure-storage-blob where it cannot).
        self.reads = ObstoreReads(url, "azure-storage-blob", self._obstore_store)

    def _full_key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def read_path(self) -> str:
        """``"obstore"``, or ``"azure-storage-blob"`` once every read goes through the SDK
        (obstore could not be set up, or the SDK read an answer obstore did not understand;
        :attr:`reads` has the reason, and logged it)."""
        return self.reads.path

    def _obstore_store(self) -> Any:
        """obstore's ``AzureStore`` for the container, reaching what :attr:`service` reaches
        with the same credentials. Runs once, on the first read."""
        from obstore.store import AzureStore

        conn = self.settings.azure_connection_string
        if conn:
            settings = obstore_settings(self.account, conn)
        else:
            from obstore.auth.azure import AzureCredentialProvider

            settings = {
                "endpoint": f"https://{self.account}.blob.core.windows.net",
                # The SDK client's own credential: one chain, one token cache.
                "credential_provider": AzureCredentialProvider(self._credential),
            }
        # obstore also reads AZURE_* variables of its own; the endpoint and the credentials
        # given here decide a GET, so they cannot make it differ from the SDK's.
        return AzureStore(
            self.container, account_name=self.account, skip_signature=False,
            client_options=client_options(self.options.timeout, settings["endpoint"]),
            retry_config=NO_RETRIES, **settings,
        )

    def _list_page(self, prefix: str, token: str | None) -> tuple[list[ObjectInfo], str | None]:
        root = f"{self.prefix}/" if self.prefix else ""
        # Metadata comes with the listing so that folder blobs (hdi_isfolder, written by
        # hierarchical-namespace accounts and tools such as Storage Explorer) are known as
        # directories, not zero-byte files.
        pager = self.container_client.list_blobs(
            name_starts_with=root + prefix, include=["metadata"], results_per_page=PAGE_SIZE
        ).by_page(continuation_token=token)
        page = [_listed(blob, root) for blob in next(pager)]
        return page, pager.continuation_token or None

    def _stat(self, key: str) -> ObjectInfo:
        props = self.container_client.get_blob_client(self._full_key(key)).get_blob_properties()
        return ObjectInfo(key=key, size=int(props.size), version=str(props.etag).strip('"'))

    def _read_range(self, key: str, offset: int, length: int) -> bytes:
        return self.reads.read(self._full_key(key), offset, length, self._sdk_read,
                               lambda exc: translate_error(exc, self.url, key) is not None)

    def _sdk_read(self, full_key: str, offset: int, length: int) -> bytes:
        """A ranged read through azure-storage-blob (what obstore does not read)."""
        blob = self.container_client.get_blob_client(full_key)
        try:
            return blob.download_blob(offset=offset, length=length, max_concurrency=1).readall()
        except ace.HttpResponseError as exc:
            # 416 InvalidRange: the range starts at or after the end; pread semantics say b"".
            # A missing blob is a 404 first, so this never hides NotFound.
            if exc.status_code == 416 or getattr(exc, "error_code", None) == "InvalidRange":
                return b""
            raise

    def _write_object(self, key: str, data: bytes) -> None:
        # One Put Blob up to the SDK's single-put limit (64 MiB), staged blocks committed
        # at once above it: either way the blob appears whole. max_concurrency=1 keeps the
        # SDK's threads out of our limiter's count.
        blob = self.container_client.get_blob_client(self._full_key(key))
        blob.upload_blob(data, overwrite=True, max_concurrency=1)

    def _close(self) -> None:
        self.service.close()
        if self._credential is not None:
            self._credential.close()

    def _translate(self, exc: BaseException, key: str) -> BackendError | None:
        return translate_error(exc, self.url, key)
