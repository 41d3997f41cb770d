"""Each loader of the side-by-side benchmark: its set-up step and the loader a job builds.

Every contender reads the same JPEGs and hands the same work to its DataLoader workers:
decode with PIL (RGB), then :func:`augment` (``RandomResizedCrop(224)``,
``RandomHorizontalFlip``, ``ToTensor``, ``Normalize``): only where the bytes come from
differs. Each is used as its own documentation shows (the comments say where it departs
from a default, and why):

====================  ================================================================================
``qfs-mount``         quiverfs: ``quiverfs mount`` of the dataset's digest, ``ImageFolder`` on the mount,
                      ``DataLoader(shuffle=True)``
``qfs-shim``          the same mount and ``ImageFolder``, ``QuiverBatchSampler`` (docs/shim.md)
``qfs-direct``        ``DirectDataset.of(ImageFolder(mount))`` + ``QuiverBatchSampler`` (docs/shim.md
                      "Direct reads")
``qfs-packed``        as ``qfs-direct`` on a packed copy (``digests pack``: Brand's shuffled tar chunks,
                      one ranged GET per chunk; docs/substitutable-reads.md "Packed datasets")
``s3tc-map``          s3torchconnector ``S3MapDataset.from_prefix`` (AWS CRT client), shuffled
``s3tc-iter``         s3torchconnector ``S3IterableDataset.from_prefix(enable_sharding=True)``: listing
                      order, no shuffle (the iterable has none of its own)
``litdata``           ``litdata.optimize`` to chunks in the bucket, then ``StreamingDataset(shuffle=True)``
                      with its local chunk cache and ``StreamingDataLoader``
``mosaic``            ``streaming.MDSWriter`` shards in the bucket, then ``StreamingDataset(shuffle=True)``
                      with its local shard cache
``boto3``             a map-style ``Dataset``: one ``get_object`` per item, a client per worker, shuffled
====================  ================================================================================

The set-up functions run in the benchmark's process; :func:`build_loader` runs in the job
process (``peers.job``) and imports only what its contender needs.
"""

from __future__ import annotations

import io
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

__all__ = ["CONTENDERS", "Contender", "augment", "build_loader", "decode"]


@dataclass(frozen=True)
class Contender:
    """One row of the tables."""

    name: str
    #: the Python modules it needs (from the ``peers`` extra, or quiverfs's own)
    modules: tuple[str, ...]
    #: what a user sees of it, for the configuration listing
    summary: str
    #: reads through a quiverfs mount (a World: mountd + mount)
    quiverfs: bool = False
    #: it has a local cache whose size can be limited (scenario b)
    cache_limit: bool = False
    #: its set-up step (None: none)
    setup: str | None = None
    #: shuffles each epoch (False: the iterable's listing order)
    shuffles: bool = True
    extra: dict[str, Any] = field(default_factory=dict)


CONTENDERS: dict[str, Contender] = {c.name: c for c in (
    Contender("qfs-mount", ("torchvision",), "quiverfs mount + ImageFolder, DataLoader(shuffle=True)",
              quiverfs=True, cache_limit=True, setup="digests build"),
    Contender("qfs-shim", ("torchvision",), "quiverfs mount + ImageFolder + QuiverBatchSampler",
              quiverfs=True, cache_limit=True, setup="digests build"),
    Contender("qfs-direct", ("torchvision",),
              "DirectDataset.of(ImageFolder(mount)) + QuiverBatchSampler (store files read directly)",
              quiverfs=True, cache_limit=True, setup="digests build"),
    Contender("qfs-packed", ("torchvision",),
              "digests pack -> DirectDataset.of(ImageFolder(mount)) + QuiverBatchSampler on the packed digest",
              quiverfs=True, cache_limit=True, setup="digests pack"),
    Contender("s3tc-map", ("s3torchconnector",), "S3MapDataset.from_prefix, DataLoader(shuffle=True)"),
    Contender("s3tc-iter", ("s3torchconnector",),
              "S3IterableDataset.from_prefix(enable_sharding=True), listing order", shuffles=False),
    Contender("litdata", ("litdata",), "litdata.optimize -> StreamingDataset(shuffle=True) + StreamingDataLoader",
              cache_limit=True, setup="litdata.optimize"),
    Contender("mosaic", ("streaming",), "streaming.MDSWriter -> StreamingDataset(shuffle=True) + DataLoader",
              cache_limit=True, setup="MDSWriter"),
    Contender("boto3", ("boto3",), "Dataset with one boto3 get_object per item, DataLoader(shuffle=True)"),
)}

REGION = "us-east-1"
ACCESS_KEY, SECRET_KEY = "peers-bench", "peers-bench-secret"  # the local server checks none


def s3_env(endpoint: str) -> dict[str, str]:
    """The standard variables every SDK here reads: the local endpoint, dummy credentials.
    ``S3_ENDPOINT_URL`` is mosaicml-streaming's own name for the endpoint."""
    return {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "AWS_DEFAULT_REGION": REGION, "AWS_REGION": REGION,
            "S3_ENDPOINT_URL": endpoint, "AWS_EC2_METADATA_DISABLED": "true"}


def boto3_client(endpoint: str, pool: int = 10):
    import boto3
    from botocore.config import Config

    return boto3.session.Session().client(
        "s3", endpoint_url=endpoint, region_name=REGION, aws_access_key_id=ACCESS_KEY,
        aws_secret_access_key=SECRET_KEY,
        config=Config(s3={"addressing_style": "path"}, max_pool_connections=pool))


# -- the work every contender's workers do ------------------------------------------------------


def decode(data: bytes):
    """JPEG bytes → a PIL RGB image (what torchvision's default loader does with a file)."""
    from PIL import Image

    with Image.open(io.BytesIO(data)) as img:
        return img.convert("RGB")


_AUGMENT = None
#: An 8 x 8 grey JPEG: warms the decoder and the transform up in the job's main process.
_TINY_JPEG = bytes.fromhex(
    "ffd8ffe000104a46494600010100000100010000ffdb004300080606070605080707070909080a0c140d0c0b0b0c1912130f"
    "141d1a1f1e1d1a1c1c20242e2720222c231c1c2837292c30313434341f27393d38323c2e333432ffc0000b08000800080101"
    "1100ffc4001f0000010501010101010100000000000000000102030405060708090a0bffc400b5100002010303020403050504"
    "040000017d01020300041105122131410613516107227114328191a1082342b1c11552d1f02433627282090a161718191a2526"
    "2728292a3435363738393a434445464748494a535455565758595a636465666768696a737475767778797a83848586878889"
    "8a92939495969798999aa2a3a4a5a6a7a8a9aab2b3b4b5b6b7b8b9bac2c3c4c5c6c7c8c9cad2d3d4d5d6d7d8d9dae1e2e3e4"
    "e5e6e7e8e9eaf1f2f3f4f5f6f7f8f9faffda0008010100003f00fbd3ffd9")


def augment(image):
    """The standard ImageNet training transform."""
    global _AUGMENT
    if _AUGMENT is None:
        from torchvision import transforms as T

        _AUGMENT = T.Compose([T.RandomResizedCrop(224), T.RandomHorizontalFlip(), T.ToTensor(),
                              T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])
    return _AUGMENT(image)


# -- set-up steps (in the benchmark's process) ----------------------------------------------------


@dataclass
class SetupResult:
    """A contender's one-time step before training: what it wrote and how long it took."""

    step: str
    seconds: float
    #: bytes of the converted copy stored in the bucket (0: none)
    stored_bytes: int = 0
    objects: int = 0
    notes: str = ""
    #: filled in by the benchmark from the bucket's log: GETs, bytes read and written
    bucket: dict[str, Any] = field(default_factory=dict)


def chunk_bytes_for(dataset_bytes: int) -> int:
    """Chunk (litdata) and shard (MDS) size: 64 MiB, both tools' documented size, unless the
    dataset is too small to make 32 of them (a ``--quick`` run): then dataset / 32, so that a
    small run has as many chunks as the default one, and a 20% cache holds ~6 of them
    (mosaicml-streaming refuses a ``cache_limit`` under 4 shards)."""
    return max(1 << 20, min(64 << 20, dataset_bytes // 32))


#: litdata's chunks a worker may hold on disk at once: up to ``max(4, max_pre_download)`` it
#: keeps (``StreamingDataset`` ``keep``) and at least 4 it downloads ahead (its async prefetch
#: raises ``max_pre_download`` to 4: ``litdata/streaming/async_prefetch.py``).
LITDATA_CHUNKS_PER_WORKER = 8


def litdata_chunk_for_cache(cache_bytes: int, workers: int, default: int) -> int:
    """litdata's chunk size for a cache of ``cache_bytes`` (scenario b): ``default`` unless
    ``workers`` x :data:`LITDATA_CHUNKS_PER_WORKER` chunks of it would not fit, then the
    largest that fits. litdata's own warning puts its peak cache at workers x
    max_pre_download x chunk; its documented 64 MB chunks (and the bench's dataset / 32 at
    ``--quick``) break that at a 20% cache, and its workers then wait for chunks until they
    time out (``ChunkWaitTimeoutError``): every (b) run failed so, until 2026-12-01. A user
    limiting the cache would size the chunks for it; at 1.6 MB chunks (``--quick``, 8.7
    chunks a worker) litdata ran, at 2.57 MB (4.3) it still timed out."""
    return max(64 << 10, min(default, cache_bytes // (workers * LITDATA_CHUNKS_PER_WORKER)))


def packed_files_for_cache(cache_bytes: int, mean_file_bytes: float, warn_share: float) -> int:
    """Files per packed chunk for ``digests pack``: Brand's 64, fewer where a chunk would pass
    ``warn_share`` of the cache (mountd warns at registration about such chunks:
    docs/operations.md, "warnings"), so that the packed row of (b) is configured as our docs
    tell a user with that cache to configure it. A quarter below what the mean file size
    allows: a chunk is a random draw of files, and at ``--quick`` the largest of 105 chunks
    sized by the mean was 1.27x it (6% of the cache)."""
    return max(1, min(64, int(0.75 * warn_share * cache_bytes / max(1.0, mean_file_bytes))))


def _fetch_item(job: tuple[str, str, str, int]) -> dict[str, Any]:
    """litdata's ``fn``: one source JPEG from the bucket (a client per worker process)."""
    endpoint, bucket, key, label = job
    client = _CLIENTS.get(os.getpid())
    if client is None:
        client = _CLIENTS[os.getpid()] = boto3_client(endpoint)
    data = client.get_object(Bucket=bucket, Key=key)["Body"].read()
    return {"image": data, "label": label}


_CLIENTS: dict[int, Any] = {}


def litdata_allow_http() -> None:
    """The one setting litdata is given beyond its documented options: ``allow_http`` in the
    client options of the obstore store it builds for chunk uploads and downloads. litdata
    builds that store from its boto3 client's endpoint but without ``allow_http``, so an
    ``http://`` endpoint fails ("builder error: BadScheme"); a real bucket is ``https://`` and
    needs nothing. (Without obstore installed, which litdata does not require, it would use
    boto3; here quiverfs brings obstore in.)"""
    from litdata.streaming import downloader

    options = getattr(downloader, "_OBSTORE_CLIENT_OPTIONS", None)
    if isinstance(options, dict):
        options["allow_http"] = True


def setup_litdata(endpoint: str, bucket: str, keys: list[str], labels: list[int], out_prefix: str,
                  chunk_bytes: int, workers: int, workdir: str) -> SetupResult:
    """``litdata.optimize``: each worker GETs source JPEGs and writes ``{"image": bytes,
    "label": int}`` samples into chunks, uploaded to ``s3://bucket/out_prefix``."""
    import litdata

    litdata_allow_http()
    started = time.perf_counter()
    # its work folders come from the environment; each conversion gets its own (a second one
    # in the same folders could pick up the first one's chunks)
    os.environ["DATA_OPTIMIZER_CACHE_FOLDER"] = os.path.join(workdir, "litdata-optimize-cache")
    os.environ["DATA_OPTIMIZER_DATA_CACHE_FOLDER"] = os.path.join(workdir, "litdata-optimize-data")
    litdata.optimize(
        fn=_fetch_item,
        inputs=[(endpoint, bucket, k, label) for k, label in zip(keys, labels, strict=True)],
        output_dir=f"s3://{bucket}/{out_prefix}",
        chunk_bytes=chunk_bytes,
        num_workers=workers,
        storage_options={"endpoint_url": endpoint, "aws_access_key_id": ACCESS_KEY,
                         "aws_secret_access_key": SECRET_KEY},
        start_method="fork",
        verbose=False,
    )
    return SetupResult("litdata.optimize", time.perf_counter() - started)


def setup_mds(endpoint: str, bucket: str, keys: list[str], labels: list[int], out_prefix: str,
              chunk_bytes: int, threads: int = 16) -> SetupResult:
    """``streaming.MDSWriter`` to ``s3://bucket/out_prefix``: source JPEGs fetched by a pool of
    threads (in order) and written as ``image: bytes, label: int`` samples, uncompressed
    (JPEG does not compress)."""
    from streaming import MDSWriter

    started = time.perf_counter()
    client = boto3_client(endpoint, pool=threads)

    def fetch(key: str) -> bytes:
        return client.get_object(Bucket=bucket, Key=key)["Body"].read()

    with MDSWriter(out=f"s3://{bucket}/{out_prefix}", columns={"image": "bytes", "label": "int"},
                   size_limit=chunk_bytes) as writer, ThreadPoolExecutor(threads) as pool:
        for data, label in zip(pool.map(fetch, keys), labels, strict=True):
            writer.write({"image": data, "label": label})
    return SetupResult("MDSWriter", time.perf_counter() - started)


# -- loaders (in the job process) ---------------------------------------------------------------


@dataclass
class Built:
    """What a job iterates: the loader, a per-epoch hook, a closing hook."""

    loader: Any
    set_epoch: Callable[[int], None] | None = None
    close: Callable[[], None] | None = None
    notes: dict[str, Any] = field(default_factory=dict)


def _dataloader_kwargs(spec: dict[str, Any]) -> dict[str, Any]:
    workers = spec["workers"]
    return {"num_workers": workers, "persistent_workers": workers > 0}


def build_loader(spec: dict[str, Any]) -> Built:
    """The loader of ``spec["contender"]`` (``peers.job`` passes its JSON spec). PIL and the
    transform are made here, before the DataLoader forks its workers, so that no worker
    imports torchvision inside the timed epoch."""
    augment(decode(_TINY_JPEG))
    return _BUILDERS[spec["contender"]](spec)


def _quiverfs(spec: dict[str, Any]) -> Built:
    from torch.utils.data import DataLoader
    from torchvision.datasets import ImageFolder

    from quiverfs.torch import DirectDataset, QuiverBatchSampler

    folder = ImageFolder(spec["root"], transform=augment)
    kind = spec["contender"]
    if kind == "qfs-mount":
        loader = DataLoader(folder, batch_size=spec["batch_size"], shuffle=True, **_dataloader_kwargs(spec))
        return Built(loader)
    dataset = DirectDataset.of(folder) if kind in ("qfs-direct", "qfs-packed") else folder
    # report_lag: num_workers x prefetch_factor (DataLoader's default 2), as docs/shim.md says
    sampler = QuiverBatchSampler(dataset, batch_size=spec["batch_size"], seed=spec["seed"],
                                 report_lag=spec["workers"] * 2)
    if not sampler.on_quiver:
        raise RuntimeError(f"{spec['root']} is not a quiverfs mount")
    loader = DataLoader(dataset, batch_sampler=sampler, **_dataloader_kwargs(spec))
    return Built(loader, set_epoch=sampler.set_epoch, close=sampler.close)


def _class_labels(spec: dict[str, Any]) -> dict[str, int]:
    """ImageFolder's labels: class folder names, sorted, numbered (one delimiter LIST)."""
    client = boto3_client(spec["endpoint"])
    out = client.list_objects_v2(Bucket=spec["bucket"], Prefix=spec["prefix"] + "/", Delimiter="/")
    names = sorted(p["Prefix"].rstrip("/").rsplit("/", 1)[-1] for p in out.get("CommonPrefixes", []))
    return {name: i for i, name in enumerate(names)}


def _s3tc(spec: dict[str, Any]) -> Built:
    from s3torchconnector import S3ClientConfig, S3IterableDataset, S3MapDataset
    from torch.utils.data import DataLoader

    labels = _class_labels(spec)

    def item(reader) -> tuple[Any, int]:
        label = labels[reader.key.rsplit("/", 2)[-2]]
        return augment(decode(reader.read())), label

    uri = f"s3://{spec['bucket']}/{spec['prefix']}/"
    # force_path_style: the endpoint is an address, not a bucket host name; the rest of
    # S3ClientConfig (throughput target, part size, retries) stays at its defaults
    common = {"region": REGION, "endpoint": spec["endpoint"], "transform": item,
              "s3client_config": S3ClientConfig(force_path_style=True)}
    if spec["contender"] == "s3tc-map":
        dataset = S3MapDataset.from_prefix(uri, **common)
        n = len(dataset)  # lists the prefix now, in set-up
        loader = DataLoader(dataset, batch_size=spec["batch_size"], shuffle=True, **_dataloader_kwargs(spec))
        return Built(loader, notes={"listed": n})
    dataset = S3IterableDataset.from_prefix(uri, enable_sharding=True, **common)
    loader = DataLoader(dataset, batch_size=spec["batch_size"], **_dataloader_kwargs(spec))
    return Built(loader)


def _litdata(spec: dict[str, Any]) -> Built:
    from litdata import StreamingDataLoader, StreamingDataset

    litdata_allow_http()
    def item(sample: dict[str, Any]) -> tuple[Any, int]:
        return augment(decode(sample["image"])), sample["label"]

    options: dict[str, Any] = {}
    if spec.get("cache_bytes"):
        options["max_cache_size"] = int(spec["cache_bytes"])
    dataset = StreamingDataset(
        f"s3://{spec['bucket']}/{spec['litdata_prefix']}", cache_dir=spec["cache_dir"], shuffle=True,
        storage_options={"endpoint_url": spec["endpoint"], "aws_access_key_id": ACCESS_KEY,
                         "aws_secret_access_key": SECRET_KEY},
        transform=item, **options)
    loader = StreamingDataLoader(dataset, batch_size=spec["batch_size"], num_workers=spec["workers"])
    return Built(loader, notes={"items": len(dataset)})


def _mosaic(spec: dict[str, Any]) -> Built:
    from streaming import StreamingDataset
    from torch.utils.data import DataLoader

    class Images(StreamingDataset):
        """The docs' pattern: subclass, decode and transform in ``__getitem__``."""

        def __getitem__(self, index: int) -> tuple[Any, int]:
            sample = super().__getitem__(index)
            return augment(decode(sample["image"])), sample["label"]

    options: dict[str, Any] = {}
    if spec.get("cache_bytes"):
        options["cache_limit"] = int(spec["cache_bytes"])
    dataset = Images(remote=f"s3://{spec['bucket']}/{spec['mds_prefix']}", local=spec["cache_dir"],
                     shuffle=True, batch_size=spec["batch_size"], **options)
    # The boto3 client that fetched index.json here would be inherited by every forked worker,
    # all sharing its keep-alive connection: over plain http their answers interleave (shards
    # came down corrupted); on a real https bucket the same sharing breaks TLS and streaming
    # retries after dropping the client (its clean_up). Drop it now, so each worker makes its own.
    for stream in dataset.streams:
        stream._downloader.clean_up()
    loader = DataLoader(dataset, batch_size=spec["batch_size"], **_dataloader_kwargs(spec))
    return Built(loader, notes={"items": len(dataset)})


def _boto3(spec: dict[str, Any]) -> Built:
    from torch.utils.data import DataLoader, Dataset

    labels = _class_labels(spec)
    client = boto3_client(spec["endpoint"])
    keys = [obj["Key"] for page in client.get_paginator("list_objects_v2").paginate(
        Bucket=spec["bucket"], Prefix=spec["prefix"] + "/") for obj in page.get("Contents", [])]

    class Objects(Dataset):
        """One GET per item; the client is made in each worker (boto3 clients are not
        fork-safe)."""

        def __init__(self) -> None:
            self.pid = -1
            self.client = None

        def __len__(self) -> int:
            return len(keys)

        def __getitem__(self, i: int) -> tuple[Any, int]:
            if self.pid != os.getpid():
                self.client, self.pid = boto3_client(spec["endpoint"]), os.getpid()
            data = self.client.get_object(Bucket=spec["bucket"], Key=keys[i])["Body"].read()
            return augment(decode(data)), labels[keys[i].rsplit("/", 2)[-2]]

    loader = DataLoader(Objects(), batch_size=spec["batch_size"], shuffle=True, **_dataloader_kwargs(spec))
    return Built(loader, notes={"listed": len(keys)})


_BUILDERS: dict[str, Callable[[dict[str, Any]], Built]] = {
    "qfs-mount": _quiverfs, "qfs-shim": _quiverfs, "qfs-direct": _quiverfs, "qfs-packed": _quiverfs,
    "s3tc-map": _s3tc, "s3tc-iter": _s3tc, "litdata": _litdata, "mosaic": _mosaic, "boto3": _boto3,
}
