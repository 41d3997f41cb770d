"""mountd.store.layout: the store-path contract, default cache dir, size parsing; and config checks."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from mountd.store import layout
from mountd.store.config import CacheConfig
from quiverfs.base.errors import UsageError

H = bytes(range(32))


def test_store_path_fans_out_by_hex_prefix():
    path = layout.store_path("/c", H)
    assert path == Path("/c/store/00/01/" + H.hex())
    assert path.name == "000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f"


def test_store_path_rejects_non_hashes():
    for bad in (b"", b"x" * 31, b"x" * 33, "00" * 32):
        with pytest.raises(ValueError):
            layout.store_path("/c", bad)


def test_other_paths():
    assert layout.tmp_dir("/c") == Path("/c/tmp")
    assert layout.index_path("/c") == Path("/c/index.sqlite")
    assert layout.socket_path("/c") == Path("/c/mountd.sock")
    assert layout.lock_path("/c") == Path("/c/lock")


def test_default_cache_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert layout.default_cache_dir() == tmp_path / "xdg" / "quiverfs"
    monkeypatch.delenv("XDG_CACHE_HOME")
    (tmp_path / "home").mkdir()  # a home that does not exist: tests/unit/test_state_dirs.py
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert layout.default_cache_dir() == tmp_path / "home" / ".cache" / "quiverfs"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/ignored")  # the spec says absolute only
    assert layout.default_cache_dir() == tmp_path / "home" / ".cache" / "quiverfs"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1073741824", 1 << 30),
        ("10G", 10 << 30),
        ("512M", 512 << 20),
        ("512m", 512 << 20),
        ("1.5T", int(1.5 * (1 << 40))),
        ("64KiB", 64 << 10),
        ("2GB", 2 << 30),
        (" 7 ", 7),
        (4096, 4096),
    ],
)
def test_parse_size(text, expected):
    assert layout.parse_size(text) == expected


def test_parse_size_percent_of_filesystem(tmp_path: Path):
    st = os.statvfs(tmp_path)
    total = st.f_blocks * st.f_frsize
    assert layout.parse_size("20%", tmp_path / "not" / "yet") == int(total * 0.2)
    assert layout.parse_size("100%", tmp_path) == total


@pytest.mark.parametrize("text", ["", "ten", "10X", "-5G", "0", "0%", "150%", "1e9", "5 G B", "%"])
def test_parse_size_errors_are_one_line(text, tmp_path: Path):
    with pytest.raises(UsageError) as info:
        layout.parse_size(text, tmp_path)
    assert "\n" not in str(info.value) and str(info.value)


def test_percent_needs_a_filesystem():
    with pytest.raises(UsageError, match="percentage"):
        layout.parse_size("20%")


def test_config_validation(tmp_path: Path):
    assert CacheConfig(cache_dir=str(tmp_path), cache_size=1).cache_dir == tmp_path
    with pytest.raises(UsageError, match="cache size"):
        CacheConfig(cache_dir=tmp_path, cache_size=0)
    with pytest.raises(UsageError, match="remote bandwidth"):
        CacheConfig(cache_dir=tmp_path, cache_size=1, remote_bandwidth=0)
    with pytest.raises(UsageError, match="remote concurrency"):
        CacheConfig(cache_dir=tmp_path, cache_size=1, remote_concurrency=0)
