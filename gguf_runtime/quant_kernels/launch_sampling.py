"""Launchers of sampling.cu: repetition penalty, greedy argmax and top-k/top-p/min-p sampling of
logits rows on the GPU, with the per-sequence state they update (no host sync per token)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .launch_core import Kernels, i32, ptr


@dataclass(frozen=True)
class SamplerState:
    """Device pointers of the per-sequence sampling state and parameters (see sampling.cu)."""

    tokens: int
    pos: int
    hist: int
    hist_n: int
    step: int
    ring: int  # mapped host memory, [ring_len, n_seq] int32
    ring_len: int
    n_seq: int
    pval: int  # argmax partials [n_seq, ARGMAX_BLOCKS]
    pidx: int
    counter: int
    cand_v: int  # top-k candidates: f32 and int32 [n_seq, topk_blocks(n_vocab), TOPK_MAX]
    cand_i: int
    cand_n: int  # int32 [n_seq, topk_blocks(n_vocab)]
    top_k: int  # per-sequence parameters: int32, f32, f32, f32, u64, f32, int32
    top_p: int
    min_p: int
    temp: int
    seed: int
    penalty: int
    last_n: int
    seq: int  # per slot: >= 0 active, < 0 padding (samples nothing)
    lp_k: int  # per slot int32: top logprobs + 1 where the slot reports logprobs, else 0 (logprobs.cu)
    lp_ring: int  # mapped host memory, [ring_len, n_seq, LP_COLS] float32
    lp_win: int  # int32 [n_seq, HIST, 2]: the penalty window's (token, raw logit bits)


ARGMAX_BLOCKS = 32
TOPK_MAX, TOPK_PER_THREAD = 1024, 8  # sampling.cu's TK_MAX and TK_E


def topk_blocks(n_vocab: int) -> int:
    """Blocks per row of topk_sample: 1024 threads x TOPK_PER_THREAD logits each."""
    return -(-n_vocab // (1024 * TOPK_PER_THREAD))


HIST, PRIME_COLS = 64, 12  # sampling.cu's history length and prime_slots' columns before it
LP_TOP = 20  # logprobs.cu: top logprobs a token at most
LP_COLS = 3 + 2 * LP_TOP  # a ring row: log-sum-exp, the chosen token's raw logit, k, k ids, k logits


def prime_table(rows) -> np.ndarray:
    """prime_slots' table: one row per (slot, history, pos, top_k, last_n, top_p, min_p, temp,
    penalty, seed[, logprobs]) tuple (logprobs: top entries a token, -1 or absent: none); the
    history's last HIST tokens are kept."""
    t = np.zeros((len(rows), PRIME_COLS + HIST), np.int32)
    f = t.view(np.float32)
    for i, (slot, history, pos, top_k, last_n, top_p, min_p, temp, penalty, seed, *lp) in enumerate(rows):
        tail = np.asarray(list(history)[-HIST:], np.int32)
        t[i, :5] = slot, tail.shape[0], pos, top_k, last_n
        f[i, 5:9] = top_p, min_p, temp, penalty
        seed = int(seed) & (1 << 64) - 1
        t[i, 9:11] = np.array([seed & 0xFFFFFFFF, seed >> 32], np.uint32).view(np.int32)
        t[i, 11] = min(int(lp[0]), LP_TOP) + 1 if lp and lp[0] >= 0 else 0
        t[i, PRIME_COLS:PRIME_COLS + tail.shape[0]] = tail
    return t


def prime_slots(k: Kernels, table: int, n: int, st: SamplerState) -> None:
    """Start the sequences of a device copy of prime_table's n rows (sampling.cu prime_slots)."""
    k.fn("sampling.cu", "prime_slots")((n,), (64,), (ptr(table), ptr(st.hist), ptr(st.hist_n), ptr(st.step),
                                                     ptr(st.counter), ptr(st.pos), ptr(st.seq), ptr(st.top_k),
                                                     ptr(st.last_n), ptr(st.top_p), ptr(st.min_p), ptr(st.temp),
                                                     ptr(st.penalty), ptr(st.seed), ptr(st.lp_k)))


def row_logprobs(k: Kernels, logits: int, ld: int, n_vocab: int, st: SamplerState, rows: int,
                 slot0: int = 0, slots: int = 0) -> None:
    """Before repeat_penalty: each reporting row's log-sum-exp, top logprobs and penalty window
    into the lp ring at the index of the token about to be sampled (logprobs.cu)."""
    k.fn("logprobs.cu", "row_logprobs")((rows,), (1024,), (
        ptr(logits), i32(ld), i32(n_vocab), ptr(st.lp_k), ptr(st.step), ptr(st.hist), ptr(st.hist_n),
        ptr(st.last_n), ptr(st.lp_ring), ptr(st.lp_win), i32(st.ring_len), i32(st.n_seq), ptr(st.seq), i32(slot0),
        ptr(slots)))


def chosen_logprob(k: Kernels, logits: int, ld: int, st: SamplerState, rows: int, slot0: int = 0,
                   slots: int = 0) -> None:
    """After the sampler: each reporting row's chosen token's raw logit into its ring row."""
    k.fn("logprobs.cu", "chosen_logprob")((-(-rows // 64),), (64,), (
        ptr(logits), i32(ld), ptr(st.lp_k), ptr(st.tokens), ptr(st.step), ptr(st.lp_win), ptr(st.lp_ring),
        i32(st.ring_len), i32(st.n_seq), ptr(st.seq), i32(slot0), ptr(slots), i32(rows)))


def lp_entry(row: np.ndarray, tok: int) -> tuple[int, float, tuple[tuple[int, float], ...]]:
    """sampling.token_logprobs' entry from a ring row (LP_COLS float32) and its token."""
    lse, chosen, k = float(row[0]), float(row[1]), int(row[2])
    ids = row[3:3 + k].view(np.int32)
    vals = row[3 + LP_TOP:3 + LP_TOP + k]
    return int(tok), chosen - lse, tuple((int(i), float(v) - lse) for i, v in zip(ids, vals))


def rows_argmax(k: Kernels, logits: int, ld: int, n_vocab: int, rows: int, out: int) -> None:
    """out[r] (int32) = row r's argmax, ties to the lowest id (sampling.cu; no sampler state)."""
    k.fn("sampling.cu", "rows_argmax")((rows,), (1024,), (ptr(logits), i32(ld), i32(n_vocab), ptr(out)))


def finite_rows(k: Kernels, logits: int, ld: int, n_vocab: int, rows: int, bad: int) -> None:
    """bad[r] (int32) = 1 where logits row r has a NaN or an infinity, else 0 (sampling.cu)."""
    k.fn("sampling.cu", "finite_rows")((rows,), (1024,), (ptr(logits), i32(ld), i32(n_vocab), ptr(bad)))


# Logits row r belongs to sequence slot slot0 + r (a decode step: slot0 = 0, one row per slot;
# after a prefill: the prompt's last row, for its slot), or to slots[r] given a device slot map
# (int32 per row, -1: skip the row; the prompts of one packed forward).
def repeat_penalty(k: Kernels, logits: int, ld: int, n_vocab: int, st: SamplerState, rows: int,
                   slot0: int = 0, slots: int = 0) -> None:
    k.fn("sampling.cu", "repeat_penalty")((rows,), (64,), (ptr(logits), i32(ld), ptr(st.hist), ptr(st.hist_n),
                                                           ptr(st.last_n), ptr(st.penalty), i32(n_vocab),
                                                           ptr(st.seq), i32(slot0), ptr(slots)))


def argmax_sample(k: Kernels, logits: int, ld: int, n_vocab: int, st: SamplerState, rows: int,
                  slot0: int = 0, slots: int = 0) -> None:
    k.fn("sampling.cu", "argmax_sample")(
        (ARGMAX_BLOCKS, rows), (1024,),
        (ptr(logits), i32(ld), i32(n_vocab), ptr(st.pval), ptr(st.pidx), ptr(st.counter), ptr(st.tokens),
         ptr(st.pos), ptr(st.hist), ptr(st.hist_n), ptr(st.step), ptr(st.ring), i32(st.ring_len), i32(st.n_seq),
         ptr(st.seq), i32(slot0), ptr(slots)))


def commit_token(k: Kernels, st: SamplerState, slot: int, tok: int) -> None:
    """Slot ``slot``'s next token is ``tok``, committed as the sampler commits one (sampling.cu)."""
    k.fn("sampling.cu", "commit_token")((1,), (1,), (
        i32(slot), i32(tok), ptr(st.tokens), ptr(st.pos), ptr(st.hist), ptr(st.hist_n), ptr(st.step), ptr(st.ring),
        i32(st.ring_len), i32(st.n_seq)))


def topk_sample(k: Kernels, logits: int, ld: int, n_vocab: int, st: SamplerState, rows: int,
                slot0: int = 0, slots: int = 0) -> None:
    """Per row: greedy when temp <= 0, else top-k/top-p/min-p/temperature with the row's seed."""
    k.fn("sampling.cu", "topk_sample")(
        (topk_blocks(n_vocab), rows), (1024,),
        (ptr(logits), i32(ld), i32(n_vocab), ptr(st.top_k), ptr(st.top_p), ptr(st.min_p), ptr(st.temp),
         ptr(st.seed), ptr(st.cand_v), ptr(st.cand_i), ptr(st.cand_n), ptr(st.counter), ptr(st.tokens), ptr(st.pos), ptr(st.hist), ptr(st.hist_n), ptr(st.step), ptr(st.ring),
         i32(st.ring_len), i32(st.n_seq), ptr(st.seq), i32(slot0), ptr(slots)))


def mask_words(n_vocab: int) -> int:
    """u32 words of a row of grammar masks (token_mask.cu; llguidance's bitmask layout)."""
    return (n_vocab + 31) // 32


def apply_mask(k: Kernels, logits: int, ld: int, n_vocab: int, mask: int, st: SamplerState, rows: int,
               slot0: int = 0, slots: int = 0) -> None:
    """Forbidden tokens' logits to -inf from each row's slot's mask row (token_mask.cu)."""
    words = mask_words(n_vocab)
    k.fn("token_mask.cu", "apply_mask")((-(-words // 256), rows), (256,), (
        ptr(logits), i32(ld), i32(n_vocab), ptr(mask), i32(words), ptr(st.seq), i32(slot0), ptr(slots)))
