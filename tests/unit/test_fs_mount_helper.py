"""The mount(8) helper's option parsing and the /proc/mounts reader, without mounting."""

from __future__ import annotations

from pathlib import Path

import pytest

from quiverfs import mount
from quiverfs.errors import UsageError, first_error
from quiverfs.mount_cli import helper_main, parse_helper_args


def test_fstab_style_options() -> None:
    args = parse_helper_args(
        ["/data/imagenet.qd", "/mnt/imagenet", "-o",
         "rw,noauto,_netdev,x-systemd.automount,cache_size=200G,cache_dir=/var/cache/quiverfs,allow_other,workers=3,"
         "frontend=pyfuse3"]
    )
    assert args == {
        "digest": Path("/data/imagenet.qd"), "mountpoint": Path("/mnt/imagenet"),
        "cache_dir": Path("/var/cache/quiverfs"), "cache_size": "200G", "allow_other": True,
        "foreground": False, "debug": False, "workers": 3, "frontend": "pyfuse3", "fake": False,
    }
    assert parse_helper_args(["d.qd", "/m"])["frontend"] == "native"


def test_flags_and_joined_options() -> None:
    args = parse_helper_args(["-n", "d.qd", "-ocache_size=10%,debug", "/m", "-sv"])
    assert args["cache_size"] == "10%" and args["debug"] and not args["fake"]
    assert parse_helper_args(["d.qd", "/m", "-f"])["fake"]


@pytest.mark.parametrize(
    "argv",
    [[], ["only-one"], ["a", "b", "c"], ["a", "b", "-o"], ["a", "b", "-o", "cache_size"],
     ["a", "b", "-o", "bogus=1"], ["a", "b", "-o", "allow_other=yes"], ["a", "b", "-o", "workers"],
     ["a", "b", "-o", "workers=two"], ["a", "b", "-o", "workers=-1"], ["a", "b", "-o", "frontend"],
     ["a", "b", "-o", "frontend=fuse2"]],
)
def test_bad_command_lines(argv) -> None:
    with pytest.raises(UsageError):
        parse_helper_args(argv)


def test_helper_exit_codes(capsys, tmp_path) -> None:
    assert helper_main(["a", "b", "-o", "bogus"]) == 1
    assert "unknown mount option 'bogus'" in capsys.readouterr().err
    assert helper_main(["a", str(tmp_path), "-f"]) == 0  # fake: parse only


def test_proc_mounts_unescaping(tmp_path, monkeypatch) -> None:
    assert mount._unescape(r"/mnt/with\040space\011tab\134x") == "/mnt/with space\ttab\\x"
    assert mount.mounted_fstype("/proc") == "proc"
    assert mount.mounted_fstype(tmp_path) is None


def test_mountpoint_checks(tmp_path) -> None:
    with pytest.raises(UsageError, match="does not exist"):
        mount.check_mountpoint(tmp_path / "missing")
    (tmp_path / "file").write_text("x")
    with pytest.raises(UsageError, match="not a directory"):
        mount.check_mountpoint(tmp_path / "file")
    with pytest.raises(UsageError, match="already a mount point"):
        mount.check_mountpoint(Path("/proc"))
    mount.check_mountpoint(tmp_path)


def test_one_error_comes_out_of_nested_exception_groups() -> None:
    inner = mount.MountError("the kernel did not accept the mount at /m")
    group = BaseExceptionGroup("outer", [ExceptionGroup("inner", [RuntimeError("cancelled"), inner])])
    assert first_error(group) is inner
    plain = RuntimeError("a bug")
    assert first_error(ExceptionGroup("g", [plain])) is plain


def test_cache_dir_must_be_a_directory(tmp_path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(UsageError, match="is not a directory"):
        mount.check_cache_dir(tmp_path / "file")
    mount.check_cache_dir(tmp_path / "not-yet")  # created later
