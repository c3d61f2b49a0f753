// Sampling on the GPU with no host sync: the chosen token goes straight into the next step's
// input buffer, the position advances, the token joins the penalty history, and a copy lands in
// a ring of mapped (pinned) host memory that the host reads after an event.
//
// Per sequence slot b the state is: tokens[b] (next input), pos[b], hist[b][HIST] + hist_n[b],
// step[b] (tokens sampled so far; ring slot and RNG counter). Row r of the logits belongs to slot
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

// llama.cpp's repetition penalty on the distinct tokens among the last last_n[b] of the history
// (penalty[b] == 1: nothing). One block (>= HIST threads) per sequence.
extern "C" __global__ void repeat_penalty(float* logits, int ld, const int* __restrict__ hist,
                                          const int* __restrict__ hist_n, const int* __restrict__ last_n,
                                          const float* __restrict__ penalty, int n_vocab,
                                          const int* __restrict__ seq, int slot0) {
    const int r = blockIdx.x, b = slot0 + r, i = threadIdx.x;
    if (seq[b] < 0) return;
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

// Greedy: argmax over the vocabulary (ties: lowest id). Grid (n_blocks, n_seq); the last block of
// each sequence to finish merges the partials and commits the token.
extern "C" __global__ void __launch_bounds__(1024) argmax_sample(
        const float* __restrict__ logits, int ld, int n_vocab, float* pval, int* pidx, unsigned* counter,
        int* tokens, int* pos, int* hist, int* hist_n, int* step, int* ring, int ring_len, int n_seq,
        const int* __restrict__ seq, int slot0) {
    __shared__ float sv[32];
    __shared__ int si[32];
    __shared__ bool last;
    const int b = slot0 + blockIdx.y, nb = gridDim.x;
    if (seq[b] < 0) return;
    const float* x = logits + (long)blockIdx.y * ld;
    const int per = (n_vocab + nb - 1) / nb, lo = blockIdx.x * per, hi = min(n_vocab, lo + per);
    float best = -INFINITY; int bi = 0x7fffffff;
    for (int i = lo + threadIdx.x; i < hi; i += blockDim.x) {
        const float v = x[i];
        if (v > best) { best = v; bi = i; }  // strided ascending: the first max per thread is its lowest id
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, best, o);
        const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
        if (ov > best || (ov == best && oi < bi)) { best = ov; bi = oi; }
    }
    if (lane == 0) { sv[warp] = best; si[warp] = bi; }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < (int)(blockDim.x >> 5); ++w)
            if (sv[w] > best || (sv[w] == best && si[w] < bi)) { best = sv[w]; bi = si[w]; }
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

#define CAP 2048

// Per sequence b: temp[b] <= 0 is greedy (argmax, ties: lowest id); otherwise top-k (k <= 1024) ->
// top-p -> min-p -> temperature -> draw, as sampling.py's Sampler, with the draw's uniform number
// from (seed[b], step[b]). One block of 1024 threads per sequence: radix-selects the k-th largest
// logit, gathers the survivors, sorts them (value desc, id asc), then thread 0 walks the list.
extern "C" __global__ void __launch_bounds__(1024) topk_sample(
        const float* __restrict__ logits, int ld, int n_vocab, const int* __restrict__ top_k_,
        const float* __restrict__ top_p_, const float* __restrict__ min_p_, const float* __restrict__ temp_,
        const unsigned long long* __restrict__ seed_, int* tokens, int* pos, int* hist, int* hist_n, int* step,
        int* ring, int ring_len, int n_seq, const int* __restrict__ seq, int slot0) {
    __shared__ u32 hist_c[256];
    __shared__ u32 prefix, prefix_mask;
    __shared__ int remaining, n_cand;
    __shared__ float cv[CAP];
    __shared__ int ci[CAP];
    const int b = slot0 + blockIdx.x, tid = threadIdx.x;
    if (seq[b] < 0) return;
    const float* x = logits + (long)blockIdx.x * ld;
    const float temp = temp_[b], top_p = top_p_[b], min_p = min_p_[b];
    const int top_k = min(max(top_k_[b], 1), min(n_vocab, 1024));
    if (temp <= 0.f) {  // greedy
        float best = -INFINITY; int bi = 0x7fffffff;
        for (int i = tid; i < n_vocab; i += blockDim.x) {
            const float v = x[i];
            if (v > best) { best = v; bi = i; }
        }
        for (int o = 16; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(0xffffffffu, best, o);
            const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (ov > best || (ov == best && oi < bi)) { best = ov; bi = oi; }
        }
        if ((tid & 31) == 0) { cv[tid >> 5] = best; ci[tid >> 5] = bi; }
        __syncthreads();
        if (tid == 0) {
            for (int w = 1; w < (int)(blockDim.x >> 5); ++w)
                if (cv[w] > best || (cv[w] == best && ci[w] < bi)) { best = cv[w]; bi = ci[w]; }
            commit(b, bi == 0x7fffffff ? 0 : bi, tokens, pos, hist, hist_n, step, ring, ring_len, n_seq);
        }
        return;
    }
    if (tid == 0) { prefix = 0; prefix_mask = 0; remaining = top_k; n_cand = 0; }
    __syncthreads();
    // radix select, 8 bits at a time from the top: the key of the k-th largest logit
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int i = tid; i < 256; i += blockDim.x) hist_c[i] = 0;
        __syncthreads();
        const u32 pf = prefix, pm = prefix_mask;
        for (int i = tid; i < n_vocab; i += blockDim.x) {
            const u32 k = order_key(x[i]);
            if ((k & pm) == pf) atomicAdd(&hist_c[(k >> shift) & 0xFFu], 1u);
        }
        __syncthreads();
        if (tid == 0) {
            int need = remaining, d = 255;
            for (; d > 0; --d) {
                if ((int)hist_c[d] >= need) break;
                need -= hist_c[d];
            }
            remaining = need;
            prefix = pf | ((u32)d << shift);
            prefix_mask = pm | (0xFFu << shift);
        }
        __syncthreads();
    }
    const u32 kth = prefix;
    // gather keys > kth, then the lowest ids among keys == kth
    for (int i = tid; i < n_vocab; i += blockDim.x) {
        const float v = x[i];
        if (order_key(v) > kth) {
            const int c = atomicAdd(&n_cand, 1);
            if (c < CAP) { cv[c] = v; ci[c] = i; }
        }
    }
    __syncthreads();
    if (tid == 0) {  // ties at the boundary, in id order (rare: a serial scan is fine)
        int need = remaining, c = min(n_cand, CAP);
        for (int i = 0; i < n_vocab && need > 0 && c < CAP; ++i)
            if (order_key(x[i]) == kth) { cv[c] = x[i]; ci[c] = i; ++c; --need; }
        n_cand = c;
    }
    __syncthreads();
    const int nc = n_cand;
    int size = 1;
    while (size < nc) size <<= 1;
    for (int i = nc + tid; i < size; i += blockDim.x) { cv[i] = -INFINITY; ci[i] = 0x7fffffff; }
    __syncthreads();
    // bitonic sort, descending by value, ascending id on ties
    for (int k = 2; k <= size; k <<= 1)
        for (int j = k >> 1; j > 0; j >>= 1) {
            for (int i = tid; i < size; i += blockDim.x) {
                const int o = i ^ j;
                if (o > i) {
                    const bool a_first = cv[i] > cv[o] || (cv[i] == cv[o] && ci[i] < ci[o]);
                    const bool desc = (i & k) == 0;
                    if (desc != a_first) {
                        const float tv = cv[i]; cv[i] = cv[o]; cv[o] = tv;
                        const int ti = ci[i]; ci[i] = ci[o]; ci[o] = ti;
                    }
                }
            }
            __syncthreads();
        }
    if (tid != 0) return;
    int n = min(nc, top_k);
    const double m = cv[0];
    if (top_p < 1.f) {  // smallest prefix whose probability reaches top_p
        double z = 0.0;
        for (int i = 0; i < n; ++i) z += exp((double)cv[i] - m);
        double cum = 0.0; int keep = n;
        for (int i = 0; i < n; ++i) {
            cum += exp((double)cv[i] - m) / z;
            if (cum >= top_p) { keep = i + 1; break; }
        }
        n = keep;
    }
    if (min_p > 0.f) {
        const double thr = m + log((double)min_p);
        int keep = 0;
        while (keep < n && (double)cv[keep] >= thr) ++keep;
        n = max(keep, 1);
    }
    double z = 0.0;
    for (int i = 0; i < n; ++i) z += exp(((double)cv[i] - m) / temp);
    const u64 r = splitmix64(seed_[b] ^ splitmix64((u64)step[b] * 0x100000001B3ull));
    const double u = (double)(r >> 11) * (1.0 / 9007199254740992.0);
    const double target = u * z;
    double cum = 0.0; int pick = n - 1;
    for (int i = 0; i < n; ++i) {
        cum += exp(((double)cv[i] - m) / temp);
        if (target < cum) { pick = i; break; }
    }
    commit(b, ci[pick], tokens, pos, hist, hist_n, step, ring, ring_len, n_seq);
}
