"""The ``quiverfs`` command: the app (main), the mount and plan commands, mountd's tables.
May import every floor below; nothing of ours imports it but ``python -m quiverfs``."""
