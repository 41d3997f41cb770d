"""TLS between peers (``--cluster-tls-cert/-key/-ca``): the transfers encrypted, and both
ends proved members by certificates a cluster CA signed.

The cluster secret's handshake still runs inside TLS (docs/cluster.md "Peer protocol"): TLS
keeps the bytes private on a network others can watch, the secret and the blake3 check keep
doing what they did without it. Both sides present a certificate (mutual TLS) and check the
other's against the CA; a client also checks that the server's certificate names the host
it dialled (the peer's advertised host: an IP address needs an IP subject-alternative name).
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path

from quiverfs.base.errors import UsageError


@dataclass(frozen=True)
class PeerTLS:
    """Where this node's certificate, its key and the cluster CA's certificate are (PEM)."""

    cert: Path
    key: Path
    ca: Path

    def server_context(self) -> ssl.SSLContext:
        """What the peer server wraps accepted connections in: this node's certificate,
        and a client certificate the CA signed required."""
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(self.ca))
        context.load_cert_chain(str(self.cert), str(self.key))
        context.verify_mode = ssl.CERT_REQUIRED
        return context

    def client_context(self) -> ssl.SSLContext:
        """What the peer client wraps its connections in: the server's certificate checked
        against the CA and the dialled host, this node's certificate presented."""
        context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(self.ca))
        context.load_cert_chain(str(self.cert), str(self.key))
        return context


def tls_from_options(cert: Path | None, key: Path | None, ca: Path | None) -> PeerTLS | None:
    """The :class:`PeerTLS` of the three options (None when none is given), checked by
    building both contexts now: a missing file, a key that does not match the certificate
    or a PEM that does not parse is one line at start-up, not a failure at the first
    transfer."""
    given = [value is not None for value in (cert, key, ca)]
    if not any(given):
        return None
    if not all(given):
        raise UsageError("peer TLS needs all three of --cluster-tls-cert, --cluster-tls-key "
                         "and --cluster-tls-ca")
    assert cert is not None and key is not None and ca is not None
    tls = PeerTLS(Path(cert), Path(key), Path(ca))
    try:
        tls.server_context()
        tls.client_context()
    except FileNotFoundError as exc:
        raise UsageError(f"peer TLS: {exc.filename}: {exc.strerror}") from None
    except (ssl.SSLError, OSError) as exc:
        raise UsageError(f"peer TLS: cannot use {cert}, {key} and {ca}: "
                         f"{getattr(exc, 'reason', None) or exc}") from None
    return tls
