"""`gguf-run bench`: llama-bench's table, --json, --plot, the Ollama comparison, one-line errors.

Runs on the CPU with the numpy backend and the default model, at tiny sizes (-p 16 -n 4 -r 2).
The CUDA-only rows (graph vs eager, batched generation) are driven through ``run_suite`` with a
stand-in backend that has the CUDA backend's methods; the Ollama comparison talks to a local HTTP
server that answers as Ollama's API documents.
"""

import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

from gguf_runtime.cli.app import main
from test_cli import assert_one_line_error

EXE = shutil.which("gguf-run", path=os.path.dirname(sys.executable)) or "gguf-run"
TINY = ["--backend", "numpy", "-p", "16", "-n", "4", "-r", "2"]


def run(*args, timeout=300):
    p = subprocess.run([EXE, *args], capture_output=True, text=True, timeout=timeout,
                       env={**os.environ, "PYTHONWARNINGS": "ignore"})
    return p.returncode, p.stdout, p.stderr


def cli(capsys, *args):
    rc = main(["bench", *args])
    out, err = capsys.readouterr()
    return rc, out, err


def parse_table(text):
    """(header, [cells by column name]) of the first markdown table in text."""
    lines = text[text.index("\n|") + 1:].splitlines()
    lines = lines[:next((i for i, ln in enumerate(lines) if not ln.startswith("|")), len(lines))]
    split = lambda ln: [c.strip() for c in ln.strip("|").split("|")]  # noqa: E731
    head = split(lines[0])
    return head, [dict(zip(head, split(ln))) for ln in lines[2:]]


def table_rows(out):
    """{(mode, test): cells} of the bench table."""
    head, rows = parse_table(out)
    return head, {(r["mode"], r["test"]): r for r in rows}


# ---- the table, --json, --plot on the numpy backend ---------------------------------------------
def test_table_has_llama_bench_columns_and_rows():
    rc, out, err = run("bench", *TINY, "-q")
    assert rc == 0, err
    assert out.startswith("device: ") and "backend: numpy" in out and "GB/s" in out.splitlines()[0]
    head, rows = table_rows(out)
    assert head == ["model", "size", "params", "backend", "mode", "test", "t/s", "GB/s", "share"]
    assert set(rows) == {("eager", "pp16"), ("eager", "tg4")}
    pp, tg = rows[("eager", "pp16")], rows[("eager", "tg4")]
    assert pp["model"] == "llama 135M Q4_1" and pp["backend"] == "numpy" and pp["params"] == "134.52 M"
    assert pp["size"].endswith("MiB")
    for r in (pp, tg):
        mean, stdev = r["t/s"].split(" ± ")
        assert float(mean) > 0 and float(stdev) >= 0
    assert pp["GB/s"] == "" and pp["share"] == ""  # prompt processing is not bandwidth-bound
    assert float(tg["GB/s"]) > 0 and tg["share"].endswith("%")
    assert "GB/s: bytes a decode step reads" in out


def test_json_has_device_model_and_every_run(capsys):
    rc, out, err = cli(capsys, *TINY, "--json", "--seed", "3")
    assert rc == 0, err
    res = json.loads(out)
    assert res["device"]["backend"] == "numpy" and res["device"]["name"]
    assert res["device"]["bandwidth_gbs"] > 0 and "numpy" in res["device"]["bandwidth_method"]
    assert res["model"]["params"] == 134515008 and res["model"]["label"] == "llama 135M Q4_1"
    assert res["settings"]["n_prompt"] == 16 and res["settings"]["seed"] == 3 and res["date"]
    assert "commit" in res
    assert [(r["test"], r["mode"]) for r in res["rows"]] == [("pp16", "eager"), ("tg4", "eager")]
    for r in res["rows"]:
        assert len(r["runs"]) == 2 and min(r["runs"]) <= r["median"] <= max(r["runs"])
        assert r["mean"] == pytest.approx(sum(r["runs"]) / 2)
    tg = res["rows"][1]
    assert tg["gbs"] == pytest.approx(tg["step_bytes"] * tg["mean"] / 1e9)
    assert tg["share"] == pytest.approx(tg["gbs"] / res["device"]["bandwidth_gbs"])


def test_batch_rows_on_numpy_print_one_note(capsys):
    rc, out, err = cli(capsys, *TINY, "--batch", "1,8,32", "--mode", "both", "-q")
    assert rc == 0, err
    notes = [ln for ln in err.splitlines() if "cuda backend" in ln]
    assert len(notes) == 1 and notes[0].startswith("note:") and "--batch 1,8,32" in notes[0], err
    assert set(table_rows(out)[1]) == {("eager", "pp16"), ("eager", "tg4")}


def test_plot_writes_a_png(tmp_path, capsys):
    png = tmp_path / "tput.png"
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert_one_line_error(cli(capsys, *TINY, "--plot", str(png)), "--plot needs matplotlib", "gguf-run[plot]")
        return
    rc, out, err = cli(capsys, *TINY, "--plot", str(png), "-q")
    assert rc == 0, err
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def no_model_load(monkeypatch):
    """Loading a model (the first step of any benchmark) fails the test: the error must come first."""
    from gguf_runtime.cli import bench_cmd

    def loaded(*a, **k):
        raise AssertionError("the model was loaded before the error")

    monkeypatch.setattr(bench_cmd, "Engine", loaded)


def test_plot_without_matplotlib_is_one_line_before_any_work(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    no_model_load(monkeypatch)
    result = cli(capsys, *TINY, "--plot", str(tmp_path / "x.png"))
    assert_one_line_error(result, "--plot needs matplotlib: pip install 'gguf-run[plot]'")
    assert result[1] == ""


@pytest.mark.parametrize("args,words", [
    (["--batch", "1,x"], ["--batch"]),
    (["--batch", "0"], ["--batch"]),
    (["--mode", "fast"], ["--mode"]),
    (["-r", "0"], ["repetitions"]),
    (["-p", "0", "-n", "0"], ["nothing to measure"]),
    (["-c", "8"], ["ctx-size", "too small"]),
    (["--backend", "tpu"], ["backend"]),
    (["--ollama", "http://127.0.0.1:1"], ["--ollama-model"]),
])
def test_bad_options_are_one_line(capsys, args, words):
    assert_one_line_error(cli(capsys, *TINY, *args), *words)


def test_help_shows_examples():
    rc, out, err = run("bench", "--help")
    assert rc == 0 and "Examples" in out and "--ollama" in out and "--batch 1,8,32,64" in out, out


# ---- graph/eager and batched rows, through a stand-in for the CUDA backend ---------------------
class FakeKV:
    def __init__(self):
        self.reserved = []
        self.k = np.zeros(1, np.float16)  # an f16 cache: the rows' bytes count 2 per element

    def reserve(self, seq, n, stream=None):
        self.reserved.append((seq, n))


class FakeCuda:
    """The methods of CudaBackend that the benchmarks call, recording graph use."""

    name = "cuda"

    def __init__(self, cfg):
        self.cfg, self.use_graph, self.max_batch, self.stream, self.kv = cfg, True, 8, None, FakeKV()
        self.prefill_graph = True
        self.steps, self.active, self.prefills, self.batch_params = [], set(), [], []

    def _work(self):
        time.sleep(2e-4)

    def truncate(self, n):
        pass

    def prefill(self, ids):
        self.prefills.append(self.prefill_graph)
        self._work()

    def start_decode(self, prompt, params, seed=0, keep=0):
        self.params = params
        self._work()

    def run_steps(self, n, params, graph=False):
        assert params == self.params
        self.steps.append(("single" if params.greedy else "sampled", graph and self.use_graph))
        self._work()

    def seq_add(self, slot, prompt, params, max_new, seed=None):
        assert slot not in self.active and len(prompt) == 128
        self.active.add(slot)
        self.batch_params.append(params)

    def batch_step(self, n):
        assert len(self.active) == n
        self.steps.append((f"B={n}", self.use_graph))
        self._work()

    def seq_release(self, slot):
        self.active.discard(slot)


@pytest.fixture(scope="module")
def model():
    from gguf_runtime.cli.default_model import default_model_path
    from gguf_runtime.format.gguf_file import open_gguf
    from gguf_runtime.format.model_config import config_from_gguf

    f = open_gguf(default_model_path())
    yield f, config_from_gguf(f)
    f.close()


def test_prefill_graph_rows_say_what_ran(model):
    """pp rows say graph only when the prefill graphs ran; a failed capture (the backend turns them
    off) labels the row eager and keeps them off; the eager row leaves them as they were."""
    from gguf_runtime.tools.bench import prefill_rate

    f, cfg = model
    be = FakeCuda(cfg)
    assert prefill_rate(be, 16, 2, graph=False).mode == "eager" and be.prefill_graph
    assert prefill_rate(be, 16, 2, graph=True).mode == "graph" and be.prefill_graph

    class Failing(FakeCuda):
        def prefill(self, ids):
            super().prefill(ids)
            self.prefill_graph = False  # as CudaBackend does when a capture fails

    be = Failing(cfg)
    r = prefill_rate(be, 16, 2, graph=True)
    assert r.mode == "eager" and not be.prefill_graph and len(r.runs) == 2


def test_suite_graph_and_eager_rows_with_batches(model, tmp_path):
    from gguf_runtime.tools.bench import Suite, kv_bytes_read, run_suite, weight_bytes_read
    from gguf_runtime.tools.bench_report import render_table, result

    f, cfg = model
    be = FakeCuda(cfg)
    seen = []
    rows = run_suite(be, f, cfg, Suite(16, 4, 2, ("graph", "eager"), (1, 4)), lambda *a: seen.append(a))
    assert [(r.test, r.mode) for r in rows] == [
        ("pp16", "graph"), ("pp16", "eager"), ("tg4", "graph"), ("tg4", "eager"), ("tg4", "graph, sampled"),
        ("B=1 tg4", "graph"), ("B=4 tg4", "graph"), ("B=1 tg4", "eager"), ("B=4 tg4", "eager"),
        ("B=1 tg4", "graph, sampled"), ("B=4 tg4", "graph, sampled")]
    assert seen[-1] == ("benchmarking", 11, 11)
    assert [p.temperature for p in be.batch_params] == [0.0] * 30 + [0.8] * 15  # (3 runs of B=1 and B=4 a row)
    # the graph row warms up twice (eager, then the capture), the eager row once; then 2 timed runs
    assert be.prefills == [True] * 4 + [False] * 3 and be.prefill_graph
    assert [len(r.runs) for r in rows[:2]] == [2, 2]
    assert ("sampled", True) in be.steps and be.params.top_k == 40  # the CLI's default sampling
    assert be.use_graph  # eager batched rows turn graphs off only while they run
    assert {g for k, g in be.steps if k == "B=4"} == {True, False}
    assert be.kv.reserved[0] == (0, 16)  # slot 0 gets pages for the single-sequence rows
    w = weight_bytes_read(f, cfg, "cuda")
    assert w == sum(t.nbytes for t in f.tensors.values())  # tied embeddings: the head reads them all
    b4 = rows[6]
    assert kv_bytes_read(cfg, 130.5, 2) == pytest.approx(kv_bytes_read(cfg, 130.5) / 2)
    assert b4.batch == 4 and b4.step_bytes == pytest.approx(w + 4 * kv_bytes_read(cfg, 128 + 2.5, 2))
    assert b4.gbs == pytest.approx(b4.step_bytes * b4.mean / 4 / 1e9)
    res = result(f=f, cfg=cfg, path=f.path, backend="cuda", device="Fake GPU", bandwidth=3000.0,
                 bandwidth_method="device-to-device copy (cupy)", weights_read=w, rows=rows,
                 settings={"n_gen": 4}, load_s=0.1)
    out = render_table(res)
    head, table = table_rows(out)
    assert ("graph", "B=4 tg4") in table and ("eager", "tg4") in table and table[("graph", "tg4")]["share"]
    if importlib.util.find_spec("matplotlib"):  # both lines, batch sizes on the x axis
        from gguf_runtime.tools.bench_report import plot

        plot(res, str(tmp_path / "b.png"))
        assert (tmp_path / "b.png").read_bytes()[:4] == b"\x89PNG"


# ---- the Ollama comparison against a local server with Ollama's documented answers ---------------
class OllamaStub(BaseHTTPRequestHandler):
    models = {"smollm2:135m"}
    log: list = []

    def _send(self, code, obj):
        data = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self.log.append((self.path, None))
        if self.path == "/api/version":
            self._send(200, {"version": "0.9.6"})
        else:
            self._send(404, {"error": "not found"})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.log.append((self.path, body))
        name = body.get("model")
        if self.path == "/api/show":
            if name in self.models:
                self._send(200, {"details": {"format": "gguf", "family": "llama", "parameter_size": "134.52M",
                                             "quantization_level": "Q4_1"}})
            else:
                self._send(404, {"error": f"model '{name}' not found"})
        elif self.path == "/api/generate":
            if name not in self.models:
                self._send(404, {"error": f"model \"{name}\" not found, try pulling it first"})
                return
            n = body["options"]["num_predict"]
            first = sum(1 for p, _ in self.log if p == "/api/generate") == 1
            self._send(200, {"model": name, "created_at": "2026-11-21T05:00:00.000000Z", "response": " word" * n,
                             "done": True, "done_reason": "length", "context": [1, 2, 3],
                             "total_duration": 1_600_000_000 if first else 20_000_000,
                             "load_duration": 1_500_000_000 if first else 2_000_000,
                             "prompt_eval_count": 14, "prompt_eval_duration": 7_000_000,
                             "eval_count": n, "eval_duration": n * 2_000_000})
        else:
            self._send(404, {"error": "not found"})

    def log_message(self, *args):
        pass


@pytest.fixture
def ollama():
    OllamaStub.log = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), OllamaStub)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", OllamaStub.log
    server.shutdown()
    server.server_close()


def test_ollama_side_by_side(ollama, capsys):
    url, log = ollama
    rc, out, err = cli(capsys, *TINY, "--ollama", url, "--ollama-model", "smollm2:135m", "--seed", "7", "-q")
    assert rc == 0, err
    assert [p for p, _ in log[:2]] == ["/api/version", "/api/show"]  # checked before the benchmark
    gens = [b for p, b in log if p == "/api/generate"]
    assert len(gens) == 3  # a warm-up request, then -r 2
    for b in gens:
        assert b["model"] == "smollm2:135m" and b["stream"] is False and b["raw"] is True
        assert b["options"] == {"num_predict": 4, "temperature": 0, "seed": 7, "num_ctx": 32}
    assert len({b["prompt"] for b in gens}) == 3  # no request can reuse the previous one's cache
    assert all(len(b["prompt"]) > 20 for b in gens)
    section = out[out.index("Ollama 0.9.6"):]
    head, rows = parse_table(section)
    assert head == ["test", "gguf-run numpy t/s", "Ollama t/s", "gguf-run / Ollama"]
    pp, tg = rows
    assert (pp["test"], tg["test"]) == ("pp16", "tg4")
    assert pp["Ollama t/s"] == "2000.00 ± 0.00" and tg["Ollama t/s"] == "500.00 ± 0.00"  # 14 / 7 ms, 4 / 8 ms
    for r in (pp, tg):
        ours, theirs = (float(r[k].split(" ± ")[0]) for k in ("gguf-run numpy t/s", "Ollama t/s"))
        assert r["gguf-run / Ollama"] == f"{ours / theirs:.2f}x"
    assert "Ollama 1.50 s" in section and "Ollama counted 14 prompt tokens, 4 generated" in section


def test_ollama_json(ollama, capsys):
    url, log = ollama
    rc, out, err = cli(capsys, *TINY, "--json", "--ollama", url, "--ollama-model", "smollm2:135m")
    assert rc == 0, err
    o = json.loads(out)["ollama"]
    assert o["model"] == "smollm2:135m" and o["version"] == "0.9.6" and o["load_s"]["ollama"] == 1.5
    assert [r["test"] for r in o["gguf_run"]] == [r["test"] for r in o["ollama"]] == ["pp16", "tg4"]
    assert o["ollama"][1]["median"] == 500.0 and len(o["answers"]) == 3
    assert 10 <= o["prompt_tokens"] <= 16


def test_ollama_missing_model_is_one_line(ollama, capsys, monkeypatch):
    url, log = ollama
    no_model_load(monkeypatch)  # found before our own benchmark ran
    result = cli(capsys, *TINY, "--ollama", url, "--ollama-model", "nope:7b")
    assert_one_line_error(result, "Ollama has no model 'nope:7b' (ollama pull nope:7b)")
    assert result[1] == "" and not any(p == "/api/generate" for p, _ in log)


def test_ollama_unreachable_is_one_line(capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    result = cli(capsys, *TINY, "--ollama", f"127.0.0.1:{port}", "--ollama-model", "smollm2:135m")
    assert_one_line_error(result, f"cannot reach Ollama at http://127.0.0.1:{port}", "ollama serve")
    assert result[1] == ""


def test_not_an_ollama_server_is_one_line(ollama, capsys):
    url, log = ollama
    assert_one_line_error(cli(capsys, *TINY, "--ollama", url + "/v1", "--ollama-model", "smollm2:135m"),
                          "does not answer like Ollama")


def test_depth_rows(capsys):
    """-d (llama-bench's depth): the pp and tg rows again after that many tokens in the cache; the
    KV bytes of the tg rows count them; bad lists are refused in one line."""
    rc, out, err = cli(capsys, *TINY, "-d", "0,40", "--json")
    assert rc == 0, err
    res = json.loads(out)
    rows = {(r["test"], r["depth"]): r for r in res["rows"]}
    assert set(rows) == {("pp16", 0), ("tg4", 0), ("pp16 @ d40", 40), ("tg4 @ d40", 40)}
    assert res["settings"]["depth"] == [0, 40] and res["settings"]["n_ctx"] >= 40 + 16
    assert rows[("tg4 @ d40", 40)]["step_bytes"] > rows[("tg4", 0)]["step_bytes"]
    for bad in ("4096,x", "-1", "8,8"):
        rc, out, err = cli(capsys, *TINY, "-d", bad)
        assert rc == 2 and "'-d'" in err, (bad, err)


def test_depth_rows_keep_the_cache(capsys, monkeypatch):
    """At depth d each repetition truncates to d and prefills (or decodes) from there: the depth's
    tokens are prefilled once, not per repetition."""
    from gguf_runtime.tools import bench as B

    calls = []

    class Spy:
        cfg = type("C", (), {"n_vocab": 100})()

        def truncate(self, n):
            calls.append(("truncate", n))

        def prefill(self, ids):
            calls.append(("prefill", len(ids)))

    be = Spy()
    B.fill_depth(be, 30)
    B.prefill_rate(be, 8, reps=2, depth=30)
    assert calls == [("truncate", 0), ("prefill", 30)] + [("truncate", 30), ("prefill", 8)] * 3
