"""``quiverfs``: the admin command line: mountd, stats, ls, evict, scrub (mount, plan and run grow here)."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import typer

from quiverfs.base.console import run_app
from quiverfs.base.errors import UsageError
from quiverfs.base.version import __version__

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


# -- mountd and its admin commands -------------------------------------------------------------
#
# Thin wrappers over mountd.rpc.client (sync) and mountd.daemon; heavy imports happen inside the
# commands so `quiverfs --help` stays fast.

#: Cache size used when --cache-size is not given: a share of the cache directory's filesystem.
DEFAULT_CACHE_SIZE = "10%"

_CACHE_DIR_HELP = ("Cache directory (default: $XDG_CACHE_HOME/quiverfs, ~/.cache/quiverfs, or "
                   "$TMPDIR/quiverfs-UID/cache for an account without a usable home).")


def _cache_dir(value: Path | None) -> Path:
    from mountd.store import layout

    return (value or layout.default_cache_dir()).expanduser().absolute()


def _print_json(value: object) -> None:
    typer.echo(json.dumps(value, indent=2, sort_keys=True))


def _rate(text: str | None, what: str) -> float | None:
    from mountd.store import layout

    if text is None:
        return None
    if "%" in text:
        raise UsageError(f"{what} cannot be a percentage: {text!r}")
    return float(layout.parse_size(text))


def _load_config(ctx: typer.Context, param: typer.CallbackParam, value: Path | None) -> Path | None:
    """Read ``--config FILE`` (TOML, before every other option: it is eager) into the
    defaults of mountd's options, so the command line still overrides the file.

    Keys are the long option names (``cache-size = "500G"``, ``cluster = "redis://..."``);
    a key no option has or a file that is not TOML is one line and exit status 2; a value
    the option refuses is reported like the same value on the command line."""
    if value is None:
        return None
    try:
        with open(value, "rb") as file:
            table = tomllib.load(file)
    except OSError as exc:
        raise UsageError(f"--config {value}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise UsageError(f"--config {value} is not TOML: {exc}") from None
    by_key = {opt.lstrip("-"): p for p in ctx.command.params if p is not param
              for opt in p.opts if opt.startswith("--")}
    defaults = {}
    for key, setting in table.items():
        option = by_key.get(key.replace("_", "-"))
        if option is None:
            raise UsageError(f"--config {value}: no option --{key} "
                             f"(keys are mountd's long options, e.g. cache-size)")
        if isinstance(setting, dict | list):
            raise UsageError(f"--config {value}: {key} must be a string, number or boolean")
        defaults[option.name] = setting  # converted, and refused, like the option's own value
    ctx.default_map = {**(ctx.default_map or {}), **defaults}
    return value


@app.command("mountd")
def mountd_command(
    config_file: Path | None = typer.Option(
        None, "--config", metavar="FILE", is_eager=True, callback=_load_config,
        help="Read options from this TOML file (keys: the long option names, e.g. cache-size = \"500G\", cluster = \"redis://...\"); options given on the command line win.",
    ),
    cache_dir: Path | None = typer.Option(None, "--cache-dir", help=_CACHE_DIR_HELP, readable=False),
    cache_size: str = typer.Option(
        DEFAULT_CACHE_SIZE, "--cache-size",
        help="Cap on cached bytes: 10G, 512M, or a percentage of the cache filesystem (20%).",
    ),
    remote_bandwidth: str | None = typer.Option(
        None, "--remote-bandwidth", help="Cap on remote bytes/s across all fills, e.g. 50M."
    ),
    remote_requests: float | None = typer.Option(
        None, "--remote-requests", help="Cap on remote requests/s across all fills.", min=0.001
    ),
    remote_concurrency: int = typer.Option(
        64, "--remote-concurrency", help="Remote reads in flight at once.", min=1
    ),
    fill_processes: int | None = typer.Option(
        None, "--fill-processes", metavar="N", min=0, max=1024,
        help="Processes that fetch, verify and store fills, so cold reads use every core (default: one per core); 0 runs fills in mountd's own threads.",
    ),
    remote_latency_ms: float = typer.Option(
        0.0, "--remote-latency-ms", metavar="MS", min=0, max=60_000,
        help="Delay each remote request's first byte by MS milliseconds (concurrent requests wait side by side): a cloud bucket's latency for benchmarks against a local emulator. Default 0: none.",
    ),
    max_span: str = typer.Option(
        "4M", "--max-span", metavar="SIZE",
        help="Most bytes one ranged GET may span to fetch several files of a packed object at once (chunk fills); 0 fetches each file on its own.",
    ),
    metrics_port: int | None = typer.Option(
        None, "--metrics-port",
        help="Serve Prometheus metrics on http://127.0.0.1:PORT/metrics (0: any free port).",
        min=0, max=65535,
    ),
    dataset_mode: str | None = typer.Option(
        None, "--dataset-mode",
        help="Force every dataset's residency: full, chunked, off or lru (default: chosen from the cache size).",
    ),
    chunk_slots: int = typer.Option(
        2, "--chunk-slots", min=2, max=3,
        help="Chunks of a chunked dataset held at once: 2 (double buffering) or 3 (preload the next while one drains).",
    ),
    chunk_grace: float | None = typer.Option(
        None, "--chunk-grace", metavar="SECONDS",
        help="Most seconds a finished chunk stays cached after the last job was given all of it, so that it can still read those files; it goes sooner once each such job has claimed a window more (default: 1).",
    ),
    sync_interval: float = typer.Option(
        1.0, "--sync-interval", metavar="SECONDS",
        help="Seconds between durable checkpoints (one syncfs of the cache's filesystem) while fills land; after a power cut, at most this much of the newest fills is re-verified.",
    ),
    socket_mode: str | None = typer.Option(
        None, "--socket-mode", metavar="OCTAL",
        help="Mode of the socket DIR/mountd.sock: 0600 (default: mountd's user and root only), 0660 (its group too), 0666 (every local user).",
    ),
    socket_group: str | None = typer.Option(
        None, "--socket-group", metavar="GROUP",
        help="Let the members of GROUP connect: the socket belongs to GROUP, mode 0660 (unless --socket-mode says otherwise).",
    ),
    shared: bool = typer.Option(
        False, "--shared", help="Let every local user connect (socket mode 0666).",
    ),
    private_store: bool = typer.Option(
        False, "--private-store",
        help="Keep the store private to mountd's user (folders 0700, files 0400) instead of traversable by every local user who knows a hash (0711, 0444).",
    ),
    protect_seconds: float = typer.Option(
        30.0, "--protect-seconds", metavar="SECONDS", min=0, max=3600,
        help="Seconds a file fetched ahead for a job (a claim's misses, packed members brought with them, a prefetch) is kept from eviction when nobody reads it; reading it, or its job's epoch ending, ends the protection sooner. 0 turns protection off.",
    ),
    protect_share: float = typer.Option(
        0.5, "--protect-share", metavar="SHARE", min=0.01, max=1.0,
        help="Share of the cache that files fetched ahead may keep protected (0.5), counted in the room pinned chunks leave; past it new prefetches wait until reads free room. A mount's sweep of a dataset larger than the cache may reach 0.8, or this share if larger.",
    ),
    user_quota: str | None = typer.Option(
        None, "--user-quota", metavar="SIZE",
        help="Cap on the cached bytes charged to each local user (the user whose request filled them): 2G, 512M, or a percentage of the cache size (25%). A fill past it evicts that user's own least recently used files first. Default: no quota.",
    ),
    cluster: str | None = typer.Option(
        None, "--cluster", metavar="URL",
        help="Join the cluster coordinated by this Redis/Valkey (redis://HOST:PORT/DB): misses ask the peers before the bucket (docs/cluster.md). Needs --advertise and --cluster-secret-file.",
    ),
    advertise: str | None = typer.Option(
        None, "--advertise", metavar="HOST:PORT",
        help="Where peers reach this node's peer server (it listens there); also its node id.",
    ),
    cluster_secret_file: Path | None = typer.Option(
        None, "--cluster-secret-file", metavar="PATH",
        help="File holding the secret every node of the cluster shares (at least 16 bytes, mode 0600).",
    ),
    cluster_name: str = typer.Option(
        "default", "--cluster-name", metavar="NAME",
        help="Name of the cluster, so several can share one Redis (keys quiverfs:NAME:...).",
    ),
    cluster_tls_cert: Path | None = typer.Option(
        None, "--cluster-tls-cert", metavar="PEM",
        help="This node's certificate for TLS between peers (signed by --cluster-tls-ca; names the advertised host). With --cluster-tls-key and --cluster-tls-ca; default: plain TCP.",
    ),
    cluster_tls_key: Path | None = typer.Option(
        None, "--cluster-tls-key", metavar="PEM", help="The private key of --cluster-tls-cert.",
    ),
    cluster_tls_ca: Path | None = typer.Option(
        None, "--cluster-tls-ca", metavar="PEM",
        help="The cluster CA's certificate: peers' certificates must be signed by it.",
    ),
) -> None:
    """Run mountd, the machine's cache server, in the foreground (for systemd, containers).

    It serves the control socket DIR/mountd.sock (mode 0600 unless --socket-group or --shared) until SIGTERM or SIGINT. Store files are readable by every local user who knows their hash, folders are not listable (--private-store: mountd's user only). Exit status 75 means another mountd already owns the cache directory.

    Example: quiverfs mountd --cache-dir /var/cache/quiverfs --cache-size 200G --socket-group quiverfs --user-quota 50G

    Or: quiverfs mountd --config /etc/quiverfs/mountd.toml (docs/operations.md "Configuration file")
    """
    from mountd.daemon import DaemonConfig, SocketAccess, main
    from mountd.store import layout
    from mountd.store.cache import CacheConfig

    directory = _cache_dir(cache_dir)
    cap = layout.parse_size(cache_size, directory)
    config = CacheConfig(
        cache_dir=directory,
        cache_size=cap,
        remote_bandwidth=_rate(remote_bandwidth, "--remote-bandwidth"),
        remote_requests=remote_requests,
        remote_concurrency=remote_concurrency,
        remote_latency=remote_latency_ms / 1000,
        span_max_bytes=layout.parse_size(max_span) if max_span.strip() != "0" else 0,
        sync_interval=sync_interval,
        private_store=private_store,
        user_quota=None if user_quota is None else layout.parse_size(user_quota, whole=cap),
        protect_seconds=protect_seconds,
        protect_share=protect_share,
    )
    socket = SocketAccess.from_options(socket_mode, socket_group, shared)
    if dataset_mode is not None and dataset_mode not in ("full", "chunked", "off", "lru"):
        raise UsageError(f"--dataset-mode must be full, chunked, off or lru, not {dataset_mode!r}")
    from mountd.coop.chunks import DEFAULT_GRACE

    grace = DEFAULT_GRACE if chunk_grace is None else chunk_grace
    if not 0 <= grace <= 3600:  # also refuses NaN and inf
        raise UsageError(f"--chunk-grace must be between 0 and 3600 seconds, not {chunk_grace}")
    from mountd.cluster.config import cluster_from_options
    from mountd.cluster.tls import tls_from_options

    tls = tls_from_options(cluster_tls_cert, cluster_tls_key, cluster_tls_ca)
    peers = cluster_from_options(cluster, advertise, cluster_secret_file, cluster_name, tls)
    main(DaemonConfig(cache=config, metrics_port=metrics_port, dataset_mode=dataset_mode,
                      chunk_slots=chunk_slots, chunk_grace=grace, socket=socket, cluster=peers,
                      fill_processes=fill_processes))


@app.command()
def stats(
    cache_dir: Path | None = typer.Option(None, "--cache-dir", help=_CACHE_DIR_HELP, readable=False),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of tables."),
    in_region: bool = typer.Option(
        False, "--in-region",
        help="Price no egress (this machine is in the buckets' region, where egress is free).",
    ),
) -> None:
    """Show mountd's counters, hit ratio, the files fetched ahead (read, unread, dropped unread) and what the cache saved in requests, bytes and money, each remote source's requests, retries and failures, and what each local user asked of it.

    Costs follow DELI's model (requests x price + bytes x egress) with the list prices in mountd/stats/costs.py (docs/operations.md names the date and sources).

    Example: quiverfs stats --cache-dir /var/cache/quiverfs --json
    """
    from mountd.rpc.client import SyncClient
    from mountd.stats.costs import stats_report
    from quiverfs.cli.mount_cli import mount_stats

    with SyncClient.connect(_cache_dir(cache_dir)) as client:
        raw = client.stats()
        report = stats_report(raw, in_region=in_region)
        report["users"] = raw.get("users", {})
        if "cluster" in raw:  # docs/cluster.md
            report["cluster"] = raw["cluster"]
        report["allocation"] = raw.get("allocation")  # absent from an older mountd
        report["sources"] = raw.get("sources", {})  # absent from an older mountd
        report["fill_stages"] = (raw.get("counters") or {}).get("fill_stages")
        listing = client.ls()
        mounts = listing["mounts"]
        # Files fetched ahead, read and dropped unread (mountd/store/holds.py): the cache's usage.
        report["protection"] = (listing.get("usage") or {}).get("protection")
    # Each mount's own figures (opens, reads, hits, misses) come from its user.quiver.stats.
    report["mounts"] = mount_stats(mounts)
    if as_json:
        _print_json(report)
    else:
        from quiverfs.cli.mountd_views import (
            print_allocation,
            print_cluster,
            print_fetched_ahead,
            print_fill_stages,
            print_mounts,
            print_sources,
            print_stats,
            print_users,
        )

        print_stats(report)
        if report["protection"]:
            print_fetched_ahead(report["protection"])
        if report["fill_stages"] and report["fill_stages"].get("jobs"):
            print_fill_stages(report["fill_stages"])
        if report["sources"]:
            print_sources(report["sources"])
        if report["allocation"] and report["allocation"].get("datasets"):
            print_allocation(report["allocation"])
        if "cluster" in report:
            print_cluster(report["cluster"])
        if report["users"]:
            print_users(report["users"])
        if report["mounts"]:
            print_mounts(report["mounts"])


@app.command("ls")
def ls_command(
    cache_dir: Path | None = typer.Option(None, "--cache-dir", help=_CACHE_DIR_HELP, readable=False),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of tables."),
) -> None:
    """List cached datasets, registered mounts and cache usage.

    Example: quiverfs ls --json
    """
    from mountd.rpc.client import SyncClient

    with SyncClient.connect(_cache_dir(cache_dir)) as client:
        listing = client.ls()
    if as_json:
        _print_json(listing)
    else:
        from quiverfs.cli.mountd_views import print_ls

        print_ls(listing)


@app.command()
def evict(
    dataset: str | None = typer.Argument(None, help="Dataset id whose cached files to remove."),
    everything: bool = typer.Option(False, "--all", help="Remove every cached file."),
    cache_dir: Path | None = typer.Option(None, "--cache-dir", help=_CACHE_DIR_HELP, readable=False),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Evict one dataset's files (or --all) from the cache. Needs root or mountd's user.

    Example: quiverfs evict 3f9a0c...e1   |   quiverfs evict --all
    """
    from mountd.rpc.client import SyncClient

    if everything == (dataset is not None):
        raise UsageError("give a DATASET or --all (not both)")
    with SyncClient.connect(_cache_dir(cache_dir)) as client:
        result = client.evict(dataset, all=everything)
    if as_json:
        _print_json(result)
    else:
        from quiverfs.cli.mountd_views import human_bytes

        typer.echo(f"evicted {result['files']} files ({human_bytes(result['bytes'])})")


@app.command()
def scrub(
    cache_dir: Path | None = typer.Option(None, "--cache-dir", help=_CACHE_DIR_HELP, readable=False),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON."),
) -> int:
    """Re-hash every cached file and remove those that no longer match. Needs root or mountd's user.

    Exit status 1 when bad or missing files were found (they are removed: the next read fetches them again).

    Example: quiverfs scrub --cache-dir /var/cache/quiverfs
    """
    from mountd.rpc.client import SyncClient
    from quiverfs.cli.mountd_views import print_scrub, scrub_progress

    with SyncClient.connect(_cache_dir(cache_dir)) as client:
        if as_json:
            report = client.scrub()
        else:
            with scrub_progress() as update:
                report = client.scrub(progress=update)
    if as_json:
        _print_json(report)
    else:
        print_scrub(report)
    return 1 if isinstance(report, dict) and (report.get("bad") or report.get("missing")) else 0


# mount, umount, mounts (quiverfs/cli/mount_cli.py)
from quiverfs.cli import mount_cli  # noqa: E402

mount_cli.register(app)

# plan stagger, run (quiverfs/cli/plan_cli.py)
from quiverfs.cli import plan_cli  # noqa: E402

plan_cli.register(app)

def main() -> None:
    """Console-script entry point."""
    run_app(app, "quiverfs")


if __name__ == "__main__":  # python -m quiverfs.cli.main (-m quiverfs.cli: cli/__main__.py)
    main()
