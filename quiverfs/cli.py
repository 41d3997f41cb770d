"""``quiverfs``: the admin command line (mount, stats, ... grow here as mountd lands)."""

from __future__ import annotations

import typer

from quiverfs import __version__
from quiverfs.console import run_app

app = typer.Typer(
    help="quiverfs: training data in cloud buckets, read like a fast local directory.\n\n"
    "Add --debug to any command for full tracebacks.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)


@app.callback()
def _root() -> None:
    """quiverfs: training data in cloud buckets, read like a fast local directory."""


@app.command()
def version() -> None:
    """Print the quiverfs version.  Example: quiverfs version"""
    typer.echo(__version__)


def main() -> None:
    """Console-script entry point."""
    run_app(app, "quiverfs")
