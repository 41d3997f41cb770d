"""Where things live in a cache directory: a contract shared with the FUSE clients.

FUSE processes open store files directly, by hash, with :func:`store_path` and no RPC, so the
names below must not change without a format bump (see ``docs/store-layout.md``)::

    CACHE_DIR/
      lock                      flock'd by the one mountd that owns this directory
      index.sqlite (+ -wal, -shm)   the index (rebuildable from store/)
      mountd.sock               the control socket
      tmp/                      fills in progress: <64-hex>.<random>.tmp (wiped on open)
      store/ab/cd/abcd…(64 hex)   verified content, named by its blake3 hash

These helpers are pure (no I/O) except :func:`default_cache_dir` and :func:`runtime_dir`, the
one place that reads the environment (and picks a private folder under the temporary directory
for an account without a usable home: :func:`private_tmp_dir`), and :func:`parse_size`, which
may ``statvfs`` the filesystem for a percentage.
"""

from __future__ import annotations

import os
import re
import stat
import tempfile
from pathlib import Path

from quiverfs.base.errors import UsageError

#: Bytes in a blake3 hash, and hex characters in a store file name.
HASH_BYTES = 32
HASH_HEX = 2 * HASH_BYTES
#: Store format version, recorded in the index's ``meta`` table.
LAYOUT_VERSION = 1

STORE = "store"
TMP = "tmp"
INDEX = "index.sqlite"
LOCK = "lock"
SOCKET = "mountd.sock"
TMP_SUFFIX = ".tmp"


def check_hash(hash: bytes) -> bytes:
    """``hash`` if it is 32 bytes, else :class:`ValueError` (never build a path from junk)."""
    if not isinstance(hash, bytes | bytearray) or len(hash) != HASH_BYTES:
        raise ValueError(f"a content hash is {HASH_BYTES} bytes, got {hash!r:.80}")
    return bytes(hash)


def store_dir(cache_dir: str | os.PathLike[str]) -> Path:
    """The root of the content-addressed store."""
    return Path(cache_dir) / STORE


def store_path(cache_dir: str | os.PathLike[str], hash: bytes) -> Path:
    """Final path of ``hash``: ``store/<hex[0:2]>/<hex[2:4]>/<64 hex>`` (lower case)."""
    return Path(store_file(os.fspath(cache_dir), check_hash(hash)))


def store_file(cache_dir: str, hash: bytes) -> str:
    """:func:`store_path` as a string, without ``pathlib`` (every fill and every miss makes
    one; ``pathlib`` was a sixth of a fill's CPU). ``hash`` is not checked here."""
    name = hash.hex()
    return f"{cache_dir}/{STORE}/{name[0:2]}/{name[2:4]}/{name}"


def tmp_dir(cache_dir: str | os.PathLike[str]) -> Path:
    """Where fills write before the rename; same filesystem as the store (rename is atomic)."""
    return Path(cache_dir) / TMP


def index_path(cache_dir: str | os.PathLike[str]) -> Path:
    """The SQLite index."""
    return Path(cache_dir) / INDEX


def lock_path(cache_dir: str | os.PathLike[str]) -> Path:
    """The file mountd holds an exclusive ``flock`` on while it owns the directory."""
    return Path(cache_dir) / LOCK


def socket_path(cache_dir: str | os.PathLike[str]) -> Path:
    """mountd's control socket."""
    return Path(cache_dir) / SOCKET


# -- where a user's state lives ---------------------------------------------------------------
#
# One rule for every command that keeps state (docs/operations.md "Where state lives"): the XDG
# variable when it is set, else the home's ``~/.cache``, else (service accounts in containers
# and batch systems often have no home, or one they cannot write) a private folder under the
# temporary directory.

#: What a one-line error about an unusable state folder tells the user to do.
_SET_A_VARIABLE = "set XDG_CACHE_HOME (or HOME) to a directory of yours, or pass --cache-dir"


def default_cache_dir() -> Path:
    """The cache directory when none is given: ``$XDG_CACHE_HOME/quiverfs``, else
    ``~/.cache/quiverfs``, else, for an account without a usable home, ``cache`` in
    :func:`private_tmp_dir` (made here; a cache there is lost at reboot, which loses no data).
    """
    return _user_cache_dir() or private_tmp_dir() / "cache"


def runtime_dir() -> Path:
    """A folder of this user's own for small private state (a mount's digest copy and log next
    to a cache directory that is not this user's): ``$XDG_RUNTIME_DIR/quiverfs`` when that
    variable names a directory of this user's, else ``$XDG_CACHE_HOME/quiverfs`` or
    ``~/.cache/quiverfs``, else :func:`private_tmp_dir`. Not created here (except the last)."""
    runtime = os.environ.get("XDG_RUNTIME_DIR", "")
    if runtime and os.path.isabs(runtime):
        try:
            st = os.stat(runtime)
        except OSError:
            st = None  # inherited from another user's session (su, sudo -E): not ours
        if st is not None and stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid():
            return Path(runtime) / "quiverfs"
    return _user_cache_dir() or private_tmp_dir()


def _user_cache_dir() -> Path | None:
    """``$XDG_CACHE_HOME/quiverfs`` (an absolute path, as the XDG spec wants), else
    ``~/.cache/quiverfs`` when this user can keep files there, else None (no home, a home
    that does not exist, or one this user may not write): the nearest of
    ``~/.cache/quiverfs``, ``~/.cache`` and ``~`` that exists must be a writable directory."""
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    if xdg and os.path.isabs(xdg):
        return Path(xdg) / "quiverfs"
    try:
        home = Path.home()
    except (RuntimeError, KeyError):  # no $HOME and no password entry
        return None
    if not home.is_absolute():
        return None
    mine = home / ".cache" / "quiverfs"
    for candidate in (mine, mine.parent, home):
        if os.path.lexists(candidate):
            usable = os.path.isdir(candidate) and os.access(candidate, os.W_OK | os.X_OK)
            return mine if usable else None
    return None


def private_tmp_dir() -> Path:
    """``<temporary directory>/quiverfs-<uid>``, this user's state folder when it has no
    usable home: made ``0700`` when missing. One that exists must be a real directory (not a
    symbolic link) owned by this user that nobody else may write, since anyone can create a
    name in ``/tmp`` first; otherwise :class:`UsageError` says what to do in one line."""
    try:
        path = Path(tempfile.gettempdir()) / f"quiverfs-{os.geteuid()}"
    except FileNotFoundError:  # $TMPDIR, /tmp, /var/tmp, /usr/tmp and the working directory
        raise UsageError("this user has no usable home and no writable temporary directory: "
                         + _SET_A_VARIABLE) from None
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        raise UsageError(f"cannot create {path}: {os.strerror(exc.errno or 0)} "
                         f"(this user has no usable home): {_SET_A_VARIABLE}") from None
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        problem = "is not a directory"
    elif st.st_uid != os.geteuid():
        problem = f"belongs to uid {st.st_uid}, not {os.geteuid()}"
    elif st.st_mode & 0o022:
        problem = f"is writable by others (mode {stat.S_IMODE(st.st_mode):04o})"
    else:
        return path
    raise UsageError(f"refusing {path} as this user's state folder: it {problem}; remove it, "
                     f"or {_SET_A_VARIABLE}")


_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40, "P": 1 << 50}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGTP]?)(I?B)?\s*$", re.IGNORECASE)
_PERCENT = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*%\s*$")


def parse_size(text: str | int, fs_path: str | os.PathLike[str] | None = None,
               *, whole: int | None = None) -> int:
    """Bytes from ``"10G"``, ``"512M"``, ``"1.5T"``, ``"1073741824"`` or ``"20%"``.

    Units are binary (``K`` = 1024); ``KB``/``KiB`` spellings are accepted. A percentage is of
    ``whole`` bytes when given (``--user-quota``: of the cache size), else of the total size
    of the filesystem holding ``fs_path`` (its nearest existing ancestor).
    Raises :class:`UsageError` with one line on anything else.
    """
    if isinstance(text, int) and not isinstance(text, bool):
        if text <= 0:
            raise UsageError(f"size must be positive, got {text}")
        return text
    raw = str(text)
    match = _PERCENT.match(raw)
    if match:
        pct = float(match.group(1))
        if not 0 < pct <= 100:
            raise UsageError(f"size percentage must be in (0, 100], got {raw!r}")
        if whole is not None:
            return max(1, int(whole * pct / 100))
        if fs_path is None:
            raise UsageError(f"size {raw!r} is a percentage but no filesystem was given")
        path = Path(fs_path)
        while not path.exists() and path != path.parent:
            path = path.parent
        st = os.statvfs(path)
        return max(1, int(st.f_blocks * st.f_frsize * pct / 100))
    match = _SIZE.match(raw)
    if not match:
        raise UsageError(
            f"bad size {raw!r}: use bytes or a number with K, M, G, T (e.g. 10G, 512M) or a percentage (20%)"
        )
    value = float(match.group(1)) * _UNITS[match.group(2).upper()]
    if value < 1:
        raise UsageError(f"size must be positive, got {raw!r}")
    return int(value)
