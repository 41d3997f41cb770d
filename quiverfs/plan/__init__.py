"""Planning: the staggering model, its calibration through a mount, the start records jobs wait
on. May import mountd, digests and the base only; the CLI and the training side import it."""
