"""mountd: the per-machine cache server that owns the shared, verified, content-addressed store."""
