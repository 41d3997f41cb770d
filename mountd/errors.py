"""Errors the mountd cache adds to :mod:`quiverfs.errors` (each ``str()`` is one clear line)."""

from __future__ import annotations

from quiverfs.errors import QuiverError


class CacheError(QuiverError):
    """Base of the cache's own errors."""

    exit_code = 4


class CacheFull(CacheError):
    """An object cannot be cached: larger than the cache, everything else pinned, or no disk."""


class CacheLocked(CacheError):
    """Another mountd already owns this cache directory."""


class CacheClosed(CacheError):
    """The cache was used before :meth:`Cache.open` or after :meth:`Cache.aclose`."""
