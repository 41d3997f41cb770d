"""The bucket of the side-by-side benchmark: fast for reads, with a real bucket's latency.

The Python emulators serve 300–400 objects/s on this machine (shared/MEASURED.md), which
would make every loader equal. Here the bucket is a directory, ``ROOT/BUCKET/KEY``, served
by two processes on loopback:

* nginx (Debian's ``nginx-light`` + ``libnginx-mod-http-echo``) answers GetObject and
  HeadObject itself: path-style ``/BUCKET/KEY`` is the file ``ROOT/BUCKET/KEY``, sent with
  ``sendfile`` (ranges, ETag, Last-Modified: nginx's static module). Before each answer the
  echo module's ``echo_sleep`` waits ``latency`` seconds on a timer (no worker is held), then
  ``echo_exec`` hands the request to the static files: a real bucket's time to first byte.
* :mod:`peers.s3dir` answers everything else (listing, bucket calls, uploads, deletes, and
  any key nginx has no file for), proxied by nginx and delayed by the same latency.

Every request, whichever process answers it, is one line of nginx's access log
(:data:`NGINX_LOG_FORMAT`); :meth:`Source.requests` reads it back and :func:`count` turns a
time window of it into GETs, bytes, lists and writes. A second nginx port serves the same
files with no delay and its own log: :func:`probe` measures there what the server itself
can do on this machine, to tell a loader's limit from the bucket's.

Without nginx (``nginx=False``, or not installed) :mod:`peers.s3dir` serves everything and
writes the same log itself (slower: a Python process; fine for tests).

    with Source(root, workdir, latency_ms=20) as bucket:
        start = bucket.mark()
        ...                                   # clients use bucket.endpoint
        c = count(bucket.requests(start))     # c.gets, c.get_bytes, ...
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from quiverfs.testing.emulators import free_ports
from quiverfs.testing.mountd import log_tail, stop_process

HERE = Path(__file__).resolve().parent

__all__ = ["Counts", "NGINX_LOG_FORMAT", "Source", "count", "nginx_available", "probe"]

#: One access-log line: end time (s, ms resolution), method, status, body bytes sent,
#: request length (line + headers + body), the request URI as sent.
NGINX_LOG_FORMAT = "$msec $request_method $status $body_bytes_sent $request_length $request_uri"
#: Where Debian puts nginx's dynamic modules.
ECHO_MODULE = Path("/usr/lib/nginx/modules/ngx_http_echo_module.so")
INSTALL_HINT = "apt-get install -y nginx-light libnginx-mod-http-echo"
#: Seconds a server may take to start answering.
START_TIMEOUT = 20.0


def nginx_available() -> str | None:
    """None when nginx and its echo module are installed, else what is missing (one line)."""
    if shutil.which("nginx") is None:
        return f"nginx is not installed ({INSTALL_HINT})"
    if not ECHO_MODULE.exists():
        return f"nginx's echo module is not installed ({INSTALL_HINT})"
    return None


# -- counting ----------------------------------------------------------------------------------


@dataclass
class Counts:
    """What clients asked of the bucket in a window of the log."""

    gets: int = 0  #: object GETs (whole or ranged)
    get_bytes: int = 0  #: body bytes those GETs sent
    heads: int = 0
    lists: int = 0  #: bucket-level GETs: ListObjects, GetBucketLocation, ListBuckets
    writes: int = 0  #: PUT and POST requests (uploads, multipart calls)
    write_bytes: int = 0  #: request bytes of the writes (bodies and heads)
    deletes: int = 0
    errors: int = 0  #: answers with status >= 400 (counted in their kind too)
    first: float | None = None  #: time of the first request counted
    last: float | None = None

    def add(self, other: Counts) -> Counts:
        out = Counts()
        for name in ("gets", "get_bytes", "heads", "lists", "writes", "write_bytes", "deletes", "errors"):
            setattr(out, name, getattr(self, name) + getattr(other, name))
        firsts = [t for t in (self.first, other.first) if t is not None]
        lasts = [t for t in (self.last, other.last) if t is not None]
        out.first = min(firsts) if firsts else None
        out.last = max(lasts) if lasts else None
        return out


def kind_of(method: str, uri: str) -> str:
    """``get``, ``head``, ``list``, ``write``, ``delete`` or ``other`` for one request."""
    path = uri.split("?", 1)[0]
    is_object = len(path.lstrip("/").split("/", 1)) == 2 and not path.endswith("/")
    if method == "GET":
        return "get" if is_object and "uploadId=" not in uri else "list"
    if method == "HEAD":
        return "head"
    if method in ("PUT", "POST"):
        return "write"
    if method == "DELETE":
        return "delete"
    return "other"


Record = tuple[float, str, int, int, int, str]


def count(records: Iterable[Record], start: float | None = None, end: float | None = None) -> Counts:
    """Requests whose log time is in ``[start, end)`` (None: unbounded)."""
    out = Counts()
    for t, method, status, sent, length, uri in records:
        if (start is not None and t < start) or (end is not None and t >= end):
            continue
        kind = kind_of(method, uri)
        if kind == "get":
            out.gets += 1
            out.get_bytes += sent
        elif kind == "head":
            out.heads += 1
        elif kind == "list":
            out.lists += 1
        elif kind == "write":
            out.writes += 1
            out.write_bytes += length
        elif kind == "delete":
            out.deletes += 1
        if status >= 400:
            out.errors += 1
        out.first = t if out.first is None else min(out.first, t)
        out.last = t if out.last is None else max(out.last, t)
    return out


# -- the servers ---------------------------------------------------------------------------------


def _nginx_conf(workdir: Path, root: Path, port: int, raw_port: int, side_port: int,
                latency: float, workers: int) -> str:
    proxy = ("proxy_pass http://s3dir; proxy_http_version 1.1; proxy_set_header Connection \"\"; "
             "proxy_request_buffering off; proxy_buffering off; proxy_read_timeout 600s;")
    # An object GET/HEAD waits on the echo module's timer, then goes to the static files;
    # other methods, and multipart calls on a key, go to s3dir (418 is only a jump label).
    delay = f"echo_sleep {latency:.3f}; echo_exec @object;" if latency > 0 else f"root {root}; try_files $uri @s3dir;"
    return f"""
load_module {ECHO_MODULE};
daemon off;
master_process on;
user root;
worker_processes {workers};
pid {workdir}/nginx.pid;
error_log {workdir}/nginx-error.log warn;
events {{ worker_connections 8192; multi_accept on; }}
http {{
    default_type application/octet-stream;
    types {{ }}
    sendfile on; tcp_nopush on; tcp_nodelay on;
    keepalive_timeout 300s; keepalive_requests 10000000;
    client_max_body_size 0;
    server_tokens off;
    client_body_temp_path {workdir}/nginx-body; proxy_temp_path {workdir}/nginx-proxy;
    fastcgi_temp_path {workdir}/nginx-fastcgi; uwsgi_temp_path {workdir}/nginx-uwsgi;
    scgi_temp_path {workdir}/nginx-scgi;
    log_format s3 '{NGINX_LOG_FORMAT}';
    upstream s3dir {{ server 127.0.0.1:{side_port}; keepalive 64; }}
    server {{
        listen 127.0.0.1:{port} backlog=4096;
        access_log {workdir}/access.log s3;
        location / {{ {proxy} }}
        location ~ "^/[a-z0-9][a-z0-9.-]+/." {{
            error_page 418 = @s3dir;
            if ($request_method !~ ^(GET|HEAD)$) {{ return 418; }}
            if ($arg_uploadId) {{ return 418; }}
            {delay}
        }}
        location @object {{ root {root}; try_files $uri @s3dir; }}
        location @s3dir {{ {proxy} }}
    }}
    server {{
        listen 127.0.0.1:{raw_port} backlog=4096;
        access_log {workdir}/probe.log s3;
        location / {{ root {root}; }}
    }}
}}
"""


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2):
            return True
    except urllib.error.HTTPError:
        return True
    except (OSError, urllib.error.URLError):
        return False


def _wait(predicate, what: str, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    while not predicate():
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}:\n{log_tail(log)}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not start in {START_TIMEOUT:g} s:\n{log_tail(log)}")
        time.sleep(0.02)


class Source:
    """The bucket directory ``root`` served on loopback (see the module docstring); a context
    manager that always stops both servers.

    ``nginx``: True (required), False (s3dir alone), None (nginx when installed)."""

    def __init__(self, root: str | os.PathLike[str], workdir: str | os.PathLike[str], *,
                 latency_ms: float = 20.0, nginx: bool | None = None, nginx_workers: int = 2) -> None:
        self.root = Path(root).resolve()
        self.workdir = Path(workdir).resolve()
        self.latency = latency_ms / 1000
        missing = nginx_available()
        if nginx and missing:
            raise RuntimeError(missing)
        self.uses_nginx = bool(nginx if nginx is not None else missing is None)
        self.nginx_workers = nginx_workers
        self.side: subprocess.Popen | None = None
        self.front: subprocess.Popen | None = None
        self.port = self.raw_port = 0
        self.log = self.workdir / "access.log"
        self.probe_log = self.workdir / "probe.log"

    @property
    def endpoint(self) -> str:
        """``http://127.0.0.1:PORT``: S3 clients' endpoint (path-style addressing)."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def raw_endpoint(self) -> str | None:
        """The same files with no delay and no counting (nginx only): for :func:`probe`."""
        return f"http://127.0.0.1:{self.raw_port}" if self.uses_nginx else None

    def __enter__(self) -> Source:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self.workdir.mkdir(parents=True, exist_ok=True)
        for old in (self.log, self.probe_log):
            old.unlink(missing_ok=True)
        ready = self.workdir / "s3dir.port"
        ready.unlink(missing_ok=True)
        side_log = self.workdir / "s3dir.out"
        argv = [sys.executable, str(HERE / "s3dir.py"), "--root", str(self.root), "--port", "0",
                "--ready", str(ready), "--latency-ms", f"{self.latency * 1000:g}"]
        if not self.uses_nginx:
            argv += ["--log", str(self.log)]
        with open(side_log, "wb") as out:
            self.side = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                         start_new_session=True)
        _wait(ready.exists, "the s3dir server", self.side, side_log)
        side_port = int(ready.read_text())
        if not self.uses_nginx:
            self.port = side_port
            _wait(lambda: _answers(self.endpoint + "/"), "the s3dir server", self.side, side_log)
            return
        self.port, self.raw_port = free_ports(2)
        conf = self.workdir / "nginx.conf"
        conf.write_text(_nginx_conf(self.workdir, self.root, self.port, self.raw_port, side_port,
                                    self.latency, self.nginx_workers))
        front_log = self.workdir / "nginx.out"
        with open(front_log, "wb") as out:
            self.front = subprocess.Popen(["nginx", "-c", str(conf), "-p", str(self.workdir),
                                           "-e", str(self.workdir / "nginx-error.log")],
                                          stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                          start_new_session=True)
        _wait(lambda: _answers(self.endpoint + "/"), "nginx", self.front, self.workdir / "nginx-error.log")

    def stop(self) -> None:
        """Stop nginx (fast shutdown: SIGTERM), then s3dir; each even if the other failed."""
        try:
            if self.front is not None:
                stop_process(self.front, 10.0)
        finally:
            if self.side is not None:
                stop_process(self.side, 10.0)

    def pids(self) -> list[int]:
        """The server processes (nginx's master and workers, s3dir), for CPU and memory."""
        out = []
        for proc in (self.front, self.side):
            if proc is not None and proc.poll() is None:
                out.append(proc.pid)
        return out

    # -- the log -------------------------------------------------------------------------------

    def mark(self) -> int:
        """The log's current end: pass it to :meth:`requests` to read what came after."""
        try:
            return self.log.stat().st_size
        except FileNotFoundError:
            return 0

    def requests(self, since: int = 0, until: int | None = None) -> list[Record]:
        """The log's requests from byte ``since`` (a :meth:`mark`) to ``until`` (None: now)."""
        if not self.log.exists():
            return []
        with open(self.log, "rb") as f:
            f.seek(since)
            data = f.read() if until is None else f.read(max(0, until - since))
        return parse_log(data)


def parse_log(data: bytes) -> list[Record]:
    """Access-log lines (a last line without its newline, being written, is left out)."""
    out = []
    for raw in data.splitlines(keepends=True):
        if not raw.endswith(b"\n"):
            break
        parts = raw.decode("latin-1").rstrip("\n").split(" ", 5)
        if len(parts) == 6:
            out.append((float(parts[0]), parts[1], int(parts[2]), int(parts[3]), int(parts[4]), parts[5]))
    return out


# -- what the server itself can do -----------------------------------------------------------------


async def _probe_conn(host: str, port: int, paths: Sequence[str], start: int, deadline: float) -> tuple[int, int]:
    reader, writer = await asyncio.open_connection(host, port)
    n = nbytes = 0
    i = start
    try:
        while time.monotonic() < deadline:
            path = paths[i % len(paths)]
            i += 7919  # a prime stride: connections spread over the files
            writer.write(f"GET {path} HTTP/1.1\r\nHost: probe\r\n\r\n".encode())
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n"):
                if line[:15].lower() == b"content-length:":
                    length = int(line[15:])
            await reader.readexactly(length)
            if not head.startswith(b"HTTP/1.1 200"):
                raise RuntimeError(f"probe GET {path}: {head.splitlines()[0]!r}")
            n += 1
            nbytes += length
    finally:
        writer.close()
    return n, nbytes


def _probe_process(host: str, port: int, paths: Sequence[str], connections: int, first: int,
                   seconds: float, out) -> None:
    async def run() -> tuple[int, int]:
        deadline = time.monotonic() + seconds
        done = await asyncio.gather(*(_probe_conn(host, port, paths, first + k * 104729, deadline)
                                      for k in range(connections)))
        return sum(d[0] for d in done), sum(d[1] for d in done)

    try:
        out.put(("ok", *asyncio.run(run())))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        out.put(("error", f"{type(exc).__name__}: {exc}", 0))


@dataclass(frozen=True)
class ProbeResult:
    """GETs/s and bytes/s a light client (raw sockets, keep-alive) got from an endpoint."""

    connections: int
    gets_per_s: float
    bytes_per_s: float
    seconds: float


def probe(endpoint: str, paths: Sequence[str], *, connections: int = 16, processes: int = 2,
          seconds: float = 3.0) -> ProbeResult:
    """``connections`` keep-alive connections in ``processes`` client processes GET ``paths``
    (``/BUCKET/KEY``) as fast as they are answered for ``seconds``. Its client is light, but it
    shares the machine's cores with the server: the rates are what the server gives at least."""
    host, port = endpoint.removeprefix("http://").rsplit(":", 1)
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    per = [connections // processes + (1 if k < connections % processes else 0) for k in range(processes)]
    procs = [ctx.Process(target=_probe_process, args=(host, int(port), list(paths), n, k * 31, seconds, out),
                         daemon=True) for k, n in enumerate(per) if n]
    started = time.perf_counter()
    for p in procs:
        p.start()
    results = [out.get(timeout=seconds + 60) for _ in procs]
    wall = time.perf_counter() - started
    for p in procs:
        p.join(10)
        if p.is_alive():
            p.terminate()
    errors = [r[1] for r in results if r[0] != "ok"]
    if errors:
        raise RuntimeError(f"probe of {endpoint} failed: {errors[0]}")
    n = sum(r[1] for r in results)
    nbytes = sum(r[2] for r in results)
    span = max(seconds, min(wall, seconds + 1.0))
    return ProbeResult(connections, n / span, nbytes / span, span)
