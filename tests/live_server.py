"""A started Service behind uvicorn on a free local port, for the server tests: ``with
live(svc) as url`` waits until it listens and stops it (and the service) afterwards."""

from __future__ import annotations

import socket
import threading
import time
from contextlib import contextmanager
from typing import Iterator

import uvicorn

from gguf_runtime.server.app import build_app


@contextmanager
def live(svc) -> Iterator[str]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(build_app(svc), log_level="warning")
    config.install_signal_handlers = False
    srv = uvicorn.Server(config)
    th = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    th.start()
    for _ in range(500):
        if srv.started:
            break
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        srv.should_exit = True
        th.join(10)
        svc.shutdown()
        sock.close()
