"""Bad command lines exit 2 with click's usage message, never as an internal error."""

from __future__ import annotations

import pytest

from digests.cli import app as digests_app
from quiverfs.base.console import INTERNAL_ERROR, run_app
from quiverfs.cli.main import app as quiverfs_app


def run(capsys, app, prog: str, *args: str) -> tuple[int, str]:
    with pytest.raises(SystemExit) as done:
        run_app(app, prog, list(args))
    return done.value.code, capsys.readouterr().err


@pytest.mark.parametrize(
    ("app", "prog", "args", "message"),
    [
        (quiverfs_app, "quiverfs", ["stats", "--bogus"], "No such option: --bogus"),
        (quiverfs_app, "quiverfs", ["mountd", "--chunk-slots", "4"], "--chunk-slots"),
        (quiverfs_app, "quiverfs", ["no-such-command"], "No such command"),
        (digests_app, "digests", ["inspect"], "Missing argument"),
        (digests_app, "digests", ["build", "x", "--workers", "many"], "--workers"),
    ],
)
def test_usage_errors_exit_2(capsys, app, prog, args, message) -> None:
    code, err = run(capsys, app, prog, *args)
    assert code == 2, err
    assert message in err
    assert "internal error" not in err and "Traceback" not in err
    assert code != INTERNAL_ERROR
