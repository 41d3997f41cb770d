"""``digests``: build, inspect, verify and diff dataset digests."""

from __future__ import annotations

import typer

from quiverfs.console import run_app

app = typer.Typer(
    help="Build, inspect, verify and diff quiverfs dataset digests.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)


@app.callback()
def _root() -> None:
    """Build, inspect, verify and diff quiverfs dataset digests."""


def main() -> None:
    """Console-script entry point."""
    run_app(app, "digests")
