"""The filesystem's Operations in process, without a kernel: tree, readdir paging, reads,
xattrs, errno mapping, EROFS. Store files and the fetcher are real files and a fake mountd."""

from __future__ import annotations

import errno
import json
import os
import stat
from pathlib import Path

import blake3
import pyfuse3
import pytest

from digests.digest import Digest
from digests.write import NewFile, write_digest
from mountd import layout
from mountd.errors import CacheFull
from mountd.protocol import MountdUnavailable, PermissionDenied
from quiverfs import fs
from quiverfs.errors import AccessDenied, CorruptObject, NotFound, TemporaryFailure
from quiverfs.fs import QuiverOperations, errno_for

CONTENT = {
    "a.txt": b"alpha",
    "empty": b"",
    "sub/b.bin": bytes(range(256)) * 40,
    "sub/deeper/c.txt": b"charlie",
    "ü dir/ä file.txt": b"unicode",
}
MANY = 1000  # files in big/, plus 3 subdirectories


def _all_content() -> dict[str, bytes]:
    files = dict(CONTENT)
    for i in range(MANY):
        files[f"big/f{i:04d}"] = f"{i}".encode()
    for d in ("d0", "d1", "d2"):
        files[f"big/{d}/x"] = d.encode()
    return files


class FakeFetcher:
    """Plays mountd's ensure: writes the store file from ``content`` (or raises ``error``)."""

    def __init__(self, cache_dir: Path, content: dict[bytes, bytes]) -> None:
        self.cache_dir = cache_dir
        self.content = content
        self.calls: list[str] = []
        self.error: Exception | None = None
        #: ensure() calls whose file "mountd" evicts before the caller can open it.
        self.evict_before_open = 0

    async def ensure(self, entry) -> str:
        self.calls.append(entry.path)
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


@pytest.fixture
def setup(tmp_path: Path):
    files = _all_content()
    out = tmp_path / "d.qd"
    write_digest(out, [NewFile(p, len(d), blake3.blake3(d).digest()) for p, d in files.items()],
                 ["file:///nowhere"])
    digest = Digest.open(out)
    cache = tmp_path / "cache"
    fetcher = FakeFetcher(cache, {blake3.blake3(d).digest(): d for d in files.values()})
    ops = QuiverOperations(digest, cache, fetcher, uid=1234, gid=5678)
    yield ops, digest, fetcher, files
    ops.close()
    digest.close()


def _ino(digest: Digest, path: str) -> int:
    return digest.lookup_path(path).id


async def _fuse_errno(coro) -> int:
    with pytest.raises(pyfuse3.FUSEError) as info:
        await coro
    return info.value.errno


# -- tree -------------------------------------------------------------------------------------


async def test_lookup_and_getattr(setup) -> None:
    ops, digest, _, files = setup
    root = await ops.getattr(pyfuse3.ROOT_INODE, None)
    assert root.st_ino == 1 and root.st_mode == stat.S_IFDIR | 0o555
    sub = await ops.lookup(pyfuse3.ROOT_INODE, b"sub", None)
    assert sub.st_ino == _ino(digest, "sub") and stat.S_ISDIR(sub.st_mode)
    b = await ops.lookup(sub.st_ino, b"b.bin", None)
    assert b.st_mode == stat.S_IFREG | 0o444 and b.st_size == len(files["sub/b.bin"])
    assert (b.st_uid, b.st_gid) == (1234, 5678)
    assert b.entry_timeout >= 3600 and b.attr_timeout >= 3600
    uni = await ops.lookup(_ino(digest, "ü dir"), "ä file.txt".encode(), None)
    assert uni.st_size == len("unicode")
    assert (await ops.getattr(b.st_ino, None)).st_size == b.st_size


async def test_dot_and_dotdot(setup) -> None:
    ops, digest, _, _ = setup
    deeper = _ino(digest, "sub/deeper")
    assert (await ops.lookup(deeper, b".", None)).st_ino == deeper
    assert (await ops.lookup(deeper, b"..", None)).st_ino == _ino(digest, "sub")
    assert (await ops.lookup(pyfuse3.ROOT_INODE, b"..", None)).st_ino == pyfuse3.ROOT_INODE


async def test_unknown_names_are_cached_negative_entries(setup) -> None:
    ops, _, _, _ = setup
    for name in (b"nope", b"\xff\xfe not utf-8", b"x" * 300):
        entry = await ops.lookup(pyfuse3.ROOT_INODE, name, None)
        assert entry.st_ino == 0 and entry.entry_timeout >= 3600  # ENOENT, cached by the kernel
    assert await _fuse_errno(ops.getattr(10**9, None)) == errno.ENOENT


class FakeToken:
    """A readdir buffer that holds ``room`` entries (the kernel's is about 25)."""

    def __init__(self, room: int) -> None:
        self.room = room
        self.entries: list[tuple[bytes, int, int]] = []


def _fake_reply(token: FakeToken, name: bytes, attr: pyfuse3.EntryAttributes, next_id: int) -> bool:
    if len(token.entries) >= token.room:
        return False
    token.entries.append((name, attr.st_ino, next_id))
    return True


async def _list_all(ops, inode: int, room: int) -> list[tuple[bytes, int, int]]:
    fh = await ops.opendir(inode, None)
    out, cookie = [], 0
    try:
        while True:
            token = FakeToken(room)
            await ops.readdir(fh, cookie, token)
            if not token.entries:
                return out
            out.extend(token.entries)
            cookie = token.entries[-1][2]
    finally:
        await ops.releasedir(fh)


async def test_readdir_pages_with_cookies(setup, monkeypatch) -> None:
    ops, digest, _, _ = setup
    monkeypatch.setattr(pyfuse3, "readdir_reply", _fake_reply)
    calls = []
    real = digest.listdir

    def counting(dir_id, after=None, limit=1024):
        calls.append((after, limit))
        return real(dir_id, after, limit)

    monkeypatch.setattr(digest, "listdir", counting)
    big = _ino(digest, "big")
    listed = await _list_all(ops, big, room=7)
    names = [n.decode() for n, _, _ in listed]
    assert names == ["d0", "d1", "d2"] + [f"f{i:04d}" for i in range(MANY)]
    assert len(set(names)) == len(names)
    assert all(ino == nxt for _, ino, nxt in listed)  # the cookie is the entry id
    # Leftovers of a page serve the next readdir calls: about one digest query per page.
    assert len(calls) <= (MANY + 3) // fs.READDIR_PAGE + 3
    assert all(limit == fs.READDIR_PAGE for _, limit in calls)


async def test_readdir_resumes_from_any_cookie(setup, monkeypatch) -> None:
    ops, digest, _, _ = setup
    monkeypatch.setattr(pyfuse3, "readdir_reply", _fake_reply)
    big = _ino(digest, "big")
    everything = await _list_all(ops, big, room=10_000)
    cookie = everything[500][2]
    fh = await ops.opendir(big, None)
    token = FakeToken(5)
    await ops.readdir(fh, cookie, token)
    assert token.entries == everything[501:506]
    assert await _fuse_errno(ops.readdir(fh, _ino(digest, "a.txt"), FakeToken(5))) == errno.EINVAL
    await ops.releasedir(fh)
    assert await _fuse_errno(ops.opendir(_ino(digest, "a.txt"), None)) == errno.ENOTDIR


async def test_statfs(setup) -> None:
    ops, digest, _, files = setup
    st = await ops.statfs(None)
    assert st.f_bsize == 4096 and st.f_blocks == -(-sum(map(len, files.values())) // 4096)
    assert st.f_files == digest.file_count + digest.dir_count and st.f_bfree == 0
    assert st.f_namemax == 255


# -- reads ------------------------------------------------------------------------------------


async def test_a_miss_evicted_before_open_is_asked_for_again(setup) -> None:
    ops, digest, fetcher, files = setup
    fetcher.evict_before_open = 2
    info = await ops.open(_ino(digest, "sub/b.bin"), os.O_RDONLY, None)
    assert fetcher.calls == ["sub/b.bin"] * 3
    assert await ops.read(info.fh, 0, 1 << 20) == files["sub/b.bin"]
    await ops.release(info.fh)
    assert ops.counters.errors == 0


async def test_a_miss_evicted_every_time_fails_with_eio(setup) -> None:
    ops, digest, fetcher, _ = setup
    fetcher.evict_before_open = 10
    with pytest.raises(pyfuse3.FUSEError) as failed:
        await ops.open(_ino(digest, "sub/b.bin"), os.O_RDONLY, None)
    assert failed.value.errno == errno.EIO
    assert len(fetcher.calls) == 3 and ops.counters.errors == 1


async def test_miss_then_hit(setup) -> None:
    ops, digest, fetcher, files = setup
    ino = _ino(digest, "sub/b.bin")
    info = await ops.open(ino, os.O_RDONLY, None)
    assert info.keep_cache
    assert fetcher.calls == ["sub/b.bin"]
    assert await ops.read(info.fh, 0, 1 << 20) == files["sub/b.bin"]
    assert await ops.read(info.fh, 100, 10) == files["sub/b.bin"][100:110]
    await ops.release(info.fh)
    info = await ops.open(ino, os.O_RDONLY, None)  # now in the store: no fetch
    assert fetcher.calls == ["sub/b.bin"]
    assert await ops.read(info.fh, 0, 5) == files["sub/b.bin"][:5]
    await ops.release(info.fh)
    c = ops.counters
    assert (c.opens, c.misses, c.hits, c.reads, c.errors) == (2, 1, 1, 3, 0)
    assert c.bytes == len(files["sub/b.bin"]) + 10 + 5
    hashes, nbytes = ops.take_hits()
    assert hashes == [blake3.blake3(files["sub/b.bin"]).digest()] and nbytes == len(files["sub/b.bin"])
    assert ops.take_hits() == ([], 0)


async def test_empty_files_need_no_store_file(setup) -> None:
    ops, digest, fetcher, _ = setup
    info = await ops.open(_ino(digest, "empty"), os.O_RDONLY, None)
    assert await ops.read(info.fh, 0, 4096) == b""
    await ops.release(info.fh)
    await ops.release(info.fh)  # the shared /dev/null descriptor is never closed
    assert fetcher.calls == []


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (NotFound("gone", url="file:///x", key="k"), errno.EIO),
        (CorruptObject("bad hash"), errno.EIO),
        (AccessDenied("denied"), errno.EIO),
        (TemporaryFailure("slow down"), errno.EIO),
        (MountdUnavailable("no mountd"), errno.EIO),
        (CacheFull("full"), errno.ENOSPC),
        (PermissionDenied("not yours"), errno.EACCES),
        (RuntimeError("a bug"), errno.EIO),
    ],
)
async def test_miss_errors_map_to_errno(setup, error, code) -> None:
    ops, digest, fetcher, _ = setup
    fetcher.error = error
    assert errno_for(error) == code
    assert await _fuse_errno(ops.open(_ino(digest, "a.txt"), os.O_RDONLY, None)) == code
    assert ops.counters.errors == 1 and ops.counters.opens == 0
    fetcher.error = None  # mountd is back: the next open works
    info = await ops.open(_ino(digest, "a.txt"), os.O_RDONLY, None)
    assert await ops.read(info.fh, 0, 100) == b"alpha"
    await ops.release(info.fh)


async def test_open_for_writing_or_a_directory_fails(setup) -> None:
    ops, digest, _, _ = setup
    ino = _ino(digest, "a.txt")
    for flags in (os.O_WRONLY, os.O_RDWR, os.O_RDONLY | os.O_TRUNC, os.O_WRONLY | os.O_APPEND):
        assert await _fuse_errno(ops.open(ino, flags, None)) == errno.EROFS
    assert await _fuse_errno(ops.open(_ino(digest, "sub"), os.O_RDONLY, None)) == errno.EISDIR


# -- xattrs -----------------------------------------------------------------------------------


async def test_xattrs(setup) -> None:
    ops, digest, _, files = setup
    ino = _ino(digest, "sub/b.bin")
    assert sorted(await ops.listxattr(ino, None)) == [b"user.quiver.cached", b"user.quiver.hash"]
    assert await ops.getxattr(ino, b"user.quiver.hash", None) == blake3.blake3(files["sub/b.bin"]).hexdigest().encode()
    assert await ops.getxattr(ino, b"user.quiver.cached", None) == b"0"
    info = await ops.open(ino, os.O_RDONLY, None)
    await ops.release(info.fh)
    assert await ops.getxattr(ino, b"user.quiver.cached", None) == b"1"
    root = pyfuse3.ROOT_INODE
    assert sorted(await ops.listxattr(root, None)) == [b"user.quiver.dataset", b"user.quiver.stats"]
    assert await ops.getxattr(root, b"user.quiver.dataset", None) == digest.dataset_id.encode()
    stats = json.loads(await ops.getxattr(root, b"user.quiver.stats", None))
    assert stats == {"dataset": digest.dataset_id, "opens": 1, "reads": 0, "hits": 0, "misses": 1,
                     "bytes": 0, "errors": 0}
    assert await ops.listxattr(_ino(digest, "sub"), None) == []
    for inode, name in ((ino, b"user.other"), (root, b"user.quiver.hash"), (_ino(digest, "sub"), b"user.quiver.stats")):
        assert await _fuse_errno(ops.getxattr(inode, name, None)) == errno.ENODATA


async def test_changes_fail_with_erofs(setup) -> None:
    ops, digest, _, _ = setup
    ino, root = _ino(digest, "a.txt"), pyfuse3.ROOT_INODE
    calls = [
        ops.setattr(ino, pyfuse3.EntryAttributes(), None, None, None),
        ops.mknod(root, b"n", stat.S_IFREG | 0o644, 0, None),
        ops.mkdir(root, b"d", 0o755, None),
        ops.unlink(root, b"a.txt", None),
        ops.rmdir(root, b"sub", None),
        ops.symlink(root, b"l", b"a.txt", None),
        ops.rename(root, b"a.txt", root, b"b.txt", 0, None),
        ops.link(ino, root, b"hard", None),
        ops.create(root, b"new", 0o644, os.O_WRONLY, None),
        ops.write(0, 0, b"x"),
        ops.setxattr(ino, b"user.quiver.hash", b"0", None),
        ops.removexattr(ino, b"user.quiver.hash", None),
    ]
    for call in calls:
        assert await _fuse_errno(call) == errno.EROFS


async def test_recent_entries_stay_bounded(setup, monkeypatch) -> None:
    ops, digest, _, _ = setup
    monkeypatch.setattr(fs, "RECENT_ENTRIES", 10)
    big = _ino(digest, "big")
    for i in range(50):
        entry = await ops.lookup(big, f"f{i:04d}".encode(), None)
        assert (await ops.getattr(entry.st_ino, None)).st_size == len(str(i))
    assert len(ops._recent) == 10


async def test_control_names_on_the_root_go_to_the_control_channel(setup) -> None:
    from quiverfs import control

    ops, digest, _, _ = setup
    assert fs.CONTROL_PREFIX == control.CONTROL_PREFIX
    info = json.loads(await ops.getxattr(pyfuse3.ROOT_INODE, b"user.quiver.ctl.n0nce1.info", None))
    assert info["dataset"] == digest.dataset_id and info["files"] == digest.file_count
    assert await _fuse_errno(ops.getxattr(pyfuse3.ROOT_INODE, b"user.quiver.ctl.n0nce2.bogus", None)) == errno.EINVAL
    # Only the root carries the channel, and it is never listed.
    assert await _fuse_errno(ops.getxattr(_ino(digest, "a.txt"), b"user.quiver.ctl.n0nce3.info", None)) == errno.ENODATA
    assert all(not n.startswith(fs.CONTROL_PREFIX) for n in await ops.listxattr(pyfuse3.ROOT_INODE, None))
