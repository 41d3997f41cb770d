"""The RPC: the wire protocol and its table of operations, the server that answers it,
and the clients the mount, the CLI and the tests use (docs/mountd-protocol.md).

May import :mod:`mountd.coop`, :mod:`mountd.store` and below.
"""
