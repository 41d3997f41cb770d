"""mountd: the per-machine cache server that owns the shared, verified, content-addressed store.

Layer 3 of 4 (see :mod:`quiverfs`): may import :mod:`digests` and the base
(:mod:`quiverfs.errors`, :mod:`quiverfs.backends`, :mod:`quiverfs.console`,
:mod:`quiverfs.version`); never the mount, the control channel, the shim or the CLI, which
talk to it over its socket (:mod:`mountd.client`).
"""
