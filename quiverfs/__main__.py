"""``python -m quiverfs``: the ``quiverfs`` command (quiverfs/cli/main.py), where no console script
is on ``PATH``."""

from quiverfs.cli.main import main

if __name__ == "__main__":
    main()
