"""`quiverfs stats`' sources table: each remote source's requests, retries, failures and how
its reads go."""

from __future__ import annotations

from rich.console import Console

from quiverfs.cli.mountd_views import print_sources


def test_sources_table_shows_requests_retries_failures_and_read_path():
    sources = {
        "s3://bucket/train": {"requests": {"GET": 1200, "HEAD": 0, "LIST": 3},
                              "bytes_read": 132 << 20, "retries": 4,
                              "failures": {"TemporaryFailure": 4, "NotFound": 1},
                              "reads": "obstore"},
        "file:///data/val": {"requests": {"GET": 7}, "bytes_read": 7000, "retries": 0,
                             "failures": {}, "reads": None},
    }
    console = Console(record=True, width=200)
    print_sources(sources, console)
    lines = console.export_text().splitlines()
    [s3] = [line for line in lines if "s3://bucket/train" in line]
    assert "obstore" in s3 and "GET 1200, LIST 3" in s3 and "HEAD" not in s3
    assert "NotFound 1, TemporaryFailure 4" in s3 and " 4 " in s3
    [local] = [line for line in lines if "file:///data/val" in line]
    assert "GET 7" in local and local.split("│")[2].strip() == "-"
    assert lines.index(local) < lines.index(s3)  # sorted by URL
