"""The admin commands against a real mountd: stats (JSON and tables), ls, evict, scrub, and
their one-line errors and exit codes."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from mountd.rpc.client import SyncClient
from quiverfs.base.console import run_app
from quiverfs.cli.main import app
from quiverfs.testing.mountd import location, make_dataset, running_mountd, wait_until

SIZE = 10_000


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    with running_mountd(tmp_path_factory.mktemp("cli") / "cache") as d:
        yield d


@pytest.fixture(scope="module")
def activity(daemon, tmp_path_factory):
    """3 misses and 5 hits (1 by ensure, 4 reported by a client) on dataset ``cli-ds``."""
    url, files = make_dataset(tmp_path_factory.mktemp("remote"), 3, size=SIZE)
    with SyncClient.connect(daemon.cache_dir) as c:
        for f in files:
            c.ensure(f.hash, f.size, location(url, f), dataset="cli-ds")
        c.ensure(files[0].hash, SIZE, location(url, files[0]), dataset="cli-ds")
        c.notify("hits", {"dataset": "cli-ds", "hashes": [f.hash.hex() for f in files] + [files[0].hash.hex()],
                          "bytes": 4 * SIZE})
        wait_until(lambda: c.stats()["counters"]["datasets"]["cli-ds"]["hits"] == 5, 10, "hits counted")
    return url, files


def cli(capsys, *args: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as done:
        run_app(app, "quiverfs", list(args))
    out, err = capsys.readouterr()
    return done.value.code, out, err


def test_stats_json_has_the_counts_ratio_and_savings(capsys, daemon, activity):
    code, out, err = cli(capsys, "stats", "--cache-dir", str(daemon.cache_dir), "--json")
    assert code == 0, err
    report = json.loads(out)
    row = report["datasets"]["cli-ds"]
    assert (row["hits"], row["misses"]) == (5, 3)
    assert row["hit_ratio"] == pytest.approx(5 / 8)
    assert row["bytes_from_cache"] == 5 * SIZE and row["bytes_from_remote"] == 3 * SIZE
    assert row["remote_requests"] == {"GET": 3, "HEAD": 0, "LIST": 0}
    assert (row["requests_saved"], row["bytes_saved"]) == (5, 5 * SIZE)
    assert row["schemes"] == ["file"] and row["cost_saved"] == 0.0 and row["remote_cost"] == 0.0
    assert row["fill_latency"]["count"] == 3 and row["fill_latency"]["mean_s"] > 0
    assert report["total"]["hits"] == 5 and report["prices_as_of"]
    # Files fetched ahead (the cache's protection): none here, every file was read on demand.
    assert (report["protection"]["started"], report["protection"]["started_bytes"]) == (0, 0)
    assert report["protection"]["ended_bytes"]["read"] == 0


def test_stats_tables_show_the_same_numbers(capsys, monkeypatch, daemon, activity):
    monkeypatch.setenv("COLUMNS", "250")
    code, out, err = cli(capsys, "stats", "--cache-dir", str(daemon.cache_dir))
    assert code == 0, err
    rows = [[cell.strip() for cell in line.split("│")[1:-1]]
            for line in out.splitlines() if "cli-ds" in line]
    assert len(rows) == 3  # one row in each table: reads, fills, saved
    assert rows[0] == ["cli-ds", "5", "3", "62.5%", "48.8 KiB", "29.3 KiB", "GET 3"]
    assert rows[1][:6] == ["cli-ds", "0", "-", "0", "0", "0 (0 B)"]  # "-": no chunk fills
    # fill p50 and mean in ms, then the p95 bucket's bound
    assert rows[1][6].endswith(" ms") and rows[1][7].endswith(" ms") and rows[1][8].startswith("≤ ")
    assert rows[2] == ["cli-ds", "file", "5", "48.8 KiB", "$0.0000", "$0.0000"]
    assert "internet egress priced" in out
    assert ("fetched ahead 0 files (0 B): read 0 files (0 B), unread now 0 files (0 B), "
            "dropped unread 0 files (0 B)") in out


def test_ls_lists_usage_and_datasets(capsys, monkeypatch, daemon, activity):
    code, out, _ = cli(capsys, "ls", "--cache-dir", str(daemon.cache_dir), "--json")
    assert code == 0
    listing = json.loads(out)
    assert listing["usage"]["datasets"]["cli-ds"]["entries"] == 3
    assert listing["usage"]["entries"] >= 3 and listing["mounts"] == []
    monkeypatch.setenv("COLUMNS", "200")
    code, out, _ = cli(capsys, "ls", "--cache-dir", str(daemon.cache_dir))
    assert code == 0 and "cli-ds" in out and "29.3 KiB" in out


def test_scrub_reports_counts(capsys, daemon, activity):
    code, out, err = cli(capsys, "scrub", "--cache-dir", str(daemon.cache_dir), "--json")
    assert code == 0, err
    report = json.loads(out)
    assert report["checked"] == report["ok"] >= 3 and report["bad"] == 0
    code, out, _ = cli(capsys, "scrub", "--cache-dir", str(daemon.cache_dir))
    assert code == 0 and "0 bad, 0 missing" in out


def test_scrub_exits_1_when_it_removed_a_damaged_file(capsys, daemon, tmp_path):
    url, [f] = make_dataset(tmp_path / "remote", 1, size=SIZE, seed=3)
    with SyncClient.connect(daemon.cache_dir) as c:
        path = c.ensure(f.hash, f.size, location(url, f), dataset="damaged")
    os.chmod(path, 0o644)
    with open(path, "r+b") as damaged:
        damaged.write(b"\0" * 16)
    code, out, _ = cli(capsys, "scrub", "--cache-dir", str(daemon.cache_dir))
    assert code == 1 and ", 1 bad, 0 missing" in out
    assert not os.path.exists(path)


def test_evict_needs_exactly_one_target(capsys, daemon):
    code, _, err = cli(capsys, "evict", "--cache-dir", str(daemon.cache_dir))
    assert code == 2 and err.strip() == "quiverfs: error: give a DATASET or --all (not both)"
    code, _, err = cli(capsys, "evict", "x", "--all", "--cache-dir", str(daemon.cache_dir))
    assert code == 2


def test_evict_a_dataset(capsys, daemon, activity):
    # Runs after the read-only tests above (file order): it empties cli-ds.
    code, out, err = cli(capsys, "evict", "cli-ds", "--cache-dir", str(daemon.cache_dir))
    assert code == 0, err
    assert out.strip() == "evicted 3 files (29.3 KiB)"
    with SyncClient.connect(daemon.cache_dir) as c:
        assert c.usage()["datasets"].get("cli-ds", {}).get("entries", 0) == 0


def test_commands_without_a_mountd_fail_in_one_line(capsys, tmp_path):
    for command in ("stats", "ls", "scrub"):
        code, out, err = cli(capsys, command, "--cache-dir", str(tmp_path / "none"))
        assert code == 1 and out == ""
        assert err.count("\n") == 1
        assert err.startswith("quiverfs: error: no mountd is running for ")
        assert f"quiverfs mountd --cache-dir {tmp_path / 'none'}" in err


def test_mountd_rejects_bad_sizes_before_starting(capsys, tmp_path):
    code, _, err = cli(capsys, "mountd", "--cache-dir", str(tmp_path), "--cache-size", "10X")
    assert code == 2 and err.startswith("quiverfs: error: bad size '10X'")
    code, _, err = cli(capsys, "mountd", "--cache-dir", str(tmp_path), "--remote-bandwidth", "5%")
    assert code == 2 and "cannot be a percentage" in err
    too_long = tmp_path / ("d" * 120)
    code, _, err = cli(capsys, "mountd", "--cache-dir", str(too_long), "--cache-size", "1M")
    assert code == 2 and "too long for a unix socket" in err and err.count("\n") == 1
    assert not too_long.exists()


@pytest.mark.parametrize("command", ["mountd", "stats", "ls", "evict", "scrub"])
def test_every_command_has_help_with_an_example(capsys, command):
    code, out, _ = cli(capsys, command, "--help")
    assert code == 0 and "Example: quiverfs " in out


def test_mountd_chunk_slots_are_2_or_3(capsys, tmp_path):
    code, _, err = cli(capsys, "mountd", "--cache-dir", str(tmp_path), "--chunk-slots", "4")
    assert code == 2 and "--chunk-slots" in err and "internal error" not in err


def test_chunk_slots_reach_the_session_registry(tmp_path):
    import trio

    from mountd.daemon import DaemonConfig, make_server
    from mountd.store.cache import Cache, CacheConfig

    async def check() -> None:
        config = CacheConfig(cache_dir=tmp_path / "cache", cache_size=1 << 20)
        cache = Cache(config)
        await cache.open()
        try:
            three = make_server(cache, DaemonConfig(config, chunk_slots=3, chunk_grace=2.5))
            assert three.coop.registry.chunk_slots == 3 and three.coop.registry.chunk_grace == 2.5
            assert make_server(cache, DaemonConfig(config)).coop.registry.chunk_slots == 2
        finally:
            await cache.aclose()

    trio.run(check)


def _config(tmp_path, text: str):
    path = tmp_path / "mountd.toml"
    path.write_text(text)
    return path


def test_mountd_config_file_sets_options_and_the_command_line_wins(tmp_path):
    config = _config(tmp_path, 'cache-size = "3M"\nprotect_share = 0.25\nshared = true\n')
    with running_mountd(tmp_path / "a", "--config", str(config), cache_size=None) as a, \
            SyncClient.connect(a.cache_dir) as client:
        assert client.usage()["cap_bytes"] == 3 << 20
        assert os.stat(a.cache_dir / "mountd.sock").st_mode & 0o777 == 0o666  # shared = true
    with running_mountd(tmp_path / "b", "--config", str(config), cache_size="5M") as b, \
            SyncClient.connect(b.cache_dir) as client:
        assert client.usage()["cap_bytes"] == 5 << 20


@pytest.mark.parametrize(("text", "message"), [
    ("cache-size = \n", "is not TOML"),
    ("bogus = 1\n", "no option --bogus"),
    ("[cluster]\nurl = 'redis://x'\n", "cluster must be a string, number or boolean"),
    ('cache-size = "10X"\n', "bad size '10X'"),
])
def test_mountd_bad_config_file_is_one_line_exit_2(capsys, tmp_path, text, message):
    config = _config(tmp_path, text)
    code, _, err = cli(capsys, "mountd", "--cache-dir", str(tmp_path / "c"), "--config", str(config))
    assert code == 2 and message in err, err
    assert err.count("\n") == 1 and "Traceback" not in err
    config = _config(tmp_path, 'remote-concurrency = "many"\n')  # refused as on the command line
    code, _, err = cli(capsys, "mountd", "--cache-dir", str(tmp_path / "c"), "--config", str(config))
    assert code == 2 and "'--remote-concurrency'" in err and "Traceback" not in err
    code, _, err = cli(capsys, "mountd", "--config", str(tmp_path / "missing.toml"))
    assert code == 2 and "No such file or directory" in err and err.count("\n") == 1


def test_the_shipped_config_file_starts_mountd(tmp_path):
    shipped = Path(__file__).resolve().parents[2] / "packaging" / "quiverfs" / "mountd.toml"
    # The file's cache directory and group are the service's; the command line overrides them.
    with running_mountd(tmp_path / "svc", "--config", str(shipped), "--socket-group", "root",
                        "--metrics-port", "0", cache_size="8M") as daemon, \
            SyncClient.connect(daemon.cache_dir) as client:
        assert client.usage()["cache_dir"] == str(daemon.cache_dir)
