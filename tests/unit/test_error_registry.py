"""The errors that cross mountd's socket: listed once, rebuilt as themselves anywhere.

A mount imports little of mountd, so a registry discovered from the classes imported so far
turned the first ``UnknownSession`` a mount relayed into a plain ``QuiverError`` (EIO instead
of ENOENT: the shim could not re-open its session after a mountd restart). Each class is
rebuilt here in a fresh interpreter that imports only :mod:`mountd.rpc.protocol`, as a mount's
main process does, and must come back with its own name, errno and exit code.
"""

from __future__ import annotations

import errno
import inspect
import json
import subprocess
import sys

import pytest

import digests.errors
import mountd.errors
import quiverfs.base.errors
from mountd.errors import LOCAL_ERRORS, WIRE_ERRORS
from mountd.rpc.protocol import error_payload, exception_from_payload
from quiverfs.base.errors import QuiverError, errno_for

#: class → (errno a mount reports, exit code of a command): docs/operations.md, docs/mount.md
#: and docs/control-protocol.md say the same.
EXPECTED = {
    "QuiverError": (errno.EIO, 1),
    "UsageError": (errno.EINVAL, 2),
    "BackendError": (errno.EIO, 3),
    "NotFound": (errno.EIO, 3),
    "AccessDenied": (errno.EACCES, 3),
    "TemporaryFailure": (errno.EIO, 3),
    "PermanentFailure": (errno.EIO, 3),
    "CorruptObject": (errno.EIO, 3),
    "DigestError": (errno.EIO, 4),
    "CacheError": (errno.EIO, 5),
    "CacheFull": (errno.ENOSPC, 5),
    "PrefetchNoRoom": (errno.ENOSPC, 5),
    "QuotaExceeded": (errno.EDQUOT, 5),
    "CacheLocked": (errno.EIO, 5),
    "CacheClosed": (errno.EIO, 5),
    "ProtocolError": (errno.EINVAL, 1),
    "MountdUnavailable": (errno.EIO, 1),
    "PermissionDenied": (errno.EACCES, 1),
    "MountdInternalError": (errno.EIO, 70),
    "SessionError": (errno.EINVAL, 1),
    "InvalidRequest": (errno.EINVAL, 1),
    "UnknownDataset": (errno.ENOENT, 1),
    "UnknownSession": (errno.ENOENT, 1),
    "SessionConflict": (errno.EBUSY, 1),
    "TooManyJobs": (errno.EBUSY, 1),
    "StaleEpoch": (errno.ESTALE, 1),
}

#: What the fresh interpreter runs: rebuild each payload read from stdin, print what it got.
_REBUILD = """
import json, sys
from mountd.rpc.protocol import exception_from_payload
from quiverfs.base.errors import errno_for
out = []
for payload in json.load(sys.stdin):
    exc = exception_from_payload(payload)
    out.append([type(exc).__name__, errno_for(exc), exc.exit_code, str(exc),
                getattr(exc, "url", None), getattr(exc, "key", None)])
print(json.dumps(out))
"""


def _make(cls: type[QuiverError]) -> QuiverError:
    if issubclass(cls, quiverfs.base.errors.BackendError):
        return cls("remote said no", url="s3://bucket/prefix", key="a/b.jpg")
    return cls(f"{cls.__name__} happened")


def test_every_error_class_of_the_three_error_modules_is_registered_or_declared_local() -> None:
    defined = {
        name
        for module in (quiverfs.base.errors, digests.errors, mountd.errors)
        for name, obj in vars(module).items()
        if inspect.isclass(obj) and issubclass(obj, QuiverError) and obj.__module__ == module.__name__
    }
    assert defined - set(WIRE_ERRORS) == set(LOCAL_ERRORS)
    assert set(WIRE_ERRORS) == set(EXPECTED)
    assert all(WIRE_ERRORS[name].__name__ == name for name in WIRE_ERRORS)


def test_each_class_carries_its_documented_errno_and_exit_code() -> None:
    for name, (code, exit_code) in EXPECTED.items():
        exc = _make(WIRE_ERRORS[name])
        assert (errno_for(exc), exc.exit_code) == (code, exit_code), name


def test_a_fresh_process_rebuilds_every_registered_class_with_its_errno_and_exit_code() -> None:
    names = sorted(WIRE_ERRORS)
    payloads = [error_payload(_make(WIRE_ERRORS[name])) for name in names]
    done = subprocess.run([sys.executable, "-c", _REBUILD], input=json.dumps(payloads),
                          capture_output=True, text=True, timeout=60, check=True)
    rebuilt = json.loads(done.stdout)
    assert len(rebuilt) == len(names)
    for name, payload, (got, code, exit_code, message, url, key) in zip(
            names, payloads, rebuilt, strict=True):
        assert got == name
        assert (code, exit_code) == EXPECTED[name], name
        assert message == payload["message"]  # verbatim, not re-formatted
        if issubclass(WIRE_ERRORS[name], quiverfs.base.errors.BackendError):
            assert (url, key) == ("s3://bucket/prefix", "a/b.jpg")


def test_the_reported_reproduction_now_gives_unknown_session() -> None:
    # The one-liner, with the protocol module where it lives now (mountd/rpc/).
    code = ("from mountd.rpc import protocol as p; "
            "print(type(p.exception_from_payload({'type':'UnknownSession','message':'x'})).__name__)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, check=True)
    assert done.stdout.strip() == "UnknownSession"


@pytest.mark.parametrize(
    ("payload", "expected"),
    [
        # A newer mountd's class falls back to the nearest registered base it names.
        ({"type": "FutureCacheError", "bases": ["CacheError", "QuiverError"], "message": "m"},
         mountd.errors.CacheError),
        # Names outside the registry are never looked up anywhere else.
        ({"type": "SystemExit", "bases": ["BaseException"], "message": "m"}, QuiverError),
        ({"type": "Interrupted", "bases": [], "message": "m"}, QuiverError),
        ({"type": 7, "message": "m"}, QuiverError),
    ],
)
def test_unregistered_names_fall_back_to_a_registered_base(payload, expected) -> None:
    exc = exception_from_payload(payload)
    assert type(exc) is expected and str(exc) == "m"


def test_an_exception_outside_the_vocabulary_travels_as_an_internal_error() -> None:
    exc = exception_from_payload(error_payload(KeyError("boom")))
    assert type(exc) is mountd.errors.MountdInternalError
    assert exc.exit_code == 70 and "KeyError" in str(exc)
