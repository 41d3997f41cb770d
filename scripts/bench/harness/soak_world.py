"""The soak benchmark's world (scripts/bench/soak.py): what it changes on the machine, its
datasets, and the processes it starts and restarts — mountd, the mounts, the jobs.

Everything here is undone or stopped by its owner: the context managers restore what they
changed (``/etc/fuse.conf``, ``/dev/fuse``'s mode, a tmpfs); :class:`Mountd` and
:class:`Mount` stop their process (unmount first; SIGTERM, then SIGKILL) in ``stop``; a
:class:`Job`'s process belongs to :func:`harness.launch.run_together`, which kills it on a
failure or a timeout (and the soak kills those a cut-short run leaves).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import subprocess
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import trio

from harness.soak_job import SoakJobSpec
from harness.world import force_unmount, mount_answers, quiverfs_cmd, wait_for
from quiverfs.testing.mountd import log_tail, stop_process
from quiverfs.testing.soak import DigestTable, Tally, alive, children

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
BUCKET, PREFIX = "soak", "train"


# -- what the run changes on the machine, undone after it --------------------------------------


@contextlib.contextmanager
def user_allow_other() -> Iterator[None]:
    """``user_allow_other`` in /etc/fuse.conf for the run (the second user's mount is read
    by root's jobs: ``--allow-other``); the file is restored byte for byte."""
    path = Path("/etc/fuse.conf")
    try:
        text: str | None = path.read_text()
    except FileNotFoundError:
        text = None
    if text is not None and any(line.strip() == "user_allow_other" for line in text.splitlines()):
        yield
        return
    path.write_text((text or "") + ("" if not text or text.endswith("\n") else "\n") + "user_allow_other\n")
    try:
        yield
    finally:
        if text is None:
            path.unlink(missing_ok=True)
        else:
            path.write_text(text)



@contextlib.contextmanager
def tmpfs(path: Path, size: int) -> Iterator[Path]:
    """A tmpfs of ``size`` bytes at ``path`` (mode 0711), unmounted after."""
    if os.path.ismount(path):  # left by a killed run
        subprocess.run(["umount", "-l", str(path)], check=False, capture_output=True)
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0711", "quiverfs-soak", str(path)],
                   check=True, capture_output=True)
    try:
        yield path
    finally:
        done = subprocess.run(["umount", str(path)], check=False, capture_output=True)
        if done.returncode != 0:
            subprocess.run(["umount", "-l", str(path)], check=False, capture_output=True)


# -- datasets ----------------------------------------------------------------------------------------


@dataclass
class Version:
    """One version of a dataset's digest and when a mount of it served (``time.time()``)."""

    table: DigestTable
    start: float
    end: float | None = None


@dataclass
class Dataset:
    """A dataset of the run: ``A`` (S3) or ``B`` (file://), its digest and its versions."""

    tag: str
    url: str
    digest: Path
    file_size: int
    source: Path | None = None  # B: the directory that is the bucket
    versions: list[Version] = field(default_factory=list)

    @property
    def rels(self) -> list[str]:
        return self.versions[0].table.paths()

    @property
    def total_bytes(self) -> int:
        return sum(size for _, size in self.versions[0].table.rows.values())


def dataset_files(files: int, size: int, seed: int) -> Iterator[tuple[str, bytes]]:
    """``files`` files of ``size`` random bytes in 10 class folders (no two alike)."""
    rng = random.Random(seed)
    for i in range(files):
        yield f"class_{i % 10:03d}/img_{i:07d}.bin", rng.randbytes(size)


def build_digest(url: str, out: Path, settings=None) -> None:
    """``digests build URL -o OUT`` (through a temp name: a rename replaces the old file)."""
    from digests.build import build

    partial = out.with_name(out.name + ".new")
    partial.unlink(missing_ok=True)
    trio.run(lambda: build(url, partial, settings=settings))
    partial.chmod(0o644)
    os.replace(partial, out)


def make_s3_dataset(s3, run: Path, files: int, size: int, env: dict[str, str]) -> Dataset:
    """Dataset A: ``files`` objects uploaded to a bucket of the S3 emulator ``s3``, and their
    digest (built with ``env``, the emulator's credentials, as the process environment)."""
    s3.create_bucket(BUCKET)
    s3.upload_threads = 4
    s3.upload_many(BUCKET, ((f"{PREFIX}/{rel}", data) for rel, data in dataset_files(files, size, 1)))
    digest = run / "A.qd"
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)  # boto3's credential chain reads the environment
    try:
        build_digest(s3.root_url(BUCKET, PREFIX), digest, settings=s3.settings())
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return Dataset("A", s3.root_url(BUCKET, PREFIX), digest, size,
                   versions=[Version(DigestTable.load(digest), 0.0)])


def make_file_dataset(run: Path, files: int, size: int) -> Dataset:
    """Dataset B: ``files`` files under ``run/B-source`` (readable by every user) and their
    digest."""
    source = run / "B-source"
    for rel, data in dataset_files(files, size, 2):
        path = source / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    digest = run / "B.qd"
    build_digest("file://" + str(source), digest)
    return Dataset("B", "file://" + str(source), digest, size, source,
                   versions=[Version(DigestTable.load(digest), 0.0)])


# -- mountd, the mounts and the jobs ------------------------------------------------------------------


class Mountd:
    """``quiverfs mountd`` on the run's cache, started again after each kill."""

    def __init__(self, cache_dir: Path, flags: list[str], env: dict[str, str], log: Path) -> None:
        self.cache_dir, self.flags, self.env, self.log = cache_dir, flags, env, log
        self.proc: subprocess.Popen | None = None
        self.starts = 0
        #: ``time.time()`` of the last start
        self.started = 0.0

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None and self.proc.poll() is None else None

    def counters(self) -> dict:
        """mountd's total counters since its last start (``quiverfs stats --json``)."""
        from mountd.rpc.client import SyncClient

        with SyncClient.connect(self.cache_dir, timeout=10.0) as client:
            return client.stats()["counters"]["total"]

    def start(self) -> None:
        """Start it in its own session and wait until it answers (fail with its log's tail
        if it exits first)."""
        from mountd.rpc.client import probe

        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                quiverfs_cmd("mountd", "--cache-dir", str(self.cache_dir), *self.flags),
                stdin=subprocess.DEVNULL, stdout=log, stderr=log, cwd=REPO, env=self.env,
                start_new_session=True)
        self.starts += 1
        self.started = time.time()
        proc = self.proc
        wait_for(lambda: probe(self.cache_dir, timeout=1.0) is not None, "mountd to answer",
                 alive=lambda: None if proc.poll() is None else
                 f"mountd exited with {proc.returncode}:\n{log_tail(self.log)}")

    def kill(self) -> list[int]:
        """SIGKILL, as a crash would; the pids of its fill processes at that moment."""
        assert self.proc is not None
        fills = children(self.proc.pid)
        self.proc.kill()
        self.proc.wait()
        return fills

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 15 s."""
        if self.proc is not None:
            stop_process(self.proc, 15)


class Mount:
    """``quiverfs mount --foreground`` of a dataset, as root or as ``user``."""

    def __init__(self, dataset: Dataset, mountpoint: Path, cache_dir: Path, env: dict[str, str],
                 log: Path, user=None, home: Path | None = None, args: tuple[str, ...] = ()) -> None:
        self.dataset, self.mountpoint, self.cache_dir = dataset, mountpoint, cache_dir
        self.env, self.log, self.user, self.home, self.args = env, log, user, home, args
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None and self.proc.poll() is None else None

    def start(self) -> None:
        """Mount (as the mount's user when it has one) and wait until the mount answers a
        listing (fail with its log's tail if the process exits first)."""
        from quiverfs.testing.users import spawn_as

        self.mountpoint.mkdir(parents=True, exist_ok=True)
        argv = ["mount", "--foreground", *self.args, "--cache-dir", str(self.cache_dir),
                str(self.dataset.digest), str(self.mountpoint)]
        if self.user is not None:
            os.chown(self.mountpoint, self.user.uid, self.user.gid)
            self.proc = spawn_as(self.user, self.home, argv, self.log)
        else:
            with open(self.log, "ab") as log:
                self.proc = subprocess.Popen(quiverfs_cmd(*argv), stdin=subprocess.DEVNULL, stdout=log,
                                             stderr=log, cwd=REPO, env=self.env, start_new_session=True)
        self.starts += 1
        proc = self.proc
        wait_for(self._ready, f"the mount of {self.dataset.tag}",
                 alive=lambda: None if proc.poll() is None else
                 f"the mount of {self.dataset.tag} exited with {proc.returncode}:\n{log_tail(self.log)}")

    def _ready(self) -> bool:
        return mount_answers(self.mountpoint)

    def stop(self) -> int | None:
        """Unmount and stop the process; its exit status (None: it was not running)."""
        force_unmount(self.mountpoint)
        if self.proc is None:
            return None
        return stop_process(self.proc, 15)


@dataclass
class Job:
    """A soak job (harness/soak_job.py): its spec, its dataset, whose it is, and its process
    once :func:`harness.launch.run_together` started it (``pid``)."""

    spec: SoakJobSpec
    tag: str
    user: object = None
    home: Path | None = None
    pid: int | None = None

    def write_spec(self, folder: Path) -> Path:
        """The spec as JSON in ``folder`` (readable by the job's user); its path."""
        spec_file = folder / f"{self.spec.name}.json"
        spec_file.write_text(json.dumps(asdict(self.spec)))
        spec_file.chmod(0o644)
        return spec_file

    def options(self) -> dict:
        """``subprocess.Popen`` arguments of the job's process: its own session (a Ctrl-C is
        the benchmark's to handle) and, for another user, that user's ids and environment."""
        options: dict = {"start_new_session": True}
        if self.user is not None:
            env = dict(os.environ, HOME=str(self.home), USER=self.user.name, LOGNAME=self.user.name)
            env.pop("XDG_RUNTIME_DIR", None)
            options.update(user=self.user.uid, group=self.user.gid, extra_groups=list(self.user.groups),
                           env=env)
        return options

    @property
    def running(self) -> bool:
        return self.pid is not None and alive(self.pid)

    def tally(self) -> tuple[Tally, dict]:
        """The job's last status: its tally, and the whole JSON."""
        data = json.loads(Path(self.spec.status).read_text())
        return Tally.from_json(data), data
