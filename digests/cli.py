"""``digests``: build, inspect, verify, diff and pack dataset digests.

A thin layer over the Python API with the same names: :func:`digests.build.build`,
:class:`digests.digest.Digest`, :func:`digests.verify.verify`, :func:`digests.diff.diff`,
:func:`digests.pack.pack`.
Errors print one line (``digests: error: ...``) with the exit codes of
:mod:`quiverfs.base.console`; ``--debug`` shows tracebacks.
"""

from __future__ import annotations

import json
import sys
from enum import StrEnum
from typing import Annotated

import trio
import typer

from digests.build import build as build_digest
from digests.diff import diff as diff_digests
from digests.digest import Digest
from digests.errors import Interrupted
from digests.pack import DEFAULT_CHUNK_SIZE, default_out
from digests.pack import pack as pack_digest
from digests.progress import make_progress
from digests.verify import verify as verify_digest
from quiverfs.base.console import run_app

app = typer.Typer(
    help="Build, inspect, verify, diff and pack quiverfs dataset digests.\n\n"
    "Add --debug to any command for full tracebacks.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)

JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout.")]


@app.callback()
def _root() -> None:
    """Build, inspect, verify, diff and pack quiverfs dataset digests."""


class TarMode(StrEnum):
    """``digests build --tar``: what a ``.tar`` object becomes (digests/build.py)."""

    shards = "shards"
    members = "members"


@app.command()
def build(
    source_url: Annotated[
        str, typer.Argument(help="What to hash: s3://, az://, gs://, file:// URL or a local path.")
    ],
    out: Annotated[str, typer.Option("-o", "--out", help="Digest file to write.")],
    location: Annotated[
        str | None,
        typer.Option(
            help="URL to record as the files' location instead of SOURCE_URL (same relative keys)."
        ),
    ] = None,
    workers: Annotated[int, typer.Option(help="Objects hashed concurrently.")] = 16,
    follow_external_links: Annotated[
        bool,
        typer.Option(
            "--follow-external-links",
            help="file:// only: include symbolic links whose target is outside SOURCE_URL "
            "(skipped with a warning by default).",
        ),
    ] = False,
    tar: Annotated[
        TarMode,
        typer.Option(
            help="What a .tar object becomes. shards: one file, like any object. members: a "
            "tar shard (WebDataset or plain, uncompressed) whose members become the files, "
            "each read from the shard by byte range; other objects stay files. "
            "See docs/digest-format.md.",
        ),
    ] = TarMode.shards,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress output.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Hash every object under SOURCE_URL into a digest; rerun the same command to resume.

    Example: digests build s3://bucket/imagenet -o imagenet.qd

    Example: digests build file:///data/imagenet --location s3://bucket/imagenet -o imagenet.qd

    Example: digests build s3://bucket/imagenet-wds --tar members -o imagenet-wds.qd
    """
    members = tar is TarMode.members
    progress = make_progress("build", quiet, unit="objects" if members else "files")
    try:
        result = trio.run(
            lambda: build_digest(
                source_url,
                out,
                location=location,
                workers=workers,
                progress=progress,
                follow_external_links=follow_external_links,
                tar=tar.value,
            )
        )
    except KeyboardInterrupt:
        progress.abort()
        raise Interrupted(
            f"interrupted; finished hashes are kept in {out}.partial: rerun the same command "
            "to resume"
        ) from None
    except BaseException:
        progress.abort()
        raise
    progress.close()
    if as_json:
        _print_json(
            {
                "out": result.out,
                "dataset_id": result.dataset_id,
                "files": result.files,
                "total_bytes": result.total_bytes,
                "hashed_files": result.hashed_files,
                "hashed_bytes": result.hashed_bytes,
                "reused_files": result.reused_files,
                "directory_markers": result.markers,
                "empty_dirs": result.empty_dirs,
                "external_links_skipped": result.external_links,
                "skipped": result.skipped_count,
                "skipped_examples": [{"key": k, "reason": r} for k, r in result.skipped],
                "tar": result.tar,
                "shards": result.shards,
                "members": result.members,
                "scanned_shards": result.scanned_shards,
                "scanned_bytes": result.scanned_bytes,
                "reused_shards": result.reused_shards,
                "shadowed": result.shadowed,
                "shadowed_examples": result.shadowed_examples,
            }
        )
        return
    typer.echo(
        f"wrote {result.out}: {result.files} files, {result.total_bytes} bytes, "
        f"dataset id {result.dataset_id}"
    )
    if members:
        typer.echo(
            f"{result.members} files from {result.shards} tar shards ({result.scanned_shards} "
            f"read, {result.scanned_bytes} bytes; {result.reused_shards} from an earlier run), "
            f"{result.files - result.members} other objects"
        )
    typer.echo(
        f"hashed {result.hashed_files} {'other ' if members else ''}objects ({result.hashed_bytes} bytes), reused "
        f"{result.reused_files} from an earlier run; {result.markers} directory markers, "
        f"{result.empty_dirs} empty directories kept"
    )
    if result.external_links:
        typer.echo(
            f"warning: skipped {result.external_links} symbolic links to targets outside "
            "the source (--follow-external-links includes them)",
            err=True,
        )
    if result.shadowed:
        typer.echo(
            f"warning: {result.shadowed} tar members or objects were replaced by a later "
            "member of the same path (the later one is kept, as extracting the shards in key "
            "order would; see the warnings above)",
            err=True,
        )
    if result.skipped_count:
        typer.echo(
            f"warning: skipped {result.skipped_count} objects{' or tar members' if members else ''}"
            " that cannot be files (see the warnings above; docs/digest-format.md)",
            err=True,
        )


@app.command()
def inspect(
    file: Annotated[str, typer.Argument(help="Digest file.")],
    check: Annotated[
        bool,
        typer.Option("--check", help="Also run SQLite's quick_check and recompute the dataset id."),
    ] = False,
    top: Annotated[
        int, typer.Option(help="How many of the largest files and directories to show.")
    ] = 5,
    as_json: JsonOpt = False,
) -> None:
    """Show a digest's id, version, counts, size, sources, largest files and directories.

    Example: digests inspect imagenet.qd --check
    """
    with Digest.open(file, check="full" if check else "rows") as d:
        info = {
            "file": file,
            "dataset_id": d.dataset_id,
            "dataset_id_checked": check,
            "format_version": d.format_version,
            "created_at": d.created_at,
            "files": d.file_count,
            "directories": d.dir_count,
            "empty_directories": d.empty_dirs(),
            "total_bytes": d.total_bytes,
            "sources": list(d.sources.values()),
            "largest_files": [{"path": f.path, "size": f.size} for f in d.largest_files(top)],
            "largest_directories": [
                {"path": e.path or "/", "files": n} for e, n in d.largest_dirs(top)
            ],
        }
    if as_json:
        _print_json(info)
        return
    typer.echo(f"dataset id      {info['dataset_id']}{' (checked)' if check else ''}")
    typer.echo(f"format version  {info['format_version']}")
    typer.echo(f"created         {info['created_at']}")
    typer.echo(f"files           {info['files']}")
    typer.echo(f"directories     {info['directories']}")
    for path in info["empty_directories"][:top]:
        typer.echo(f"empty dir       {path}/")
    typer.echo(f"total size      {info['total_bytes']} bytes")
    for url in info["sources"]:
        typer.echo(f"source          {url}")
    for f in info["largest_files"]:
        typer.echo(f"largest file    {f['size']:>14}  {f['path']}")
    for e in info["largest_directories"]:
        typer.echo(f"largest dir     {e['files']:>8} files  {e['path']}")


@app.command()
def verify(
    file: Annotated[str, typer.Argument(help="Digest file.")],
    workers: Annotated[int, typer.Option(help="Objects read concurrently.")] = 16,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress output.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Re-read every file from its location; report each missing or different one (exit 1).

    Also recomputes the dataset id. Example: digests verify imagenet.qd --workers 32
    """
    with Digest.open(file, check="full") as d:
        progress = make_progress("verify", quiet)
        try:
            result = trio.run(lambda: verify_digest(d, workers=workers, progress=progress))
        except KeyboardInterrupt:
            progress.abort()
            raise Interrupted("interrupted; nothing was changed") from None
        except BaseException:
            progress.abort()
            raise
        progress.close()
    if as_json:
        _print_json(
            {
                "ok": result.ok,
                "checked": result.checked,
                "bytes": result.bytes,
                "missing": [{"path": p, "reason": r} for p, r in result.missing],
                "mismatched": [{"path": p, "reason": r} for p, r in result.mismatched],
            }
        )
    else:
        for path, reason in result.missing + result.mismatched:
            typer.echo(f"{path}: {reason}")
        typer.echo(
            f"checked {result.checked} files ({result.bytes} bytes): {len(result.missing)} "
            f"missing, {len(result.mismatched)} different"
        )
    if not result.ok:
        raise typer.Exit(1)


@app.command()
def diff(
    a: Annotated[str, typer.Argument(help="Old digest.")],
    b: Annotated[str, typer.Argument(help="New digest.")],
    as_json: JsonOpt = False,
) -> None:
    """Paths added (+), removed (-) and changed (M) from A to B; exit 0 if identical, 1 if not.

    Locations are ignored, as in the dataset id. Example: digests diff old.qd new.qd
    """
    with Digest.open(a, check="rows") as da, Digest.open(b, check="rows") as db:
        result = diff_digests(da, db)
    if as_json:
        _print_json(
            {
                "identical": result.identical,
                "same_id": result.same_id,
                "a_id": result.a_id,
                "b_id": result.b_id,
                "added": result.added,
                "removed": result.removed,
                "changed": result.changed,
            }
        )
    else:
        for sign, paths in (("+", result.added), ("-", result.removed), ("M", result.changed)):
            for path in paths:
                typer.echo(f"{sign} {path}")
        if result.identical:
            typer.echo(f"identical: dataset id {result.a_id}")
    if not result.identical:
        raise typer.Exit(1)


@app.command()
def pack(
    source_url: Annotated[
        str, typer.Argument(help="The dataset: s3://, az://, gs://, file:// URL or a local path.")
    ],
    dest_url: Annotated[
        str,
        typer.Argument(help="Where the chunks go: an empty location (a file:// one is created)."),
    ],
    chunk_size: Annotated[
        int, typer.Option(help="Files per chunk (Brand's 64 by default).")
    ] = DEFAULT_CHUNK_SIZE,
    seed: Annotated[
        int | None,
        typer.Option(help="Seed of the shuffle (default: random; printed and recorded)."),
    ] = None,
    digest: Annotated[
        str | None,
        typer.Option(
            help="A digest of SOURCE_URL: its files are packed without hashing the source "
            "again (its keys are read under SOURCE_URL; every file is still verified)."
        ),
    ] = None,
    out: Annotated[
        str | None,
        typer.Option("-o", "--out", help="Packed digest to write (default: NAME.qd, NAME the "
                     "last part of DEST_URL)."),
    ] = None,
    workers: Annotated[
        int, typer.Option(help="Reads in flight, and chunks assembled or written at once.")
    ] = 16,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress output.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Shuffle SOURCE_URL's files into tar chunks under DEST_URL and write a digest of the same
    dataset (same paths and id) whose files point into the chunks; rerun to resume.

    Example: digests pack s3://b/imagenet s3://b/imagenet-packed --digest imagenet.qd -o p.qd

    Example: digests pack /data/cifar file:///scratch/cifar-packed --chunk-size 64 --seed 7
    """
    out = out or default_out(dest_url)
    try:
        result = trio.run(
            lambda: pack_digest(
                source_url,
                dest_url,
                out,
                chunk_size=chunk_size,
                seed=seed,
                digest=digest,
                workers=workers,
                progress=lambda label: make_progress(label, quiet),
            )
        )
    except KeyboardInterrupt:
        raise Interrupted(
            f"interrupted; what is done is kept ({out}.pack-partial and the chunks under "
            f"{dest_url}): rerun the same command to resume"
        ) from None
    if as_json:
        _print_json(
            {
                "out": result.out,
                "dest": result.dest,
                "dataset_id": result.dataset_id,
                "seed": result.seed,
                "chunk_size": result.chunk_size,
                "plan_id": result.plan_id,
                "chunks": result.chunks,
                "files": result.files,
                "total_bytes": result.total_bytes,
                "chunk_bytes": result.chunk_bytes,
                "written_chunks": result.written_chunks,
                "reused_chunks": result.reused_chunks,
                "written_bytes": result.written_bytes,
                "resumed": result.resumed,
                "hashed_source": result.hashed_source,
                "empty_dirs": len(result.empty_dirs),
            }
        )
        return
    typer.echo(
        f"wrote {result.out}: {result.files} files, {result.total_bytes} bytes in "
        f"{result.chunks} chunks under {result.dest}, dataset id {result.dataset_id}"
    )
    typer.echo(
        f"seed {result.seed}, chunk size {result.chunk_size}: wrote {result.written_chunks} "
        f"chunks ({result.written_bytes} bytes), {result.reused_chunks} already there"
    )


def _print_json(obj: object) -> None:
    json.dump(obj, sys.stdout, indent=2)
    sys.stdout.write("\n")


def main() -> None:
    """Console-script entry point."""
    run_app(app, "digests")


if __name__ == "__main__":  # ``python -m digests.cli`` (``python -m digests``: digests/__main__.py)
    main()
