"""The filesystem a mount serves: its tree, reads, misses, read-ahead, extended attributes and
control channel. May import the protocol floor, mountd, digests and the base, nothing above."""
