"""QuiverBatchSampler off a quiverfs mount: a seeded shuffled sampler, split across ranks."""

from __future__ import annotations

import errno
import socket
import time
import warnings
from array import array
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install -e '.[torch]')")

import quiverfs.client.torch as shim  # noqa: E402  (after the importorskip)
from quiverfs.client.timing_reports import TimingReports  # noqa: E402
from quiverfs.torch import QuiverBatchSampler  # noqa: E402


@pytest.fixture
def paths(tmp_path: Path) -> list[str]:
    out = []
    for i in range(23):
        p = tmp_path / f"c{i % 3}" / f"{i:03d}.bin"
        p.parent.mkdir(exist_ok=True)
        p.write_bytes(b"x")
        out.append(str(p))
    return out


def test_warns_once_and_shuffles(paths, monkeypatch) -> None:
    monkeypatch.setattr(shim, "_warned_off_mount", False)
    with pytest.warns(RuntimeWarning, match="not on a quiverfs mount"):
        sampler = QuiverBatchSampler(paths=paths, batch_size=5, job="j")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        QuiverBatchSampler(paths=paths, batch_size=5, job="j")  # no second warning
    assert not sampler.on_quiver and len(sampler) == 5
    first = [i for b in sampler for i in b]
    second = [i for b in sampler for i in b]  # next epoch: another order
    assert sorted(first) == sorted(second) == list(range(23)) and first != second
    sampler.set_epoch(0)
    assert [i for b in sampler for i in b] == first  # seeded by (seed, epoch)


def test_ranks_split_evenly(paths, monkeypatch) -> None:
    monkeypatch.setattr(shim, "_warned_off_mount", True)
    samplers = [QuiverBatchSampler(paths=paths, batch_size=4, job="j", rank=r, world_size=3,
                                   drop_last=False) for r in range(3)]
    per_rank = [[i for b in s for i in b] for s in samplers]
    assert all(len(ids) == 8 for ids in per_rank)  # ceil(23 / 3), padded with repeats
    assert set().union(*per_rank) == set(range(23))
    assert all(len(s) == 2 for s in samplers)


def test_drop_last_and_validation(paths, monkeypatch) -> None:
    monkeypatch.setattr(shim, "_warned_off_mount", True)
    sampler = QuiverBatchSampler(paths=paths, batch_size=5, job="j", drop_last=True)
    batches = list(sampler)
    assert len(batches) == len(sampler) == 4 and all(len(b) == 5 for b in batches)
    with pytest.raises(ValueError):
        QuiverBatchSampler(paths=paths, job="j", rank=2, world_size=2)
    with pytest.raises(TypeError):
        QuiverBatchSampler(object(), job="j")


def test_rank_and_job_come_from_torch_distributed(paths, monkeypatch) -> None:
    monkeypatch.setattr(shim, "_warned_off_mount", True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                                         rank=0, world_size=1)
    try:
        sampler = QuiverBatchSampler(paths=paths, batch_size=4)
        assert (sampler.rank, sampler.world_size) == (0, 1)
        assert sampler.job.startswith("job-")
    finally:
        torch.distributed.destroy_process_group()


class _OldMount:
    """A control channel from before batch reports carried files/misses: it refuses them with
    EINVAL (unknown argument), as quiverfs.protocol.control.parse_name did then."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, dict]] = []

    def request(self, op: str, **args):
        self.requests.append((op, args))
        if op == "batch" and "files" in args:
            raise OSError(errno.EINVAL, "unknown argument 'files' of batch")
        return {"recorded": 1}


def test_a_mount_that_refuses_files_and_misses_gets_the_time_alone() -> None:
    old = _OldMount()
    reports = TimingReports(old, "j", 0)  # type: ignore[arg-type]
    reports.send("batch", s="0.250000", files=5, misses=1)
    reports.put("batch", s="0.500000", files=5, misses=0)
    reports.put("epoch", epoch=0, s="0.750000")
    assert reports.flush(5.0)
    assert old.requests == [
        ("batch", {"job": "j", "rank": 0, "s": "0.250000", "files": 5, "misses": 1}),
        ("batch", {"job": "j", "rank": 0, "s": "0.250000"}),  # the same report, time alone
        ("batch", {"job": "j", "rank": 0, "s": "0.500000"}),  # and from then on, in order
        ("epoch", {"job": "j", "rank": 0, "epoch": 0, "s": "0.750000"}),
    ]


class _SlowMount:
    """A control channel whose every request takes ``delay`` seconds (a busy mount)."""

    def __init__(self, delay: float) -> None:
        self.delay = delay
        self.requests: list[str] = []

    def request(self, op: str, **args):
        time.sleep(self.delay)
        self.requests.append(args["s"])
        return {"recorded": 1}


def test_queued_reports_do_not_wait_for_the_mount_and_go_in_order() -> None:
    """The training loop's reports go through a thread: queuing twenty 20 ms reports takes
    far less than their 0.4 s, they arrive in order, and flush waits for the last one."""
    slow = _SlowMount(0.02)
    reports = TimingReports(slow, "j", 0)  # type: ignore[arg-type]
    started = time.monotonic()
    for k in range(20):
        reports.put("batch", s=str(k))
    queued = time.monotonic() - started
    assert queued < 0.1, queued
    assert not reports.flush(0.05)  # not all sent yet
    assert reports.flush(5.0)
    assert slow.requests == [str(k) for k in range(20)]


class _Indices(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 23

    def __getitem__(self, i: int) -> int:
        return i


@pytest.mark.parametrize(("workers", "prefetch", "depth"), [(0, None, 0), (2, 3, 6), (3, 2, 6)])
def test_the_report_lag_is_read_from_the_dataloader(paths, workers, prefetch, depth) -> None:
    """Unset, the lag is the DataLoader's depth (``num_workers × prefetch_factor``), so that a
    batch report names the batch its interval trained on; it is read at each epoch's start."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        sampler = QuiverBatchSampler(paths=paths, batch_size=5, job="j")
    loader = torch.utils.data.DataLoader(_Indices(), batch_sampler=sampler, num_workers=workers,
                                         prefetch_factor=prefetch)
    seen = sorted(int(i) for batch in loader for i in batch)
    assert seen == list(range(23)) and sampler.lag == depth
    list(sampler)  # iterated by hand: nothing in flight
    assert sampler.lag == 0
    sampler.report_lag = 1  # given: used as it is, whatever iterates
    list(loader)
    assert sampler.lag == 1


class _Reports:
    """Collects the reports a sampler queues (TimingReports.put)."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, dict]] = []

    def put(self, op: str, **args) -> None:
        self.sent.append((op, args))


def _slow_start(_worker: int) -> None:
    time.sleep(0.6)


def test_the_loaders_start_up_is_not_a_batch_time(paths) -> None:
    """A DataLoader's first ``workers × prefetch_factor`` requests fill its queue (no step
    ended) and the next one waits for its workers to start: none of them is reported. Before,
    they went to mountd as samples (the queue's without the files they read, classified by the
    job's claims), and the start-up's one moved a CPU-bound job's b by a quarter. (Off a
    mount the reports carry no files and misses: the claims that know them are mountd's.)"""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        sampler = QuiverBatchSampler(paths=paths, batch_size=1, job="j")
    sampler._reports = reports = _Reports()  # type: ignore[assignment]
    loader = torch.utils.data.DataLoader(_Indices(), batch_sampler=sampler, num_workers=2,
                                         prefetch_factor=2, worker_init_fn=_slow_start)
    assert sorted(int(i) for batch in loader for i in batch) == list(range(23))
    batches = [args for op, args in reports.sent if op == "batch"]
    assert len(batches) == 23 - (sampler.lag + 1) == 18
    assert max(float(args["s"]) for args in batches) < 0.5
    assert [op for op, _ in reports.sent].count("epoch") == 1


class _SlowClaims:
    """A control channel that gives ``files`` ids as hits, ``n`` per claim, each claim taking
    ``delay`` seconds."""

    def __init__(self, files: int, delay: float) -> None:
        self.left = list(range(files))
        self.delay = delay
        self.claims = 0

    def request(self, op: str, **args):
        assert op == "claim"
        time.sleep(self.delay)
        self.claims += 1
        hits, self.left = self.left[: args["n"]], self.left[args["n"] :]
        return {"hits": hits, "fetch": [], "wait": False}


def test_the_next_claim_is_not_waited_for_while_a_batch_is_left(paths, monkeypatch) -> None:
    """The claim made when the sampler's claimed files fall below the threshold runs in a
    thread: the batch still buffered is yielded at once, not after the claim's round trip."""
    monkeypatch.setattr(shim, "_warned_off_mount", True)
    sampler = QuiverBatchSampler(paths=paths, batch_size=4, fetch_size=8, threshold=1.0,
                                 report=False)
    slow = _SlowClaims(len(paths), 0.2)
    sampler.control = slow  # type: ignore[assignment]
    sampler._cid_to_index = array("q", range(len(paths)))
    waits = []
    seen: list[int] = []
    last = time.monotonic()
    for batch in sampler:
        now = time.monotonic()
        waits.append(now - last)
        seen += batch
        last = now
    sampler.control = None
    sampler.close()
    assert sorted(seen) == list(range(len(paths)))  # every file once
    assert slow.claims == 4  # 8 + 8 + 7, then the claim that finds the epoch over
    # Batches 1 and 3 (from 0) are yielded while the claim made below the threshold is in
    # flight; 0, 2 and 4 wait for a claim, and so does the last (3 files left: no batch).
    assert len(waits) == 6
    assert max(waits[1], waits[3]) < 0.1, waits
    assert min(waits[0], waits[2], waits[4], waits[5]) >= 0.1, waits
