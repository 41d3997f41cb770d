"""The parts of scripts/bench/peers.py that are ours, without the ``peers`` extra: the
S3-compatible directory server (scripts/bench/peers/s3dir.py) driven by boto3, the bucket
front (peers/source.py: nginx with its injected latency, when nginx and its echo module are
installed) and the access-log counters both write for. No FUSE, no torch."""

from __future__ import annotations

import io
import os
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts" / "bench"))

boto3 = pytest.importorskip("boto3")

from peers.contenders import (  # noqa: E402
    CONTENDERS,
    LITDATA_CHUNKS_PER_WORKER,
    chunk_bytes_for,
    litdata_chunk_for_cache,
    packed_files_for_cache,
)
from peers.s3dir import S3Dir, etag_of  # noqa: E402
from peers.source import Counts, Source, count, kind_of, nginx_available, parse_log, probe  # noqa: E402

BUCKET = "bkt"
LATENCY_MS = 30


def _client(endpoint: str):
    from botocore.config import Config

    return boto3.session.Session().client(
        "s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="x",
        aws_secret_access_key="y", config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 1}))


def _objects(root: Path) -> dict[str, bytes]:
    """23 objects in three class folders, sizes 1..~60 KB, distinct contents."""
    out = {}
    for i in range(23):
        key = f"train/class_{i % 3}/img_{i:03d}.JPEG"
        data = os.urandom(1000 + 2600 * i)
        out[key] = data
        path = root / BUCKET / key
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    (root / BUCKET / "zzz.txt").write_bytes(b"outside the prefix")
    return out


SERVERS = [pytest.param(False, id="s3dir")]
if nginx_available() is None:
    SERVERS.append(pytest.param(True, id="nginx"))
else:
    SERVERS.append(pytest.param(True, id="nginx", marks=pytest.mark.skip(reason=nginx_available())))


@pytest.fixture(scope="module", params=SERVERS)
def bucket(request, tmp_path_factory):
    """The bucket served one way or the other (one server per way, for the whole module)."""
    root = tmp_path_factory.mktemp("root")
    objects = _objects(root)
    with Source(root, tmp_path_factory.mktemp("work"), latency_ms=LATENCY_MS, nginx=request.param) as src:
        yield src, objects, _client(src.endpoint)


def _settled(src: Source, mark: int, n: int) -> list:
    """The log's records after ``mark`` once ``n`` are there (nginx writes after the answer)."""
    deadline = time.monotonic() + 20  # a loaded machine: the deadline only bounds a failure
    while True:
        records = src.requests(mark)
        if len(records) >= n or time.monotonic() > deadline:
            return records
        time.sleep(0.01)


def _quiet_mark(src: Source, quiet: float = 0.3) -> int:
    """The log's end once nothing has been added to it for ``quiet`` seconds: a request of an
    earlier test is logged after its answer, and would otherwise count after the mark."""
    deadline = time.monotonic() + 10
    mark = src.mark()
    while time.monotonic() < deadline:
        time.sleep(quiet)
        now = src.mark()
        if now == mark:
            break
        mark = now
    return mark


def test_get_whole_and_ranges_return_the_right_bytes(bucket):
    src, objects, s3 = bucket
    key = "train/class_1/img_010.JPEG"
    data = objects[key]
    assert s3.get_object(Bucket=BUCKET, Key=key)["Body"].read() == data
    got = s3.get_object(Bucket=BUCKET, Key=key, Range="bytes=100-1099")
    assert got["Body"].read() == data[100:1100]
    assert got["ContentRange"] == f"bytes 100-1099/{len(data)}"
    assert s3.get_object(Bucket=BUCKET, Key=key, Range="bytes=-10")["Body"].read() == data[-10:]
    assert s3.get_object(Bucket=BUCKET, Key=key, Range=f"bytes={len(data) - 5}-")["Body"].read() == data[-5:]


def test_head_gives_size_and_the_same_etag_as_get(bucket):
    src, objects, s3 = bucket
    key = "train/class_2/img_005.JPEG"
    head = s3.head_object(Bucket=BUCKET, Key=key)
    assert head["ContentLength"] == len(objects[key])
    assert head["ETag"] == s3.get_object(Bucket=BUCKET, Key=key)["ETag"]
    assert head["ETag"] == etag_of((src.root / BUCKET / key).stat())


def test_missing_key_is_no_such_key(bucket):
    _, _, s3 = bucket
    with pytest.raises(s3.exceptions.NoSuchKey):
        s3.get_object(Bucket=BUCKET, Key="train/class_0/nope.JPEG")


def test_list_pages_prefix_and_delimiter(bucket):
    _, objects, s3 = bucket
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix="train/",
                                                         PaginationConfig={"PageSize": 5})
    listed = [(o["Key"], o["Size"]) for page in pages for o in page.get("Contents", [])]
    assert listed == sorted((k, len(v)) for k, v in objects.items())
    top = s3.list_objects_v2(Bucket=BUCKET, Prefix="train/", Delimiter="/")
    assert [p["Prefix"] for p in top["CommonPrefixes"]] == [f"train/class_{i}/" for i in range(3)]
    assert "Contents" not in top
    everything = s3.list_objects_v2(Bucket=BUCKET)
    assert everything["KeyCount"] == len(objects) + 1
    v1 = s3.list_objects(Bucket=BUCKET, Prefix="train/class_0/", MaxKeys=3)
    assert v1["IsTruncated"] and len(v1["Contents"]) == 3


def test_put_and_multipart_upload_then_read_back(bucket):
    from boto3.s3.transfer import TransferConfig

    src, _, s3 = bucket
    s3.put_object(Bucket=BUCKET, Key="out/small.bin", Body=b"hello")
    assert s3.get_object(Bucket=BUCKET, Key="out/small.bin")["Body"].read() == b"hello"
    big = os.urandom(11 * 1024 * 1024)
    s3.upload_fileobj(io.BytesIO(big), BUCKET, "out/big.bin",
                      Config=TransferConfig(multipart_threshold=5 << 20, multipart_chunksize=5 << 20))
    assert (src.root / BUCKET / "out" / "big.bin").read_bytes() == big
    assert s3.head_object(Bucket=BUCKET, Key="out/big.bin")["ContentLength"] == len(big)
    listed = s3.list_objects_v2(Bucket=BUCKET, Prefix="out/")["Contents"]
    assert [o["Key"] for o in listed] == ["out/big.bin", "out/small.bin"]
    s3.delete_object(Bucket=BUCKET, Key="out/big.bin")
    s3.delete_object(Bucket=BUCKET, Key="out/small.bin")
    assert "Contents" not in s3.list_objects_v2(Bucket=BUCKET, Prefix="out/")
    assert not list((src.root / ".s3dir" / "uploads").iterdir())  # parts cleaned up


def test_counters_count_gets_bytes_lists_and_writes(bucket):
    src, objects, s3 = bucket
    keys = sorted(objects)[:4]
    mark = _quiet_mark(src)
    for key in keys:
        s3.get_object(Bucket=BUCKET, Key=key)["Body"].read()
    s3.get_object(Bucket=BUCKET, Key=keys[0], Range="bytes=0-99")["Body"].read()
    s3.head_object(Bucket=BUCKET, Key=keys[1])
    s3.list_objects_v2(Bucket=BUCKET, Prefix="train/")
    s3.put_object(Bucket=BUCKET, Key="count/x.bin", Body=b"x" * 5000)
    c = count(_settled(src, mark, 8))
    assert (c.gets, c.heads, c.lists, c.writes) == (5, 1, 1, 1)
    assert c.get_bytes == sum(len(objects[k]) for k in keys) + 100
    assert c.write_bytes >= 5000
    assert c.errors == 0
    s3.delete_object(Bucket=BUCKET, Key="count/x.bin")


def test_every_request_waits_the_latency_yet_many_wait_at_once(bucket):
    src, objects, s3 = bucket
    key = sorted(objects)[0]
    started = time.perf_counter()
    s3.get_object(Bucket=BUCKET, Key=key)["Body"].read()
    assert time.perf_counter() - started >= LATENCY_MS / 1000
    paths = [f"/{BUCKET}/{k}" for k in objects]
    result = probe(src.endpoint, paths, connections=16, processes=1, seconds=1.0)
    one_at_a_time = 1000 / LATENCY_MS
    # 16 connections waiting at once: far more than one request per latency
    assert result.gets_per_s > 4 * one_at_a_time
    assert result.gets_per_s < 16 * one_at_a_time * 1.1  # and none skips its wait


def test_log_parsing_and_kinds():
    data = (b"1700000000.100 GET 200 1000 300 /b/train/a.jpg\n"
            b"1700000000.200 GET 206 10 310 /b/train/a.jpg?x-id=GetObject\n"
            b"1700000000.300 GET 200 900 200 /b?list-type=2&prefix=train%2F\n"
            b"1700000000.400 HEAD 404 0 200 /b/train/missing.jpg\n"
            b"1700000000.500 PUT 200 0 5300 /b/out/x.bin\n"
            b"1700000000.600 POST 200 300 400 /b/out/y.bin?uploads\n"
            b"1700000000.700 DELETE 204 0 200 /b/out/x.bin\n"
            b"1700000000.800 GET 200 5 ")  # being written: left out
    records = parse_log(data)
    assert len(records) == 7
    assert [kind_of(m, u) for _, m, _, _, _, u in records] == [
        "get", "get", "list", "head", "write", "write", "delete"]
    c = count(records)
    assert (c.gets, c.get_bytes, c.lists, c.heads, c.writes, c.write_bytes, c.deletes, c.errors) == (
        2, 1010, 1, 1, 2, 5700, 1, 1)
    window = count(records, 1700000000.15, 1700000000.45)
    assert (window.gets, window.lists, window.heads) == (1, 1, 1)
    assert count(records[:2]).add(count(records[2:])).gets == 2
    assert Counts().first is None


def test_s3dir_refuses_keys_without_a_file_form(tmp_path):
    from peers.s3dir import Request

    store = S3Dir(tmp_path)
    (tmp_path / BUCKET).mkdir()
    for key in ("a/../b", "a//b", "./x"):
        resp = store.handle(Request("PUT", f"/{BUCKET}/{key}", {}, b"x"))
        assert resp.status == 400
    assert not any(p.is_file() for p in (tmp_path / BUCKET).rglob("*"))


def test_chunk_size_and_contender_table():
    assert chunk_bytes_for(20_000 * 110_000) == 64 << 20  # the tools' documented size
    small = 2_000 * 110_000
    assert chunk_bytes_for(small) == small // 32  # as many chunks as the default run
    assert {"qfs-shim", "s3tc-map", "litdata", "mosaic", "boto3"} <= set(CONTENDERS)
    assert all(c.cache_limit == (c.name.startswith("qfs-") or c.name in ("litdata", "mosaic"))
               for c in CONTENDERS.values())


def test_scenario_b_chunks_fit_each_tools_cache_rule():
    """(b)'s converted copies: litdata's chunks such that every worker's chunks fit its
    cache (its workers timed out waiting for chunks otherwise), the packed chunks at most
    mountd's warning share of the cache; the defaults wherever they already fit."""
    quick, full = 2_000 * 110_000, 20_000 * 110_000
    cache = int(quick * 0.2)
    chunk = litdata_chunk_for_cache(cache, 4, chunk_bytes_for(quick))
    assert 4 * LITDATA_CHUNKS_PER_WORKER * chunk <= cache < 4 * LITDATA_CHUNKS_PER_WORKER * (chunk + 1)
    assert chunk < 2_570_000  # the size that still timed out (2026-12-01)
    # the full run's 64 MiB chunks break the rule too: 440 MB / 32
    assert litdata_chunk_for_cache(int(full * 0.2), 4, 64 << 20) == int(full * 0.2) // 32
    # a cache that holds them all keeps the documented size
    assert litdata_chunk_for_cache(100 << 30, 4, 64 << 20) == 64 << 20
    assert packed_files_for_cache(cache, 110_000, 0.05) == 15  # 1.65 MB, 3/4 of 5% of 44 MB
    assert packed_files_for_cache(int(full * 0.2), 110_000, 0.05) == 64  # Brand's size fits
    assert packed_files_for_cache(1_000, 110_000, 0.05) == 1


def test_a_file_removed_behind_the_servers_back_leaves_the_listing(tmp_path):
    """The benchmark removes an earlier run's converted copies on disk: a listing cached
    before must drop them, not fail (it answered 502 through nginx once)."""
    from peers.s3dir import Request

    store = S3Dir(tmp_path)
    for name in ("a.bin", "b.bin"):
        path = tmp_path / BUCKET / "old" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"x")
    assert store.keys(BUCKET) == ["old/a.bin", "old/b.bin"]
    (tmp_path / BUCKET / "old" / "a.bin").unlink()
    resp = store.handle(Request("GET", f"/{BUCKET}?list-type=2&prefix=old%2F", {}))
    assert resp.status == 200
    assert b"<Key>old/b.bin</Key>" in resp.body and b"old/a.bin" not in resp.body
    assert store.keys(BUCKET) == ["old/b.bin"]  # listed afresh
