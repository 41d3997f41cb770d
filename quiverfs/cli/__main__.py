"""``python -m quiverfs.cli``: the ``quiverfs`` command, as mountd is started on demand
(mountd/rpc/client.py) and as the tests and benchmarks run it."""

from quiverfs.cli.main import main

if __name__ == "__main__":
    main()
