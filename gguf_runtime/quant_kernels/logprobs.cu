// Log-probabilities of sampled tokens on the GPU, for the slots that ask for them (OpenAI
// logprobs / top_logprobs, Ollama logprobs), inside the batch step's graph: the model's own
// distribution, log-softmax of the raw logits, before penalties, temperature or truncation (as
// sampling.token_logprobs and vLLM report them). Two kernels around the sampler (sampling.cu):
//   row_logprobs, before repeat_penalty: the row's log-sum-exp and its k most likely tokens (value
//     desc, id asc; k <= LP_TOP), and the raw logits of the penalty's window (the history tokens the
//     penalty may change), at the token's index in the pinned lp ring (step[b], not yet committed);
//   chosen_logprob, after the sampler committed the token: its raw logit (from that window where the
//   token is in it, else the logits row, which the penalty left alone there).
// Row r belongs to slot slot_map[r] or slot0 + r, as the sampler's rows do; slots with lp_k[b] = 0
// (k + 1 where asked) or seq[b] < 0 are skipped. A ring row holds LP_COLS floats: log-sum-exp,
// the chosen token's raw logit, k, k ids (int bits), k logits.
#include "common.cuh"

#define HIST 64    // sampling.cu's history length
#define LP_TOP 20  // the most top_logprobs either API allows
#define LP_COLS (3 + 2 * LP_TOP)

// k rounds of the warp's best over the lanes' sorted lists (a lane's head moves on when it wins):
// the warp's k best, in order, to out_v / out_i (lane 0 writes).
DEV void lp_warp_merge(const float* lv, const int* li, int n, int k, float* out_v, int* out_i) {
    int h = 0;
    for (int r = 0; r < k; ++r) {
        float v = h < n ? lv[h] : -INFINITY;
        int i = h < n ? li[h] : 0x7fffffff;
        const int mine = i;
        warp_argmax(v, i);
        if (mine == i && h < n) ++h;  // ids are distinct: one lane wins
        if ((threadIdx.x & 31) == 0) { out_v[r] = v; out_i[r] = i; }
    }
}

extern "C" __global__ void __launch_bounds__(1024) row_logprobs(
        const float* __restrict__ logits, int ld, int n_vocab, const int* __restrict__ lp_k,
        const int* __restrict__ step, const int* __restrict__ hist, const int* __restrict__ hist_n,
        const int* __restrict__ last_n, float* lp_ring, int* lp_win, int ring_len, int n_seq,
        const int* __restrict__ seq, int slot0, const int* __restrict__ slot_map) {
    __shared__ float scratch[32];
    __shared__ float wv[32][LP_TOP];
    __shared__ int wi[32][LP_TOP];
    pdl_enter();
    const int r = blockIdx.x, b = slot_map ? slot_map[r] : slot0 + r;
    if (b < 0 || seq[b] < 0 || lp_k[b] <= 0) return;
    const int k = min(lp_k[b] - 1, LP_TOP), tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const float* x = logits + (long)r * ld;
    // the window repeat_penalty reads (its newest last_n distinct history tokens): their raw logits
    if (tid < HIST) {
        const int n = min(min(hist_n[b], HIST), last_n[b]);
        const int tok = tid < n ? hist[b * HIST + (hist_n[b] - 1 - tid + HIST) % HIST] : -1;
        const bool ok = tok >= 0 && tok < n_vocab;
        lp_win[(b * HIST + tid) * 2] = ok ? tok : -1;
        lp_win[(b * HIST + tid) * 2 + 1] = __float_as_int(ok ? x[tok] : 0.f);
    }
    // the maximum, the sum of exp(x - max), and this thread's k best (ascending ids: a later equal
    // value goes after the earlier ones)
    float lv[LP_TOP];
    int li[LP_TOP], n = 0;
    float m = -INFINITY;
    for (int i = tid; i < n_vocab; i += blockDim.x) {
        const float v = x[i];
        m = fmaxf(m, v);
        if (k > 0 && (n < k || v > lv[k - 1])) {
            int at = min(n, k - 1);
            while (at > 0 && v > lv[at - 1]) {
                lv[at] = lv[at - 1];
                li[at] = li[at - 1];
                --at;
            }
            lv[at] = v;
            li[at] = i;
            n = min(n + 1, k);
        }
    }
    {  // the block's maximum
        float w = m;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) w = fmaxf(w, __shfl_xor_sync(0xffffffffu, w, o));
        __syncthreads();
        if (lane == 0) scratch[warp] = w;
        __syncthreads();
        w = lane < (int)(blockDim.x >> 5) ? scratch[lane] : -INFINITY;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) w = fmaxf(w, __shfl_xor_sync(0xffffffffu, w, o));
        m = w;
    }
    float s = 0.f;
    for (int i = tid; i < n_vocab; i += blockDim.x) s += expf(x[i] - m);
    s = block_sum(s, scratch);
    lp_warp_merge(lv, li, n, k, wv[warp], wi[warp]);
    __syncthreads();
    float* out = lp_ring + ((long)(step[b] % ring_len) * n_seq + b) * LP_COLS;
    if (warp == 0) {  // the warps' lists, merged by warp 0 (lane w holds warp w's)
        const int nw = blockDim.x >> 5;
        lp_warp_merge(wv[lane], wi[lane], lane < nw ? k : 0, k, out + 3 + LP_TOP, reinterpret_cast<int*>(out + 3));
        if (lane == 0) {
            out[0] = m + logf(s);
            out[2] = (float)k;
        }
    }
}

// After the sampler committed slot b's token (tokens[b], step[b] advanced): its raw logit into
// the ring row row_logprobs wrote.
extern "C" __global__ void chosen_logprob(const float* __restrict__ logits, int ld, const int* __restrict__ lp_k,
                                          const int* __restrict__ tokens, const int* __restrict__ step,
                                          const int* __restrict__ lp_win, float* lp_ring, int ring_len, int n_seq,
                                          const int* __restrict__ seq, int slot0, const int* __restrict__ slot_map,
                                          int rows) {
    pdl_enter();
    const int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= rows) return;
    const int b = slot_map ? slot_map[r] : slot0 + r;
    if (b < 0 || seq[b] < 0 || lp_k[b] <= 0) return;
    const int tok = tokens[b];
    float v = logits[(long)r * ld + tok];
    for (int j = 0; j < HIST; ++j)
        if (lp_win[(b * HIST + j) * 2] == tok) { v = __int_as_float(lp_win[(b * HIST + j) * 2 + 1]); break; }
    lp_ring[((long)((step[b] - 1) % ring_len) * n_seq + b) * LP_COLS + 1] = v;
}
