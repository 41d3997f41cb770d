"""Real-mount fixtures: a mountd and ``quiverfs mount --foreground`` in subprocesses.

Every fixture skips with the reason when FUSE cannot be used here, polls for readiness with a
deadline while checking that its process is alive (no fixed sleeps), and always cleans up:
``fusermount3 -u`` then ``-z`` for mounts, SIGTERM then SIGKILL for processes. Each module
uses its own temporary cache directory, so a test mountd never meets another one.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import blake3
import pytest
import trio

from quiverfs.testing.mountd import log_tail, stop_process
from quiverfs.testing.users import LocalUser, fuse_for_every_user, spawn_as, stop

REPO = Path(__file__).resolve().parents[2]

#: Seconds a mountd or a mount may take to become ready.
READY_TIMEOUT = 60.0


def fuse_skip_reason() -> str | None:
    """Why real mounts cannot run here, or None."""
    if not os.path.exists("/dev/fuse"):
        return "FUSE unavailable: /dev/fuse does not exist"
    if os.geteuid() != 0:
        return "FUSE mount tests run as root (the test machines' setup)"
    if shutil.which("fusermount3") is None:
        return "FUSE unavailable: fusermount3 is not installed (apt-get install fuse3)"
    return None


@pytest.fixture(scope="module")
def fuse() -> None:
    """Skip the module's tests when FUSE cannot be used."""
    reason = fuse_skip_reason()
    if reason:
        pytest.skip(reason)


@pytest.fixture(scope="module")
def dev_fuse_for_users() -> Iterator[None]:
    """/dev/fuse open to every user for the module (quiverfs.testing.users)."""
    with fuse_for_every_user():
        yield


def quiverfs_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "quiverfs.cli", *args]


def wait_for(predicate: Callable[[], bool], what: str, timeout: float = READY_TIMEOUT,
             alive: Callable[[], str | None] | None = None, interval: float = 0.01) -> None:
    """Poll ``predicate`` until true; fail after ``timeout`` or as soon as ``alive()`` names a death."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if alive is not None:
            died = alive()
            if died:
                raise AssertionError(f"{what}: {died}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(interval)


# -- mountd -------------------------------------------------------------------------------------


class MountdProcess:
    """``quiverfs mountd`` for one cache directory (``extra``: more options)."""

    def __init__(self, cache_dir: Path, cache_size: str = "8G", *extra: str) -> None:
        self.cache_dir = cache_dir
        self.cache_size = cache_size
        self.extra = extra
        self.log = cache_dir.parent / f"{cache_dir.name}-mountd.log"
        self.proc: subprocess.Popen | None = None

    def start(self) -> MountdProcess:
        from mountd.rpc.client import probe

        self.cache_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                quiverfs_cmd("mountd", "--cache-dir", str(self.cache_dir), "--cache-size", self.cache_size,
                             *self.extra),
                stdin=subprocess.DEVNULL, stdout=log, stderr=log, cwd=REPO,
            )
        wait_for(lambda: probe(self.cache_dir, timeout=1.0) is not None, "mountd to answer", alive=self.died)
        return self

    def died(self) -> str | None:
        if self.proc is not None and self.proc.poll() is not None:
            return f"mountd exited with {self.proc.returncode}:\n{log_tail(self.log)}"
        return None

    def kill(self) -> None:
        """SIGKILL, as a crash would."""
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc)


def stop_mountd_of(cache_dir: Path) -> None:
    """Stop a mountd that something else started for ``cache_dir`` (e.g. a mount, on demand)."""
    from mountd.errors import MountdUnavailable
    from mountd.rpc.client import SyncClient

    try:
        with SyncClient.connect(cache_dir, timeout=2.0) as client:
            pid = client.hello_info.get("pid") or client.stats()["server"]["pid"]
    except MountdUnavailable:
        return
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.02)
    os.kill(pid, signal.SIGKILL)


# -- mounts -------------------------------------------------------------------------------------


def mount_pids(mount: MountProcess) -> list[int]:
    """The mount's main process and its forked workers."""
    assert mount.proc is not None
    pid = mount.proc.pid
    children: list[int] = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            children += [int(c) for c in f.read().split()]
    return [pid, *children]


def open_store_files(mount: MountProcess) -> dict[int, list[tuple[str, int]]]:
    """pid -> the store files it has open: their names as ``/proc/PID/fd`` shows them
    (" (deleted)" once evicted) and their sizes."""
    store = str(mount.cache_dir / "store")
    out: dict[int, list[tuple[str, int]]] = {}
    for pid in mount_pids(mount):
        files = []
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith(store):
                    files.append((target, os.stat(f"/proc/{pid}/fd/{fd}").st_size))
            except FileNotFoundError:
                continue  # closed meanwhile
        out[pid] = files
    return out


@contextmanager
def small_tmpfs(path: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` (``"24m"``) mounted at ``path`` (made if missing), private to its
    owner as a cache directory must be; always unmounted. Skips when it cannot be mounted."""
    path.mkdir(parents=True, exist_ok=True)
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs",
                             str(path)], capture_output=True, text=True, check=False)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {result.stderr.strip() or result.returncode}")
    try:
        yield path
    finally:
        if subprocess.run(["umount", str(path)], capture_output=True, check=False).returncode:
            subprocess.run(["umount", "-l", str(path)], capture_output=True, check=False)


def is_mounted(path: Path) -> bool:
    from quiverfs.mount.mountpoint import mounted_fstype

    return mounted_fstype(path) is not None


def force_unmount(path: Path) -> None:
    """``fusermount3 -u``, then ``-z`` if that did not do it."""
    if not is_mounted(path):
        return
    subprocess.run(["fusermount3", "-u", str(path)], capture_output=True, check=False)
    if is_mounted(path):
        subprocess.run(["fusermount3", "-u", "-z", str(path)], capture_output=True, check=False)


class MountProcess:
    """``quiverfs mount --foreground DIGEST MOUNTPOINT`` in a subprocess."""

    def __init__(self, digest: Path, mountpoint: Path, cache_dir: Path, *extra: str) -> None:
        self.digest = digest
        self.mountpoint = mountpoint
        self.cache_dir = cache_dir
        self.extra = extra
        self.log = mountpoint.parent / f"{mountpoint.name}-mount.log"
        self.proc: subprocess.Popen | None = None

    def start(self) -> MountProcess:
        self.mountpoint.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                quiverfs_cmd("mount", "--foreground", "--cache-dir", str(self.cache_dir), *self.extra,
                             str(self.digest), str(self.mountpoint)),
                stdin=subprocess.DEVNULL, stdout=log, stderr=log, cwd=REPO,
            )
        wait_for(self._ready, f"the mount at {self.mountpoint}", alive=self.died)
        return self

    def _ready(self) -> bool:
        if not os.path.ismount(self.mountpoint):
            return False
        try:
            os.listdir(self.mountpoint)
        except OSError:
            return False
        return True

    def died(self) -> str | None:
        if self.proc is not None and self.proc.poll() is not None:
            return f"the mount process exited with {self.proc.returncode}:\n{log_tail(self.log)}"
        return None

    def stop(self) -> None:
        try:
            force_unmount(self.mountpoint)
        finally:
            if self.proc is not None:
                stop_process(self.proc)

    def __enter__(self) -> MountProcess:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


class UserMount:
    """``quiverfs mount --foreground [ARGS] --cache-dir CACHE DIGEST MOUNTPOINT`` run as a
    throwaway local ``user`` from ``home`` (the real-user tests); the mount point is made the
    user's; unmounted and stopped on exit. The log is ``MOUNTPOINT.log`` beside it."""

    def __init__(self, user: LocalUser, home: Path, cache: Path, digest: Path, mountpoint: Path,
                 *args: str) -> None:
        self.user, self.home, self.cache, self.digest = user, home, cache, digest
        self.mountpoint = mountpoint
        self.args = args
        self.log = mountpoint.parent / f"{mountpoint.name}.log"
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> UserMount:
        self.mountpoint.mkdir(parents=True, exist_ok=True)
        os.chown(self.mountpoint, self.user.uid, self.user.gid)
        self.proc = spawn_as(self.user, self.home, [
            "mount", "--foreground", *self.args, "--cache-dir", str(self.cache), str(self.digest),
            str(self.mountpoint)], self.log)
        try:
            # is_mounted reads the mount table: root may not stat another user's FUSE mount.
            wait_for(lambda: is_mounted(self.mountpoint), f"{self.user.name}'s mount",
                     alive=self._died)
        except BaseException:
            self.__exit__()
            raise
        return self

    def _died(self) -> str | None:
        assert self.proc is not None
        code = self.proc.poll()
        return None if code is None else f"exited {code}: {self.log.read_text()[-2000:]}"

    def __exit__(self, *exc_info: object) -> None:
        force_unmount(self.mountpoint)
        if self.proc is not None:
            stop(self.proc)


# -- datasets -----------------------------------------------------------------------------------


def write_tree(root: Path, files: dict[str, bytes]) -> None:
    for rel, data in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)


def build_digest(source: Path, out: Path) -> str:
    """``digests build file://SOURCE -o OUT`` through the Python API; the dataset id."""
    from digests.build import build

    result = trio.run(lambda: build("file://" + str(source), out))
    return result.dataset_id


@contextmanager
def serving(source: Path, work: Path, name: str, cache_size: str = "8G",
            *mountd_options: str, mount_options: tuple[str, ...] = ()) -> Iterator[Path]:
    """Build ``source``'s digest under ``work``, start a mountd of its own (``cache_size``,
    ``mountd_options``; its cache directory is ``work/NAME-cache``) and mount the digest (as
    ``name``, with ``mount_options``); the mount point. Everything is stopped on the way out."""
    digest = work / f"{name}.qd"
    build_digest(source, digest)
    cache = work / f"{name}-cache"
    mountd = MountdProcess(cache, cache_size, *mountd_options).start()
    try:
        with MountProcess(digest, work / f"{name}-mnt", cache, *mount_options) as mount:
            yield mount.mountpoint
    finally:
        mountd.stop()


@contextmanager
def dataset_served(work: Path, files: dict[str, bytes], name: str = "d") -> Iterator[dict]:
    """``files`` written under ``work/source``, their digest ``work/NAME.qd`` and a mountd of
    their own on ``work/cache``: ``{"digest", "cache", "tmp"}`` (mountd stopped on the way out).
    The body of most modules' ``world`` fixture."""
    source = work / "source"
    write_tree(source, files)
    digest = work / f"{name}.qd"
    build_digest(source, digest)
    with _mountd_for(work) as cache:
        yield {"digest": digest, "cache": cache, "tmp": work}


@contextmanager
def datasets_served(work: Path, trees: dict[str, dict[str, bytes]]) -> Iterator[dict]:
    """Each of ``trees`` (name → files) written under ``work/src-NAME`` with its digest
    ``work/NAME.qd``, and one mountd for all of them on ``work/cache``: ``{"digests": {name:
    path}, "cache", "tmp"}`` (mountd stopped on the way out). For datasets that share a cache."""
    digests = {}
    for name, files in trees.items():
        write_tree(work / f"src-{name}", files)
        digests[name] = work / f"{name}.qd"
        build_digest(work / f"src-{name}", digests[name])
    with _mountd_for(work) as cache:
        yield {"digests": digests, "cache": cache, "tmp": work}


@contextmanager
def _mountd_for(work: Path) -> Iterator[Path]:
    """A mountd on ``work/cache`` while inside; its cache directory."""
    cache = work / "cache"
    mountd = MountdProcess(cache).start()
    try:
        yield cache
    finally:
        mountd.stop()


@pytest.fixture
def mountpoint(world: dict, request: pytest.FixtureRequest) -> Iterator[Path]:
    """An empty directory of the test's own under the module's ``world``, unmounted after."""
    path = world["tmp"] / f"mnt-{request.node.name}"
    path.mkdir()
    yield path
    force_unmount(path)


def file_hash(path: str | os.PathLike[str], chunk: int = 1 << 20) -> bytes:
    """blake3 of a file, read in chunks (through the mount when ``path`` is in one)."""
    hasher = blake3.blake3()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            hasher.update(block)
    return hasher.digest()


@pytest.fixture(scope="module")
def module_tmp(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Iterator[Path]:
    """A temporary directory for the module (its own cache directory lives in it)."""
    yield tmp_path_factory.mktemp(request.module.__name__.rsplit(".", 1)[-1])


def drop_pages(path: Path) -> None:
    """Make the kernel forget a mount file's cached pages, so that its next read reaches the
    mount."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def mount_stats(mountpoint: Path) -> dict:
    """The mount's ``user.quiver.stats``."""
    return json.loads(os.getxattr(mountpoint, "user.quiver.stats"))


def sha(data: bytes) -> str:
    """A short name for bytes in assertion messages."""
    return hashlib.sha256(data).hexdigest()
