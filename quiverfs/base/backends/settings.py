"""Where backends get their endpoints from: read once, from the environment, here only.

Credentials are *not* here: boto3, azure-identity and google-auth each find them through their
own standard chains. The exception is Azure's ``AZURE_STORAGE_CONNECTION_STRING``, which the
Azure SDK documents as the standard way to configure a client but does not read by itself; it
is read here and handed to the SDK, never logged and never stored in a digest.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RemoteSettings:
    """Endpoint overrides for S3-compatible stores and emulators; all optional."""

    #: S3-compatible endpoint (``AWS_ENDPOINT_URL_S3`` or ``AWS_ENDPOINT_URL``); None = AWS.
    s3_endpoint_url: str | None = None
    #: Azure connection string (``AZURE_STORAGE_CONNECTION_STRING``); None = account URL +
    #: DefaultAzureCredential.
    azure_connection_string: str | None = None
    #: GCS emulator (``STORAGE_EMULATOR_HOST``); when set the client uses anonymous credentials.
    gcs_emulator_host: str | None = None
    #: GCP project for the client (``GOOGLE_CLOUD_PROJECT``); listing and reads do not need it.
    gcs_project: str | None = None

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> RemoteSettings:
        """Settings from ``environ`` (default: ``os.environ``)."""
        env = os.environ if environ is None else environ
        return cls(
            s3_endpoint_url=env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL") or None,
            azure_connection_string=env.get("AZURE_STORAGE_CONNECTION_STRING") or None,
            gcs_emulator_host=env.get("STORAGE_EMULATOR_HOST") or None,
            gcs_project=env.get("GOOGLE_CLOUD_PROJECT") or None,
        )
