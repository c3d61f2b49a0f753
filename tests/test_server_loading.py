"""`gguf-run serve` while its model loads, as llama-server does: it answers from the moment it
listens; /health and /v1/health are llama-server's 503 "Loading model" until the model is in (then
200), and the model is listed and shown meanwhile; a generation request sent during the load waits
for it and gets its normal answer. A load that fails ends the server (exit 2, the one error line
of before, no traceback; a request waiting gets a 503 naming the error); Ctrl-C or SIGTERM during
the load exits at once, as an interrupted load always did (130). The real CLI as a subprocess whose
load waits for the test's go-ahead (gated_serve.py); a micro model, numpy backend, 127.0.0.1."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from gguf_runtime.errors import GGUFError  # noqa: E402
from gguf_runtime.format.gguf_file import open_gguf  # noqa: E402
from micro_models import Micro, write_micro  # noqa: E402

GATED = Path(__file__).resolve().parent / "gated_serve.py"
LOADING = {"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}}
TIMEOUT = 60  # hang guards: each wait below ends on an event well before
GREEDY = {"model": "m", "prompt": "Hello there", "stream": False, "options": {"num_predict": 4, "temperature": 0}}


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("loading")
    good = write_micro(Micro(seed=3), d / "m.gguf")
    data = good.read_bytes()
    (d / "truncated.gguf").write_bytes(data[:len(data) * 2 // 3])  # its header reads; its tensors run past the end
    (d / "text.gguf").write_text("hello, not a model\n")
    return {"good": good, "truncated": d / "truncated.gguf", "text": d / "text.gguf"}


def load_error(path: Path) -> str:
    """The one line `gguf-run` prints for a file that does not open (the loader's GGUFError)."""
    with pytest.raises(GGUFError) as ei:
        open_gguf(str(path))
    return f"error: {ei.value}"


class Gated:
    """`gguf-run serve PATH` (gated_serve.py) on a free port: its URL once bound, and the lines it
    writes on stdout (the port, then "waiting" per request that waits for the load)."""

    def __init__(self, path: Path, *more: str) -> None:
        self.p = subprocess.Popen([sys.executable, str(GATED), "serve", str(path), "--name", "m", "--backend", "numpy",
                                   "--port", "0", "-c", "64", *more], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.line()}"

    def _read(self) -> None:
        for line in self.p.stdout:
            self.lines.put(line.strip())
        self.lines.put(None)

    def line(self) -> str:
        line = self.lines.get(timeout=TIMEOUT)
        assert line is not None, f"exited {self.p.poll()}: {self.p.stderr.read()}"
        return line

    def go(self) -> None:
        """Let the load go on."""
        self.p.stdin.close()

    def first(self, route: str) -> httpx.Response:
        """GET ``route`` once the server accepts connections (it listens a moment after binding)."""
        end = time.monotonic() + TIMEOUT
        while True:
            try:
                return httpx.get(self.url + route)
            except httpx.ConnectError:
                assert self.p.poll() is None and time.monotonic() < end, "never listened"
                time.sleep(0.05)

    def stop(self, sig: int = signal.SIGINT, timeout: float = TIMEOUT) -> tuple[int, str]:
        """(exit status, stderr) after ``sig``."""
        if self.p.poll() is None:
            self.p.send_signal(sig)
        try:
            rc = self.p.wait(timeout)
        finally:
            if self.p.poll() is None:
                self.p.kill()
        return rc, self.p.stderr.read()


def in_thread(fn, *args, **kw) -> tuple[threading.Thread, dict]:
    out: dict = {}
    t = threading.Thread(target=lambda: out.update(r=fn(*args, **kw)), daemon=True)
    t.start()
    return t, out


def until(pred) -> bool:
    end = time.monotonic() + TIMEOUT
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.05)
    return False


def test_health_is_503_while_the_model_loads_then_ok(files):
    s = Gated(files["good"])
    try:
        for route in ("/health", "/v1/health"):
            r = s.first(route)
            assert r.status_code == 503 and r.json() == LOADING, (route, r.text)
        # what needs no loaded model answers as for a model not loaded: from the file's header
        assert [m["name"] for m in httpx.get(s.url + "/api/tags").json()["models"]] == ["m:latest"]
        assert [m["id"] for m in httpx.get(s.url + "/v1/models").json()["data"]] == ["m:latest"]
        show = httpx.post(s.url + "/api/show", json={"model": "m"})
        assert show.status_code == 200 and "num_ctx                        64" in show.json()["parameters"]
        assert httpx.get(s.url + "/api/ps").json() == {"models": []}
        assert httpx.get(s.url + "/api/version").status_code == 200
        s.go()
        assert until(lambda: httpx.get(s.url + "/health").status_code == 200)
        for route in ("/health", "/v1/health"):
            assert httpx.get(s.url + route).json() == {"status": "ok"}
        assert [m["name"] for m in httpx.get(s.url + "/api/ps").json()["models"]] == ["m:latest"]
    finally:
        rc, err = s.stop()
    assert rc == 0 and "Traceback" not in err, err
    assert f"serving m:latest (numpy, one request at a time, context 64) on {s.url}\n" in err, err


def test_a_request_sent_during_the_load_waits_and_is_answered(files):
    s = Gated(files["good"])
    try:
        assert s.first("/health").status_code == 503
        t, got = in_thread(httpx.post, s.url + "/api/generate", json=GREEDY, timeout=TIMEOUT)
        t2, got2 = in_thread(httpx.post, s.url + "/v1/completions", timeout=TIMEOUT,
                             json={"model": "m", "prompt": "Hello", "max_tokens": 3, "temperature": 0})
        assert s.line() == s.line() == "waiting"  # both arrived while it loads
        s.go()
        t.join(TIMEOUT)
        t2.join(TIMEOUT)
        r, r2 = got["r"], got2["r"]
        assert r.status_code == 200 and r.json()["done"], r.text
        assert r2.status_code == 200 and r2.json()["choices"][0]["text"], r2.text
        again = httpx.post(s.url + "/api/generate", json=GREEDY)  # asked again, loaded: the same answer
        assert again.status_code == 200 and again.json()["response"] == r.json()["response"]
    finally:
        rc, err = s.stop()
    assert rc == 0 and "Traceback" not in err, err


def test_requests_waiting_for_the_load_are_bounded_by_max_queue(files):
    """Each request waiting for the load holds its body: past --max-queue of them the next gets the
    queue's 503 at once (no unbounded memory while a big model loads); the waiting ones are served."""
    s = Gated(files["good"], "--max-queue", "2")
    try:
        assert s.first("/health").status_code == 503
        waiting = [in_thread(httpx.post, s.url + "/api/generate", json=GREEDY, timeout=TIMEOUT) for _ in range(2)]
        assert s.line() == s.line() == "waiting"
        r = httpx.post(s.url + "/api/generate", json=GREEDY)
        assert r.status_code == 503 and "waiting for a model to load" in r.json()["error"], r.text
        s.go()
        for t, got in waiting:
            t.join(TIMEOUT)
            assert got["r"].status_code == 200, got["r"].text
    finally:
        rc, err = s.stop()
    assert rc == 0 and "Traceback" not in err, err


def test_a_models_folder_is_listed_during_the_load(tmp_path):
    """serve --models: the folder's other models are listed from their headers while the first one
    loads, and a request naming one of them waits for that load, then for its own, and is answered."""
    first = write_micro(Micro(seed=3), tmp_path / "m.gguf")
    write_micro(Micro(seed=4), tmp_path / "other.gguf")
    s = Gated(first, "--models", str(tmp_path))
    try:
        assert s.first("/health").status_code == 503
        assert until(lambda: len(httpx.get(s.url + "/api/tags").json()["models"]) == 2)
        names = [m["name"] for m in httpx.get(s.url + "/api/tags").json()["models"]]
        assert names == ["m:latest", "other:latest"], names
        t, got = in_thread(httpx.post, s.url + "/api/generate", json={**GREEDY, "model": "other"}, timeout=TIMEOUT)
        assert s.line() == "waiting"
        s.go()
        t.join(TIMEOUT)
        assert got["r"].status_code == 200 and got["r"].json()["model"] == "other:latest", got["r"].text
    finally:
        rc, err = s.stop()
    assert rc == 0 and "Traceback" not in err, err


def test_a_file_that_is_not_gguf_is_the_one_line_of_before(files):
    p = subprocess.run([sys.executable, "-m", "gguf_runtime", "serve", str(files["text"]), "--backend", "numpy",
                        "--port", "0"], capture_output=True, text=True, timeout=TIMEOUT)
    assert (p.returncode, p.stderr) == (2, load_error(files["text"]) + "\n")


def test_a_load_that_fails_ends_the_server_and_the_requests_waiting(files):
    """A truncated file (its header reads: listed, a request for it waits): the load's error is the
    waiting request's 503 and the server's one line; it exits 2 and stops listening."""
    s = Gated(files["truncated"])
    try:
        assert s.first("/health").json() == LOADING
        t, got = in_thread(httpx.post, s.url + "/api/chat", timeout=TIMEOUT,
                           json={"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": False})
        assert s.line() == "waiting"
        s.go()
        t.join(TIMEOUT)
        r = got["r"]
        assert r.status_code == 503 and "did not load" in r.json()["error"] and "truncated" in r.json()["error"], r.text
        rc = s.p.wait(TIMEOUT)
    finally:
        rc, err = s.stop()
    assert (rc, err) == (2, load_error(files["truncated"]) + "\n")
    with pytest.raises(httpx.ConnectError):
        httpx.get(s.url + "/health")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["int", "term"])
def test_a_signal_during_the_load_exits_at_once(files, sig):
    """The load never finishes here: the server exits without waiting for it, as Ctrl-C during a
    load always did (130), with no traceback. (The limit is below the 30 s a wait for the loading
    scheduler's thread would take.)"""
    s = Gated(files["good"])
    assert s.first("/health").status_code == 503
    rc, err = s.stop(sig, timeout=15)
    assert rc == 130 and err.strip() == "", err


def test_a_signal_ends_the_requests_waiting_for_the_load_at_once(files):
    """A request waiting for the load when the server is told to stop gets the 503 of a server
    shutting down at once, not a connection cut at the end of the graceful shutdown."""
    s = Gated(files["good"])
    try:
        assert s.first("/health").status_code == 503
        t, got = in_thread(httpx.post, s.url + "/api/generate", json=GREEDY, timeout=TIMEOUT)
        assert s.line() == "waiting"
        s.p.send_signal(signal.SIGINT)
        t.join(TIMEOUT)
        r = got.get("r")
        assert r is not None and r.status_code == 503 and "shutting down" in r.json()["error"], got
    finally:
        rc, err = s.stop(timeout=15)
    assert rc == 130 and "Traceback" not in err, err
