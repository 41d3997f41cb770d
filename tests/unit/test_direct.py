"""The direct loader's parts that need no mount: store paths, files off any mount, pickling,
and hit reports when mountd is away (tests/mount/test_direct_loader.py has the rest)."""

from __future__ import annotations

import logging
import os
import pickle
import time
from pathlib import Path

import blake3

from mountd.store import layout
from quiverfs.client.direct import DirectReader, _store_file
from quiverfs.client.hit_reports import CONNECT_TIMEOUT, HitReporter


def test_store_file_names_what_layout_names(tmp_path: Path) -> None:
    for data in (b"", b"a", b"quiver" * 1000):
        content_hash = blake3.blake3(data).digest()
        assert _store_file(os.fspath(layout.store_dir(tmp_path)), content_hash) == \
            os.fspath(layout.store_path(tmp_path, content_hash))


def test_files_on_no_mount_are_opened_as_they_are(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "x.bin").write_bytes(b"payload")
    reader = DirectReader()
    assert reader.read(tmp_path / "a" / "x.bin") == b"payload"
    monkeypatch.chdir(tmp_path)
    assert reader.read("a/x.bin") == b"payload"  # relative paths too
    assert reader.read(os.fsencode(tmp_path / "a" / "x.bin")) == b"payload"  # and bytes
    assert reader.counts() == {"store": 0, "mount": 0, "elsewhere": 3}
    assert reader.prepare(tmp_path) is False
    assert reader.flush() is True  # nothing to report
    reader.close()


def test_a_reader_pickles_its_settings_only(tmp_path: Path) -> None:
    (tmp_path / "x").write_bytes(b"1")
    reader = DirectReader(digests=[tmp_path / "d.qd"], flush_hits=7, flush_seconds=3.0, report=False)
    reader.read(tmp_path / "x")
    copy = pickle.loads(pickle.dumps(reader))
    assert copy._settings == reader._settings and copy._proc is None
    assert copy.counts() == {"store": 0, "mount": 0, "elsewhere": 0}  # state is per process
    reader.close()


def test_hits_for_a_mountd_that_is_away_are_dropped_and_logged_once(tmp_path: Path, caplog) -> None:
    reporter = HitReporter(os.fspath(tmp_path / "no-cache"), every=2, seconds=60)
    caplog.set_level(logging.WARNING, logger="quiverfs.direct")
    started = time.monotonic()
    for i in range(5):
        reporter.add("d" * 64, bytes([i]) * 32, 10)  # never blocks, whatever mountd does
    assert reporter.flush(timeout=5) is False
    assert time.monotonic() - started < CONNECT_TIMEOUT + 4
    assert (reporter.reported, reporter.dropped) == (0, 5)
    reporter.add("d" * 64, b"\x09" * 32, 10)
    assert reporter.flush(timeout=5) is False
    reporter.close()
    assert reporter.dropped == 6
    lines = [r for r in caplog.records if "hit reports to mountd" in r.getMessage()]
    assert len(lines) == 1
