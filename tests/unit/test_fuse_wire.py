"""The FUSE protocol encoders against the kernel's layouts (<linux/fuse.h>, 7.38): struct
sizes, padding, field order, the errno clamp, xattr size probes and INIT negotiation."""

from __future__ import annotations

import errno
import stat
import struct

import pytest

from quiverfs.protocol import fuse_wire as w

ATTRS = w.Attributes(ino=42, mode=stat.S_IFREG | 0o444, size=1025, uid=1000, gid=100,
                     mtime_ns=1_700_000_000 * 10**9 + 123_456_789)
DIR_ATTRS = w.Attributes(ino=7, mode=stat.S_IFDIR | 0o555, size=0, uid=0, gid=0, mtime_ns=0)


def test_struct_sizes_match_the_kernel() -> None:
    assert w.IN_HEADER.size == w.HEADER_SIZE == 40  # fuse_in_header
    assert w.OUT_HEADER.size == 16  # fuse_out_header
    assert w.ATTR.size == 88  # fuse_attr
    assert w.ENTRY_HEAD.size + w.ATTR.size == 128  # fuse_entry_out
    assert w.ATTR_OUT_HEAD.size + w.ATTR.size == 104  # fuse_attr_out
    assert w.GETXATTR_IN.size == w.GETXATTR_OUT.size == 8
    assert w.INIT_OUT.size == 64 and w.INIT_IN.size == 16
    assert w.OPEN_OUT.size == 16 and w.DIRENT_HEAD.size == 24 and w.STATFS_OUT.size == 80
    assert w.READ_IN.size == 20  # the part of the 40-byte fuse_read_in we read


def test_opcodes_are_the_kernels() -> None:
    assert (w.LOOKUP, w.FORGET, w.GETATTR, w.READ, w.STATFS, w.GETXATTR, w.LISTXATTR) == (1, 2, 3, 15, 17, 22, 23)
    assert (w.INIT, w.OPENDIR, w.READDIR, w.INTERRUPT, w.IOCTL, w.BATCH_FORGET, w.READDIRPLUS) == (26, 27, 28, 36, 39, 42, 44)
    assert w.MUTATING.isdisjoint(w.NO_REPLY)
    assert not w.MUTATING & {w.LOOKUP, w.GETATTR, w.READ, w.READDIR, w.READDIRPLUS, w.STATFS,
                             w.GETXATTR, w.LISTXATTR, w.OPEN, w.OPENDIR}
    assert {w.FORGET, w.BATCH_FORGET, w.INTERRUPT} == w.NO_REPLY


def test_request_header_and_names() -> None:
    request = w.IN_HEADER.pack(46, w.LOOKUP, 99, 5, 1, 2, 3, 0, 0) + b"name\0x"
    assert w.parse_header(request) == (46, w.LOOKUP, 99, 5)
    assert w.cstring(request, w.HEADER_SIZE) == b"name"
    assert w.cstring(request, w.HEADER_SIZE + 5) == b"x"  # no NUL: to the end
    assert w.cstring(request, len(request)) == b""


def test_reply_and_error() -> None:
    assert w.reply(5) == struct.pack("<IiQ", 16, 0, 5)
    assert w.reply(5, b"abc") == struct.pack("<IiQ", 19, 0, 5) + b"abc"
    assert w.error(6, errno.ENOENT) == struct.pack("<IiQ", 16, -errno.ENOENT, 6)
    assert w.error(6, 4095) == struct.pack("<IiQ", 16, -4095, 6)


@pytest.mark.parametrize("bad", [0, -1, -errno.ENOENT, 4096, 10**9])
def test_error_clamps_bad_errnos_to_eio(bad: int) -> None:
    assert w.OUT_HEADER.unpack(w.error(3, bad)) == (16, -errno.EIO, 3)


def test_attributes_pack() -> None:
    fields = w.ATTR.unpack(ATTRS.pack())
    ino, size, blocks, atime, mtime, ctime, atimens, mtimens, ctimens, mode, nlink, uid, gid, rdev, blksize, flags = fields
    assert (ino, size, blocks) == (42, 1025, 3)  # 512-byte blocks, rounded up
    assert atime == mtime == ctime == 1_700_000_000
    assert atimens == mtimens == ctimens == 123_456_789
    assert (mode, nlink, uid, gid, rdev, blksize, flags) == (stat.S_IFREG | 0o444, 1, 1000, 100, 0, 4096, 0)
    assert w.ATTR.unpack(DIR_ATTRS.pack())[2] == 0


def test_entry_and_attr_bodies() -> None:
    body = w.entry_body(ATTRS, 3600)
    assert len(body) == 128
    assert w.ENTRY_HEAD.unpack_from(body) == (42, 0, 3600, 3600, 0, 0)
    assert body[w.ENTRY_HEAD.size:] == ATTRS.pack()
    negative = w.entry_body(None, 3600)
    assert len(negative) == 128
    assert w.ENTRY_HEAD.unpack_from(negative) == (0, 0, 3600, 0, 0, 0)  # cached ENOENT
    assert negative[w.ENTRY_HEAD.size:] == bytes(88)
    out = w.attr_body(ATTRS, 60)
    assert len(out) == 104 and w.ATTR_OUT_HEAD.unpack_from(out) == (60, 0, 0)
    assert out[16:] == ATTRS.pack()


@pytest.mark.parametrize("length", [1, 2, 7, 8, 9, 15, 16, 17, 255])
def test_dirents_are_padded_to_8_bytes(length: int) -> None:
    name = b"n" * length
    record = w.dirent(name, ATTRS, 1234, None)
    padded = -(-length // 8) * 8
    assert len(record) == 24 + padded and len(record) % 8 == 0
    assert w.DIRENT_HEAD.unpack_from(record) == (42, 1234, length, 8)  # DT_REG
    assert record[24:24 + length] == name and record[24 + length:] == bytes(padded - length)
    plus = w.dirent(name, ATTRS, 1234, 3600)
    assert len(plus) == 128 + len(record)  # fuse_direntplus: entry_out, then the dirent
    assert plus[:128] == w.entry_body(ATTRS, 3600) and plus[128:] == record


def test_dirent_types() -> None:
    assert w.DIRENT_HEAD.unpack_from(w.dirent(b"d", DIR_ATTRS, 7, None))[3] == 4  # DT_DIR
    assert w.DIRENT_HEAD.unpack_from(w.dirent(b"f", ATTRS, 42, None))[3] == 8  # DT_REG


def test_statfs_body() -> None:
    body = w.statfs_body(blocks=1000, files=77, block_size=4096, name_max=255)
    assert len(body) == 80
    assert struct.unpack("<QQQQQIIII6I", body) == (1000, 0, 0, 77, 0, 4096, 255, 4096, 0, *([0] * 6))


def test_xattr_body() -> None:
    value = b"0123456789"
    assert w.xattr_body(value, 0) == struct.pack("<II", 10, 0)  # the size probe
    assert w.xattr_body(b"", 0) == struct.pack("<II", 0, 0)
    assert w.xattr_body(value, 9) == errno.ERANGE
    assert w.xattr_body(value, 10) == value
    assert w.xattr_body(value, 65536) == value
    assert w.xattr_body(b"", 10) == b""


def test_init_body_takes_only_what_the_kernel_offers() -> None:
    offered = w.ASYNC_READ | w.DO_READDIRPLUS | (1 << 5) | (1 << 30)
    body = w.init_body(31, offered, 131072)
    assert len(body) == 64
    (major, minor, readahead, flags, background, congestion, max_write, time_gran, max_pages,
     map_alignment, flags2, *unused) = w.INIT_OUT.unpack(body)
    assert (major, minor, readahead) == (7, 31, 131072)
    assert flags == w.ASYNC_READ | w.DO_READDIRPLUS  # not what we did not ask for
    assert (background, congestion, max_write, time_gran) == (16, 12, w.MAX_WRITE, 1)
    assert (max_pages, map_alignment, flags2, unused) == (w.MAX_PAGES_WANTED, 0, 0, [0] * 7)


def test_init_body_with_a_newer_kernel() -> None:
    fields = w.INIT_OUT.unpack(w.init_body(41, 0xFFFFFFFF, 4096))
    assert fields[:4] == (7, w.KERNEL_MINOR, 4096, w.WANTED_FLAGS)
    assert w.KERNEL_MINOR == 38
    assert w.WANTED_FLAGS == (1 << 0) | (1 << 13) | (1 << 14) | (1 << 18) | (1 << 22)
    assert w.INIT_OUT.unpack(w.init_body(38, 0, 0))[3] == 0  # nothing offered, nothing taken


def test_request_buffer_holds_the_largest_write() -> None:
    assert w.REQUEST_BUFFER >= w.MAX_WRITE + w.HEADER_SIZE + 80  # fuse_write_in is 40 bytes
    assert w.MAX_PAGES_WANTED * 4096 == 1 << 20


def test_every_opcode_has_its_name() -> None:
    for value, name in w.OPCODE_NAMES.items():
        assert getattr(w, name) == value, name  # the name is the constant's own
    assert len(set(w.OPCODE_NAMES.values())) == len(w.OPCODE_NAMES) == 39
    assert set(w.OPCODE_NAMES) >= w.NO_REPLY | w.MUTATING | {w.READ, w.LOOKUP, w.READDIRPLUS}
    assert w.opcode_name(w.READ) == "READ" and w.opcode_name(w.BATCH_FORGET) == "BATCH_FORGET"
    assert w.opcode_name(4000) == "opcode 4000"


# -- the one writer to /dev/fuse (quiverfs.fuse.channel.send) --------------------------------------


def test_send_writes_a_reply_in_one_write(tmp_path) -> None:
    import os

    from quiverfs.fuse.channel import send

    read_end, write_end = os.pipe()
    try:
        assert send(write_end, w.reply(5, b"abc"))
        assert send(write_end, [w.OUT_HEADER.pack(w.OUT_HEADER.size + 2, 0, 6), b"xy"])
        os.close(write_end)
        write_end = -1
        data = os.read(read_end, 4096)
        assert data == w.reply(5, b"abc") + w.reply(6, b"xy")
    finally:
        os.close(read_end)
        if write_end >= 0:
            os.close(write_end)


@pytest.mark.parametrize(("code", "alive", "logged"), [
    (errno.ENOENT, True, False),  # the kernel no longer waits for that request: not a failure
    (errno.ENODEV, False, False),  # unmounted: the caller stops serving
    (errno.EINVAL, True, True),  # a malformed reply: logged, dropped
])
def test_send_knows_what_the_devices_errors_mean(monkeypatch, caplog, code, alive, logged) -> None:
    import os

    from quiverfs.fuse import channel as fuse_channel

    def refuse(fd, data):  # the fault; a real /dev/fuse answers these only in odd states
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(fuse_channel.os, "write", refuse)
    monkeypatch.setattr(fuse_channel.os, "writev", refuse)
    with caplog.at_level("WARNING", logger="quiverfs.fuse"):
        assert fuse_channel.send(99, w.error(1, errno.EIO)) is alive
        assert fuse_channel.send(99, [w.reply(2)]) is alive
    assert len(caplog.records) == (2 if logged else 0)
