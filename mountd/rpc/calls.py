"""What both clients of mountd share (:mod:`mountd.rpc.client`, :mod:`mountd.rpc.async_client`):
where the socket is, the arguments of requests, and how an answer is read.

The two clients differ in how they wait (one blocking request at a time; many pipelined
requests on one trio connection), not in what they send or how they read what comes back:
that is here, once. Errors from mountd are re-raised as the same quiverfs error class (see
:func:`mountd.rpc.protocol.exception_from_payload`).
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from mountd.errors import MountdUnavailable, PermissionDenied, ProtocolError
from mountd.rpc import protocol
from mountd.rpc.fdpass import close_all
from mountd.rpc.protocol import MAX_OPEN
from mountd.store import layout
from quiverfs.base.backends.base import Location

__all__ = [
    "MAX_QUEUED_FDS",
    "Opened",
    "ProgressFn",
    "connect_error",
    "ensure_args",
    "open_args",
    "opened_files",
    "path_of",
    "resolve_socket",
    "result_of",
    "result_with_fds",
]

#: Called with each progress frame of a long request (scrub).
ProgressFn = Callable[[dict[str, Any]], None]

#: What ``open`` gives for one hash: ``(descriptor, size)`` of its store file, or None (not
#: cached, or cached with another size than asked: read it through the mount).
Opened = tuple[int, int] | None

#: Descriptors a client keeps received but not yet claimed by a response (the oldest are
#: closed beyond it; a response then finds too few, a ProtocolError). Responses take theirs
#: as soon as they are parsed, so a few responses' worth is plenty.
MAX_QUEUED_FDS = 4 * MAX_OPEN


def resolve_socket(cache_dir: str | os.PathLike[str] | None) -> tuple[Path, Path]:
    """``(cache_dir, socket_path)`` with the default cache directory filled in."""
    directory = Path(cache_dir) if cache_dir is not None else layout.default_cache_dir()
    directory = directory.expanduser().absolute()
    return directory, layout.socket_path(directory)


def _location_json(location: Location | Mapping[str, Any]) -> dict[str, Any]:
    if isinstance(location, Mapping):
        return dict(location)
    return {"url": location.url, "key": location.key, "offset": location.offset,
            "length": location.length}


def ensure_args(hash: bytes, size: int, location: Location | Mapping[str, Any],
                dataset: str | None = None) -> dict[str, Any]:
    """The ``args`` of an ``ensure`` request (and of one ``prefetch`` item, without dataset)."""
    args: dict[str, Any] = {"hash": bytes(hash).hex(), "size": size, "location": _location_json(location)}
    if dataset is not None:
        args["dataset"] = dataset
    return args


def open_args(hashes: Sequence[bytes], dataset: str | None = None,
              sizes: Sequence[int] | None = None) -> dict[str, Any]:
    """The ``args`` of an ``open`` request (at most :data:`MAX_OPEN` hashes)."""
    if len(hashes) > MAX_OPEN:
        raise ValueError(f"open takes at most {MAX_OPEN} hashes per request, not {len(hashes)}")
    args: dict[str, Any] = {"hashes": [bytes(h).hex() for h in hashes]}
    if sizes is not None:
        args["sizes"] = list(sizes)
    if dataset is not None:
        args["dataset"] = dataset
    return args


def opened_files(result: Any, fds: Sequence[int], hashes: Sequence[bytes]) -> list[Opened]:
    """An ``open`` answer: each hash's ``(descriptor, size)`` or None, in the order asked.
    Takes ``fds`` over: all are closed when the answer does not match them."""
    sizes = result.get("sizes") if isinstance(result, dict) else None
    if (not isinstance(sizes, list) or len(sizes) != len(hashes)
            or sum(size is not None for size in sizes) != len(fds)
            or any(size is not None and (isinstance(size, bool) or not isinstance(size, int))
                   for size in sizes)):
        close_all(fds)
        raise ProtocolError("mountd's answer to open does not match the descriptors it sent")
    given = iter(fds)
    return [None if size is None else (next(given), size) for size in sizes]


def connect_error(path: Path, exc: OSError) -> Exception:
    """The one-line error for a failed connect to ``path``."""
    if isinstance(exc, PermissionError):
        try:
            owner = f"uid {path.stat().st_uid}"
        except OSError:
            owner = "another user"
        return PermissionDenied(
            f"cannot connect to mountd at {path}: permission denied (the socket belongs to "
            f"{owner} and is private to it; run as that user or root)"
        )
    return MountdUnavailable(
        f"no mountd is running for {path.parent} ({os.strerror(exc.errno or errno.ECONNREFUSED).lower()} "
        f"on {path}); start one with: quiverfs mountd --cache-dir {path.parent}"
    )


def path_of(result: Mapping[str, Any]) -> str:
    """The ``path`` of an ``ensure`` answer; a ``supply`` answer is an error for a client
    that expected mountd to fetch (it asked without being able to supply)."""
    if "path" not in result:
        raise PermissionDenied(
            "mountd does not read sources for this user (it runs as another uid): "
            "this client must supply the bytes itself (see docs/operations.md \"Security\")")
    return result["path"]


def result_of(message: Mapping[str, Any]) -> Any:
    """The result of a response; mountd's error raised as its quiverfs class."""
    ok = message.get("ok")
    if ok is True:
        return message.get("result")
    if ok is False:
        raise protocol.exception_from_payload(message.get("error"))
    raise ProtocolError("mountd sent a response without 'ok'")


def result_with_fds(message: Mapping[str, Any], received: Sequence[int]) -> tuple[Any, Sequence[int]]:
    """``(result, descriptors)`` of a response that came with ``received`` descriptors; they
    are closed when the response is an error (nobody else would)."""
    try:
        return result_of(message), received
    except BaseException:
        close_all(received)
        raise
