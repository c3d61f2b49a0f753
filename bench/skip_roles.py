"""Measuring aid: leave the kernels of some roles out of the matvec-path calls (up to
MAX_MMV_TOKENS rows) of a loaded CUDA backend, so a decode step's time without them can be read
off a benchmark. The outputs are then wrong; nothing of this is in the product.

Roles: qkv, attn, o, glu, down, head (matvecs and attention, by the calling method), norm (every
rmsnorm kernel), router (a mixture of experts' router, and its top-k where that is a launch of its
own: the experts then read the ids left in the buffer) and experts (the chosen experts' products).
``skip(backend, {"attn", "o"})`` patches the blocks module's launcher references;
``skip(backend, set())`` restores them. Captured graphs are dropped.
"""

from __future__ import annotations

import sys

from gguf_runtime.backends.cuda import blocks as B
from gguf_runtime.quant_kernels import launch_attention as LA
from gguf_runtime.quant_kernels import launch_layers as LL
from gguf_runtime.quant_kernels import launch_moe as LE
from gguf_runtime.quant_kernels import launchers as L

ROLES = ("qkv", "attn", "o", "glu", "down", "head", "norm", "router", "experts")
BY_CALLER = ("mmv", "mmv_glu", "attention", "attention_tiles", "flash_decode")  # role from the calling method
NORM = {"rmsnorm": "norm"}  # launch_layers' launchers of a fixed role
MOE = {"router": "router", "topk": "router", "router_topk": "router", "glu": "experts", "down": "experts",
       "mv": "experts"}  # launch_moe's


class _Skipping:
    """A launcher module whose matvec / attention launches return at once for the skipped roles."""

    def __init__(self, mod, roles: frozenset[str], fixed: dict[str, str] | None = None) -> None:
        self._mod, self._roles, self._fixed = mod, roles, fixed or {}

    def __getattr__(self, name):
        fn = getattr(self._mod, name)
        if name in self._fixed:
            role = self._fixed[name]
            return (lambda *a, **kw: None) if role in self._roles else fn
        if name not in BY_CALLER:
            return fn

        def maybe(*args, **kwargs):
            frame = sys._getframe(1)
            caller, local = frame.f_code.co_name, frame.f_locals
            role = {"attn_in": "qkv", "attend": "attn", "ffn": "glu", "logits": "head"}.get(caller)
            if caller == "_project_residual":
                role = local["role"].lower()
            small = local["self"]._small(local["t"]) if "t" in local else True
            if role in self._roles and small:
                return None
            return fn(*args, **kwargs)
        return maybe


def skip(backend, roles: set[str] | frozenset[str]) -> None:
    bad = set(roles) - set(ROLES)
    if bad:
        raise SystemExit(f"skip: unknown roles {sorted(bad)}; roles are {', '.join(ROLES)}")
    B.L = _Skipping(L, frozenset(roles)) if roles else L
    B.LA = _Skipping(LA, frozenset(roles)) if roles else LA
    B.LL = _Skipping(LL, frozenset(roles), NORM) if roles else LL
    B.LE = _Skipping(LE, frozenset(roles), MOE) if roles else LE
    backend.graphs.clear()
