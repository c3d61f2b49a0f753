"""Tensor parallelism's split arithmetic on the CPU: N ranks simulated with the numpy backend.

Each rank is a thread running a NumpyBackend over its ``ShardedFile`` (format/shard.py), with an
all-reduce and an all-gather over the threads; the logits of every rank, over a prompt and then
tokens through the KV cache, must equal the unsplit model's (float32 order: the split only
changes the order of the sums). The cases cover what a split touches: K-quant column splits,
Q/K/V biases, QK-norm, Gemma's post norms and soft-caps, Phi-3's fused QKV and gate-up, a
vocabulary that does not divide (the last rank's head padded), and the refusals.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from gguf_runtime.backends.numpy.backend import NumpyBackend
from gguf_runtime.engine import backend_choice
from gguf_runtime.errors import BackendError, UnsupportedModelError
from gguf_runtime.format.gguf_file import open_gguf
from gguf_runtime.format.model_config import config_from_gguf
from gguf_runtime.format.shard import FfnSplit, ShardedFile, check_split, vocab_part
from micro_models import Micro, prompt_ids, write_micro

Q4_K_M = {"token_embd.weight": QT.Q4_K, "output.weight": QT.Q6_K, "attn_q.weight": QT.Q4_K,
          "attn_k.weight": QT.Q4_K, "attn_v.weight": QT.Q6_K, "attn_output.weight": QT.Q4_K,
          "ffn_gate.weight": QT.Q4_K, "ffn_up.weight": QT.Q4_K, "ffn_down.weight": QT.Q6_K}
CASES = {
    # the 8B's type mix: O and down split on 256-value blocks
    "llama": (Micro(n_embd=512, n_ff=1024, n_head=8, n_head_kv=4, n_layer=2, tied=False, rope_base=5e5,
                    quant=Q4_K_M), 2),
    "llama-4": (Micro(n_embd=256, n_ff=512, n_head=8, n_head_kv=4, n_layer=2, tied=False, n_vocab=4001,
                      quant={".weight": QT.Q8_0}), 4),
    "qwen2": (Micro(arch="qwen2", vocab="qwen2", n_embd=256, n_ff=512, n_head=4, n_head_kv=2, n_layer=2, bias=True,
                    n_vocab=4001, quant={".weight": QT.Q8_0}), 2),
    "qwen3": (Micro(arch="qwen3", vocab="qwen2", n_embd=256, n_ff=512, n_head=4, n_head_kv=2, head_dim=128,
                    qk_norm=True, n_layer=2, tied=False, quant={".weight": QT.Q5_0}), 2),
    "gemma3": (Micro(arch="gemma3", vocab="llama-spm", n_embd=256, n_ff=512, n_head=4, n_head_kv=2, head_dim=64,
                     n_layer=3, qk_norm=True, post_norms=True, sliding_window=4, final_softcap=30.0,
                     attn_softcap=50.0, quant={".weight": QT.Q8_0}), 2),
    "phi3": (Micro(arch="phi3", vocab="phi-3", n_embd=256, n_ff=256, n_head=4, n_head_kv=4, tied=False, n_layer=2,
                   quant={".weight": QT.Q8_0}), 2),
    # mixtures of experts, split inside every expert (quant: the first suffix that matches): Qwen3-MoE's
    # K-quant experts (down's 512 Q6_K columns in two 256-value parts), Qwen2-MoE's shared expert, gpt-oss's biased MXFP4 experts
    # (gate and up biases split, down's on rank 0) and sinks
    "qwen3moe": (Micro(arch="qwen3moe", vocab="qwen2", n_embd=256, n_ff=512, n_head=4, n_head_kv=2, head_dim=64,
                       qk_norm=True, n_layer=2, tied=False, n_expert=8, n_expert_used=3, n_ff_exp=512,
                       quant={"ffn_gate_exps.weight": QT.Q4_K, "ffn_up_exps.weight": QT.Q4_K,
                              "ffn_down_exps.weight": QT.Q6_K, ".weight": QT.Q8_0}), 2),
    "qwen2moe": (Micro(arch="qwen2moe", vocab="qwen2", n_embd=256, n_ff=512, n_head=4, n_head_kv=2, n_layer=2,
                       bias=True, tied=False, n_expert=8, n_expert_used=2, n_ff_exp=256, n_ff_shexp=512,
                       quant={".weight": QT.Q8_0}), 2),
    # FFN rows in unequal parts where equal ones would cut down's quant blocks: a Qwen3-30B-A3B-like
    # expert (768 Q6_K down columns: 512 / 256 over 2 ranks), a Qwen3-235B-A22B-like one over 4 (1,536:
    # 512 / 512 / 256 / 256), a dense FFN (768 over 2) and an F32 one of 33 rows (17 / 16)
    "qwen3moe-uneven": (Micro(arch="qwen3moe", vocab="qwen2", n_embd=256, n_ff=512, n_head=4, n_head_kv=2,
                              head_dim=64, qk_norm=True, n_layer=2, tied=False, n_expert=4, n_expert_used=2,
                              n_ff_exp=768, quant={"ffn_down_exps.weight": QT.Q6_K, "_exps.weight": QT.Q4_K,
                                                   ".weight": QT.Q8_0}), 2),
    "qwen3moe-uneven-4": (Micro(arch="qwen3moe", vocab="qwen2", n_embd=256, n_ff=512, n_head=4, n_head_kv=4,
                                head_dim=64, qk_norm=True, n_layer=2, tied=False, n_expert=4, n_expert_used=2,
                                n_ff_exp=1536, quant={"ffn_down_exps.weight": QT.Q6_K, ".weight": QT.Q8_0}), 4),
    "llama-uneven": (Micro(n_embd=256, n_ff=768, n_head=4, n_head_kv=2, n_layer=2, tied=False,
                           quant={"ffn_down.weight": QT.Q6_K, ".weight": QT.Q8_0}), 2),
    "qwen3moe-odd": (Micro(arch="qwen3moe", vocab="qwen2", n_embd=64, n_ff=128, n_head=4, n_head_kv=2, n_layer=2,
                           tied=False, n_expert=4, n_expert_used=2, n_ff_exp=33), 2),
    "gpt-oss": (Micro(arch="gpt-oss", vocab="qwen2", n_embd=256, n_head=8, n_head_kv=4, head_dim=64, n_layer=2,
                      bias=True, tied=False, n_expert=8, n_expert_used=2, n_ff_exp=256, sliding_window=4,
                      yarn=(32.0, 4096), quant={"_exps.weight": QT.MXFP4, ".weight": QT.Q8_0}), 4),
}


class ThreadComm:
    """The collectives of ``world`` threads: each rank's contribution, a barrier, the sum / the
    concatenation (every rank computes it from the same parts, in rank order)."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.parts: list = [None] * world
        self.barrier = threading.Barrier(world, timeout=60)

    def rank(self, r: int) -> "RankComm":
        return RankComm(self, r)


class RankComm:
    def __init__(self, group: ThreadComm, rank: int) -> None:
        self.g, self.r = group, rank

    def _exchange(self, x: np.ndarray) -> list[np.ndarray]:
        g = self.g
        g.parts[self.r] = x
        g.barrier.wait()
        parts = list(g.parts)
        g.barrier.wait()  # (nobody overwrites a part before every rank has read it)
        return parts

    def all_reduce(self, x: np.ndarray) -> np.ndarray:
        parts = self._exchange(x)
        out = parts[0].copy()
        for p in parts[1:]:
            out = out + p
        return out

    def all_gather(self, x: np.ndarray) -> np.ndarray:
        return np.concatenate(self._exchange(x), axis=-1)


def run_split(path, world: int, prompt: list[int], more: list[int]) -> list[tuple[np.ndarray, np.ndarray]]:
    """Every rank's (prompt logits, logits through the cache)."""
    f = open_gguf(path)
    cfg = config_from_gguf(f)
    group = ThreadComm(world)
    out: list = [None] * world
    errors: list = []

    def rank(r: int) -> None:
        try:
            part = ShardedFile(f, cfg, r, world)
            be = NumpyBackend(part, part.config, n_ctx=64, comm=group.rank(r))
            out[r] = (be.eval(prompt, all_logits=True), be.eval(more, all_logits=True))
        except BaseException as e:  # (a failing rank breaks the barrier for the others)
            errors.append(e)
            group.barrier.abort()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_split_logits_equal_unsplit(tmp_path, case):
    m, world = CASES[case]
    path = write_micro(m, tmp_path / f"{case}.gguf")
    f = open_gguf(path)
    cfg = config_from_gguf(f)
    prompt, more = prompt_ids(cfg.n_vocab, 9), prompt_ids(cfg.n_vocab, 3, seed=2)
    be = NumpyBackend(f, cfg, n_ctx=64)
    ref = (be.eval(prompt, all_logits=True), be.eval(more, all_logits=True))
    scale = float(np.abs(ref[0]).max())
    for r, got in enumerate(run_split(path, world, prompt, more)):
        for g, want in zip(got, ref):
            assert g.shape == want.shape
            err = float(np.abs(g - want).max())
            assert err <= 2e-5 * scale, f"{case}: rank {r} differs from the unsplit model by {err} (scale {scale})"
            assert (g.argmax(-1) == want.argmax(-1)).all()


def test_shard_shapes_and_bytes(tmp_path):
    """Each rank's tensors: the expected shapes, byte counts that match their types, and parts that
    put back together give the full tensor (rows stacked, columns side by side)."""
    m, world = CASES["llama"]
    f = open_gguf(write_micro(m, tmp_path / "m.gguf"))
    cfg = config_from_gguf(f)
    shards = [ShardedFile(f, cfg, r, world) for r in range(world)]
    sc = shards[1].config
    assert (sc.n_head, sc.n_head_kv, sc.n_ff) == (cfg.n_head // 2, cfg.n_head_kv // 2, cfg.n_ff // 2)
    for s in shards:
        for name, t in s.tensors.items():
            assert s.raw(name).nbytes == t.nbytes, name
    q = "blk.0.attn_q.weight"
    whole = f.raw(q).reshape(cfg.n_head * cfg.head_dim, -1)
    assert np.array_equal(np.concatenate([s.raw(q).reshape(-1, whole.shape[1]) for s in shards]), whole)
    o = "blk.1.attn_output.weight"
    whole = f.raw(o).reshape(cfg.n_embd, -1)
    assert np.array_equal(np.concatenate([s.raw(o).reshape(cfg.n_embd, -1) for s in shards], axis=1), whole)
    head = [s.raw("output.weight") for s in shards]
    assert np.array_equal(np.concatenate(head), f.raw("output.weight"))
    assert shards[1].tensors["output.weight"].ne[1] == vocab_part(cfg, world)


def test_refusals(tmp_path):
    m, _ = CASES["llama"]
    f = open_gguf(write_micro(m, tmp_path / "m.gguf"))
    cfg = config_from_gguf(f)
    with pytest.raises(UnsupportedModelError, match="do not divide into 3 equal parts"):
        check_split(f, cfg, 3)
    with pytest.raises(UnsupportedModelError, match="not whole 256-value blocks"):
        check_split(f, cfg, 4)  # O's 512 Q4_K columns in parts of 128
    # an expert's down columns split inside a quant block (Qwen3-30B-A3B's 768 Q6_K ones over 2 GPUs)
    moe = Micro(arch="qwen3moe", vocab="qwen2", n_embd=256, n_ff=512, n_head=4, n_head_kv=2, n_layer=1,
                n_expert=4, n_expert_used=2, n_ff_exp=256, quant={"ffn_down_exps.weight": QT.Q6_K, ".weight": QT.Q8_0})
    f = open_gguf(write_micro(moe, tmp_path / "moe.gguf"))
    with pytest.raises(UnsupportedModelError, match="256 experts' FFN rows do not split into 2 parts: "
                                                    "'blk.0.ffn_down_exps.weight' \\(Q6_K\\) has 1 whole 256-value"):
        check_split(f, config_from_gguf(f), 2)
    tiny = Micro(n_embd=64, n_ff=3, n_head=4, n_head_kv=4, n_layer=1)  # float32: any row, but fewer than 4
    f = open_gguf(write_micro(tiny, tmp_path / "tiny.gguf"))
    with pytest.raises(UnsupportedModelError, match="3 FFN rows do not split into 4 parts: fewer than 4"):
        check_split(f, config_from_gguf(f), 4)


def test_uneven_ffn_split(tmp_path):
    """Unequal FFN parts only where equal ones would cut down's blocks, on whole blocks, the first
    ranks the larger, covering every row once; each rank's config and tensors of its own part."""
    m, _ = CASES["qwen3moe-uneven-4"]
    f = open_gguf(write_micro(m, tmp_path / "m.gguf"))
    cfg = config_from_gguf(f)
    split = FfnSplit(f, cfg, 4)
    assert [split.part("ff_exp", r) for r in range(4)] == [(0, 512), (512, 512), (1024, 256), (1280, 256)]
    assert "experts' FFN rows 512 / 512 / 256 / 256 a GPU" in split.uneven()
    assert FfnSplit(f, cfg, 2).uneven() == ""  # 1,536 / 2 = 768: three whole blocks each
    shards = [ShardedFile(f, cfg, r, 4) for r in range(4)]
    assert [s.config.n_ff_exp for s in shards] == [512, 512, 256, 256]
    down = "blk.0.ffn_down_exps.weight"
    assert [s.tensors[down].ne[0] for s in shards] == [512, 512, 256, 256]
    whole = f.raw(down).reshape(cfg.n_expert * cfg.n_embd, -1)
    assert np.array_equal(np.concatenate([s.raw(down).reshape(whole.shape[0], -1) for s in shards], axis=1), whole)
    gate = "blk.1.ffn_gate_exps.weight"
    rows = f.raw(gate).reshape(cfg.n_expert, cfg.n_ff_exp, -1)
    got = np.concatenate([s.raw(gate).reshape(cfg.n_expert, s.config.n_ff_exp, -1) for s in shards], axis=1)
    assert np.array_equal(got, rows)


def test_backend_choice_refuses_without_gpus(tmp_path, monkeypatch):
    """-tp N asks for the cuda backend's ranks: the numpy backend, or no GPU, is one line."""
    m, _ = CASES["qwen2"]
    f = open_gguf(write_micro(m, tmp_path / "m.gguf"))
    cfg = config_from_gguf(f)
    with pytest.raises(BackendError, match="with the cuda backend"):
        backend_choice.select_backend("numpy", f, cfg, 64, tensor_parallel=2)
    monkeypatch.setattr(backend_choice, "cuda_available", lambda: (False, "no NVIDIA GPU found"))
    with pytest.raises(BackendError, match="needs the cuda backend: no NVIDIA GPU found"):
        backend_choice.select_backend("auto", f, cfg, 64, tensor_parallel=2)


def test_cli_tensor_parallel_without_gpu_is_one_line(tmp_path):
    import subprocess
    import sys

    m, _ = CASES["qwen2"]
    path = write_micro(m, tmp_path / "m.gguf")
    r = subprocess.run([sys.executable, "-m", "gguf_runtime", "run", str(path), "-tp", "2", "--backend", "numpy",
                        "-p", "hi", "-n", "2", "-q"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and "--tensor-parallel 2" in r.stderr, r.stderr
