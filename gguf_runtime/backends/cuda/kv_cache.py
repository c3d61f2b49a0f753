"""The paged KV cache on the GPU: a pool of fixed-size pages and a block table per sequence.

Per layer the cache is [pages, n_head_kv, page_size] rows of head_dim values (kv_layout.py: f32 and
f16 elements, or q8_0 / q4_0 blocks, each (page, KV head) block its rows' values then their
scales); sequence slot s's position p lives in page table[s, p // page_size], slot p % page_size
(page_size a power of two: the kernels shift). Kernels read the table and each token's position
from device memory, so one launch configuration serves any context length.
Pages are handed out by the host-side pool (page_pool.py) when a sequence is admitted (for its
prompt plus the tokens it may generate) and return to it the moment the sequence ends, where full
pages stay findable by their tokens (the prefix cache) until the pool needs them. Keys and values are
float32, f16 (llama.cpp's default cache type), q8_0 or q4_0 (``kv_type``, keys and values alike);
the kernels compute in float32.
"""

from __future__ import annotations

from typing import Sequence

import cupy as cp
import numpy as np

from ...format.model_config import ModelConfig
from ..page_pool import PagePool
from ...quant_kernels import kv_layout as KL

PAGE_SIZE = 16


class PagedKVCache:
    def __init__(self, cfg: ModelConfig, n_ctx: int, n_seqs: int = 1, n_pages: int | None = None,
                 page_size: int = PAGE_SIZE, kv_type: str = "f32") -> None:
        self.page_size, self.kv_type = page_size, kv_type
        self.max_pages = (n_ctx + page_size - 1) // page_size  # table width: pages one sequence can hold
        self.n_seqs = n_seqs
        self.n_pages = n_pages if n_pages is not None else self.max_pages * n_seqs
        # bytes per (page, KV head) block, viewed as uint8 whatever the type (block_bytes: ValueError
        # for an unknown type or heads it cannot block)
        kb, vb = (KL.block_bytes(kv_type, page_size, d) for d in (cfg.head_dim, cfg.head_dim_v))
        blk = (cfg.n_layer, self.n_pages, cfg.n_head_kv)
        self.k = cp.zeros(blk + (kb,), cp.uint8)
        self.v = cp.zeros(blk + (vb,), cp.uint8)
        self._dims = (cfg.head_dim, cfg.head_dim_v)
        self.table = cp.full((n_seqs, self.max_pages), -1, cp.int32)  # -1: no page (kernels skip it)
        self.pool = PagePool(self.n_pages, page_size, n_seqs)

    @staticmethod
    def page_bytes(cfg: ModelConfig, page_size: int = PAGE_SIZE, kv_type: str = "f32") -> int:
        return cfg.n_layer * cfg.n_head_kv * (KL.block_bytes(kv_type, page_size, cfg.head_dim)
                                               + KL.block_bytes(kv_type, page_size, cfg.head_dim_v))

    def values(self, i: int, which: str = "k") -> np.ndarray:
        """Layer i's keys (or values) as float32 [pages, n_head_kv, page_size, head_dim] on the host
        (kv_layout.unpack: tests and inspection)."""
        raw = (self.k if which == "k" else self.v)[i].get()
        return KL.unpack(raw, self.kv_type, self.page_size, self._dims[0 if which == "k" else 1])

    def layer(self, i: int) -> tuple[int, int]:
        """Device pointers of layer i's K and V pages."""
        return self.k[i].data.ptr, self.v[i].data.ptr

    def capacity(self, seq: int) -> int:
        """Tokens sequence ``seq`` can hold with the pages it owns."""
        return len(self.pool.owned(seq)) * self.page_size

    def free_pages(self) -> int:
        """Pages a new sequence can get (those kept only by the prefix cache included)."""
        return self.pool.available()

    def pages_for(self, n_tokens: int) -> int:
        return -(-min(n_tokens, self.max_pages * self.page_size) // self.page_size)

    def reserve(self, seq: int, n_tokens: int, stream: cp.cuda.Stream | None = None,
                prefix: Sequence[int] = ()) -> None:
        """Give sequence ``seq`` pages for positions [0, n_tokens) (keeping those it has; one that has
        none may start with ``prefix``, match's cached pages). KVCacheFullError when the pool is short."""
        if self.pool.reserve(seq, self.pages_for(n_tokens), prefix):
            owned = self.pool.owned(seq)
            row = np.full(self.max_pages, -1, np.int32)
            row[:len(owned)] = owned
            self.table[seq].set(row, stream=stream)

    def match(self, tokens: Sequence[int]) -> list[int]:
        """The cached pages of the longest whole-page prefix of a prompt, its last token left out."""
        return self.pool.match(tokens, min(len(tokens) - 1, self.max_pages * self.page_size))

    def publish(self, seq: int, tokens: Sequence[int]) -> None:
        """The sequence's full pages among ``tokens`` (written from position 0) join the prefix cache."""
        self.pool.publish(seq, tokens)

    def release(self, seq: int, stream: cp.cuda.Stream | None = None, tokens: Sequence[int] = ()) -> None:
        """Return the sequence's pages to the pool (its full pages among ``tokens``, the tokens whose
        K/V it wrote, kept for the prefix cache); its table row points nowhere again."""
        self.pool.release(seq, tokens)
        self.table[seq].set(np.full(self.max_pages, -1, np.int32), stream=stream)

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes
