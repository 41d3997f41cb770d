"""Digests: one immutable file per dataset version (path → size, blake3 hash, location).

Layer 2 of 4 (see :mod:`quiverfs`): may import the base (:mod:`quiverfs.errors`,
:mod:`quiverfs.backends`, :mod:`quiverfs.console`, :mod:`quiverfs.version`) and nothing else of
ours; :mod:`mountd` and the mount import digests, never the other way round.
"""
