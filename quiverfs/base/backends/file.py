"""``file:///path``: a local or shared (NFS, Lustre) directory tree as an object store.

The test baseline, and the way to front slow shared storage. Keys are POSIX paths relative to
the root directory; regular files are objects. Listing is a sorted walk, paged so it behaves
like the cloud backends, and also names:

* every directory with no subdirectory and no file below it, as a :data:`DIRECTORY` entry
  (what a bucket's directory marker is), so empty directories reach the digest: the tree's
  shape is part of the dataset, and a loader may list an empty ``valid/``;
* symbolic links to files: followed when their target stays inside the root (as if the file
  were there); listed as :data:`EXTERNAL_LINK` when it leaves the root (``/etc/passwd``,
  ``../../x``), which a build skips unless asked to follow them. Links to directories are
  not descended into, like ``find`` without ``-L``.

Writes are atomic: the bytes go to a temporary file in the object's directory (named
``.NAME.tmp-PID-RANDOM``), which is fsynced and renamed over the object's name, and the
directory is fsynced; missing directories below the root are created (and their parents
fsynced). The root itself must exist, as a bucket must. Crash states: the object's old
content or its new one; at worst a leftover ``.*.tmp-*`` file, which a listing shows.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
from urllib.parse import unquote

from quiverfs.base.backends.base import (
    DIRECTORY,
    EXTERNAL_LINK,
    Backend,
    BackendOptions,
    ObjectInfo,
)
from quiverfs.base.backends.settings import RemoteSettings
from quiverfs.base.errors import (
    AccessDenied,
    BackendError,
    NotFound,
    PermanentFailure,
    TemporaryFailure,
)

PAGE_SIZE = 1000

#: The one table: errno → our error class. Anything else is a permanent failure.
ERRNO_TABLE: dict[int, type[BackendError]] = {
    errno.ENOENT: NotFound,
    errno.ENOTDIR: NotFound,
    errno.EISDIR: NotFound,
    errno.EACCES: AccessDenied,
    errno.EPERM: AccessDenied,
    errno.EAGAIN: TemporaryFailure,
    errno.EINTR: TemporaryFailure,
    errno.ETIMEDOUT: TemporaryFailure,
    errno.ESTALE: TemporaryFailure,  # NFS handle went stale: reopening usually works
    errno.EIO: TemporaryFailure,
    # what a write meets
    errno.EROFS: AccessDenied,
    errno.ENOSPC: PermanentFailure,
    errno.EDQUOT: PermanentFailure,
}


class FileBackend(Backend):
    """Objects are the regular files under a root directory."""

    scheme = "file"

    def __init__(self, url: str, options: BackendOptions, settings: RemoteSettings) -> None:
        super().__init__(url, options, settings)
        self.root = unquote(url[len("file://") :])
        # Listing walks the whole tree once, then serves pages from this sorted list.
        self._listings: dict[str, list[ObjectInfo]] = {}

    def _path(self, key: str) -> str:
        return os.path.join(self.root, key)

    def path_of(self, key: str) -> str:
        """The local path of object ``key`` (a mount on a shared mountd opens it with its
        own rights and hands mountd the descriptor: mountd/store/supplied.py)."""
        return self._path(key)

    def error_of(self, exc: OSError, key: str) -> BackendError:
        """``exc`` (from opening or reading ``key``) in our vocabulary: the one errno table."""
        return self._translate(exc, key) or PermanentFailure(str(exc), url=self.url, key=key)

    def _info(self, key: str, st: os.stat_result) -> ObjectInfo:
        return ObjectInfo(key=key, size=st.st_size, version=str(st.st_mtime_ns))

    def _walk(self, prefix: str) -> list[ObjectInfo]:
        # Walk only the directory the prefix's directory part names, then filter by string
        # prefix, which is what S3-style listing means.
        base = prefix.rpartition("/")[0]
        start = self._path(base) if base else self.root
        if not os.path.isdir(self.root):
            raise FileNotFoundError(errno.ENOENT, "no such directory", self.root)
        inside = os.path.join(os.path.realpath(self.root), "")
        found: list[ObjectInfo] = []
        for dirpath, dirnames, filenames in os.walk(start, followlinks=False):
            dirnames.sort()
            objects_here = 0
            for name in filenames:
                full = os.path.join(dirpath, name)
                key = os.path.relpath(full, self.root).replace(os.sep, "/")
                if not key.startswith(prefix):
                    continue
                try:
                    st = os.stat(full)
                except FileNotFoundError:
                    continue  # removed while we walked, or a dangling link
                if not os.path.isfile(full):
                    continue
                info = self._info(key, st)
                if os.path.islink(full) and not os.path.realpath(full).startswith(inside):
                    info = ObjectInfo(info.key, info.size, info.version, EXTERNAL_LINK)
                else:
                    objects_here += 1
                found.append(info)
            # A directory with nothing a digest could hold below it is named on its own, like
            # a bucket's directory marker; the others are implied by their files' keys.
            rel_dir = os.path.relpath(dirpath, self.root).replace(os.sep, "/")
            if not dirnames and not objects_here and rel_dir != "." and rel_dir.startswith(prefix):
                found.append(ObjectInfo(rel_dir, 0, "", DIRECTORY))
        found.sort(key=lambda info: info.key)
        return found

    def _list_page(self, prefix: str, token: str | None) -> tuple[list[ObjectInfo], str | None]:
        if token is None:
            self._listings[prefix] = self._walk(prefix)
        listing = self._listings[prefix]
        start = int(token or 0)
        page = listing[start : start + PAGE_SIZE]
        end = start + len(page)
        if end >= len(listing):
            self._listings.pop(prefix, None)
            return page, None
        return page, str(end)

    def _stat(self, key: str) -> ObjectInfo:
        path = self._path(key)
        st = os.stat(path)
        if not os.path.isfile(path):
            raise IsADirectoryError(errno.EISDIR, "not a regular file", path)
        return self._info(key, st)

    def _read_range(self, key: str, offset: int, length: int) -> bytes:
        fd = os.open(self._path(key), os.O_RDONLY | os.O_CLOEXEC)
        try:
            chunks = []
            while length > 0:
                data = os.pread(fd, length, offset)
                if not data:
                    break
                chunks.append(data)
                offset += len(data)
                length -= len(data)
            return b"".join(chunks)
        finally:
            os.close(fd)

    def _write_object(self, key: str, data: bytes) -> None:
        if not os.path.isdir(self.root):
            raise FileNotFoundError(errno.ENOENT, "no such directory", self.root)
        path = os.path.normpath(self._path(key))
        if not path.startswith(os.path.join(os.path.normpath(self.root), "")):
            raise PermanentFailure("key leaves the root directory", url=self.url, key=key)
        directory, name = os.path.split(path)
        created = _make_dirs(directory)
        tmp = os.path.join(directory, f".{name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
        # 0o666 less the umask, like any file a program creates (mkstemp would give 0600).
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
        try:
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        _fsync_dir(directory)
        # A new directory's entry lives in its parent: fsync the parents, deepest first.
        for made in reversed(created):
            _fsync_dir(os.path.dirname(made))

    def _translate(self, exc: BaseException, key: str) -> BackendError | None:
        if isinstance(exc, OSError) and exc.errno in ERRNO_TABLE:
            cls = ERRNO_TABLE[exc.errno]
            return cls(os.strerror(exc.errno).lower(), url=self.url, key=key)
        return None


def _make_dirs(directory: str) -> list[str]:
    """Create ``directory`` and its missing ancestors; the ones created, outermost first."""
    missing = []
    while not os.path.isdir(directory):
        missing.append(directory)
        directory = os.path.dirname(directory)
    created = []
    for path in reversed(missing):
        try:
            os.mkdir(path)
        except FileExistsError:
            if not os.path.isdir(path):
                raise NotADirectoryError(errno.ENOTDIR, "a file is in the way", path) from None
            continue  # another writer made it meanwhile
        created.append(path)
    return created


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

