"""Running a typer app the way every quiverfs command behaves.

Errors from our vocabulary print as one line ``PROG: error: MESSAGE`` and exit with the error
class's code; anything unexpected prints one line asking for ``--debug``, which shows the full
traceback instead. Exit codes (docs/operations.md): 0 ok, 1 failure, 2 bad usage, 3 remote
error, 4 invalid digest, 5 cache error, 70 internal error, 75 another mountd owns the cache,
130 interrupted. Each comes from the error class (``exit_code``), defined once in the package's
errors module.
"""

from __future__ import annotations

import sys
import traceback

import click
import typer

from quiverfs.base.errors import QuiverError

INTERNAL_ERROR = 70
INTERRUPTED = 130


def _click_classes(name: str) -> tuple[type[BaseException], ...]:
    """``name`` from click and, where typer vendors its own copy of click (typer >= 0.29:
    ``typer._click``), from that copy too: typer raises the vendored classes."""
    modules = [click.exceptions]
    try:
        from typer._click import exceptions as vendored  # type: ignore[import-not-found]

        modules.append(vendored)
    except ImportError:
        pass
    return tuple(getattr(module, name) for module in modules if hasattr(module, name))


_EXIT = _click_classes("Exit")
_CLICK_ERROR = _click_classes("ClickException")
_ABORT = _click_classes("Abort")


def run_app(app: typer.Typer, prog: str, argv: list[str] | None = None) -> None:
    """Run ``app`` with ``argv`` (default ``sys.argv[1:]``) and exit with its status."""
    args = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in args
    if debug:
        args.remove("--debug")
    try:
        result = app(args=args, prog_name=prog, standalone_mode=False)
    except QuiverError as exc:
        if debug:
            traceback.print_exc()
        print(f"{prog}: error: {exc}", file=sys.stderr)
        sys.exit(exc.exit_code)
    except _EXIT as exc:
        sys.exit(exc.exit_code)
    except _CLICK_ERROR as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except (KeyboardInterrupt, *_ABORT):
        print(f"{prog}: interrupted", file=sys.stderr)
        sys.exit(INTERRUPTED)
    except Exception as exc:
        if debug:
            traceback.print_exc()
        else:
            print(
                f"{prog}: internal error: {type(exc).__name__}: {exc} (rerun with --debug for details)",
                file=sys.stderr,
            )
        sys.exit(INTERNAL_ERROR)
    if result == INTERRUPTED:
        # typer turns Ctrl-C into a return value of 130 rather than raising.
        print(f"{prog}: interrupted", file=sys.stderr)
    sys.exit(result if isinstance(result, int) else 0)
