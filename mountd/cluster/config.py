"""The cluster's typed configuration, validated in one place (``quiverfs mountd --cluster``)."""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from mountd.cluster.tls import PeerTLS
from quiverfs.base.errors import UsageError

#: Shortest cluster secret accepted, in bytes (HMAC-SHA256 keys shorter than this are guessable).
MIN_SECRET = 16

_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


@dataclass(frozen=True)
class ClusterConfig:
    """How this mountd joins a cluster: where Redis is, what it advertises, the shared secret.

    ``secret`` is the content of ``--cluster-secret-file`` and is never printed (its
    ``repr`` hides it)."""

    #: ``redis://HOST:PORT/DB`` (or ``rediss://`` for TLS to Redis, ``unix://`` for a socket).
    redis_url: str
    #: ``HOST:PORT`` the peers reach this node's peer server at; also its node id.
    advertise: str
    #: Shared key for the peers' HMAC challenge-response.
    secret: bytes
    #: Key prefix in Redis (``quiverfs:<name>:…``): several clusters may share one Redis.
    name: str = "default"
    #: Seconds between heartbeats (and membership refreshes).
    heartbeat: float = 1.0
    #: Seconds a heartbeat key lives: a node silent this long has left.
    node_ttl: float = 5.0
    #: Milliseconds a cluster-wide fill lock lives if its holder never releases it (it died).
    lock_ttl_ms: int = 60_000
    #: Seconds a peer has for a whole transfer (connect, handshake, answer) before the next
    #: source is tried.
    peer_timeout: float = 10.0
    #: Largest file fetched from (or pushed to) a peer, in bytes; larger ones go to the
    #: bucket. Transfers stream (mountd/cluster/peer.py): no memory limit asks for a cap.
    peer_max_bytes: int = 1 << 40
    #: Address the peer server listens on (default: the advertised host).
    listen_host: str | None = None
    #: TLS between peers (:mod:`mountd.cluster.tls`); None: plain TCP.
    tls: PeerTLS | None = None

    def __repr__(self) -> str:  # never print the secret
        return (f"ClusterConfig(redis_url={self.redis_url!r}, advertise={self.advertise!r}, "
                f"name={self.name!r}, secret=<{len(self.secret)} bytes>, tls={self.tls is not None})")

    def __post_init__(self) -> None:
        scheme = urlsplit(self.redis_url).scheme
        if scheme not in ("redis", "rediss", "unix"):
            raise UsageError(f"--cluster must be a redis://HOST:PORT/DB URL, not {self.redis_url!r}")
        split_address(self.advertise, "--advertise")
        if not _NAME.match(self.name):
            raise UsageError(f"--cluster-name must be 1-64 letters, digits, '.', '_' or '-', "
                             f"not {self.name!r}")
        if len(self.secret) < MIN_SECRET:
            raise UsageError(f"the cluster secret must be at least {MIN_SECRET} bytes "
                             f"(got {len(self.secret)}); e.g. head -c 32 /dev/urandom | base64")
        if not 0 < self.heartbeat < self.node_ttl:
            raise UsageError("the heartbeat interval must be positive and shorter than the node TTL")
        if self.lock_ttl_ms < 100 or self.peer_timeout <= 0 or self.peer_max_bytes < 0:
            raise UsageError("lock TTL must be >= 100 ms, peer timeout > 0, peer max bytes >= 0")

    @property
    def host(self) -> str:
        """The advertised host."""
        return split_address(self.advertise, "--advertise")[0]

    @property
    def port(self) -> int:
        """The advertised port (the peer server's)."""
        return split_address(self.advertise, "--advertise")[1]


def split_address(text: str, what: str) -> tuple[str, int]:
    """``("10.0.0.5", 7070)`` from ``"10.0.0.5:7070"`` (``[::1]:7070`` for IPv6);
    :class:`UsageError` otherwise."""
    host, sep, port = text.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise UsageError(f"{what} must be HOST:PORT with a port in 1-65535, not {text!r}")
    return host, int(port)


def read_secret(path: Path) -> bytes:
    """The cluster secret from ``path`` (surrounding whitespace stripped). Refused, with one
    line, when the file is missing or readable by anyone but its owner (a secret every local
    user can read lets them impersonate a peer)."""
    try:
        info = os.stat(path)
        data = Path(path).read_bytes().strip()
    except OSError as exc:
        raise UsageError(f"--cluster-secret-file {path}: {exc.strerror}") from None
    if info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise UsageError(f"--cluster-secret-file {path} is readable by others "
                         f"(mode {stat.S_IMODE(info.st_mode):04o}); chmod 600 it")
    return data


def cluster_from_options(url: str | None, advertise: str | None, secret_file: Path | None,
                         name: str = "default", tls: PeerTLS | None = None) -> ClusterConfig | None:
    """The :class:`ClusterConfig` of ``--cluster``, ``--advertise``, ``--cluster-secret-file``,
    ``--cluster-name`` and the peer TLS options (None without ``--cluster``); one-line
    :class:`UsageError` for a missing or bad one."""
    if url is None:
        if advertise is not None or secret_file is not None or tls is not None:
            raise UsageError("--advertise, --cluster-secret-file and --cluster-tls-* need "
                             "--cluster redis://HOST:PORT/DB")
        return None
    if advertise is None or secret_file is None:
        raise UsageError("--cluster needs --advertise HOST:PORT (where peers reach this node) "
                         "and --cluster-secret-file PATH (the secret every node shares)")
    return ClusterConfig(redis_url=url, advertise=advertise, secret=read_secret(secret_file),
                         name=name, tls=tls)
