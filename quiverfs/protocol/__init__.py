"""What the mount's parts share: the FUSE ABI, the workers' messages, the control channel's
grammar, mountd's descriptor hand-off. May import mountd, digests and the base, nothing above."""
