"""llama.cpp's -m, -ngl, -fa and -s as its users type them (cli/llama_flags.py): rewritten before
the commands parse, never taken from inside another option's value, one clear line when wrong."""

import pytest

from gguf_runtime.cli import llama_flags as LF
from gguf_runtime.cli.app import _takes_value
from gguf_runtime.errors import GGUFRunError

from test_cli import assert_one_line_error, run


def tr(*args):
    notes = []
    return LF.translate(list(args), _takes_value, notes.append), notes


def test_model_option_becomes_the_model_argument():
    assert tr("run", "-m", "a.gguf", "-p", "hi")[0] == ["run", "a.gguf", "-p", "hi"]
    assert tr("run", "-p", "hi", "--model=a.gguf")[0] == ["run", "a.gguf", "-p", "hi"]
    assert tr("bench", "-p", "512", "-m", "a.gguf", "-n", "128")[0] == ["bench", "a.gguf", "-p", "512", "-n", "128"]
    # embed: MODEL, then its texts
    assert tr("embed", "-m", "a.gguf", "one", "two")[0] == ["embed", "a.gguf", "one", "two"]


def test_option_values_are_not_read_as_flags():
    """A prompt, a system message or a stop word that reads "-m" or "-ngl" stays what it is."""
    assert tr("run", "a.gguf", "-p", "-m")[0] == ["run", "a.gguf", "-p", "-m"]
    assert tr("run", "-m", "a.gguf", "--system", "-ngl")[0] == ["run", "a.gguf", "--system", "-ngl"]
    assert tr("run", "a.gguf", "--", "-m", "x")[0] == ["run", "a.gguf", "--", "-m", "x"]
    # other commands pass untouched
    assert tr("info", "-m", "a.gguf")[0] == ["info", "-m", "a.gguf"]
    assert tr("tokenize", "a.gguf", "-s")[0] == ["tokenize", "a.gguf", "-s"]


def test_gpu_layers_flash_attention_and_seed():
    args, notes = tr("run", "a.gguf", "-ngl", "99", "-fa", "on", "-s", "7", "-p", "x")
    assert args == ["run", "a.gguf", "--seed", "7", "-p", "x"] and notes == []
    assert tr("run", "a.gguf", "-ngl", "0")[0] == ["run", "a.gguf", "--backend", "numpy"]
    assert tr("run", "a.gguf", "--n-gpu-layers", "all")[0] == ["run", "a.gguf"]
    assert tr("run", "a.gguf", "-ngl", "-1")[0] == ["run", "a.gguf"]
    args, notes = tr("run", "a.gguf", "-ngl", "20", "-fa", "off")
    assert args == ["run", "a.gguf"]
    assert len(notes) == 2 and "partial offload" in notes[0] and "flash-attention" in notes[1]
    # llama-bench's -fa 1, and older llama.cpp's bare -fa switch (the next word is an option)
    assert tr("bench", "a.gguf", "-fa", "1", "-p", "512")[0] == ["bench", "a.gguf", "-p", "512"]
    assert tr("run", "a.gguf", "-fa", "-p", "x")[0] == ["run", "a.gguf", "-p", "x"]
    # llama-server's parallel slots
    assert tr("serve", "-m", "a.gguf", "-np", "8", "--port", "0")[0] == ["serve", "a.gguf", "--max-batch", "8",
                                                                      "--port", "0"]
    # any count of slots: the smallest batch size that holds them, with a note
    args, notes = tr("serve", "a.gguf", "-np", "3")
    assert args == ["serve", "a.gguf", "--max-batch", "4"] and len(notes) == 1 and "up to 4" in notes[0]
    # -ngl 0 beside --backend numpy agrees
    assert tr("run", "a.gguf", "--backend", "numpy", "-ngl", "0")[0] == ["run", "a.gguf", "--backend", "numpy",
                                                                         "--backend", "numpy"]


@pytest.mark.parametrize("args,words", [
    (("run", "-m", "a.gguf", "b.gguf"), ["twice"]),
    (("run", "-m", "a.gguf", "-m", "b.gguf"), ["two models"]),
    (("run", "-m"), ["-m needs"]),
    (("run", "a.gguf", "-ngl", "many"), ["-ngl many", "number of layers"]),
    (("run", "a.gguf", "-ngl", "0", "--backend", "cuda"), ["-ngl 0", "--backend cuda", "give one"]),
    (("run", "a.gguf", "--backend=cuda", "-ngl", "0"), ["-ngl 0", "--backend cuda"]),
    (("serve", "a.gguf", "-np", "100"), ["-np 100", "1 to 64"]),
    (("serve", "a.gguf", "-np", "x"), ["-np x", "sequences"]),
    (("serve", "a.gguf", "-np"), ["-np", "sequences"]),
])
def test_wrong_uses_name_the_problem(args, words):
    with pytest.raises(GGUFRunError) as e:
        tr(*args)
    for w in words:
        assert w in str(e.value)


def test_a_llama_cli_line_runs_as_it_stands():
    """`llama-cli -m MODEL -ngl 0 -s 42 ...` with gguf-run in front: the default model on the CPU."""
    from gguf_runtime.cli.default_model import default_model_path

    m = default_model_path()
    a = run("-m", m, "-ngl", "0", "-fa", "on", "-s", "42", "--temp", "1.0", "--raw", "-n", "8", "-p", "Once upon a time")
    b = run(m, "--backend", "numpy", "--seed", "42", "--temp", "1.0", "--raw", "-n", "8", "-p", "Once upon a time",
            "-q")
    assert a[0] == 0 and a[1] == b[1] and a[1].strip(), a
    assert_one_line_error(run("-m", m, "-ngl", "lots", "-p", "x"), "-ngl lots")
    # an option gguf-run has not (llama.cpp's -t THREADS): named as such, not as a second model
    assert_one_line_error(run("-m", m, "-t", "8", "-p", "x"), "no such option", "-t")
