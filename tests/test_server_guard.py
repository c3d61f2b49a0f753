"""The server's Host and Origin checks (server/guard.py): DNS rebinding and cross-site requests
are refused with a JSON 403 before any route runs; localhost names and origins pass."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("starlette")
pytest.importorskip("httpx")
from starlette.testclient import TestClient  # noqa: E402

from gguf_runtime.server.app import build_app  # noqa: E402
from gguf_runtime.server.guard import allowed_host, allowed_origin, DEFAULT_ORIGINS, is_loopback  # noqa: E402

SERVICE = SimpleNamespace()  # the routes used here (/ and /api/version) do not touch the model


def client(check_host=True, origins=()):
    return TestClient(build_app(SERVICE, check_host=check_host, allow_origins=origins),
                      base_url="http://localhost:11434")


@pytest.mark.parametrize("host", ["localhost:11434", "localhost", "127.0.0.1:11434", "[::1]:11434", "::1",
                                  "0.0.0.0:11434", "192.168.1.20:11434", "10.0.0.7", "ollama.localhost:8080",
                                  "box.local", "gpu.internal:11434", "LOCALHOST:11434"])
def test_local_hosts_pass(host):
    r = client().get("/api/version", headers={"host": host})
    assert r.status_code == 200 and "version" in r.json()


@pytest.mark.parametrize("host", ["evil.example:11434", "evil.example", "attacker.com.", "8.8.8.8:11434",
                                  "localhost.evil.example", "127.0.0.1.nip.io:11434"])
def test_dns_rebinding_host_is_refused(host):
    """A page on an attacker's name that resolves to 127.0.0.1 sends its own name as Host."""
    for path in ("/api/version", "/api/show", "/v1/models"):
        r = client().request("POST" if path == "/api/show" else "GET", path, headers={"host": host})
        assert r.status_code == 403, (host, path, r.text)
        err = r.json()["error"]
        msg = err["message"] if path.startswith("/v1/") else err
        assert "host" in msg and "localhost" in msg


def test_no_host_check_when_bound_to_all_interfaces():
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("192.168.1.20")
    assert client(check_host=False).get("/api/version", headers={"host": "gpu-box.example.org"}).status_code == 200


def test_cross_origin_text_plain_post_is_refused():
    """The 'simple' cross-origin POST a browser sends without preflight (text/plain body)."""
    r = client().post("/api/generate", content=b'{"model": "m", "prompt": "hi"}',
                      headers={"origin": "https://evil.example", "content-type": "text/plain"})
    assert r.status_code == 403 and "origin" in r.json()["error"] and "--allow-origin" in r.json()["error"]
    r = client().post("/v1/chat/completions", content=b"{}",
                      headers={"origin": "http://evil.example:8080", "content-type": "text/plain"})
    assert r.status_code == 403 and r.json()["error"]["type"] == "forbidden"
    r = client().post("/tokenize", content=b'{"content": "hi"}',  # llama-server's routes: OpenAI's shape too
                      headers={"origin": "https://evil.example", "content-type": "text/plain"})
    assert r.status_code == 403 and r.json()["error"]["type"] == "forbidden"


@pytest.mark.parametrize("origin", ["http://localhost:3000", "http://127.0.0.1", "https://localhost",
                                    "http://[::1]:5173", "app://obsidian.md", "vscode-webview://abc"])
def test_local_origins_get_cors_headers(origin):
    r = client().get("/api/version", headers={"origin": origin})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == origin
    pre = client().options("/api/chat", headers={"origin": origin, "access-control-request-method": "POST",
                                                 "access-control-request-headers": "content-type"})
    assert pre.status_code == 204 and pre.headers["access-control-allow-origin"] == origin
    assert "POST" in pre.headers["access-control-allow-methods"]


def test_preflight_allows_the_openai_sdks_headers():
    """The headers openai-node sends from a page (its x-stainless-* fingerprint, OpenAI-Beta) are
    allowed, as Ollama allows them: else the browser drops every request the SDK makes."""
    sent = ("authorization, content-type, openai-beta, x-stainless-arch, x-stainless-lang, x-stainless-os, "
            "x-stainless-package-version, x-stainless-retry-count, x-stainless-runtime, "
            "x-stainless-runtime-version, x-stainless-timeout, x-stainless-helper-method")
    pre = client().options("/v1/chat/completions", headers={"origin": "http://localhost:3000",
                                                            "access-control-request-method": "POST",
                                                            "access-control-request-headers": sent})
    assert pre.status_code == 204
    allowed = {h.strip().lower() for h in pre.headers["access-control-allow-headers"].split(",")}
    assert {h.strip() for h in sent.split(",")} <= allowed


def test_preflight_of_a_foreign_origin_is_refused_and_allow_origin_admits_it():
    h = {"origin": "https://notes.example", "access-control-request-method": "POST"}
    assert client().options("/api/chat", headers=h).status_code == 403
    assert client(origins=("https://notes.example",)).options("/api/chat", headers=h).status_code == 204
    assert client(origins=("*",)).get("/api/version", headers={"origin": "https://any.example"}).status_code == 200


def test_origin_patterns():
    assert allowed_origin("http://localhost:8080", DEFAULT_ORIGINS)
    assert not allowed_origin("http://localhost:8080.evil.example", DEFAULT_ORIGINS)
    assert not allowed_origin("http://localhost.evil.example", DEFAULT_ORIGINS)
    assert not allowed_origin("null", DEFAULT_ORIGINS)
    assert allowed_host("") and not allowed_host("example.com")


def test_no_origin_header_passes():
    """curl, SDKs and Ollama's own CLI send no Origin."""
    assert client().get("/api/version").status_code == 200
