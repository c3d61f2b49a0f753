"""Structured output (engine/constraint.py, llguidance): every output of a random model under a JSON
schema or grammar parses and obeys it; schemas and grammars the engine cannot use stop with one
line; `gguf-run run --json-schema / --grammar` end to end on the numpy backend."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from gguf_runtime.engine.constraint import Constraint, compile_grammar
from gguf_runtime.engine.engine import Engine
from gguf_runtime.errors import GrammarError
from gguf_runtime.format.tokenizer import Tokenizer
from gguf_runtime.sampling import SamplingParams

from micro_models import VOCAB_DIR, Micro, write_micro
from test_cli import assert_one_line_error, run

# bounded schemas (no extra properties, bounded strings, numbers and arrays): a random model ends them
SCHEMAS = [
    {"type": "object", "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["age"], "additionalProperties": False},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "tag": {"enum": ["red", "green", "blue"]}},
     "required": ["ok", "tag"], "additionalProperties": False},
    {"type": "array", "items": {"type": "string", "maxLength": 4}, "minItems": 1, "maxItems": 3},
    {"type": "object", "additionalProperties": False, "required": ["p", "q"],
     "properties": {"p": {"type": "object", "properties": {"x": {"type": "integer", "minimum": -5, "maximum": 5}},
                          "required": ["x"], "additionalProperties": False},
                    "q": {"type": "array", "items": {"enum": [1, 2, 3]}, "maxItems": 2}}},
    {"type": "object", "additionalProperties": False, "required": ["name", "kind"],
     "properties": {"name": {"type": "string", "maxLength": 6, "pattern": "^[a-z]+$"},
                    "kind": {"anyOf": [{"const": "cat"}, {"const": "dog"}]}}},
]


def check(value, schema):
    """The schema's rules these tests use (jsonschema's Draft 2020 semantics for them)."""
    if "enum" in schema:
        assert value in schema["enum"]
    if "const" in schema:
        assert value == schema["const"]
    if "anyOf" in schema:
        assert any(value == s.get("const") for s in schema["anyOf"])
    t = schema.get("type")
    if t == "object":
        assert isinstance(value, dict) and set(schema.get("required", ())) <= set(value)
        if schema.get("additionalProperties") is False:
            assert set(value) <= set(schema["properties"])
        for k, v in value.items():
            check(v, schema["properties"][k])
    elif t == "array":
        assert isinstance(value, list) and schema.get("minItems", 0) <= len(value) <= schema.get("maxItems", 1e9)
        for v in value:
            check(v, schema["items"])
    elif t == "integer":
        assert isinstance(value, int) and not isinstance(value, bool)
        assert schema.get("minimum", -1e18) <= value <= schema.get("maximum", 1e18)
    elif t == "string":
        assert isinstance(value, str) and len(value) <= schema.get("maxLength", 1e9)
        if "pattern" in schema:
            assert re.search(schema["pattern"], value)
    elif t == "boolean":
        assert isinstance(value, bool)


@pytest.fixture(scope="module")
def vocab():
    tok = Tokenizer.from_gguf(VOCAB_DIR / "ggml-vocab-llama-bpe.gguf")
    return tok, len(tok.tokens)


def constrained_argmax(tok, n, grammar, rng, scale=3.0, budget=400):
    """Greedy decoding of random logits under a grammar: the token ids up to the end of generation."""
    c = Constraint(tok, n, grammar)
    out = []
    for _ in range(budget):
        t = int(np.argmax(c.apply(rng.standard_normal(n).astype(np.float32) * scale)))
        if t in tok.eog_ids:
            return out
        out.append(t)
        c.advance(t)
    raise AssertionError(f"no end after {budget} tokens: {tok.decode(out)[:200]!r}")


@pytest.mark.parametrize("i", range(len(SCHEMAS)))
def test_random_logits_under_a_schema_give_valid_json(vocab, i):
    tok, n = vocab
    schema = SCHEMAS[i]
    grammar = compile_grammar("json_schema", schema)
    for seed in range(3):
        text = tok.decode(constrained_argmax(tok, n, grammar, np.random.default_rng(seed)))
        check(json.loads(text), schema)
        assert text == json.dumps(json.loads(text), ensure_ascii=False), "not compact JSON"


def test_objects_with_properties_hold_only_theirs(vocab):
    """A schema's objects with properties and no word on additionalProperties hold only those keys (as
    llama.cpp and Ollama read it; the model had filled them with keys of its own until its budget
    ran out); one that allows more, or an object without properties, stays open."""
    tok, n = vocab
    inner = {"type": "object", "properties": {"b": {"enum": [1, 2]}}, "required": ["b"]}
    schema = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}, "in": inner},
              "required": ["a", "in"]}
    grammar = compile_grammar("json_schema", schema)
    for seed in range(4):
        value = json.loads(tok.decode(constrained_argmax(tok, n, grammar, np.random.default_rng(seed))))
        assert set(value) == {"a", "in"} and set(value["in"]) == {"b"}, value
    from gguf_runtime.engine.constraint import closed_objects
    assert closed_objects({"type": "object"}, bare=False) == {"type": "object"}
    assert closed_objects({"type": "object"}) == {"type": "object", "additionalProperties": False}
    open_one = {"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": True}
    assert closed_objects(open_one, bare=False) == open_one
    assert closed_objects({"$defs": {"P": inner}, "$ref": "#/$defs/P"}, bare=False)["$defs"]["P"][
        "additionalProperties"] is False
    # an allOf's branches each hold part of the keys: closing each would refuse the others' keys
    both = {"allOf": [{"type": "object", "properties": {"a": {"const": 1}}, "required": ["a"]},
                      {"type": "object", "properties": {"b": {"const": 2}}, "required": ["b"]}]}
    assert closed_objects(both, bare=False)["allOf"][0]["required"] == ["a", "b"]
    with_ref = {"$defs": {"B": both["allOf"][1]}, "allOf": [both["allOf"][0], {"$ref": "#/$defs/B"}]}
    assert "additionalProperties" not in closed_objects(with_ref, bare=False)["allOf"][0]
    value = json.loads(tok.decode(constrained_argmax(tok, n, compile_grammar("json_schema", both),
                                                     np.random.default_rng(0))))
    assert value["a"] == 1 and value["b"] == 2, value


def test_gbnf_and_regex_grammars(vocab):
    tok, n = vocab
    g = compile_grammar("gbnf", 'root ::= "answer: " ("yes" | "no")')
    for seed in range(3):
        assert tok.decode(constrained_argmax(tok, n, g, np.random.default_rng(seed))) in ("answer: yes", "answer: no")
    r = compile_grammar("regex", r"[0-9]{3}-[a-z]{2}")
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", tok.decode(constrained_argmax(tok, n, r, np.random.default_rng(0))))


def test_the_mask_forbids_and_allows(vocab):
    tok, n = vocab
    c = Constraint(tok, n, compile_grammar("json", None))
    allowed = c.allowed()
    assert allowed.shape == (n,) and allowed[tok.encode("{", add_special=False)[0]]
    assert not allowed[tok.encode("hello", add_special=False)[0]]
    logits = np.zeros(n, np.float32)
    masked = c.apply(logits)
    assert (masked[~allowed] == -np.inf).all() and (masked[allowed] == 0).all() and (logits == 0).all()


@pytest.mark.parametrize("kind,spec,words", [
    ("json_schema", "{not json", ["not valid json"]),
    ("json_schema", "[1, 2]", ["json object"]),
    ("json_schema", {"type": "bogus"}, ["json_schema"]),
    ("gbnf", "root ::= undefined-rule", ["gbnf"]),
    ("regex", "([", ["regex"]),
    ("yaml", "a: 1", ["unknown grammar kind"]),
    ("json_schema", {"type": "string", "pattern": "(?<=a)b"}, ["look-around", "not supported", "(?<=a)b"]),
    ("regex", "(?<=a)b", ["look-around"]),
])
def test_unusable_schemas_and_grammars_name_the_problem(kind, spec, words):
    with pytest.raises(GrammarError) as e:
        compile_grammar(kind, spec)
    msg = str(e.value)
    assert "\n" not in msg and all(w in msg.lower() for w in words), msg


def test_a_grammar_nothing_matches_fails_before_any_work(vocab):
    """A schema that only refers to itself compiles, but no output matches it: the Constraint refuses
    it at once (it gave an empty 200 answer), and one whose required property refers back to it
    fails at its first token with a hint at that recursion."""
    tok, n = vocab
    with pytest.raises(GrammarError, match="admits no output at all") as e:
        Constraint(tok, n, compile_grammar("json_schema", {"$ref": "#"}))
    assert "\n" not in str(e.value)
    c = Constraint(tok, n, compile_grammar("json_schema", {"type": "object", "properties": {"a": {"$ref": "#"}},
                                                           "required": ["a"]}))
    with pytest.raises(GrammarError, match="refer back") as e:
        c.advance(int(c.allowed().nonzero()[0][0]))
    assert "\n" not in str(e.value)


@pytest.fixture(scope="module")
def micro_path(tmp_path_factory):
    return write_micro(Micro(vocab="gpt-2", n_vocab=None, seed=3), tmp_path_factory.mktemp("m") / "micro.gguf")


def test_engine_generates_schema_valid_json_on_the_numpy_backend(micro_path):
    eng = Engine(micro_path, backend="numpy", n_ctx=512)
    schema = SCHEMAS[3]
    for seed in range(2):
        con = eng.constraint("json_schema", schema)
        gen = eng.generate(eng.encode_raw("data:"), n_predict=200,
                           params=SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=seed),
                           constraint=con)
        text = gen.text()
        assert gen.stats.stop_reason == "stop", text
        check(json.loads(text), schema)


def test_cli_json_schema_and_grammar(micro_path, tmp_path):
    schema = json.dumps(SCHEMAS[1])
    rc, out, err = run(str(micro_path), "-p", "x", "--raw", "--backend", "numpy", "-n", "100", "--json-schema",
                       schema, "--quiet")
    assert rc == 0, err
    check(json.loads(out), SCHEMAS[1])
    g = tmp_path / "yn.gbnf"
    g.write_text('root ::= "yes" | "no"\n')
    rc, out, err = run(str(micro_path), "-p", "x", "--raw", "--backend", "numpy", "-n", "20", "--grammar", str(g),
                       "--quiet")
    assert rc == 0 and out.strip() in ("yes", "no"), (out, err)
    assert_one_line_error(run(str(micro_path), "-p", "x", "--json-schema", "{oops"), "json")
    for not_an_object in ("[1, 2]", "true", '"x"'):
        assert_one_line_error(run(str(micro_path), "-p", "x", "--json-schema", not_an_object), "not an object")
    assert_one_line_error(run(str(micro_path), "-p", "x", "--grammar", str(tmp_path / "missing.gbnf")), "cannot read")


def S(props, required=None, **kw):
    """An object schema with no extra properties (every one required unless told)."""
    return {"type": "object", "properties": props, "required": list(props) if required is None else required,
            "additionalProperties": False, **kw}


STR = {"type": "string", "maxLength": 24}
# 30 varied schemas: nested objects, arrays, enums, required and optional fields, string formats,
# numbers with bounds, unions, constants; every string and array bounded, so any model ends them
VARIED = [
    ("a person", S({"name": STR, "age": {"type": "integer", "minimum": 0, "maximum": 120}})),
    ("a city", S({"city": STR, "country": STR, "population": {"type": "integer", "minimum": 0, "maximum": 10**8}})),
    ("a yes/no answer to: is the sky blue?", S({"answer": {"type": "boolean"}})),
    ("a traffic light state", S({"light": {"enum": ["red", "yellow", "green"]}})),
    ("three colours", {"type": "array", "items": STR, "minItems": 3, "maxItems": 3}),
    ("a shopping list", S({"items": {"type": "array", "items": STR, "minItems": 1, "maxItems": 4}})),
    ("a point", S({"x": {"type": "number", "minimum": -100, "maximum": 100},
                   "y": {"type": "number", "minimum": -100, "maximum": 100}})),
    ("a book", S({"title": STR, "author": S({"first": STR, "last": STR}), "year": {"type": "integer",
                                                                               "minimum": 1000, "maximum": 2100}})),
    ("a meeting date", S({"date": {"type": "string", "format": "date"}})),
    ("a log entry time", S({"at": {"type": "string", "format": "date-time"}, "level": {"enum": ["info", "warn"]}})),
    ("a contact", S({"email": {"type": "string", "format": "email", "maxLength": 40}, "name": STR})),
    ("an id", S({"id": {"type": "string", "format": "uuid"}})),
    ("a server", S({"host": {"type": "string", "format": "ipv4"}, "port": {"type": "integer", "minimum": 1,
                                                                             "maximum": 65535}})),
    ("a product", S({"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"}, "price": {
        "type": "number", "minimum": 0, "maximum": 1000}})),
    ("a grade", S({"grade": {"type": "string", "enum": ["A", "B", "C", "D", "F"]}, "pass": {"type": "boolean"}})),
    ("a matrix 2x2", S({"m": {"type": "array", "minItems": 2, "maxItems": 2, "items": {
        "type": "array", "minItems": 2, "maxItems": 2, "items": {"type": "integer", "minimum": -9, "maximum": 9}}}})),
    ("an optional nickname", S({"name": STR, "nickname": STR}, required=["name"])),
    ("a pet", S({"kind": {"const": "cat"}, "lives": {"type": "integer", "minimum": 1, "maximum": 9}})),
    ("a shape", {"anyOf": [S({"circle": {"type": "number", "minimum": 0, "maximum": 10}}),
                           S({"square": {"type": "number", "minimum": 0, "maximum": 10}})]}),
    ("a nullable note", S({"note": {"anyOf": [STR, {"type": "null"}]}})),
    ("tags", S({"tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}})),
    ("a temperature", S({"celsius": {"type": "number", "minimum": -50, "maximum": 60}, "unit": {"const": "C"}})),
    ("a weekday", {"enum": ["mon", "tue", "wed", "thu", "fri", "sat", "sun"]}),
    ("a count", {"type": "integer", "minimum": 0, "maximum": 100}),
    ("a word", {"type": "string", "minLength": 1, "maxLength": 12}),
    ("a team", S({"lead": S({"name": STR}), "members": {"type": "array", "maxItems": 3, "items": S({"name": STR})}})),
    ("an address", S({"street": STR, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}, "city": STR})),
    ("a rating", S({"stars": {"type": "integer", "minimum": 1, "maximum": 5}, "comment": STR})),
    ("a flag set", S({"a": {"type": "boolean"}, "b": {"type": "boolean"}, "c": {"type": "boolean"}})),
    ("an event", S({"name": STR, "when": S({"date": {"type": "string", "format": "date"},
                                            "hour": {"type": "integer", "minimum": 0, "maximum": 23}}),
                    "attendees": {"type": "integer", "minimum": 0, "maximum": 500}})),
]


@pytest.fixture(scope="module")
def default_engine():
    from gguf_runtime.cli.default_model import default_model_path
    from gguf_runtime.errors import GGUFRunError
    try:
        path = default_model_path()
    except GGUFRunError as e:
        pytest.skip(str(e))
    return Engine(path, backend="numpy", n_ctx=1024)


def test_thirty_schemas_on_the_default_model(default_engine):
    """Greedy answers of the default model (SmolLM2) under 30 varied schemas: every one parses
    and validates (jsonschema, formats checked) and ends by itself (the grammar closed)."""
    jsonschema = pytest.importorskip("jsonschema")
    eng = default_engine
    checker = jsonschema.FormatChecker()
    for what, schema in VARIED:
        ids = eng.encode_chat([{"role": "user", "content": f"Give {what} as JSON."}])
        gen = eng.generate(ids, n_predict=300, params=SamplingParams(temperature=0),
                           constraint=eng.constraint("json_schema", schema))
        text = gen.text()
        assert gen.stats.stop_reason == "stop", (what, text)
        jsonschema.validate(json.loads(text), schema, format_checker=checker)
