"""The FUSE kernel protocol, as far as a read-only filesystem needs it: opcodes, structs, replies.

quiverfs speaks the protocol of ``/dev/fuse`` itself instead of going through libfuse (see
docs/mount.md "Why not libfuse"): the layouts below are those of ``<linux/fuse.h>``,
protocol 7.38, little-endian, every struct padded to 8 bytes. Nothing here does I/O; the
encoders return ``bytes`` ready to be written to the device in one ``write``, which is what
the kernel requires of a reply.
"""

from __future__ import annotations

import errno
import stat
import struct
from dataclasses import dataclass

#: Protocol version we answer INIT with (the kernel uses the smaller of its and ours).
KERNEL_MAJOR = 7
KERNEL_MINOR = 38

#: Oldest kernel protocol the native front end serves: 7.29 (Linux 5.1) is where the kernel
#: takes ENOSYS for OPENDIR as "no opendir needed" (7.28 brought MAX_PAGES, 7.23 the 64-byte
#: INIT reply, 4.19 the same for OPEN); on an older one every ``opendir`` would fail.
MIN_KERNEL_MINOR = 29

# -- opcodes (enum fuse_opcode) -----------------------------------------------------------------
LOOKUP = 1
FORGET = 2
GETATTR = 3
SETATTR = 4
READLINK = 5
SYMLINK = 6
MKNOD = 8
MKDIR = 9
UNLINK = 10
RMDIR = 11
RENAME = 12
LINK = 13
OPEN = 14
READ = 15
WRITE = 16
STATFS = 17
RELEASE = 18
FSYNC = 20
SETXATTR = 21
GETXATTR = 22
LISTXATTR = 23
REMOVEXATTR = 24
FLUSH = 25
INIT = 26
OPENDIR = 27
READDIR = 28
RELEASEDIR = 29
FSYNCDIR = 30
ACCESS = 34
CREATE = 35
INTERRUPT = 36
DESTROY = 38
IOCTL = 39
BATCH_FORGET = 42
FALLOCATE = 43
READDIRPLUS = 44
RENAME2 = 45
COPY_FILE_RANGE = 47
TMPFILE = 51

#: Every opcode above by name, for logs ("READ", not 15): see :func:`opcode_name`.
OPCODE_NAMES = {
    LOOKUP: "LOOKUP", FORGET: "FORGET", GETATTR: "GETATTR", SETATTR: "SETATTR",
    READLINK: "READLINK", SYMLINK: "SYMLINK", MKNOD: "MKNOD", MKDIR: "MKDIR", UNLINK: "UNLINK",
    RMDIR: "RMDIR", RENAME: "RENAME", LINK: "LINK", OPEN: "OPEN", READ: "READ", WRITE: "WRITE",
    STATFS: "STATFS", RELEASE: "RELEASE", FSYNC: "FSYNC", SETXATTR: "SETXATTR",
    GETXATTR: "GETXATTR", LISTXATTR: "LISTXATTR", REMOVEXATTR: "REMOVEXATTR", FLUSH: "FLUSH",
    INIT: "INIT", OPENDIR: "OPENDIR", READDIR: "READDIR", RELEASEDIR: "RELEASEDIR",
    FSYNCDIR: "FSYNCDIR", ACCESS: "ACCESS", CREATE: "CREATE", INTERRUPT: "INTERRUPT",
    DESTROY: "DESTROY", IOCTL: "IOCTL", BATCH_FORGET: "BATCH_FORGET", FALLOCATE: "FALLOCATE",
    READDIRPLUS: "READDIRPLUS", RENAME2: "RENAME2", COPY_FILE_RANGE: "COPY_FILE_RANGE",
    TMPFILE: "TMPFILE",
}


def opcode_name(opcode: int) -> str:
    """``opcode``'s name in ``<linux/fuse.h>`` (without ``FUSE_``), or ``opcode N``."""
    return OPCODE_NAMES.get(opcode) or f"opcode {opcode}"


#: Requests that would change the tree or a file: always EROFS (the mount is also ``ro``, so
#: the VFS refuses most of them before they reach us).
MUTATING = frozenset({SETATTR, SYMLINK, MKNOD, MKDIR, UNLINK, RMDIR, RENAME, LINK, WRITE, FSYNC,
                      SETXATTR, REMOVEXATTR, FSYNCDIR, CREATE, FALLOCATE, RENAME2,
                      COPY_FILE_RANGE, TMPFILE})

#: Requests the kernel expects no reply to. INTERRUPT asks us to abandon a request in flight;
#: the protocol lets a filesystem ignore it and answer that request when it is done (see
#: docs/mount.md "Reads": a reader interrupted while its miss is fetched gets the data).
NO_REPLY = frozenset({FORGET, BATCH_FORGET, INTERRUPT})

# -- INIT flags -----------------------------------------------------------------------------------
ASYNC_READ = 1 << 0
DO_READDIRPLUS = 1 << 13
READDIRPLUS_AUTO = 1 << 14
PARALLEL_DIROPS = 1 << 18
MAX_PAGES = 1 << 22

#: ``flags`` bit saying the INIT carries a second word of flags (``flags2``, 7.36).
INIT_EXT = 1 << 30
#: ``flags2`` bit (``FUSE_PASSTHROUGH`` is 1 << 37): files opened with ``FOPEN_PASSTHROUGH``
#: are read by the kernel from a backing file the daemon registered (Linux 6.9, 7.40).
PASSTHROUGH_FLAGS2 = 1 << 5
#: How deep the backing files' filesystems may stack under ours (they are the store's own
#: filesystem: ext4, xfs..., depth 0).
MAX_STACK_DEPTH = 1

#: What we ask for (and take only where the kernel offers it): parallel reads and lookups,
#: READDIRPLUS (a listing hands the kernel every entry's attributes, so no LOOKUP follows it),
#: and reads of up to ``MAX_PAGES_WANTED`` pages per request.
WANTED_FLAGS = ASYNC_READ | DO_READDIRPLUS | READDIRPLUS_AUTO | PARALLEL_DIROPS | MAX_PAGES
MAX_PAGES_WANTED = 256
#: The largest READ the mount asks for: MAX_PAGES_WANTED pages of 4 KiB (1 MiB).
MAX_READ_BYTES = MAX_PAGES_WANTED * 4096
MAX_WRITE = 128 * 1024

#: A request buffer must hold the largest request (a WRITE of MAX_WRITE plus headers).
REQUEST_BUFFER = MAX_WRITE + 4096

# -- structs ----------------------------------------------------------------------------------------
IN_HEADER = struct.Struct("<IIQQIIIHH")  # len, opcode, unique, nodeid, uid, gid, pid, extlen, pad
OUT_HEADER = struct.Struct("<IiQ")  # len, error (negative errno), unique
ATTR = struct.Struct("<QQQQQQIIIIIIIIII")  # fuse_attr, 88 bytes
ENTRY_HEAD = struct.Struct("<QQQQII")  # nodeid, generation, entry/attr valid (s, ns)
ATTR_OUT_HEAD = struct.Struct("<QII")  # attr_valid, attr_valid_nsec, dummy
READ_IN = struct.Struct("<QQI")  # fh, offset, size (then read_flags, lock_owner, flags)
RELEASE_IN = struct.Struct("<QII")  # fh, flags, release_flags (then lock_owner)
GETXATTR_IN = struct.Struct("<II")  # size, padding
GETXATTR_OUT = struct.Struct("<II")  # size, padding
INIT_IN = struct.Struct("<IIII")  # major, minor, max_readahead, flags
INIT_IN_FLAGS2 = struct.Struct("<I")  # flags2, after INIT_IN (7.36: with INIT_EXT in flags)
INIT_OUT = struct.Struct("<IIIIHHIIHHII6I")  # fuse_init_out, 64 bytes (…, flags2, max_stack_depth)
OPEN_OUT = struct.Struct("<QIi")  # fh, open_flags, backing_id (7.40; padding before)
DIRENT_HEAD = struct.Struct("<QQII")  # ino, off, namelen, type
STATFS_OUT = struct.Struct("<QQQQQIIII6I")  # fuse_kstatfs, 80 bytes

HEADER_SIZE = IN_HEADER.size  # 40


@dataclass(frozen=True, slots=True)
class Attributes:
    """What the kernel is told about one inode (``struct fuse_attr``)."""

    ino: int
    mode: int
    size: int
    uid: int
    gid: int
    mtime_ns: int
    blksize: int = 4096

    def pack(self) -> bytes:
        seconds, nanos = divmod(self.mtime_ns, 10**9)
        return ATTR.pack(self.ino, self.size, (self.size + 511) // 512, seconds, seconds, seconds,
                         nanos, nanos, nanos, self.mode, 1, self.uid, self.gid, 0, self.blksize, 0)


def parse_header(request: bytes) -> tuple[int, int, int, int]:
    """``(length, opcode, unique, nodeid)`` of a request."""
    length, opcode, unique, nodeid = IN_HEADER.unpack_from(request)[:4]
    return length, opcode, unique, nodeid


def cstring(request: bytes, offset: int) -> bytes:
    """The NUL-terminated name starting at ``offset`` (a LOOKUP's or GETXATTR's name)."""
    end = request.find(b"\0", offset)
    return request[offset:] if end < 0 else request[offset:end]


# -- replies ---------------------------------------------------------------------------------------


def reply(unique: int, body: bytes = b"") -> bytes:
    """A successful reply carrying ``body``."""
    return OUT_HEADER.pack(OUT_HEADER.size + len(body), 0, unique) + body


def error(unique: int, code: int) -> bytes:
    """A failed reply: ``code`` is a positive errno."""
    if not 0 < code < 4096:
        code = errno.EIO
    return OUT_HEADER.pack(OUT_HEADER.size, -code, unique)


def entry_body(attributes: Attributes | None, timeout: int) -> bytes:
    """``fuse_entry_out``; ``None`` is a negative entry the kernel caches for ``timeout``."""
    if attributes is None:
        return ENTRY_HEAD.pack(0, 0, timeout, 0, 0, 0) + bytes(ATTR.size)
    return ENTRY_HEAD.pack(attributes.ino, 0, timeout, timeout, 0, 0) + attributes.pack()


def attr_body(attributes: Attributes, timeout: int) -> bytes:
    """``fuse_attr_out``."""
    return ATTR_OUT_HEAD.pack(timeout, 0, 0) + attributes.pack()


def xattr_body(value: bytes, asked: int) -> bytes | int:
    """The reply body to a GETXATTR/LISTXATTR of ``asked`` bytes, or ``ERANGE``.

    Asked for 0 bytes, the caller wants the size (``getxattr(2)`` with a zero buffer)."""
    if asked == 0:
        return GETXATTR_OUT.pack(len(value), 0)
    if len(value) > asked:
        return errno.ERANGE
    return value


def dirent(name: bytes, attributes: Attributes, cookie: int, timeout: int | None) -> bytes:
    """One ``fuse_dirent`` (``timeout`` None) or ``fuse_direntplus``, padded to 8 bytes."""
    head = DIRENT_HEAD.pack(attributes.ino, cookie, len(name), stat.S_IFMT(attributes.mode) >> 12)
    record = head + name + b"\0" * (-len(name) % 8)
    if timeout is None:
        return record
    return entry_body(attributes, timeout) + record


def statfs_body(blocks: int, files: int, block_size: int, name_max: int) -> bytes:
    """``fuse_statfs_out``: a full filesystem (nothing free: it is read-only)."""
    return STATFS_OUT.pack(blocks, 0, 0, files, 0, block_size, name_max, block_size, 0, *([0] * 6))


#: Notification codes (sent as the ``error`` of an OUT_HEADER with unique 0).
NOTIFY_INVAL_INODE = 2
INVAL_INODE = struct.Struct("<Qqq")  # ino, offset, length


def inval_inode(ino: int) -> bytes:
    """A notification telling the kernel to drop ``ino``'s cached pages and attributes."""
    body = INVAL_INODE.pack(ino, 0, 0)  # offset 0, length 0: the whole file
    return OUT_HEADER.pack(OUT_HEADER.size + len(body), NOTIFY_INVAL_INODE, 0) + body


def init_body(kernel_minor: int, kernel_flags: int, max_readahead: int,
              passthrough: bool = False) -> bytes:
    """``fuse_init_out`` answering the kernel's INIT; ``passthrough``: ask for
    ``FUSE_PASSTHROUGH`` (the caller checked that the kernel offers it: :func:`offers_passthrough`)."""
    minor = min(kernel_minor, KERNEL_MINOR)
    flags = WANTED_FLAGS & kernel_flags
    flags2 = depth = 0
    if passthrough:
        flags, flags2, depth = flags | INIT_EXT, PASSTHROUGH_FLAGS2, MAX_STACK_DEPTH
    return INIT_OUT.pack(KERNEL_MAJOR, minor, max_readahead, flags, 16, 12, MAX_WRITE, 1,
                         MAX_PAGES_WANTED, 0, flags2, depth, *([0] * 6))


def offers_passthrough(request: bytes) -> bool:
    """Whether the kernel's INIT ``request`` offers ``FUSE_PASSTHROUGH`` (in ``flags2``)."""
    flags = INIT_IN.unpack_from(request, HEADER_SIZE)[3]
    at = HEADER_SIZE + INIT_IN.size
    if not flags & INIT_EXT or len(request) < at + INIT_IN_FLAGS2.size:
        return False
    return bool(INIT_IN_FLAGS2.unpack_from(request, at)[0] & PASSTHROUGH_FLAGS2)


# -- opens (only with passthrough: otherwise OPEN is answered ENOSYS, quiverfs/fuse/worker.py) --
FOPEN_DIRECT_IO = 1 << 0
FOPEN_KEEP_CACHE = 1 << 1
FOPEN_PASSTHROUGH = 1 << 7


def open_body(open_flags: int, backing_id: int = 0, fh: int = 0) -> bytes:
    """``fuse_open_out``: ``open_flags``, the ``backing_id`` of a passthrough open, and the
    file handle its READs and RELEASE will carry (READs name the inode: 0 unless told)."""
    return OPEN_OUT.pack(fh, open_flags, backing_id)
