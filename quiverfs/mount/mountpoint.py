"""Mount points: what ``/proc/self/mountinfo`` says is mounted, whether FUSE can be used here,
the claim on a mount point, and unmounting.

One mount per mount point: the check that nothing is mounted there and the mount itself
happen under an exclusive ``flock`` of the mount point directory (:func:`claim_mountpoint`),
so of two ``quiverfs mount`` racing for one directory exactly one mounts; the other gets one
line. A mount remembers which mount it made (its id in ``/proc/self/mountinfo``) and, when it
fails or stops, unmounts that one only (:func:`unmount_own`), never a mount someone else made
at the same place.
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from quiverfs.base.errors import QuiverError, UsageError
from quiverfs.fuse import channel as fuse_channel

#: File system type in /proc/mounts (``fuse.`` + the subtype).
FSTYPE = "fuse.quiverfs"


class MountError(QuiverError):
    """The mount could not be started or stopped; ``str()`` says why in one line."""


def _unescape(field: str) -> str:
    # /proc/mounts escapes space, tab, newline and backslash as \ooo octal.
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and i + 4 <= len(field) and field[i + 1:i + 4].isdigit():
            out.append(chr(int(field[i + 1:i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


#: Which mount: its id in /proc/self/mountinfo and its device (``major:minor``). Ids are
#: reused only after an unmount; the pair tells our mount from a later one at the same place.
MountIdentity = tuple[int, str]


def _topmost_mount(mountpoint: str | os.PathLike[str]) -> tuple[MountIdentity, str] | None:
    """The topmost mount at ``mountpoint`` per ``/proc/self/mountinfo`` (last wins): its
    identity and file system type, or None."""
    target = os.path.abspath(os.fspath(mountpoint))
    found = None
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
            for line in f:
                # id, parent id, major:minor, root, mount point, options, [optional fields],
                # "-", fstype, source, super options
                parts = line.rstrip("\n").split(" ")
                if len(parts) >= 5 and _unescape(parts[4]) == target:
                    fstype = parts[parts.index("-", 5) + 1]
                    found = ((int(parts[0]), parts[2]), fstype)
    except (OSError, ValueError, IndexError):
        return None
    return found


def mounted_fstype(mountpoint: str | os.PathLike[str]) -> str | None:
    """The file system type of the topmost mount at ``mountpoint``, or None."""
    found = _topmost_mount(mountpoint)
    return None if found is None else found[1]


def mount_identity(mountpoint: str | os.PathLike[str]) -> MountIdentity | None:
    """The identity of the topmost mount at ``mountpoint``, or None."""
    found = _topmost_mount(mountpoint)
    return None if found is None else found[0]


def unmount_own(mountpoint: Path, mine: MountIdentity | None) -> None:
    """Unmount ``mountpoint`` lazily if the mount there is still ``mine``; else touch nothing."""
    if mine is not None and mount_identity(mountpoint) == mine:
        fuse_channel.unmount(mountpoint, lazy=True)


def fuse_unavailable() -> str | None:
    """Why FUSE cannot be used here (a one-line reason), or None when it can."""
    if not os.path.exists("/dev/fuse"):
        return "/dev/fuse does not exist (load the fuse module, or give the container the device)"
    if not os.access("/dev/fuse", os.R_OK | os.W_OK):
        return ("/dev/fuse is not readable and writable by this user (distributions make it "
                "0666; a container may need: chmod 666 /dev/fuse)")
    if shutil.which("fusermount3") is None:
        return "fusermount3 is not installed (apt-get install fuse3)"
    return None


def _already_mounted(mountpoint: Path) -> UsageError:
    return UsageError(f"{mountpoint} is already a mount point (quiverfs umount {mountpoint} first)")


def check_mountpoint(mountpoint: Path, nonempty: bool = False) -> None:
    """Raise :class:`UsageError` unless ``mountpoint`` is an existing, unmounted directory,
    and an empty one unless ``nonempty``.

    Entries found are checked against ``/proc/mounts`` once more: a mount racing ours may
    land between the first check and the listing, which then lists the new mount's root
    (racing mounts, tests/mount/test_fs_mountpoint.py: the loser said "not empty")."""
    if mounted_fstype(mountpoint) is not None:
        raise _already_mounted(mountpoint)
    if not mountpoint.is_dir():
        what = "does not exist" if not mountpoint.exists() else "is not a directory"
        raise UsageError(f"mount point {mountpoint} {what}")
    if nonempty:
        return
    try:
        with os.scandir(mountpoint) as entries:
            occupied = next(entries, None) is not None
    except OSError as exc:
        raise UsageError(f"cannot read mount point {mountpoint}: {os.strerror(exc.errno or errno.EIO)}") from None
    if occupied:
        if mounted_fstype(mountpoint) is not None:
            raise _already_mounted(mountpoint)
        raise UsageError(f"mount point {mountpoint} is not empty (--nonempty mounts over its entries, hiding them)")


@contextmanager
def claim_mountpoint(mountpoint: Path, nonempty: bool = False) -> Iterator[None]:
    """Hold ``mountpoint`` for our mount: check it and mount inside the ``with``.

    The lock is an exclusive ``flock`` of the directory, taken without waiting: a second
    mount racing for it gets :class:`UsageError` at once. One that comes after the mount
    opens the mounted root instead (another inode: its lock succeeds), and the check under
    the lock then finds the mount in ``/proc/mounts``. So at most one mount is ever made.
    """
    check_mountpoint(mountpoint, nonempty)  # the common refusals, before opening anything
    try:
        fd = os.open(mountpoint, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise UsageError(f"cannot open mount point {mountpoint}: {os.strerror(exc.errno or errno.EIO)}") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise UsageError(f"{mountpoint} is being mounted by another process") from None
        check_mountpoint(mountpoint, nonempty)
        yield
    finally:
        os.close(fd)


def unmount(mountpoint: str | os.PathLike[str], *, lazy: bool = False) -> None:
    """Unmount the quiverfs mount at ``mountpoint`` with ``fusermount3 -u``.

    A mount whose process died ("Transport endpoint is not connected") is detached lazily
    (``-z``); so is every mount with ``lazy=True``. Raises :class:`UsageError` when nothing
    (or something other than quiverfs) is mounted there, :class:`MountError` when it is busy.
    """
    path = os.path.abspath(os.fspath(mountpoint))
    fstype = mounted_fstype(path)
    if fstype is None:
        raise UsageError(f"{path} is not mounted")
    if fstype != FSTYPE:
        raise UsageError(f"{path} is a {fstype} mount, not quiverfs")
    tool = shutil.which("fusermount3")
    if tool is None:
        raise MountError("fusermount3 is not installed (apt-get install fuse3)")
    result = subprocess.run([tool, "-u", *(["-z"] if lazy else []), path],
                            capture_output=True, text=True, check=False)
    if result.returncode == 0:
        return
    message = (result.stderr or result.stdout).strip().splitlines()[-1:] or [f"status {result.returncode}"]
    text = message[0]
    if not lazy and "not connected" in text.lower():
        # The serving process is gone; only a lazy unmount detaches such a mount.
        unmount(path, lazy=True)
        return
    if "busy" in text.lower():
        raise MountError(f"{path} is busy (files or directories open there): close them, or use --lazy")
    raise MountError(f"cannot unmount {path}: {text}")
