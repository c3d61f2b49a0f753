"""The hostile corpus (hostile_models.write_corpus) through the command line and the server, each
command in its own process under a memory limit and a timeout: one error line and exit 2 (or a
clean run), never a traceback, a hang or unbounded memory; the server refuses to start with one
line, or starts and answers a bad template with a JSON error and keeps serving."""

from __future__ import annotations

import json
import os
import re
import resource
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from hostile_models import GIANT_WORD, GIANT_WORDS, base_file, write_corpus

MEMORY = 4 << 30  # address space of each command (the corpus's worst took ~1 GiB without the checks)
TIMEOUT = 120  # a hang guard per command, far above what each takes


def _limit() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY, MEMORY))


def cli(*args: str, stdin: str | None = None) -> tuple[int, str, str]:
    p = subprocess.run([sys.executable, "-m", "gguf_runtime", *args], input=stdin, capture_output=True, text=True,
                       timeout=TIMEOUT, preexec_fn=_limit, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    return p.returncode, p.stdout, p.stderr


def one_error_line(rc: int, out: str, err: str, what: str) -> None:
    err = err.strip()
    assert rc == 2 and err.startswith("error: ") and "\n" not in err, (what, rc, err[-2000:])
    assert "\x1b" not in out + err and "Traceback" not in err, (what, err)


def clean_or_one_line(rc: int, out: str, err: str, what: str) -> None:
    assert "\x1b" not in out + err and "Traceback" not in err, (what, err[-2000:])
    if rc:
        one_error_line(rc, out, err, what)


def serve(path: str, kind: str, what: str) -> None:
    p = subprocess.Popen([sys.executable, "-m", "gguf_runtime", "serve", str(path), "--backend", "numpy",
                          "--port", "0", "-c", "256", "--name", "m", "-q"], stderr=subprocess.PIPE, text=True,
                         preexec_fn=_limit, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        line = p.stderr.readline()
        if kind == "metadata":
            rest = p.stderr.read()
            rc = p.wait(TIMEOUT)
            one_error_line(rc, "", line + rest, what)
            return
        m = re.search(r" on (http://\S+)", line)
        assert m, (what, line, p.stderr.read() if p.poll() is not None else "")
        import httpx

        url = m.group(1)
        host, port = url.removeprefix("http://").split(":")
        for _ in range(200):
            try:
                socket.create_connection((host, int(port)), timeout=1).close()
                break
            except OSError:
                time.sleep(0.05)
        r = httpx.post(url + "/api/chat", json={"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                 "stream": False}, timeout=TIMEOUT)
        assert 400 <= r.status_code < 600 and "error" in r.json(), (what, r.status_code, r.text[:300])
        msg = r.json()["error"]
        assert "\n" not in msg and "template" in msg, (what, msg)
        r = httpx.post(url + "/api/generate", json={"model": "m", "prompt": "hi", "raw": True, "stream": False,
                                                     "options": {"num_predict": 2, "temperature": 0}}, timeout=TIMEOUT)
        assert r.status_code == 200 and r.json()["done"], (what, r.status_code, r.text[:300])  # still serving
        p.send_signal(signal.SIGINT)
        assert p.wait(TIMEOUT) == 0, what
    finally:
        if p.poll() is None:
            p.kill()


def check_file(entry: tuple[str, object, str]) -> str:
    name, path, kind = entry
    path = str(path)
    rc, out, err = cli(path, "-p", "hi", "--backend", "numpy", "-n", "2")
    one_error_line(rc, out, err, f"run {name}")
    rc, out, err = cli("info", path)
    clean_or_one_line(rc, out, err, f"info {name}")
    rc, out, err = cli("tokenize", path, "Hello world")
    clean_or_one_line(rc, out, err, f"tokenize {name}")
    if kind == "template":
        assert rc == 0 and out.strip(), (name, err)
    serve(path, kind, f"serve {name}")
    return name


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus"))


def test_every_hostile_file_through_run_info_tokenize_and_serve(corpus):
    assert len(corpus) >= 50
    with ThreadPoolExecutor(max_workers=2) as pool:
        done = list(pool.map(check_file, corpus))
    assert len(done) == len(corpus)


@pytest.mark.parametrize("prompt", [GIANT_WORD, GIANT_WORDS], ids=["one 1 MB word", "1 MB of distinct words"])
def test_giant_prompts(tmp_path, prompt):
    """A megabyte prompt: `run` refuses it in one line before tokenizing (longer than the context
    could hold); `tokenize` reads it from stdin and tokenizes it, within the memory limit."""
    base = str(base_file(tmp_path))
    rc, out, err = cli(base, "--raw", "--backend", "numpy", "-n", "1", stdin=prompt)
    one_error_line(rc, out, err, "run giant prompt")
    assert "--ctx-size" in err, err
    rc, out, err = cli("tokenize", base, "-", "--json", stdin=prompt)
    assert rc == 0, err[-2000:]
    ids = json.loads(out)
    assert len(ids) > 1000
