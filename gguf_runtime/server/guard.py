"""Who may talk to a local server: the Host and Origin checks Ollama makes.

* **Host** (DNS rebinding): a page on ``evil.example`` whose name the attacker re-points at
  127.0.0.1 reaches a loopback server with ``Host: evil.example``. A server bound to a loopback
  address therefore answers only Host names that mean this machine: ``localhost`` and
  ``*.localhost`` / ``*.local`` / ``*.internal``, the machine's own hostname, and loopback, private
  or unspecified IP literals (any port). A server bound to another address is meant to be reached
  by other names, and checks no Host (as Ollama).
* **Origin** (cross-site requests): a browser sends ``Origin`` with every cross-origin request,
  including the "simple" ``text/plain`` POSTs that skip CORS preflight. A request with an Origin is
  served only if that origin is allowed: localhost, 127.0.0.1, [::1] and 0.0.0.0 on any port and
  scheme, the app schemes Ollama allows (``app://``, ``file://``, ``tauri://``,
  ``vscode-webview://``), and whatever ``--allow-origin`` adds (``*`` for any). Requests without
  an Origin (curl, SDKs) are not browsers' and pass. Preflights (OPTIONS) of allowed origins get the
  CORS headers; every refusal is a 403 with a JSON error.
"""

from __future__ import annotations

import ipaddress
import json
import socket
from typing import Any, Awaitable, Callable, Iterable

DEFAULT_ORIGINS = tuple(f"{scheme}://{host}{port}" for scheme in ("http", "https")
                        for host in ("localhost", "127.0.0.1", "[::1]", "0.0.0.0") for port in ("", ":*")) + (
    "app://*", "file://*", "tauri://*", "vscode-webview://*")
LOCAL_SUFFIXES = (".localhost", ".local", ".internal")
CORS_METHODS = "GET, POST, PUT, PATCH, DELETE, HEAD, OPTIONS"
# request headers a page may send (Ollama's list: the OpenAI SDKs' own, OpenAI-Beta and x-stainless-*, included)
CORS_HEADERS = ", ".join(["Authorization", "Content-Type", "User-Agent", "Accept", "X-Requested-With", "OpenAI-Beta"]
                         + [f"x-stainless-{h}" for h in ("arch", "async", "custom-poll-interval", "helper-method",
                                                         "lang", "os", "package-version", "poll-helper",
                                                         "read-timeout", "retry-count", "runtime", "runtime-version",
                                                         "timeout")])


def is_loopback(host: str) -> bool:
    """Whether a bind address is loopback only (then the Host check applies)."""
    h = host.strip("[]").lower()
    if h == "localhost":
        return True
    try:
        return ipaddress.ip_address(h).is_loopback
    except ValueError:
        return False


def _host_name(header: str) -> str:
    """The host part of a Host header (no port, no IPv6 brackets), lower case."""
    h = header.strip().lower()
    if h.startswith("["):
        return h[1:h.index("]")] if "]" in h else h[1:]
    return h.rsplit(":", 1)[0] if h.count(":") == 1 else h


def allowed_host(header: str) -> bool:
    h = _host_name(header)
    if h in ("", "localhost") or h.endswith(LOCAL_SUFFIXES):
        return True
    try:
        ip = ipaddress.ip_address(h)
    except ValueError:
        return h == socket.gethostname().lower()
    return ip.is_loopback or ip.is_private or ip.is_unspecified


def allowed_origin(origin: str, allowed: Iterable[str]) -> bool:
    """``origin`` against patterns: exact, ``*`` (any), ``scheme://host:*`` (any port of that host),
    ``scheme://*`` (any origin of that scheme)."""
    o = origin.strip().lower()
    for pattern in allowed:
        p = pattern.strip().lower().rstrip("/")
        if p == "*" or o == p:
            return True
        if p.endswith("://*") and o.startswith(p[:-1]):
            return True
        if p.endswith(":*") and o.startswith(p[:-1]) and o[len(p) - 1:].isdigit():
            return True
    return False


class Guard:
    """ASGI middleware: Host check (when bound to loopback), Origin check, CORS preflight."""

    def __init__(self, app: Callable[..., Awaitable[None]], check_host: bool,
                 allow_origins: Iterable[str] = ()) -> None:
        self.app, self.check_host = app, check_host
        self.origins = tuple(DEFAULT_ORIGINS) + tuple(allow_origins)

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        host = headers.get("host", "")
        if self.check_host and not allowed_host(host):
            return await _refuse(send, scope, f"host {json.dumps(host)[:120]} is not this machine; the server "
                                              "answers localhost names only (DNS rebinding protection)")
        origin = headers.get("origin")
        if origin is None:
            return await self.app(scope, receive, send)
        if not allowed_origin(origin, self.origins):
            return await _refuse(send, scope, f"origin {json.dumps(origin)[:120]} is not allowed; start the "
                                              "server with --allow-origin ORIGIN to allow it")
        cors = [(b"access-control-allow-origin", origin.encode("latin-1")), (b"vary", b"Origin")]
        if scope["method"] == "OPTIONS" and "access-control-request-method" in headers:
            await send({"type": "http.response.start", "status": 204, "headers": cors + [
                (b"access-control-allow-methods", CORS_METHODS.encode()),
                (b"access-control-allow-headers", CORS_HEADERS.encode()),
                (b"access-control-max-age", b"600")]})
            return await send({"type": "http.response.body", "body": b""})

        async def send_with_cors(message: dict) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": list(message.get("headers", [])) + cors}
            await send(message)

        return await self.app(scope, receive, send_with_cors)


# llama-server's routes (app.py): their errors in OpenAI's shape, as /v1/*'s
LLAMA_PATHS = ("/health", "/v1/health", "/tokenize", "/detokenize", "/apply-template")


def openai_shaped(path: str) -> bool:
    """Whether a path's errors take OpenAI's shape ({"error": {"message", "type", ...}}) rather
    than Ollama's ({"error": message})."""
    return path.startswith("/v1/") or path in LLAMA_PATHS


async def _refuse(send: Callable, scope: dict, message: str) -> None:
    openai = openai_shaped(scope.get("path", ""))
    body: Any = {"error": {"message": message, "type": "forbidden", "param": None, "code": None}} if openai \
        else {"error": message}
    data = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": 403,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]})
    await send({"type": "http.response.body", "body": data})
