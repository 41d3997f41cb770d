"""One training-like job of the side-by-side benchmark, in its own process.

``python job.py SPEC.json`` builds its contender's loader (:func:`peers.contenders.build_loader`:
dataset, sampler, ``workers`` DataLoader workers that decode and augment), prints ``ready``,
waits for a line on stdin (so that several jobs start together), then runs ``epochs``
epochs: every batch is taken from the loader and followed by ``compute_s`` seconds of sleep
(the GPU step; 0 by default). It prints one JSON line: for each epoch its wall-clock start
and end (``time.time()``, the clock of the bucket's access log) and the images it got.

:func:`run_jobs` (the benchmark's side) starts N of them together
(:func:`harness.launch.run_together`), and kills them all on a failure, a timeout or Ctrl-C.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if __name__ == "__main__":  # a job process: scripts/bench (peers, harness) on the path
    sys.path.insert(0, str(HERE.parent))

from harness.launch import JobFailed, run_together, wait_for_go  # noqa: E402

__all__ = ["JobFailed", "run", "run_jobs"]


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
    result = run(json.loads(Path(path).read_text()), wait_for_go)
    print(json.dumps(result), flush=True)
    sys.stdout.flush()
    # Some loaders leave non-daemon threads or worker pools behind at exit (and a stuck exit
    # would count against the next row): the result is out, leave now.
    os._exit(0)


def run_jobs(specs: list[dict[str, Any]], workdir: Path, env: dict[str, str], timeout: float,
             on_start: Callable[[list[int]], None] | None = None,
             one_by_one: bool = False) -> list[dict[str, Any]]:
    """Start one process per spec, together; their results in order. ``on_start`` gets the
    job pids once they run (for the monitor). ``one_by_one``: set up one job after another
    (harness/launch.py). Stderr of job NAME is in ``workdir/NAME.log``."""
    workdir.mkdir(parents=True, exist_ok=True)
    jobs = []
    for spec in specs:
        spec_file = workdir / f"{spec['name']}.json"
        spec_file.write_text(json.dumps(spec))
        jobs.append((spec["name"], spec_file))
    return run_together(jobs, HERE / "job.py", workdir, timeout=timeout, cwd=HERE.parents[2],
                        env=env, on_start=on_start, one_by_one=one_by_one)


if __name__ == "__main__":
    sys.path.insert(0, str(HERE.parents[2]))  # the repository: quiverfs
    _main(sys.argv[1])
