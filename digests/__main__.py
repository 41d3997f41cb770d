"""``python -m digests``: the ``digests`` command (digests/cli.py), where no console script is
on ``PATH``."""

from digests.cli import main

if __name__ == "__main__":
    main()
