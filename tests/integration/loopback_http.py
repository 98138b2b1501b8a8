"""Serving a fake API on a free loopback port, shared by the fake Container, Kubernetes and KFP servers."""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@contextlib.contextmanager
def serving(handler: type[BaseHTTPRequestHandler], state: Any) -> Iterator[ThreadingHTTPServer]:
    """Runs `handler` (with `state` as its class attribute) on 127.0.0.1 until the block ends."""
    bound = type("Handler", (handler,), {"state": state})
    server = ThreadingHTTPServer(("127.0.0.1", 0), bound)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


class QuietHandler(BaseHTTPRequestHandler):
    """A request handler that logs nothing and answers JSON, or plain text for a str payload."""

    def log_message(self, format: str, *args: Any) -> None:  # keep test output quiet
        pass

    def reply(self, code: int, payload: Any) -> None:
        text = isinstance(payload, str)
        data = payload.encode() if text else json.dumps(payload).encode()
        self.send_response(code)
        self.send_header("Content-Type", "text/plain; charset=utf-8" if text else "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def read_body(self) -> bytes:
        """The request body (empty without a Content-Length)."""
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""
