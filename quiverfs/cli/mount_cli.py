"""``quiverfs mount``, ``quiverfs umount``, ``quiverfs mounts`` and the ``mount.fuse.quiverfs`` helper.

A thin layer over :mod:`quiverfs.mount`; :func:`register` adds the commands to the
``quiverfs`` app (quiverfs/cli/main.py calls it). :func:`mount_stats` gives the per-mount counters
that ``quiverfs stats``/``mounts`` show next to mountd's.
"""

from __future__ import annotations

import json
import math
import os
import sys
import threading
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import typer

from quiverfs.base.errors import QuiverError, UsageError
from quiverfs.filesystem.readahead import WINDOW
from quiverfs.filesystem.sweep import FACTOR
from quiverfs.mount.mountd_wait import MOUNTD_WAIT

_CACHE_DIR_HELP = ("Cache directory shared with mountd (default: $XDG_CACHE_HOME/quiverfs, "
                   "~/.cache/quiverfs, or $TMPDIR/quiverfs-UID/cache for an account without a "
                   "usable home).")

#: Seconds ``mount_stats`` waits for one mount's ``user.quiver.stats`` (a hung mount must not
#: hang ``quiverfs stats``).
STATS_TIMEOUT = 1.0

#: Most processes a mount may serve its requests with (`--workers`).
MAX_WORKERS = 32

#: Longest ``--mountd-wait`` (seconds): a day; a reader blocked longer is a hung job.
MAX_MOUNTD_WAIT = 86400.0

#: Most files a mount may read ahead (`--readahead`): far more than mountd fills at once.
MAX_READAHEAD = 10_000

#: Largest ``--sweep``: files fetched ahead per file read by a reader that is not scanning.
MAX_SWEEP = 64


def _check_size(cache_size: str | None, cache_dir: Path | None) -> None:
    if cache_size is not None:
        from mountd.store import layout

        layout.parse_size(cache_size, cache_dir or layout.default_cache_dir())


def mount(
    digest: Path, mountpoint: Path, *, cache_dir: Path | None = None, cache_size: str | None = None,
    foreground: bool = False, allow_other: bool = False, debug: bool = False, workers: int = 0,
    frontend: str = "native",
    nonempty: bool = False, readahead: int = WINDOW, sweep: int = FACTOR,
    mountd_wait: float = MOUNTD_WAIT, passthrough: bool | None = None,
) -> str:
    """Mount ``digest`` at ``mountpoint`` (the Python API of ``quiverfs mount``).

    Detached (the default): returns once the mount serves, with the line to print. With
    ``foreground``: serves in this process and returns after the unmount.
    """
    from quiverfs.mount.serve import FRONTENDS, PYFUSE3, MountOptions
    from quiverfs.mount.start import mount_detached, run_foreground, setup_logging

    _check_size(cache_size, cache_dir)
    if not 0 <= workers <= MAX_WORKERS:
        raise UsageError(f"--workers must be between 1 and {MAX_WORKERS} (0: one per core), not {workers}")
    if frontend not in FRONTENDS:
        raise UsageError(f"--frontend must be one of {', '.join(FRONTENDS)}, not {frontend!r}")
    if not 0 <= readahead <= MAX_READAHEAD:
        raise UsageError(f"--readahead must be a number of files from 0 (off) to {MAX_READAHEAD}, not {readahead}")
    if not 0 <= sweep <= MAX_SWEEP:
        raise UsageError(f"--sweep must be a number of files per file read from 0 (off) to {MAX_SWEEP}, "
                         f"not {sweep}")
    if not 0 <= mountd_wait <= MAX_MOUNTD_WAIT:
        raise UsageError(f"--mountd-wait must be seconds from 0 (fail at once) to {MAX_MOUNTD_WAIT:g}, "
                         f"not {mountd_wait:g}")
    if passthrough and frontend == PYFUSE3:
        raise UsageError("--passthrough needs the native front end (--frontend native)")
    if frontend == PYFUSE3:
        from quiverfs.fuse import frontend_pyfuse3  # an optional extra: only when asked for

        frontend_pyfuse3.require()
    options = MountOptions(digest, mountpoint, cache_dir, cache_size, allow_other, debug, workers,
                           frontend, nonempty=nonempty, readahead=readahead, sweep=sweep,
                           mountd_wait=mountd_wait, passthrough=passthrough)
    if foreground:
        setup_logging(debug)
        run_foreground(options)
        return f"unmounted {options.resolved().mountpoint}"
    pid = mount_detached(options)
    where = options.resolved().mountpoint
    try:
        dataset = os.getxattr(where, "user.quiver.dataset").decode()
    except OSError:
        dataset = "?"
    return f"mounted dataset {dataset[:16]} at {where} (pid {pid})"


def mount_stats(mounts: Iterable[Mapping[str, Any]], timeout: float = STATS_TIMEOUT) -> list[dict[str, Any]]:
    """Per-mount counters for mountd's ``ls()["mounts"]`` records, read from each mount's
    ``user.quiver.stats`` (opens, reads, hits, misses, bytes, errors).

    Each result is the record plus ``"stats"`` (a dict, or None) and ``"stats_error"`` (why
    there are none: not a mount point any more, not answering within ``timeout``, ...).

    ``"digest"`` is the digest file the user mounted, as the mount says (None when it says
    nothing); ``"snapshot"`` the record's digest: the mount's private copy, which is what it
    registered with mountd and serves (docs/mount.md "The digest copy").
    """
    out = []
    for record in mounts:
        row: dict[str, Any] = dict(record)
        row["stats"], row["stats_error"] = None, None
        mountpoint = record.get("mountpoint")
        if not mountpoint:
            row["stats_error"] = "no mount point registered"
        else:
            row["stats"], row["stats_error"] = _read_stats(mountpoint, timeout)
        row["snapshot"] = record.get("digest")
        mounted = (row["stats"] or {}).get("mounted_digest")
        row["digest"] = mounted if isinstance(mounted, str) else None
        out.append(row)
    return out


def _read_stats(mountpoint: str, timeout: float) -> tuple[dict[str, Any] | None, str | None]:
    """``(stats, None)`` or ``(None, why not)``; the getxattr runs in a daemon thread."""
    result: list[Any] = []

    def read() -> None:
        try:
            result.append(json.loads(os.getxattr(mountpoint, "user.quiver.stats")))
        except (OSError, ValueError) as exc:
            result.append(exc)

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    thread.join(timeout)
    if not result:
        return None, f"no answer within {timeout:g}s"
    if isinstance(result[0], OSError):
        return None, os.strerror(result[0].errno) if result[0].errno else str(result[0])
    if isinstance(result[0], Exception):
        return None, str(result[0])
    return result[0], None


def register(app: typer.Typer) -> None:
    """Add ``mount``, ``umount`` and ``mounts`` to the ``quiverfs`` app."""

    @app.command("mount")
    def mount_command(
        digest: Path = typer.Argument(..., help="The dataset's digest file (from `digests build`)."),
        mountpoint: Path = typer.Argument(..., help="An existing empty directory (see --nonempty)."),
        cache_dir: Path | None = typer.Option(None, "--cache-dir", help=_CACHE_DIR_HELP, readable=False),
        cache_size: str | None = typer.Option(
            None, "--cache-size",
            help="Cache size for a mountd this mount starts (10G, 20%); a running mountd keeps its own.",
        ),
        foreground: bool = typer.Option(
            False, "--foreground", "-f", help="Serve in this process until unmounted (systemd, containers)."
        ),
        allow_other: bool = typer.Option(
            False, "--allow-other", help="Let other users read the mount (root, or user_allow_other in /etc/fuse.conf)."
        ),
        workers: int = typer.Option(
            0, "--workers", help="Processes serving the mount's requests (default 0: one per core, 2 to 4).",
        ),
        frontend: str = typer.Option(
            "native", "--frontend",
            help="Who speaks FUSE: native (fast, Linux >= 5.1) or pyfuse3 (portable, one process; "
                 "needs the pyfuse3 extra).",
        ),
        nonempty: bool = typer.Option(
            False, "--nonempty", help="Mount over a directory that is not empty (its entries are hidden meanwhile).",
        ),
        readahead: int = typer.Option(
            WINDOW, "--readahead", metavar="N",
            help="Files fetched ahead when the reads are a scan in digest order (cp -r, tar, a "
                 "loader walking a directory); 0: off.",
        ),
        sweep: int = typer.Option(
            FACTOR, "--sweep", metavar="N",
            help="When the reads are not a scan (a shuffled epoch), fetch the files of the range "
                 "they cover in digest order, up to N files (and N times the bytes) per file read; "
                 "for a dataset larger than the cache, at most 72% of the cache fetched and unread "
                 "at a time, kept until read; 0: off.",
        ),
        mountd_wait: float = typer.Option(
            MOUNTD_WAIT, "--mountd-wait", metavar="SECONDS",
            help="How long a miss or a sampler's request waits for a mountd that is away "
                 "(restarting) before it fails with EIO; 0: fail at once. Hits never wait.",
        ),
        passthrough: bool | None = typer.Option(
            None, "--passthrough/--no-passthrough",
            help="Let the kernel read cached files from the cache itself (FUSE passthrough: "
                 "Linux 6.9+, mounted by root): much faster for large files, but every open() "
                 "then reaches the mount. Default: on for datasets of files of 1 MiB or more "
                 "on average, where the kernel allows it.",
        ),
    ) -> None:
        """Mount a dataset read-only: its files are read through the machine's shared cache.

        Starts a mountd (default cache directory and size) when none runs. Returns once the
        mount serves; unmount with `quiverfs umount`. Add --debug for detailed logs.

        Example: quiverfs mount imagenet.qd /mnt/imagenet --cache-dir /var/cache/quiverfs
        """
        debug = "--debug" in sys.argv  # the global --debug (run_app removes it from the args)
        line = mount(digest, mountpoint, cache_dir=cache_dir, cache_size=cache_size,
                     foreground=foreground, allow_other=allow_other, debug=debug, workers=workers,
                     frontend=frontend, nonempty=nonempty, readahead=readahead, sweep=sweep,
                     mountd_wait=mountd_wait, passthrough=passthrough)
        if not foreground:
            typer.echo(line)

    @app.command("umount")
    def umount_command(
        mountpoint: Path = typer.Argument(..., help="Where the dataset is mounted."),
        lazy: bool = typer.Option(False, "--lazy", "-z", help="Detach now even if files are open there."),
    ) -> None:
        """Unmount a quiverfs mount (also one whose process died).

        Example: quiverfs umount /mnt/imagenet
        """
        from quiverfs.mount.mountpoint import unmount

        unmount(mountpoint, lazy=lazy)
        typer.echo(f"unmounted {os.path.abspath(mountpoint)}")

    @app.command("mounts")
    def mounts_command(
        cache_dir: Path | None = typer.Option(None, "--cache-dir", help=_CACHE_DIR_HELP, readable=False),
        as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
    ) -> None:
        """List the mounts registered with mountd and each one's own counters.

        Example: quiverfs mounts --json
        """
        from mountd.rpc.client import SyncClient, resolve_socket

        with SyncClient.connect(resolve_socket(cache_dir)[0]) as client:
            rows = mount_stats(client.ls()["mounts"])
        if as_json:
            typer.echo(json.dumps(rows, indent=2, sort_keys=True))
            return
        from quiverfs.cli.mountd_views import print_mounts

        print_mounts(rows)


# -- mount.fuse.quiverfs: the mount(8) / fstab helper ----------------------------------------

#: Generic mount(8)/fstab options the helper accepts and ignores (the mount is always
#: read-only, nodev and nosuid).
IGNORED_OPTIONS = frozenset({
    "defaults", "ro", "rw", "auto", "noauto", "user", "nouser", "users", "nofail", "_netdev",
    "dev", "nodev", "suid", "nosuid", "exec", "noexec", "atime", "noatime", "relatime",
    "diratime", "nodiratime", "sync", "async",
})

HELPER = "mount.fuse.quiverfs"
HELPER_USAGE = (f"usage: {HELPER} DIGEST MOUNTPOINT "
                "[-o cache_dir=DIR,cache_size=SIZE,workers=N,readahead=N,sweep=N,mountd_wait=SECONDS,"
                "frontend=native|pyfuse3,allow_other,nonempty,passthrough,nopassthrough,"
                "foreground,debug]")


def parse_helper_args(argv: list[str]) -> dict[str, Any]:
    """The :func:`mount` keyword arguments for a mount(8) helper command line.

    mount(8) runs ``mount.fuse.quiverfs SPEC DIR [-sfnv] [-o OPTIONS]``; ``-f`` (fake)
    sets ``"fake": True``. Raises :class:`UsageError` on anything it does not understand.
    """
    positional: list[str] = []
    opts: list[str] = []
    fake = False
    args = list(argv)
    while args:
        arg = args.pop(0)
        if arg == "-o":
            if not args:
                raise UsageError(f"-o needs a value; {HELPER_USAGE}")
            opts.extend(o for o in args.pop(0).split(",") if o)
        elif arg.startswith("-o") and len(arg) > 2:
            opts.extend(o for o in arg[2:].split(",") if o)
        elif arg.startswith("-") and len(arg) > 1 and set(arg[1:]) <= set("sfnvh"):
            if "h" in arg:
                raise UsageError(HELPER_USAGE)
            fake = fake or "f" in arg
        else:
            positional.append(arg)
    if len(positional) != 2:
        raise UsageError(HELPER_USAGE)
    result: dict[str, Any] = {"digest": Path(positional[0]), "mountpoint": Path(positional[1]),
                              "cache_dir": None, "cache_size": None, "allow_other": False,
                              "foreground": False, "debug": False, "workers": 0, "frontend": "native",
                              "nonempty": False, "readahead": WINDOW, "sweep": FACTOR,
                              "mountd_wait": MOUNTD_WAIT, "passthrough": None,
                              "fake": fake}
    for opt in opts:
        key, eq, value = opt.partition("=")
        if key in ("cache_dir", "cache_size"):
            if not eq or not value:
                raise UsageError(f"option {key} needs a value ({key}=...)")
            result[key] = Path(value) if key == "cache_dir" else value
        elif key == "frontend":
            from quiverfs.mount.serve import FRONTENDS

            if value not in FRONTENDS:
                raise UsageError(f"option frontend must be one of {', '.join(FRONTENDS)}, not {opt!r}")
            result[key] = value
        elif key == "workers":
            if not eq or not value.isdigit():
                raise UsageError(f"option workers needs a number (workers=N), not {opt!r}")
            result[key] = int(value)
        elif key == "readahead":
            if not eq or not value.isdigit():
                raise UsageError(f"option readahead needs a number of files (readahead=N, 0: off), not {opt!r}")
            result[key] = int(value)
        elif key == "sweep":
            if not eq or not value.isdigit():
                raise UsageError(f"option sweep needs a number of files per file read (sweep=N, 0: off), "
                                 f"not {opt!r}")
            result[key] = int(value)
        elif key == "mountd_wait":
            try:
                seconds = float(value)
            except ValueError:
                seconds = math.nan  # fails the range check below
            if not eq or not 0 <= seconds <= MAX_MOUNTD_WAIT:
                raise UsageError(f"option mountd_wait needs seconds from 0 to {MAX_MOUNTD_WAIT:g} "
                                 f"(mountd_wait=60), not {opt!r}")
            result[key] = seconds
        elif key == "nopassthrough" and not eq:
            result["passthrough"] = False
        elif key in ("allow_other", "nonempty", "foreground", "debug", "passthrough") and not eq:
            result[key] = True
        elif key in IGNORED_OPTIONS or key.startswith("x-") or key == "comment":
            continue
        else:
            raise UsageError(f"unknown mount option {opt!r}; {HELPER_USAGE}")
    return result


def helper_main(argv: list[str] | None = None) -> int:
    """Entry point of ``mount.fuse.quiverfs``; mount(8) exit codes: 1 for a refusal (a bad
    command line, a mount point that is taken, not empty or missing), 32 for a mount that
    failed."""
    args = sys.argv[1:] if argv is None else argv
    try:
        kwargs = parse_helper_args(args)
        if kwargs.pop("fake"):
            return 0
        line = mount(**kwargs)
    except QuiverError as exc:
        # Judged by the exit code, not the class: a detached mount's serving process reports
        # its error as a line and its exit status, and the parent raises it as a MountError
        # with that status. A refusal there (a racing mount took the mount point between the
        # parent's check and the child's) is as much a UsageError as the parent's own.
        if exc.exit_code == UsageError.exit_code:
            print(f"{HELPER}: {exc}", file=sys.stderr)
            return 1
        print(f"{HELPER}: error: {exc}", file=sys.stderr)
        return 32
    except KeyboardInterrupt:
        return 130
    if not kwargs["foreground"]:
        print(line)
    return 0
