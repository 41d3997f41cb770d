"""Session requests: their limits, their validation and the errors a refused one raises.

Every request to :class:`mountd.coop.sessions.SessionRegistry` is checked here before anything
changes. The errors a refused request raises live in :mod:`mountd.errors` with the rest of the
package's (each carries the errno the control channel returns).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from mountd.coop.plans import Mode
from mountd.errors import InvalidRequest

if TYPE_CHECKING:
    from mountd.coop.dataset_state import DatasetState

__all__ = [
    "check_ids",
    "check_int",
    "check_mode",
    "check_name",
    "check_seconds",
    "check_sizes",
]

#: Largest ``n`` one claim may ask for.
MAX_CLAIM = 1 << 16
MAX_WORLD = 1 << 16
MAX_EPOCH = (1 << 31) - 1
MAX_LOOKAHEAD = 1000
MAX_NAME = 256
#: Most id ranges a session's scope may have (it travels in one xattr name).
MAX_SCOPE_RANGES = 64
#: Epoch pools a job keeps at once (ranks straddling one epoch boundary).
LIVE_EPOCHS = 2


# -- validation ---------------------------------------------------------------------------------


def check_int(name: str, value: Any, lo: int, hi: int) -> int:
    """``value`` if it is an ``int`` (not a bool) in ``lo..hi``, else :class:`InvalidRequest`."""
    if type(value) is not int:  # bool is an int subclass: refuse it too
        raise InvalidRequest(f"{name} must be an integer, got {type(value).__name__}")
    if not lo <= value <= hi:
        raise InvalidRequest(f"{name} must be in {lo}..{hi}, got {value}")
    return value


def check_name(what: str, value: Any) -> str:
    """``value`` if it is a printable, non-empty string of at most ``MAX_NAME`` characters."""
    if type(value) is not str or not value or len(value) > MAX_NAME or not value.isprintable():
        raise InvalidRequest(f"{what} must be a printable string of 1..{MAX_NAME} characters")
    return value


def check_seconds(name: str, value: Any) -> float:
    """``value`` as a float if it is a finite, non-negative number of seconds."""
    if type(value) not in (int, float) or not math.isfinite(value) or value < 0:
        raise InvalidRequest(f"{name} must be a finite number of seconds >= 0")
    return float(value)


def check_mode(value: Any) -> Mode:
    """``value`` as a :class:`~mountd.coop.plans.Mode` (one of its names)."""
    try:
        return Mode(value)
    except ValueError:
        raise InvalidRequest(f"unknown mode {value!r}") from None


def check_sizes(sizes: Any) -> Sequence[int]:
    """``sizes`` if it is a non-empty sequence of byte counts (integers >= 0)."""
    if isinstance(sizes, str | bytes) or not isinstance(sizes, Sequence) or not sizes:
        raise InvalidRequest("sizes must be a non-empty sequence of byte counts")
    if any(type(s) is not int or s < 0 for s in sizes):
        raise InvalidRequest("sizes must be integers >= 0")
    return sizes


def scope_mask(dataset: DatasetState, ranges: Any) -> bytearray:
    """A job's scope, ``[[start, stop], ...]`` (half-open id ranges, ascending, disjoint), as
    a mask of the dataset's files (1 = in scope)."""
    if isinstance(ranges, str | bytes) or not isinstance(ranges, Iterable):
        raise InvalidRequest("scope must be a list of [start, stop] id ranges")
    ranges = list(ranges)
    if not 0 < len(ranges) <= MAX_SCOPE_RANGES:
        raise InvalidRequest(f"scope must have 1..{MAX_SCOPE_RANGES} ranges")
    mask = bytearray(dataset.count)
    previous = 0
    for pair in ranges:
        if (isinstance(pair, str | bytes) or not isinstance(pair, Sequence) or len(pair) != 2
                or any(type(v) is not int for v in pair)):
            raise InvalidRequest("scope ranges must be [start, stop] pairs of integers")
        start, stop = pair
        if not previous <= start < stop <= dataset.count:
            raise InvalidRequest(f"scope ranges must be ascending, disjoint and within 0..{dataset.count}")
        mask[start:stop] = b"\x01" * (stop - start)
        previous = stop
    return mask


def check_ids(dataset: DatasetState, ids: Any) -> list[int]:
    """``ids`` as a list if every one is an ``int`` in ``0..N-1`` of ``dataset`` (all checked
    before any is used, so a bad list changes nothing)."""
    if isinstance(ids, str | bytes) or not isinstance(ids, Iterable):
        raise InvalidRequest("ids must be a sequence of file ids")
    out = list(ids)
    for i in out:
        if type(i) is not int or not 0 <= i < dataset.count:
            raise InvalidRequest(f"file ids must be integers in 0..{dataset.count - 1}")
    return out
