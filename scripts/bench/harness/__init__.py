"""A reusable harness for emulated training jobs reading through quiverfs (benchmarks only).

* :mod:`.world` — a synthetic dataset in a ``file://`` "bucket", its digest, a mountd with
  remote limits (the bucket is the bottleneck, as in Quiver and DELI) and a mount; always torn
  down, also on errors and Ctrl-C.
* :mod:`.jobs` — an emulated training job in its own process: a real ``torch`` DataLoader
  with worker processes over a dataset that reads file bytes by path, a sampler (shuffled,
  :class:`quiverfs.torch.QuiverBatchSampler`, or none), a sleep per mini-batch for compute;
  reads through the mount, straight from the bucket with quiverfs's backend code (no cache),
  or not at all (synthetic data). Runs of N concurrent jobs start together.
* :mod:`.cli` — the command-line knobs the scripts share and their start-up checks.
* :mod:`.report` — remote counters before/after a run, and the tables the scripts print.
* ``papers_*`` and :mod:`.plots` — the paper-reproduction suite of ``scripts/bench/papers.py``:
  one module per section (Quiver Table 3, Figures 6/7, DELI, costs), the report writer and
  the matplotlib figures.

The scripts in ``scripts/bench/`` (``coop_jobs.py``, ``shim_vs_lru.py``, ``papers.py``) build
on it; see docs/benchmarks.md.
"""
