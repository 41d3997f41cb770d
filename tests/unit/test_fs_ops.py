"""The mount's request handling in process, without a kernel: raw FUSE requests go through a
worker (quiverfs/fuse/worker.py) and, when it forwards them, through the main process's
QuiverOperations (quiverfs/filesystem/fs.py); replies are decoded with the kernel's struct layouts.
Covered: tree, readdir paging, statfs, reads (hits inline, misses forwarded), counters, hit
reports, errno mapping, EROFS and the zero-message opens, xattrs and the control channel.
Store files are real files; the fetcher is a fake mountd."""

from __future__ import annotations

import calendar
import errno
import json
import os
import socket
import stat
import struct
import time
from dataclasses import dataclass
from pathlib import Path

import blake3
import pytest
import trio
import trio.testing

from digests.digest import Digest
from digests.errors import DigestError
from digests.write import NewFile, write_digest
from mountd.errors import CacheFull, MountdUnavailable, PermissionDenied
from mountd.store import layout
from quiverfs.base.errors import (
    AccessDenied,
    CorruptObject,
    FsError,
    NotFound,
    TemporaryFailure,
    errno_for,
)
from quiverfs.filesystem import fs, tree
from quiverfs.filesystem.fs import QuiverOperations
from quiverfs.filesystem.reads import SharedCounters
from quiverfs.filesystem.tree import Tree
from quiverfs.fuse.worker import Worker
from quiverfs.protocol import fuse_wire as w
from quiverfs.protocol import worker_messages

CONTENT = {
    "a.txt": b"alpha",
    "empty": b"",
    "sub/b.bin": bytes(range(256)) * 40,
    "sub/deeper/c.txt": b"charlie",
    "ü dir/ä file.txt": b"unicode",
}
MANY = 1000  # files in big/, plus 3 subdirectories
CREATED_AT = 1_700_000_000  # the digest's creation time: every inode's mtime
UID, GID = 1234, 5678
UNIQUE = 7

DT_DIR, DT_REG = 4, 8
ATTR_FIELDS = ("ino", "size", "blocks", "atime", "mtime", "ctime", "atimensec", "mtimensec",
               "ctimensec", "mode", "nlink", "uid", "gid", "rdev", "blksize", "flags")


def _all_content() -> dict[str, bytes]:
    files = dict(CONTENT)
    for i in range(MANY):
        files[f"big/f{i:04d}"] = f"{i}".encode()
    for d in ("d0", "d1", "d2"):
        files[f"big/{d}/x"] = d.encode()
    return files


def b3(data: bytes) -> bytes:
    return blake3.blake3(data).digest()


class FakeFetcher:
    """Plays mountd's ensure: writes the store file from ``content`` (or raises ``error``)."""

    def __init__(self, cache_dir: Path, content: dict[bytes, bytes]) -> None:
        self.cache_dir = cache_dir
        self.content = content
        self.calls: list[str] = []
        self.error: Exception | None = None
        #: ensure() calls whose file "mountd" evicts before the caller can open it.
        self.evict_before_open = 0
        #: when set, ensure() waits for it (to overlap requests)
        self.gate: trio.Event | None = None

    async def ensure(self, entry) -> str:
        self.calls.append(entry.path)
        if self.gate is not None:
            await self.gate.wait()
        if self.error is not None:
            raise self.error
        path = layout.store_path(self.cache_dir, entry.hash)
        if self.evict_before_open:
            self.evict_before_open -= 1
            path.unlink(missing_ok=True)
            return str(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(self.content[entry.hash])
        return str(path)


@dataclass
class Env:
    digest: Digest
    files: dict[str, bytes]
    fetcher: FakeFetcher
    counters: SharedCounters
    worker: Worker
    ops: QuiverOperations
    main_end: socket.socket  # the main process's end of the workers' socket
    cache: Path

    def ino(self, path: str) -> int:
        return self.digest.lookup_path(path).id

    def store_file(self, path: str) -> Path:
        return layout.store_path(self.cache, b3(self.files[path]))

    def put_in_store(self, path: str) -> None:
        store = self.store_file(path)
        store.parent.mkdir(parents=True, exist_ok=True)
        store.write_bytes(self.files[path])

    def forwarded(self) -> list[bytes]:
        """Every message the worker sent to the main process since the last call."""
        out = []
        while True:
            try:
                out.append(self.main_end.recv(w.REQUEST_BUFFER + 64, socket.MSG_DONTWAIT))
            except BlockingIOError:
                return out


@pytest.fixture
def env(tmp_path: Path):
    files = _all_content()
    yield from _env(tmp_path, files, [NewFile(p, len(d), b3(d)) for p, d in files.items()])


def _env(tmp_path: Path, files: dict[str, bytes], rows: list[NewFile]):
    out = tmp_path / "d.qd"
    write_digest(out, rows, ["file:///nowhere"], created_at=CREATED_AT)
    digest = Digest.open(out)
    cache = tmp_path / "cache"
    fetcher = FakeFetcher(cache, {b3(d): d for d in files.values()})
    counters = SharedCounters(2, digest.dir_count + digest.file_count + 1)
    main_end, worker_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    worker = Worker(-1, Tree(digest, cache, uid=UID, gid=GID), worker_end, counters.slot(1),
                    marks=counters.misses_past_start(), report_opens=counters.report_opens())
    ops = QuiverOperations(digest, cache, fetcher, counters, uid=UID, gid=GID)
    yield Env(digest, files, fetcher, counters, worker, ops, main_end, cache)
    ops.close()
    worker.reads.close()
    main_end.close()
    worker_end.close()
    digest.close()


# -- building requests, decoding replies ------------------------------------------------------


def request(opcode: int, nodeid: int, body: bytes = b"", unique: int = UNIQUE) -> bytes:
    """A raw request as the kernel writes it: fuse_in_header, then ``body``."""
    return w.IN_HEADER.pack(w.HEADER_SIZE + len(body), opcode, unique, nodeid, 1000, 1000, 4242,
                            0, 0) + body


def read_in(offset: int, size: int, fh: int = 0) -> bytes:
    """fuse_read_in (40 bytes): fh, offset, size, read_flags, lock_owner, flags, padding."""
    body = struct.pack("<QQIIQII", fh, offset, size, 0, 0, os.O_RDONLY, 0)
    assert len(body) == 40
    return body


def read_request(nodeid: int, offset: int, size: int, unique: int = UNIQUE) -> bytes:
    return request(w.READ, nodeid, read_in(offset, size), unique)


def lookup_request(parent: int, name: bytes) -> bytes:
    return request(w.LOOKUP, parent, name + b"\0")


def getxattr_request(nodeid: int, name: bytes, size: int = 65536) -> bytes:
    return request(w.GETXATTR, nodeid, w.GETXATTR_IN.pack(size, 0) + name + b"\0")


def listxattr_request(nodeid: int, size: int = 65536) -> bytes:
    return request(w.LISTXATTR, nodeid, w.GETXATTR_IN.pack(size, 0))


def split_reply(out: bytes | list[bytes] | None, unique: int = UNIQUE) -> tuple[int, bytes]:
    """``(errno, body)`` of a reply (errno 0: success), checking its header."""
    assert out is not None, "expected a reply"
    data = b"".join(out) if isinstance(out, list) else out
    length, error, got_unique = w.OUT_HEADER.unpack_from(data)
    assert length == len(data) and got_unique == unique
    assert error <= 0
    if error:
        assert length == w.OUT_HEADER.size  # a failed reply carries no body
    return -error, data[w.OUT_HEADER.size:]


def ok_body(out, unique: int = UNIQUE) -> bytes:
    code, body = split_reply(out, unique)
    assert code == 0, f"failed with {errno.errorcode.get(code, code)}"
    return body


def errno_of(out, unique: int = UNIQUE) -> int:
    code, _ = split_reply(out, unique)
    return code


def attr(data: bytes, offset: int = 0) -> dict[str, int]:
    return dict(zip(ATTR_FIELDS, w.ATTR.unpack_from(data, offset), strict=True))


def entry_out(body: bytes) -> tuple[dict[str, int], dict[str, int]]:
    """fuse_entry_out → (head, attr)."""
    assert len(body) == w.ENTRY_HEAD.size + w.ATTR.size == 128
    nodeid, generation, entry_valid, attr_valid, entry_nsec, attr_nsec = w.ENTRY_HEAD.unpack_from(body)
    head = {"nodeid": nodeid, "generation": generation, "entry_valid": entry_valid,
            "attr_valid": attr_valid, "entry_valid_nsec": entry_nsec, "attr_valid_nsec": attr_nsec}
    return head, attr(body, w.ENTRY_HEAD.size)


def attr_out(body: bytes) -> tuple[int, dict[str, int]]:
    """fuse_attr_out → (attr_valid, attr)."""
    assert len(body) == w.ATTR_OUT_HEAD.size + w.ATTR.size == 104
    valid, _nsec, _dummy = w.ATTR_OUT_HEAD.unpack_from(body)
    return valid, attr(body, w.ATTR_OUT_HEAD.size)


@dataclass
class Dirent:
    name: bytes
    ino: int
    cookie: int
    type: int
    entry: tuple[dict[str, int], dict[str, int]] | None  # readdirplus only


def dirents(body: bytes, plus: bool) -> list[Dirent]:
    out, pos = [], 0
    while pos < len(body):
        entry = None
        if plus:
            entry = entry_out(body[pos:pos + 128])
            pos += 128
        ino, cookie, namelen, kind = w.DIRENT_HEAD.unpack_from(body, pos)
        pos += w.DIRENT_HEAD.size
        name = body[pos:pos + namelen]
        padded = (namelen + 7) // 8 * 8
        assert body[pos + namelen:pos + padded] == bytes(padded - namelen)
        pos += padded
        out.append(Dirent(name, ino, cookie, kind, entry))
    assert pos == len(body)
    return out


def handle(env: Env, req: bytes):
    return env.worker.handle(req)


def lookup(env: Env, parent: int, name: bytes) -> tuple[dict[str, int], dict[str, int]]:
    return entry_out(ok_body(handle(env, lookup_request(parent, name))))


def getattr_(env: Env, inode: int) -> tuple[int, dict[str, int]]:
    return attr_out(ok_body(handle(env, request(w.GETATTR, inode, bytes(16)))))


def readdir(env: Env, inode: int, cookie: int, size: int, plus: bool) -> bytes | list[bytes] | None:
    return handle(env, request(w.READDIRPLUS if plus else w.READDIR, inode, read_in(cookie, size)))


def list_all(env: Env, inode: int, size: int, plus: bool) -> list[Dirent]:
    """Every entry, as the kernel lists a directory: READDIR from the last cookie until empty."""
    out: list[Dirent] = []
    cookie = 0
    while True:
        page = dirents(ok_body(readdir(env, inode, cookie, size, plus)), plus)
        if not page:
            return out
        assert sum(len(d.name) for d in page) > 0
        out.extend(page)
        cookie = page[-1].cookie


def split_dots(listed: list[Dirent]) -> tuple[list[Dirent], list[Dirent]]:
    """``(the . and .. entries, the rest)``: every listing starts with the two."""
    assert [d.name for d in listed[:2]] == [b".", b".."]
    return listed[:2], listed[2:]


async def miss(env: Env, req: bytes):
    """A READ the worker cannot serve: it must be forwarded as is; the main process's reply."""
    assert handle(env, req) is None
    assert env.forwarded() == [worker_messages.FORWARD + req]
    return await env.ops.answer(req)


async def xattr(env: Env, req: bytes):
    """An xattr request: always forwarded by the worker, answered by the main process."""
    assert handle(env, req) is None
    assert env.forwarded() == [worker_messages.FORWARD + req]
    return await env.ops.answer(req)


def totals(env: Env) -> dict[str, int]:
    return env.counters.totals()


# -- tree -------------------------------------------------------------------------------------


def test_lookup_and_getattr(env: Env) -> None:
    valid, root = getattr_(env, tree.ROOT_INODE)
    assert valid == tree.TIMEOUT >= 3600
    assert root["ino"] == 1 and root["mode"] == stat.S_IFDIR | 0o555 and root["size"] == 0
    head, sub = lookup(env, tree.ROOT_INODE, b"sub")
    assert head["nodeid"] == sub["ino"] == env.ino("sub") and stat.S_ISDIR(sub["mode"])
    assert head["generation"] == 0
    head, b = lookup(env, sub["ino"], b"b.bin")
    size = len(env.files["sub/b.bin"])
    assert head["nodeid"] == b["ino"] == env.ino("sub/b.bin")
    assert head["entry_valid"] == head["attr_valid"] == tree.TIMEOUT
    assert b["mode"] == stat.S_IFREG | 0o444 and b["size"] == size
    assert b["blocks"] == -(-size // 512) and b["nlink"] == 1
    assert b["blksize"] == 16384  # 10,240 bytes: the next power of two (tree.io_block)
    assert (b["uid"], b["gid"]) == (UID, GID)
    assert b["mtime"] == b["atime"] == b["ctime"] == CREATED_AT and b["mtimensec"] == 0
    _, uni = lookup(env, env.ino("ü dir"), "ä file.txt".encode())
    assert uni["size"] == len("unicode") and uni["ino"] == env.ino("ü dir/ä file.txt")
    valid, again = getattr_(env, b["ino"])
    assert valid == tree.TIMEOUT and again == b
    _, empty = lookup(env, tree.ROOT_INODE, b"empty")
    assert empty["size"] == 0 and empty["blocks"] == 0 and empty["mode"] == stat.S_IFREG | 0o444


def test_the_owner_defaults_to_the_mounting_user(env: Env) -> None:
    mine = Tree(env.digest, env.cache)
    attributes = mine.attributes(mine.entry(env.ino("a.txt")))
    assert (attributes.uid, attributes.gid) == (os.getuid(), os.getgid())


def test_mtime_does_not_depend_on_the_local_timezone(env: Env, monkeypatch) -> None:
    monkeypatch.setenv("TZ", "CET-1CEST,M3.5.0,M10.5.0/3")  # Berlin, no tzdata needed
    time.tzset()
    try:
        summer = env.cache.parent / "summer.qd"
        stamp = calendar.timegm((2024, 7, 1, 12, 0, 0))
        write_digest(summer, [NewFile("x", 1, b3(b"x"))], ["file:///nowhere"], created_at=stamp)
        with Digest.open(summer) as digest:
            assert Tree(digest, env.cache).mtime_ns == stamp * 10**9
    finally:
        monkeypatch.undo()
        time.tzset()


def test_dot_and_dotdot(env: Env) -> None:
    deeper = env.ino("sub/deeper")
    assert lookup(env, deeper, b".")[0]["nodeid"] == deeper
    assert lookup(env, deeper, b"..")[0]["nodeid"] == env.ino("sub")
    assert lookup(env, env.ino("sub"), b"..")[0]["nodeid"] == tree.ROOT_INODE
    head, root = lookup(env, tree.ROOT_INODE, b"..")
    assert head["nodeid"] == root["ino"] == tree.ROOT_INODE


def test_unknown_names_are_cached_negative_entries(env: Env) -> None:
    for name in (b"nope", b"\xff\xfe not utf-8", b"x" * 300, b"x" * (tree.NAME_MAX + 1)):
        head, attributes = lookup(env, tree.ROOT_INODE, name)
        # ENOENT the kernel caches: nodeid 0 with an entry timeout, no attributes
        assert head["nodeid"] == 0 and head["entry_valid"] == tree.TIMEOUT >= 3600
        assert head["attr_valid"] == 0 and set(attributes.values()) == {0}
    assert lookup(env, env.ino("sub"), b"a.txt")[0]["nodeid"] == 0  # a name from another dir
    assert errno_of(handle(env, request(w.GETATTR, 10**9, bytes(16)))) == errno.ENOENT
    assert errno_of(handle(env, lookup_request(10**9, b".."))) == errno.ENOENT
    assert env.forwarded() == []


def test_digest_failures_are_eio(env: Env, monkeypatch) -> None:
    def broken(*args):
        raise DigestError("disk on fire")

    monkeypatch.setattr(env.digest, "lookup", broken)
    monkeypatch.setattr(env.digest, "listdir", broken)
    assert errno_of(handle(env, lookup_request(tree.ROOT_INODE, b"a.txt"))) == errno.EIO
    assert errno_of(readdir(env, tree.ROOT_INODE, 0, 4096, plus=True)) == errno.EIO
    assert totals(env)["errors"] == 0  # an errno the tree chose, not a bug


def test_unexpected_exceptions_are_eio_and_counted(env: Env, monkeypatch) -> None:
    def bug():
        raise RuntimeError("a bug")

    monkeypatch.setattr(env.worker.tree, "statfs", bug)
    assert errno_of(handle(env, request(w.STATFS, tree.ROOT_INODE))) == errno.EIO
    assert totals(env)["errors"] == 1


def test_readdirplus_pages_with_cookies(env: Env, monkeypatch) -> None:
    calls = []
    real = env.digest.listdir

    def counting(dir_id, after=None, limit=1024):
        calls.append((after, limit))
        return real(dir_id, after, limit)

    monkeypatch.setattr(env.digest, "listdir", counting)
    big = env.ino("big")
    room = 7 * (128 + 24 + 8)  # seven entries with names of up to 8 bytes
    dots, listed = split_dots(list_all(env, big, room, plus=True))
    assert [(d.name, d.ino, d.type) for d in dots] == [(b".", big, DT_DIR), (b"..", tree.ROOT_INODE, DT_DIR)]
    assert [d.cookie for d in dots] == [tree.DOT_COOKIE, tree.DOTDOT_COOKIE]
    names = [d.name.decode() for d in listed]
    assert names == ["d0", "d1", "d2"] + [f"f{i:04d}" for i in range(MANY)]
    assert len(set(names)) == len(names)
    # an entry's cookie is its id, shifted past the cookies of . and ..
    assert all(d.cookie == d.ino + tree.COOKIE_SHIFT for d in listed)
    assert [d.ino for d in listed] == [env.ino(f"big/{n}") for n in names]
    assert [d.type for d in listed[:4]] == [DT_DIR, DT_DIR, DT_DIR, DT_REG]
    for d in (listed[0], listed[3], listed[-1]):
        head, attributes = d.entry
        assert head["nodeid"] == attributes["ino"] == d.ino
        assert head["entry_valid"] == head["attr_valid"] == tree.TIMEOUT
        assert (attributes["uid"], attributes["gid"]) == (UID, GID)
    assert listed[0].entry[1]["mode"] == stat.S_IFDIR | 0o555
    assert listed[-1].entry[1]["mode"] == stat.S_IFREG | 0o444
    assert listed[-1].entry[1]["size"] == len(str(MANY - 1))
    # Leftovers of a page serve the next READDIRs: about one digest query per page.
    assert len(calls) <= (MANY + 3) // tree.READDIR_PAGE + 3
    assert all(limit == tree.READDIR_PAGE for _, limit in calls)


def test_readdir_without_attributes(env: Env) -> None:
    dots, listed = split_dots(list_all(env, tree.ROOT_INODE, 4096, plus=False))
    # The root is its own parent.
    assert [(d.name, d.ino, d.type) for d in dots] == [(b".", 1, DT_DIR), (b"..", 1, DT_DIR)]
    assert [(d.name, d.type) for d in listed] == [
        (b"big", DT_DIR), (b"sub", DT_DIR), ("ü dir".encode(), DT_DIR),
        (b"a.txt", DT_REG), (b"empty", DT_REG)]
    assert all(d.entry is None and d.cookie == d.ino + tree.COOKIE_SHIFT for d in listed)
    assert [d.ino for d in listed] == [env.ino(d.name.decode()) for d in listed]
    _, big = split_dots(list_all(env, env.ino("big"), 4096, plus=False))
    assert len(big) == MANY + 3 and len({d.ino for d in big}) == MANY + 3
    deeper = list_all(env, env.ino("sub/deeper"), 4096, plus=True)
    assert [(d.name, d.ino) for d in deeper] == [
        (b".", env.ino("sub/deeper")), (b"..", env.ino("sub")), (b"c.txt", env.ino("sub/deeper/c.txt"))]


def test_dots_fit_alone_and_resume_by_their_cookies(env: Env) -> None:
    sub = env.ino("sub")
    one_plain = 24 + 8  # a plain entry with a name of up to 8 bytes
    first = dirents(ok_body(readdir(env, sub, 0, one_plain, plus=False)), plus=False)
    assert [(d.name, d.cookie) for d in first] == [(b".", tree.DOT_COOKIE)]
    second = dirents(ok_body(readdir(env, sub, tree.DOT_COOKIE, one_plain, plus=False)), False)
    assert [(d.name, d.ino, d.cookie) for d in second] == [(b"..", 1, tree.DOTDOT_COOKIE)]
    rest = dirents(ok_body(readdir(env, sub, tree.DOTDOT_COOKIE, 4096, plus=True)), plus=True)
    assert [d.name for d in rest] == [b"deeper", b"b.bin"]
    # A buffer too small for even one entry gets nothing (not an error), as before.
    assert ok_body(readdir(env, sub, 0, 8, plus=False)) == b""
    # Cookie 3 would be the root's (id 1): never a child, so never a cookie we gave.
    assert errno_of(readdir(env, sub, 1 + tree.COOKIE_SHIFT, 4096, plus=False)) == errno.EINVAL


def test_readdir_resumes_from_any_cookie(env: Env) -> None:
    big = env.ino("big")
    everything = dirents(ok_body(readdir(env, big, 0, 10**6, plus=False)), plus=False)
    assert len(everything) == 2 + MANY + 3
    room = 5 * (24 + 8)  # five plain entries named fNNNN
    for at in (500, 3, 0, 1, 2, 999):
        page = dirents(ok_body(readdir(env, big, everything[at].cookie, room, plus=False)), False)
        assert page == everything[at + 1:at + 6]
    # The same cookie again, now with attributes.
    page = dirents(ok_body(readdir(env, big, everything[500].cookie, 5 * 160, plus=True)), True)
    assert [d.name for d in page] == [d.name for d in everything[501:506]]
    assert ok_body(readdir(env, big, everything[-1].cookie, room, plus=False)) == b""
    # A cookie this directory never gave (an entry of another one), a file, no such inode.
    assert errno_of(readdir(env, big, env.ino("a.txt") + tree.COOKIE_SHIFT, room, plus=False)) == errno.EINVAL
    assert errno_of(readdir(env, big, env.ino("sub") + tree.COOKIE_SHIFT, room, plus=True)) == errno.EINVAL
    assert errno_of(readdir(env, env.ino("a.txt"), 0, 4096, plus=False)) == errno.ENOTDIR
    assert errno_of(readdir(env, env.ino("a.txt"), 0, 4096, plus=True)) == errno.ENOTDIR
    assert errno_of(readdir(env, 10**9, 0, 4096, plus=True)) == errno.ENOENT


def test_statfs(env: Env) -> None:
    body = ok_body(handle(env, request(w.STATFS, tree.ROOT_INODE)))
    assert len(body) == w.STATFS_OUT.size == 80
    blocks, bfree, bavail, files, ffree, bsize, namelen, frsize, _pad, *spare = w.STATFS_OUT.unpack(body)
    assert bsize == frsize == 4096
    assert blocks == -(-sum(map(len, env.files.values())) // 4096)
    assert files == env.digest.file_count + env.digest.dir_count == len(env.files) + 8  # root, big, d0-d2, sub, deeper, ü dir
    assert (bfree, bavail, ffree) == (0, 0, 0) and namelen == 255 and spare == [0] * 6


# -- reads ------------------------------------------------------------------------------------


def test_hits_are_answered_inline(env: Env) -> None:
    data = env.files["sub/b.bin"]
    env.put_in_store("sub/b.bin")
    ino = env.ino("sub/b.bin")
    out = handle(env, read_request(ino, 0, 1 << 20))
    assert isinstance(out, list)  # header and data, for one writev
    assert ok_body(out) == data
    assert ok_body(handle(env, read_request(ino, 100, 10, unique=8)), unique=8) == data[100:110]
    assert ok_body(handle(env, read_request(ino, len(data) - 3, 4096))) == data[-3:]
    assert ok_body(handle(env, read_request(ino, len(data) + 10, 4096))) == b""
    assert totals(env) == {"opens": 1, "reads": 4, "hits": 1, "misses": 0,
                           "bytes": len(data) + 10 + 3, "errors": 0}
    assert env.forwarded() == [] and env.fetcher.calls == []
    # Hit reports: batched, sent to the main process on flush (u64 bytes, then hash + inode).
    env.worker.flush()
    (message,) = env.forwarded()
    assert message == worker_messages.HITS + struct.pack("<Q", len(data)) + b3(data) + struct.pack("<Q", ino)
    env.worker.flush()
    assert env.forwarded() == []  # nothing pending: nothing sent
    env.ops.add_hits(message[1:])
    assert env.ops.take_hits() == ([b3(data)], len(data))
    assert env.ops.take_hits() == ([], 0)


def test_hit_reports_of_several_files(env: Env) -> None:
    for path in ("a.txt", "sub/b.bin", "sub/deeper/c.txt"):
        env.put_in_store(path)
        assert ok_body(handle(env, read_request(env.ino(path), 0, 4096))) == env.files[path][:4096]
    assert ok_body(handle(env, read_request(env.ino("sub/b.bin"), 4096, 4096))) == env.files["sub/b.bin"][4096:8192]
    env.worker.flush()
    (message,) = env.forwarded()
    env.ops.add_hits(message[1:])
    hashes, nbytes = env.ops.take_hits()
    assert hashes == [b3(env.files[p]) for p in ("a.txt", "sub/b.bin", "sub/deeper/c.txt")]
    assert nbytes == 5 + 10240 + 7
    assert totals(env)["opens"] == totals(env)["hits"] == 3 and totals(env)["reads"] == 4


def test_a_kept_descriptor_serves_a_file_evicted_from_the_store(env: Env) -> None:
    data = env.files["sub/b.bin"]
    env.put_in_store("sub/b.bin")
    ino = env.ino("sub/b.bin")
    assert ok_body(handle(env, read_request(ino, 0, 4096))) == data[:4096]
    env.store_file("sub/b.bin").unlink()
    assert ok_body(handle(env, read_request(ino, 4096, 4096))) == data[4096:8192]
    assert env.forwarded() == []
    # A new read of the file (offset 0) looks in the store again: evicted, so a miss.
    again = read_request(ino, 0, 4096)
    assert handle(env, again) is None
    assert env.forwarded() == [worker_messages.FORWARD + again]


async def test_evicted_files_are_remembered_for_the_kernel(env: Env) -> None:
    """Files read from the mount are remembered by hash, so mountd's evictions can be
    turned into the inodes whose pages the kernel must drop (mountd/store/evictions.py)."""
    env.put_in_store("a.txt")
    assert ok_body(handle(env, read_request(env.ino("a.txt"), 0, 4096))) == b"alpha"
    env.worker.flush()
    (message,) = env.forwarded()
    env.ops.add_hits(message[1:])
    miss = read_request(env.ino("sub/b.bin"), 0, 1 << 20)
    assert ok_body(await env.ops.answer(miss)) == env.files["sub/b.bin"]  # a miss, in the main process
    hashes = [b3(env.files[p]) for p in ("a.txt", "sub/b.bin", "sub/deeper/c.txt")]
    assert sorted(env.ops.evicted(hashes)) == sorted([env.ino("a.txt"), env.ino("sub/b.bin")])
    assert env.ops.evicted(hashes) == []  # told once


# -- kept store files and sizes (quiverfs/filesystem/reads.py) ------------------------------------

X = bytes(range(250)) * 12  # 3,000 bytes
Y = os.urandom(300 * 1024)
PARTS = {f"p{i}": bytes([i]) * 10_000 for i in range(5)}


@pytest.fixture
def sized(tmp_path: Path):
    """A digest with two rows whose size is not their content's (an outside check's case:
    2^40 bytes naming a 3,000-byte content, 100 bytes naming a 300 KB one), their correct
    twins, and five 10,000-byte files."""
    files = {"x": X, "y": Y, **PARTS}
    rows = [NewFile(p, len(d), b3(d)) for p, d in files.items()]
    rows += [NewFile("huge", 1 << 40, b3(X)), NewFile("short", 100, b3(Y))]
    yield from _env(tmp_path, files, rows)


def _kept(env: Env) -> list[int]:
    return list(env.worker.reads.kept_files())


def test_kept_files_are_bounded_by_count_and_by_bytes(sized: Env) -> None:
    reads = sized.worker.reads
    paths = list(PARTS)
    for path in paths:
        sized.put_in_store(path)
    reads.max_files, reads.max_bytes = 3, 1 << 30
    for path in paths:
        assert ok_body(handle(sized, read_request(sized.ino(path), 0, 100))) == PARTS[path][:100]
    assert _kept(sized) == [sized.ino(p) for p in paths[2:]]
    reads.close()
    reads.max_files, reads.max_bytes = 64, 25_000  # two 10,000-byte files, not three
    for path in paths:
        assert ok_body(handle(sized, read_request(sized.ino(path), 0, 100))) == PARTS[path][:100]
    assert _kept(sized) == [sized.ino(p) for p in paths[3:]]
    reads.max_bytes = 5_000  # smaller than one file: read, then closed (nothing is kept)
    assert ok_body(handle(sized, read_request(sized.ino("p0"), 0, 100))) == PARTS["p0"][:100]
    assert _kept(sized) == []
    assert ok_body(handle(sized, read_request(sized.ino("p0"), 100, 100))) == PARTS["p0"][100:200]
    assert _kept(sized) == []
    c = totals(sized)
    assert (c["opens"], c["hits"], c["reads"], c["errors"]) == (11, 11, 12, 0)


def test_a_file_read_to_its_end_is_closed(sized: Env) -> None:
    sized.put_in_store("p1")
    ino = sized.ino("p1")
    assert ok_body(handle(sized, read_request(ino, 0, 4096))) == PARTS["p1"][:4096]
    assert _kept(sized) == [ino]
    assert ok_body(handle(sized, read_request(ino, 8192, 4096))) == PARTS["p1"][8192:]
    assert _kept(sized) == []
    # A READ in the middle afterwards (pages the kernel dropped) reopens it, uncounted.
    assert ok_body(handle(sized, read_request(ino, 4096, 4096))) == PARTS["p1"][4096:8192]
    c = totals(sized)
    assert (c["opens"], c["reads"], c["bytes"]) == (1, 3, 4096 + (10_000 - 8192) + 4096)


def test_the_timer_closes_kept_files_that_left_the_store(sized: Env) -> None:
    for path in ("p0", "p1", "p2"):
        sized.put_in_store(path)
        assert ok_body(handle(sized, read_request(sized.ino(path), 0, 100))) == PARTS[path][:100]
    fds = sized.worker.reads.kept_files()
    sized.store_file("p1").unlink()  # mountd evicted it
    sized.worker.tick()
    assert _kept(sized) == [sized.ino("p0"), sized.ino("p2")]
    with pytest.raises(OSError):
        os.fstat(fds[sized.ino("p1")])  # closed: its blocks are free
    # The rest of the evicted file is a miss again; the others are still served from the store.
    later = read_request(sized.ino("p1"), 100, 100)
    assert handle(sized, later) is None and sized.forwarded()[-1] == worker_messages.FORWARD + later
    assert ok_body(handle(sized, read_request(sized.ino("p2"), 100, 100))) == PARTS["p2"][100:200]


async def test_the_main_process_closes_what_the_eviction_journal_names(sized: Env) -> None:
    ino = sized.ino("p3")
    assert ok_body(await miss(sized, read_request(ino, 0, 100))) == PARTS["p3"][:100]
    assert list(sized.ops.reads.kept_files()) == [ino]
    # Still in the store (a journal can run ahead of what this process sees): closed by hash.
    assert sized.ops.evicted([b3(PARTS["p3"])]) == [ino]
    assert sized.ops.reads.kept_files() == {}
    # Gone from the store without the journal saying so: closed by the sweep.
    assert ok_body(await miss(sized, read_request(sized.ino("p4"), 0, 100))) == PARTS["p4"][:100]
    sized.store_file("p4").unlink()
    assert sized.ops.evicted([]) == []
    assert sized.ops.reads.kept_files() == {}


async def test_a_row_whose_size_is_not_its_contents_fails_warm_as_cold(
        sized: Env, mock_clock, caplog: pytest.LogCaptureFixture) -> None:
    """Outside check 1: a hit checks the store file's size; a mismatch is EIO with one log
    line, answered again (without a line) for the kernel's retry, as a failed fetch is."""
    sized.put_in_store("x")
    huge = sized.ino("huge")
    assert getattr_(sized, huge)[1]["size"] == 1 << 40  # stat says what the digest says
    with caplog.at_level("WARNING"):
        assert errno_of(await miss(sized, read_request(huge, 0, 4096))) == errno.EIO
        assert errno_of(await miss(sized, read_request(huge, 0, 4096))) == errno.EIO  # the retry
        assert errno_of(await miss(sized, read_request(huge, 4096, 4096))) == errno.EIO
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "huge" in lines[0] and "3000" in lines[0], lines
    assert sized.fetcher.calls == []  # a warm cache: mountd is not asked
    # The correct row of the same content reads as ever, inline.
    assert ok_body(handle(sized, read_request(sized.ino("x"), 0, 1 << 20))) == X
    # Cold: the content is fetched, and the store file mountd names is checked as well.
    caplog.clear()
    short = sized.ino("short")
    with caplog.at_level("WARNING"):
        assert errno_of(await miss(sized, read_request(short, 0, 4096))) == errno.EIO
        assert errno_of(await miss(sized, read_request(short, 0, 4096))) == errno.EIO
    assert sized.fetcher.calls == ["short"]
    assert len(caplog.records) == 1 and "short" in caplog.records[0].getMessage()
    # Warm now (the content is in the store): after the failure is forgotten, the same answer.
    mock_clock.jump(fs.FAILURE_MEMORY + 0.1)
    assert errno_of(await miss(sized, read_request(short, 0, 4096))) == errno.EIO
    assert sized.fetcher.calls == ["short"]
    c = totals(sized)
    assert (c["errors"], c["reads"], c["bytes"], c["opens"], c["hits"]) == (3, 1, len(X), 1, 1)
    assert sized.worker.reads.kept_files() == {} and sized.ops.reads.kept_files() == {}


async def test_miss_then_hit(env: Env) -> None:
    data = env.files["sub/b.bin"]
    ino = env.ino("sub/b.bin")
    assert ok_body(await miss(env, read_request(ino, 0, 1 << 20))) == data
    assert env.fetcher.calls == ["sub/b.bin"]
    assert env.store_file("sub/b.bin").read_bytes() == data
    # Now in the store: the worker answers, no fetch.
    assert ok_body(handle(env, read_request(ino, 100, 10))) == data[100:110]
    assert ok_body(handle(env, read_request(ino, 0, 5))) == data[:5]
    assert env.fetcher.calls == ["sub/b.bin"] and env.forwarded() == []
    assert totals(env) == {"opens": 2, "reads": 3, "hits": 1, "misses": 1,
                           "bytes": len(data) + 10 + 5, "errors": 0}
    env.worker.flush()
    (message,) = env.forwarded()
    env.ops.add_hits(message[1:])
    assert env.ops.take_hits() == ([b3(data)], len(data))  # the miss is not a hit
    assert env.ops.take_hits() == ([], 0)


async def test_forwarded_reads_at_offsets(env: Env) -> None:
    data = env.files["sub/b.bin"]
    ino = env.ino("sub/b.bin")
    req = read_request(ino, 4000, 300, unique=99)
    out = await miss(env, req)
    assert isinstance(out, list) and ok_body(out, unique=99) == data[4000:4300]
    # The main process keeps the file open for the READs that follow.
    assert ok_body(await env.ops.answer(read_request(ino, len(data) - 1, 10))) == data[-1:]
    assert await env.ops.read(ino, 0, 3) == data[:3]
    assert env.fetcher.calls == ["sub/b.bin"]
    c = totals(env)
    assert (c["opens"], c["misses"], c["reads"], c["bytes"]) == (1, 1, 3, 300 + 1 + 3)


async def reads_at_once(env: Env, ino: int, offsets: tuple[int, ...], one_by_one: bool = False) -> dict[int, bytes]:
    """READs of 4 KiB of ``ino`` at ``offsets``, forwarded together while the fetch they
    wait for is held (``one_by_one``: each blocked before the next is sent); offset → body."""
    env.fetcher.gate = trio.Event()
    replies: dict[int, bytes] = {}

    async def ask(offset: int) -> None:
        replies[offset] = ok_body(await env.ops.answer(read_request(ino, offset, 4096)))

    async with trio.open_nursery() as nursery:
        for offset in offsets:
            nursery.start_soon(ask, offset)
            if one_by_one:
                await trio.testing.wait_all_tasks_blocked()
        await trio.testing.wait_all_tasks_blocked()
        env.fetcher.gate.set()
    return replies


async def test_a_miss_past_offset_0_counts_once_whoever_takes_its_read_at_offset_0(env: Env) -> None:
    """The kernel reads a large file with READs at several offsets at once. When the one past
    offset 0 reaches the main process first and fetches the file, the READ at offset 0 may
    reach a worker after the fetch landed: the file is a miss, counted once, and no hit is
    reported to mountd (this counted a hit and failed a mount test now and then)."""
    data = env.files["sub/b.bin"]
    ino = env.ino("sub/b.bin")
    assert ok_body(await miss(env, read_request(ino, 4096, 4096))) == data[4096:8192]
    assert env.fetcher.calls == ["sub/b.bin"]
    c = totals(env)
    assert (c["opens"], c["hits"], c["misses"]) == (1, 0, 1)
    assert ok_body(handle(env, read_request(ino, 0, 4096))) == data[:4096]  # the worker's
    c = totals(env)
    assert (c["opens"], c["hits"], c["misses"], c["reads"]) == (1, 0, 1, 2)
    env.worker.flush()
    assert env.forwarded() == []  # no hit to report
    # The next read of the file (the kernel dropped its pages) is a hit, as any.
    assert ok_body(handle(env, read_request(ino, 0, 4096))) == data[:4096]
    c = totals(env)
    assert (c["opens"], c["hits"], c["misses"]) == (2, 1, 1)
    assert env.fetcher.calls == ["sub/b.bin"]


async def test_a_miss_past_offset_0_counts_once_when_its_read_at_offset_0_waits_for_it(env: Env) -> None:
    """The same race with both READs forwarded: the one at offset 0 waits for the fetch the
    other started (and a later READ past offset 0 of the same read leaves nothing behind)."""
    data = env.files["sub/b.bin"]
    ino = env.ino("sub/b.bin")
    replies = await reads_at_once(env, ino, (4096, 0, 8192), one_by_one=True)
    assert replies == {o: data[o:o + 4096] for o in (0, 4096, 8192)}
    c = totals(env)
    assert (c["opens"], c["hits"], c["misses"]) == (1, 0, 1)
    assert env.ops.take_hits() == ([], 0)
    assert ok_body(handle(env, read_request(ino, 0, 4096))) == data[:4096]
    c = totals(env)
    assert (c["opens"], c["hits"], c["misses"]) == (2, 1, 1)


async def test_a_file_fetched_meanwhile_is_a_hit(env: Env) -> None:
    ino = env.ino("a.txt")
    req = read_request(ino, 0, 4096)
    assert handle(env, req) is None  # forwarded: not in the store yet
    env.put_in_store("a.txt")  # another request fetched it before the main process got to it
    assert ok_body(await env.ops.answer(req)) == b"alpha"
    assert env.fetcher.calls == []
    c = totals(env)
    assert (c["opens"], c["hits"], c["misses"]) == (1, 1, 0)
    # A hit in the main process is reported to mountd as a worker's is (the pyfuse3 front
    # end's hits all come this way).
    assert env.ops.take_hits() == ([b3(b"alpha")], len(b"alpha"))
    assert ok_body(await env.ops.answer(read_request(ino, 4096, 4096))) == b""
    assert env.ops.take_hits() == ([], 0)  # a later READ of the same read of the file is not


async def test_concurrent_misses_of_one_file_share_one_fetch(env: Env) -> None:
    data = env.files["sub/b.bin"]
    ino = env.ino("sub/b.bin")
    replies = await reads_at_once(env, ino, (0, 4096, 8192))
    assert replies == {o: data[o:o + 4096] for o in (0, 4096, 8192)}
    assert env.fetcher.calls == ["sub/b.bin"]
    c = totals(env)
    assert (c["opens"], c["misses"], c["reads"], c["errors"]) == (1, 1, 3, 0)


async def test_a_miss_evicted_before_open_is_asked_for_again(env: Env) -> None:
    env.fetcher.evict_before_open = 2
    out = await miss(env, read_request(env.ino("sub/b.bin"), 0, 1 << 20))
    assert env.fetcher.calls == ["sub/b.bin"] * 3
    assert ok_body(out) == env.files["sub/b.bin"]
    assert totals(env)["errors"] == 0 and totals(env)["misses"] == 1


async def test_a_miss_evicted_every_time_fails_with_eio(env: Env) -> None:
    env.fetcher.evict_before_open = 10
    out = await miss(env, read_request(env.ino("sub/b.bin"), 0, 1 << 20))
    assert errno_of(out) == errno.EIO
    assert len(env.fetcher.calls) == fs.ENSURE_ATTEMPTS == 3
    c = totals(env)
    assert c["errors"] == 1 and c["opens"] == 0 and c["reads"] == 0


async def test_a_failed_fetch_answers_the_kernels_retry(env: Env, mock_clock) -> None:
    ino = env.ino("a.txt")
    env.fetcher.error = TemporaryFailure("slow down")
    assert errno_of(await miss(env, read_request(ino, 0, 4096))) == errno.EIO
    assert env.fetcher.calls == ["a.txt"] and totals(env)["errors"] == 1
    # The kernel retries the page at once: the same answer, without asking mountd again.
    env.fetcher.error = None
    mock_clock.jump(fs.FAILURE_MEMORY / 2)
    assert errno_of(await miss(env, read_request(ino, 0, 4096))) == errno.EIO
    assert env.fetcher.calls == ["a.txt"] and totals(env)["errors"] == 1
    # Later, a read asks again (and mountd is back).
    mock_clock.jump(fs.FAILURE_MEMORY)
    assert ok_body(await miss(env, read_request(ino, 0, 4096))) == b"alpha"
    assert env.fetcher.calls == ["a.txt", "a.txt"]
    c = totals(env)
    assert (c["errors"], c["opens"], c["misses"], c["reads"]) == (1, 1, 1, 1)


async def test_failure_memory_is_per_file(env: Env, mock_clock) -> None:
    env.fetcher.error = CacheFull("full")
    assert errno_of(await miss(env, read_request(env.ino("a.txt"), 0, 4096))) == errno.ENOSPC
    env.fetcher.error = None
    out = await miss(env, read_request(env.ino("sub/deeper/c.txt"), 0, 4096))
    assert ok_body(out) == b"charlie"
    assert errno_of(await miss(env, read_request(env.ino("a.txt"), 0, 4096))) == errno.ENOSPC
    assert env.fetcher.calls == ["a.txt", "sub/deeper/c.txt"]


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (NotFound("gone", url="file:///x", key="k"), errno.EIO),
        (CorruptObject("bad hash"), errno.EIO),
        (AccessDenied("denied"), errno.EACCES),
        (TemporaryFailure("slow down"), errno.EIO),
        (MountdUnavailable("no mountd"), errno.EIO),
        (CacheFull("full"), errno.ENOSPC),
        (PermissionDenied("not yours"), errno.EACCES),
        (RuntimeError("a bug"), errno.EIO),
    ],
)
async def test_miss_errors_map_to_errno(env: Env, mock_clock, error, code) -> None:
    env.fetcher.error = error
    assert errno_for(error) == code
    ino = env.ino("a.txt")
    assert errno_of(await miss(env, read_request(ino, 0, 4096))) == code
    with pytest.raises(FsError) as failed:
        await env.ops.read(ino, 0, 4096)  # the kernel's retry, straight to the main process
    assert failed.value.errno == code
    c = totals(env)
    assert c["errors"] == 1 and c["opens"] == 0 and c["reads"] == 0
    assert env.fetcher.calls == ["a.txt"]
    env.fetcher.error = None  # mountd is back: once the failure is forgotten, reads work
    mock_clock.jump(fs.FAILURE_MEMORY + 0.1)
    assert ok_body(await miss(env, read_request(ino, 0, 100))) == b"alpha"
    assert env.fetcher.calls == ["a.txt", "a.txt"]
    assert totals(env)["errors"] == 1


def test_errno_for_passes_fs_errors_through() -> None:
    assert errno_for(FsError(errno.ENODATA)) == errno.ENODATA
    assert errno_for(OSError(errno.ENOENT, "store file gone")) == errno.EIO
    assert errno_for(DigestError("corrupt")) == errno.EIO


async def test_empty_files_need_no_store_file(env: Env) -> None:
    ino = env.ino("empty")
    out = handle(env, read_request(ino, 0, 4096))
    assert ok_body(out) == b""
    assert await env.ops.read(ino, 0, 4096) == b""
    assert ok_body(await env.ops.answer(read_request(ino, 0, 4096))) == b""
    assert env.fetcher.calls == [] and env.forwarded() == []
    c = totals(env)
    assert (c["opens"], c["hits"], c["misses"], c["bytes"], c["errors"]) == (0, 0, 0, 0, 0)
    assert not env.cache.exists() or not any(p.is_file() for p in env.cache.rglob("*"))


def test_reading_a_directory_is_eisdir(env: Env) -> None:
    assert errno_of(handle(env, read_request(env.ino("sub"), 0, 4096))) == errno.EISDIR
    assert errno_of(handle(env, read_request(10**9, 0, 4096))) == errno.ENOENT
    assert env.forwarded() == []


async def test_main_process_read_errors(env: Env) -> None:
    out = await env.ops.answer(read_request(env.ino("sub"), 0, 4096))
    assert errno_of(out) == errno.EISDIR
    assert errno_of(await env.ops.answer(read_request(10**9, 0, 4096))) == errno.ENOENT
    assert errno_of(await env.ops.answer(request(w.LOOKUP, 1, b"a.txt\0"))) == errno.ENOSYS
    assert env.fetcher.calls == [] and totals(env)["errors"] == 0


def test_forwarding_without_a_main_process_is_eio(env: Env) -> None:
    env.main_end.close()
    assert errno_of(handle(env, read_request(env.ino("a.txt"), 0, 4096))) == errno.EIO
    assert errno_of(handle(env, listxattr_request(tree.ROOT_INODE))) == errno.EIO


# -- requests answered without the tree ----------------------------------------------------------


def test_opens_are_enosys_so_the_kernel_stops_sending_them(env: Env) -> None:
    body = struct.pack("<II", os.O_RDONLY, 0)  # fuse_open_in
    assert errno_of(handle(env, request(w.OPEN, env.ino("a.txt"), body))) == errno.ENOSYS
    assert errno_of(handle(env, request(w.OPENDIR, env.ino("sub"), body))) == errno.ENOSYS
    assert errno_of(handle(env, request(w.FLUSH, env.ino("a.txt"), bytes(24)))) == errno.ENOSYS
    assert errno_of(handle(env, request(w.ACCESS, env.ino("a.txt"), bytes(8)))) == errno.ENOSYS
    assert errno_of(handle(env, request(w.IOCTL, env.ino("a.txt"), bytes(32)))) == errno.ENOTTY
    assert errno_of(handle(env, request(w.READLINK, env.ino("a.txt")))) == errno.EINVAL
    assert errno_of(handle(env, request(31, env.ino("a.txt"), bytes(56)))) == errno.ENOSYS  # GETLK
    for opcode in (w.RELEASE, w.RELEASEDIR, w.DESTROY):
        assert ok_body(handle(env, request(opcode, env.ino("a.txt"), bytes(24)))) == b""
    assert env.forwarded() == []


def test_opens_of_files_are_reported_even_when_the_kernels_pages_will_serve_them(env: Env) -> None:
    """Python's ``open()`` asks every file whether it is a terminal: the ``FUSE_IOCTL`` reaches
    a worker even when the kernel's pages answer every READ (which then never come). Each
    open of a non-empty file goes to the main process as an OPENED record (hash, inode), for
    mountd to end the file's protection; directories, empty files and unknown inodes are
    not reported, and opens are neither hits nor counted reads. Only while a sampler uses
    the mount's control channel (the main process's switch, shared with the workers)."""
    ioctl = request(w.IOCTL, env.ino("a.txt"), bytes(32))
    assert errno_of(handle(env, ioctl)) == errno.ENOTTY
    assert not env.ops.refresh_open_reports()  # no sampler: opens are not reported
    env.worker.flush()
    assert env.forwarded() == []
    env.ops.control.last_request = env.ops.control.clock()  # a sampler's claim, say
    assert env.ops.refresh_open_reports()
    for name in ("a.txt", "sub", "empty", "sub/b.bin"):
        assert errno_of(handle(env, request(w.IOCTL, env.ino(name), bytes(32)))) == errno.ENOTTY
    assert errno_of(handle(env, request(w.IOCTL, 10**9, bytes(32)))) == errno.ENOTTY
    assert env.forwarded() == []  # batched until the worker's tick
    env.worker.flush()
    [message] = env.forwarded()
    opened = ("a.txt", "sub/b.bin")
    records = b"".join(worker_messages.HIT_RECORD.pack(b3(env.files[p]), env.ino(p)) for p in opened)
    assert message == worker_messages.OPENED + struct.pack("<Q", 0) + records
    env.ops.add_opened(message[1:])
    assert env.ops.take_opened() == [b3(env.files[p]) for p in opened]
    assert env.ops.take_opened() == []
    assert env.ops.take_hits() == ([], 0) and totals(env)["opens"] == 0


def test_an_unknown_opcode_is_enosys_and_the_worker_goes_on(env: Env) -> None:
    for opcode in (0, 52, 4000, 2**32 - 1):
        assert errno_of(handle(env, request(opcode, env.ino("a.txt"), bytes(16), unique=opcode)),
                        unique=opcode) == errno.ENOSYS
    assert env.forwarded() == [] and totals(env)["errors"] == 0
    assert lookup(env, tree.ROOT_INODE, b"a.txt")[0]["nodeid"] == env.ino("a.txt")


def test_failures_are_logged_with_the_opcodes_name(env: Env, monkeypatch, caplog) -> None:
    def broken(inode: int):
        raise RuntimeError("a bug")

    monkeypatch.setattr(env.worker.tree, "entry", broken)
    with caplog.at_level("ERROR"):
        assert errno_of(handle(env, request(w.GETATTR, env.ino("a.txt"), bytes(16)))) == errno.EIO
    assert [r.getMessage() for r in caplog.records] == ["FUSE GETATTR failed"]


def test_forgets_and_interrupts_get_no_reply(env: Env) -> None:
    assert handle(env, request(w.FORGET, env.ino("a.txt"), struct.pack("<Q", 1))) is None
    batch = struct.pack("<II", 2, 0) + struct.pack("<QQ", env.ino("a.txt"), 1) * 2
    assert handle(env, request(w.BATCH_FORGET, 0, batch)) is None
    assert handle(env, request(w.INTERRUPT, 0, struct.pack("<Q", 6))) is None
    assert env.forwarded() == []
    assert lookup(env, tree.ROOT_INODE, b"a.txt")[0]["nodeid"] == env.ino("a.txt")  # still there


def test_changes_fail_with_erofs(env: Env) -> None:
    expected = {w.SETATTR, w.SYMLINK, w.MKNOD, w.MKDIR, w.UNLINK, w.RMDIR, w.RENAME, w.LINK,
                w.WRITE, w.FSYNC, w.SETXATTR, w.REMOVEXATTR, w.FSYNCDIR, w.CREATE, w.FALLOCATE,
                w.RENAME2, w.COPY_FILE_RANGE, w.TMPFILE}
    assert expected == w.MUTATING
    ino = env.ino("a.txt")
    for opcode in sorted(w.MUTATING):
        for nodeid in (ino, tree.ROOT_INODE):
            out = handle(env, request(opcode, nodeid, bytes(64) + b"name\0", unique=opcode))
            assert errno_of(out, unique=opcode) == errno.EROFS, opcode
    assert env.forwarded() == [] and totals(env)["errors"] == 0


# -- xattrs -----------------------------------------------------------------------------------


def names(body: bytes) -> list[bytes]:
    assert body == b"" or body.endswith(b"\0")
    return body.split(b"\0")[:-1]


#: ``user.quiver.stats``' read-ahead and sweep fields of a mount without either (docs/mount.md).
READAHEAD_OFF = {"readahead": 0, "readahead_cap_bytes": 0, "readahead_window_files": 0,
                 "readahead_window_bytes": 0, "readahead_files": 0, "readahead_bytes": 0,
                 "sweep": 0, "sweep_running": False, "sweep_files": 0, "sweep_bytes": 0,
                 "sweep_restarts": 0, "sweep_bound_bytes": 0, "sweep_unread_bytes": 0,
                 "sweep_renewed": 0}


async def test_xattrs(env: Env) -> None:
    data = env.files["sub/b.bin"]
    ino = env.ino("sub/b.bin")
    listed = ok_body(await xattr(env, listxattr_request(ino)))
    assert names(listed) == [b"user.quiver.hash", b"user.quiver.cached"]
    (size, _) = w.GETXATTR_OUT.unpack(ok_body(await xattr(env, listxattr_request(ino, 0))))
    assert size == len(listed)
    assert errno_of(await xattr(env, listxattr_request(ino, size - 1))) == errno.ERANGE
    assert ok_body(await xattr(env, listxattr_request(ino, size))) == listed
    value = ok_body(await xattr(env, getxattr_request(ino, b"user.quiver.hash")))
    assert value == blake3.blake3(data).hexdigest().encode()
    assert w.GETXATTR_OUT.unpack(ok_body(await xattr(env, getxattr_request(ino, b"user.quiver.hash", 0)))) == (64, 0)
    assert errno_of(await xattr(env, getxattr_request(ino, b"user.quiver.hash", 63))) == errno.ERANGE
    assert ok_body(await xattr(env, getxattr_request(ino, b"user.quiver.cached"))) == b"0"
    assert ok_body(await miss(env, read_request(ino, 0, 1 << 20))) == data
    assert ok_body(await xattr(env, getxattr_request(ino, b"user.quiver.cached"))) == b"1"
    empty = env.ino("empty")
    assert ok_body(await xattr(env, getxattr_request(empty, b"user.quiver.cached"))) == b"1"
    assert ok_body(await xattr(env, getxattr_request(empty, b"user.quiver.hash"))) == blake3.blake3(b"").hexdigest().encode()

    root = tree.ROOT_INODE
    assert names(ok_body(await xattr(env, listxattr_request(root)))) == [b"user.quiver.dataset",
                                                                        b"user.quiver.stats"]
    dataset = ok_body(await xattr(env, getxattr_request(root, b"user.quiver.dataset")))
    assert dataset == env.digest.dataset_id.encode()
    stats = json.loads(ok_body(await xattr(env, getxattr_request(root, b"user.quiver.stats"))))
    assert stats == {"dataset": env.digest.dataset_id, "opens": 1, "reads": 1, "hits": 0,
                     "misses": 1, "bytes": len(data), "errors": 0, **READAHEAD_OFF}
    sub = env.ino("sub")
    assert ok_body(await xattr(env, listxattr_request(sub))) == b""
    assert w.GETXATTR_OUT.unpack(ok_body(await xattr(env, listxattr_request(sub, 0)))) == (0, 0)
    for inode, name in ((ino, b"user.other"), (root, b"user.quiver.hash"), (sub, b"user.quiver.stats"),
                        (ino, b"user.quiver.stats"), (ino, b"user.quiver.dataset"), (root, b"")):
        assert errno_of(await xattr(env, getxattr_request(inode, name))) == errno.ENODATA, name
    assert errno_of(await xattr(env, getxattr_request(10**9, b"user.quiver.hash"))) == errno.ENOENT
    assert errno_of(await xattr(env, listxattr_request(10**9))) == errno.ENOENT
    assert env.fetcher.calls == ["sub/b.bin"] and totals(env)["errors"] == 0


async def test_stats_sum_every_process_and_take_extra_fields(env: Env) -> None:
    env.put_in_store("a.txt")
    assert ok_body(handle(env, read_request(env.ino("a.txt"), 0, 4096))) == b"alpha"  # worker
    assert ok_body(await miss(env, read_request(env.ino("sub/deeper/c.txt"), 0, 4096))) == b"charlie"
    ops = QuiverOperations(env.digest, env.cache, env.fetcher, env.counters,
                           extra_stats=lambda: {"pid": 42, "mountpoint": "/mnt/x"})
    try:
        assert ops.stats() == {"dataset": env.digest.dataset_id, "opens": 2, "reads": 2, "hits": 1,
                               "misses": 1, "bytes": 5 + 7, "errors": 0, "pid": 42,
                               "mountpoint": "/mnt/x", **READAHEAD_OFF}
    finally:
        ops.close()
    assert env.counters.slot(1).tolist() == [1, 1, 1, 0, 5, 0]  # the worker's own row
    assert env.counters.slot(0).tolist() == [1, 1, 0, 1, 7, 0]  # the main process's row


def test_recent_entries_stay_bounded(env: Env, monkeypatch) -> None:
    monkeypatch.setattr(tree, "RECENT_ENTRIES", 10)
    big = env.ino("big")
    for i in range(50):
        head, _ = lookup(env, big, f"f{i:04d}".encode())
        assert getattr_(env, head["nodeid"])[1]["size"] == len(str(i))
    recent = env.worker.tree._recent
    assert len(recent) == 10
    assert sorted(e.name for e in recent.values())[-1] == "f0049"


async def test_control_names_on_the_root_go_to_the_control_channel(env: Env) -> None:
    from quiverfs.protocol import control

    assert fs.CONTROL_PREFIX == control.CONTROL_PREFIX
    root = tree.ROOT_INODE
    raw = ok_body(await xattr(env, getxattr_request(root, b"user.quiver.ctl.n0nce1.info")))
    info = json.loads(raw)
    assert info["dataset"] == env.digest.dataset_id and info["files"] == env.digest.file_count
    out = await xattr(env, getxattr_request(root, b"user.quiver.ctl.n0nce2.bogus"))
    assert errno_of(out) == errno.EINVAL
    # A size probe of the same name gets the size of the same (replayed) response; too small
    # a buffer is ERANGE.
    probe = await xattr(env, getxattr_request(root, b"user.quiver.ctl.n0nce1.info", 0))
    assert w.GETXATTR_OUT.unpack(ok_body(probe)) == (len(raw), 0)
    out = await xattr(env, getxattr_request(root, b"user.quiver.ctl.n0nce1.info", len(raw) - 1))
    assert errno_of(out) == errno.ERANGE
    # Only the root carries the channel, and it is never listed.
    out = await xattr(env, getxattr_request(env.ino("a.txt"), b"user.quiver.ctl.n0nce3.info"))
    assert errno_of(out) == errno.ENODATA
    out = await xattr(env, getxattr_request(env.ino("sub"), b"user.quiver.ctl.n0nce4.info"))
    assert errno_of(out) == errno.ENODATA
    listed = names(ok_body(await xattr(env, listxattr_request(root))))
    assert listed and all(not n.startswith(fs.CONTROL_PREFIX) for n in listed)


@pytest.mark.parametrize("size, block", [(0, 4096), (1, 4096), (4096, 4096), (4097, 8192),
                                         (110 * 1024, 128 * 1024), (1 << 20, 1 << 20),
                                         ((1 << 20) + 1, 1 << 20), (1 << 40, 1 << 20)])
def test_a_files_io_block_is_its_size_rounded_up_to_a_power_of_two_within_4_kib_and_1_mib(size, block) -> None:
    assert tree.io_block(size) == block
