"""The paged KV cache on the GPU: a pool of fixed-size pages and a block table per sequence.

Per layer the cache is [pages, n_head_kv, page_size, head_dim]; sequence slot s's position p
lives in page table[s, p // page_size], slot p % page_size. Kernels read the table and each
token's position from device memory, so one launch configuration serves any context length.
Pages are handed out by a host-side free list when a sequence is admitted (for its prompt plus
the tokens it may generate) and return to it the moment the sequence ends. Keys and values are
float32 or f16 (``kv_type``; f16 is llama.cpp's default cache type); the kernels compute in float32.
"""

from __future__ import annotations

import cupy as cp
import numpy as np

from ...errors import KVCacheFullError
from ...format.model_config import ModelConfig

PAGE_SIZE = 16
KV_DTYPES = {"f32": cp.float32, "f16": cp.float16}
class PagedKVCache:
    def __init__(self, cfg: ModelConfig, n_ctx: int, n_seqs: int = 1, n_pages: int | None = None,
                 page_size: int = PAGE_SIZE, kv_type: str = "f32") -> None:
        if kv_type not in KV_DTYPES:
            raise ValueError(f"KV cache type {kv_type!r} is not one of {', '.join(KV_DTYPES)}")
        self.page_size, self.kv_type = page_size, kv_type
        self.kv16 = kv_type == "f16"  # the kernels' flag
        self.max_pages = (n_ctx + page_size - 1) // page_size  # table width: pages one sequence can hold
        self.n_seqs = n_seqs
        self.n_pages = n_pages if n_pages is not None else self.max_pages * n_seqs
        shape = (cfg.n_layer, self.n_pages, cfg.n_head_kv, page_size, cfg.head_dim)
        self.k = cp.zeros(shape, KV_DTYPES[kv_type])
        self.v = cp.zeros(shape[:-1] + (cfg.head_dim_v,), KV_DTYPES[kv_type])
        self.table = cp.full((n_seqs, self.max_pages), -1, cp.int32)  # -1: no page (kernels skip it)
        self._free = list(range(self.n_pages - 1, -1, -1))
        self._owned: list[list[int]] = [[] for _ in range(n_seqs)]

    @staticmethod
    def page_bytes(cfg: ModelConfig, page_size: int = PAGE_SIZE, kv_type: str = "f32") -> int:
        elem = np.dtype(KV_DTYPES[kv_type]).itemsize
        return cfg.n_layer * cfg.n_head_kv * page_size * (cfg.head_dim + cfg.head_dim_v) * elem

    def layer(self, i: int) -> tuple[int, int]:
        """Device pointers of layer i's K and V pages."""
        return self.k[i].data.ptr, self.v[i].data.ptr

    def capacity(self, seq: int) -> int:
        """Tokens sequence ``seq`` can hold with the pages it owns."""
        return len(self._owned[seq]) * self.page_size

    def free_pages(self) -> int:
        return len(self._free)

    def reserve(self, seq: int, n_tokens: int, stream: cp.cuda.Stream | None = None) -> None:
        """Give sequence ``seq`` pages for positions [0, n_tokens) (keeping those it has)."""
        need = -(-min(n_tokens, self.max_pages * self.page_size) // self.page_size)
        owned = self._owned[seq]
        if need - len(owned) > len(self._free):
            raise KVCacheFullError(f"the KV cache has {len(self._free)} free pages of {self.page_size} tokens, "
                                   f"{need - len(owned)} are needed; wait for a sequence to finish or raise the "
                                   "KV budget")
        if need <= len(owned):
            return
        while len(owned) < need:
            owned.append(self._free.pop())
        row = np.full(self.max_pages, -1, np.int32)
        row[:len(owned)] = owned
        self.table[seq].set(row, stream=stream)

    def release(self, seq: int, stream: cp.cuda.Stream | None = None) -> None:
        """Return the sequence's pages to the pool; its table row points nowhere again."""
        self._free.extend(reversed(self._owned[seq]))
        self._owned[seq] = []
        self.table[seq].set(np.full(self.max_pages, -1, np.int32), stream=stream)

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes
