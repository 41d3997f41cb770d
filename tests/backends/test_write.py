"""Whole-object writes (``Backend.write_object``), one contract over file://, moto (s3),
Azurite (az) and gcp-storage-emulator (gs) on loopback.

Every test writes under a root of its own next to the seeded ``root/`` (same bucket, container
or base directory), so the read-only contract suite never sees what was written here.
"""

from __future__ import annotations

import errno
import os
import uuid
from pathlib import Path
from urllib.parse import unquote

import pytest

from quiverfs.base.backends import Backend, BackendOptions, RemoteSettings
from quiverfs.base.errors import NotFound, PermanentFailure
from quiverfs.testing.faultproxy import FaultProxy

from .conftest import ROOT, OpenAt, Store
from .test_contract import FAST_RETRY, _faulty_file_method

pytestmark = pytest.mark.backends


def _fresh_root(store: Store) -> str:
    """A new, empty root URL on the store (for file://, an existing empty directory)."""
    assert store.url.endswith("/" + ROOT)
    url = store.url[: -len(ROOT)] + f"written-{uuid.uuid4().hex[:12]}"
    if store.scheme == "file":
        os.mkdir(unquote(url[len("file://") :]))
    return url


@pytest.fixture
def writer(store: Store, open_at: OpenAt) -> Backend:
    """A backend rooted at an empty root of the store, for writing."""
    return open_at(_fresh_root(store), store.options(), store.settings)


async def _keys(backend: Backend) -> list[str]:
    return [info.key async for info in backend.list()]


async def test_write_then_read_back(writer: Backend) -> None:
    data = os.urandom(70_000)
    await writer.write_object("chunk-000000.tar", data)
    assert (await writer.stat("chunk-000000.tar")).size == len(data)
    assert await writer.read("chunk-000000.tar") == data
    assert await writer.read_range("chunk-000000.tar", 1000, 24) == data[1000:1024]
    assert await _keys(writer) == ["chunk-000000.tar"]  # nothing else (no temporary files)
    assert writer.counters.requests["PUT"] == 1
    assert writer.counters.bytes_written == len(data)


async def test_overwrite_replaces_the_whole_object(writer: Backend) -> None:
    await writer.write_object("x.bin", b"first version, longer than the second")
    before = await writer.stat("x.bin")
    await writer.write_object("x.bin", b"second")
    after = await writer.stat("x.bin")
    assert after.size == 6
    assert await writer.read("x.bin") == b"second"
    assert after.version != before.version or writer.scheme == "file"  # mtime may tie
    assert await _keys(writer) == ["x.bin"]
    assert writer.counters.requests["PUT"] == 2


async def test_keys_with_subdirectories_unicode_and_empty_objects(writer: Backend) -> None:
    objects = {
        "a/b/c/deep.bin": os.urandom(3000),
        "a/b/sibling.txt": b"next to c/\n",
        "dir with space/naïve ☃.jpg": b"\xff\xd8" + os.urandom(100),
        "empty": b"",
    }
    for key, data in objects.items():
        await writer.write_object(key, data)
    assert await _keys(writer) == sorted(objects)
    for key, data in objects.items():
        assert await writer.read(key) == data
        assert (await writer.stat(key)).size == len(data)
    assert writer.counters.requests["PUT"] == len(objects)


async def test_write_to_a_missing_bucket_is_not_found(store: Store, open_at: OpenAt) -> None:
    backend = open_at(store.missing_url, store.options(), store.settings)
    with pytest.raises(NotFound) as failure:
        await backend.write_object("a/x.bin", b"data")
    assert failure.value.__cause__ is not None  # the SDK's (or the OS's) own error
    assert backend.counters.retries == 0  # NotFound is never retried
    assert backend.counters.bytes_written == 0
    if store.scheme == "file":  # the root is a bucket: a write never creates it
        assert not Path(unquote(store.missing_url[len("file://") :])).exists()


async def test_transient_fault_in_a_write_is_retried(
    store: Store, open_at: OpenAt, proxy: FaultProxy | None
) -> None:
    root = _fresh_root(store)
    if proxy is None:
        backend = open_at(root, store.options(retry=FAST_RETRY), store.settings)
        injected = _faulty_file_method(backend, "_write_object", 2)
    else:
        assert store.emulator is not None
        backend = open_at(root, store.options(retry=FAST_RETRY), store.emulator.settings(proxy.endpoint))
        proxy.arm("503", count=2)
        injected = lambda: proxy.faults_injected  # noqa: E731
    data = os.urandom(5000)
    await backend.write_object("sub/retried.bin", data)
    assert injected() == 2
    assert backend.counters.retries == 2
    assert backend.counters.requests["PUT"] == 3
    assert backend.counters.bytes_written == len(data)  # counted once
    if proxy is not None:
        proxy.disarm()
    assert await backend.read("sub/retried.bin") == data


async def test_file_write_is_atomic_and_leaves_no_temporary_file(
    tmp_path: Path, open_at: OpenAt, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = open_at(tmp_path.as_uri(), BackendOptions(concurrency=2), RemoteSettings())
    await backend.write_object("d/x.bin", b"old content")

    def failing_write(fd: int, data: object) -> int:
        raise OSError(errno.ENOSPC, "No space left on device (injected)")

    with monkeypatch.context() as patch:
        patch.setattr(os, "write", failing_write)
        with pytest.raises(PermanentFailure, match="no space left on device"):
            await backend.write_object("d/x.bin", b"new content that never lands")
    assert (tmp_path / "d" / "x.bin").read_bytes() == b"old content"
    assert sorted(os.listdir(tmp_path / "d")) == ["x.bin"]  # the temporary file is gone
    mode = (tmp_path / "d" / "x.bin").stat().st_mode & 0o777
    umask = os.umask(0)
    os.umask(umask)
    assert mode == 0o666 & ~umask


async def test_write_refuses_a_key_that_leaves_the_root(tmp_path: Path, open_at: OpenAt) -> None:
    (tmp_path / "root").mkdir()
    backend = open_at((tmp_path / "root").as_uri(), BackendOptions(), RemoteSettings())
    with pytest.raises(PermanentFailure, match="leaves the root"):
        await backend.write_object("../outside.bin", b"x")
    assert not (tmp_path / "outside.bin").exists()
    with pytest.raises(ValueError):
        await backend.write_object("dir/", b"x")
