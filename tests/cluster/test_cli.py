"""``quiverfs mountd --cluster`` as operators run it: real processes, a real redis-server."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from mountd.rpc.client import SyncClient
from quiverfs.testing.emulators import free_port, free_ports
from quiverfs.testing.mountd import location, make_dataset, running_mountd, wait_until
from quiverfs.testing.redis import RedisServer
from tests.cluster.conftest import SECRET, mountd_once, secret_file


@pytest.mark.parametrize(("options", "message"), [
    (["--cluster", "redis://127.0.0.1:1/0"], "--cluster needs --advertise"),
    (["--advertise", "127.0.0.1:7000"], "need --cluster"),
    (["--cluster", "http://x", "--advertise", "127.0.0.1:7000", "--cluster-secret-file", "S"],
     "redis://HOST:PORT/DB"),
    (["--cluster", "redis://127.0.0.1:1/0", "--advertise", "nohost", "--cluster-secret-file", "S"],
     "--advertise must be HOST:PORT"),
    (["--cluster", "redis://127.0.0.1:1/0", "--advertise", "127.0.0.1:7000",
      "--cluster-secret-file", "OPEN"], "readable by others"),
])
def test_bad_cluster_options_are_one_line_errors(tmp_path: Path, options: list[str],
                                                 message: str) -> None:
    good, open_file = secret_file(tmp_path), tmp_path / "open.secret"
    open_file.write_bytes(SECRET)
    open_file.chmod(0o644)
    options = [str(good) if o == "S" else str(open_file) if o == "OPEN" else o for o in options]
    done = mountd_once(tmp_path, *options)
    assert done.returncode == 2, done.stderr
    assert message in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "Traceback" not in done.stderr and SECRET.decode() not in done.stderr


def test_two_processes_share_through_peers_and_one_killed_costs_nothing(
        tmp_path: Path, redis_server: RedisServer) -> None:
    url, files = make_dataset(tmp_path / "bucket", 12, size=3000)
    secret = secret_file(tmp_path)
    *ports, metrics = free_ports(3)

    def options(i: int) -> list[str]:
        return ["--cluster", redis_server.url, "--advertise", f"127.0.0.1:{ports[i]}",
                "--cluster-secret-file", str(secret), "--cluster-name", "cli",
                *(["--metrics-port", str(metrics)] if i == 1 else [])]

    with running_mountd(tmp_path / "a", *options(0)) as a, \
            running_mountd(tmp_path / "b", *options(1)) as b, \
            SyncClient.connect(a.cache_dir) as ca, SyncClient.connect(b.cache_dir) as cb:
        wait_until(lambda: len(cb.stats()["cluster"]["members"]) == 2, 30, "b to see a")
        wait_until(lambda: len(ca.stats()["cluster"]["members"]) == 2, 30, "a to see b")
        for f in files:
            assert Path(ca.ensure(f.hash, f.size, location(url, f))).read_bytes() == f.data
        for f in files:
            assert Path(cb.ensure(f.hash, f.size, location(url, f))).read_bytes() == f.data
        sa, sb = ca.stats(), cb.stats()
        gets = [s["counters"]["total"]["remote_requests"]["GET"] for s in (sa, sb)]
        assert sum(gets) == len(files)
        assert sb["cluster"]["peer_hits"] >= 1 and sb["cluster"]["connected"] is True
        text = urllib.request.urlopen(f"http://127.0.0.1:{metrics}/metrics", timeout=10).read()
        assert b"quiverfs_cluster_peer_hits_total " in text
        assert b"quiverfs_cluster_take_overs_total 0" in text
        assert b"quiverfs_cluster_members 2" in text
        # quiverfs stats shows the cluster (JSON and tables).
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
        shown = subprocess.run([sys.executable, "-m", "quiverfs.cli", "stats", "--cache-dir",
                                str(b.cache_dir), "--json"], capture_output=True, text=True,
                               timeout=60, env=env, check=True)
        assert json.loads(shown.stdout)["cluster"]["node"] == f"127.0.0.1:{ports[1]}"
        table = subprocess.run([sys.executable, "-m", "quiverfs.cli", "stats", "--cache-dir",
                                str(b.cache_dir)], capture_output=True, text=True,
                               timeout=60, env=env, check=True)
        assert "cluster cli" in table.stdout and "connected" in table.stdout

        a.proc.send_signal(signal.SIGKILL)  # no goodbye: b notices when its key expires
        a.proc.wait(10)
        more_url, more = make_dataset(tmp_path / "bucket2", 8, size=3000, seed=1)
        for f in more:  # a is still a member for a few seconds: no error reaches b's reader
            got = cb.ensure(f.hash, f.size, location(more_url, f))
            assert Path(got).read_bytes() == f.data
        wait_until(lambda: cb.stats()["cluster"]["members"] == [f"127.0.0.1:{ports[1]}"],
                   30, "b to see a gone")


def test_cluster_options_from_the_config_file(tmp_path: Path, redis_server: RedisServer) -> None:
    secret, port = secret_file(tmp_path), free_port()
    config = tmp_path / "mountd.toml"
    config.write_text(f'cluster = "{redis_server.url}"\nadvertise = "127.0.0.1:{port}"\n'
                      f'cluster-secret-file = "{secret}"\ncluster-name = "fromfile"\n')
    with running_mountd(tmp_path / "n", "--config", str(config)) as node, \
            SyncClient.connect(node.cache_dir) as client:
        shown = client.stats()["cluster"]
        assert (shown["node"], shown["name"]) == (f"127.0.0.1:{port}", "fromfile")
        wait_until(lambda: client.stats()["cluster"]["members"] == [f"127.0.0.1:{port}"], 30,
                   "the node to see itself in Redis")
    # A file missing the secret is refused like the same options on the command line.
    config.write_text(f'cluster = "{redis_server.url}"\nadvertise = "127.0.0.1:{port}"\n')
    done = mountd_once(tmp_path, "--config", str(config))
    assert done.returncode == 2 and "--cluster needs --advertise" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
