"""Timed read passes: reader processes read interleaved shares of a file list at once.

Shared by the cold-read benchmarks (mount_cold.py, packed_reads.py). Each reader is a forked
process that waits at a barrier, reads its share (paths with ``open+read``, or S3 keys with a
plain boto3 client), and reports start and end with ``time.perf_counter`` (CLOCK_MONOTONIC:
one clock for every process); it hashes every ``sample_every``-th file outside the timed loop,
and the pass fails when a reader fails, reads the wrong number of bytes, or a sampled blake3
differs from the digest's.
"""

from __future__ import annotations

import multiprocessing
import queue
import random
import signal
import time
from dataclasses import dataclass

import blake3

#: Readers hash every 16th file of their share against the digest.
SAMPLE_EVERY = 16


@dataclass(frozen=True)
class S3Target:
    """Where the boto3 readers GET from (moto's endpoint, dummy credentials)."""

    endpoint: str
    env: dict[str, str]
    bucket: str
    prefix: str


def _s3_client(target: S3Target):
    import boto3

    return boto3.session.Session().client(
        "s3", endpoint_url=target.endpoint, region_name=target.env["AWS_DEFAULT_REGION"],
        aws_access_key_id=target.env["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=target.env["AWS_SECRET_ACCESS_KEY"])


def _reader(items: list[str], hashes: list[bytes], s3: S3Target | None, barrier_timeout: float,
            barrier, results) -> None:
    """One reader process: read ``items`` (paths, or S3 keys with ``s3``) after the barrier;
    report (start, end, bytes, sampled, mismatches), then hash the sampled files outside the
    timed loop."""
    # Ctrl-C is the parent's to handle (it stops the readers); SIGTERM ends a reader at once.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        client = None
        if s3 is not None:  # a plain reader's set-up, not timed: its client and connection
            client = _s3_client(s3)
            client.head_bucket(Bucket=s3.bucket)
        barrier.wait(barrier_timeout)
        start = time.perf_counter()
        total = 0
        kept = []
        for i, item in enumerate(items):
            if client is not None:
                data = client.get_object(Bucket=s3.bucket, Key=item)["Body"].read()
            else:
                with open(item, "rb") as f:
                    data = f.read()
            total += len(data)
            if i % SAMPLE_EVERY == 0:
                kept.append((i, data))
        end = time.perf_counter()
        bad = [items[i] for i, data in kept if blake3.blake3(data).digest() != hashes[i]]
        results.put(("ok", start, end, total, len(kept), bad[:3]))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which fails the pass
        results.put(("error", f"{type(exc).__name__}: {exc}"))


def read_pass(items: list[str], hashes: list[bytes], file_size: int, readers: int, *,
              shuffle_seed: int | None = None, s3: S3Target | None = None,
              pass_timeout: float = 900.0, barrier_timeout: float = 120.0) -> float:
    """Files/s of ``readers`` processes reading interleaved shares of ``items`` (each
    ``file_size`` bytes) at once, from the first start to the last end.

    Reader k reads items k, k+R, k+2R, ... (of a random permutation with ``shuffle_seed``).
    Fails when a reader fails or dies, the pass takes longer than ``pass_timeout``, the bytes
    read are not ``len(items) × file_size``, or a sampled hash differs.
    """
    order = list(range(len(items)))
    if shuffle_seed is not None:
        random.Random(shuffle_seed).shuffle(order)
    ctx = multiprocessing.get_context("fork")
    barrier = ctx.Barrier(readers + 1)
    results = ctx.Queue()
    procs = [ctx.Process(target=_reader, daemon=True,
                         args=([items[j] for j in order[k::readers]], [hashes[j] for j in order[k::readers]],
                               s3, barrier_timeout, barrier, results))
             for k in range(readers)]
    try:
        for p in procs:
            p.start()
        barrier.wait(barrier_timeout)
        outs = []
        deadline = time.monotonic() + pass_timeout
        while len(outs) < readers:
            try:
                out = results.get(timeout=1.0)
            except queue.Empty:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"a read pass took longer than {pass_timeout:.0f} s") from None
                dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"a reader process died (exit {dead[0]})") from None
                continue
            if out[0] != "ok":
                raise RuntimeError(f"a reader failed: {out[1]}")
            outs.append(out)
    finally:
        deadline = time.monotonic() + 5.0  # readers that reported exit on their own
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in procs:  # the others (a failure, Ctrl-C) are stopped
            if p.is_alive():
                p.terminate()
                p.join(5)
    got = sum(out[3] for out in outs)
    if got != len(items) * file_size:
        raise RuntimeError(f"read {got} bytes, expected {len(items) * file_size}")
    bad = [path for out in outs for path in out[5]]
    if bad:
        raise RuntimeError(f"content differs from the digest's blake3: {bad}")
    return len(items) / (max(out[2] for out in outs) - min(out[1] for out in outs))
