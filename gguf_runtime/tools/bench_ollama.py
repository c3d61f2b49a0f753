"""The Ollama side of `gguf-run bench --ollama URL --ollama-model NAME`.

A small client of Ollama's REST API (stdlib urllib, no dependency): ``check`` makes sure the
server answers and has the model before any benchmark runs, ``generate`` posts one
``/api/generate`` request (``stream: false``, ``raw: true``: the same text gguf-run evaluates,
with no template) and ``rates`` turns the documented timing fields (durations in nanoseconds) into
the prompt eval and eval rates ``ollama run --verbose`` prints.
"""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.parse
import urllib.request

from .bench import Rate
from ..errors import GGUFRunError

DEFAULT_URL = "http://127.0.0.1:11434"
CHECK_TIMEOUT = 10.0  # seconds for /api/version and /api/show
GENERATE_TIMEOUT = 900.0  # seconds for one /api/generate (a cold load of a large model included)
FIELDS = ("prompt_eval_count", "prompt_eval_duration", "eval_count", "eval_duration")

PARAGRAPH = ("The old lighthouse stood at the edge of the cliff, its white paint worn thin by a century of "
             "salt and wind. Every evening the keeper climbed the spiral stairs, trimmed the wick, and "
             "watched the beam sweep across the dark water toward the fishing boats returning home. "
             "Engineers later replaced the lamp with an electric light and a clockwork motor, but the "
             "villagers still told stories about the storms, the shipwrecks, and the quiet people who "
             "kept the light burning through long winter nights. ")


class OllamaError(GGUFRunError):
    """Ollama cannot be reached, lacks the model, or answered something unexpected."""


def normalize_url(url: str) -> str:
    u = url.strip().rstrip("/")
    if "://" not in u:
        u = "http://" + u
    parts = urllib.parse.urlsplit(u)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise OllamaError(f"--ollama {url!r} is not an http(s) URL like {DEFAULT_URL}")
    return u


def bench_prompts(tokenizer, n_prompt: int, count: int) -> list[str]:
    """``count`` different texts of about n_prompt tokens (at most n_prompt with BOS) under our
    tokenizer: a numbered note and a fixed paragraph. Each starts differently so that neither
    side reuses a cached prefix from the previous request."""
    out = []
    for i in range(count):
        text = f"Note {i + 1}. " + PARAGRAPH * (n_prompt // 40 + 2)
        ids = tokenizer.encode(text, add_special=True)
        body = [t for t in ids if t != tokenizer.bos_id]
        k = max(1, n_prompt - (len(ids) - len(body)))
        while True:
            text = tokenizer.decode(body[:k]).strip()
            if len(tokenizer.encode(text, add_special=True)) <= n_prompt or k <= 1:
                break
            k -= 1
        out.append(text)
    return out


class Ollama:
    def __init__(self, url: str, model: str) -> None:
        self.url, self.model = normalize_url(url), model
        self.version = ""

    def _request(self, path: str, body: dict | None, timeout: float) -> dict:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method="GET" if body is None else "POST",
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as e:
            text = e.read().decode(errors="replace")
            try:
                msg = str(json.loads(text).get("error", ""))
            except (ValueError, AttributeError):
                msg = text.strip()[:200]
            if e.code == 404 or "not found" in msg.lower():
                if path == "/api/version":
                    raise OllamaError(f"{self.url} does not answer like Ollama (HTTP 404 on /api/version); "
                                      "is the URL right?") from None
                raise OllamaError(f"Ollama has no model '{self.model}' (ollama pull {self.model})") from None
            raise OllamaError(f"Ollama at {self.url} answered HTTP {e.code} on {path}: {msg or e.reason}") from None
        except (urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", e)
            if isinstance(reason, (TimeoutError, socket.timeout)):
                why = f"no answer in {timeout:.0f} s"
            elif isinstance(reason, ConnectionRefusedError):
                why = "connection refused"
            else:
                why = str(reason).splitlines()[0][:120] if str(reason) else type(reason).__name__
            raise OllamaError(f"cannot reach Ollama at {self.url} ({why}); is `ollama serve` running?") from None
        try:
            out = json.loads(raw)
        except ValueError:
            raise OllamaError(f"Ollama at {self.url} sent an answer on {path} that is not JSON") from None
        if not isinstance(out, dict):
            raise OllamaError(f"Ollama at {self.url} sent an unexpected answer on {path}")
        if out.get("error"):
            raise OllamaError(f"Ollama at {self.url}: {out['error']}")
        return out

    def check(self) -> None:
        """The server answers and has the model (before any time goes into our own benchmark)."""
        self.version = str(self._request("/api/version", None, CHECK_TIMEOUT).get("version", ""))
        self._request("/api/show", {"model": self.model, "name": self.model}, CHECK_TIMEOUT)

    def generate(self, prompt: str, n_gen: int, seed: int, n_ctx: int) -> dict:
        out = self._request("/api/generate", {
            "model": self.model, "prompt": prompt, "stream": False, "raw": True,
            "options": {"num_predict": n_gen, "temperature": 0, "seed": seed, "num_ctx": n_ctx},
        }, GENERATE_TIMEOUT)
        missing = [k for k in FIELDS if not isinstance(out.get(k), (int, float))]
        if missing:
            raise OllamaError(f"Ollama's answer lacks {', '.join(missing)}; is {self.url} an Ollama server?")
        return out

    def rates(self, prompts: list[str], n_prompt: int, n_gen: int, seed: int,
              n_ctx: int) -> tuple[Rate, Rate, float, list[dict]]:
        """(prompt eval, eval, load seconds of the first request, the answers' timing fields);
        prompts[0] warms up (and loads the model), the others are timed."""
        answers = []
        for p in prompts:
            a = self.generate(p, n_gen, seed, n_ctx)
            answers.append({k: a.get(k) for k in (*FIELDS, "load_duration", "total_duration", "done_reason")})
        timed = answers[1:]
        pp = [a["prompt_eval_count"] / (a["prompt_eval_duration"] / 1e9) for a in timed if a["prompt_eval_duration"]]
        tg = [a["eval_count"] / (a["eval_duration"] / 1e9) for a in timed if a["eval_duration"]]
        if not pp or not tg:
            raise OllamaError("Ollama reported zero durations; cannot compute its rates")
        load = (answers[0].get("load_duration") or 0) / 1e9
        return (Rate(f"pp{n_prompt}", "ollama", n_prompt, pp), Rate(f"tg{n_gen}", "ollama", n_gen, tg), load,
                answers)
