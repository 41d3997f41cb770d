"""Digests: one immutable file per dataset version (path → size, blake3 hash, location).

Layer 2 of 4 (see :mod:`quiverfs`): may import the base (:mod:`quiverfs.base.errors`,
:mod:`quiverfs.base.backends`, :mod:`quiverfs.base.console`, :mod:`quiverfs.base.version`) and
nothing else of ours; :mod:`mountd` and the mount import digests, never the other way round.
"""
