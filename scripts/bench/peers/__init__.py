"""The side-by-side benchmark against other loaders (``scripts/bench/peers.py``), in parts.

* :mod:`.s3dir` — a small S3-compatible server over a directory (``ROOT/BUCKET/KEY``):
  GetObject with Range, HeadObject, ListObjectsV2, PutObject, multipart uploads, deletes;
  a per-request latency; an access log. Stdlib only (asyncio), so it runs without the
  ``peers`` extra, and the tests drive it with boto3.
* :mod:`.source` — the bucket the benchmark reads: nginx in front of :mod:`.s3dir` (nginx
  serves object GETs and HEADs from the same directory with ``sendfile``, after a per-request
  delay from the echo module; everything else goes to :mod:`.s3dir`), its access-log counters,
  and a probe of its own capacity. Without nginx it is :mod:`.s3dir` alone.
* :mod:`.images` — the JPEG dataset in ImageFolder layout (a realistic size spread).
* :mod:`.contenders` — each loader: its set-up (conversion) step and the dataset and loader a
  job builds with it, each the way its own documentation shows.
* :mod:`.job` — one training-like job process (DataLoader, decode + augmentation, a fixed
  compute per batch), started in groups that begin together.
* :mod:`.monitor` — peak memory of the processes of a run, disk used by caches, CPU busy.
* :mod:`.report` — the tables, the verdicts and the markdown of docs/benchmarks.md.
"""
