"""quiverfs: training datasets in cloud buckets, read like a fast local directory.

Packages: :mod:`quiverfs` (filesystem, backends, admin CLI), :mod:`digests` (dataset
manifests) and :mod:`mountd` (the per-machine cache server).
"""

__version__ = "0.1.0"
