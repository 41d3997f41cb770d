"""mountd: the per-machine cache server that owns the shared, verified, content-addressed store.

Layer 3 of 4 (see :mod:`quiverfs`): may import :mod:`digests` and the base
(:mod:`quiverfs.base.errors`, :mod:`quiverfs.base.backends`, :mod:`quiverfs.base.console`,
:mod:`quiverfs.base.version`); never the mount, the control channel, the shim or the CLI, which
talk to it over its socket (:mod:`mountd.rpc.async_client`, :mod:`mountd.rpc.client`).

Inside, one package per subsystem, layered in this order (each imports only those below it;
``[tool.importlinter]`` in pyproject.toml holds it):

* :mod:`mountd.daemon` -- ``quiverfs mountd``: the process that owns the others;
* :mod:`mountd.rpc` -- the wire protocol and its table of operations, the server, the clients;
* :mod:`mountd.coop` -- co-operative reads: job sessions, claims, chunks, dataset views;
* :mod:`mountd.cluster` -- several mountds as one cache through Redis/Valkey: membership,
  placement, peer transfer, cluster-wide single-flight (docs/cluster.md);
* :mod:`mountd.store` -- the content-addressed store: layout, files on disk, index, fills,
  recovery, scrub, eviction, and the :class:`~mountd.store.cache.Cache` over them;
* :mod:`mountd.stats` -- counters, the bucket cost model, the Prometheus endpoint;
* :mod:`mountd.errors` -- every error of the package, and the registry of those that travel.
"""
