"""Digests: one immutable file per dataset version (path → size, blake3 hash, location)."""
