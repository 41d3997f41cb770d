"""Descriptor hand-off (the ``open`` operation) against a real mountd over its socket.

mountd opens the store files of cached hashes and sends the descriptors (``SCM_RIGHTS``) in
one answer: they read the exact cached bytes; a hash not cached, or asked with another size,
gets none; every descriptor is one hit of the dataset and the caller's uid (and refreshes
LRU recency); nothing leaks in mountd or in the client, whatever the client does; a user of
another uid gets a private store's files this way. Assertions are on bytes, counts, errno.
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from mountd.errors import ProtocolError
from mountd.rpc import protocol
from mountd.rpc.async_client import open_client
from mountd.rpc.client import SyncClient
from mountd.store import layout
from quiverfs.testing.mountd import SampleFile, location, make_dataset, running_mountd, wait_until
from quiverfs.testing.soak import fd_count
from quiverfs.testing.users import LocalUsers, run_as, traversable_tmpdir

MISSING = [bytes([0xEE]) * 31 + bytes([i]) for i in range(4)]  # never cached


@pytest.fixture(scope="module")
def workdir() -> Iterator[Path]:
    path = traversable_tmpdir("quiverfs-handoff-")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def dataset(workdir: Path) -> tuple[str, list[SampleFile]]:
    return make_dataset(workdir / "remote", 16, size=5000)


@pytest.fixture(scope="module")
def daemon(workdir: Path, dataset):
    """A mountd whose store holds the first 12 files of the dataset (the last 4 never)."""
    url, files = dataset
    with running_mountd(workdir / "cache") as daemon:
        fill(daemon.cache_dir, url, files[:12])
        yield daemon


def fill(cache_dir: Path, url: str, files: list[SampleFile]) -> None:
    with SyncClient.connect(cache_dir) as client:
        for f in files:
            client.ensure(f.hash, f.size, location(url, f))


def read_all(fd: int) -> bytes:
    """Everything in a descriptor, from offset 0 (it is not closed)."""
    chunks, offset = [], 0
    while chunk := os.pread(fd, 1 << 16, offset):
        chunks.append(chunk)
        offset += len(chunk)
    return b"".join(chunks)


def close_opened(opened) -> None:
    for item in opened:
        if item is not None:
            os.close(item[0])



def counters(client: SyncClient, dataset: str) -> tuple[dict, dict]:
    """The dataset's cache counters and this uid's request counters."""
    stats = client.stats()
    return (stats["counters"]["datasets"].get(dataset, {"hits": 0, "misses": 0, "bytes_from_cache": 0}),
            stats["users"].get(str(os.getuid()), {}))


# -- what the descriptors give ----------------------------------------------------------------


def test_descriptors_read_the_cached_bytes_and_missing_hashes_get_none(daemon, dataset) -> None:
    _, files = dataset
    asked = [files[0].hash, MISSING[0], files[5].hash, files[13].hash, files[11].hash, files[0].hash]
    with SyncClient.connect(daemon.cache_dir) as client:
        opened = client.open(asked)
    try:
        assert [item is None for item in opened] == [False, True, False, True, False, False]
        for (fd, size), f in zip([opened[i] for i in (0, 2, 4, 5)], [files[i] for i in (0, 5, 11, 0)],
                                 strict=True):
            assert size == f.size and read_all(fd) == f.data
            assert fcntl.fcntl(fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC  # not inherited by children
            with pytest.raises(OSError) as info:
                os.write(fd, b"x")  # opened read-only
            assert info.value.errno == errno.EBADF
        # Two descriptors of one hash are two opens of the same store file.
        assert opened[0][0] != opened[5][0]
        assert os.fstat(opened[0][0]).st_ino == os.stat(layout.store_path(daemon.cache_dir, files[0].hash)).st_ino
    finally:
        close_opened(opened)


def test_each_descriptor_is_one_hit_of_the_dataset_and_the_caller(daemon, dataset) -> None:
    _, files = dataset
    name = "ds-hits"
    asked = [files[1].hash, files[2].hash, MISSING[1], files[3].hash, files[1].hash, files[14].hash]
    handed = [files[1], files[2], files[3], files[1]]
    with SyncClient.connect(daemon.cache_dir) as client:
        before, user_before = counters(client, name)
        opened = client.open(asked, name)
        close_opened(opened)
        after, user_after = counters(client, name)
        refs = client.usage()["datasets"][name]
    assert sum(item is not None for item in opened) == len(handed)
    assert after["hits"] - before["hits"] == len(handed)
    assert after["bytes_from_cache"] - before["bytes_from_cache"] == sum(f.size for f in handed)
    assert after["misses"] == before["misses"]  # a hash not cached is no miss: nobody fetched it
    delta = {k: user_after[k] - user_before.get(k, 0)
             for k in ("opens", "opened", "reported_hits", "reported_hit_bytes", "ensures")}
    assert delta == {"opens": 1, "opened": 4, "reported_hits": 4,
                     "reported_hit_bytes": sum(f.size for f in handed), "ensures": 0}
    assert refs["entries"] == 3  # the dataset now references the three distinct files


def test_a_size_that_is_not_the_contents_gets_no_descriptor_and_no_hit(daemon, dataset) -> None:
    _, files = dataset
    name = "ds-sizes"
    with SyncClient.connect(daemon.cache_dir) as client:
        before, _ = counters(client, name)
        opened = client.open([files[4].hash, files[6].hash], name, sizes=[files[4].size + 1, files[6].size])
        close_opened(opened)
        after, _ = counters(client, name)
    assert opened[0] is None and opened[1] is not None and opened[1][1] == files[6].size
    assert after["hits"] - before["hits"] == 1


def test_opening_refreshes_lru_recency(workdir, dataset) -> None:
    """A cache of three files: the one handed over survives the next fill, the oldest other
    one is evicted (as a reported hit would have it)."""
    url, files = dataset
    with running_mountd(workdir / "small", cache_size="15K") as small:
        fill(small.cache_dir, url, files[:3])
        with SyncClient.connect(small.cache_dir) as client:
            # Files whose path ensure answered are held from eviction for a moment
            # (mountd/store/holds.py); this test is about the order after that.
            wait_until(lambda: client.usage()["held"] == 0, 10, "the fills' holds to end")
            close_opened(client.open([files[0].hash]))
            client.ensure(files[3].hash, files[3].size, location(url, files[3]))
            assert client.usage()["entries"] == 3
        present = [layout.store_path(small.cache_dir, f.hash).exists() for f in files[:4]]
    assert present == [True, False, True, True]


def test_malformed_open_requests_are_refused_and_the_connection_lives(daemon, dataset) -> None:
    _, files = dataset
    good = files[7].hash.hex()
    bad_requests = [
        ({"hashes": [good] * (protocol.MAX_OPEN + 1)}, "at most 64"),
        ({"hashes": ["xyz"]}, "hex digits"),
        ({"hashes": [good], "sizes": [1, 2]}, "one size per hash"),
        ({"hashes": [good], "sizes": [-1]}, "at least 0"),
        ({"hashes": good}, "must be a list"),
        ({"hashes": [good], "mode": "w"}, "unknown arguments"),
    ]
    with SyncClient.connect(daemon.cache_dir) as client:
        for args, match in bad_requests:
            with pytest.raises(ProtocolError, match=match):
                client.call("open", args)
        with pytest.raises(ValueError):  # the client does not even send it
            client.open([files[7].hash] * (protocol.MAX_OPEN + 1))
        opened = client.open([files[7].hash] * protocol.MAX_OPEN)  # a full batch is fine
        try:
            assert all(read_all(fd) == files[7].data for fd, _ in opened)
        finally:
            close_opened(opened)


def test_the_async_client_matches_descriptors_to_their_answers(daemon, dataset) -> None:
    """Many opens in flight on one connection, answered in any order, interleaved with
    answers that carry none, and some cancelled: each answer gets its own descriptors."""
    _, files = dataset
    cached = files[:12]

    async def main() -> None:
        async with open_client(daemon.cache_dir) as client:

            async def one(i: int) -> None:
                picks = [cached[(i + k) % 12] for k in range(1 + i % 7)]
                asked = [f.hash for f in picks] + [MISSING[i % 4]]
                opened = await client.open(asked, "ds-async")
                try:
                    assert opened[-1] is None
                    assert [read_all(fd) for fd, _ in opened[:-1]] == [f.data for f in picks]
                finally:
                    close_opened(opened)

            async def cancelled(i: int) -> None:
                with trio.move_on_after(0):
                    close_opened(await client.open([cached[i % 12].hash] * 8))

            async with trio.open_nursery() as nursery:
                for i in range(40):
                    nursery.start_soon(one, i)
                    nursery.start_soon(client.stats)
                    if i % 5 == 0:
                        nursery.start_soon(cancelled, i)
            await one(99)  # the connection still matches after all that

    baseline = fd_count()
    trio.run(main)
    assert fd_count() == baseline


# -- no descriptor leaks --------------------------------------------------------------------


def test_many_calls_leak_no_descriptor_in_mountd_or_the_client(daemon, dataset) -> None:
    _, files = dataset
    asked = [f.hash for f in files] * 4  # 64: 48 cached, 16 not
    with SyncClient.connect(daemon.cache_dir) as client:
        client.stats()  # the connection is served: its descriptors in mountd are open
        mountd_before, mine_before = fd_count(daemon.proc.pid), fd_count()
        for _ in range(200):
            opened = client.open(asked)
            assert sum(item is not None for item in opened) == 48
            close_opened(opened)
        with pytest.raises(ProtocolError):
            client.call("open", {"hashes": ["bad"]})
        assert fd_count() == mine_before
        # mountd closes its copies just after sending: the answer may come first.
        wait_until(lambda: fd_count(daemon.proc.pid) == mountd_before, 10,
                   f"mountd's descriptors back to {mountd_before}")


def _raw_connection(cache_dir: Path) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(os.fspath(layout.socket_path(cache_dir)))
    return sock


def test_clients_that_leave_mid_reply_leak_nothing_in_mountd(daemon, dataset) -> None:
    _, files = dataset
    hashes = [f.hash.hex() for f in files[:12]] * 5 + [f.hash.hex() for f in files[:4]]  # 64
    requests = b"".join(protocol.encode_frame(protocol.make_request(i, "open", {"hashes": hashes}))
                        for i in range(1, 41))
    with SyncClient.connect(daemon.cache_dir) as client:
        connections = client.stats()["server"]["connections"]
        baseline = fd_count(daemon.proc.pid)
        # 1. Asks for 40 × 64 descriptors and leaves without reading a byte.
        sock = _raw_connection(daemon.cache_dir)
        sock.sendall(requests)
        sock.close()
        # 2. Reads a few bytes of the first answer without room for descriptors (the kernel
        #    drops them), then leaves.
        sock = _raw_connection(daemon.cache_dir)
        sock.sendall(requests)
        assert len(sock.recv(10)) > 0
        sock.close()
        # 3. Takes the first answer's descriptors, then leaves with the rest unread.
        sock = _raw_connection(daemon.cache_dir)
        sock.sendall(requests)
        _, fds, _, _ = socket.recv_fds(sock, 100, protocol.MAX_OPEN)
        assert len(fds) == 64
        for fd in fds:
            os.close(fd)
        sock.close()
        wait_until(lambda: client.stats()["server"]["connections"] == connections, 30,
                   "mountd to see the three clients go")
        wait_until(lambda: fd_count(daemon.proc.pid) == baseline, 30,
                   f"mountd's descriptors back to {baseline}")
        opened = client.open([files[0].hash])  # mountd is fine
        assert read_all(opened[0][0]) == files[0].data
        close_opened(opened)


# -- another user, a private store ------------------------------------------------------------


def test_another_user_gets_a_private_stores_files_only_by_hand_off(workdir, dataset, local_users: LocalUsers) -> None:
    url, files = dataset
    other = local_users.user("qfs_test_other")
    with running_mountd(workdir / "private", "--private-store", "--shared") as private:
        fill(private.cache_dir, url, files[:3])
        paths = [os.fspath(layout.store_path(private.cache_dir, f.hash)) for f in files[:3]]
        asked = [f.hash for f in files[:4]]  # the fourth is not cached
        cache_dir = private.cache_dir

        def as_other() -> dict:
            direct = []
            for path in paths:
                try:
                    os.close(os.open(path, os.O_RDONLY))
                    direct.append("opened")
                except OSError as exc:
                    direct.append(errno.errorcode[exc.errno])
            with SyncClient.connect(cache_dir) as client:
                opened = client.open(asked, "ds-private")
                stats = client.stats()
            got = [None if item is None else read_all(item[0]).hex() for item in opened]
            close_opened(opened)
            return {"direct": direct, "got": got, "store_access": client.hello_info["store_access"],
                    "user": stats["users"][str(os.getuid())]}

        result = run_as(other, as_other)
    assert result["store_access"] == "private"
    assert result["direct"] == ["EACCES"] * 3  # the store files themselves stay closed to it
    assert result["got"] == [f.data.hex() for f in files[:3]] + [None]
    assert (result["user"]["opened"], result["user"]["reported_hits"]) == (3, 3)
