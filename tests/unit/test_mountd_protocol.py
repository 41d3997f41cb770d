"""The mountd protocol: framing, request checks, error transport, and the server's handling of
ids, pipelining and malformed input (in process, over a real socketpair, with a fake cache)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import trio

from mountd.errors import CacheFull, MountdInternalError, ProtocolError
from mountd.rpc import protocol
from mountd.rpc.protocol import (
    MAX_FRAME,
    FrameDecoder,
    decode_body,
    encode_frame,
    exception_from_payload,
    parse_request,
)
from mountd.rpc.server import Server
from mountd.stats.counters import Counters
from mountd.store.config import CacheConfig
from quiverfs.base.errors import BackendError, CorruptObject, NotFound, QuiverError

HASH = bytes(range(32))
LOC = {"url": "file:///data", "key": "a/b.jpg", "offset": 0, "length": 10}

# -- framing ------------------------------------------------------------------------------------


def test_frame_roundtrip_byte_by_byte():
    messages = [{"id": 1, "op": "hello", "args": {"version": 1}}, {"id": "x", "é": "ü" * 70000}]
    stream = b"".join(encode_frame(m) for m in messages)
    decoder = FrameDecoder()
    bodies = []
    for i in range(len(stream)):
        bodies.extend(decoder.feed(stream[i : i + 1]))
    assert [decode_body(b) for b in bodies] == messages
    assert decoder.pending == 0


def test_frames_sharing_one_read():
    stream = encode_frame({"a": 1}) + encode_frame({"b": 2}) + encode_frame({"c": 3})[:5]
    decoder = FrameDecoder()
    assert [decode_body(b) for b in decoder.feed(stream)] == [{"a": 1}, {"b": 2}]
    assert decoder.pending == 5


def test_header_is_big_endian_length():
    frame = encode_frame({"k": "v"})
    (length,) = struct.unpack(">I", frame[:4])
    assert length == len(frame) - 4 and json.loads(frame[4:]) == {"k": "v"}


def test_oversized_frame_refused_both_ways():
    with pytest.raises(ProtocolError, match="exceeds"):
        FrameDecoder().feed(struct.pack(">I", MAX_FRAME + 1))
    with pytest.raises(ProtocolError, match="exceeds"):
        encode_frame({"x": "a" * (MAX_FRAME + 1)})


@pytest.mark.parametrize("body", [b"\xff\xfe", b"{not json", b"[1, 2]", b'"text"', b"null"])
def test_body_must_be_a_json_object(body):
    with pytest.raises(ProtocolError):
        decode_body(body)


# -- requests -----------------------------------------------------------------------------------


def test_parse_request_and_notification():
    request = parse_request({"id": 7, "op": "ensure", "args": {"size": 1}})
    assert (request.id, request.op, request.args, request.wants_response) == (
        7,
        "ensure",
        {"size": 1},
        True,
    )
    note = parse_request({"op": "hits"})
    assert note.id is None and not note.wants_response and note.args == {}


@pytest.mark.parametrize(
    "message, match",
    [
        ({"id": 1}, "needs an 'op'"),
        ({"id": 1, "op": "format_disk"}, "unknown op"),
        ({"id": True, "op": "hello"}, "request id"),
        ({"id": 1.5, "op": "hello"}, "request id"),
        ({"id": [1], "op": "hello"}, "request id"),
        ({"id": "x" * 200, "op": "hello"}, "request id"),
        ({"id": 1, "op": "hello", "args": [1]}, "must be an object"),
        ({"id": 1, "op": "hello", "extra": 1}, "unknown request fields"),
    ],
)
def test_malformed_requests(message, match):
    with pytest.raises(ProtocolError, match=match):
        parse_request(message)


def test_request_id_of_keeps_valid_ids_only():
    assert protocol.request_id_of({"id": 3}) == 3
    assert protocol.request_id_of({"id": "abc"}) == "abc"
    assert protocol.request_id_of({"id": False}) is None
    assert protocol.request_id_of({}) is None


def test_check_item_accepts_a_good_item():
    digest, size, where = protocol.check_item({"hash": HASH.hex(), "size": 10, "location": LOC})
    assert digest == HASH and size == 10 and where == LOC


@pytest.mark.parametrize(
    "item, match",
    [
        ({"hash": "ab", "size": 1, "location": LOC}, "hex digits"),
        ({"hash": "zz" * 32, "size": 1, "location": LOC}, "hex digits"),
        ({"hash": HASH.hex(), "size": -1, "location": LOC}, "at least 0"),
        ({"hash": HASH.hex(), "size": True, "location": LOC}, "integer"),
        ({"hash": HASH.hex(), "size": 1, "location": "s3://x"}, "must be an object"),
        ({"hash": HASH.hex(), "size": 1, "location": {**LOC, "evil": 1}}, "unknown location"),
        ({"hash": HASH.hex(), "size": 1, "location": {**LOC, "url": ""}}, "must not be empty"),
        ({"hash": HASH.hex(), "size": 1, "location": {**LOC, "key": "a\x00"}}, "NUL"),
        ({"hash": HASH.hex(), "size": 1, "location": {**LOC, "offset": "0"}}, "integer"),
        ([1, 2], "must be an object"),
    ],
)
def test_check_item_rejects(item, match):
    with pytest.raises(ProtocolError, match=match):
        protocol.check_item(item)


# -- errors -------------------------------------------------------------------------------------


def test_backend_error_roundtrip_keeps_class_message_and_where():
    original = NotFound("no such object", url="s3://bucket/prefix", key="a/b.jpg")
    rebuilt = exception_from_payload(json.loads(json.dumps(protocol.error_payload(original))))
    assert type(rebuilt) is NotFound
    assert str(rebuilt) == str(original) == "no such object: s3://bucket/prefix/a/b.jpg"
    assert (rebuilt.url, rebuilt.key, rebuilt.exit_code) == ("s3://bucket/prefix", "a/b.jpg", 3)


def test_cache_error_roundtrip():
    rebuilt = exception_from_payload(
        protocol.error_payload(CacheFull("object larger than the cache"))
    )
    assert type(rebuilt) is CacheFull and str(rebuilt) == "object larger than the cache"


def test_unknown_class_falls_back_to_nearest_known_base():
    payload = {
        "type": "ShinyNewError",
        "bases": ["CorruptObject", "BackendError", "QuiverError"],
        "message": "m",
        "url": "u",
        "key": "k",
    }
    rebuilt = exception_from_payload(payload)
    assert (
        type(rebuilt) is CorruptObject and isinstance(rebuilt, BackendError) and str(rebuilt) == "m"
    )
    assert type(exception_from_payload({"type": "Nope", "message": "x"})) is QuiverError


def test_foreign_exceptions_become_internal_errors():
    payload = protocol.error_payload(KeyError("boom"))
    assert payload["type"] == "MountdInternalError" and "KeyError" in payload["message"]
    assert exception_from_payload(payload).exit_code == 70
    assert isinstance(exception_from_payload(payload), MountdInternalError)


# -- the server, in process, over a socketpair ---------------------------------------------------


class FakeCache:
    """Just enough of mountd.store.cache.Cache: ensure() waits until the test opens its gate."""

    def __init__(self):
        self.config = CacheConfig(cache_dir=Path("/nonexistent/cache"), cache_size=1 << 30)
        self.capacity = self.config.cache_size  # what hello reports as the store's room
        self.counters = Counters()  # the server times the requests of fills there
        self.gates: dict[bytes, trio.Event] = {}
        self.hits: list = []

    async def ensure(self, hash, size, location, dataset=None, *, uid=None):
        if hash == b"\x00" * 32:
            raise NotFound("gone", url=location.url, key=location.key)
        if hash == b"\x01" * 32:
            raise RuntimeError("bug in the cache")
        await self.gates.setdefault(hash, trio.Event()).wait()
        return f"/store/{hash.hex()}"

    def record_hits(self, dataset, hashes, nbytes):
        self.hits.append((dataset, list(hashes), nbytes))

    def release(self, holder, hashes=None):
        return 0

    def add_listener(self, listener):
        pass  # nothing is ever filled or evicted here


class Wire:
    """The test's end of a socketpair: send frames or raw bytes, read messages."""

    def __init__(self, stream):
        self.stream = stream
        self.reader = protocol.ExactReader(stream)

    async def send(self, message):
        await self.stream.send_all(encode_frame(message))

    async def receive(self):
        with trio.fail_after(5):
            return await self.reader.read_frame()


@pytest.fixture
async def wire(nursery):
    cache = FakeCache()
    server = Server(cache, "/tmp/unused")
    left, right = trio.socket.socketpair()
    nursery.start_soon(server.handle_connection, trio.SocketStream(right))
    stream = trio.SocketStream(left)
    w = Wire(stream)
    w.cache, w.server = cache, server
    yield w
    await stream.aclose()


def ensure_msg(rid, hash):
    return {"id": rid, "op": "ensure", "args": {"hash": hash.hex(), "size": 10, "location": LOC}}


async def test_pipelined_requests_answer_out_of_order_by_id(wire):
    first, second = b"\x0a" * 32, b"\x0b" * 32
    await wire.send(ensure_msg(1, first))
    await wire.send(ensure_msg("two", second))
    await wire.send({"id": 3, "op": "hello", "args": {"version": 1}})
    answer = await wire.receive()
    assert answer["id"] == 3 and answer["ok"] and answer["result"]["version"] == 1
    wire.cache.gates.setdefault(second, trio.Event()).set()
    assert await wire.receive() == {
        "id": "two",
        "ok": True,
        "result": {"path": f"/store/{second.hex()}"},
    }
    wire.cache.gates.setdefault(first, trio.Event()).set()
    assert await wire.receive() == {
        "id": 1,
        "ok": True,
        "result": {"path": f"/store/{first.hex()}"},
    }


async def test_malformed_frames_get_errors_and_the_connection_lives(wire):
    await wire.stream.send_all(struct.pack(">I", 9) + b"{not json")
    answer = await wire.receive()
    assert answer["id"] is None and not answer["ok"] and answer["error"]["type"] == "ProtocolError"
    await wire.send({"id": 5, "op": "nope"})
    answer = await wire.receive()
    assert answer["id"] == 5 and answer["error"]["type"] == "ProtocolError"
    assert "unknown op" in answer["error"]["message"]
    await wire.send({"id": 6, "op": "ensure", "args": {"hash": "xyz", "size": 1, "location": LOC}})
    answer = await wire.receive()
    assert answer["id"] == 6 and "hex digits" in answer["error"]["message"]
    await wire.send({"id": 7, "op": "hello", "args": {"version": 99}})
    assert "protocol 99" in (await wire.receive())["error"]["message"]
    await wire.send({"id": 8, "op": "hello", "args": {"version": 1}})
    assert (await wire.receive())["ok"] is True
    assert wire.server.protocol_errors == 4


async def test_cache_errors_travel_and_bugs_are_internal_errors(wire):
    await wire.send(ensure_msg(1, b"\x00" * 32))
    answer = await wire.receive()
    assert answer["error"]["type"] == "NotFound" and answer["error"]["key"] == "a/b.jpg"
    await wire.send(ensure_msg(2, b"\x01" * 32))
    answer = await wire.receive()
    assert (
        answer["error"]["type"] == "MountdInternalError"
        and "bug in the cache" in answer["error"]["message"]
    )


async def test_notifications_get_no_answer(wire):
    await wire.send({"op": "hits", "args": {"dataset": "d", "hashes": [HASH.hex()], "bytes": 10}})
    await wire.send({"id": 9, "op": "hello", "args": {"version": 1}})
    assert (await wire.receive())["id"] == 9  # the first frame back answers the hello
    assert wire.cache.hits == [("d", [HASH], 10)]


async def test_oversized_frame_closes_only_that_connection(wire):
    await wire.stream.send_all(struct.pack(">I", MAX_FRAME + 1))
    answer = await wire.receive()
    assert answer["id"] is None and "exceeds" in answer["error"]["message"]
    assert await wire.receive() is None  # closed by the server


async def test_truncated_header_then_eof_is_a_protocol_error_not_a_crash(wire):
    await wire.stream.send_all(b"\x00\x00")
    await wire.stream.send_eof()
    answer = await wire.receive()
    assert answer["id"] is None and "middle of a frame" in answer["error"]["message"]
    assert await wire.receive() is None


async def test_unencodable_result_becomes_an_error_response(wire):
    wire.cache.usage = lambda: {"path": object()}
    await wire.send({"id": 1, "op": "usage"})
    answer = await wire.receive()
    assert answer["id"] == 1 and answer["error"]["type"] == "ProtocolError"
    await wire.send({"id": 2, "op": "hello", "args": {"version": 1}})
    assert (await wire.receive())["ok"] is True


# -- the table of operations -------------------------------------------------------------------


def test_every_operation_has_exactly_one_handler():
    server = Server(FakeCache(), "/tmp/unused")
    assert set(server.handlers) == set(protocol.OPERATIONS)
    assert all(callable(h) for h in server.handlers.values())
    assert {n for n, op in protocol.OPERATIONS.items() if op.admin} == {"evict", "scrub", "shutdown"}
    assert {n for n, op in protocol.OPERATIONS.items() if op.notification} == {"hits", "prefetch"}
    # Nothing that changes session state or the store by itself is retried after a lost answer.
    assert not {"claim", "next_epoch", "hits", "evict", "scrub", "shutdown"} & {
        n for n, op in protocol.OPERATIONS.items() if op.idempotent}


async def test_only_advisory_ops_may_be_sent_as_notifications(wire):
    await wire.send({"op": "evict", "args": {"dataset": "d"}})
    answer = await wire.receive()
    assert answer["id"] is None and answer["error"]["type"] == "ProtocolError"
    assert "evict needs an 'id'" in answer["error"]["message"]
    await wire.send({"id": 3, "op": "hello", "args": {"version": 1}})
    assert (await wire.receive())["ok"] is True  # the connection lives


async def test_hello_lists_the_operations_of_the_table(wire):
    await wire.send({"id": 1, "op": "hello", "args": {"version": 1}})
    assert (await wire.receive())["result"]["ops"] == sorted(protocol.OPERATIONS)


def test_packed_hashes_round_trip_and_refuse_junk():
    hashes = [bytes([i]) * 32 for i in range(3)]
    assert protocol.check_packed_hashes({"p": b"".join(hashes).hex()}, "p") == hashes
    assert protocol.check_packed_hashes({"p": ""}, "p") == []
    for bad in ("ab" * 31, "zz" * 32, ["00" * 32], None):
        with pytest.raises(protocol.ProtocolError, match="'p' must be hex digits, 64 per hash"):
            protocol.check_packed_hashes({"p": bad}, "p")
    with pytest.raises(protocol.ProtocolError, match="at most 100000 per request"):
        protocol.check_packed_hashes({"p": "00" * 32 * (protocol.MAX_ITEMS + 1)}, "p")
