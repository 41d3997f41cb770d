"""The PyTorch shim through a real mount: the control channel answers on the mount root, and
``QuiverBatchSampler`` gives every file exactly once per epoch to a DataLoader with 0 and 4
workers, across epochs and across two ranks of one job.

These tests need the control-channel hook in ``QuiverOperations.getxattr`` (docs/
control-protocol.md, "The mount side"); without it every control request is ENODATA and they
fail, by design.
"""

from __future__ import annotations

import errno
import json
import os
from collections import Counter
from pathlib import Path

import pytest

from quiverfs.client.control_client import ControlClient
from quiverfs.protocol.control import make_name
from quiverfs.testing.sample_data import generate_images, write_tree
from tests.mount.conftest import MountdProcess, MountProcess, build_digest, serving

pytestmark = pytest.mark.mount

torchvision = pytest.importorskip("torchvision", reason="torchvision is not installed (pip install -e '.[torch]')")
torch = pytest.importorskip("torch")

from quiverfs.torch import QuiverBatchSampler  # noqa: E402  (after the importorskip)
from tests.mount.raw_files import RawFiles  # noqa: E402

FILES = 4 * 30


@pytest.fixture(scope="module")
def mounted(fuse, module_tmp: Path):
    source = module_tmp / "images"
    count = write_tree(source, generate_images(n_classes=4, per_class=30, size=32))
    assert count == FILES
    digest = module_tmp / "images.qd"
    dataset_id = build_digest(source, digest)
    cache = module_tmp / "cache"
    mountd = MountdProcess(cache).start()
    try:
        with MountProcess(digest, module_tmp / "mnt", cache) as mount:
            yield mount.mountpoint, source, dataset_id
    finally:
        mountd.stop()


class Indexed(torch.utils.data.Dataset):
    """ImageFolder that returns (index, label) after really reading the file (in the worker)."""

    def __init__(self, root: Path) -> None:
        self.inner = torchvision.datasets.ImageFolder(str(root))
        self.samples = self.inner.samples

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, i: int):
        image, label = self.inner[i]
        assert image.size == (32, 32)
        return i, label


def test_info_over_the_control_channel(mounted) -> None:
    mnt, _, dataset_id = mounted
    info = json.loads(os.getxattr(mnt, make_name("info")))
    assert info["dataset"] == dataset_id and info["files"] == FILES
    paths = ControlClient(mnt).paths()
    assert len(paths) == FILES and paths == sorted(paths)
    assert all((mnt / p).is_file() for p in paths[:5])


def test_malformed_and_unknown_requests_get_errno(mounted) -> None:
    mnt, _, _ = mounted
    for name, code in [
        ("user.quiver.ctl.x.claim?job=j", errno.EINVAL),
        ("user.quiver.ctl.x.bogus", errno.EINVAL),
        (make_name("claim", job="nobody", rank=0, n=4), errno.ENOENT),
    ]:
        with pytest.raises(OSError) as info:
            os.getxattr(mnt, name)
        assert info.value.errno == code, name
    assert os.listdir(mnt)  # the mount keeps serving


@pytest.mark.parametrize("workers", [0, 4])
def test_every_file_once_per_epoch_through_a_dataloader(mounted, workers: int) -> None:
    mnt, _, _ = mounted
    dataset = Indexed(mnt / "train")
    sampler = QuiverBatchSampler(dataset, batch_size=8, job=f"dl-{workers}", seed=workers)
    assert sampler.on_quiver
    assert len(sampler) == FILES // 8
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler, num_workers=workers)
    orders = []
    for epoch in range(3):
        sampler.set_epoch(epoch)
        seen = [int(i) for indices, _ in loader for i in indices]
        assert Counter(seen) == Counter(range(FILES)), f"epoch {epoch}"
        orders.append(seen)
    assert orders[0] != orders[1]  # a new random order each epoch
    assert sampler.flush_reports()  # sent by a thread, off the training loop
    timings = ControlClient(mnt).request("timings", job=f"dl-{workers}")
    # Each epoch's steps but the loader's start-up (its first lag + 1 requests) are reported.
    assert timings["batches"] == 3 * (len(sampler) - (sampler.lag + 1))
    assert [e[0] for e in timings["epochs"]] == [0, 1, 2]
    sampler.close()


def test_two_ranks_split_an_epoch_with_equal_steps(mounted) -> None:
    mnt, _, _ = mounted
    dataset = Indexed(mnt / "train")
    samplers = [
        QuiverBatchSampler(dataset, batch_size=7, job="ddp", rank=r, world_size=2, report=False)
        for r in range(2)
    ]
    for epoch in range(2):
        for s in samplers:
            s.set_epoch(epoch)
        iterators = [iter(s) for s in samplers]
        batches: list[list[list[int]]] = [[], []]
        live = [True, True]
        while any(live):  # interleave the ranks, as DDP does
            for r, it in enumerate(iterators):
                if live[r]:
                    try:
                        batches[r].append(next(it))
                    except StopIteration:
                        live[r] = False
        assert len(batches[0]) == len(batches[1]) == len(samplers[0])
        per_rank = [{i for b in bs for i in b} for bs in batches]
        assert per_rank[0] | per_rank[1] == set(range(FILES))
        assert not per_rank[0] & per_rank[1]
    for s in samplers:
        s.close()


def test_a_rank_left_more_than_an_epoch_behind_is_told(mounted) -> None:
    # mountd keeps two epochs of a job; ranks that are not kept in step (no DDP) can leave
    # one so far behind that its epoch is gone: it then reads nothing that epoch, and says so.
    mnt, _, _ = mounted
    dataset = Indexed(mnt / "train")
    ahead, behind = (QuiverBatchSampler(dataset, batch_size=7, job="apart", rank=r, world_size=2,
                                        report=False) for r in range(2))
    for epoch in range(3):  # rank 0 takes its share of epochs 0, 1 and 2
        ahead.set_epoch(epoch)
        assert len({i for b in ahead for i in b}) == FILES // 2
    behind.set_epoch(0)
    with pytest.warns(RuntimeWarning, match="epoch 0 of job apart was over before rank 1"):
        assert list(behind) == []
    ahead.close()
    behind.close()


def test_a_second_job_reads_hits_after_the_first_epoch(mounted) -> None:
    mnt, _, _ = mounted
    # The tests above read everything through the mount: the whole dataset is cached now.
    control = ControlClient(mnt)
    control.request("open", job="late", rank=0, world=1, epoch=0, seed=9)
    claim = control.request("claim", job="late", rank=0, n=40)
    assert len(claim["hits"]) == 40 and claim["fetch"] == []
    control.request("close", job="late", rank=0)


def test_off_the_mount_it_is_a_shuffled_sampler(mounted, monkeypatch) -> None:
    import quiverfs.client.torch

    monkeypatch.setattr(quiverfs.client.torch, "_warned_off_mount", False)
    _, source, _ = mounted
    dataset = Indexed(source / "train")
    with pytest.warns(RuntimeWarning, match="not on a quiverfs mount"):
        sampler = QuiverBatchSampler(dataset, batch_size=16, job="off")
    assert not sampler.on_quiver
    seen = [i for batch in sampler for i in batch]
    assert sorted(seen) == list(range(FILES)) and seen != list(range(FILES))


@pytest.fixture(scope="module")
def split_mount(fuse, module_tmp: Path):
    """A cold mount holding train/ (3 x 10 images) and val/ (3 x 5)."""
    source = module_tmp / "split"
    assert write_tree(source, generate_images(n_classes=3, per_class=10, size=32)) == 30
    assert write_tree(source, generate_images(n_classes=3, per_class=5, size=32, split="val")) == 15
    with serving(source, module_tmp, "split") as mountpoint:
        yield mountpoint


def test_an_imagefolder_over_a_subdirectory_claims_only_its_files(split_mount) -> None:
    """The sampler sends its files' id ranges as the job's scope: the epoch is exactly the
    sub-directory's files, and no claim names the rest of the mount."""
    dataset = Indexed(split_mount / "train")
    sampler = QuiverBatchSampler(dataset, batch_size=4, job="train-only", report=False)
    assert sampler.on_quiver and sampler.mapped == 30
    assert sampler.scope is not None and sampler.session["quota"] == 30
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler, num_workers=2)
    for epoch in range(2):
        sampler.set_epoch(epoch)
        seen = [int(i) for indices, _ in loader for i in indices]
        assert Counter(seen) == Counter(range(30)), f"epoch {epoch}"
    # What mountd gives this job: exactly the train/ ids, none of val/ (without the scope it
    # would hand out all 45 and the sampler would skip 15).
    train_ids = {cid for cid, index in enumerate(sampler._cid_to_index) if index >= 0}
    assert len(train_ids) == 30
    control = ControlClient(split_mount)
    control.request("next", job="train-only", rank=0, epoch=5)
    claimed: list[int] = []
    while True:
        claim = control.request("claim", job="train-only", rank=0, n=8)
        if not claim["hits"] and not claim["fetch"]:
            break
        claimed += claim["hits"] + claim["fetch"]
    assert sorted(claimed) == sorted(train_ids)
    sampler.close()


def test_batch_reports_say_what_the_batch_read(mounted) -> None:
    # The sampler's reports carry each batch's files and misses through the control channel
    # (op `batch`, args files/misses) to mountd, which sorts them exactly: the dataset is all
    # cached by now, so every full report is a hit sample and the job gets a t_hit.
    import subprocess

    from tests.mount.conftest import quiverfs_cmd

    mnt, _, dataset_id = mounted
    control = ControlClient(mnt)
    control.request("open", job="bad-report", rank=0, world=1)
    with pytest.raises(OSError) as info:  # more misses than files: refused, nothing recorded
        control.request("batch", job="bad-report", rank=0, s="0.1", files=8, misses=9)
    assert info.value.errno == errno.EINVAL
    control.request("close", job="bad-report", rank=0)
    dataset = Indexed(mnt / "train")
    sampler = QuiverBatchSampler(dataset, batch_size=8, job="exact", seed=4)
    sent = []
    queue = sampler._reports.put
    sampler._reports.put = lambda op, **kw: (sent.append((op, kw)), queue(op, **kw))  # type: ignore[method-assign]
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler, num_workers=0)
    seen = [int(i) for indices, _ in loader for i in indices]
    assert Counter(seen) == Counter(range(FILES))
    batches = [kw for op, kw in sent if op == "batch"]
    assert len(batches) == FILES // 8 - 1
    assert all((kw["files"], kw["misses"]) == (8, 0) for kw in batches)
    assert sampler.flush_reports()
    out = subprocess.run(quiverfs_cmd("stats", "--cache-dir", str(mounted_cache(mnt)), "--json"),
                         capture_output=True, text=True, check=True)
    allocation = json.loads(out.stdout)["allocation"]
    assert allocation["policy"] == "benefit-aware"
    (job,) = [j for j in allocation["datasets"][dataset_id]["jobs"] if j["job"] == "exact"]
    assert job["t_hit"] is not None and job["t_miss"] is None
    sampler.close()


def mounted_cache(mnt: Path) -> Path:
    """The cache directory of the module's mount (beside the mount point)."""
    return mnt.parent / "cache"


@pytest.fixture(scope="module")
def small_cache_mount(fuse, module_tmp: Path):
    """A cold mount of 4 x 30 images whose mountd cache holds about a tenth of them, so that
    claims soon find no room to protect more misses."""
    source = module_tmp / "small"
    files = list(generate_images(n_classes=4, per_class=30, size=32))
    assert write_tree(source, iter(files)) == FILES
    cache_size = str(sum(len(data) for _, data in files) // 10)
    with serving(source, module_tmp, "small", cache_size, "--dataset-mode", "lru") as mountpoint:
        yield mountpoint, dict(files)


def test_claims_wait_for_room_and_every_file_still_comes_once(small_cache_mount) -> None:
    """With no room to protect more misses, mountd answers a claim that has no hits with
    ``wait`` once the job's claimed and unread misses make a batch per rank; the sampler then
    yields what it holds or waits, and the DataLoader still reads every file exactly once per
    epoch, with the right bytes. Before, each such claim got one more miss, and the sampler
    claimed miss after miss into a cache that had no room for them."""
    mnt, files = small_cache_mount
    dataset = RawFiles(mnt, files)
    sampler = QuiverBatchSampler(dataset, batch_size=8, job="small", seed=3, report=False)
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler, num_workers=2,
                                         collate_fn=lambda items: items)
    for epoch in range(2):
        sampler.set_epoch(epoch)
        read = [item for batch in loader for item in batch]
        assert Counter(i for i, _ in read) == Counter(range(FILES)), f"epoch {epoch}"
        assert all(same for _, same in read), f"epoch {epoch}: wrong bytes"
    assert sampler.claim_waits > 0
    sampler.close()
