"""The mount(8) helper's option parsing and the /proc/mounts reader, without mounting."""

from __future__ import annotations

from pathlib import Path

import pytest

from quiverfs.base.errors import UsageError, first_error
from quiverfs.cli.mount_cli import helper_main, parse_helper_args
from quiverfs.mount import mountpoint as mountpoints
from quiverfs.mount import serve, start


def test_fstab_style_options() -> None:
    args = parse_helper_args(
        ["/data/imagenet.qd", "/mnt/imagenet", "-o",
         "rw,noauto,_netdev,x-systemd.automount,cache_size=200G,cache_dir=/var/cache/quiverfs,allow_other,workers=3,"
         "frontend=pyfuse3,readahead=16,sweep=4,mountd_wait=2.5"]
    )
    assert args == {
        "digest": Path("/data/imagenet.qd"), "mountpoint": Path("/mnt/imagenet"),
        "cache_dir": Path("/var/cache/quiverfs"), "cache_size": "200G", "allow_other": True,
        "foreground": False, "debug": False, "workers": 3, "frontend": "pyfuse3", "nonempty": False,
        "readahead": 16, "sweep": 4, "mountd_wait": 2.5, "passthrough": None, "fake": False,
    }
    assert parse_helper_args(["d.qd", "/m"])["frontend"] == "native"
    assert parse_helper_args(["d.qd", "/m", "-o", "nonempty"])["nonempty"] is True
    assert parse_helper_args(["d.qd", "/m"])["readahead"] == 256  # on by default
    assert parse_helper_args(["d.qd", "/m", "-o", "readahead=0"])["readahead"] == 0
    assert parse_helper_args(["d.qd", "/m"])["sweep"] == 8  # on by default
    assert parse_helper_args(["d.qd", "/m", "-o", "sweep=0"])["sweep"] == 0
    assert parse_helper_args(["d.qd", "/m"])["mountd_wait"] == 60.0  # misses wait out a restart
    assert parse_helper_args(["d.qd", "/m", "-o", "mountd_wait=0"])["mountd_wait"] == 0.0
    assert parse_helper_args(["d.qd", "/m", "-o", "passthrough"])["passthrough"] is True
    assert parse_helper_args(["d.qd", "/m", "-o", "nopassthrough"])["passthrough"] is False


def test_flags_and_joined_options() -> None:
    args = parse_helper_args(["-n", "d.qd", "-ocache_size=10%,debug", "/m", "-sv"])
    assert args["cache_size"] == "10%" and args["debug"] and not args["fake"]
    assert parse_helper_args(["d.qd", "/m", "-f"])["fake"]


@pytest.mark.parametrize(
    "argv",
    [[], ["only-one"], ["a", "b", "c"], ["a", "b", "-o"], ["a", "b", "-o", "cache_size"],
     ["a", "b", "-o", "bogus=1"], ["a", "b", "-o", "allow_other=yes"], ["a", "b", "-o", "workers"],
     ["a", "b", "-o", "workers=two"], ["a", "b", "-o", "workers=-1"], ["a", "b", "-o", "frontend"],
     ["a", "b", "-o", "frontend=fuse2"], ["a", "b", "-o", "nonempty=1"], ["a", "b", "-o", "readahead"],
     ["a", "b", "-o", "readahead=many"], ["a", "b", "-o", "readahead=-1"], ["a", "b", "-o", "sweep"],
     ["a", "b", "-o", "sweep=lots"], ["a", "b", "-o", "sweep=-2"], ["a", "b", "-o", "mountd_wait"],
     ["a", "b", "-o", "mountd_wait=soon"], ["a", "b", "-o", "mountd_wait=-1"], ["a", "b", "-o", "mountd_wait=nan"]],
)
def test_bad_command_lines(argv) -> None:
    with pytest.raises(UsageError):
        parse_helper_args(argv)


@pytest.mark.parametrize("seconds", [-1.0, 86_401.0])
def test_mountd_wait_out_of_range_is_one_line(seconds, tmp_path) -> None:
    from quiverfs.cli.mount_cli import mount as mount_api

    with pytest.raises(UsageError) as caught:
        mount_api(tmp_path / "d.qd", tmp_path, mountd_wait=seconds)
    assert str(caught.value) == f"--mountd-wait must be seconds from 0 (fail at once) to 86400, not {seconds:g}"


@pytest.mark.parametrize(("option", "value", "says"), [
    ("readahead", -1, "--readahead must be a number of files from 0 (off) to 10000, not -1"),
    ("readahead", 10_001, "--readahead must be a number of files from 0 (off) to 10000, not 10001"),
    ("sweep", -1, "--sweep must be a number of files per file read from 0 (off) to 64, not -1"),
    ("sweep", 65, "--sweep must be a number of files per file read from 0 (off) to 64, not 65"),
])
def test_a_count_out_of_range_is_one_line(option, value, says, tmp_path) -> None:
    from quiverfs.cli.mount_cli import mount as mount_api

    with pytest.raises(UsageError) as caught:
        mount_api(tmp_path / "d.qd", tmp_path, **{option: value})
    assert str(caught.value) == says


def test_helper_exit_codes(capsys, tmp_path) -> None:
    assert helper_main(["a", "b", "-o", "bogus"]) == 1
    assert "unknown mount option 'bogus'" in capsys.readouterr().err
    assert helper_main(["a", str(tmp_path), "-f"]) == 0  # fake: parse only


def test_proc_mounts_unescaping(tmp_path, monkeypatch) -> None:
    assert mountpoints._unescape(r"/mnt/with\040space\011tab\134x") == "/mnt/with space\ttab\\x"
    assert mountpoints.mounted_fstype("/proc") == "proc"
    assert mountpoints.mounted_fstype(tmp_path) is None


def test_mountpoint_checks(tmp_path) -> None:
    with pytest.raises(UsageError, match="does not exist"):
        mountpoints.check_mountpoint(tmp_path / "missing")
    (tmp_path / "file").write_text("x")
    with pytest.raises(UsageError, match="not a directory"):
        mountpoints.check_mountpoint(tmp_path / "file")
    with pytest.raises(UsageError, match="already a mount point"):
        mountpoints.check_mountpoint(Path("/proc"))
    with pytest.raises(UsageError, match="is not empty"):
        mountpoints.check_mountpoint(tmp_path)
    mountpoints.check_mountpoint(tmp_path, nonempty=True)
    (tmp_path / "empty").mkdir()
    mountpoints.check_mountpoint(tmp_path / "empty")


def test_a_mount_landing_during_the_checks_is_named_as_a_mount(tmp_path, monkeypatch) -> None:
    # A racing mount lands after /proc/mounts was read and before the listing, which then
    # lists the new mount's root: the refusal names the mount, not "not empty".
    (tmp_path / "entry").write_text("x")
    answers = iter([None, "fuse.quiverfs"])
    monkeypatch.setattr(mountpoints, "mounted_fstype", lambda _path: next(answers))
    with pytest.raises(UsageError, match="already a mount point") as err:
        mountpoints.check_mountpoint(tmp_path)
    assert "not empty" not in str(err.value)


def test_mountpoint_claim_is_exclusive(tmp_path) -> None:
    first = mountpoints.claim_mountpoint(tmp_path)
    first.__enter__()
    try:
        with pytest.raises(UsageError, match="is being mounted by another process"):
            mountpoints.claim_mountpoint(tmp_path).__enter__()
    finally:
        first.__exit__(None, None, None)
    with mountpoints.claim_mountpoint(tmp_path):  # released on the way out
        pass


def test_mount_identity_and_unmount_own(tmp_path, monkeypatch) -> None:
    proc_id = mountpoints.mount_identity("/proc")
    assert proc_id is not None and proc_id[0] > 0 and ":" in proc_id[1]
    assert mountpoints.mount_identity(tmp_path) is None
    calls = []
    monkeypatch.setattr(mountpoints.fuse_channel, "unmount", lambda path, lazy: calls.append(path))
    mountpoints.unmount_own(Path("/proc"), (proc_id[0] + 1, proc_id[1]))  # not ours: untouched
    mountpoints.unmount_own(Path("/proc"), None)
    assert calls == []
    mountpoints.unmount_own(Path("/proc"), proc_id)
    assert calls == [Path("/proc")]


def test_status_lines_name_the_mount_made(tmp_path) -> None:
    import os

    read_fd, write_fd = os.pipe()
    status = serve.Status(write_fd)
    status.mounted((123, "0:77"))
    status.send("error: something failed")

    class Gone:
        def poll(self):
            return 1

    try:
        assert start._read_status(read_fd, Gone(), float("inf")) == ("error: something failed", (123, "0:77"))
    finally:
        os.close(read_fd)


def test_one_error_comes_out_of_nested_exception_groups() -> None:
    inner = mountpoints.MountError("the kernel did not accept the mount at /m")
    group = BaseExceptionGroup("outer", [ExceptionGroup("inner", [RuntimeError("cancelled"), inner])])
    assert first_error(group) is inner
    plain = RuntimeError("a bug")
    assert first_error(ExceptionGroup("g", [plain])) is plain


def test_cache_dir_must_be_a_directory(tmp_path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(UsageError, match="is not a directory"):
        start.check_cache_dir(tmp_path / "file")
    start.check_cache_dir(tmp_path / "not-yet")  # created later


def test_a_cache_dir_that_cannot_be_made_is_one_line(tmp_path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(UsageError, match=r"cannot create the cache directory .*/file/cache: "
                                         r"Not a directory \(pass --cache-dir"):
        start.make_cache_dir(tmp_path / "file" / "cache")  # even root cannot: ENOTDIR
    start.make_cache_dir(tmp_path / "a" / "cache")
    assert (tmp_path / "a" / "cache").is_dir()
    assert (tmp_path / "a" / "cache").stat().st_mode & 0o777 == 0o700


def test_the_helper_exits_1_when_a_racing_mount_takes_the_mount_point(tmp_path, monkeypatch, capsys) -> None:
    # The race, forced: the helper's own checks find the mount point free; by the time its
    # forked mount process checks again, another mount has taken it. That process reports
    # a UsageError through the status pipe and its exit status; mount(8) must see 1, as for
    # the same refusal made before the fork (tests/mount/test_fs_mountpoint.py races for real).
    import os

    reason = mountpoints.fuse_unavailable()
    if reason:
        pytest.skip(f"FUSE unavailable: {reason}")
    parent = os.getpid()
    monkeypatch.setattr(mountpoints, "mounted_fstype",
                        lambda _path: None if os.getpid() == parent else mountpoints.FSTYPE)
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    code = helper_main([str(tmp_path / "d.qd"), str(mountpoint), "-o", f"cache_dir={tmp_path / 'cache'}"])
    captured = capsys.readouterr()
    assert (code, captured.out) == (1, "")
    assert captured.err == (f"mount.fuse.quiverfs: {mountpoint} is already a mount point "
                            f"(quiverfs umount {mountpoint} first)\n")


def test_the_helper_exits_32_when_the_mount_fails(tmp_path, capsys) -> None:
    # A digest that is no digest: the mount process refuses it (exit 4): a failed mount.
    reason = mountpoints.fuse_unavailable()
    if reason:
        pytest.skip(f"FUSE unavailable: {reason}")
    (tmp_path / "d.qd").write_bytes(b"not a digest" * 100)
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    code = helper_main([str(tmp_path / "d.qd"), str(mountpoint), "-o", f"cache_dir={tmp_path / 'cache'}"])
    captured = capsys.readouterr()
    assert (code, captured.out) == (32, "")
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("mount.fuse.quiverfs: error: ")
    assert str(tmp_path / "d.qd") in lines[0]
    assert mountpoints.mounted_fstype(mountpoint) is None
