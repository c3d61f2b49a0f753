"""Compile every kernel a model can launch at load, one NVRTC pass per source file, so that no
kernel compiles on the first token or inside a graph capture: the matvecs of every group and
token count (f32 and int8 activations, with and without the q8 epilogue), the tensor-core
products of the batch buckets, and the layer, attention and sampling kernels.
"""

from __future__ import annotations

from typing import Sequence

from .cuda_blocks import CudaBlocks
from .cuda_workspace import use_q8
from .cuda_weights import DeviceWeights
from .model_config import ModelConfig
from .quant_kernels import launch_attention as LA
from .quant_kernels import launch_mma as LM
from .quant_kernels import launchers as L
from .quant_kernels.launch_core import Kernels

MMV_SWEEP = ((2, 1), (2, 2), (2, 4), (1, 1), (1, 2), (1, 4))  # (R, WG) candidates of GGUF_RUN_MMV_*


def precompile(kernels: Kernels, cfg: ModelConfig, w: DeviceWeights, blocks: CudaBlocks, max_batch: int,
               buckets: Sequence[int]) -> None:
    """Compile every kernel this model can launch, one NVRTC pass per source file."""
    mm, mma = [], []
    head = w.mat("output.weight" if "output.weight" in w.mats else "token_embd.weight")
    groups = []
    for i in range(cfg.n_layer):
        p = f"blk.{i}."
        groups.append([w.mat(p + n) for n in ("attn_q.weight", "attn_k.weight", "attn_v.weight")])
        groups += [[w.mat(p + n)] for n in ("attn_output.weight", "ffn_down.weight", "ffn_gate.weight",
                                            "ffn_up.weight")]
    groups.append([head])
    glu = {(w.mat(f"blk.{i}.ffn_gate.weight").struct, w.mat(f"blk.{i}.ffn_gate.weight").rows,
            w.mat(f"blk.{i}.ffn_gate.weight").cols) for i in range(cfg.n_layer)}
    q8 = use_q8(cfg)
    # o-proj and down: y += W a, or y = W a before a post-norm (both modes)
    residuals = {w.mat(f"blk.{i}.{n}.weight").qs for i in range(cfg.n_layer) for n in ("attn_output", "ffn_down")}
    for mats in groups:
        structs, rows = [m.struct for m in mats], [m.rows for m in mats]
        ios = [0] + ([1] if q8 and L.q8_capable(mats) else [])
        # staged scales (launchers.mmv_kstage_bytes): roles qkv and head here, o and down with the epilogue
        stage = bool(blocks.kstage & ({"qkv"} if len(mats) == 3 else {"head"} if mats is groups[-1] else set()))
        for mode in (0, 1):
            for b in L.MMV_TOKENS:
                r, wg = L.mmv_config(structs, rows, mats[0].cols, b)
                staged = stage and len(ios) > 1 and L.mmv_kstage_bytes(structs, mats[0].cols, r, wg, 1)
                mm += [L.mmv_name(structs, b, r, wg, mode, io) for io in ios + ([5] if staged else [])]
        if len(ios) > 1 and len(mats) == 1 and rows[0] % L.Q8_OUT_ROWS == 0:  # residual with a q8 epilogue
            staged = bool(blocks.kstage & {"o", "down"})
            for b in L.MMV_TOKENS:
                r, wg = L.mmv_config(structs, rows, mats[0].cols, b, True)
                mm += [L.mmv_name(structs, b, r, wg, 1, io)
                       for io in ((3, 7) if staged and L.mmv_kstage_bytes(structs, mats[0].cols, r, wg, 3) else (3,))]
        if max_batch > blocks.decode_mmv_rows:  # batch decode steps: tensor-core products
            modes = (0, 1) if len(mats) == 1 and mats[0].qs in residuals else (0,)
            configs = [LM.mma_config(rows, b, mats[0].cols) for b in buckets
                       if blocks.decode_mmv_rows < b <= max_batch]
            mma += [LM.mma_name(structs, c.wr, c.nt, mode, c.h) for c in configs for mode in modes]
    act = L.ACT[cfg.activation]
    for s, n, c in glu:
        mm += [L.glu_name(s, b, *L.glu_config(s, n, c, b), act) for b in L.MMV_TOKENS]
        if q8 and s not in L.FLOAT_STRUCTS:
            mm += [L.glu_name(s, b, *L.glu_config(s, n, c, b), act, 1) for b in L.MMV_TOKENS]
            ios = (3, 7) if "glu" in blocks.kstage and L.glu_kstage_bytes(s, c) else (3,)
            mm += [L.glu_name(s, b, *L.glu_q8_out_config(s, n, c, b), act, io) for b in L.MMV_TOKENS
                   for io in ios if n % L.Q8_OUT_ROWS == 0]
    mma += [LM.mma_glu_name(s, *LM.mma_config([n], b, 0, tall=False)[:2], act) for s, n, _ in glu for b in buckets
            if blocks.decode_mmv_rows < b <= max_batch]
    mm.append(f"embed_rows<{w.mat('token_embd.weight').struct}>")
    mm += [f"dequant_f16<{s}>" for s in {m.struct for m in w.mats.values()}]
    if blocks.mmv_cfg["GLU"]:  # measuring the GLU's (R, WG)
        mm += [L.glu_name(s, b, *blocks.mmv_cfg["GLU"], act, io) for s, _, c in glu for b in L.MMV_TOKENS
               for io in (1, 3) + ((7,) if "glu" in blocks.kstage and L.glu_kstage_bytes(s, c) else ())]
    if any(blocks.mmv_cfg[k] for k in ("QKV", "O", "DOWN")):  # measuring (R, WG): every candidate, one module
        for mats in groups:
            structs = [m.struct for m in mats]
            for r, wg in MMV_SWEEP:
                mm += [L.mmv_name(structs, 1, r, wg, 0, 1), L.mmv_name(structs, 1, *L.q8_out_config(r, wg), 1, 3)]
    kernels.prepare("matvec.cu", mm)
    if mma:
        kernels.prepare("matmul_mma.cu", mma)
    kernels.prepare("layers.cu", ["rmsnorm", "rope_kv", "glu", "add_bias", "softcap", "quantize_q8"])
    kv16 = blocks.kv.kv16
    kernels.prepare("attention.cu", [LA.kernel_name(cfg.head_dim, cfg.n_head // cfg.n_head_kv, shape, kv16)
                                     for shape in blocks.attn_shapes])
    if any(blocks.tiles(b, decode=True) for b in buckets if b <= max_batch):
        kernels.prepare("attention_tiles.cu", [LA.tiles_kernel_name(cfg.head_dim, cfg.n_head // cfg.n_head_kv,
                                                                    kv16=kv16)])
    kernels.prepare("sampling.cu", ["repeat_penalty", "argmax_sample", "topk_sample"])
