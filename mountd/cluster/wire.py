"""The peer protocol's bytes: the cluster-secret handshake and the request/answer frames.

Over one TCP connection (trio stream; with peer TLS, inside the TLS session:
:mod:`mountd.cluster.tls`), all integers big-endian:

Handshake (HMAC-SHA256 challenge-response; the secret never crosses the wire, and a
recorded exchange cannot be replayed because both sides add a fresh nonce)::

    server → client   b"QVP1" ‖ server_nonce[32]
    client → server   client_nonce[32] ‖ HMAC(secret, b"client" ‖ server_nonce ‖ client_nonce)
    server → client   0x00 ‖ HMAC(secret, b"server" ‖ server_nonce ‖ client_nonce)   accepted
                      0x01, then close                                                refused

Then any number of requests, one at a time::

    GET   b"G" ‖ hash[32]                 → 0x00 ‖ size[8] ‖ bytes[size]   (have it)
                                          → 0x01                           (not here)
    PUT   b"P" ‖ hash[32] ‖ size[8] ‖ bytes[size]
                                          → 0x00 stored (or already held)  | 0x01 refused
    HAS   b"H" ‖ count[4] ‖ hash[32] × count   (count ≤ MAX_HAS)
                                          → 0x00 ‖ bitmap[(count + 7) // 8]
                                            (bit i, LSB first: the i-th hash is stored here)

The receiver of content checks its blake3 against the hash before using or storing it (no
peer is trusted with content; the secret only keeps strangers from using a node's disk and
bandwidth). Sizes above the receiver's limit end the connection. Content of any size travels
in one frame; the ends stream large ones (:mod:`mountd.cluster.peer`).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct

import trio

from mountd.errors import PeerError

MAGIC = b"QVP1"
NONCE = 32
MAC = 32
HASH = 32
OP_GET = b"G"
OP_PUT = b"P"
OP_HAS = b"H"
COUNT = struct.Struct(">I")
#: Most hashes one HAS asks about (32 bytes each: 128 KiB).
MAX_HAS = 4096
OK = b"\x00"
NO = b"\x01"
SIZE = struct.Struct(">Q")
#: Bytes read per receive while taking in content.
RECEIVE_STEP = 1 << 20


def mac(secret: bytes, side: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    """The handshake MAC of ``side`` (``b"client"`` or ``b"server"``)."""
    return hmac.new(secret, side + server_nonce + client_nonce, hashlib.sha256).digest()


async def receive_exactly(stream: trio.abc.ReceiveStream, n: int) -> bytes:
    """Exactly ``n`` bytes; :class:`PeerError` if the stream ends first."""
    parts = bytearray()
    while len(parts) < n:
        data = await stream.receive_some(min(RECEIVE_STEP, n - len(parts)))
        if not data:
            raise PeerError(f"peer closed the connection after {len(parts)} of {n} bytes")
        parts += data
    return bytes(parts)


async def server_handshake(stream: trio.abc.Stream, secret: bytes) -> bool:
    """The server's side: True when the client proved it knows ``secret``; False (after
    telling it so) otherwise. Raises :class:`PeerError` when the client breaks off."""
    server_nonce = os.urandom(NONCE)
    await stream.send_all(MAGIC + server_nonce)
    answer = await receive_exactly(stream, NONCE + MAC)
    client_nonce, proof = answer[:NONCE], answer[NONCE:]
    if not hmac.compare_digest(proof, mac(secret, b"client", server_nonce, client_nonce)):
        await stream.send_all(NO)
        return False
    await stream.send_all(OK + mac(secret, b"server", server_nonce, client_nonce))
    return True


async def client_handshake(stream: trio.abc.Stream, secret: bytes) -> None:
    """The client's side; :class:`PeerError` when the server refuses us, does not speak the
    protocol, or cannot prove it knows ``secret`` itself."""
    hello = await receive_exactly(stream, len(MAGIC) + NONCE)
    if hello[: len(MAGIC)] != MAGIC:
        raise PeerError("not a quiverfs peer (wrong greeting)")
    server_nonce = hello[len(MAGIC):]
    client_nonce = os.urandom(NONCE)
    await stream.send_all(client_nonce + mac(secret, b"client", server_nonce, client_nonce))
    if await receive_exactly(stream, 1) != OK:
        raise PeerError("peer refused the cluster secret (is --cluster-secret-file the same "
                        "on every node?)")
    proof = await receive_exactly(stream, MAC)
    if not hmac.compare_digest(proof, mac(secret, b"server", server_nonce, client_nonce)):
        raise PeerError("peer does not know the cluster secret")
