"""Tar shards read once, in order, through ranged GETs: every member's offset, size and blake3.

``digests build --tar members`` (digests/build.py) turns every ``.tar`` object into the files
it holds: a member's location is the shard's key plus the offset of its data, so the mount
fetches one member with one ranged GET and never needs the tar format again. This module
only reads: :func:`scan_shard` walks one shard from its first byte with ranged reads of
:data:`~quiverfs.base.backends.base.DEFAULT_CHUNK` (8 MiB), hashing each member's data as it
passes, so a shard is downloaded once and never held whole in memory (one chunk plus the
header being parsed).

The headers are parsed here rather than by :mod:`tarfile`: ``tarfile`` reads from a blocking
file object, and our reads are trio calls; a small parser over an async reader keeps one
thread hop per GET. What it understands:

* ustar headers (``prefix`` + ``name``), old V7 headers, GNU headers (base-256 sizes);
* GNU long names (``L``; ``K`` long link names are read and ignored), pax extended headers
  (``x``: ``path`` and ``size``; ``g`` global headers are read and ignored), so names longer
  than 100 bytes come out whole;
* regular files (``0``, ``\\0``, ``7``) and empty ones; directories (``5``), which become
  directories of the digest;
* symbolic and hard links, devices, FIFOs, GNU sparse files, volume labels and unknown types
  are skipped with a reason (the caller warns);
* the end of the archive is two zero blocks, one zero block, or simply the end of the object:
  a shard cut right after its last member's data (no padding, no end blocks) is complete.

Member names: a leading ``./`` is dropped (``tar -C dir -c .`` writes them), a trailing ``/``
too; what remains must be a valid digest path (digests/paths.py) once joined to ``prefix``,
or the member is skipped with the reason. A name given twice in one shard keeps the later
member, as extracting the tar would (:attr:`ShardScan.duplicates` counts the earlier ones).

Errors: a compressed shard (gzip, bzip2, xz or zstd magic where the first header should be)
is a :class:`UsageError` naming the fix (repack uncompressed); a header with a bad checksum,
or an object that ends inside a header or a member's data, is :class:`CorruptObject`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import blake3
import trio

from digests.paths import path_problem
from quiverfs.base.backends import Backend, ObjectInfo
from quiverfs.base.backends.base import DEFAULT_CHUNK
from quiverfs.base.errors import CorruptObject, UsageError

BLOCK = 512
ZERO_BLOCK = bytes(BLOCK)
#: Hash slices at least this big in a worker thread (as digests/build.py does for objects).
THREAD_HASH_BYTES = 1 << 20
#: Longest GNU long name or pax header accepted: they are held in memory, and a hostile
#: shard could otherwise name a gigabyte-long "name".
MAX_EXTENDED_HEADER = 1 << 20

#: Key suffixes of compressed tars, refused by ``--tar members`` before anything is read.
COMPRESSED_SUFFIXES = (
    ".tar.gz", ".tgz", ".taz", ".tar.bz2", ".tbz", ".tbz2", ".tb2", ".tar.xz", ".txz",
    ".tar.zst", ".tar.zstd", ".tzst", ".tar.lz4", ".tar.lzma", ".tlz", ".tar.z",
)
#: Magic bytes of the compressions a ``.tar`` object may secretly be, by name.
COMPRESSION_MAGIC = {
    b"\x1f\x8b": "gzip",
    b"BZh": "bzip2",
    b"\xfd7zXZ\x00": "xz",
    b"\x28\xb5\x2f\xfd": "zstd",
}

_REGULAR = {b"0", b"\0", b"7"}
#: Entry types whose size field is not followed by data blocks (as tarfile reads them).
_NO_DATA = {b"1", b"2", b"3", b"4", b"5", b"6"}
_SKIPPED_TYPES = {
    b"1": "hard link (not supported: repack with the content)",
    b"2": "symbolic link (not supported)",
    b"3": "character device",
    b"4": "block device",
    b"6": "FIFO",
    b"S": "GNU sparse file (not supported)",
    b"V": "volume label",
    b"M": "multi-volume continuation (not supported)",
}


def is_shard_key(key: str) -> bool:
    """Whether ``--tar members`` reads object ``key`` as a tar shard (it ends in ``.tar``)."""
    return key.lower().endswith(".tar")


def compressed_suffix(key: str) -> str | None:
    """The compressed-tar suffix ``key`` ends with (``.tar.gz``, ``.tgz`` ...), or ``None``."""
    lower = key.lower()
    for suffix in COMPRESSED_SUFFIXES:
        if lower.endswith(suffix):
            return suffix
    return None


def compressed_refusal(key: str, what: str) -> UsageError:
    """The one-line refusal of a compressed shard: members of a compressed stream have no
    byte offsets a ranged read could use."""
    return UsageError(
        f"{key!r} is a compressed tar ({what}): --tar members needs uncompressed shards, whose "
        "members can be read by byte range; repack it uncompressed (e.g. gunzip / zstd -d to "
        "a .tar), or build with --tar shards to keep each shard as one file"
    )


@dataclass(frozen=True, slots=True)
class Member:
    """One member of a shard as the digest will hold it.

    ``path`` is the digest path (``prefix`` joined to the normalised member name). For a file,
    its content is bytes ``[offset, offset + size)`` of the shard and ``hash`` their blake3;
    a directory has ``is_dir`` true, ``size`` 0 and no hash.
    """

    path: str
    is_dir: bool
    offset: int
    size: int
    hash: bytes | None


@dataclass
class ShardScan:
    """What :func:`scan_shard` found in one shard.

    ``members`` has one entry per path (the later member wins); ``skipped`` holds
    ``(member name, reason)`` for members that cannot be files; ``duplicates`` counts members
    replaced by a later one of the same path. ``changed`` is true when the object turned out
    shorter or longer than ``info.size`` (the caller re-stats and reads again);
    ``read_to_end`` when the reads reached the object's end and found nothing past it.
    """

    members: dict[str, Member] = field(default_factory=dict)
    skipped: list[tuple[str, str]] = field(default_factory=list)
    duplicates: int = 0
    duplicate_examples: list[str] = field(default_factory=list)
    changed: bool = False
    read_to_end: bool = False


class _Reader:
    """Sequential reads of one object of known size through ranged GETs of ``chunk`` bytes.

    Holds at most one chunk (plus the unread rest of the previous one). The last GET asks for
    one byte more than the object should have, so a grown object shows (``grown``) without a
    request of its own; a GET that comes back short before the listed size means the object
    shrank (``shrunk``).
    """

    def __init__(self, backend: Backend, key: str, size: int, chunk: int) -> None:
        self.backend = backend
        self.key = key
        self.size = size
        self.chunk = chunk
        self.pos = 0  # absolute offset of the next byte handed out
        self._buf = b""
        self._at = 0  # index of self.pos in self._buf
        self._next = 0  # absolute offset of the next GET
        self.eof = False  # the whole listed size was read (and the probe byte, if asked)
        self.grown = False
        self.shrunk = False

    @property
    def changed(self) -> bool:
        return self.grown or self.shrunk

    async def _more(self) -> bool:
        """Read the next chunk into the buffer; false at the end (or once the object changed)."""
        if self.eof or self.changed:
            return False
        # Ask for the probe byte with the last chunk; an exact hit of a chunk boundary leaves
        # a 1-byte GET for the probe alone.
        want = min(self.chunk, self.size + 1 - self._next)
        data = await self.backend.read_range(self.key, self._next, want)
        expected_real = min(want, self.size - self._next)
        if len(data) > expected_real:
            self.grown = True
            return False
        if len(data) < expected_real:
            self.shrunk = True
            return False
        self._next += len(data)
        if self._next >= self.size and want > expected_real:
            self.eof = True  # the probe byte was asked for and did not come
        if not data:
            return False
        # Only a header split across two chunks leaves a rest to copy.
        self._buf = self._buf[self._at :] + data if self._at < len(self._buf) else data
        self._at = 0
        return True

    def _available(self) -> int:
        return len(self._buf) - self._at

    async def take(self, n: int) -> bytes:
        """Up to ``n`` bytes (fewer only at the end of the object)."""
        while self._available() < n and await self._more():
            pass
        out = self._buf[self._at : self._at + n]
        self._at += len(out)
        self.pos += len(out)
        return out

    async def feed(self, n: int, hasher: blake3.blake3 | None) -> int:
        """Pass the next ``n`` bytes to ``hasher`` (or drop them); how many there were."""
        done = 0
        while done < n:
            if self._available() == 0 and not await self._more():
                break
            step = min(n - done, self._available())
            if hasher is not None:
                piece = memoryview(self._buf)[self._at : self._at + step]
                if step >= THREAD_HASH_BYTES:
                    await trio.to_thread.run_sync(hasher.update, piece)
                else:
                    hasher.update(piece)
            self._at += step
            self.pos += step
            done += step
        return done


def _field_str(raw: bytes) -> str:
    """A NUL-terminated header field as text (UTF-8; undecodable bytes kept as surrogates,
    which path_problem then refuses as 'not valid UTF-8')."""
    return raw.split(b"\0", 1)[0].decode("utf-8", "surrogateescape")


def _number(raw: bytes) -> int:
    """An octal header number, or GNU base-256 (first byte's high bit set)."""
    if raw and raw[0] & 0x80:
        value = int.from_bytes(raw[1:], "big")
        if raw[0] & 0x40:  # negative: never a valid size
            raise ValueError("negative base-256 number")
        return value
    text = raw.split(b"\0", 1)[0].strip(b" \0")
    return int(text, 8) if text else 0


def _checksum_ok(block: bytes) -> bool:
    try:
        stored = _number(block[148:156])
    except ValueError:
        return False
    unsigned = sum(block[:148]) + 8 * 0x20 + sum(block[156:])
    # Some old tars summed signed chars; accept either, as tarfile does.
    signed = unsigned - 256 * sum(1 for b in block[:148] + block[156:] if b >= 128)
    return stored in (unsigned, signed)


def _pax_records(data: bytes) -> dict[str, str]:
    """``"%d %s=%s\\n"`` records of a pax header; lengths count bytes. ValueError if malformed."""
    records: dict[str, str] = {}
    pos = 0
    while pos < len(data):
        if data[pos:].strip(b"\0") == b"":
            break
        space = data.find(b" ", pos)
        try:
            length = int(data[pos:space]) if space > pos else 0
        except ValueError:
            length = 0
        record = data[space + 1 : pos + length]
        if (length <= 0 or pos + length > len(data) or not record.endswith(b"\n")
                or b"=" not in record):
            raise ValueError("malformed pax record")
        keyword, _, value = record[:-1].partition(b"=")
        records[keyword.decode("utf-8", "surrogateescape")] = value.decode(
            "utf-8", "surrogateescape"
        )
        pos += length
    return records


def normalize_member_name(name: str) -> str:
    """The member name as a relative path: leading ``./`` (repeated) and trailing ``/`` dropped;
    ``"."`` and ``"./"`` become ``""`` (the shard's own directory)."""
    while name.startswith("./"):
        name = name[2:]
    if name == ".":
        return ""
    return name.rstrip("/") if name.endswith("/") else name


async def scan_shard(
    backend: Backend, info: ObjectInfo, prefix: str = "", chunk: int = DEFAULT_CHUNK
) -> ShardScan:
    """Read shard ``info`` once, in order; every member's digest path, offset, size and hash.

    ``prefix`` (the shard's directory, ``""`` at the root) is joined to each member name:
    members land where extracting the shard in place would put them. Raises
    :class:`UsageError` for a compressed shard, :class:`CorruptObject` for one that is not
    a tar or is cut inside a header or a member's data. When the object is found to have
    changed size, returns at once with ``changed`` set.
    """
    reader = _Reader(backend, info.key, info.size, chunk)
    scan = ShardScan()
    long_name: str | None = None
    pax: dict[str, str] = {}
    first = True

    def corrupt(message: str) -> CorruptObject:
        return CorruptObject(
            f"{message}; fix or remove the shard, or build with --tar shards",
            url=backend.url,
            key=info.key,
        )

    while True:
        at = reader.pos
        block = await reader.take(BLOCK)
        if reader.changed:
            scan.changed = True
            return scan
        if not block or block == ZERO_BLOCK:
            break  # the object's end (a shard cut after its last member) or the end marker
        valid = len(block) == BLOCK and _checksum_ok(block)
        if first and not valid:
            # A small compressed file is shorter than one header: look at the magic first.
            for magic, what in COMPRESSION_MAGIC.items():
                if block.startswith(magic):
                    raise compressed_refusal(info.key, what)
        if len(block) < BLOCK:
            if block.strip(b"\0") == b"":
                break  # a cut end marker
            raise corrupt(f"not a complete tar: the object ends inside the header at offset {at}")
        if not valid:
            if first:
                raise corrupt("not a tar archive (no valid tar header at offset 0)")
            raise corrupt(f"bad tar header checksum at offset {at}")
        first = False
        kind = block[156:157]
        try:
            size = _number(block[124:136])
        except ValueError:
            raise corrupt(f"bad size field in the tar header at offset {at}") from None
        if kind in (b"L", b"K", b"x", b"g"):
            if size > MAX_EXTENDED_HEADER:
                raise corrupt(f"extended tar header of {size} bytes at offset {at}")
            data = await reader.take(size)
            if reader.changed:
                scan.changed = True
                return scan
            if len(data) < size:
                raise corrupt(f"not a complete tar: the object ends inside the header at {at}")
            await reader.feed(-size % BLOCK, None)
            if kind == b"L":
                long_name = _field_str(data)
            elif kind == b"x":
                try:
                    pax.update(_pax_records(data))
                except ValueError:
                    raise corrupt(f"malformed pax header at offset {at}") from None
            continue  # K (long link name) and g (global defaults) change nothing we keep

        if "size" in pax:
            try:
                size = int(pax["size"])
            except ValueError:
                raise corrupt(f"bad pax size at offset {at}") from None
        if "path" in pax:
            raw_name = pax["path"]
        elif long_name is not None:
            raw_name = long_name
        else:
            raw_name = _field_str(block[0:100])
            if block[257:263] == b"ustar\0":  # POSIX ustar: prefix + "/" + name
                head = _field_str(block[345:500])
                if head:
                    raw_name = f"{head}/{raw_name}"
        sparse = any(key.startswith("GNU.sparse.") for key in pax)
        long_name, pax = None, {}
        data_at = reader.pos

        # Old tars mark a directory by a regular entry whose name ends in "/".
        slash_dir = kind in _REGULAR and raw_name.endswith("/")
        is_file = kind in _REGULAR and not sparse and not slash_dir
        is_dir = kind == b"5" or (slash_dir and size == 0)
        hasher = blake3.blake3() if is_file else None
        # As tarfile does: a link's, device's or directory's size field says nothing about
        # blocks after it; every other entry (files, sparse files, unknown types) has data.
        if kind not in _NO_DATA:
            got = await reader.feed(size, hasher)
            if reader.changed:
                scan.changed = True
                return scan
            if got < size:
                raise corrupt(
                    f"not a complete tar: the object ends inside member {raw_name!r} "
                    f"(offset {data_at}, {size} bytes)"
                )
            await reader.feed(-size % BLOCK, None)  # padding; may be missing at the very end
            if reader.changed:
                scan.changed = True
                return scan

        if not is_file and not is_dir:
            if sparse:
                reason = "GNU sparse file (not supported)"
            elif slash_dir:
                reason = f"a directory name holding {size} bytes of data"
            else:
                reason = _SKIPPED_TYPES.get(kind, f"unknown tar entry type {kind!r}")
            scan.skipped.append((raw_name, reason))
            continue
        name = normalize_member_name(raw_name)
        path = f"{prefix}/{name}" if prefix and name else (name or prefix)
        if not path:
            continue  # "./": the root itself
        problem = path_problem(path)
        if problem:
            scan.skipped.append((raw_name, problem))
            continue
        if is_dir:
            member = Member(path, True, data_at, 0, None)
        else:
            assert hasher is not None
            member = Member(path, False, data_at, size, hasher.digest())
        earlier = scan.members.get(path)
        if earlier is not None and not (earlier.is_dir and member.is_dir):
            scan.duplicates += 1
            if len(scan.duplicate_examples) < 5:
                scan.duplicate_examples.append(path)
        if earlier is not None:
            del scan.members[path]  # re-inserted last, so order stays that of the tar
        scan.members[path] = member

    scan.read_to_end = reader.eof
    return scan
