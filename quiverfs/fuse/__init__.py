"""The FUSE machinery: the /dev/fuse session, the worker processes and their pool, the pyfuse3
front end. May import the filesystem it serves and the floors below it; never the mount above."""
