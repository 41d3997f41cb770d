"""quiverfs: training datasets in cloud buckets, read like a fast local directory.

Three top-level packages, in layers; imports point down only, never up, and no import hides
inside a function to dodge a cycle. The ``[tool.importlinter]`` contract in pyproject.toml
holds it (``lint-imports``, run by scripts/test.sh), and tests/unit/test_layers.py checks that
every module of ours is named in it:

1. **base** (in this package): :mod:`quiverfs.errors` (the error vocabulary),
   :mod:`quiverfs.backends` (remote storage), :mod:`quiverfs.console` (how commands run and
   fail), :mod:`quiverfs.forking` (helper processes: FUSE workers, mountd's fill processes),
   :mod:`quiverfs.version`. They import nothing of ours above them.
2. :mod:`digests`: dataset manifests; imports the base.
3. :mod:`mountd`: the per-machine cache server; imports digests and the base.
4. **the mount, control channel, shim and CLI** (the rest of this package: ``fs``,
   ``readahead``, ``tree``, ``fuse_*``, ``mount``, ``control*``, ``torch``, ``direct``,
   ``handoff``, ``cli``, ``mount_cli``, ``mountd_views``, ``testing``); may import everything
   below.

This ``__init__`` imports nothing, so importing the base costs nothing more.
"""

from quiverfs.version import __version__

__all__ = ["__version__"]
