"""Job processes started together, for benchmarks that compare jobs side by side.

A job process sets itself up (imports torch, builds its dataset and loader), prints ``ready``,
waits for a line on stdin, runs, and prints its result as one JSON line. :func:`run_together`
starts every job, waits until all are ready, starts them at once, and returns their results:
jobs that set up at different speeds still start together. Used by the emulated training jobs
(harness/jobs.py) and by the loaders of the peers benchmark (peers/job.py).
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any


class JobFailed(RuntimeError):
    """A job did not start, failed, or ran past its time (its log's tail in the message)."""


def run_together(jobs: Sequence[tuple[str, Path]], script: Path, workdir: Path, *, timeout: float,
                 cwd: Path, env: Mapping[str, str] | None = None,
                 on_start: Callable[[list[int]], None] | None = None,
                 options: Mapping[str, Mapping[str, Any]] | None = None,
                 one_by_one: bool = False) -> list[dict[str, Any]]:
    """Run ``python SCRIPT SPEC_FILE`` for each ``(name, spec_file)``, started together; their
    JSON results, in order. ``on_start`` gets the job pids once they run (for a monitor).
    ``options``: more ``subprocess.Popen`` arguments for job NAME (``user=``, ``group=``,
    ``extra_groups=`` and its own ``env=`` to run it as another local user;
    ``start_new_session=``), over the ones above. ``one_by_one``: each job's set-up runs
    only once the one before it is ready (for a library whose set-up races with itself in
    other processes); the timed part still starts together.

    Stderr of job NAME is in ``workdir/NAME.log``, its result in ``workdir/NAME.result.json``.
    Every job process is killed if anything fails, on Ctrl-C, and at ``timeout`` seconds."""
    workdir.mkdir(parents=True, exist_ok=True)
    procs: list[tuple[str, subprocess.Popen, Path]] = []
    timed_out = threading.Event()

    def expire() -> None:
        timed_out.set()
        for _, proc, _ in procs:
            proc.kill()

    timer = threading.Timer(timeout, expire)
    timer.daemon = True
    try:
        timer.start()  # before the first job: a set-up that hangs is killed too
        for name, spec_file in jobs:
            log = workdir / f"{name}.log"
            popen: dict[str, Any] = {"cwd": cwd, "env": None if env is None else dict(env)}
            popen.update((options or {}).get(name, {}))
            with open(log, "wb") as err:
                proc = subprocess.Popen([sys.executable, str(script), str(spec_file)],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                                        text=True, **popen)
            procs.append((name, proc, log))
            if one_by_one:
                _wait_ready(name, proc, log)
        if not one_by_one:
            for name, proc, log in procs:
                _wait_ready(name, proc, log)
        for _, proc, _ in procs:  # start them together
            proc.stdin.write("go\n")
            proc.stdin.flush()
        if on_start is not None:
            on_start([proc.pid for _, proc, _ in procs])
        results = []
        for name, proc, log in procs:
            line = proc.stdout.readline()
            code = proc.wait()
            if timed_out.is_set():
                raise JobFailed(f"job {name} ran past {timeout:.0f} s:\n{tail(log)}")
            if code != 0 or not line:
                raise JobFailed(f"job {name} failed (exit {code}):\n{tail(log)}")
            results.append(json.loads(line))
            (workdir / f"{name}.result.json").write_text(line)  # for later diagnosis
        return results
    finally:
        timer.cancel()
        for _, proc, _ in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def _wait_ready(name: str, proc: subprocess.Popen, log: Path) -> None:
    """Wait for job ``name`` to say it has set up."""
    line = proc.stdout.readline().strip()
    if line != "ready":
        raise JobFailed(f"job {name} did not start ({line!r}):\n{tail(log)}")


def wait_for_go() -> None:
    """The job's side: say it is ready, and wait for the start (exit if the benchmark went
    away before it)."""
    print("ready", flush=True)
    if not sys.stdin.readline():
        raise SystemExit(1)


def tail(path: Path, lines: int = 25) -> str:
    """The last ``lines`` lines of a job's log ("" when unreadable)."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""
