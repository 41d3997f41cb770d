"""The store: the content-addressed files on disk (``disk``), their layout, the SQLite index,
crash recovery, scrub, verified single-flight fills under remote limits, eviction
policy, per-user quotas, the eviction journal, and :class:`~mountd.store.cache.Cache` over them all.

May import :mod:`mountd.stats`, :mod:`mountd.errors`, digests and the base; nothing
else of mountd (``[tool.importlinter]`` in pyproject.toml).
"""
