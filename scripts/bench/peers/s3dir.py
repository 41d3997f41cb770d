"""A small S3-compatible server over a directory: object ``KEY`` of bucket ``B`` is the file
``ROOT/B/KEY``.

It answers what the loaders of the side-by-side benchmark send, with path-style addressing:
GetObject (with a single ``Range``), HeadObject, ListObjectsV2 (and v1), ListBuckets,
CreateBucket, HeadBucket, GetBucketLocation, PutObject, multipart uploads (create, upload
part, complete, abort), DeleteObject and DeleteObjects. Signatures are not checked (any
credentials work), bodies may come plain, ``Transfer-Encoding: chunked`` or
``Content-Encoding: aws-chunked``. Every answer waits ``latency`` seconds first (a real bucket's
time to first byte). With ``log`` set, each request is appended to an access log in the same
format as :data:`peers.source.NGINX_LOG_FORMAT`::

    MSEC METHOD STATUS BODY_BYTES_SENT REQUEST_LENGTH REQUEST_URI

so :mod:`peers.source` counts requests and bytes the same way for nginx and for this server.

asyncio rather than trio (the house's choice for quiverfs): this is a stand-alone benchmark
process, and asyncio's ``loop.sendfile`` sends object bodies from the page cache without
copying them through Python. Run it as a script::

    python s3dir.py --root DIR --port 0 --latency-ms 20 --log access.log --ready ready.txt

(``--port 0``: any free port, written to ``--ready`` once listening.)

Writes are atomic (a temp file under ``ROOT/.s3dir/tmp``, then ``rename``), so nginx serving
the same directory never sees half an object. Keys are listed in byte order, as S3 does; a
bucket's sorted key list is kept and rebuilt after a write to that bucket.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import bisect
import contextlib
import email.utils
import hashlib
import os
import re
import shutil
import time
import uuid
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import parse_qsl, quote, unquote, urlsplit
from xml.sax.saxutils import escape

__all__ = ["S3Dir", "etag_of", "main", "serve"]

#: Where the server keeps its own files inside the root (never a bucket: names start with ".").
INTERNAL = ".s3dir"
#: Longest request head accepted (request line and headers).
MAX_HEAD = 64 * 1024
#: ListObjects' default and largest page.
MAX_KEYS = 1000
XMLNS = "http://s3.amazonaws.com/doc/2006-03-01/"
_BUCKET_NAME = re.compile(r"^[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]$")


def etag_of(st: os.stat_result) -> str:
    """nginx's ETag for a static file (hex mtime seconds, hex size), quoted: the same value
    whichever of the two servers answers."""
    return f'"{int(st.st_mtime):x}-{st.st_size:x}"'


def _http_date(ts: float) -> str:
    return email.utils.formatdate(ts, usegmt=True)


def _iso(ts: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime(ts))


class S3Error(Exception):
    """An S3 error answer: HTTP status, S3 code, message."""

    def __init__(self, status: int, code: str, message: str, resource: str = "") -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.resource = status, code, message, resource

    def body(self) -> bytes:
        return (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{self.code}</Code>'
                f"<Message>{escape(self.message)}</Message><Resource>{escape(self.resource)}"
                f"</Resource><RequestId>s3dir</RequestId></Error>").encode()


@dataclass
class Request:
    method: str
    target: str  #: the request URI as sent (path and query)
    headers: dict[str, str]  #: lower-case names
    body: bytes = b""
    head_length: int = 0

    @property
    def path(self) -> str:
        return unquote(urlsplit(self.target).path)

    @property
    def query(self) -> dict[str, str]:
        return dict(parse_qsl(urlsplit(self.target).query, keep_blank_values=True))


@dataclass
class Response:
    status: int
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    #: Send ``count`` bytes of this file from ``offset`` instead of ``body``.
    file: Path | None = None
    offset: int = 0
    count: int = 0

    @property
    def length(self) -> int:
        return self.count if self.file is not None else len(self.body)


REASONS = {200: "OK", 204: "No Content", 206: "Partial Content", 400: "Bad Request",
           403: "Forbidden", 404: "Not Found", 405: "Method Not Allowed", 409: "Conflict",
           416: "Range Not Satisfiable", 500: "Internal Server Error", 501: "Not Implemented"}


class S3Dir:
    """The S3 operations over ``root`` (no I/O with clients: :func:`serve` does that)."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root).resolve()
        self.internal = self.root / INTERNAL
        (self.internal / "tmp").mkdir(parents=True, exist_ok=True)
        (self.internal / "uploads").mkdir(parents=True, exist_ok=True)
        #: bucket → its keys, sorted; dropped when the bucket is written
        self._keys: dict[str, list[str]] = {}

    # -- paths ------------------------------------------------------------------------------

    def _bucket_dir(self, bucket: str, *, must_exist: bool = True) -> Path:
        if not _BUCKET_NAME.match(bucket):
            raise S3Error(400, "InvalidBucketName", f"bad bucket name {bucket!r}", bucket)
        path = self.root / bucket
        if must_exist and not path.is_dir():
            raise S3Error(404, "NoSuchBucket", "The specified bucket does not exist", bucket)
        return path

    def _object_path(self, bucket: str, key: str) -> Path:
        parts = key.split("/")
        if not key or any(p in ("", ".", "..") for p in parts):
            raise S3Error(400, "InvalidArgument", f"key {key!r} has no file form here", key)
        return self._bucket_dir(bucket) / key

    def _temp(self) -> Path:
        return self.internal / "tmp" / uuid.uuid4().hex

    def _publish(self, bucket: str, temp: Path, final: Path) -> os.stat_result:
        final.parent.mkdir(parents=True, exist_ok=True)
        os.replace(temp, final)
        self._keys.pop(bucket, None)
        return final.stat()

    def keys(self, bucket: str) -> list[str]:
        """Every key of ``bucket``, in byte order (cached until the bucket is written)."""
        cached = self._keys.get(bucket)
        if cached is None:
            base = self._bucket_dir(bucket)
            found = []
            for dirpath, _dirnames, filenames in os.walk(base):
                rel = os.path.relpath(dirpath, base)
                prefix = "" if rel == "." else rel.replace(os.sep, "/") + "/"
                found.extend(prefix + name for name in filenames)
            cached = sorted(found, key=lambda k: k.encode())
            self._keys[bucket] = cached
        return cached

    # -- dispatch ----------------------------------------------------------------------------

    def handle(self, req: Request) -> Response:
        """One request's answer (errors as S3 error documents)."""
        try:
            return self._dispatch(req)
        except S3Error as err:
            body = b"" if req.method == "HEAD" else err.body()
            return Response(err.status, {"Content-Type": "application/xml"}, body)
        except (OSError, ValueError, ET.ParseError) as exc:  # a bad request or a file gone: answer
            err = S3Error(500, "InternalError", f"{type(exc).__name__}: {exc}", req.path)
            return Response(500, {"Content-Type": "application/xml"}, b"" if req.method == "HEAD" else err.body())

    def _dispatch(self, req: Request) -> Response:
        path, query = req.path, req.query
        if path in ("", "/"):
            if req.method == "GET":
                return self._list_buckets()
            raise S3Error(405, "MethodNotAllowed", f"{req.method} /")
        bucket, _, key = path.lstrip("/").partition("/")
        m = req.method
        if not key:
            if m == "PUT":
                return self._create_bucket(bucket)
            if m == "HEAD":
                self._bucket_dir(bucket)
                return Response(200, {"x-amz-bucket-region": "us-east-1"})
            if m == "GET" and "location" in query:
                self._bucket_dir(bucket)
                return _xml(f'<LocationConstraint xmlns="{XMLNS}"></LocationConstraint>')
            if m == "GET":
                return self._list(bucket, query)
            if m == "POST" and "delete" in query:
                return self._delete_many(bucket, req.body)
            if m == "DELETE":
                return self._delete_bucket(bucket)
            raise S3Error(501, "NotImplemented", f"{m} on a bucket")
        if m in ("GET", "HEAD"):
            if "uploadId" in query:
                raise S3Error(501, "NotImplemented", "ListParts")
            return self._get(bucket, key, req.headers.get("range"), head=m == "HEAD")
        if m == "PUT":
            if "x-amz-copy-source" in req.headers:
                raise S3Error(501, "NotImplemented", "CopyObject")
            if "uploadId" in query:
                return self._upload_part(bucket, query["uploadId"], int(query["partNumber"]), req.body)
            return self._put(bucket, key, req.body)
        if m == "POST" and "uploads" in query:
            return self._create_upload(bucket, key)
        if m == "POST" and "uploadId" in query:
            return self._complete_upload(bucket, key, query["uploadId"], req.body)
        if m == "DELETE" and "uploadId" in query:
            return self._abort_upload(query["uploadId"])
        if m == "DELETE":
            return self._delete(bucket, key)
        raise S3Error(501, "NotImplemented", f"{m} on an object")

    # -- buckets -----------------------------------------------------------------------------

    def buckets(self) -> list[str]:
        return sorted(p.name for p in self.root.iterdir()
                      if p.is_dir() and not p.name.startswith(".") and _BUCKET_NAME.match(p.name))

    def _list_buckets(self) -> Response:
        items = "".join(f"<Bucket><Name>{b}</Name><CreationDate>{_iso((self.root / b).stat().st_mtime)}"
                        f"</CreationDate></Bucket>" for b in self.buckets())
        return _xml(f'<ListAllMyBucketsResult xmlns="{XMLNS}"><Owner><ID>s3dir</ID></Owner>'
                    f"<Buckets>{items}</Buckets></ListAllMyBucketsResult>")

    def _create_bucket(self, bucket: str) -> Response:
        self._bucket_dir(bucket, must_exist=False).mkdir(exist_ok=True)
        return Response(200, {"Location": f"/{bucket}"})

    def _delete_bucket(self, bucket: str) -> Response:
        path = self._bucket_dir(bucket)
        if self.keys(bucket):
            raise S3Error(409, "BucketNotEmpty", "The bucket you tried to delete is not empty", bucket)
        shutil.rmtree(path)
        self._keys.pop(bucket, None)
        return Response(204)

    def _list(self, bucket: str, query: dict[str, str]) -> Response:
        """ListObjectsV2 (``list-type=2``) or v1: prefix, delimiter, max-keys, start-after /
        continuation-token (v2), marker (v1), encoding-type=url."""
        keys = self.keys(bucket)
        v2 = query.get("list-type") == "2"
        prefix = query.get("prefix", "")
        delimiter = query.get("delimiter", "")
        max_keys = min(MAX_KEYS, int(query.get("max-keys", MAX_KEYS)))
        url = query.get("encoding-type") == "url"
        token = query.get("continuation-token")
        after = (_untoken(token) if token else query.get("start-after", "")) if v2 else query.get("marker", "")
        start = bisect.bisect_left(keys, prefix.encode(), key=_ordered) if prefix else 0
        if after:
            start = max(start, bisect.bisect_right(keys, after.encode(), key=_ordered))
        contents: list[str] = []
        prefixes: list[str] = []
        last = ""
        truncated = False
        i = start
        while i < len(keys):
            key = keys[i]
            if not key.startswith(prefix):
                break
            if len(contents) + len(prefixes) >= max_keys:
                truncated = True
                break
            rest = key[len(prefix):]
            if delimiter and delimiter in rest:
                common = prefix + rest.split(delimiter, 1)[0] + delimiter
                prefixes.append(common)
                last = common
                # skip every key under this common prefix
                i = bisect.bisect_left(keys, common.encode() + b"\xff", key=_ordered)
                continue
            try:
                st = (self.root / bucket / key).stat()
            except OSError:  # removed behind our back (not through a DELETE): list afresh next time
                self._keys.pop(bucket, None)
                i += 1
                continue
            contents.append(f"<Contents><Key>{_enc(key, url)}</Key><LastModified>{_iso(st.st_mtime)}"
                            f"</LastModified><ETag>{escape(etag_of(st))}</ETag><Size>{st.st_size}</Size>"
                            f"<StorageClass>STANDARD</StorageClass></Contents>")
            last = key
            i += 1
        parts = [f'<ListBucketResult xmlns="{XMLNS}"><Name>{bucket}</Name>',
                 f"<Prefix>{_enc(prefix, url)}</Prefix><MaxKeys>{max_keys}</MaxKeys>",
                 f"<IsTruncated>{'true' if truncated else 'false'}</IsTruncated>"]
        if delimiter:
            parts.append(f"<Delimiter>{_enc(delimiter, url)}</Delimiter>")
        if url:
            parts.append("<EncodingType>url</EncodingType>")
        if v2:
            parts.append(f"<KeyCount>{len(contents) + len(prefixes)}</KeyCount>")
            if token:
                parts.append(f"<ContinuationToken>{escape(token)}</ContinuationToken>")
            if query.get("start-after"):
                parts.append(f"<StartAfter>{_enc(query['start-after'], url)}</StartAfter>")
            if truncated:
                parts.append(f"<NextContinuationToken>{_token(last)}</NextContinuationToken>")
        else:
            parts.append(f"<Marker>{_enc(after, url)}</Marker>")
            if truncated:
                parts.append(f"<NextMarker>{_enc(last, url)}</NextMarker>")
        parts.extend(contents)
        parts.extend(f"<CommonPrefixes><Prefix>{_enc(p, url)}</Prefix></CommonPrefixes>" for p in prefixes)
        parts.append("</ListBucketResult>")
        return _xml("".join(parts))

    # -- objects -----------------------------------------------------------------------------

    def _get(self, bucket: str, key: str, range_header: str | None, *, head: bool) -> Response:
        path = self._object_path(bucket, key)
        try:
            st = path.stat()
        except (FileNotFoundError, NotADirectoryError):
            raise S3Error(404, "NoSuchKey", "The specified key does not exist.", key) from None
        if not path.is_file():
            raise S3Error(404, "NoSuchKey", "The specified key does not exist.", key)
        size = st.st_size
        headers = {"ETag": etag_of(st), "Last-Modified": _http_date(st.st_mtime),
                   "Content-Type": "application/octet-stream", "Accept-Ranges": "bytes"}
        status, offset, count = 200, 0, size
        if range_header:
            offset, count = _parse_range(range_header, size, key)
            status = 206
            headers["Content-Range"] = f"bytes {offset}-{offset + count - 1}/{size}"
        if head:
            headers["Content-Length"] = str(count)
            return Response(status, headers)
        return Response(status, headers, file=path, offset=offset, count=count)

    def _put(self, bucket: str, key: str, body: bytes) -> Response:
        final = self._object_path(bucket, key)
        temp = self._temp()
        temp.write_bytes(body)
        st = self._publish(bucket, temp, final)
        return Response(200, {"ETag": etag_of(st)})

    def _delete(self, bucket: str, key: str) -> Response:
        path = self._object_path(bucket, key)
        with contextlib.suppress(FileNotFoundError, NotADirectoryError, IsADirectoryError):
            path.unlink()
            self._keys.pop(bucket, None)
        return Response(204)

    def _delete_many(self, bucket: str, body: bytes) -> Response:
        root = ET.fromstring(body)
        done = []
        for obj in root.iter():
            if obj.tag.endswith("Key") and obj.text:
                self._delete(bucket, obj.text)
                done.append(f"<Deleted><Key>{escape(obj.text)}</Key></Deleted>")
        return _xml(f'<DeleteResult xmlns="{XMLNS}">{"".join(done)}</DeleteResult>')

    # -- multipart uploads -------------------------------------------------------------------

    def _upload_dir(self, upload_id: str) -> Path:
        if not re.fullmatch(r"[0-9a-f]{32}", upload_id):
            raise S3Error(404, "NoSuchUpload", "The specified upload does not exist.", upload_id)
        path = self.internal / "uploads" / upload_id
        if not path.is_dir():
            raise S3Error(404, "NoSuchUpload", "The specified upload does not exist.", upload_id)
        return path

    def _create_upload(self, bucket: str, key: str) -> Response:
        self._object_path(bucket, key)  # validates both
        upload_id = uuid.uuid4().hex
        (self.internal / "uploads" / upload_id).mkdir()
        return _xml(f'<InitiateMultipartUploadResult xmlns="{XMLNS}"><Bucket>{bucket}</Bucket>'
                    f"<Key>{escape(key)}</Key><UploadId>{upload_id}</UploadId>"
                    f"</InitiateMultipartUploadResult>")

    def _upload_part(self, bucket: str, upload_id: str, number: int, body: bytes) -> Response:
        self._bucket_dir(bucket)
        part = self._upload_dir(upload_id) / f"{number:05d}"
        part.write_bytes(body)
        return Response(200, {"ETag": f'"{hashlib.md5(body).hexdigest()}"'})

    def _complete_upload(self, bucket: str, key: str, upload_id: str, body: bytes) -> Response:
        folder = self._upload_dir(upload_id)
        numbers = [int(el.text or 0) for el in ET.fromstring(body).iter() if el.tag.endswith("PartNumber")]
        if not numbers:
            numbers = sorted(int(p.name) for p in folder.iterdir())
        temp = self._temp()
        with open(temp, "wb") as out:
            for n in numbers:
                try:
                    with open(folder / f"{n:05d}", "rb") as part:
                        shutil.copyfileobj(part, out, 1 << 20)
                except FileNotFoundError:
                    raise S3Error(400, "InvalidPart", f"part {n} was not uploaded", key) from None
        st = self._publish(bucket, temp, self._object_path(bucket, key))
        shutil.rmtree(folder, ignore_errors=True)
        return _xml(f'<CompleteMultipartUploadResult xmlns="{XMLNS}"><Location>/{bucket}/{escape(key)}'
                    f"</Location><Bucket>{bucket}</Bucket><Key>{escape(key)}</Key>"
                    f"<ETag>{escape(etag_of(st))}</ETag></CompleteMultipartUploadResult>")

    def _abort_upload(self, upload_id: str) -> Response:
        shutil.rmtree(self._upload_dir(upload_id), ignore_errors=True)
        return Response(204)


def _ordered(key: str) -> bytes:
    return key.encode()


def _enc(value: str, url: bool) -> str:
    return quote(value, safe="/") if url else escape(value)


def _token(key: str) -> str:
    return base64.urlsafe_b64encode(key.encode()).decode()


def _untoken(token: str) -> str:
    try:
        return base64.urlsafe_b64decode(token.encode()).decode()
    except ValueError:
        raise S3Error(400, "InvalidArgument", "bad continuation token") from None


def _xml(text: str) -> Response:
    return Response(200, {"Content-Type": "application/xml"},
                    b'<?xml version="1.0" encoding="UTF-8"?>\n' + text.encode())


def _parse_range(header: str, size: int, key: str) -> tuple[int, int]:
    """(offset, count) of a single ``bytes=`` range; S3 answers 416 past the end."""
    m = re.fullmatch(r"\s*bytes=(\d*)-(\d*)\s*", header)
    if not m or (not m.group(1) and not m.group(2)):
        raise S3Error(400, "InvalidArgument", f"unsupported range {header!r}", key)
    first, last = m.group(1), m.group(2)
    if not first:  # the last N bytes
        n = min(int(last), size)
        return size - n, n
    start = int(first)
    end = min(int(last), size - 1) if last else size - 1
    if start >= size or end < start:
        raise S3Error(416, "InvalidRange", "The requested range is not satisfiable", key)
    return start, end - start + 1


# -- the HTTP side ------------------------------------------------------------------------------


def _decode_chunked(data: bytes) -> bytes:
    """A ``Transfer-Encoding: chunked`` or ``aws-chunked`` body (chunk extensions such as
    ``;chunk-signature=`` and trailers are dropped)."""
    out = bytearray()
    pos = 0
    while True:
        eol = data.index(b"\r\n", pos)
        size = int(data[pos:eol].split(b";", 1)[0], 16)
        pos = eol + 2
        if size == 0:
            return bytes(out)
        out += data[pos:pos + size]
        pos += size + 2


async def _read_chunked(reader: asyncio.StreamReader) -> bytes:
    """The raw bytes of a chunked body up to and including its trailer's end."""
    raw = bytearray()
    while True:
        line = await reader.readuntil(b"\r\n")
        raw += line
        size = int(line.split(b";", 1)[0].strip() or b"0", 16)
        if size == 0:
            while True:  # trailers, then an empty line
                trailer = await reader.readuntil(b"\r\n")
                raw += trailer
                if trailer == b"\r\n":
                    return bytes(raw)
        raw += await reader.readexactly(size + 2)


async def _read_request(reader: asyncio.StreamReader) -> Request | None:
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
        return None
    lines = head.decode("latin-1").split("\r\n")
    method, target, _ = lines[0].split(" ", 2)
    headers = {}
    for line in lines[1:]:
        if line:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
    body = b""
    if headers.get("transfer-encoding", "").lower() == "chunked":
        body = _decode_chunked(await _read_chunked(reader))
    elif "content-length" in headers:
        body = await reader.readexactly(int(headers["content-length"]))
    if "aws-chunked" in headers.get("content-encoding", ""):
        body = _decode_chunked(body)
    return Request(method, target, headers, body, len(head) + len(body))


async def _send(writer: asyncio.StreamWriter, req: Request, resp: Response) -> None:
    headers = {"Server": "s3dir", "Date": _http_date(time.time()),
               "x-amz-request-id": "s3dir", **resp.headers}
    if "Content-Length" not in headers:
        headers["Content-Length"] = str(resp.length)
    reason = REASONS.get(resp.status, "Unknown")
    head = f"HTTP/1.1 {resp.status} {reason}\r\n" + "".join(
        f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n"
    writer.write(head.encode("latin-1"))
    if req.method == "HEAD":
        await writer.drain()
        return
    if resp.file is not None:
        await writer.drain()
        with open(resp.file, "rb") as f:
            await asyncio.get_running_loop().sendfile(writer.transport, f, resp.offset, resp.count)
    else:
        writer.write(resp.body)
        await writer.drain()


def _log_line(req: Request, resp: Response, sent: int) -> str:
    return f"{time.time():.3f} {req.method} {resp.status} {sent} {req.head_length} {req.target}\n"


async def serve(root: str | os.PathLike[str], host: str = "127.0.0.1", port: int = 0, *,
                latency: float = 0.0, log: str | None = None,
                ready: str | None = None) -> None:
    """Serve ``root`` until cancelled; the bound port is written to ``ready`` (a file)."""
    store = S3Dir(root)
    log_file = open(log, "a", buffering=1) if log else None  # noqa: SIM115 - closed below

    async def client(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                req = await _read_request(reader)
                if req is None:
                    return
                if latency:
                    await asyncio.sleep(latency)
                resp = store.handle(req)
                await _send(writer, req, resp)
                if log_file is not None:
                    log_file.write(_log_line(req, resp, 0 if req.method == "HEAD" else resp.length))
                if req.headers.get("connection", "").lower() == "close":
                    return
        except (ConnectionError, asyncio.IncompleteReadError):
            return
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError, OSError):
                await writer.wait_closed()

    server = await asyncio.start_server(client, host, port, limit=MAX_HEAD, backlog=1024)
    bound = server.sockets[0].getsockname()[1]
    if ready:
        Path(ready + ".tmp").write_text(str(bound))
        os.replace(ready + ".tmp", ready)
    try:
        async with server:
            await server.serve_forever()
    finally:
        if log_file is not None:
            log_file.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--root", required=True, help="directory holding one folder per bucket")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0: any free port (see --ready)")
    parser.add_argument("--latency-ms", type=float, default=0.0, help="delay before every answer")
    parser.add_argument("--log", default=None, help="append an access log here")
    parser.add_argument("--ready", default=None, help="write the bound port to this file")
    args = parser.parse_args(argv)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(args.root, args.host, args.port, latency=args.latency_ms / 1000,
                          log=args.log, ready=args.ready))


if __name__ == "__main__":
    main()
