#!/usr/bin/env python3
"""A soak: two mounts, four jobs and a fault every few minutes, checked for leaks and wrong bytes.

Issue 36, item 7. One mountd (cache = 20% of the two datasets, on a tmpfs of its own that a
filler file can fill) serves two mounts:

* **A**, an ``s3://`` dataset in the moto S3 server, reached through a fault-injecting proxy
  (``quiverfs.testing.faultproxy``), mounted by root;
* **B**, a ``file://`` dataset, mounted by a second local user (``qfs_test_soak``, made for the
  run and removed after it) with ``--allow-other``, so its misses take the path of other users'
  mounts: the mount reads the source with its own rights and hands the bytes to mountd.

Four jobs (scripts/bench/harness/soak_job.py: a real DataLoader, two workers, a sleep per
mini-batch) read them for the whole run: ``A-shim`` and ``B-shim`` with
``quiverfs.torch.QuiverBatchSampler``, ``A-shuffle`` and ``B-shuffle`` with a shuffled sampler;
``B-shuffle`` runs as the second user. Every read's bytes are checked against the blake3 and
size in the digest.

Every ``--fault-every`` seconds something goes wrong on purpose, in turn:

=================  ==========================================================================
``mountd-kill``    mountd SIGKILLed, started again after a few seconds (its fill processes
                   die with it)
``bucket-down``    the proxy answers every S3 request with HTTP 503 for half the window, then
                   resets every connection (TCP RST) for the other half (a minute by default)
``worker-kill``    one FUSE worker of a mount SIGKILLed (A and B in turn); the mount replaces it
``disk-full``      another program fills the cache's filesystem (a filler file), removed
                   after the window
``digest-replace`` 2% of B's files rewritten with new bytes, B's digest rebuilt and renamed over
                   the file the mount was started from; the mount keeps serving its private
                   copy (changed files it has not cached fail verification: EIO), and is
                   mounted again on the new digest after a while (docs/mount.md "The digest
                   copy": to serve a new version, mount it again)
=================  ==========================================================================

Each fault is a *window* from its start to the moment its cause is gone (mountd answering
again, the proxy disarmed, the worker replaced, the filler removed, the new mount ready),
plus a grace of 10 s for the recovery. Every ``--sample-every`` seconds the script samples
the resident memory, open descriptors and threads of every quiverfs process, by role:
mountd, its fill processes, each mount's main process and its FUSE workers, each job's main
process and its loader workers (a job's descriptors of the files under its mount left out:
those are the reads in progress, quiverfs/testing/soak.py ``Role``); and the bytes in the
cache's ``store/`` and ``tmp/`` (also every 2 s, for the maximum).

Printed at the end: a table of every series after the warm-up (first five minutes) with its
least-squares slope per minute, fitted within each process's life (a restarted process starts
a new segment), relative to its mean, and what the slope adds up to over the span; the fault
windows with the read errors each explains; and the targets, PASS or FAIL:

* 0 wrong bytes (a read of B that returns another *version* of the file counts as right only
  while a mount of that version was serving);
* read errors only inside the fault windows;
* no series growing after the warm-up: RSS within ±10% over the span, descriptors and threads
  flat (the fitted growth over the span below 1, or 5% of the mean where that is more);
* cache bytes at most the cap plus one file in flight per fill slot;
* a fault of one dataset (its bucket down, its digest replaced) leaves the other dataset's
  jobs at least half the reads/s they had in the minute before it;
* every job read again after each fault window, and no process of a killed mountd (its fill
  processes) or of an unmounted mount is left running.

    .venv/bin/python scripts/bench/soak.py                    # 30 minutes, a fault every 3
    .venv/bin/python scripts/bench/soak.py --minutes 3        # a quick run, faults every 30 s
    .venv/bin/python scripts/bench/soak.py --minutes 10 --fault-every 60

Needs root and FUSE (and ``useradd`` unless ``--no-second-user``); turns on
``user_allow_other`` in /etc/fuse.conf and makes /dev/fuse 0666 for the run, restoring both.
Everything lives under .bench/soak/ (git-ignored): the logs of mountd, the mounts and the
jobs, the jobs' statuses and ``results.json``. Ctrl-C or SIGTERM stops every process the
benchmark started and undoes what it changed.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO))

from harness.launch import run_together  # noqa: E402
from harness.soak_faults import FAULTS, Fault, index_bytes  # noqa: E402
from harness.soak_job import SoakJobSpec  # noqa: E402
from harness.soak_report import READINGS, SoakReport  # noqa: E402
from harness.soak_world import (  # noqa: E402
    Dataset,
    Job,
    Mount,
    Mountd,
    make_file_dataset,
    make_s3_dataset,
    tmpfs,
    user_allow_other,
)
from harness.world import BENCH, force_unmount, sigterm_as_interrupt, stop_mountd_of  # noqa: E402

from mountd.store.evictions import JOURNAL_ENTRIES  # noqa: E402
from quiverfs.base.errors import QuiverError  # noqa: E402
from quiverfs.testing.mountd import log_tail  # noqa: E402
from quiverfs.testing.soak import (  # noqa: E402
    FaultWindow,
    Role,
    RoleSample,
    Tally,
    alive,
    cache_bytes,
    sample_role,
)
from quiverfs.testing.users import (  # noqa: E402
    LocalUsers,
    fuse_for_every_user,
    interpreter_reachable,
    unavailable_reason,
)

WORK = BENCH / "soak"
USER = "qfs_test_soak"
#: Seconds after a fault window's end during which errors are still the fault's (recovery:
#: a reconnect, a retry's backoff, a read that started during the window).
GRACE = 10.0
#: Seconds the jobs may take to set up (torch imported, loaders built) before they start.
JOB_SETUP = 300.0
KINDS = ("mountd-kill", "bucket-down", "worker-kill", "disk-full", "digest-replace")


def progress(message: str) -> None:
    print(f"[soak] {message}", file=sys.stderr, flush=True)


# -- the plan --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    """How long the run lasts and how its faults, samples and warm-up are spaced (seconds)."""

    seconds: float
    fault_every: float
    sample_every: float
    warmup: float
    mountd_down: float
    bucket_down: float
    disk_full: float
    digest_hold: float
    grace: float = GRACE

    @classmethod
    def of(cls, args: argparse.Namespace) -> Plan:
        """The defaults for a long run (15 minutes or more: a fault every 3 minutes, samples
        each minute, 5 minutes of warm-up), compressed for a short one; options win."""
        seconds = args.minutes * 60.0
        long = args.minutes >= 15
        every = args.fault_every or (180.0 if long else max(20.0, seconds / 6))
        return cls(seconds, every,
                   args.sample_every or (60.0 if long else max(5.0, seconds / 18)),
                   args.warmup if args.warmup is not None else (300.0 if long else seconds / 3),
                   mountd_down=min(5.0, every / 6), bucket_down=min(60.0, every / 2),
                   disk_full=min(60.0, every / 2), digest_hold=min(20.0, every / 3))

    def expected(self, kind: str) -> float:
        """About how long a fault of ``kind`` lasts (to fit the last one in the run)."""
        return {"mountd-kill": self.mountd_down + 3, "bucket-down": self.bucket_down,
                "worker-kill": 3.0, "disk-full": self.disk_full,
                "digest-replace": self.digest_hold + 8}[kind]

    def schedule(self) -> list[tuple[float, str]]:
        """(seconds after the start, kind) of every fault: the kinds in turn, one every
        ``fault_every``, as long as the fault and its grace end before the run does."""
        out = []
        k = 1
        while (at := k * self.fault_every) + self.expected(KINDS[(k - 1) % len(KINDS)]) + self.grace < self.seconds:
            out.append((at, KINDS[(k - 1) % len(KINDS)]))
            k += 1
        return out


# -- the run -------------------------------------------------------------------------------------------


class Soak(SoakReport):
    """Everything a run holds; :meth:`run` does it, :meth:`report` prints it."""

    def __init__(self, args: argparse.Namespace, plan: Plan, run: Path) -> None:
        self.args, self.plan, self.run_dir = args, plan, run
        self.stack = contextlib.ExitStack()
        self.windows: list[FaultWindow] = []
        self.samples: dict[str, list[RoleSample]] = {}
        self.cache_points: list[tuple[float, float, object]] = []
        self.index_points: list[tuple[float, float, object]] = []
        #: (t, mountd's pid, files it evicted since it started), each sample period
        self.removals: list[tuple[float, int, int]] = []
        self.cache_max = 0
        self.dir_max = 0
        self.leftovers: list[str] = []
        self.deaths: list[str] = []
        self.worker_kills = 0
        self.datasets: dict[str, Dataset] = {}
        self.mounts: list[Mount] = []
        self.jobs: list[Job] = []

    # -- set-up ---------------------------------------------------------------------------

    def setup(self) -> None:
        """The second user, the S3 emulator and its proxy, the datasets, the cache's tmpfs,
        mountd, the two mounts, the jobs' specs; each undone by ``stack``."""
        from quiverfs.testing.emulators import run_moto
        from quiverfs.testing.faultproxy import FaultProxy

        args, run = self.args, self.run_dir
        user = home = None
        if not args.no_second_user:
            users = self.stack.enter_context(LocalUsers())
            user = users.user(USER)
            self.stack.enter_context(interpreter_reachable(REPO))
            self.stack.enter_context(fuse_for_every_user())
            self.stack.enter_context(user_allow_other())
            home = run / "home"
            home.mkdir()
            os.chown(home, user.uid, user.gid)
        self.user, self.home = user, home
        progress("starting the S3 emulator and its fault proxy")
        s3 = self.stack.enter_context(run_moto())
        self.proxy = self.stack.enter_context(FaultProxy(s3.port, flavor="s3"))
        drop = ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3", "AWS_CONFIG_FILE",
                "AWS_SHARED_CREDENTIALS_FILE")
        clean = {k: v for k, v in os.environ.items() if k not in drop}
        progress(f"writing two datasets of {args.files} files x {args.file_size // 1024} KiB")
        self.datasets = {"A": make_s3_dataset(s3, run, args.files, args.file_size, clean | s3.env),
                         "B": make_file_dataset(run, args.files, args.file_size)}
        data = sum(d.total_bytes for d in self.datasets.values())
        self.cap = int(data * args.cache_fraction)
        # Room for the cache, the index and its write-ahead log (which grew to several times
        # the cap here), the mounts' digest copies; the filler takes what is left.
        self.fs_size = 3 * self.cap + (256 << 20)
        self.cachefs = self.stack.enter_context(tmpfs(run / "cachefs", self.fs_size))
        self.cache_dir = self.cachefs / "cache"
        env = clean | s3.env_for(self.proxy.endpoint)
        self.mountd = Mountd(self.cache_dir, ["--cache-size", str(self.cap), "--shared"], env,
                             run / "mountd.log")
        progress(f"starting mountd (cache {self.cap / 2**20:.1f} MiB = {args.cache_fraction:.0%} of "
                 f"{data / 2**20:.1f} MiB) and the two mounts")
        self.mountd.start()
        self.stack.callback(self.mountd.stop)
        a = Mount(self.datasets["A"], run / "mnt-A", self.cache_dir, env, run / "mount-A.log")
        b = Mount(self.datasets["B"], run / "mnt-B", self.cache_dir, env, run / "mount-B.log", user=user,
                  home=home, args=("--allow-other",) if user is not None else ())
        for mount in (a, b):
            mount.start()
            self.stack.callback(mount.stop)
            self.mounts.append(mount)
        self.make_jobs()

    def make_jobs(self) -> None:
        """The four jobs' specs: a shim and a shuffle per dataset, B's shuffle as the second
        user (their statuses in ``jobs/``, which that user may write)."""
        args, run = self.args, self.run_dir
        folder = run / "jobs"
        folder.mkdir(mode=0o755)
        if self.user is not None:
            os.chown(folder, self.user.uid, self.user.gid)
        plan = [("A-shim", "A", "shim", None), ("A-shuffle", "A", "shuffle", None),
                ("B-shim", "B", "shim", None), ("B-shuffle", "B", "shuffle", self.user)]
        for i, (name, tag, sampler, user) in enumerate(plan):
            mount = self.mounts[0 if tag == "A" else 1]
            spec = SoakJobSpec(name=name, sampler=sampler, root=str(mount.mountpoint),
                               digest=str(self.datasets[tag].digest), status=str(folder / f"{name}.status.json"),
                               seconds=self.plan.seconds, batch_size=args.batch_size, compute_s=args.compute,
                               workers=args.workers, seed=i)
            self.jobs.append(Job(spec, tag, user, self.home if user is not None else None))
        self.job_folder = folder

    def start_jobs(self) -> None:
        """Start the jobs together (:func:`harness.launch.run_together`, in a thread of its
        own while this one makes the faults): once each has set up (torch imported, loader
        built), they start at once, and the run's clock with them."""
        progress("starting the four jobs (torch, DataLoader workers)")
        specs = [(job.spec.name, job.write_spec(self.job_folder)) for job in self.jobs]
        started = threading.Event()
        self.job_error: BaseException | None = None

        def on_start(pids: list[int]) -> None:
            for job, pid in zip(self.jobs, pids, strict=True):
                job.pid = pid
            self.start = time.time()
            started.set()

        def together() -> None:
            try:
                run_together(specs, HERE / "harness" / "soak_job.py", self.job_folder, cwd=REPO,
                             timeout=JOB_SETUP + self.plan.seconds + 120, on_start=on_start,
                             options={job.spec.name: job.options() for job in self.jobs})
            except BaseException as exc:  # noqa: BLE001 - reported by the run (check_alive, report)
                self.job_error = exc
            finally:
                started.set()

        self.jobs_thread = threading.Thread(target=together, name="soak jobs", daemon=True)
        self.jobs_thread.start()
        self.stack.callback(self.stop_jobs)
        while not started.wait(0.5):  # (a loop: Ctrl-C gets through)
            pass
        if self.job_error is not None:
            raise RuntimeError(f"the jobs did not start: {self.job_error}")
        for d in self.datasets.values():
            d.versions[0].start = self.start - 1.0

    def stop_jobs(self) -> None:
        """Kill the jobs still running (a run cut short) and wait for their launcher."""
        for job in self.jobs:
            if job.running:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(job.pid, signal.SIGKILL)
        self.jobs_thread.join(30)

    # -- the run ----------------------------------------------------------------------------

    def roles(self) -> list[Role]:
        """Every quiverfs process of the run, by role (found afresh at each reading)."""
        out = [Role.main("mountd", lambda: self.mountd.pid),
               Role.children_of("mountd fill processes", lambda: self.mountd.pid)]
        for mount in self.mounts:
            who = f" ({self.user.name})" if mount.user is not None else ""
            out += [Role.main(f"mount {mount.dataset.tag}{who}", lambda m=mount: m.pid),
                    Role.children_of(f"mount {mount.dataset.tag} workers", lambda m=mount: m.pid)]
        for job in self.jobs:
            who = f" ({self.user.name})" if job.user is not None else ""
            data = (job.spec.root,)  # the files it is reading now are not held (Role)
            out += [Role.main(f"job {job.spec.name}{who}", lambda j=job: j.pid if j.running else None, data),
                    Role.children_of(f"job {job.spec.name} loader workers",
                                     lambda j=job: j.pid if j.running else None, data)]
        return out

    def sample(self, roles: list[Role]) -> None:
        """One reading of every role (``samples``: every reading; the table uses each
        period's floor, :func:`floors`)."""
        now = time.time()
        for role in roles:
            self.samples.setdefault(role.name, []).append(sample_role(role, now - self.start))

    def sample_removals(self, now: float) -> None:
        """mountd's files evicted since its start, with its pid (see :meth:`journal_full`)."""
        pid = self.mountd.pid
        if pid is None:
            return
        try:
            evicted = self.mountd.counters()["evicted_files"]
        except (OSError, QuiverError):
            return  # down or restarting: the next sample has it
        self.removals.append((now - self.start, pid, evicted))

    def journal_full(self, point: RoleSample) -> bool:
        """Whether mountd's eviction journal was full at ``point`` (a point of the mountd
        series). The journal (mountd/store/evictions.py) keeps the last JOURNAL_ENTRIES
        hashes that left the store, ~20 MiB when full: until then mountd's RSS grows with
        every eviction by design, and only a full journal shows growth of anything else."""
        known = [n for t, pid, n in self.removals if pid in point.pids and t <= point.t]
        return bool(known) and known[-1] >= JOURNAL_ENTRIES

    def check_alive(self) -> None:
        """Note a mount or a job that ended on its own (not a fault of ours): each once."""
        for mount in self.mounts:
            if mount.proc is not None and mount.proc.poll() is not None and mount.starts:
                self.deaths.append(f"{time.time() - self.start:.0f} s: the mount of {mount.dataset.tag} "
                                   f"exited with {mount.proc.returncode}: {log_tail(mount.log, 3)}")
                mount.starts = 0  # reported once
        for job in self.jobs:
            if (not job.running and time.time() < self.start + self.plan.seconds - 5
                    and not any(job.spec.name in d for d in self.deaths)):
                self.deaths.append(f"{time.time() - self.start:.0f} s: job {job.spec.name} ended early "
                                   f"({self.job_error or 'see its log'})")

    def run(self) -> None:
        """Start the jobs, then until the end: the faults on schedule (each stepped until
        its cause is gone), the readings, the samples and the cache's maximum."""
        self.start_jobs()
        plan = self.plan
        schedule = [(self.start + at, kind) for at, kind in plan.schedule()]
        progress(f"running {plan.seconds / 60:g} min: {len(schedule)} faults, one every "
                 f"{plan.fault_every:g} s; samples every {plan.sample_every:.0f} s; warm-up {plan.warmup:.0f} s")
        roles = self.roles()
        active: list[Fault] = []
        next_sample = next_cache = next_reading = self.start
        # READINGS per sample period: the period's floor is the series' point.
        reading_every = max(0.5, plan.sample_every / READINGS)
        end = self.start + plan.seconds
        while (now := time.time()) < end or active:
            while schedule and schedule[0][0] <= now:
                _, kind = schedule.pop(0)
                fault = FAULTS[kind](self)
                self.windows.append(fault.begin())
                active.append(fault)
                progress(f"{now - self.start:6.0f} s  fault: {kind} ({fault.window.note})")
            for fault in list(active):
                if fault.step(time.time()):
                    active.remove(fault)
                    w = fault.window
                    progress(f"{time.time() - self.start:6.0f} s  over:  {w.kind} after "
                             f"{w.end - w.start:.1f} s ({w.note})")
            if now >= next_reading and now < end:
                self.sample(roles)
                next_reading += reading_every
            if now >= next_sample and now < end:
                self.sample_removals(now)
                self.cache_points.append((now - self.start, float(cache_bytes(self.cache_dir)), "cache"))
                self.index_points.append((now - self.start, float(index_bytes(self.cache_dir)), "index"))
                next_sample += plan.sample_every
                reads = sum(self.job_reads().values())
                progress(f"{now - self.start:6.0f} s  sample: cache {self.cache_points[-1][1] / 2**20:.1f} MiB, "
                         f"{reads:,} verified reads so far")
            if now >= next_cache:
                store = cache_bytes(self.cache_dir)
                self.cache_max = max(self.cache_max, store)
                self.dir_max = max(self.dir_max, store + index_bytes(self.cache_dir))
                next_cache += 2.0
            self.check_alive()
            time.sleep(0.25)
        progress("the run is over: waiting for the jobs to stop")
        self.jobs_thread.join(120)
        if self.job_error is not None:
            self.deaths.append(f"the jobs: {self.job_error}")

    def job_reads(self) -> dict[str, int]:
        out = {}
        for job in self.jobs:
            try:
                out[job.spec.name] = job.tally()[0].reads
            except (OSError, ValueError, KeyError):
                out[job.spec.name] = 0
        return out

    # -- the report ---------------------------------------------------------------------------

    def classify(self, job: Job, tally: Tally) -> tuple[int, int]:
        """(wrong bytes, reads of another version while it was served) among ``job``'s
        mismatching reads (B's files change; what a read returned must be some version's
        content, read while a mount of that version served)."""
        dataset = self.datasets[job.tag]
        wrong, other_version = 0, 0
        for t, rel, hexhash in tally.mismatches:
            ok = False
            for version in dataset.versions[1:]:
                row = version.table.rows.get(rel)
                end = version.end if version.end is not None else float("inf")
                if row is not None and row[0].hex() == hexhash and version.start - 1 <= t <= end + self.plan.grace:
                    ok = True
                    break
            if ok:
                other_version += 1
            else:
                wrong += dataset.file_size
        # A tally keeps at most Tally.KEEP mismatches: the rest count as wrong.
        wrong += max(0, tally.wrong_reads - len(tally.mismatches)) * dataset.file_size
        return wrong, other_version


def sweep(run: Path) -> None:
    """What a killed run left: mounts, a mountd on the cache, the tmpfs."""
    for name in ("mnt-A", "mnt-B"):
        force_unmount(run / name)
    stop_mountd_of(run / "cachefs" / "cache")
    if os.path.ismount(run / "cachefs"):
        subprocess.run(["umount", "-l", str(run / "cachefs")], check=False, capture_output=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=30.0, help="length of the run (default 30)")
    parser.add_argument("--fault-every", type=float, default=None,
                        help="seconds between faults (default 180; shorter runs: a sixth of the run, at least 20)")
    parser.add_argument("--sample-every", type=float, default=None,
                        help="seconds between samples (default 60; shorter runs: an eighteenth of the run)")
    parser.add_argument("--warmup", type=float, default=None,
                        help="seconds before the slopes are fitted (default 300; shorter runs: a third)")
    parser.add_argument("--files", type=int, default=1200, help="files per dataset")
    parser.add_argument("--file-size", type=int, default=32 * 1024, help="bytes per file")
    parser.add_argument("--cache-fraction", type=float, default=0.2, help="cache size / both datasets")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--compute", type=float, default=0.1, help="seconds of compute per mini-batch")
    parser.add_argument("--workers", type=int, default=2, help="DataLoader workers per job")
    parser.add_argument("--no-second-user", action="store_true",
                        help="mount B and run B-shuffle as root (no throwaway user, no fuse.conf change)")
    args = parser.parse_args()
    if args.minutes <= 0 or args.files < 100 or (args.fault_every is not None and args.fault_every < 5):
        parser.error("need --minutes > 0, --files >= 100 and --fault-every >= 5")
    if os.geteuid() != 0 or not os.path.exists("/dev/fuse"):
        raise SystemExit("needs root and /dev/fuse")
    if not args.no_second_user and (reason := unavailable_reason()) is not None:
        raise SystemExit(f"a second local user cannot be made ({reason}): use --no-second-user")

    sigterm_as_interrupt()
    plan = Plan.of(args)
    run = WORK / time.strftime("%Y%m%d-%H%M%S")
    sweep_all()
    run.mkdir(parents=True)
    run.chmod(0o755)
    (run / "pid").write_text(str(os.getpid()))
    soak = Soak(args, plan, run)
    ok = False
    try:
        with soak.stack:
            soak.setup()
            soak.run()
            ok = soak.report()
    except KeyboardInterrupt:
        sweep(run)
        raise SystemExit("interrupted: every process stopped") from None
    except RuntimeError as exc:
        sweep(run)
        raise SystemExit(f"failed: {exc}\n(logs: {run})") from None
    raise SystemExit(0 if ok else 1)


def sweep_all() -> None:
    """Clean up after every earlier run that was killed before its teardown (a run whose
    process still lives is left alone: its ``pid`` file names it)."""
    if not WORK.exists():
        return
    for old in WORK.iterdir():
        try:
            pid = int((old / "pid").read_text())
        except (OSError, ValueError):
            pid = 0
        if old.is_dir() and not (pid and alive(pid)):
            sweep(old)


if __name__ == "__main__":
    main()
