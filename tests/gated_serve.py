"""`gguf-run ARGS...` (serve) whose model load waits for the test's go-ahead: a byte on stdin
(closed stdin: at once). On stdout, for the test: the port once bound, and "waiting" each time a
request for a model arrives while the server is in its initial load. Run as a script by
tests/test_server_loading.py; patched here, in this process only, nothing in the product."""

from __future__ import annotations

import os
import sys

from gguf_runtime.cli import serve_cmd
from gguf_runtime.cli.app import main
from gguf_runtime.engine import engine
from gguf_runtime.server.service import Service

_bind, _using, _Engine = serve_cmd._bind, Service.using, engine.Engine


def bind(host: str, port: int):
    sock = _bind(host, port)
    print(sock.getsockname()[1], flush=True)
    return sock


def using(self, *args, **kw):
    if self.loading:
        print("waiting", flush=True)
    return _using(self, *args, **kw)


class GatedEngine(_Engine):
    def __init__(self, *args, **kw) -> None:
        os.read(0, 1)  # (a raw read: no lock of sys.stdin's held if the process exits meanwhile)
        super().__init__(*args, **kw)


serve_cmd._bind, Service.using, engine.Engine = bind, using, GatedEngine

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
