"""quiverfs: training datasets in cloud buckets, read like a fast local directory.

Three top-level packages, in layers; imports point down only, never up, and no import hides
inside a function to dodge a cycle. The ``[tool.importlinter]`` contract in pyproject.toml
holds it (``lint-imports``, run by scripts/test.sh), and tests/unit/test_layers.py checks that
every module of ours is named in it. This package keeps one folder per floor, so that ``ls``
shows the layers; each folder's ``__init__`` says what it may import:

1. **base** (:mod:`quiverfs.base`): the error vocabulary, remote storage backends, how
   commands run and fail, helper processes (FUSE workers, mountd's fill processes), the
   version. They import nothing of ours above them.
2. :mod:`digests`: dataset manifests; imports the base.
3. :mod:`mountd`: the per-machine cache server; imports digests and the base.
4. **the rest of this package**, floor by floor, each over the ones below it:

   * :mod:`quiverfs.protocol` -- what the mount's parts share: the FUSE ABI, the workers'
     messages, the control channel's grammar, mountd's descriptor hand-off; beside it
     :mod:`quiverfs.plan`, the staggering planner;
   * :mod:`quiverfs.filesystem` -- the filesystem a mount serves;
   * :mod:`quiverfs.fuse` -- the FUSE machinery that serves it;
   * :mod:`quiverfs.mount` -- a mount's life; beside it, neither importing the other,
     :mod:`quiverfs.client`, the training side (the PyTorch shim, imported as
     :mod:`quiverfs.torch`, and direct reads from the store);
   * :mod:`quiverfs.cli` -- the ``quiverfs`` command; :mod:`quiverfs.testing`, test helpers.

This ``__init__`` imports nothing, so importing the base costs nothing more.
"""

from quiverfs.base.version import __version__

__all__ = ["__version__"]
