"""llama-server's routes on `gguf-run serve`: /health (and /v1/health: ok, 503 "Loading model" during
the initial load), /tokenize, /detokenize and /apply-template in llama-server's shapes, checked
against the tokenizer and template themselves, for the model loaded and for one of the catalog
read from its header (not loaded for it); bad input is one 4xx in OpenAI's error shape. Micro
models (numpy backend, 127.0.0.1): Llama-3's BPE vocabulary (a character split across tokens:
byte pieces) and Llama-2's SPM one (a space prefix, a BOS the template writes too)."""

from __future__ import annotations

import threading

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from gguf_runtime.engine.engine import Engine  # noqa: E402
from gguf_runtime.format.chat_template import ChatTemplate  # noqa: E402
from gguf_runtime.format.gguf_file import open_gguf  # noqa: E402
from gguf_runtime.format.tokenizer import Tokenizer  # noqa: E402
from gguf_runtime.server.adapters import make_adapter  # noqa: E402
from gguf_runtime.server.app import Service  # noqa: E402
from live_server import live  # noqa: E402
from micro_models import Micro, write_micro  # noqa: E402

CTX = 64
MAX_BODY = 16 * 1024
CHATML = ("{% if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t.function.name }}{% endfor %}<|im_end|>\n"
          "{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% if reasoning_effort %}[{{ reasoning_effort }}] "
          "{% endif %}{% if flavor %}({{ flavor }}) {% endif %}{% endif %}")
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
WITH_BOS = ("{{ bos_token }}{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}[assistant]{% endif %}")
ASCII = "Hello world, how are you?"
MULTI = "Grüße aus 日本 🙂!"  # "ß", the CJK characters and the emoji are byte tokens in the cut vocabulary
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Grüße?"}]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    d = tmp_path_factory.mktemp("llama")
    paths = {"alpha": write_micro(Micro(vocab="llama-bpe", seed=1, chat_template=CHATML,
                                        added_tokens=("<|im_start|>", "<|im_end|>")), d / "alpha.gguf"),
             "beta": write_micro(Micro(vocab="llama-spm", seed=2, chat_template=WITH_BOS), d / "beta.gguf")}
    loads: list[str] = []

    def loader(path):
        loads.append(str(path))
        return make_adapter(Engine(str(path), backend="numpy", n_ctx=CTX))

    svc = Service(lambda: loader(paths["alpha"]), name="alpha", max_body=MAX_BODY,
                  catalog=[(k, str(p)) for k, p in paths.items()], loader=loader).start()
    with live(svc) as url:
        yield url, svc, paths, loads


@pytest.fixture(scope="module")
def url(served) -> str:
    return served[0]


def header(path):
    """The tokenizer and template of a file, read here (the reference the routes are checked against)."""
    meta = open_gguf(path, check_data=False).metadata
    return Tokenizer.from_metadata(meta), ChatTemplate.from_metadata(meta)


def post(url: str, route: str, body) -> httpx.Response:
    return httpx.post(url + route, json=body)


def piece_bytes(p) -> bytes:
    return p.encode("utf-8") if isinstance(p, str) else bytes(p)


# ---- /health -----------------------------------------------------------------------------------------
def test_health_is_ok_once_serving(url):
    for route in ("/health", "/v1/health"):
        r = httpx.get(url + route)
        assert r.status_code == 200 and r.json() == {"status": "ok"}


def test_health_is_503_during_the_initial_load(tmp_path):
    """Served before start() is done, as llama-server listens while it loads: its 503 and body, the
    text routes too; ok once the model is in."""
    path = write_micro(Micro(seed=3), tmp_path / "slow.gguf")
    release = threading.Event()

    def factory():
        release.wait(30)
        return make_adapter(Engine(str(path), backend="numpy", n_ctx=CTX))

    svc = Service(factory, name="slow")
    with live(svc) as url:
        starting = threading.Thread(target=svc.start)
        starting.start()
        try:
            for r in [httpx.get(url + "/health"), httpx.get(url + "/v1/health")] + [
                    post(url, route, {}) for route in ("/tokenize", "/detokenize", "/apply-template")]:
                assert r.status_code == 503 and r.json() == {
                    "error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}}, r.url
        finally:
            release.set()
            starting.join(60)
        assert httpx.get(url + "/health").json() == {"status": "ok"}
        assert post(url, "/tokenize", {"content": "a"}).status_code == 200


# ---- /tokenize, /detokenize ------------------------------------------------------------------------------
@pytest.mark.parametrize("model", [None, "alpha", "beta"])
def test_tokenize_is_the_tokenizer(served, model):
    """None: the loaded model's; beta: read from its file, with nothing loaded for it."""
    url, svc, paths, loads = served
    tok, _ = header(paths[model or "alpha"])
    named = {} if model is None else {"model": model}
    for text in (ASCII, MULTI, "<|im_start|>user"):
        assert post(url, "/tokenize", {"content": text, **named}).json() == {
            "tokens": tok.encode(text, add_special=False, parse_special=True)}
        for add, parse in ((True, True), (True, False), (False, False)):
            r = post(url, "/tokenize", {"content": text, "add_special": add, "parse_special": parse, **named})
            assert r.json()["tokens"] == tok.encode(text, add_special=add, parse_special=parse)
    assert loads == [str(paths["alpha"])]
    assert [m["name"] for m in httpx.get(url + "/api/ps").json()["models"]] == ["alpha:latest"]
    if model == "beta":  # (its header read once, kept for the next requests)
        assert svc.vocab("beta:latest", read=False) is svc.vocab("beta:latest") is not None


def test_tokenize_defaults_are_llama_servers(url, served):
    """No BOS (add_special false), special tokens' text parsed as them (parse_special true)."""
    tok, _ = header(served[2]["alpha"])
    ids = post(url, "/tokenize", {"content": "<|im_start|>x"}).json()["tokens"]
    assert ids == [tok.token_to_id["<|im_start|>"], tok.token_to_id["x"]]
    assert post(url, "/tokenize", {"content": ""}).json() == {"tokens": []}
    assert post(url, "/tokenize", {"content": "", "add_special": True}).json() == {"tokens": [tok.bos_id]}


def test_tokenize_with_pieces(served):
    """A piece that is UTF-8 is a string; one byte of a character split across tokens is a list of
    byte values; the pieces' bytes make the text."""
    url, _, paths, _ = served
    tok, _ = header(paths["alpha"])
    got = post(url, "/tokenize", {"content": MULTI, "with_pieces": True}).json()["tokens"]
    assert [t["id"] for t in got] == tok.encode(MULTI, add_special=False, parse_special=True)
    assert all(set(t) == {"id", "piece"} for t in got)
    assert b"".join(piece_bytes(t["piece"]) for t in got) == MULTI.encode("utf-8")
    assert {"id": tok.token_to_id["Ġworld"], "piece": " world"} in post(
        url, "/tokenize", {"content": ASCII, "with_pieces": True}).json()["tokens"]
    split = [t["piece"] for t in got if isinstance(t["piece"], list)]
    assert [0xC3] in split and [0x9F] in split  # "ß" as two byte tokens
    assert "ü" in [t["piece"] for t in got]  # a two-byte character of one token: a string


@pytest.mark.parametrize("text", [ASCII, MULTI])
def test_detokenize_round_trip(url, text):
    ids = post(url, "/tokenize", {"content": text}).json()["tokens"]
    assert post(url, "/detokenize", {"tokens": ids}).json() == {"content": text}


def test_detokenize_a_cut_character(served):
    """Tokens that end inside a character: its bytes so far are U+FFFD, as llama-server's JSON writes them."""
    url, _, paths, _ = served
    tok, _ = header(paths["alpha"])
    ids = tok.encode(MULTI, add_special=False)
    cut = next(k for k, t in enumerate(ids) if tok.token_to_bytes(t) == b"\xc3")  # "ß"'s first byte
    assert post(url, "/detokenize", {"tokens": ids[:cut + 1]}).json() == {"content": "Grü\N{REPLACEMENT CHARACTER}"}


def test_detokenize_is_llama_servers(served):
    """The pieces joined, special tokens' text included, the SPM space prefix kept (llama-server's
    tokens_to_str); beta's from its header."""
    url, _, paths, _ = served
    tok, _ = header(paths["beta"])
    ids = post(url, "/tokenize", {"model": "beta", "content": "Hello world", "add_special": True}).json()["tokens"]
    assert ids[0] == tok.bos_id
    assert post(url, "/detokenize", {"model": "beta", "tokens": ids}).json() == {"content": "<s> Hello world"}
    assert post(url, "/detokenize", {"model": "beta", "tokens": ids[1:]}).json() == {"content": " Hello world"}
    assert post(url, "/detokenize", {"tokens": []}).json() == {"content": ""}


# ---- /apply-template ------------------------------------------------------------------------------------
def test_apply_template_is_the_chat_prompt(served):
    """The template's text with the generation prompt, as /v1/chat/completions renders it; tokenized
    as llama-server's clients then do (BOS added, specials parsed), the chat route's prompt tokens."""
    url, svc, paths, _ = served
    tok, tpl = header(paths["alpha"])
    prompt = post(url, "/apply-template", {"messages": CHAT}).json()
    assert prompt == {"prompt": tpl.render(CHAT, add_generation_prompt=True)}
    assert prompt["prompt"].endswith("<|im_end|>\n<|im_start|>assistant\n")
    ids = post(url, "/tokenize", {"content": prompt["prompt"], "add_special": True}).json()["tokens"]
    assert ids == svc.engine.encode_chat(CHAT)
    kw = post(url, "/apply-template", {"messages": CHAT, "chat_template_kwargs": {"flavor": "terse"},
                                       "reasoning_effort": "low"}).json()
    assert kw["prompt"].endswith("<|im_start|>assistant\n[low] (terse) ")
    tools = post(url, "/apply-template", {"messages": CHAT, "tools": [TOOL]}).json()
    assert tools == {"prompt": "<|im_start|>system\nTools: get_weather<|im_end|>\n" + prompt["prompt"]}
    assert post(url, "/apply-template", {"messages": CHAT, "tools": [TOOL], "tool_choice": "none"}).json() == prompt
    parts = [{"role": "user", "content": [{"type": "text", "text": "Grü"}, {"type": "text", "text": "ße?"}]}]
    assert post(url, "/apply-template", {"messages": CHAT[:1] + parts}).json() == prompt


def test_apply_template_drops_the_bos_the_tokenizer_adds(served):
    """beta's template writes <s> and its tokenizer adds BOS: the prompt is without it, as llama.cpp's."""
    url, _, paths, loads = served
    _, tpl = header(paths["beta"])
    whole = tpl.render(CHAT, add_generation_prompt=True)
    assert whole.startswith("<s>[system]")
    assert post(url, "/apply-template", {"model": "beta", "messages": CHAT}).json() == {"prompt": whole[3:]}
    assert loads == [str(paths["alpha"])]


# ---- bad input ----------------------------------------------------------------------------------------
BAD = [
    ("/tokenize", {}, 400, "content must be a string"),
    ("/tokenize", {"content": 5}, 400, "content must be a string"),
    ("/tokenize", {"content": ["a", 1]}, 400, "content must be a string"),
    ("/tokenize", {"content": "a", "add_special": "yes"}, 400, "add_special must be true or false"),
    ("/tokenize", {"content": "a", "parse_special": 1}, 400, "parse_special must be true or false"),
    ("/tokenize", {"content": "a", "with_pieces": "true"}, 400, "with_pieces must be true or false"),
    ("/tokenize", {"content": "a", "model": "nope"}, 404, 'model "nope" not found'),
    ("/tokenize", {"content": "ab " * 4000}, 400, "content is 12,000 bytes, more than 64 tokens"),
    ("/tokenize", {"content": "a" * MAX_BODY}, 413, "the limit is"),
    ("/detokenize", {}, 400, "tokens must be a list"),
    ("/detokenize", {"tokens": "1 2"}, 400, "tokens must be a list"),
    ("/detokenize", {"tokens": [1, 4098]}, 400, "tokens[1] is 4098, not a token id of alpha:latest (0 to 4097)"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens[0] is -1, not a token id"),
    ("/detokenize", {"tokens": [1, 2, "3"]}, 400, 'tokens[2] is "3", not a token id'),
    ("/detokenize", {"tokens": [True]}, 400, "tokens[0] is true, not a token id"),
    ("/detokenize", {"tokens": [1.5]}, 400, "tokens[0] is 1.5, not a token id"),
    ("/detokenize", {"tokens": [1] * (CTX + 1)}, 400, f"tokens holds {CTX + 1} ids, more than the context of {CTX}"),
    ("/detokenize", {"tokens": [1], "model": "nope"}, 404, 'model "nope" not found'),
    ("/apply-template", {}, 400, "messages must be a list"),
    ("/apply-template", {"messages": []}, 400, "messages must not be empty"),
    ("/apply-template", {"messages": [{"content": "hi"}]}, 400, "messages[0] must be an object with a string role"),
    ("/apply-template", {"messages": [{"role": "user", "content": 3}]}, 400, "messages[0].content must be a string"),
    ("/apply-template", {"messages": CHAT, "chat_template_kwargs": []}, 400, "chat_template_kwargs must be an object"),
    ("/apply-template", {"messages": CHAT, "reasoning_effort": "max"}, 400, "reasoning_effort must be"),
    ("/apply-template", {"messages": CHAT, "tools": [{"type": "function", "function": {"name": 3}}]}, 400,
     "tools[0].function.name must be"),
    ("/apply-template", {"messages": CHAT, "tools": [TOOL], "model": "beta"}, 400,
     "beta:latest does not support tools"),
    ("/apply-template", {"messages": CHAT, "model": "nope"}, 404, 'model "nope" not found'),
]


@pytest.mark.parametrize("route,body,status,message", BAD)
def test_bad_input_is_one_openai_error(url, route, body, status, message):
    r = post(url, route, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert message in err["message"] and err["type"] == "invalid_request_error" and "param" in err
    assert err["code"] == ("model_not_found" if status == 404 else None)


@pytest.mark.parametrize("route", ["/tokenize", "/detokenize", "/apply-template"])
def test_junk_is_a_400(url, route):
    for junk in (b"{not json", b"[1, 2]", b'"text"', b"\xff\xfe"):
        r = httpx.post(url + route, content=junk, headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", (junk, r.text)
    r = httpx.get(url + route)  # (a POST route)
    assert r.status_code == 405 and "Method Not Allowed" in r.json()["error"]["message"]


def test_no_model_loaded(tmp_path):
    """Health is the server's: ok with no model loaded (keep_alive); the text routes then answer
    from the header of the model serve started with (not the one last loaded) and load nothing."""
    path = write_micro(Micro(seed=6), tmp_path / "idle.gguf")
    other = write_micro(Micro(vocab="llama-spm", seed=7), tmp_path / "other.gguf")
    loads: list[str] = []

    def loader(p):
        loads.append(str(p))
        return make_adapter(Engine(str(p), backend="numpy", n_ctx=CTX))

    svc = Service(lambda: loader(path), name="idle", catalog=[("other", str(other))], loader=loader).start()
    with live(svc) as url:
        assert post(url, "/api/generate", {"model": "other"}).json()["done_reason"] == "load"
        assert svc.unload() and httpx.get(url + "/api/ps").json() == {"models": []}
        assert httpx.get(url + "/health").json() == {"status": "ok"}
        tok, tpl = header(path)
        assert post(url, "/tokenize", {"content": MULTI}).json() == {"tokens": tok.encode(MULTI, add_special=False)}
        assert post(url, "/detokenize", {"tokens": [300, 301]}).json() == {
            "content": (tok.token_to_bytes(300) + tok.token_to_bytes(301)).decode()}
        assert post(url, "/apply-template", {"model": "idle", "messages": CHAT}).json() == {
            "prompt": tpl.render(CHAT, add_generation_prompt=True)}
        assert loads == [str(path), str(other)] and httpx.get(url + "/api/ps").json() == {"models": []}


def test_a_file_gone_since_listing_is_a_400(tmp_path):
    """The catalog's file read for its vocabulary no longer opens: one line, a 400; the server goes on."""
    paths = {k: write_micro(Micro(seed=s), tmp_path / f"{k}.gguf") for k, s in (("one", 4), ("two", 5))}
    svc = Service(lambda: make_adapter(Engine(str(paths["one"]), backend="numpy", n_ctx=CTX)), name="one",
                  catalog=[(k, str(p)) for k, p in paths.items()]).start()
    with live(svc) as url:
        paths["two"].write_bytes(b"GGUF\x03\x00")
        r = post(url, "/tokenize", {"model": "two", "content": "a"})
        assert r.status_code == 400 and r.json()["error"]["message"], r.text
        assert post(url, "/tokenize", {"model": "one", "content": "a"}).status_code == 200
