"""Who may connect to mountd's socket: ``--socket-mode``, ``--socket-group`` and ``--shared``
parsed and checked in one place (mountd.daemon.SocketAccess), and ``bind_socket`` giving the
socket its mode and group without a moment of wider access, whatever the umask.
tests/mountd/test_shared_access.py connects as other users to a real mountd."""

from __future__ import annotations

import grp
import os
import stat

import pytest

from mountd.daemon import SocketAccess
from mountd.rpc.listener import bind_socket
from quiverfs.base.errors import UsageError


def other_group() -> grp.struct_group:
    """A group other than ours (root may give a file to any group)."""
    for entry in grp.getgrall():
        if entry.gr_gid != os.getegid():
            return entry
    pytest.skip("no second group on this machine")


def test_options_mean_owner_only_a_group_or_everybody() -> None:
    group = other_group()
    assert SocketAccess.from_options() == SocketAccess(0o600)
    assert SocketAccess.from_options(group=group.gr_name) == SocketAccess(0o660, group.gr_gid, group.gr_name)
    assert SocketAccess.from_options(group=str(group.gr_gid)) == SocketAccess(0o660, group.gr_gid, group.gr_name)
    assert SocketAccess.from_options(shared=True) == SocketAccess(0o666)
    assert SocketAccess.from_options(mode="0o640") == SocketAccess(0o640)
    assert SocketAccess.from_options(mode="0666", group=group.gr_name).mode == 0o666
    assert [a.admits_others for a in (SocketAccess(0o600), SocketAccess(0o660), SocketAccess(0o666))] \
        == [False, True, True]
    assert SocketAccess(0o660, group.gr_gid, group.gr_name).describe() == f"0660, group {group.gr_name}"


@pytest.mark.parametrize(("options", "message"), [
    ({"mode": "0700"}, "read/write bits only"),
    ({"mode": "0066"}, "with 0600 for mountd's own user"),
    ({"mode": "rw-rw----"}, "must be octal"),
    ({"mode": "0640", "group": "0"}, "needs a --socket-mode that lets the group connect"),
    ({"shared": True, "group": "0"}, "--shared lets every local user connect"),
    ({"shared": True, "mode": "0600"}, "--shared lets every local user connect"),
    ({"group": "qfs_no_such_group"}, "no such group"),
])
def test_bad_options_are_refused_in_one_line(options, message) -> None:
    with pytest.raises(UsageError, match=message):
        SocketAccess.from_options(**options)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give the socket to another group")
async def test_the_socket_is_never_wider_than_asked_even_under_umask_0(
        tmp_path, monkeypatch, open_umask) -> None:
    group = other_group()
    path = tmp_path / "s.sock"
    seen = []
    real_chown = os.chown

    def chown(target, uid, gid):  # what anyone could do with the file before the group changes
        seen.append(stat.S_IMODE(os.stat(target).st_mode))
        real_chown(target, uid, gid)

    monkeypatch.setattr(os, "chown", chown)
    listener = bind_socket(path, mode=0o660, gid=group.gr_gid)
    try:
        st = os.stat(path)
        assert (stat.S_IMODE(st.st_mode), st.st_gid) == (0o660, group.gr_gid)
        assert seen == [0o600]  # owner only until the group is the right one
    finally:
        listener.close()


async def test_a_group_mountd_cannot_join_is_one_clear_error_and_no_socket(tmp_path, monkeypatch) -> None:
    def refuse(*args):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "chown", refuse)
    path = tmp_path / "s.sock"
    with pytest.raises(UsageError, match="cannot give the socket .* to group 4242: mountd's user"):
        bind_socket(path, mode=0o660, gid=4242)
    assert not path.exists()


async def test_the_default_socket_is_owner_only_under_umask_0(tmp_path, open_umask) -> None:
    listener = bind_socket(tmp_path / "s.sock")
    try:
        assert stat.S_IMODE(os.stat(tmp_path / "s.sock").st_mode) == 0o600
    finally:
        listener.close()


def test_quiverfs_mountd_refuses_conflicting_options_before_starting(capsys, tmp_path) -> None:
    from quiverfs.base.console import run_app
    from quiverfs.cli.main import app

    cache_dir = tmp_path / "cache"
    with pytest.raises(SystemExit) as done:
        run_app(app, "quiverfs", ["mountd", "--cache-dir", str(cache_dir), "--shared",
                                  "--socket-group", "0"])
    _, err = capsys.readouterr()
    assert done.value.code == 2 and err.count("\n") == 1, err
    assert err.startswith("quiverfs: error: --shared lets every local user connect")
    assert not cache_dir.exists()
