// Sampling on the GPU with no host sync: the chosen token goes straight into the next step's
// input buffer, the position advances, the token joins the penalty history, and a copy lands in
// a ring of mapped (pinned) host memory that the host reads after an event.
//
// Per sequence slot b the state is: tokens[b] (next input), pos[b], hist[b][HIST] + hist_n[b],
// step[b] (tokens sampled so far; ring slot and RNG counter). Row r of the logits belongs to slot
// slot_map[r] where a slot map is given (a forward of several prompts: -1 skips the row), else to
// slot0 + r; slots with seq[b] < 0 (padding) are skipped.
#include "common.cuh"

#define HIST 64

DEV void commit(int b, int tok, int* tokens, int* pos, int* hist, int* hist_n, int* step, int* ring,
                int ring_len, int n_seq) {
    tokens[b] = tok;
    pos[b] += 1;
    hist[b * HIST + (hist_n[b] % HIST)] = tok;
    hist_n[b] += 1;
    ring[(step[b] % ring_len) * n_seq + b] = tok;
    step[b] += 1;
}

// A given token committed as if sampled (one thread): decoding that starts from a token the host
// already holds (speculative decoding's fall-back to plain decoding: the token a verification left).
extern "C" __global__ void commit_token(int b, int tok, int* tokens, int* pos, int* hist, int* hist_n, int* step,
                                        int* ring, int ring_len, int n_seq) {
    pdl_enter();
    commit(b, tok, tokens, pos, hist, hist_n, step, ring, ring_len, n_seq);
}

// Damaged weights show in a prompt's logits: bad[r] = 1 where row r holds a NaN or an infinity,
// else 0 (one block per row; a fixed kernel, where CuPy's reductions compile per shape).
extern "C" __global__ void finite_rows(const float* __restrict__ logits, int ld, int n_vocab, int* bad) {
    const float* x = logits + (long)blockIdx.x * ld;
    pdl_enter();
    int any = 0;
    for (int i = threadIdx.x; i < n_vocab; i += blockDim.x) any |= !isfinite(x[i]);
    any = __syncthreads_or(any);
    if (threadIdx.x == 0) bad[blockIdx.x] = any;
}

// A sequence's start in its slot (admission, never between steps): one block per row of ``table``,
// int32 [n, PRIME_COLS + HIST]: slot, hist_n, pos, top_k, last_n, top_p, min_p, temp, penalty (f32
// bits), seed (low, high word), logprobs (k + 1 top entries a token, 0: none; logprobs.cu), then
// the history (hist_n tokens, zero-padded). The step and the
// RNG counter restart at 0 and the slot turns active (seq[slot] = slot). One launch for a forward's
// prompts in place of a dozen host copies each.
#define PRIME_COLS 12
extern "C" __global__ void prime_slots(const int* __restrict__ table, int* hist, int* hist_n, int* step,
                                       unsigned* counter, int* pos, int* seq, int* top_k, int* last_n,
                                       float* top_p, float* min_p, float* temp, float* penalty,
                                       unsigned long long* seed, int* lp_k) {
    const int* row = table + (long)blockIdx.x * (PRIME_COLS + HIST);
    pdl_enter();
    const int b = row[0];
    for (int i = threadIdx.x; i < HIST; i += blockDim.x) hist[b * HIST + i] = row[PRIME_COLS + i];
    if (threadIdx.x != 0) return;
    hist_n[b] = row[1];
    step[b] = 0;
    counter[b] = 0;
    pos[b] = row[2];
    seq[b] = b;
    top_k[b] = row[3];
    last_n[b] = row[4];
    top_p[b] = __int_as_float(row[5]);
    min_p[b] = __int_as_float(row[6]);
    temp[b] = __int_as_float(row[7]);
    penalty[b] = __int_as_float(row[8]);
    seed[b] = (unsigned long long)(unsigned)row[9] | ((unsigned long long)(unsigned)row[10] << 32);
    lp_k[b] = row[11];
}

// llama.cpp's repetition penalty on the distinct tokens among the last last_n[b] of the history
// (penalty[b] == 1: nothing). One block (>= HIST threads) per sequence.
extern "C" __global__ void repeat_penalty(float* logits, int ld, const int* __restrict__ hist,
                                          const int* __restrict__ hist_n, const int* __restrict__ last_n,
                                          const float* __restrict__ penalty, int n_vocab,
                                          const int* __restrict__ seq, int slot0,
                                          const int* __restrict__ slot_map) {
    const int r = blockIdx.x, i = threadIdx.x;
    pdl_enter();
    const int b = slot_map ? slot_map[r] : slot0 + r;
    if (b < 0 || seq[b] < 0) return;
    const float pen = penalty[b];
    const int n = min(min(hist_n[b], HIST), last_n[b]);
    if (pen == 1.f || i >= n) return;
    const int* h = hist + b * HIST;
    const int newest = hist_n[b] - 1;
    const int tok = h[(newest - i + HIST) % HIST];
    for (int j = 0; j < i; ++j)
        if (h[(newest - j + HIST) % HIST] == tok) return;  // counted once, by its newest entry
    if (tok < 0 || tok >= n_vocab) return;
    float* p = logits + (long)r * ld + tok;
    *p = *p > 0.f ? *p / pen : *p * pen;
}

// The argmax of x[lo, hi) over the block (ties: lowest id; none finite: -inf, 0x7fffffff), in
// thread 0's (best, bi); sv / si: 32 entries of shared memory.
DEV void block_argmax(const float* x, int lo, int hi, float* sv, int* si, float& best, int& bi) {
    best = -INFINITY;
    bi = 0x7fffffff;
    for (int i = lo + threadIdx.x; i < hi; i += blockDim.x) {
        const float v = x[i];
        if (v > best) { best = v; bi = i; }  // strided ascending: the first max per thread is its lowest id
    }
    warp_argmax(best, bi);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) { sv[warp] = best; si[warp] = bi; }
    __syncthreads();
    if (threadIdx.x == 0)
        for (int w = 1; w < (int)(blockDim.x >> 5); ++w)
            if (sv[w] > best || (sv[w] == best && si[w] < bi)) { best = sv[w]; bi = si[w]; }
}

// Greedy: argmax over the vocabulary (ties: lowest id). Grid (n_blocks, n_seq); the last block of
// each sequence to finish merges the partials and commits the token.
extern "C" __global__ void __launch_bounds__(1024) argmax_sample(
        const float* __restrict__ logits, int ld, int n_vocab, float* pval, int* pidx, unsigned* counter,
        int* tokens, int* pos, int* hist, int* hist_n, int* step, int* ring, int ring_len, int n_seq,
        const int* __restrict__ seq, int slot0, const int* __restrict__ slot_map) {
    __shared__ float sv[32];
    __shared__ int si[32];
    __shared__ bool last;
    const int nb = gridDim.x;
    pdl_enter();
    const int b = slot_map ? slot_map[blockIdx.y] : slot0 + blockIdx.y;
    if (b < 0 || seq[b] < 0) return;
    const float* x = logits + (long)blockIdx.y * ld;
    const int per = (n_vocab + nb - 1) / nb, lo = blockIdx.x * per, hi = min(n_vocab, lo + per);
    float best;
    int bi;
    block_argmax(x, lo, hi, sv, si, best, bi);
    if (threadIdx.x == 0) {
        pval[b * nb + blockIdx.x] = best;
        pidx[b * nb + blockIdx.x] = bi;
        __threadfence();
        last = atomicAdd(&counter[b], 1u) == (unsigned)(nb - 1);
    }
    __syncthreads();
    if (!last || threadIdx.x != 0) return;
    __threadfence();
    float bv = -INFINITY; int bk = 0;
    for (int k = 0; k < nb; ++k) {
        const float v = ((volatile float*)pval)[b * nb + k];
        const int id = ((volatile int*)pidx)[b * nb + k];
        if (v > bv || (v == bv && id < bk)) { bv = v; bk = id; }
    }
    if (bk == 0x7fffffff) bk = 0;  // every logit NaN or -inf
    counter[b] = 0;
    commit(b, bk, tokens, pos, hist, hist_n, step, ring, ring_len, n_seq);
}

// Each row's argmax (ties: lowest id; all NaN or -inf: 0) into out[r], touching no sampler state:
// speculative decoding's greedy verification reads these few ints instead of the rows' logits.
// One block of 1024 threads a row.
extern "C" __global__ void __launch_bounds__(1024) rows_argmax(const float* __restrict__ logits, int ld, int n_vocab,
                                                              int* out) {
    __shared__ float sv[32];
    __shared__ int si[32];
    pdl_enter();
    float best;
    int bi;
    block_argmax(logits + (long)blockIdx.x * ld, 0, n_vocab, sv, si, best, bi);
    if (threadIdx.x != 0) return;
    out[blockIdx.x] = bi == 0x7fffffff ? 0 : bi;
}

DEV u64 splitmix64(u64 z) {
    z += 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

DEV u32 order_key(float f) {  // monotone: larger float -> larger key
    const u32 u = __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

#define CAP 2048   // candidates the final block sorts
#define TK_E 8      // logits per thread in the first phase: grid.x = ceil(n_vocab / (1024 * TK_E))
#define TK_MAX 1024 // largest top-k

DEV u32 key_float(u32 k) { return (k & 0x80000000u) ? (k & 0x7FFFFFFFu) : ~k; }  // inverse of order_key

// Warp 0: the 8-bit digit of the `remaining`-th largest key among those counted in h (256 bins),
// then prefix/prefix_mask/remaining updated for the next digit down.
DEV void radix_pick(const u32* h, int shift, u32& prefix, u32& prefix_mask, int& remaining) {
    const int lane = threadIdx.x;
    u32 c[8], s = 0;
#pragma unroll
    for (int j = 0; j < 8; ++j) { c[j] = h[255 - 8 * lane - j]; s += c[j]; }  // lane 0: the top bins
    u32 incl = s;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const u32 t = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += t;
    }
    const u32 excl = incl - s, need = (u32)remaining;
    const bool mine = excl < need && need <= incl;
    const bool any = __ballot_sync(0xffffffffu, mine) != 0u;
    __syncwarp();
    if (mine) {
        u32 n = need - excl; int d = 255 - 8 * lane;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            if (c[j] >= n) break;
            n -= c[j]; --d;
        }
        remaining = (int)n;
        prefix |= (u32)d << shift;
        prefix_mask |= 0xFFu << shift;
    } else if (!any && lane == 0) {  // fewer keys than asked for (cannot happen): take digit 0
        prefix_mask |= 0xFFu << shift;
    }
}

// Adds 1 to the bin of every calling thread of the warp: one atomic per distinct bin.
DEV void hist_add(u32* h, u32 bin) {
    const unsigned peers = __match_any_sync(__activemask(), bin);
    if ((threadIdx.x & 31) == __ffs(peers) - 1) atomicAdd(&h[bin], (u32)__popc(peers));
}

// (key, id) with the largest key, the lowest id among equal keys: a warp's, then the block's (ws:
// 64 words of shared memory); the result in thread 0's bk, bi.
DEV void top1_warp(u32& bk, int& bi) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const u32 ok = __shfl_xor_sync(0xffffffffu, bk, o);
        const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
        if (ok > bk || (ok == bk && oi < bi)) { bk = ok; bi = oi; }
    }
}
DEV void top1_block(u32& bk, int& bi, u32* ws) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    top1_warp(bk, bi);
    if (lane == 0) { ws[warp] = bk; ws[32 + warp] = (u32)bi; }
    __syncthreads();
    if (warp == 0) {
        bk = lane < (int)(blockDim.x >> 5) ? ws[lane] : 0u;
        bi = lane < (int)(blockDim.x >> 5) ? (int)ws[32 + lane] : 0x7fffffff;
        top1_warp(bk, bi);
    }
}

// Block-wide inclusive prefix sum of one float per thread (blockDim.x == 1024); ws: 32 floats.
DEV float block_scan(float v, float* ws) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const float t = __shfl_up_sync(0xffffffffu, v, o);
        if (lane >= o) v += t;
    }
    if (lane == 31) ws[warp] = v;
    __syncthreads();
    if (warp == 0) {
        float w = ws[lane];
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const float t = __shfl_up_sync(0xffffffffu, w, o);
            if (lane >= o) w += t;
        }
        ws[lane] = w;
    }
    __syncthreads();
    const float r = v + (warp ? ws[warp - 1] : 0.f);
    __syncthreads();
    return r;
}

// Per sequence b: temp[b] <= 0 is greedy (argmax, ties: lowest id); otherwise top-k (k <= 1024) ->
// top-p -> min-p -> temperature -> draw, as sampling.py's Sampler, with the draw's uniform number
// from (seed[b], step[b]). Grid (n_blocks, rows), 1024 threads, two blocks per SM (32 registers:
// a batch of 64 rows over the 8B's vocabulary launches 1,024 blocks). Phase 1: each block
// radix-selects the k largest logits of its slice (TK_E per thread, in registers; one shared atomic
// per distinct digit per warp), or for k = 1 takes the max by a reduction, and writes them to
// cand_v/cand_i. Phase 2: the last block of the row to finish
// gathers the n_blocks * k candidates (radix-selecting again when they overflow CAP), sorts them
// (value desc, id asc) and draws with block-wide prefix sums; it commits the token.
extern "C" __global__ void __launch_bounds__(1024, 2) topk_sample(
        const float* __restrict__ logits, int ld, int n_vocab, const int* __restrict__ top_k_,
        const float* __restrict__ top_p_, const float* __restrict__ min_p_, const float* __restrict__ temp_,
        const unsigned long long* __restrict__ seed_, float* cand_v, int* cand_i, int* cand_n,
        unsigned* counter, int* tokens, int* pos, int* hist, int* hist_n, int* step,
        int* ring, int ring_len, int n_seq, const int* __restrict__ seq, int slot0,
        const int* __restrict__ slot_map) {
    __shared__ u32 hist_c[256];
    __shared__ u32 prefix, prefix_mask;
    __shared__ int remaining, n_cand, n_ties, first;
    __shared__ bool last;
    __shared__ float cv[CAP];
    __shared__ int ci[CAP];
    __shared__ float ws[32];
    const int tid = threadIdx.x, nb = gridDim.x, blk = blockIdx.x;
    pdl_enter();
    const int b = slot_map ? slot_map[blockIdx.y] : slot0 + blockIdx.y;
    if (b < 0 || seq[b] < 0) return;
    const float* x = logits + (long)blockIdx.y * ld;
    const float temp = temp_[b];
    const int top_k = temp <= 0.f ? 1 : min(max(top_k_[b], 1), min(n_vocab, TK_MAX));
    const int per = (n_vocab + nb - 1) / nb, lo = blk * per, hi = min(n_vocab, lo + per);
    float* my_v = cand_v + ((long)b * nb + blk) * TK_MAX;
    int* my_i = cand_i + ((long)b * nb + blk) * TK_MAX;

    // ---- phase 1: the top_k largest of this block's slice ----
    u32 key[TK_E];
#pragma unroll
    for (int e = 0; e < TK_E; ++e) {
        const int i = lo + e * 1024 + tid;
        key[e] = i < hi ? order_key(x[i]) : 0u;
    }
    const int kk = min(top_k, max(hi - lo, 0));
    if (tid == 0) { prefix = 0; prefix_mask = 0; remaining = kk; n_cand = 0; n_ties = 0; }
    __syncthreads();
    if (kk == 1) {  // top-1 (greedy rows): the largest key, lowest id on ties, by a max reduction
        u32 bk = 0u; int bi = 0x7fffffff;  // (0, no id) loses to every real (key, id)
#pragma unroll
        for (int e = 0; e < TK_E; ++e) {
            const int i = lo + e * 1024 + tid;
            if (i < hi && (key[e] > bk || bi == 0x7fffffff)) { bk = key[e]; bi = i; }  // ids ascend with e
        }
        top1_block(bk, bi, hist_c);
        if (tid == 0) { my_v[0] = u2f(key_float(bk)); my_i[0] = bi; }
    } else if (kk > 0) {
        for (int shift = 24; shift >= 0; shift -= 8) {
            if (tid < 256) hist_c[tid] = 0;
            __syncthreads();
            const u32 pf = prefix, pm = prefix_mask;
#pragma unroll
            for (int e = 0; e < TK_E; ++e)
                if (lo + e * 1024 + tid < hi && (key[e] & pm) == pf) hist_add(hist_c, (key[e] >> shift) & 0xFFu);
            __syncthreads();
            if (tid < 32) radix_pick(hist_c, shift, prefix, prefix_mask, remaining);
            __syncthreads();
        }
        const u32 kth = prefix;
        const int take = remaining;  // how many keys equal to kth, lowest ids first
        int my_ties = 0;
#pragma unroll
        for (int e = 0; e < TK_E; ++e) {
            const int i = lo + e * 1024 + tid;
            if (i < hi && key[e] > kth) {
                const int c = atomicAdd(&n_cand, 1);
                my_v[c] = u2f(key_float(key[e])); my_i[c] = i;
            }
            my_ties += i < hi && key[e] == kth;
        }
        if (my_ties) atomicAdd(&n_ties, my_ties);
        __syncthreads();
        const int base = kk - take;  // keys above kth, already written
        if (n_ties == take) {  // the usual case: every tie is taken
#pragma unroll
            for (int e = 0; e < TK_E; ++e) {
                const int i = lo + e * 1024 + tid;
                if (i < hi && key[e] == kth) {
                    const int c = atomicAdd(&n_cand, 1);
                    my_v[c] = u2f(key_float(kth)); my_i[c] = i;
                }
            }
        } else {  // more ties than places: take them in id order (id = lo + e*1024 + tid)
            int taken = 0;
            for (int e = 0; e < TK_E && taken < take; ++e) {
                const int i = lo + e * 1024 + tid;
                const bool t = i < hi && key[e] == kth;
                const unsigned bal = __ballot_sync(0xffffffffu, t);
                if ((tid & 31) == 0) ws[tid >> 5] = __int_as_float(__popc(bal));
                __syncthreads();
                int before = 0, total = 0;
                for (int w = 0; w < 32; ++w) {
                    const int cw = __float_as_int(ws[w]);
                    before += w < (tid >> 5) ? cw : 0;
                    total += cw;
                }
                const int rank = taken + before + __popc(bal & ((1u << (tid & 31)) - 1u));
                if (t && rank < take) { my_v[base + rank] = u2f(key_float(kth)); my_i[base + rank] = i; }
                taken += total;
                __syncthreads();
            }
        }
    }
    __threadfence();  // every thread's candidates are visible before the count below
    __syncthreads();
    if (tid == 0) {
        cand_n[b * nb + blk] = kk;
        __threadfence();
        last = atomicAdd(&counter[b], 1u) == (unsigned)(nb - 1);
    }
    __syncthreads();
    if (!last) return;
    __threadfence();

    // ---- phase 2 (the row's last block): the top_k of all candidates, sorted ----
    const volatile float* av = cand_v + (long)b * nb * TK_MAX;
    const volatile int* ai = cand_i + (long)b * nb * TK_MAX;
    const volatile int* an = cand_n + b * nb;
    int total = 0;
    for (int k = 0; k < nb; ++k) total += an[k];
    if (tid == 0) { prefix = 0; prefix_mask = 0; remaining = min(top_k, total); n_cand = 0; }
    __syncthreads();
    const int slots = nb * TK_MAX;  // candidate j of block k sits at k * TK_MAX + j
    if (total > CAP) {  // radix-select the top_k-th key among the candidates
        for (int shift = 24; shift >= 0; shift -= 8) {
            if (tid < 256) hist_c[tid] = 0;
            __syncthreads();
            const u32 pf = prefix, pm = prefix_mask;
            for (int s = tid; s < slots; s += 1024) {
                if ((s % TK_MAX) >= an[s / TK_MAX]) continue;
                const u32 k = order_key(av[s]);
                if ((k & pm) == pf) atomicAdd(&hist_c[(k >> shift) & 0xFFu], 1u);
            }
            __syncthreads();
            if (tid < 32) radix_pick(hist_c, shift, prefix, prefix_mask, remaining);
            __syncthreads();
        }
    }
    // Every key above kth is kept (exactly want - remaining of them, fewer than CAP), then ties
    // of kth where places are left. A grammar mask leaves most logits at -inf: those are the ties,
    // and the few allowed tokens must never lose their places to them.
    const bool sel = total > CAP;
    const u32 kth = sel ? prefix : 0u;
    const int above = sel ? min(top_k, total) - remaining : 0;
    if (tid == 0) n_ties = 0;
    __syncthreads();
    for (int s = tid; s < slots; s += 1024) {
        if ((s % TK_MAX) >= an[s / TK_MAX]) continue;
        const float v = av[s];
        const u32 key = order_key(v);
        if (!sel || key > kth) {
            const int c = atomicAdd(&n_cand, 1);
            cv[c] = v; ci[c] = ai[s];
        } else if (key == kth) {
            const int c = above + atomicAdd(&n_ties, 1);
            if (c < CAP) { cv[c] = v; ci[c] = ai[s]; }
        }
    }
    __syncthreads();
    const int nc = sel ? min(above + n_ties, CAP) : n_cand;
    int size = 1;
    while (size < nc) size <<= 1;
    for (int i = nc + tid; i < size; i += 1024) { cv[i] = -INFINITY; ci[i] = 0x7fffffff; }
    __syncthreads();
    for (int k = 2; k <= size; k <<= 1)  // bitonic sort, descending by value, ascending id on ties
        for (int j = k >> 1; j > 0; j >>= 1) {
            for (int i = tid; i < size; i += 1024) {
                const int o = i ^ j;
                if (o > i) {
                    const bool a_first = cv[i] > cv[o] || (cv[i] == cv[o] && ci[i] < ci[o]);
                    if (((i & k) == 0) != a_first) {
                        const float tv = cv[i]; cv[i] = cv[o]; cv[o] = tv;
                        const int ti = ci[i]; ci[i] = ci[o]; ci[o] = ti;
                    }
                }
            }
            __syncthreads();
        }

    // ---- the draw: top-p, min-p, temperature over the sorted list (block-wide scans) ----
    int n = min(nc, top_k), pick = 0;
    if (temp > 0.f && n > 1) {
        const float m = cv[0], top_p = top_p_[b], min_p = min_p_[b];
        const bool in = tid < n;
        if (top_p < 1.f) {  // smallest prefix whose probability reaches top_p
            const float e = in ? __expf(cv[tid] - m) : 0.f;
            const float cum = block_scan(e, ws);
            if (tid == 1023) ws[0] = cum;
            if (tid == 0) first = n;
            __syncthreads();
            const float z = ws[0];
            if (in && cum >= top_p * z) atomicMin(&first, tid + 1);
            __syncthreads();
            n = first;
        }
        if (min_p > 0.f) {
            const float thr = m + logf(min_p);
            n = max(__syncthreads_count(tid < n && cv[tid] >= thr), 1);
        }
        const float w = tid < n ? __expf((cv[tid] - m) / temp) : 0.f;
        const float cum = block_scan(w, ws);
        if (tid == 1023) ws[0] = cum;
        if (tid == 0) first = n - 1;
        __syncthreads();
        const u64 r = splitmix64(seed_[b] ^ splitmix64((u64)step[b] * 0x100000001B3ull));
        const float target = (float)((double)(r >> 11) * (1.0 / 9007199254740992.0)) * ws[0];
        if (tid < n && target < cum) atomicMin(&first, tid);
        __syncthreads();
        pick = first;
    }
    if (tid != 0) return;
    counter[b] = 0;
    const int tok = ci[pick];
    commit(b, (tok < 0 || tok >= n_vocab) ? 0 : tok, tokens, pos, hist, hist_n, step, ring, ring_len, n_seq);
}
