"""``python -m quiverfs``: the ``quiverfs`` command (quiverfs/cli.py), where no console script
is on ``PATH``."""

from quiverfs.cli import main

if __name__ == "__main__":
    main()
