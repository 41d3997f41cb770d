"""Who may reach what in a cache directory: the modes mountd gives everything it makes there.

One mountd serves every user of a machine (docs/operations.md "Security"). Its store is
*traversable but not listable*: a process that knows a content hash may open the store file
of that hash directly (the hash is the capability: it comes from a digest the user could
build or was given), but nobody can list ``store/`` to learn what is cached. Everything else
stays mountd's own:

=====================================================  ==========  ===========================
path                                                   shared      private (``--private-store``)
=====================================================  ==========  ===========================
the cache directory                                    ``0711``    ``0700`` (``0711`` when the
                                                                   socket admits other users)
``store/``, ``store/ab/``, ``store/ab/cd/``            ``0711``    ``0700``
store files (verified, never written again)            ``0444``    ``0400``
``tmp/``                                               ``0700``    ``0700``
``lock``, ``index.sqlite`` (``-wal``, ``-shm``,        ``0600``    ``0600``
``.corrupt``)
``mountd.sock``                                        ``--socket-mode`` (``0600`` by default)
=====================================================  ==========  ===========================

Modes are set explicitly (``chmod``), never left to the umask. The mode of ``store/`` is the
one switch the fill path reads: fan-out folders made later copy it, and store files get the
matching file mode (:meth:`StoreModes.of_store`), so fills need no configuration of their own.
:func:`secure_cache_dir` and :func:`set_store_access` set that switch on open, after the
directory's lock is taken (a second mountd that fails to take the lock changes nothing).

Changing the store's access (a cache from a quiverfs that made everything private, or
``--private-store`` switched on or off) walks the store once, recorded in the index's
``meta.store_access`` (:mod:`mountd.store.recovery`): a walk cut short by a crash is redone.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from mountd.errors import CacheDirUnsafe
from mountd.store import layout

log = logging.getLogger("mountd.store.access")

#: Mode of the folders no other user may enter: ``tmp/`` (and everything, in a private store).
PRIVATE_DIR = 0o700
#: Mode of mountd's own files: the lock and the index.
PRIVATE_FILE = 0o600
#: Mode of a folder others may traverse (open a name they know in it) but not list.
TRAVERSABLE_DIR = 0o711

#: Threads walking fan-out folders to change their files' modes: a few overlap the disk's
#: latency; more only fight over the GIL (a million files on the 2-core VM: 4 threads 10 s warm,
#: 11-16 s cold; 16 threads 13 s warm, 22 s cold).
WALK_THREADS = 4


@dataclass(frozen=True)
class StoreModes:
    """The modes of the store: the cache directory, ``store/`` and its folders, store files."""

    #: ``"shared"`` or ``"private"``: recorded in the index's ``meta.store_access``.
    name: str
    #: The cache directory itself.
    top: int
    #: ``store/`` and every fan-out folder.
    dirs: int
    #: Every store file.
    files: int

    @property
    def shared(self) -> bool:
        """True when other users may open store files whose hash they know."""
        return bool(self.dirs & 0o011)

    @staticmethod
    def of_store(store: str | os.PathLike[str]) -> StoreModes:
        """The modes a store folder's own mode stands for: :data:`SHARED` when others may
        traverse it, else :data:`PRIVATE` (how fills learn the configuration)."""
        return SHARED if os.stat(store).st_mode & 0o011 else PRIVATE


#: Traversable but not listable: the default (docs/operations.md "Security").
SHARED = StoreModes("shared", top=TRAVERSABLE_DIR, dirs=TRAVERSABLE_DIR, files=0o444)
#: Nobody but mountd's user (and root): ``--private-store``.
PRIVATE = StoreModes("private", top=PRIVATE_DIR, dirs=PRIVATE_DIR, files=0o400)


def store_modes(private: bool) -> StoreModes:
    """:data:`PRIVATE` or :data:`SHARED`."""
    return PRIVATE if private else SHARED


def _mode(path: str | os.PathLike[str]) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def check_private(cache_dir: Path) -> None:
    """Refuse an existing cache directory others could change; changes nothing.

    * not a directory, or owned by another user (who could change its mode and plant files
      that would be served as verified content): :class:`CacheDirUnsafe`;
    * writable by group or others: :class:`CacheDirUnsafe` as well (same reason).

    Read and search bits are not refused: :func:`secure_cache_dir` sets them once the lock is
    held (``0711`` is what a shared store needs, so it is never "fixed" to ``0700``).
    """
    try:
        info = os.stat(cache_dir)
    except OSError as exc:
        raise CacheDirUnsafe(f"cannot use cache directory {cache_dir}: {exc.strerror}") from None
    if not stat.S_ISDIR(info.st_mode):
        raise CacheDirUnsafe(f"cache directory {cache_dir} is not a directory")
    if info.st_uid != os.geteuid():
        raise CacheDirUnsafe(
            f"cache directory {cache_dir} belongs to uid {info.st_uid}, not to this user "
            f"(uid {os.geteuid()}): pick a directory of your own with --cache-dir")
    mode = stat.S_IMODE(info.st_mode)
    if mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise CacheDirUnsafe(
            f"cache directory {cache_dir} is writable by other users (mode {mode:04o}), who could "
            f"plant cache content: chmod 711 {cache_dir}")


def _private_files(cache_dir: Path) -> list[Path]:
    index = layout.index_path(cache_dir)
    return [layout.lock_path(cache_dir), index,
            *(index.with_name(index.name + suffix) for suffix in ("-wal", "-shm", ".corrupt"))]


def secure_cache_dir(cache_dir: Path, modes: StoreModes) -> None:
    """The cache directory ``modes.top``, ``store/`` ``modes.dirs``, ``tmp/`` private, the lock
    and the index files ``0600`` (cheap: a few ``stat`` and ``chmod``; run on every open, with
    the lock held, before the index is opened).

    ``store/`` is the switch fills read, and the gate to everything below it: being exact on
    every open, a folder or file below it with wider modes than configured (a walk cut short,
    :func:`set_store_access`) is never reachable. A cache directory others could list (an
    older quiverfs made ``0755``) is narrowed with a warning. Index files matter most: SQLite
    creates ``-wal`` and ``-shm`` with the database file's mode, and anyone can name them in a
    traversable cache directory.
    """
    mode = _mode(cache_dir)
    if mode != modes.top:
        if mode & 0o044 & ~modes.top:
            log.warning("cache directory %s was listable by other users (mode %04o); made it %04o",
                        cache_dir, mode, modes.top)
        os.chmod(cache_dir, modes.top)
    for folder, wanted in ((layout.store_dir(cache_dir), modes.dirs),
                           (layout.tmp_dir(cache_dir), PRIVATE_DIR)):
        if _mode(folder) != wanted:
            os.chmod(folder, wanted)
    for path in _private_files(cache_dir):
        with contextlib.suppress(FileNotFoundError):
            if _mode(path) != PRIVATE_FILE:
                os.chmod(path, PRIVATE_FILE)


def allow_traversal(cache_dir: Path) -> None:
    """Let other users reach names in the cache directory (its socket): ``0711`` if it was
    ``0700``. The daemon calls it for a private store whose socket admits other users."""
    if _mode(cache_dir) & 0o011 != 0o011:
        os.chmod(cache_dir, TRAVERSABLE_DIR)


def _set_top(path: str, modes: StoreModes) -> int:
    """Give ``store/<top>/``, its folders and their regular files ``modes``; files changed."""
    changed = 0
    with os.scandir(path) as level2:
        leaves = [d.path for d in level2 if d.is_dir(follow_symlinks=False)]
    for leaf in leaves:
        try:
            fd = os.open(leaf, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            continue
        try:
            with os.scandir(fd) as files:
                for f in files:
                    # d_type, no stat: a symlink (never made by mountd) is not followed.
                    if f.is_file(follow_symlinks=False):
                        with contextlib.suppress(FileNotFoundError):
                            os.chmod(f.name, modes.files, dir_fd=fd)  # by name: no path walk
                            changed += 1
            os.fchmod(fd, modes.dirs)
        finally:
            os.close(fd)
    os.chmod(path, modes.dirs)
    return changed


def set_store_access(cache_dir: Path, modes: StoreModes) -> int:
    """Give every fan-out folder and store file ``modes`` (blocking; a few threads walk the
    256 top folders); returns the number of files changed. ``store/`` itself is set by
    :func:`secure_cache_dir`, before.

    One ``scandir`` per fan-out folder and one ``chmod`` per file by name (no ``stat``, no
    path walk): 10-16 s per million files (docs/store-layout.md "Access").
    """
    with os.scandir(layout.store_dir(cache_dir)) as level1:
        tops = [d.path for d in level1 if d.is_dir(follow_symlinks=False)]
    with ThreadPoolExecutor(WALK_THREADS, thread_name_prefix="mountd-chmod") as pool:
        return sum(pool.map(lambda top: _set_top(top, modes), tops))
