"""One training-like job of the side-by-side benchmark, in its own process.

``python job.py SPEC.json`` builds its contender's loader (:func:`peers.contenders.build_loader`:
dataset, sampler, ``workers`` DataLoader workers that decode and augment), prints ``ready``,
waits for a line on stdin (so that several jobs start together), then runs ``epochs``
epochs: every batch is taken from the loader and followed by ``compute_s`` seconds of sleep
(the GPU step; 0 by default). It prints one JSON line: for each epoch its wall-clock start
and end (``time.time()``, the clock of the bucket's access log) and the images it got.

:func:`run_jobs` (the benchmark's side) starts N of them, waits until each is ready, starts
them together, and kills them all on a failure, a timeout or Ctrl-C.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def run(spec: dict[str, Any], go: Callable[[], None]) -> dict[str, Any]:
    from peers.contenders import build_loader

    started = time.time()
    built = build_loader(spec)
    setup_s = time.time() - started
    go()
    epochs = []
    for epoch in range(spec["epochs"]):
        if built.set_epoch is not None:
            built.set_epoch(epoch)
        start = time.time()
        images = batches = 0
        first_batch = None
        for batch in built.loader:
            images += len(batch[1])
            batches += 1
            if first_batch is None:
                first_batch = time.time() - start
            if spec["compute_s"]:
                time.sleep(spec["compute_s"])
        epochs.append({"epoch": epoch, "start": start, "end": time.time(), "images": images,
                       "batches": batches, "first_batch_s": first_batch})
    if built.close is not None:
        built.close()
    return {"name": spec["name"], "contender": spec["contender"], "setup_s": setup_s,
            "setup_start": started, "epochs": epochs, "notes": built.notes, "pid": os.getpid()}


def _main(path: str) -> None:
    spec = json.loads(Path(path).read_text())

    def go() -> None:
        print("ready", flush=True)
        if not sys.stdin.readline():
            raise SystemExit(1)  # the benchmark went away

    result = run(spec, go)
    print(json.dumps(result), flush=True)
    sys.stdout.flush()
    # Some loaders leave non-daemon threads or worker pools behind at exit (and a stuck exit
    # would count against the next row): the result is out, leave now.
    os._exit(0)


class JobFailed(RuntimeError):
    pass


def run_jobs(specs: list[dict[str, Any]], workdir: Path, env: dict[str, str], timeout: float,
             on_start: Callable[[list[int]], None] | None = None) -> list[dict[str, Any]]:
    """Start one process per spec, wait until all are ready, start them together; their
    results in order. ``on_start`` gets the job pids once they run (for the monitor).
    Stderr of job NAME is in ``workdir/NAME.log``."""
    workdir.mkdir(parents=True, exist_ok=True)
    procs: list[tuple[dict[str, Any], subprocess.Popen, Path]] = []
    timer = None
    timed_out = threading.Event()

    def expire() -> None:
        timed_out.set()
        for _, proc, _ in procs:
            proc.kill()

    try:
        for spec in specs:
            spec_file = workdir / f"{spec['name']}.json"
            spec_file.write_text(json.dumps(spec))
            log = workdir / f"{spec['name']}.log"
            with open(log, "wb") as err:
                proc = subprocess.Popen([sys.executable, str(HERE / "job.py"), str(spec_file)],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                                        text=True, env=env, cwd=str(HERE.parents[2]))
            procs.append((spec, proc, log))
        timer = threading.Timer(timeout, expire)
        timer.daemon = True
        timer.start()
        for spec, proc, log in procs:
            line = proc.stdout.readline().strip()
            if line != "ready":
                raise JobFailed(f"job {spec['name']} did not start ({line!r}):\n{tail(log)}")
        for _, proc, _ in procs:
            proc.stdin.write("go\n")
            proc.stdin.flush()
        if on_start is not None:
            on_start([proc.pid for _, proc, _ in procs])
        results = []
        for spec, proc, log in procs:
            line = proc.stdout.readline()
            code = proc.wait()
            if timed_out.is_set():
                raise JobFailed(f"job {spec['name']} ran past {timeout:.0f} s:\n{tail(log)}")
            if code != 0 or not line:
                raise JobFailed(f"job {spec['name']} failed (exit {code}):\n{tail(log)}")
            results.append(json.loads(line))
        return results
    finally:
        if timer is not None:
            timer.cancel()
        for _, proc, _ in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


if __name__ == "__main__":
    sys.path.insert(0, str(HERE.parent))  # scripts/bench: the peers package
    sys.path.insert(0, str(HERE.parents[2]))  # the repository: quiverfs
    _main(sys.argv[1])
