"""Plant known bugs in a copy of the project and report which tests catch each.

A test that cannot fail is a defect; this is how we know ours can. Each mutation replaces one
exact snippet of product code (it must occur once) with a subtly wrong one, in a copy of
``gguf_runtime/`` and ``tests/`` under a temporary folder, runs the tests that should catch it
there, and records which failed. A mutation no test catches is a hole in the suite.

    python tests/mutations.py                  # the CPU mutations (a few minutes each: micro models)
    python tests/mutations.py --gpu            # the CUDA ones (on the GPU machine; twins as for -m gpu)
    python tests/mutations.py --only top_p_side,min_p_sampler --table out.md

Prints a table (mutation, tests run, failed / total, the failing tests) and exits 1 if any
mutation survived. Tests that fail with no mutation (run once per selection) do not count.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Mutation:
    name: str
    what: str  # the bug, in words
    path: str  # the file, relative to the repository
    old: str  # exact text, found once
    new: str
    tests: tuple[str, ...]  # pytest arguments: the tests expected to catch it
    gpu: bool = False


MICRO = "tests/test_micro_archs.py"
SAMPLING = "tests/test_sampling.py"
MUTATIONS = [
    # ---- the numpy reference (caught against transformers) ----
    Mutation("eps_outside_sqrt", "RMSNorm: x / (sqrt(mean(x^2)) + eps) instead of x / sqrt(mean(x^2) + eps)",
             "gguf_runtime/backends/numpy/backend.py", "np.sqrt(ms + np.float32(self.cfg.rms_eps))",
             "(np.sqrt(ms) + np.float32(self.cfg.rms_eps))", (MICRO,)),
    Mutation("gelu_sigmoid", "GELU: x * sigmoid(1.702 x) instead of the tanh form",
             "gguf_runtime/backends/numpy/backend.py",
             "return 0.5 * x * (1.0 + np.tanh(np.float32(0.7978845608028654) * (x + np.float32(0.044715) * x * x * x)))",
             "return x / (1.0 + np.exp(np.float32(-1.702) * x))", (MICRO,)),
    Mutation("rope_base_1e-5", "RoPE base 1e-5 too large (relative)", "gguf_runtime/model.py",
             "inv = base ** (-np.arange(0, n, 2, dtype=np.float64) / n) * scale",
             "inv = (base * (1 + 1e-5)) ** (-np.arange(0, n, 2, dtype=np.float64) / n) * scale", (MICRO,)),
    Mutation("attn_scale_1e-3", "attention scale 0.1% too large", "gguf_runtime/format/model_config.py",
             "attn_scale=1.0 / math.sqrt(n_embd // n_head if gemma and n_layer == 62 else head_dim),",
             "attn_scale=1.001 / math.sqrt(n_embd // n_head if gemma and n_layer == 62 else head_dim),", (MICRO,)),
    Mutation("attn_scale_n_embd", "attention scale from n_embd / n_head where head_dim differs",
             "gguf_runtime/format/model_config.py",
             "attn_scale=1.0 / math.sqrt(n_embd // n_head if gemma and n_layer == 62 else head_dim),",
             "attn_scale=1.0 / math.sqrt(n_embd // n_head),", (MICRO,)),
    Mutation("window_off_by_one", "sliding window one key wider", "gguf_runtime/backends/numpy/backend.py",
             "mask |= dist >= self.cfg.layer_window[layer]", "mask |= dist > self.cfg.layer_window[layer]", (MICRO,)),
    # ---- the numpy sampler ----
    Mutation("top_p_side", "top-p keeps the token after the one whose sum reaches p (searchsorted right)",
             "gguf_runtime/sampling.py", 'np.searchsorted(cum, p, side="left")', 'np.searchsorted(cum, p, side="right")',
             (SAMPLING,)),
    Mutation("min_p_sampler", "min-p in the Sampler drops tokens at exactly the threshold (> for >=)",
             "gguf_runtime/sampling.py", "keep = v.astype(np.float64) >= float(v.max()) + math.log(pr.min_p)",
             "keep = v.astype(np.float64) > float(v.max()) + math.log(pr.min_p)", (SAMPLING,)),
    Mutation("min_p_filter", "min_p_filter drops tokens at exactly the threshold (> for >=)",
             "gguf_runtime/sampling.py", "np.where(x.astype(np.float64) >= threshold, x, -np.inf)",
             "np.where(x.astype(np.float64) > threshold, x, -np.inf)", (SAMPLING,)),
    Mutation("temperature_ignored", "the numpy Sampler ignores temperature", "gguf_runtime/sampling.py",
             "return ids, softmax(apply_temperature(v, self.params.temperature))", "return ids, softmax(v)",
             (SAMPLING,)),
    # ---- CUDA kernels (caught against numpy on the GPU) ----
    Mutation("cuda_eps_outside_sqrt", "RMSNorm kernel: 1 / (sqrt(ms) + eps)", "gguf_runtime/quant_kernels/layers.cu",
             "const float k = rsqrtf(ss / (float)n + eps);", "const float k = 1.f / (sqrtf(ss / (float)n) + eps);",
             ("tests/test_gpu_kernels.py", "tests/test_gpu_q8.py", "-k", "rmsnorm or norm_residual"), gpu=True),
    Mutation("cuda_gelu_sigmoid", "GLU matvec epilogue: x * sigmoid(1.702 x) for tanh-GELU",
             "gguf_runtime/quant_kernels/matvec.cu", "(ACT == 0 ? silu_f(g) : gelu_tanh_f(g)) * acc[H + r][b]",
             "(ACT == 0 ? silu_f(g) : g / (1.f + __expf(-1.702f * g))) * acc[H + r][b]",
             ("tests/test_gpu_kernels.py", "-k", "glu"), gpu=True),
    Mutation("cuda_window_off_by_one", "attention kernel: sliding window one key wider",
             "gguf_runtime/quant_kernels/attention.cu", "const int lo = window > 0 ? max(0, p - window + 1) : 0;",
             "const int lo = window > 0 ? max(0, p - window) : 0;",
             ("tests/test_gpu_kernels.py", "tests/test_gpu_micro.py", "-k", "attention or gemma"), gpu=True),
    Mutation("cuda_attn_scale_1e-3", "attention kernel: scale 0.1% too large", "gguf_runtime/quant_kernels/attention.cu",
             "qv[g][e] = qh[lane + 32 * e] * scale;", "qv[g][e] = qh[lane + 32 * e] * (scale * 1.001f);",
             ("tests/test_gpu_kernels.py", "-k", "test_attention"), gpu=True),
    Mutation("cuda_decode_mask_one_past", "decode attention on the tensor cores: one key past the row's own",
             "gguf_runtime/quant_kernels/flash_decode.cu", "v = key < end && key >= lo ? v * LOG2E : -INFINITY;",
             "v = key <= end && key >= lo ? v * LOG2E : -INFINITY;",
             ("tests/test_gpu_flash_decode.py",), gpu=True),
    Mutation("cuda_q8_norm_no_eps", "int8 matvec that applies the previous epilogue's RMSNorm leaves out eps",
             "gguf_runtime/quant_kernels/matvec_block.cuh", "rsqrtf(ssq[b] / (float)K + xq.eps)",
             "rsqrtf(ssq[b] / (float)K)", ("tests/test_gpu_q8.py", "tests/test_gpu_micro.py", "-k", "consumer or int8"),
             gpu=True),
    Mutation("cuda_temperature_ignored", "GPU sampler ignores temperature", "gguf_runtime/quant_kernels/sampling.cu",
             "__expf((cv[tid] - m) / temp)", "__expf(cv[tid] - m)", ("tests/test_gpu_sampler.py",), gpu=True),
    Mutation("cuda_top_p_strict", "GPU sampler's top-p needs a sum above p (> for >=)",
             "gguf_runtime/quant_kernels/sampling.cu", "if (in && cum >= top_p * z)", "if (in && cum > top_p * z)",
             ("tests/test_gpu_sampler.py",), gpu=True),
    Mutation("cuda_min_p_strict", "GPU sampler's min-p drops tokens at exactly the threshold (> for >=)",
             "gguf_runtime/quant_kernels/sampling.cu", "cv[tid] >= thr", "cv[tid] > thr",
             ("tests/test_gpu_sampler.py",), gpu=True),
]


def copy_tree(dst: Path) -> None:
    for sub in ("gguf_runtime", "tests"):
        shutil.copytree(REPO / sub, dst / sub, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for name in ("pyproject.toml",):
        shutil.copy(REPO / name, dst / name)


def apply(m: Mutation, root: Path) -> None:
    p = root / m.path
    text = p.read_text()
    n = text.count(m.old)
    if n != 1:
        raise SystemExit(f"{m.name}: the snippet occurs {n} times in {m.path} (the code moved: update the mutation)")
    p.write_text(text.replace(m.old, m.new))


def pytest_run(root: Path, args: list[str], timeout: int) -> tuple[set[str], int, str]:
    """(failed test ids, tests run, last line) of pytest over ``args`` in the copy ``root``."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), *filter(None, [os.environ.get("PYTHONPATH")])])}
    where = subprocess.run([sys.executable, "-c", "import gguf_runtime; print(gguf_runtime.__file__)"],
                           cwd=root, env=env, capture_output=True, text=True).stdout.strip()
    if not where.startswith(str(root)):
        raise SystemExit(f"the copy's gguf_runtime is not the one imported ({where})")
    cmd = [sys.executable, "-m", "pytest", "-q", "-rf", "-p", "no:cacheprovider", *args]
    try:
        out = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout).stdout
    except subprocess.TimeoutExpired as e:
        out = (e.stdout.decode() if isinstance(e.stdout, bytes) else e.stdout or "") + "\n(timed out)"
    lines = out.splitlines()
    failed = {re.sub(r"\s+-\s.*$", "", ln.split(" ", 1)[1]) for ln in lines if ln.startswith(("FAILED ", "ERROR "))}
    counts = re.findall(r"(\d+) (passed|failed|errors?)", lines[-1] if lines else "")
    return failed, sum(int(n) for n, _ in counts), lines[-1] if lines else "(no output)"


def selection(m: Mutation) -> list[str]:
    return [*m.tests, *(["-m", "gpu"] if m.gpu else [])]


def baseline(m: Mutation, extra: list[str], timeout: int, cache: dict) -> set[str]:
    """Tests of m's selection that fail with no mutation (not counted as catching it)."""
    key = tuple(selection(m) + extra)
    if key not in cache:
        with tempfile.TemporaryDirectory(prefix="mut-baseline-") as tmp:
            copy_tree(Path(tmp))
            cache[key] = pytest_run(Path(tmp), list(key), timeout)[0]
        if cache[key]:
            print(f"baseline: {len(cache[key])} test(s) fail with no mutation: {sorted(cache[key])[:4]}", flush=True)
    return cache[key]


class _NoBaseline(dict):
    def __contains__(self, key) -> bool:
        return True

    def __getitem__(self, key) -> set[str]:
        return set()


def run(m: Mutation, extra: list[str], timeout: int, cache: dict) -> dict:
    base = baseline(m, extra, timeout, cache)
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix=f"mut-{m.name}-") as tmp:
        root = Path(tmp)
        copy_tree(root)
        apply(m, root)
        failed, total, last = pytest_run(root, selection(m) + extra, timeout)
    caught = sorted(failed - base)
    return {"name": m.name, "what": m.what, "tests": " ".join(m.tests), "failed": caught, "n_failed": len(caught),
            "total": total, "seconds": time.time() - t0, "tail": [last]}


def short(nodeid: str) -> str:
    return nodeid.split("/")[-1]


def table(rows: list[dict]) -> str:
    lines = ["| mutation | the bug | tests run | failed | caught by (first 4) |", "|---|---|---|---|---|"]
    for r in rows:
        caught = ", ".join(short(f) for f in r["failed"][:4]) + (" ..." if len(r["failed"]) > 4 else "")
        lines.append(f"| {r['name']} | {r['what']} | `{r['tests']}` | {r['n_failed']} / {r['total']} | "
                     f"{caught or '**NONE: survived**'} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpu", action="store_true", help="the CUDA mutations (else the CPU ones)")
    ap.add_argument("--only", help="comma-separated mutation names")
    ap.add_argument("--table", help="also write the table (markdown) here")
    ap.add_argument("--timeout", type=int, default=1200, help="seconds per mutation")
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--no-baseline", action="store_true", help="skip the unmutated runs (the suite just passed)")
    ap.add_argument("pytest_args", nargs="*", help="more pytest arguments (after --)")
    args = ap.parse_args()
    chosen = [m for m in MUTATIONS if m.gpu == args.gpu]
    if args.only:
        names = set(args.only.split(","))
        chosen = [m for m in MUTATIONS if m.name in names]
    if args.list:
        for m in chosen:
            print(f"{m.name:26s} {m.what}")
        return 0
    rows, cache = [], ({} if not args.no_baseline else _NoBaseline())
    for m in chosen:
        r = run(m, args.pytest_args, args.timeout, cache)
        rows.append(r)
        print(f"{m.name}: {r['n_failed']} / {r['total']} failed in {r['seconds']:.0f} s  {' '.join(r['tail'])}",
              flush=True)
    text = table(rows)
    print(text)
    if args.table:
        Path(args.table).write_text(text + "\n")
    return 1 if any(r["n_failed"] == 0 for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
