"""One training job of the soak benchmark (scripts/bench/soak.py): reads and checks every byte.

A separate process (``python soak_job.py SPEC.json``, started with the others by
:func:`harness.launch.run_together`), possibly as another local user. A real
``torch.utils.data.DataLoader`` (``workers`` worker processes, persistent, fork) over the
dataset's files through a mount, with :class:`quiverfs.torch.QuiverBatchSampler` (``shim``)
or a shuffled sampler (``shuffle``), a sleep per mini-batch for compute, epoch after epoch
for the spec's ``seconds`` from the start signal, or until SIGTERM.

Each worker reads a file's raw bytes (``open`` + ``read``, its pages dropped after, so the
next read reaches quiverfs again rather than the kernel's page cache) and checks them against
the blake3 and size the digest names (:class:`quiverfs.testing.soak.DigestTable`); a failed
read is counted with its errno and second, never raised, so the loader goes on through
faults. The main process adds the workers' outcomes into a
:class:`~quiverfs.testing.soak.Tally`. When the sampler itself fails (a claim while mountd or
the mount is away), the failure is counted (``where="claim"``) and the epoch's iteration is
started again a second later.

Every ``status_every`` seconds, and when it ends, the job writes its tally as JSON to the
spec's ``status`` path (atomically), with ``pid``, ``epochs`` and ``done``; its result line
(stdout) is a summary: ``name``, ``reads``, ``errors``, ``wrong_bytes``, ``epochs``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[3]


@dataclass
class SoakJobSpec:
    """One soak job (see the module docstring)."""

    name: str
    #: ``shim`` (QuiverBatchSampler) or ``shuffle`` (a new random order each epoch).
    sampler: str
    #: The mount point the paths are under.
    root: str
    #: The digest whose hashes the bytes are checked against (the version mounted at start).
    digest: str
    #: Where the JSON status goes (a folder this job's user may write).
    status: str
    #: How long the job reads, from the start signal.
    seconds: float
    batch_size: int = 16
    compute_s: float = 0.1
    workers: int = 2
    prefetch_factor: int = 2
    seed: int = 0
    status_every: float = 5.0


def _dataset(spec: SoakJobSpec, rels: list[str]):  # -> a torch Dataset
    from torch.utils.data import Dataset

    from quiverfs.testing.soak import DigestTable

    table = DigestTable.load(spec.digest)

    class CheckedFiles(Dataset):
        """Item i: file i read and checked — ``(t, rel, nbytes, ok, hex of what was read when
        it differs, error name)``."""

        def __init__(self) -> None:
            self.paths = [os.path.join(spec.root, rel) for rel in rels]

        def __len__(self) -> int:
            return len(self.paths)

        def __getitem__(self, i: int) -> tuple:
            rel = rels[i]
            try:
                with open(self.paths[i], "rb") as f:
                    data = f.read()
                    with contextlib.suppress(OSError):  # only a hint
                        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
            except OSError as exc:
                return (time.time(), rel, 0, False, None, exc.errno)
            if table.matches(rel, data):
                return (time.time(), rel, len(data), True, None, None)
            return (time.time(), rel, len(data), False, data, None)

    return CheckedFiles()


def run(spec: SoakJobSpec, go: Any = None) -> dict[str, Any]:
    """Set up, wait for ``go()``, read for ``spec.seconds`` or until SIGTERM; a summary."""
    import torch  # before the loader forks its workers
    from torch.utils.data import BatchSampler, DataLoader, RandomSampler

    from quiverfs.testing.soak import DigestTable, Tally

    rels = DigestTable.load(spec.digest).paths()
    dataset = _dataset(spec, rels)
    stopping = False

    def stop(signum: int, frame: Any) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    sampler = None
    if spec.sampler == "shim":
        from quiverfs.torch import QuiverBatchSampler

        sampler = QuiverBatchSampler(dataset, spec.batch_size, paths=dataset.paths, job=spec.name,
                                     seed=spec.seed, report_lag=spec.workers * spec.prefetch_factor)
        if not sampler.on_quiver:
            raise RuntimeError(f"{spec.root} is not a quiverfs mount with a control channel")
        batches: Any = sampler
    else:
        generator = torch.Generator().manual_seed(spec.seed)
        batches = BatchSampler(RandomSampler(dataset, generator=generator), spec.batch_size,
                               drop_last=False)
    loader = DataLoader(dataset, batch_sampler=batches, num_workers=spec.workers,
                        persistent_workers=True, prefetch_factor=spec.prefetch_factor,
                        collate_fn=lambda items: items, multiprocessing_context="fork")
    tally = Tally()
    status = Path(spec.status)
    epochs = 0
    last_status = 0.0

    def publish(done: bool = False) -> None:
        tally.write(status, pid=os.getpid(), uid=os.getuid(), epochs=epochs, done=done,
                    name=spec.name)

    publish()
    if go is not None:
        go()
    stop_at = time.time() + spec.seconds
    epoch = 0
    while not stopping and time.time() < stop_at:
        if sampler is not None:
            sampler.set_epoch(epoch)
        try:
            for batch in loader:
                for t, rel, nbytes, ok, data, code in batch:
                    if ok:
                        tally.ok(nbytes, t)
                    elif code is not None:
                        tally.error(code, "read", t)
                    else:
                        tally.wrong(rel, data, t)
                time.sleep(spec.compute_s)
                if time.time() - last_status >= spec.status_every:
                    publish()
                    last_status = time.time()
                if stopping or time.time() >= stop_at:
                    break
            else:
                epochs += 1
                epoch += 1
        except OSError as exc:  # the sampler's claim failed (mountd or the mount away)
            tally.error(exc, "claim")
            time.sleep(1.0)
    if sampler is not None:
        sampler.close()
    publish(done=True)
    return {"name": spec.name, "reads": tally.reads, "errors": tally.error_count,
            "wrong_bytes": tally.wrong_bytes, "epochs": epochs}


def _main(spec_path: str) -> None:
    from harness.launch import wait_for_go

    spec = SoakJobSpec(**json.loads(Path(spec_path).read_text()))
    print(json.dumps(run(spec, wait_for_go)), flush=True)


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # harness.launch
    _main(sys.argv[1])
