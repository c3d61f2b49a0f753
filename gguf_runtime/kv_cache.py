"""The paged KV cache on the GPU: a pool of fixed-size pages and a block table per sequence.

Per layer the cache is [pages, n_head_kv, page_size, head_dim]; sequence s's position p lives in
page table[s, p // page_size], slot p % page_size. Kernels read the table and each token's
position from device memory, so one launch configuration serves any context length.
"""

from __future__ import annotations

import cupy as cp
import numpy as np

from .model_config import ModelConfig

PAGE_SIZE = 16


class PagedKVCache:
    def __init__(self, cfg: ModelConfig, n_ctx: int, n_seqs: int = 1, page_size: int = PAGE_SIZE) -> None:
        self.page_size = page_size
        self.max_pages = (n_ctx + page_size - 1) // page_size  # pages one sequence can hold
        self.n_seqs = n_seqs
        self.n_pages = self.max_pages * n_seqs
        shape = (cfg.n_layer, self.n_pages, cfg.n_head_kv, page_size, cfg.head_dim)
        self.k = cp.zeros(shape, cp.float32)
        self.v = cp.zeros(shape[:-1] + (cfg.head_dim_v,), cp.float32)
        # each sequence owns a fixed run of pages; the table is what the kernels follow
        table = np.arange(self.n_pages, dtype=np.int32).reshape(n_seqs, self.max_pages)
        self.table = cp.asarray(table)

    def layer(self, i: int) -> tuple[int, int]:
        """Device pointers of layer i's K and V pages."""
        return self.k[i].data.ptr, self.v[i].data.ptr

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes
