"""The command line as a user meets it: output, stats, and one clear line for every bad input.

Commands run as real processes (the installed `gguf-run` entry point) so exit codes, stdout and
stderr are exactly what a shell sees. Generation uses the default model on the numpy backend.
"""

import os
import shutil
import subprocess
import sys

import pytest
from gguf.constants import GGUFValueType as V

from gguf_runtime.format.blocks import BY_NAME
from gguf_runtime.tools.synth_presets import pack_header, tokenizer_kvs

from gguf_samples import write_sample  # noqa: F401  (tests/ is on sys.path)

EXE = shutil.which("gguf-run", path=os.path.dirname(sys.executable)) or "gguf-run"
SSTI = ("{% for x in ().__class__.__base__.__subclasses__() %}{% if \"warning\" in x.__name__ %}"
        "{{x()._module.__builtins__['__import__']('os').popen(\"touch PWNED\")}}{%endif%}{% endfor %}")


def run(*args, stdin=None, timeout=300):
    p = subprocess.run([EXE, *args], capture_output=True, text=True, input=stdin, timeout=timeout,
                       env={**os.environ, "PYTHONWARNINGS": "ignore"})
    return p.returncode, p.stdout, p.stderr


def assert_one_line_error(result, *words):
    rc, out, err = result
    assert rc == 2, err
    assert "Traceback" not in err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("error:"), err
    for w in words:
        assert w.lower() in lines[0].lower(), (w, err)


# ---- a tiny llama model with SmolLM2's vocabulary, zero weights ---------------------------------
def tiny_llama(path, smollm2_path, template=None, types=None, arch="llama"):
    d, n_layer, n_head, n_kv, n_ff = 64, 2, 4, 2, 128
    kvs = [("general.architecture", V.STRING, arch), ("general.name", V.STRING, "tiny"),
           (f"{arch}.embedding_length", V.UINT32, d), (f"{arch}.block_count", V.UINT32, n_layer),
           (f"{arch}.feed_forward_length", V.UINT32, n_ff), (f"{arch}.attention.head_count", V.UINT32, n_head),
           (f"{arch}.attention.head_count_kv", V.UINT32, n_kv), (f"{arch}.context_length", V.UINT32, 256),
           (f"{arch}.attention.layer_norm_rms_epsilon", V.FLOAT32, 1e-5)]
    kvs += [kv for kv in tokenizer_kvs(smollm2_path) if kv[0] != "tokenizer.chat_template"]
    if template is not None:
        kvs.append(("tokenizer.chat_template", V.STRING, template))
    n_vocab = 49152
    q8, f32 = BY_NAME["Q8_0"], BY_NAME["F32"]
    table = [("token_embd.weight", (d, n_vocab), q8), ("output_norm.weight", (d,), f32)]
    for i in range(n_layer):
        p = f"blk.{i}."
        table += [(p + "attn_norm.weight", (d,), f32), (p + "attn_q.weight", (d, d), q8),
                  (p + "attn_k.weight", (d, d // 2), q8), (p + "attn_v.weight", (d, d // 2), q8),
                  (p + "attn_output.weight", (d, d), q8), (p + "ffn_norm.weight", (d,), f32),
                  (p + "ffn_gate.weight", (d, n_ff), q8), (p + "ffn_up.weight", (d, n_ff), q8),
                  (p + "ffn_down.weight", (n_ff, d), q8)]
    table = [(n, ne, (types or {}).get(n, t)) for n, ne, t in table]
    header = pack_header(kvs, table)
    from gguf_runtime.format.gguf_file import open_gguf
    with open(path, "wb") as fh:
        fh.write(header)
    with open_gguf(path, check_data=False) as f:
        end = max(t.offset + t.nbytes for t in f.tensors.values())
    with open(path, "r+b") as fh:
        fh.truncate(end)
    return str(path)


# ---- generation ---------------------------------------------------------------------------------
def test_raw_greedy_completion_streams_the_reference_text():
    rc, out, err = run("--prompt", "The capital of France is", "--raw", "-n", "6", "--temp", "0",
                       "--backend", "numpy", "-q")
    assert rc == 0, err
    assert out.startswith(" Paris.\n\nThe answer"), out  # transformers' greedy text for this prompt


def test_chat_default_stops_at_end_of_turn_and_prints_stats():
    rc, out, err = run("--prompt", "What is the capital of France?", "-n", "200", "--temp", "0", "--verbose",
                       "--backend", "numpy")
    assert rc == 0, err
    assert "Paris" in out
    stats = dict(ln.split(":", 1) for ln in err.splitlines() if ":" in ln and not ln.startswith("note"))
    for key in ("total duration", "load duration", "prompt eval count", "prompt eval duration",
                "prompt eval rate", "eval count", "eval duration", "eval rate"):
        assert key in stats, err
    assert int(stats["eval count"].split()[0]) < 200  # stopped at <|im_end|>, not at -n


def test_same_seed_same_text_and_stdin_prompt():
    a = run("--raw", "-n", "12", "--temp", "1.0", "--seed", "42", "--backend", "numpy", "-q", stdin="Once upon a time")
    b = run("--raw", "-n", "12", "--temp", "1.0", "--seed", "42", "--backend", "numpy", "-q", stdin="Once upon a time")
    assert a[0] == 0 and a[1] == b[1] and a[1].strip()


def test_info_and_tokenize():
    rc, out, err = run("info")
    assert rc == 0, err
    for word in ("architecture", "llama", "Q4_1", "Q8_0", "quant types", "tokenizer.ggml.pre"):
        assert word in out
    # K and V of 30 layers x 3 KV heads x 64 dims: 11,520 elements a token
    assert "kv_cache        22.50 KiB a token in f16, 45.00 KiB in f32 (180.00 MiB / 360.00 MiB at 8,192" in out
    # -tp N: what each GPU would hold, or the one line -tp would refuse with (9 heads over 2 GPUs)
    rc, out, err = run("info", "--no-metadata", "-tp", "2")
    assert rc == 0 and "tensor parallel over 2 GPUs" in out and "9 attention heads do not divide into 2" in out, err
    rc, out, err = run("info", "--no-metadata", "-tp", "3")
    assert rc == 0 and "weights" in out.split("tensor parallel over 3 GPUs")[1], out
    assert "7.50 KiB a token a GPU in f16" in out  # one of the 3 KV heads a GPU
    from gguf_runtime.cli.default_model import default_model_path
    rc, out, err = run("tokenize", default_model_path(), "The capital of France is")
    assert (rc, out.strip()) == (0, "504 3575 282 4649 314")
    rc, out, err = run("tokenize", default_model_path(), "<|im_start|>user", "--parse-special", "--pieces")
    assert rc == 0 and out.splitlines()[0].split()[0] == "1"


def test_help_shows_examples_for_every_command():
    for cmd in ([], ["run"], ["info"], ["tokenize"], ["synth"], ["chat"], ["bench"], ["serve"], ["perplexity"]):
        rc, out, err = run(*cmd, "--help")
        assert rc == 0 and "Examples" in out, (cmd, out)


# ---- bad input: one line, exit code 2, never a traceback ----------------------------------------
def test_missing_path():
    assert_one_line_error(run("/no/such/model.gguf", "-p", "hi"), "no such file")


@pytest.mark.skipif(not os.path.exists("/proc/self/mem"), reason="Linux /proc")
def test_unreadable_regular_file():
    """/proc/self/mem stats as a regular file and fails every read (EIO)."""
    assert_one_line_error(run("/proc/self/mem", "-p", "hi"), "cannot be read")
    assert_one_line_error(run("info", "/proc/self/mem"), "cannot be read")


def test_context_beyond_memory():
    """-c 10,000,000 asks the numpy backend for a 429 GiB KV cache: one line, not a MemoryError."""
    assert_one_line_error(run("-p", "hi", "-c", "10000000", "--backend", "numpy", "-n", "2", "-q"),
                          "--ctx-size", "GiB of KV cache")


def test_prompt_beyond_any_context_is_refused_before_tokenizing():
    """10 MB of one 'word' on stdin: more bytes than the context could hold at the vocabulary's
    longest token, refused from its length alone (it took 34-55 s and ~4 GB of BPE before)."""
    assert_one_line_error(run("--backend", "numpy", "-q", "-n", "2", stdin="a" * 10_000_000),
                          "bytes", "longest token", "--ctx-size")


def test_not_a_gguf_and_truncated(tmp_path):
    txt = tmp_path / "notes.txt"
    txt.write_text("hello, not a model\n" * 10)
    assert_one_line_error(run(str(txt), "-p", "hi"), "not a GGUF")
    from gguf_runtime.cli.default_model import default_model_path
    cut = tmp_path / "cut.gguf"
    with open(default_model_path(), "rb") as src:
        cut.write_bytes(src.read(3_000_000))
    assert_one_line_error(run(str(cut), "-p", "hi"), "truncated")
    assert_one_line_error(run("info", str(cut)), "truncated")


@pytest.mark.parametrize("args,words", [
    (["--temp", "abc"], ["temp"]),
    (["--top-p", "2"], ["top-p"]),
    (["-n", "-5"], ["n-predict"]),
    (["--bogus"], ["bogus"]),
    (["--backend", "tpu"], ["backend"]),
    (["-ctk", "q5_1"], ["cache-type-k", "q5_1", "not supported"]),
    (["--cache-type-v", "f8"], ["cache-type-v", "f8"]),
    (["--raw", "--system", "be brief"], ["--system", "--raw"]),
])
def test_bad_option_values(args, words):
    assert_one_line_error(run("-p", "hi", *args), *words)


def test_prompt_longer_than_context():
    assert_one_line_error(run("-p", "word " * 200, "-c", "64", "--backend", "numpy"), "context", "--ctx-size")


def test_unsupported_architecture():
    vocab = os.path.join(os.path.dirname(__file__), "data", "tokenizer", "ggml-vocab-gpt-2.gguf")
    assert_one_line_error(run(vocab, "-p", "hi"), "gpt2", "not supported", "llama")


def test_unsupported_quant_type(tmp_path, smollm2_path):
    """A type nothing here reads (Q8_1: ggml's activation type) is one line; IQ4_NL, which the
    numpy backend reads, runs there."""
    path = tiny_llama(tmp_path / "q81.gguf", smollm2_path, types={"blk.1.ffn_up.weight": BY_NAME["Q8_1"]})
    assert_one_line_error(run(path, "-p", "hi", "--backend", "numpy"), "Q8_1", "not supported")
    path = tiny_llama(tmp_path / "iq.gguf", smollm2_path, types={"blk.1.ffn_up.weight": BY_NAME["IQ4_NL"]})
    rc, out, err = run(path, "-p", "hi", "-n", "2", "--backend", "numpy")
    assert rc == 0, err


def test_cuda_backend_without_gpu():
    try:
        import cupy  # noqa: F401
        pytest.skip("this machine may have CuPy; the no-GPU message is for machines without one")
    except Exception:
        pass
    assert_one_line_error(run("-p", "hi", "--backend", "cuda"), "cuda", "--backend numpy")


def test_template_escaping_its_sandbox(tmp_path, smollm2_path):
    path = tiny_llama(tmp_path / "evil.gguf", smollm2_path, template=SSTI)
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        rc, out, err = run(path, "-p", "hi", "--chat", "--backend", "numpy", "-n", "2")
    finally:
        os.chdir(cwd)
    assert_one_line_error((rc, out, err), "unsafe", "--raw")
    assert not (tmp_path / "PWNED").exists()
    # the same file still runs in raw mode
    rc, out, err = run(path, "-p", "hi", "--raw", "--backend", "numpy", "-n", "2", "-q")
    assert rc == 0, err


def test_tiny_model_runs(tmp_path, smollm2_path):
    path = tiny_llama(tmp_path / "tiny.gguf", smollm2_path)
    rc, out, err = run(path, "-p", "hi", "--raw", "--backend", "numpy", "-n", "3", "--temp", "0", "-q")
    assert rc == 0, err


def test_cli_needs_no_click_package():
    """typer vendors click; a plain install has no `click` (the test extras pull it in via uvicorn)."""
    code = ("import sys; sys.modules['click'] = None\n"
            "from gguf_runtime.cli.app import main\n"
            "sys.exit(main(['--help']) or main(['--temp', 'abc', '-p', 'x']) - 2)")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "Traceback" not in p.stderr
