"""``quiverfs mountd --user-quota`` against a real mountd: the option's parsing, the quota at
work on a client's fills, and what ``stats`` (JSON and the users table) says per uid."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from mountd.errors import QuotaExceeded
from mountd.rpc.client import SyncClient
from quiverfs.base.console import run_app
from quiverfs.cli.main import app
from quiverfs.testing.mountd import location, make_dataset, running_mountd

SIZE = 100_000
QUOTA = 262_144  # 25% of --cache-size 1M


def cli(capsys, *args: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as done:
        run_app(app, "quiverfs", list(args))
    out, err = capsys.readouterr()
    return done.value.code, out, err


@pytest.fixture(scope="module")
def filled(tmp_path_factory):
    """A mountd with a quota of 25% of its 1 MiB cache; this process (mountd's own uid, so
    mountd reads for it) fills 5 files of 100,000 bytes, then asks for one over the quota."""
    work = tmp_path_factory.mktemp("quota")
    url, files = make_dataset(work / "remote", 5, size=SIZE)
    _, [big] = make_dataset(work / "remote", 1, size=QUOTA + 1, prefix="big")
    with running_mountd(work / "cache", "--user-quota", "25%", cache_size="1M") as daemon:
        with SyncClient.connect(daemon.cache_dir) as client:
            paths = [client.ensure(f.hash, f.size, location(url, f), dataset="q")
                     for f in files]
            with pytest.raises(QuotaExceeded) as refused:
                client.ensure(big.hash, big.size, location(url, big), dataset="q")
        yield daemon, files, paths, refused.value


def test_a_client_past_the_quota_keeps_only_its_newest_files(filled):
    daemon, files, paths, _ = filled
    with SyncClient.connect(daemon.cache_dir) as client:
        assert client.usage()["entries"] == 2
    assert [os.path.exists(p) for p in paths] == [False, False, False, True, True]
    assert [Path(p).read_bytes() for p in paths[3:]] == [f.data for f in files[3:]]


def test_content_larger_than_the_quota_is_refused_in_one_line(filled):
    *_, refused = filled
    assert "larger than the per-user quota of the cache (262144 bytes" in str(refused)
    assert "\n" not in str(refused)


def test_stats_json_shows_each_uids_cached_bytes_and_the_quota(capsys, filled):
    daemon, *_ = filled
    code, out, err = cli(capsys, "stats", "--cache-dir", str(daemon.cache_dir), "--json")
    assert code == 0, err
    me = json.loads(out)["users"][str(os.getuid())]
    assert {k: me[k] for k in ("cached_files", "cached_bytes", "quota", "quota_evicted_files",
                               "quota_evicted_bytes")} == {
        "cached_files": 2, "cached_bytes": 2 * SIZE, "quota": QUOTA,
        "quota_evicted_files": 3, "quota_evicted_bytes": 3 * SIZE}
    assert me["ensures"] == 6


def test_stats_users_table_shows_them_too(capsys, monkeypatch, filled):
    daemon, *_ = filled
    monkeypatch.setenv("COLUMNS", "250")
    code, out, err = cli(capsys, "stats", "--cache-dir", str(daemon.cache_dir))
    assert code == 0, err
    header = next(line for line in out.splitlines() if "misses asked" in line)
    assert [c.strip() for c in header.split("┃")[-4:-1]] == ["cached", "quota", "quota evicted"]
    table = out[out.index("mountd: users"):]
    row = next(line for line in table.splitlines() if line.startswith("│"))
    assert [c.strip() for c in row.split("│")[-4:-1]] == ["2 (195.3 KiB)", "256.0 KiB",
                                                           "3 (293.0 KiB)"]


@pytest.mark.parametrize("value, message", [("10X", "bad size '10X'"),
                                            ("0", "size must be positive"),
                                            ("150%", "size percentage must be in (0, 100]")])
def test_bad_quotas_are_refused_before_starting(capsys, tmp_path, value, message):
    code, _, err = cli(capsys, "mountd", "--cache-dir", str(tmp_path / "c"), "--cache-size", "1M",
                       "--user-quota", value)
    assert code == 2 and err.startswith("quiverfs: error: ") and message in err
    assert err.count("\n") == 1
    assert not (tmp_path / "c").exists()
