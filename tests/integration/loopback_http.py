"""Serving a fake API on a free loopback port, shared by the fake Container and Kubernetes servers."""

from __future__ import annotations

import contextlib
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
