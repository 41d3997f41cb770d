"""Co-operative reads: job sessions, epochs and claims (substitutable hits), chunk
residency, datasets' compact-id views, and :class:`~mountd.coop.service.CoopService`,
which ties them to the cache (docs/substitutable-reads.md).

May import :mod:`mountd.store` and below.
"""
