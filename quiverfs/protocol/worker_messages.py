"""What a mount's FUSE workers send its main process, over their ``SOCK_SEQPACKET`` socket.

One byte of kind, then the body. The workers (quiverfs/fuse/worker.py) write these; the mount's main
process reads them (quiverfs/mount/serve.py) and hands the hit reports to the filesystem
(:meth:`quiverfs.filesystem.fs.QuiverOperations.add_hits`). Both sides import it from here, below
them both, so that the filesystem need not import the FUSE workers.
"""

from __future__ import annotations

import struct

FORWARD = b"Q"  # a raw request for the main process to answer
HITS = b"H"  # u64 bytes, then one record per file read from the store: 32-byte hash, u64 inode
SERVED = b"S"  # as HITS, for files whose descriptor mountd handed over: it counted them as hits
#: Files a reader opened (the open's ``FUSE_IOCTL``, which Python's ``open()`` sends for every
#: file, its pages cached or not): one HIT_RECORD each, no bytes. Read from the kernel's pages,
#: a file sends no READ; the open is what says it was read (quiverfs/fuse/worker.py).
OPENED = b"O"
HIT_RECORD = struct.Struct("<32sQ")
