"""Every error mountd adds to :mod:`quiverfs.base.errors`, and the registry of those that travel.

One module for the package's errors (STYLE.md): the cache's, the protocol's and the session
layer's. Each ``str()`` is one clear line; ``exit_code`` and ``errno`` are class attributes
(see :mod:`quiverfs.base.errors`), because mountd's error transport rebuilds a class by name without
calling ``__init__`` (:func:`mountd.rpc.protocol.exception_from_payload`).

:data:`WIRE_ERRORS` lists, explicitly, every class a response may name. A client rebuilds the
class from it, whatever it has imported so far (a registry discovered through
``__subclasses__()`` only knew the classes imported so far: a mount relaying its first
``UnknownSession`` turned it into a plain EIO). ``tests/unit/test_error_registry.py`` rebuilds
each class in a fresh process and checks its errno and exit code.
"""

from __future__ import annotations

import errno as _errno

from digests.errors import DigestError
from quiverfs.base.errors import (
    AccessDenied,
    BackendError,
    CorruptObject,
    NotFound,
    PermanentFailure,
    QuiverError,
    TemporaryFailure,
    UsageError,
)

#: ``quiverfs mountd`` exit status when another mountd already owns the cache directory.
EXIT_ALREADY_RUNNING = 75

# -- the cache --------------------------------------------------------------------------------


class CacheError(QuiverError):
    """Base of the cache's own errors (exit code 5)."""

    exit_code = 5


class CacheFull(CacheError):
    """An object cannot be cached: larger than the cache, everything else pinned, or no disk."""

    errno = _errno.ENOSPC


class PrefetchNoRoom(CacheFull):
    """A fill nobody waits for (a claim's miss fetched ahead, a prefetch) found the rest of
    the cache pinned or protected: it is dropped, not an error (the reader that needs the
    file fetches it on demand, which may end protections). Counted as ``prefetches_dropped``."""


class QuotaExceeded(CacheFull):
    """An object cannot be cached for this user within its share of the cache
    (``--user-quota``): larger than the quota, or the rest of the user's content is pinned."""

    errno = _errno.EDQUOT


class CacheLocked(CacheError):
    """Another mountd already owns this cache directory."""


class AlreadyRunning(CacheLocked):
    """Another mountd owns this cache directory (``quiverfs stats`` talks to it)."""

    exit_code = EXIT_ALREADY_RUNNING


class CacheDirUnsafe(CacheError):
    """The cache directory could be reached or changed by other users (or is not usable)."""


class CacheClosed(CacheError):
    """The cache was used before :meth:`Cache.open` or after :meth:`Cache.aclose`."""


# -- the protocol -----------------------------------------------------------------------------


class ProtocolError(QuiverError):
    """A malformed frame, request or response, or an incompatible protocol version.

    ``EINVAL``: through the control channel it means an argument mountd refused.
    """

    errno = _errno.EINVAL


class MountdUnavailable(QuiverError):
    """No mountd answers on the socket (and none could be started), or it went away."""


class PermissionDenied(QuiverError):
    """The caller's uid may not run this admin operation (only root or mountd's owner may)."""

    errno = _errno.EACCES


class MountdInternalError(QuiverError):
    """mountd hit an unexpected error (a bug) while serving the request; see its log."""

    exit_code = 70


# -- job sessions (docs/control-protocol.md "Errors") -----------------------------------------


class SessionError(QuiverError):
    """Base of session request errors; ``errno`` is what the control channel returns."""

    errno = _errno.EINVAL


class InvalidRequest(SessionError):
    """A malformed request: wrong type or out of range."""


class UnknownDataset(SessionError):
    """The dataset is not registered with the session registry."""

    errno = _errno.ENOENT


class UnknownSession(SessionError):
    """No session is open for this dataset, job and rank."""

    errno = _errno.ENOENT


class SessionConflict(SessionError):
    """The request contradicts existing state (another world size for the job, another seed
    for the rank, a dataset registered twice differently, removing a dataset in use)."""

    errno = _errno.EBUSY


class TooManyJobs(SessionError):
    """The registry already holds ``max_jobs`` jobs (each costs ~10 bytes per file)."""

    errno = _errno.EBUSY


class StaleEpoch(SessionError):
    """The epoch is behind this rank's epoch, or its pool was dropped."""

    errno = _errno.ESTALE


# -- the cluster (mountd/cluster/) -------------------------------------------------------------


class PeerError(QuiverError):
    """A peer mountd could not give what was asked: unreachable, hung, refused the cluster
    secret, broke the protocol. Never reaches a reader: the miss goes to the next source."""


class PeerCorrupt(PeerError):
    """A peer sent bytes that do not hash to what was asked (counted against that peer)."""


# -- the registry -----------------------------------------------------------------------------

#: Every class a mountd response may name, by name. Listed, not discovered: adding an error
#: class that can leave mountd means adding it here (a test checks every class of the three
#: error modules is either here or in :data:`LOCAL_ERRORS`).
WIRE_ERRORS: dict[str, type[QuiverError]] = {
    cls.__name__: cls
    for cls in (
        QuiverError,
        UsageError,
        BackendError,
        NotFound,
        AccessDenied,
        TemporaryFailure,
        PermanentFailure,
        CorruptObject,
        DigestError,
        CacheError,
        CacheFull,
        PrefetchNoRoom,
        QuotaExceeded,
        CacheLocked,
        CacheClosed,
        ProtocolError,
        MountdUnavailable,
        PermissionDenied,
        MountdInternalError,
        SessionError,
        InvalidRequest,
        UnknownDataset,
        UnknownSession,
        SessionConflict,
        TooManyJobs,
        StaleEpoch,
    )
}

#: Classes that never leave the process that raises them (named so the registry test can tell
#: an omission from a decision): a mountd refusing to start, Ctrl-C during a build.
#: Peer errors stay inside mountd's miss path (the next source is tried instead).
LOCAL_ERRORS = frozenset({"AlreadyRunning", "CacheDirUnsafe", "Interrupted", "PeerError",
                          "PeerCorrupt"})
