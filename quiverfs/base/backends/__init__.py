"""Remote object stores behind one interface, chosen by URL scheme.

>>> backend = open_backend("s3://my-bucket/imagenet/train")      # doctest: +SKIP
>>> async for info in backend.list(): ...                         # doctest: +SKIP

Schemes: ``s3://bucket/prefix``, ``az://account/container/prefix``, ``gs://bucket/prefix`` and
``file:///absolute/path`` (a plain local path is accepted and turned into a ``file://`` URL).
"""

from __future__ import annotations

import importlib
import os
from urllib.parse import quote, unquote, urlsplit

from quiverfs.base.backends.base import (
    DIRECTORY,
    EXTERNAL_LINK,
    OBJECT,
    Backend,
    BackendOptions,
    ObjectInfo,
    RetryPolicy,
)
from quiverfs.base.backends.settings import RemoteSettings
from quiverfs.base.errors import UsageError

__all__ = [
    "DIRECTORY",
    "EXTERNAL_LINK",
    "OBJECT",
    "Backend",
    "BackendOptions",
    "ObjectInfo",
    "RemoteSettings",
    "RetryPolicy",
    "normalize_url",
    "open_backend",
]

#: scheme → "module:Class", imported on first use so ``file://`` work never loads cloud SDKs.
REGISTRY: dict[str, str] = {
    "file": "quiverfs.base.backends.file:FileBackend",
    "s3": "quiverfs.base.backends.s3:S3Backend",
    "az": "quiverfs.base.backends.azure:AzureBackend",
    "gs": "quiverfs.base.backends.gcs:GCSBackend",
}


def normalize_url(url: str) -> str:
    """A canonical root URL: scheme lower-cased, no trailing ``/``; local paths → ``file://``.

    Raises :class:`UsageError` for unknown schemes or a URL without a bucket/container.
    """
    if "://" not in url:
        path = os.path.abspath(os.path.expanduser(url))
        return "file://" + quote(path)
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in REGISTRY:
        known = ", ".join(f"{s}://" for s in REGISTRY)
        raise UsageError(f"unknown URL scheme {scheme!r} in {url!r} (known: {known})")
    if scheme == "file":
        if parts.netloc not in ("", "localhost"):
            raise UsageError(f"file:// URLs must be absolute paths (file:///data/...): {url!r}")
        path = os.path.normpath(unquote(parts.path)) if parts.path else ""
        if not path.startswith("/"):
            raise UsageError(f"file:// URLs must be absolute paths (file:///data/...): {url!r}")
        return "file://" + quote(path.rstrip("/") or "/")
    if not parts.netloc:
        raise UsageError(f"{scheme}:// URL needs a bucket or account: {url!r}")
    if scheme == "az" and not parts.path.strip("/"):
        raise UsageError(f"az:// URL needs account and container (az://ACCOUNT/CONTAINER/...): {url!r}")
    path = parts.path.strip("/")
    return f"{scheme}://{parts.netloc}" + (f"/{path}" if path else "")


def backend_class(scheme: str) -> type[Backend]:
    """The backend class registered for ``scheme``."""
    module_name, _, class_name = REGISTRY[scheme].partition(":")
    return getattr(importlib.import_module(module_name), class_name)


def open_backend(
    url: str,
    options: BackendOptions | None = None,
    settings: RemoteSettings | None = None,
) -> Backend:
    """A backend rooted at ``url``. ``settings`` default to :meth:`RemoteSettings.from_environ`."""
    url = normalize_url(url)
    scheme = url.split("://", 1)[0]
    cls = backend_class(scheme)
    return cls(url, options or BackendOptions(), settings or RemoteSettings.from_environ())
