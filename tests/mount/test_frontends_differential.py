"""The two front ends answer alike: the native one (quiverfs/fuse/worker.py, our own protocol
code) and pyfuse3 (quiverfs/fuse/frontend_pyfuse3.py, libfuse's), as two mounts of one digest at
once, through the real kernel.

Seeded random sequences of operations run on both mounts, one operation on each in turn, and
every answer must be identical: inode numbers, sizes, modes, names and cookies in order
(getdents64 with buffers of odd sizes and seeks back to a cookie, over a directory of a few
thousand entries), bytes at odd offsets and sizes, xattr values, sizes and errno, and the
errno of every failure (ENOENT, ENOTDIR, EISDIR, EROFS, ENODATA, ERANGE, EINVAL). Answers are
also checked against the source tree, so two front ends that agree on a wrong answer fail.
"""

from __future__ import annotations

import ctypes
import errno
import os
import random
import stat
import struct
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.mount.conftest import MountProcess, dataset_served

pytestmark = pytest.mark.mount
pytest.importorskip("pyfuse3", reason="the pyfuse3 front end needs the pyfuse3 extra")

MANY = "many"  # a directory of MANY_COUNT files: listings page over many READDIRs
MANY_COUNT = 3000
SEEDS = (1, 2, 3)
OPS_PER_SEED = 250
FRONTENDS = ("native", "pyfuse3")

libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
libc.getxattr.restype = libc.listxattr.restype = ctypes.c_ssize_t
libc.getxattr.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_void_p, ctypes.c_size_t]
libc.listxattr.argtypes = [ctypes.c_char_p, ctypes.c_void_p, ctypes.c_size_t]
SYS_GETDENTS64 = 217 if os.uname().machine == "x86_64" else 61  # aarch64: 61
DIRENT64 = struct.Struct("<QqHB")  # d_ino, d_off, d_reclen, d_type, then the name
libc.statx.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_uint, ctypes.c_void_p]
AT_FDCWD, AT_SYMLINK_NOFOLLOW, AT_STATX_FORCE_SYNC, STATX_BASIC_STATS = -100, 0x100, 0x2000, 0x7FF
# struct statx: mask, blksize, attributes, nlink, uid, gid, mode, pad, ino, size, blocks,
# attributes_mask, then atime, btime, ctime, mtime (s64 seconds, u32 nanoseconds, pad)
STATX = struct.Struct("<IIQIIIHHQQQQ16x16x16xqI4x")


def _files() -> dict[str, bytes]:
    rng = random.Random(11)
    files = {
        "README": b"two front ends, one tree\n",
        "empty": b"",
        "page": rng.randbytes(4096),
        "page+1": rng.randbytes(4097),
        "big.bin": rng.randbytes(1024 * 1024 + 333),
        "odd/131073.dat": rng.randbytes(131073),
        "odd/deeper/deepest/leaf": rng.randbytes(7777),
        "ünïcödé/café ☕.txt": "grüße\n".encode(),
        "with space/a b.c": rng.randbytes(3000),
    }
    for i in range(MANY_COUNT):
        files[f"{MANY}/n{rng.randrange(10**6):06d}_{i}"] = rng.randbytes(rng.randrange(0, 300))
    return files


@pytest.fixture(scope="module")
def world(fuse, module_tmp: Path):
    """One digest, one mountd, and the two front ends mounted side by side."""
    files = _files()
    with dataset_served(module_tmp, files, "tree") as served:
        digest, cache = served["digest"], served["cache"]
        with MountProcess(digest, module_tmp / "native", cache), \
                MountProcess(digest, module_tmp / "pyfuse3", cache, "--frontend", "pyfuse3"):
            dirs = {""} | {str(Path(rel).parent) for rel in files} - {"."}
            for rel in list(dirs):
                while rel:
                    rel = os.path.dirname(rel)
                    dirs.add(rel)
            yield {"files": files, "dirs": sorted(dirs), "source": module_tmp / "source",
                   "mounts": {name: module_tmp / name for name in FRONTENDS}}


# -- observing one mount: every answer is a plain value, or ("errno", name) ---------------------


def _err(exc: OSError) -> tuple[str, str]:
    return ("errno", errno.errorcode.get(exc.errno or 0, str(exc.errno)))


def _attempt(fn: Callable[[], object]) -> object:
    try:
        return fn()
    except OSError as exc:
        return _err(exc)


def _stat(path: Path) -> object:
    st = os.lstat(path)
    return (st.st_ino, stat.filemode(st.st_mode), st.st_size, st.st_nlink, st.st_uid, st.st_gid,
            st.st_blocks, st.st_blksize, st.st_mtime_ns)


def _getattr(path: Path) -> object:
    """``statx`` with ``AT_STATX_FORCE_SYNC``: the kernel asks the mount (GETATTR) instead of
    answering from the attributes it keeps for 24 hours."""
    buf = ctypes.create_string_buffer(256)
    if libc.statx(AT_FDCWD, os.fsencode(path), AT_SYMLINK_NOFOLLOW | AT_STATX_FORCE_SYNC,
                  STATX_BASIC_STATS, buf) != 0:
        raise OSError(ctypes.get_errno(), "statx")
    (_, blksize, _, nlink, uid, gid, mode, _, ino, size, blocks, _, mtime_s,
     mtime_ns) = STATX.unpack_from(buf.raw)
    return ino, stat.filemode(mode), size, nlink, uid, gid, blocks, blksize, mtime_s, mtime_ns


def _getdents(path: Path, bufsize: int, seek_to: int | None = None) -> object:
    """``(name, ino, d_off, d_type)`` of every entry, read with ``bufsize``-byte getdents64
    calls (after seeking to cookie ``seek_to``, as seekdir does)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        if seek_to is not None:
            os.lseek(fd, seek_to, os.SEEK_SET)
        buf = ctypes.create_string_buffer(bufsize)
        out = []
        while True:
            n = libc.syscall(SYS_GETDENTS64, fd, buf, bufsize)
            if n < 0:
                raise OSError(ctypes.get_errno(), "getdents64")
            if n == 0:
                return out
            raw, pos = buf.raw[:n], 0
            while pos < n:
                ino, off, reclen, kind = DIRENT64.unpack_from(raw, pos)
                name = raw[pos + DIRENT64.size:pos + reclen].split(b"\0", 1)[0]
                out.append((name, ino, off, kind))
                pos += reclen
    finally:
        os.close(fd)


def _pread(path: Path, offset: int, size: int) -> object:
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.pread(fd, size, offset)
    finally:
        os.close(fd)


def _read_dir_fd(path: Path) -> object:
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.read(fd, 10)
    finally:
        os.close(fd)


def _getxattr_raw(path: Path, name: bytes, size: int) -> object:
    """``getxattr(2)`` with a ``size``-byte buffer (0: asks for the value's size)."""
    buf = ctypes.create_string_buffer(max(size, 1))
    n = libc.getxattr(os.fsencode(path), name, buf if size else None, size)
    if n < 0:
        raise OSError(ctypes.get_errno(), "getxattr")
    return n if size == 0 else buf.raw[:n]


def _listxattr_raw(path: Path, size: int) -> object:
    buf = ctypes.create_string_buffer(max(size, 1))
    n = libc.listxattr(os.fsencode(path), buf if size else None, size)
    if n < 0:
        raise OSError(ctypes.get_errno(), "listxattr")
    return n if size == 0 else buf.raw[:n]


def _write_open(path: Path, flags: int) -> object:
    fd = os.open(path, flags, 0o644)
    os.close(fd)
    return "opened"


# -- random operations ----------------------------------------------------------------------------


class Operations:
    """Draws operations on relative paths; each returns ``(description, observe(root))``."""

    def __init__(self, world: dict, rng: random.Random) -> None:
        self.rng = rng
        self.files = world["files"]
        self.file_names = sorted(self.files)
        self.dirs = world["dirs"]

    def _file(self) -> str:
        rng = self.rng
        if rng.random() < 0.3:
            return rng.choice([name for name in self.file_names if not name.startswith(MANY)])
        return rng.choice(self.file_names)

    def _any_path(self) -> str:
        rng = self.rng
        kind = rng.randrange(6)
        if kind == 0:
            return rng.choice(self.dirs)
        if kind == 1:  # a name that is not there
            return os.path.join(rng.choice(self.dirs), f"missing-{rng.randrange(1000)}")
        if kind == 2:  # through a file: ENOTDIR
            return os.path.join(self._file(), "below")
        if kind == 3:  # longer than any name can be
            return os.path.join(rng.choice(self.dirs), "x" * 300)
        return self._file()

    def _check_attributes(self, rel: str) -> None:
        """Mode and size of a file or directory of the source (the mount's are read-only)."""
        if rel in self.files:
            want = ("-r--r--r--", len(self.files[rel]))
        elif rel in self.dirs:
            want = ("dr-xr-xr-x", 0)
        else:
            want = ("errno", "ENOTDIR" if os.path.dirname(rel) in self.files else "ENOENT")
            self.check = lambda answer: answer == want
            return
        self.check = lambda answer: isinstance(answer, tuple) and answer[1:3] == want

    def draw(self) -> tuple[str, Callable[[Path], object]]:
        """An operation; ``self.check`` then tells whether an answer agrees with the source
        (``None``: only the two front ends are compared)."""
        rng = self.rng
        self.check: Callable[[object], bool] | None = None
        op = rng.choice(["stat", "getattr", "listdir", "pread", "pread", "pread", "xattr", "xattr",
                         "listxattr", "change", "misc"])
        if op == "stat":
            rel = self._any_path()
            self._check_attributes(rel)
            return f"stat {rel!r}", lambda root: _attempt(lambda: _stat(root / rel))
        if op == "getattr":
            rel = self._any_path()
            self._check_attributes(rel)
            return f"statx {rel!r}", lambda root: _attempt(lambda: _getattr(root / rel))
        if op == "listdir":
            rel = rng.choice([MANY, MANY, "", "odd", "odd/deeper/deepest", "ünïcödé"])
            # Tiny buffers cost a READDIR per entry; over MANY that is thousands of requests,
            # so there the buffers hold a few dozen entries (still many pages of READDIRs).
            small = [] if rel == MANY else [64, 100, 333]
            bufsize = rng.choice([*small, 1024, 4096, 32768])
            pick = rng.random()  # where in the listing to seek back to
            return (f"getdents {rel!r} buffer {bufsize} seek {pick:.3f}",
                    lambda root: _attempt(lambda: _listing_from(root / rel, bufsize, pick)))
        if op == "pread":
            rel = self._file()
            size = len(self.files[rel])
            offset = rng.choice([0, 1, rng.randrange(size + 1), max(size - 1, 0), size, size + 5,
                                 4095, 4096, 131071])
            length = rng.choice([1, 7, 4095, 4097, 65537, 131073, rng.randrange(1, 300_000)])
            expected = self.files[rel][offset:offset + length]
            self.check = lambda answer: answer == expected
            return (f"pread {rel!r} at {offset} size {length}",
                    lambda root: _attempt(lambda: _pread(root / rel, offset, length)))
        if op == "xattr":
            rel = rng.choice([self._file(), rng.choice(self.dirs), "", self._any_path()])
            name = rng.choice([b"user.quiver.hash", b"user.quiver.cached", b"user.quiver.dataset",
                               b"user.quiver.nope", b"trusted.nope", b"user.quiver.ctl.x"])
            size = rng.choice([0, 3, 64, 4096])
            return (f"getxattr {rel!r} {name!r} buffer {size}",
                    lambda root: _attempt(lambda: _getxattr_raw(root / rel, name, size)))
        if op == "listxattr":
            rel = rng.choice([self._file(), rng.choice(self.dirs), ""])
            size = rng.choice([0, 5, 4096])
            return (f"listxattr {rel!r} buffer {size}",
                    lambda root: _attempt(lambda: _listxattr_raw(root / rel, size)))
        if op == "change":
            rel, folder = self._file(), rng.choice(self.dirs)
            new = os.path.join(folder, "new")
            change = rng.choice([
                ("open for writing", lambda r: _write_open(r / rel, os.O_WRONLY)),
                ("create", lambda r: _write_open(r / new, os.O_WRONLY | os.O_CREAT)),
                ("truncate", lambda r: os.truncate(r / rel, 0)),
                ("rename", lambda r: os.rename(r / rel, r / new)),
                ("unlink", lambda r: os.unlink(r / rel)),
                ("mkdir", lambda r: os.mkdir(r / new)),
                ("rmdir", lambda r: os.rmdir(r / folder) if folder else os.rmdir(r / "odd")),
                ("symlink", lambda r: os.symlink("x", r / new)),
                ("link", lambda r: os.link(r / rel, r / new)),
                ("chmod", lambda r: os.chmod(r / rel, 0o777)),
                ("setxattr", lambda r: os.setxattr(r / rel, "user.x", b"1")),
                ("removexattr", lambda r: os.removexattr(r / rel, "user.quiver.hash")),
            ])
            return f"{change[0]} {rel!r}/{new!r}", lambda root: _attempt(lambda: change[1](root))
        misc = rng.choice([
            ("read a directory", lambda r: _read_dir_fd(r / rng.choice(self.dirs))),
            ("listdir a file", lambda r: os.listdir(r / self.file_names[0])),
            ("readlink a file", lambda r: os.readlink(r / "README")),
            ("statvfs", lambda r: tuple(os.statvfs(r))),
            ("open a missing file", lambda r: _pread(r / "odd/missing", 0, 1)),
        ])
        return misc[0], lambda root: _attempt(lambda: misc[1](root))


def _listing_from(path: Path, bufsize: int, pick: float) -> object:
    """A full listing with ``bufsize`` buffers, then the tail after one of its cookies."""
    full = _getdents(path, bufsize)
    assert isinstance(full, list)
    at = int(pick * len(full))
    cookie = full[at][2] if at < len(full) else 0
    return full, _getdents(path, bufsize, seek_to=cookie)


# -- the tests --------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
def test_same_answers_for_random_sequences(world, seed: int) -> None:
    rng = random.Random(seed)
    operations = Operations(world, rng)
    errnos: set[str] = set()
    for step in range(OPS_PER_SEED):
        description, observe = operations.draw()
        answers = {name: observe(root) for name, root in world["mounts"].items()}
        assert answers["native"] == answers["pyfuse3"], f"seed {seed} step {step}: {description}"
        if operations.check is not None:
            assert operations.check(answers["native"]), f"seed {seed} step {step}: {description}"
        if isinstance(answers["native"], tuple) and answers["native"][:1] == ("errno",):
            errnos.add(answers["native"][1])
    # The sequences reach the failures they are meant to compare.
    assert {"ENOENT", "ENOTDIR", "EROFS", "EISDIR", "ENODATA", "ERANGE", "EINVAL"} <= errnos, errnos


def test_listings_have_dot_and_dotdot_and_agree_with_the_source(world) -> None:
    source = world["source"]
    for rel in ("", MANY, "odd/deeper"):
        listings = {name: _getdents(root / rel, 4096) for name, root in world["mounts"].items()}
        assert listings["native"] == listings["pyfuse3"], rel
        listing = listings["native"]
        assert isinstance(listing, list)
        names = [entry[0] for entry in listing]
        assert names[:2] == [b".", b".."]
        assert sorted(names[2:]) == sorted(os.fsencode(n) for n in os.listdir(source / rel))
        offsets = [entry[2] for entry in listing]
        assert len(set(offsets)) == len(offsets) and all(off > 0 for off in offsets)
        root = world["mounts"]["native"]
        assert listing[0][1] == os.stat(root / rel).st_ino
        if rel:
            assert listing[1][1] == os.stat(root / os.path.dirname(rel)).st_ino
        else:
            assert listing[1][1] == 1  # the root is its own parent


def test_odd_reads_and_xattrs_cover_every_file_kind(world) -> None:
    """Deterministic corners the random walk might miss: empty file, page edges, EOF."""
    mounts, files = world["mounts"], world["files"]
    cases = [("empty", 0, 10), ("page", 4095, 2), ("page+1", 4096, 1), ("page+1", 4097, 1),
             ("big.bin", 1024 * 1024 - 1, 400), ("odd/131073.dat", 131072, 131072)]
    for rel, offset, size in cases:
        answers = {name: _pread(root / rel, offset, size) for name, root in mounts.items()}
        assert answers["native"] == answers["pyfuse3"] == files[rel][offset:offset + size], rel
    for rel in ("empty", "README", "ünïcödé/café ☕.txt"):
        values = {name: os.getxattr(root / rel, "user.quiver.hash") for name, root in mounts.items()}
        assert values["native"] == values["pyfuse3"] and len(values["native"]) == 64
