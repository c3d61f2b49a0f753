"""llama.cpp's spellings of the options its users type first, read as gguf-run's before a command
parses argv: ``-m MODEL`` (the MODEL argument), ``-ngl N`` (0: the CPU, i.e. ``--backend numpy``;
any other N: every layer on the GPU, as gguf-run always runs them), ``-fa [on|off|auto|1|0]``
(flash attention: gguf-run's GPU path always uses its flash-attention kernels), ``-s N``
(``--seed``) and llama-server's ``-np N`` (``serve --max-batch``: the smallest of its batch sizes
that holds N sequences). So `llama-cli -m M.gguf
-ngl 99 -fa on -p ...` and `llama-bench -m M.gguf -ngl 99 -fa 1 -p 512 -n 128` run as they stand
with `gguf-run` / `gguf-run bench` in front."""

from __future__ import annotations

from typing import Callable

from ..errors import GGUFRunError
from .options import BATCHES

COMMANDS = frozenset({"run", "chat", "bench", "serve", "perplexity", "embed"})
MODEL = ("-m", "--model")
GPU_LAYERS = ("-ngl", "--n-gpu-layers", "--gpu-layers")
FLASH = ("-fa", "--flash-attn")
PARALLEL = ("-np", "--parallel")  # llama-server's slots: serve's sequences decoded together
FLASH_VALUES = {"on": True, "1": True, "auto": True, "off": False, "0": False}
ALL_LAYERS = 99  # llama.cpp's usual "every layer"; fewer asks for a partial offload, which gguf-run has not


def translate(args: list[str], takes_value: Callable[[str, str], bool | None],
              note: Callable[[str], None]) -> list[str]:
    """args (a command name first) with llama.cpp's options rewritten; ``takes_value(command,
    option)``: whether that command's option reads the next word (so a prompt that reads "-m" stays
    a prompt), None for an option it does not have (the command then names it: its next word
    cannot be told from a MODEL argument). Other commands and words after ``--`` pass as they are."""
    if not args or args[0] not in COMMANDS:
        return args
    cmd, out, model, positional, unknown, i = args[0], [args[0]], None, False, False, 1
    cpu_flag, backends = None, []  # (-ngl 0 and the --backend values given beside it)
    while i < len(args):
        a = args[i]
        nxt = args[i + 1] if i + 1 < len(args) else None
        if a == "--":
            out += args[i:]
            positional = positional or i + 1 < len(args)
            break
        if a in MODEL or a.startswith(("--model=", "-m=")):
            value = a.split("=", 1)[1] if "=" in a else nxt
            if not value:
                raise GGUFRunError(f"{a} needs a model file or name after it")
            if model is not None:
                raise GGUFRunError(f"two models given with {a} ({model!r} and {value!r}): give one")
            model = value
            i += 1 if "=" in a else 2
            continue
        if a in GPU_LAYERS:
            more = _gpu_layers(a, nxt, note)
            cpu_flag = f"{a} {nxt}" if more else cpu_flag
            out += more
            i += 2
            continue
        if a in FLASH:
            on = FLASH_VALUES.get((nxt or "").lower())
            if on is False:
                note(f"{a} {nxt}: gguf-run's GPU path always runs its flash-attention kernels")
            i += 1 if on is None else 2  # a bare -fa (older llama.cpp's switch) means on
            continue
        if a in PARALLEL and cmd == "serve":
            out += ["--max-batch", _batch_for(a, nxt, note)]
            i += 2
            continue
        if a == "-s":
            out += ["--seed"] + ([nxt] if nxt is not None else [])
            i += 2
            continue
        if a == "--backend" or a.startswith("--backend="):
            backends.append(a.split("=", 1)[1] if "=" in a else nxt or "")
        out.append(a)
        value = takes_value(cmd, a) if a.startswith("-") and "=" not in a and a != "-" else False
        unknown = unknown or value is None
        if value and nxt is not None:
            out.append(nxt)
            i += 2
            continue
        positional = positional or not a.startswith("-") or a == "-"
        i += 1
    other = [b for b in backends if b != "numpy"]
    if cpu_flag and other:
        raise GGUFRunError(f"{cpu_flag} runs on the CPU (--backend numpy) but --backend {other[0]} is given too: "
                           "give one")
    if model is None:
        return out
    if positional and not unknown and cmd != "embed":  # (embed: MODEL then TEXT...)
        raise GGUFRunError(f"the model is given twice: -m {model!r} and a MODEL argument; give one")
    return [out[0], model, *out[1:]]


def _batch_for(flag: str, value: str | None, note: Callable[[str], None]) -> str:
    try:
        n = int(value or "")
    except ValueError:
        n = 0
    if not 1 <= n <= BATCHES[-1]:
        raise GGUFRunError(f"{flag} {value or ''}: give the number of sequences served together, 1 to "
                           f"{BATCHES[-1]}".replace("  ", " "))
    batch = next(b for b in BATCHES if b >= n)
    if batch != n:
        note(f"{flag} {n}: up to {batch} sequences decoded together (serve's batch sizes: "
             f"{', '.join(map(str, BATCHES))})")
    return str(batch)


def _gpu_layers(flag: str, value: str | None, note: Callable[[str], None]) -> list[str]:
    if value in ("all", "auto"):
        return []
    try:
        n = int(value or "")
    except ValueError:
        raise GGUFRunError(f"{flag} {value or ''}: give a number of layers (0: run on the CPU; "
                           f"{ALL_LAYERS}: every layer on the GPU)".replace("  ", " ")) from None
    if n < 0:
        return []  # (llama.cpp: -1 is its "auto")
    if n == 0:
        return ["--backend", "numpy"]
    if n < ALL_LAYERS:
        note(f"{flag} {n}: no partial offload here; on the GPU every layer runs there")
    return []
