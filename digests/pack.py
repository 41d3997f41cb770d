"""``digests pack``: repack a dataset into shuffled tar chunks, and a digest that points into them.

Brand's chunk generation (papers/brand-batched-random-access.txt §3.2): shuffle the whole
dataset once with a seeded RNG, cut the shuffled sequence into chunks of ``chunk_size`` files
(64 in the paper), and store each chunk as one object, so that one request fetches many small
files and every chunk is a uniform random sample of the dataset. Here a chunk is a plain,
uncompressed tar (``chunk-000000.tar`` ... under the destination; members named by their
original relative paths, so ``tar tf`` and WebDataset tools read them), and the new digest
keeps every file's original path, size and hash with a location inside its chunk (key = the
chunk, offset = the member's data). The dataset id is therefore the loose digest's.

The layout of every chunk is fixed by the plan before any byte is read: tar headers are
deterministic (mode 0644, mtime 0, no owner names; a pax record only for a name that is not
ASCII or longer than ustar's 100 bytes), so member offsets and chunk sizes are known up front, the same digest, seed and chunk
size give byte-identical chunks, and a chunk object of the planned size is a complete one.

Input: the files of a source digest (``digest=``: the fast path, nothing is hashed), read
through ``SOURCE_URL`` at the digest's keys and offsets; or, without one, a digest built from
``SOURCE_URL`` first (``digests build``, into ``OUT.pack-source``, resumable on its own). Every
file's bytes are checked against its hash before they are packed: wrong bytes are never packed.

State and resume: the plan (seed, chunk size, every member's chunk and offsets) is written once
to ``OUT.pack-partial`` (SQLite, created under a temporary name and renamed, so it exists only
complete), and the destination gets a small manifest (``quiverfs-pack.json``: format, dataset
id, seed, chunk size, chunk count, plan id) before the first chunk. A rerun of the same command
reads the plan, lists the destination and skips every chunk whose object has the planned size
(writes are whole-object puts, so an object of that size under a matching manifest is a
finished chunk, even one written just before a crash and never recorded). Crash states:
``OUT.pack-source`` and its partial (hashing; a rerun resumes the build); ``OUT.pack-partial``
without ``OUT`` (a rerun writes the missing chunks); ``OUT`` complete with the partial still
there (a rerun writes no chunk and rewrites ``OUT`` from the plan).

Why one module of ~720 lines: the plan, the tar layout it fixes and the resumable writer
that follows it are one contract (offsets in the plan are the bytes the writer emits); split
apart, each half would have to restate the other's rules.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import secrets
import sqlite3
import tarfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from urllib.parse import unquote

import blake3
import trio

from digests.build import build
from digests.digest import Digest
from digests.progress import Progress
from digests.write import NewFile, write_digest
from quiverfs.base.backends import (
    Backend,
    BackendOptions,
    RemoteSettings,
    normalize_url,
    open_backend,
)
from quiverfs.base.backends.base import DEFAULT_CHUNK
from quiverfs.base.errors import CorruptObject, NotFound, UsageError, first_error

#: Files per chunk by default: the paper's choice (§3.2, measured in its §5.5).
DEFAULT_CHUNK_SIZE = 64
#: Object name of chunk ``i`` under the destination.
CHUNK_KEY = "chunk-{:06d}.tar"
#: The destination's record of the pack it holds, written before the first chunk.
MANIFEST_KEY = "quiverfs-pack.json"
#: Names the tar layout and the manifest; part of the plan id, so chunks of another layout are
#: never taken for finished ones.
PACK_FORMAT = "quiverfs-pack-1"
#: A chunk is one PUT and is held in memory while it is written: S3 takes at most 5 GB in one.
MAX_CHUNK_BYTES = 4 << 30
#: Member metadata, the same for every member (reproducible chunks).
MEMBER_MODE = 0o644
MEMBER_MTIME = 0
#: tar's block; the archive ends with two zero blocks.
BLOCK = tarfile.BLOCKSIZE
#: Hash buffers at least this big in a worker thread (as digests/build.py does).
THREAD_HASH_BYTES = 1 << 20

STATE_SCHEMA = """
-- source, dest, dataset_id, seed, chunk_size, plan_id: what the plan was made from.
CREATE TABLE pack (key TEXT PRIMARY KEY, value TEXT NOT NULL) WITHOUT ROWID;
-- Every file in shuffled order. chunk = position // chunk_size; src_key/src_offset: where the
-- bytes are read (relative to the source URL); data_offset: where they start in the chunk.
CREATE TABLE members (
    position INTEGER PRIMARY KEY, chunk INTEGER NOT NULL, path TEXT NOT NULL,
    size INTEGER NOT NULL, hash BLOB NOT NULL, src_key TEXT NOT NULL,
    src_offset INTEGER NOT NULL, data_offset INTEGER NOT NULL
);
-- Every chunk: its object key and exact size in bytes; written = 1 once a run wrote it.
CREATE TABLE chunks (
    chunk INTEGER PRIMARY KEY, key TEXT NOT NULL, size INTEGER NOT NULL, written INTEGER NOT NULL
);
-- Directories of the source that hold nothing: they are part of the dataset id.
CREATE TABLE dirs (path TEXT PRIMARY KEY) WITHOUT ROWID;
"""


@dataclass(frozen=True, slots=True)
class Member:
    """One file of a chunk: what it is, where it is read, where its bytes land in the chunk."""

    path: str
    size: int
    hash: bytes
    src_key: str
    src_offset: int
    #: Offset of the member's data (after its header) in the chunk object.
    data_offset: int = 0


@dataclass(slots=True)
class Chunk:
    """One planned chunk: its object key, members in tar order, and exact size in bytes."""

    index: int
    key: str
    members: list[Member]
    size: int


@dataclass
class PackResult:
    """What a pack did. ``written_chunks`` were put by this run, ``reused_chunks`` found
    finished in the destination; ``hashed_source``: the source was hashed first (no
    ``digest=`` given)."""

    out: str
    dest: str
    dataset_id: str = ""
    seed: int = 0
    chunk_size: int = 0
    plan_id: str = ""
    chunks: int = 0
    files: int = 0
    total_bytes: int = 0
    chunk_bytes: int = 0
    written_chunks: int = 0
    reused_chunks: int = 0
    written_bytes: int = 0
    resumed: bool = False
    hashed_source: bool = False
    empty_dirs: list[str] = field(default_factory=list)


# -- the plan (pure) ---------------------------------------------------------------------------


def member_header(path: str, size: int) -> bytes:
    """The tar header block(s) of a member: ustar, preceded by a pax record for a name that
    is not ASCII or longer than ustar's 100 bytes (and a size of 8 GiB or more)."""
    info = tarfile.TarInfo(path)
    info.size = size
    info.mode = MEMBER_MODE
    info.mtime = MEMBER_MTIME
    info.type = tarfile.REGTYPE
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape")


def _padding(size: int) -> int:
    return -size % BLOCK


def layout(index: int, members: Iterable[Member]) -> Chunk:
    """Chunk ``index`` of ``members`` in this order, with each member's data offset."""
    placed = []
    offset = 0
    for member in members:
        offset += len(member_header(member.path, member.size))
        placed.append(
            Member(member.path, member.size, member.hash, member.src_key, member.src_offset, offset)
        )
        offset += member.size + _padding(member.size)
    return Chunk(index, CHUNK_KEY.format(index), placed, offset + 2 * BLOCK)


def plan_chunks(files: list[Member], seed: int, chunk_size: int) -> list[Chunk]:
    """Shuffle ``files`` with ``random.Random(seed)`` and cut them into chunks of
    ``chunk_size`` (the last one may be smaller). ``files`` should come in a fixed order
    (canonical): the plan is then a function of the dataset, the seed and the chunk size."""
    if chunk_size < 1:
        raise UsageError(f"--chunk-size must be at least 1: {chunk_size}")
    order = list(files)
    random.Random(seed).shuffle(order)
    return [
        layout(i, order[start : start + chunk_size])
        for i, start in enumerate(range(0, len(order), chunk_size))
    ]


def plan_id(dataset_id: str, seed: int, chunk_size: int, chunks: Iterable[Chunk]) -> str:
    """A hash of the whole plan: format, dataset, seed, chunk size, every chunk's members."""
    hasher = blake3.blake3(f"{PACK_FORMAT}\n{dataset_id}\n{seed}\n{chunk_size}\n".encode())
    for chunk in chunks:
        hasher.update(f"{chunk.key}\0{chunk.size}\0".encode())
        for m in chunk.members:
            hasher.update(m.path.encode("utf-8", "surrogateescape") + b"\0")
            hasher.update(m.size.to_bytes(8, "big") + m.hash)
    return hasher.hexdigest()


def tar_bytes(chunk: Chunk, contents: list[bytes]) -> bytes:
    """The chunk object: each member's header, data and padding, then two zero blocks."""
    out = bytearray()
    for member, data in zip(chunk.members, contents, strict=True):
        out += member_header(member.path, member.size)
        if len(out) != member.data_offset or len(data) != member.size:
            raise AssertionError(f"chunk {chunk.key}: member {member.path!r} off its plan")
        out += data
        out += bytes(_padding(member.size))
    out += bytes(2 * BLOCK)
    if len(out) != chunk.size:
        raise AssertionError(f"chunk {chunk.key}: {len(out)} bytes, planned {chunk.size}")
    return bytes(out)


# -- the command ------------------------------------------------------------------------------


async def pack(
    source: str | Backend,
    dest: str | Backend,
    out: str | os.PathLike[str] | None = None,
    *,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    seed: int | None = None,
    digest: str | os.PathLike[str] | None = None,
    workers: int = 16,
    progress: Callable[[str], Progress] | None = None,
    settings: RemoteSettings | None = None,
    options: BackendOptions | None = None,
) -> PackResult:
    """Pack the files of ``source`` into shuffled tar chunks under ``dest``; write their
    digest to ``out`` (default: ``NAME.qd`` in the current directory, NAME the last part of
    ``dest``). Resume if interrupted: rerun with the same arguments.

    ``digest`` is a digest of ``source`` (exactly one source; its keys and offsets are read
    relative to ``source``, like ``digests build --location``); without it the source is
    hashed first. ``seed`` (default: random, then recorded) fixes the shuffle. ``workers``
    bounds the reads in flight and the chunks being assembled or written (each held in
    memory). ``source`` and ``dest`` are URLs (opened with ``settings``/``options``, closed at
    the end) or open :class:`Backend` objects (left open). ``progress(label)`` makes the
    reporter of each phase, when it starts: ``"hash"`` (hashing the source) and ``"pack"``;
    each is closed when its phase ends, or aborted when it fails (only one draws at a time).

    Raises :class:`UsageError` for a chunk size or worker count below 1, a destination equal
    to or inside the source, a destination that holds anything but this pack, or a state file
    of another pack; :class:`CorruptObject` when a file's bytes do not match its hash.
    """
    if chunk_size < 1:
        raise UsageError(f"--chunk-size must be at least 1: {chunk_size}")
    if workers < 1:
        raise UsageError(f"--workers must be at least 1: {workers}")
    if seed is not None and seed < 0:
        raise UsageError(f"--seed must be a non-negative integer: {seed}")
    source_url = source.url if isinstance(source, Backend) else normalize_url(source)
    dest_url = dest.url if isinstance(dest, Backend) else normalize_url(dest)
    _check_not_nested(source_url, dest_url)
    out = os.fspath(out) if out is not None else default_out(dest_url)
    parent = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(parent):
        raise UsageError(f"output directory does not exist: {parent}")
    reporter = progress or (lambda label: Progress())
    result = PackResult(out=out, dest=dest_url, chunk_size=chunk_size)

    async with contextlib.AsyncExitStack() as stack:
        if isinstance(source, Backend):
            src = source
        else:
            src = open_backend(source_url, options, settings)
            stack.push_async_callback(src.aclose)
        if isinstance(dest, Backend):
            dst = dest
        else:
            if dest_url.startswith("file://"):
                # A file:// destination is a directory we may create; a bucket must exist.
                os.makedirs(_file_path(dest_url), exist_ok=True)
            dst = open_backend(dest_url, options, settings)
            stack.push_async_callback(dst.aclose)
        state_path = out + ".pack-partial"
        if os.path.exists(state_path):
            result.resumed = True
        else:
            # Before hours of hashing: a destination that cannot take this pack is refused.
            await _precheck_dest(dst, chunk_size, seed)
            digest_path = await _source_digest(src, digest, out, reporter, result)
            await trio.to_thread.run_sync(
                _make_state, state_path, digest_path, source_url, dest_url, chunk_size, seed
            )
        state = sqlite3.connect(state_path)
        stack.callback(state.close)
        chunks = _load_state(state, state_path, source_url, dest_url, chunk_size, seed, digest)
        meta = dict(state.execute("SELECT key, value FROM pack"))
        result.seed = int(meta["seed"])
        result.plan_id = meta["plan_id"]
        result.dataset_id = meta["dataset_id"]
        result.chunks = len(chunks)
        result.files = sum(len(c.members) for c in chunks)
        result.total_bytes = _payload(chunks)
        result.chunk_bytes = sum(c.size for c in chunks)
        result.empty_dirs = [path for (path,) in state.execute("SELECT path FROM dirs")]

        manifest = _manifest(meta, len(chunks))
        present = await _check_dest(dst, chunks, manifest)
        if MANIFEST_KEY not in present:
            await dst.write_object(MANIFEST_KEY, json.dumps(manifest, indent=1).encode() + b"\n")

        todo = [chunk for chunk in chunks if present.get(chunk.key) != chunk.size]
        done = [chunk for chunk in chunks if present.get(chunk.key) == chunk.size]
        state.executemany(
            "UPDATE chunks SET written = 1 WHERE chunk = ?", ((c.index,) for c in done)
        )
        state.commit()
        result.reused_chunks = len(done)
        with _reporting(reporter("pack")) as bar:
            bar.add_total(result.files, result.total_bytes)
            bar.totals_known()
            bar.advance(sum(len(c.members) for c in done), _payload(done))
            await _write_chunks(src, dst, state, todo, workers, bar, result)

    dataset_id = await trio.to_thread.run_sync(_finalize, state_path, out, dest_url)
    if dataset_id != result.dataset_id:
        raise AssertionError(
            f"packed digest {out} has dataset id {dataset_id}, the source {result.dataset_id}"
        )
    os.unlink(state_path)
    _remove_source_digest(out)
    return result


@contextlib.contextmanager
def _reporting(progress: Progress) -> Iterator[Progress]:
    """``progress``, closed when the block ends, aborted when it fails."""
    try:
        yield progress
    except BaseException:
        progress.abort()
        raise
    progress.close()


def _payload(chunks: Iterable[Chunk]) -> int:
    """Bytes of the files in ``chunks`` (headers and padding not counted)."""
    return sum(m.size for chunk in chunks for m in chunk.members)


def default_out(dest_url: str) -> str:
    """``NAME.qd`` for a destination (URL or path) whose last path part (or bucket) is NAME."""
    tail = normalize_url(dest_url).split("://", 1)[1].rstrip("/")
    name = tail.rsplit("/", 1)[-1] or "packed"
    return f"{name}.qd"


def _file_path(url: str) -> str:
    return unquote(url[len("file://") :])


def _check_not_nested(source_url: str, dest_url: str) -> None:
    """Refuse a destination equal to or inside the source: its chunks would become files of
    the source (and a rebuild of the source's digest would hash them)."""
    a, b = source_url, dest_url
    if a.startswith("file://") and b.startswith("file://"):
        a = "file://" + os.path.realpath(_file_path(a))
        b = "file://" + os.path.realpath(_file_path(b))
    if b == a or b.startswith(a.rstrip("/") + "/"):
        raise UsageError(
            f"DEST_URL {dest_url} is {'the source' if b == a else 'inside the source'} "
            f"{source_url}: pack into a location outside it"
        )


async def _source_digest(
    src: Backend,
    digest: str | os.PathLike[str] | None,
    out: str,
    reporter: Callable[[str], Progress],
    result: PackResult,
) -> str:
    """The path of the source's digest: the one given, or one built now (resumable)."""
    if digest is not None:
        return os.fspath(digest)
    built = out + ".pack-source"
    if os.path.exists(built) and not os.path.exists(built + ".partial"):
        # Left by a run that stopped after hashing and before planning: reuse it if it is
        # this source's.
        with Digest.open(built) as d:
            if list(d.sources.values()) == [src.url]:
                return built
    with _reporting(reporter("hash")) as bar:
        await build(src, built, progress=bar)
    result.hashed_source = True
    return built


def _remove_source_digest(out: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(out + ".pack-source")


def _make_state(
    state_path: str,
    digest_path: str,
    source_url: str,
    dest_url: str,
    chunk_size: int,
    seed: int | None,
) -> None:
    """Plan the pack from the source digest and write ``state_path`` (in a worker thread).

    Written under a temporary name and renamed: the state file exists only complete.
    """
    with Digest.open(digest_path, check="rows") as d:
        sources = list(d.sources.values())
        if len(sources) != 1:
            raise UsageError(
                f"{digest_path} names {len(sources)} sources; pack reads a digest of one source"
            )
        files = [
            Member(f.path, f.size, f.hash, f.location.key, f.location.offset)
            for f in d.iter_files()
        ]
        dirs = d.empty_dirs()
        dataset_id = d.dataset_id
    if seed is None:
        seed = secrets.randbits(32)
    chunks = plan_chunks(files, seed, chunk_size)
    for chunk in chunks:
        if chunk.size > MAX_CHUNK_BYTES:
            raise UsageError(
                f"chunk {chunk.index} would hold {chunk.size} bytes, more than a chunk may "
                f"({MAX_CHUNK_BYTES} bytes, one PUT): use a smaller --chunk-size"
            )
    meta = {
        "format": PACK_FORMAT,
        "source": source_url,
        "dest": dest_url,
        "dataset_id": dataset_id,
        "seed": str(seed),
        "chunk_size": str(chunk_size),
        "plan_id": plan_id(dataset_id, seed, chunk_size, chunks),
    }
    tmp = f"{state_path}.tmp-{os.getpid()}"
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)
    db = sqlite3.connect(tmp)
    try:
        db.executescript(STATE_SCHEMA)
        db.executemany("INSERT INTO pack VALUES (?, ?)", meta.items())
        db.executemany(
            "INSERT INTO members VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            _member_rows(chunks, chunk_size),
        )
        db.executemany(
            "INSERT INTO chunks VALUES (?, ?, ?, 0)", ((c.index, c.key, c.size) for c in chunks)
        )
        db.executemany("INSERT INTO dirs VALUES (?)", ((path,) for path in dirs))
        db.commit()
    finally:
        db.close()
    os.replace(tmp, state_path)


def _member_rows(chunks: list[Chunk], chunk_size: int) -> Iterator[tuple]:
    for chunk in chunks:
        for i, m in enumerate(chunk.members):
            yield (
                chunk.index * chunk_size + i, chunk.index, m.path, m.size, m.hash, m.src_key,
                m.src_offset, m.data_offset,
            )


def _load_state(
    db: sqlite3.Connection,
    state_path: str,
    source_url: str,
    dest_url: str,
    chunk_size: int,
    seed: int | None,
    digest: str | os.PathLike[str] | None,
) -> list[Chunk]:
    """The plan in ``state_path``, after checking that it is this command's."""
    try:
        meta = dict(db.execute("SELECT key, value FROM pack"))
    except sqlite3.Error as exc:
        raise UsageError(
            f"{state_path} is not a pack's state ({exc}): delete it to start over"
        ) from None
    start_over = f"rerun that command to resume it, or delete {state_path} to start over"
    if meta.get("format") != PACK_FORMAT:
        raise UsageError(f"{state_path} is from another version of digests pack: delete it")
    if (meta["source"], meta["dest"]) != (source_url, dest_url):
        raise UsageError(
            f"{state_path} belongs to another pack ({meta['source']} to {meta['dest']}); "
            + start_over
        )
    if int(meta["chunk_size"]) != chunk_size or (seed is not None and int(meta["seed"]) != seed):
        raise UsageError(
            f"{state_path} holds a pack with --chunk-size {meta['chunk_size']} --seed "
            f"{meta['seed']}; " + start_over
        )
    if digest is not None:
        with Digest.open(digest) as d:
            if d.dataset_id != meta["dataset_id"]:
                raise UsageError(
                    f"{state_path} packs dataset {meta['dataset_id']}, not {digest} "
                    f"({d.dataset_id}); " + start_over
                )
    chunks = {
        index: Chunk(index, key, [], size)
        for index, key, size in db.execute("SELECT chunk, key, size FROM chunks ORDER BY chunk")
    }
    for chunk, path, size, content_hash, src_key, src_offset, data_offset in db.execute(
        "SELECT chunk, path, size, hash, src_key, src_offset, data_offset FROM members "
        "ORDER BY position"
    ):
        chunks[chunk].members.append(
            Member(path, size, content_hash, src_key, src_offset, data_offset)
        )
    return list(chunks.values())


def _manifest(meta: dict[str, str], chunks: int) -> dict:
    return {
        "format": PACK_FORMAT,
        "dataset_id": meta["dataset_id"],
        "seed": int(meta["seed"]),
        "chunk_size": int(meta["chunk_size"]),
        "chunks": chunks,
        "plan_id": meta["plan_id"],
    }


async def _precheck_dest(dst: Backend, chunk_size: int, seed: int | None) -> None:
    """Refuse, with one HEAD and at most one LIST page, a destination that holds another pack
    (another chunk size or seed, or no seed given to resume it) or objects but no pack.
    :func:`_check_dest` checks the plan itself once it is made."""
    try:
        theirs = json.loads(await dst.read(MANIFEST_KEY))
    except NotFound:
        theirs = None
    except ValueError:
        theirs = {}
    if theirs is None:
        async for info in dst.list():
            if _leftover(dst, info.key):
                continue
            raise UsageError(
                f"{dst.url} is not empty (e.g. {info.key!r}) and holds no pack manifest "
                f"({MANIFEST_KEY}): pack into an empty location, or delete its objects to "
                "start over"
            )
        return
    if theirs.get("chunk_size") != chunk_size or seed is None or theirs.get("seed") != seed:
        raise _another_pack(dst, theirs)


def _another_pack(dst: Backend, theirs: dict) -> UsageError:
    return UsageError(
        f"{dst.url} already holds another pack (seed {theirs.get('seed')}, chunk size "
        f"{theirs.get('chunk_size')}, dataset {theirs.get('dataset_id')}): rerun with that "
        "--seed and --chunk-size to resume it, or pack into an empty location (or delete its "
        "objects) to start over"
    )


def _leftover(dst: Backend, key: str) -> bool:
    """A ``file://`` write's temporary file left by a crash (``.NAME.tmp-*``): not an object."""
    name = key.rsplit("/", 1)[-1]
    return dst.scheme == "file" and name.startswith(".") and ".tmp-" in name


async def _check_dest(dst: Backend, chunks: list[Chunk], manifest: dict) -> dict[str, int]:
    """Key → size of what the destination already holds of this pack.

    The destination must be empty, or hold this pack's manifest and nothing but its chunks
    (``file://`` leftovers of an interrupted atomic write, ``.NAME.tmp-*``, are ignored).
    """
    ours = {chunk.key for chunk in chunks} | {MANIFEST_KEY}
    present: dict[str, int] = {}
    others: list[str] = []
    async for info in dst.list():
        if _leftover(dst, info.key):
            continue
        if info.key in ours:
            present[info.key] = info.size
        else:
            others.append(info.key)
    if MANIFEST_KEY in present:
        try:
            theirs = json.loads(await dst.read(MANIFEST_KEY))
        except ValueError:
            theirs = {}
        if theirs != manifest:
            raise _another_pack(dst, theirs)
        if others:
            raise UsageError(
                f"{dst.url} holds this pack and {len(others)} other objects (e.g. "
                f"{others[0]!r}): pack into an empty location"
            )
        return present
    if present or others:
        example = sorted(present)[0] if present else others[0]
        raise UsageError(
            f"{dst.url} is not empty ({len(present) + len(others)} objects, e.g. {example!r}) "
            f"and holds no pack manifest ({MANIFEST_KEY}): pack into an empty location, or "
            "delete its objects to start over"
        )
    return present


async def _write_chunks(
    src: Backend,
    dst: Backend,
    state: sqlite3.Connection,
    todo: list[Chunk],
    workers: int,
    progress: Progress,
    result: PackResult,
) -> None:
    """Read, verify, assemble and put every chunk of ``todo``; ``workers`` chunks at a time,
    ``workers`` reads in flight in all. A chunk is recorded as written once its put returns
    (SQLite from the trio thread only: code between two awaits is atomic)."""
    reads = trio.CapacityLimiter(workers)

    async def read_member(member: Member, contents: list[bytes], i: int) -> None:
        async with reads:
            contents[i] = await read_verified(src, member)

    async def one_chunk(chunk: Chunk) -> None:
        contents: list[bytes] = [b""] * len(chunk.members)
        async with trio.open_nursery() as nursery:
            for i, member in enumerate(chunk.members):
                nursery.start_soon(read_member, member, contents, i)
        data = await trio.to_thread.run_sync(tar_bytes, chunk, contents)
        del contents
        await dst.write_object(chunk.key, data)
        state.execute("UPDATE chunks SET written = 1 WHERE chunk = ?", (chunk.index,))
        state.commit()
        result.written_chunks += 1
        result.written_bytes += len(data)
        progress.advance(len(chunk.members), _payload([chunk]))

    async def worker(recv: trio.MemoryReceiveChannel[Chunk]) -> None:
        async with recv:
            async for chunk in recv:
                await one_chunk(chunk)

    send, recv = trio.open_memory_channel[Chunk](0)
    try:
        async with trio.open_nursery() as nursery:
            for _ in range(min(workers, len(todo)) or 1):
                nursery.start_soon(worker, recv.clone())
            await recv.aclose()
            async with send:
                for chunk in todo:
                    await send.send(chunk)
    except BaseExceptionGroup as group:
        raise first_error(group) from None


async def read_verified(src: Backend, member: Member) -> bytes:
    """The member's bytes from the source, checked against its hash (never pack wrong bytes)."""
    parts = []
    hasher = blake3.blake3()
    done = 0
    while done < member.size:
        want = min(DEFAULT_CHUNK, member.size - done)
        data = await src.read_range(member.src_key, member.src_offset + done, want)
        if not data:
            raise CorruptObject(
                f"object ends after {member.src_offset + done} bytes; the digest says "
                f"{member.path!r} has {member.size} bytes at offset {member.src_offset}: "
                "rebuild the source's digest",
                url=src.url,
                key=member.src_key,
            )
        if len(data) >= THREAD_HASH_BYTES:
            await trio.to_thread.run_sync(hasher.update, data)
        else:
            hasher.update(data)
        parts.append(data)
        done += len(data)
    if hasher.digest() != member.hash:
        raise CorruptObject(
            f"the content of {member.path!r} does not match the digest's hash (changed since "
            "the digest was built?): rebuild the source's digest",
            url=src.url,
            key=member.src_key,
        )
    return parts[0] if len(parts) == 1 else b"".join(parts)


def _finalize(state_path: str, out: str, dest_url: str) -> str:
    """Write the packed digest from the plan (in a worker thread); its dataset id."""
    db = sqlite3.connect(state_path)
    try:
        (missing,) = db.execute("SELECT count(*) FROM chunks WHERE written = 0").fetchone()
        if missing:
            raise AssertionError(f"{missing} chunks are not written")
        rows = (
            NewFile(path, size, content_hash, 0, key, offset)
            for path, size, content_hash, key, offset in db.execute(
                "SELECT m.path, m.size, m.hash, c.key, m.data_offset FROM members m "
                "JOIN chunks c ON c.chunk = m.chunk"
            )
        )
        dirs = [path for (path,) in db.execute("SELECT path FROM dirs")]
        return write_digest(out, rows, [dest_url], dirs=dirs)
    finally:
        db.close()
