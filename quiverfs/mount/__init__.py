"""A mount's life: its mount point, the serving process that joins the filesystem to the FUSE
machinery, starting and stopping. May import every floor below; not the training side or the CLI."""
