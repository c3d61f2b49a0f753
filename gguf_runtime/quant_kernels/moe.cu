// Mixture-of-experts FFN (qwen3moe, as llama.cpp's build_moe_ffn): the router's top-k on the device
// and the products of the chosen experts, with the expert ids read from a device buffer, so one
// captured graph serves every token.
//
// A stacked expert tensor [n_expert, n, K] is repacked as one matrix of n_expert * n rows (repack.py
// keeps rows independent), so expert e's row r is row e * n + r: the products are matvec_block.cuh's
// row-group loops with the row index offset. Each token-and-rank pair ("slot" s = t * k + j) is one
// blockIdx.y: one token's matvec over its expert's rows (B = 1).
#include "matvec_block.cuh"

#define PLANES(i) const u8* qs##i, const u8* qh##i, const u8* sc##i, const u8* d##i
#define MAT(i, T) Mat{qs##i, qh##i, sc##i, d##i, K / T::BLOCK}
#define XQ_ARGS const u8* xq, int ldq, const float4* xs, int lds, int xres, int xnorm, float xeps
#define XIN(row, nw, eps) \
    XIn{x + (long)(row) * ldx, ldx, nw, eps, XQ{xq + (long)(row) * ldq, ldq, xs + (long)(row) * lds, lds, xres, xnorm, xeps}}

constexpr int MOE_MAX_EXPERTS = 256;  // 8 router probabilities a lane
constexpr int MOE_WARPS = 4;          // warps a block of the product kernels

// ids[t, j], w[t, j] (j < k, by rank) = the k most probable experts of token t (ties: the lower id)
// and their probabilities, softmax over logits[t, :E] in f32, renormalized over the k where norm.
// One warp a token; an id is always within [0, E), whatever the logits hold.
extern "C" __global__ void moe_topk(const float* __restrict__ logits, int ld, int E, int k, int norm, int rows,
                         int* __restrict__ ids, float* __restrict__ w) {
    constexpr int PER = MOE_MAX_EXPERTS / 32;
    const int t = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    pdl_enter();
    if (t >= rows) return;
    float p[PER], mx = -INFINITY;
#pragma unroll
    for (int i = 0; i < PER; ++i) {
        const int e = lane + 32 * i;
        p[i] = e < E ? logits[(long)t * ld + e] : -INFINITY;
        mx = fmaxf(mx, p[i]);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    float sum = 0.f;
#pragma unroll
    for (int i = 0; i < PER; ++i) {
        p[i] = lane + 32 * i < E ? expf(p[i] - mx) : 0.f;
        sum += p[i];
    }
    sum = warp_sum(sum);
#pragma unroll
    for (int i = 0; i < PER; ++i) p[i] = lane + 32 * i < E ? p[i] / sum : -1.f;  // -1: not an expert / taken
    int my_id = 0;
    float my_w = 0.f, chosen = 0.f;
    for (int j = 0; j < k; ++j) {
        float bv = -1.f;
        int bi = 0;
#pragma unroll
        for (int i = 0; i < PER; ++i)
            if (p[i] > bv) { bv = p[i]; bi = lane + 32 * i; }  // ascending ids: the first wins ties
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
            const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (ov > bv || (ov == bv && oi < bi)) { bv = ov; bi = oi; }
        }
        bi = min(max(bi, 0), E - 1);
#pragma unroll
        for (int i = 0; i < PER; ++i)
            if (lane + 32 * i == bi) p[i] = -1.f;
        if (lane == j) { my_id = bi; my_w = bv; }
        chosen += fmaxf(bv, 0.f);
    }
    if (lane < k) {
        ids[(long)t * k + lane] = my_id;
        w[(long)t * k + lane] = norm ? my_w / chosen : my_w;
    }
}

// y[s, :n] = W_e x'[s / k] for every slot s < gridDim.y: e = ids[s], or with ids null W itself (the
// router: k = 1, one slot a token). x' = x (RMS-normalized with nw non-null) or the int8 rows
// (XIO bit 0; bit 3 with their rests).
template <class T, int R, int WG, int XIO>
__global__ void __launch_bounds__(32 * MOE_WARPS) moe_mv(PLANES(0), int n, int K, const int* __restrict__ ids,
        int k, const float* __restrict__ x, int ldx, const float* __restrict__ nw, float eps, XQ_ARGS,
        float* __restrict__ y, int ldy) {
    const int s = blockIdx.y, row0 = group_row0<R, WG, MOE_WARPS>();
    pdl_enter();  // before the ids: the router's kernel writes them
    const int e = ids ? ids[s] : 0;
    Mat m[R]; int row[R];
#pragma unroll
    for (int r = 0; r < R; ++r) { m[r] = MAT(0, T); row[r] = e * n + min(row0 + r, n - 1); }
    float acc[R][1];
    mmv_any<T, 1, R, WG, XIO>(m, row, K, XIN(s / k, nw, eps), acc);
    if (!group_leader<WG>()) return;
#pragma unroll
    for (int r = 0; r < R; ++r)
        if (row0 + r < n) y[(long)s * ldy + row0 + r] = acc[r][0];
}

// y[s, :n] = act(G_e x'[s / k]) * (U_e x'[s / k]), e = ids[s]: the chosen experts' gate and up rows
// in one pass (R / 2 of each a row group); ACT 0 = SiLU, 1 = GELU (tanh). x' as moe_mv's.
template <class T, int R, int WG, int ACT, int XIO>
__global__ void __launch_bounds__(32 * MOE_WARPS) moe_glu(PLANES(0), PLANES(1), int n, int K,
        const int* __restrict__ ids, int k, const float* __restrict__ x, int ldx, const float* __restrict__ nw,
        float eps, XQ_ARGS, float* __restrict__ y, int ldy) {
    constexpr int H = R / 2;
    const int s = blockIdx.y, row0 = group_row0<H, WG, MOE_WARPS>();
    pdl_enter();
    const int e = ids[s];
    Mat m[R]; int row[R];
#pragma unroll
    for (int r = 0; r < H; ++r) {
        m[r] = MAT(0, T); m[H + r] = MAT(1, T);
        row[r] = row[H + r] = e * n + min(row0 + r, n - 1);
    }
    float acc[R][1];
    mmv_any<T, 1, R, WG, XIO>(m, row, K, XIN(s / k, nw, eps), acc);
    if (!group_leader<WG>()) return;
#pragma unroll
    for (int r = 0; r < H; ++r) {
        if (row0 + r >= n) break;
        const float g = acc[r][0];
        y[(long)s * ldy + row0 + r] = (ACT == 0 ? silu_f(g) : gelu_tanh_f(g)) * acc[H + r][0];
    }
}

// y[t, :n] += sum over j < k of w[t k + j] * W_e x'[t k + j], e = ids[t k + j]: the chosen experts'
// down products, weighted and summed in rank order, added to the residual (one token a blockIdx.y).
// One warp a row group (WG = 1): group_reduce's shared memory is not reused across the k products.
template <class T, int R, int WG, int XIO>
__global__ void __launch_bounds__(32 * MOE_WARPS) moe_down(PLANES(0), int n, int K, const int* __restrict__ ids,
        const float* __restrict__ w, int k, const float* __restrict__ x, int ldx, XQ_ARGS, float* __restrict__ y,
        int ldy) {
    static_assert(WG == 1, "moe_down: one warp a row group");
    const int t = blockIdx.y, row0 = group_row0<R, WG, MOE_WARPS>();
    pdl_enter();
    float tot[R];
#pragma unroll
    for (int r = 0; r < R; ++r) tot[r] = 0.f;
    for (int j = 0; j < k; ++j) {
        const int s = t * k + j, e = ids[s];
        const float we = w[s];
        Mat m[R]; int row[R];
#pragma unroll
        for (int r = 0; r < R; ++r) { m[r] = MAT(0, T); row[r] = e * n + min(row0 + r, n - 1); }
        float acc[R][1];
        mmv_any<T, 1, R, WG, XIO>(m, row, K, XIN(s, nullptr, 0.f), acc);
#pragma unroll
        for (int r = 0; r < R; ++r) tot[r] = fmaf(we, acc[r][0], tot[r]);
    }
    if (!group_leader<WG>()) return;
#pragma unroll
    for (int r = 0; r < R; ++r)
        if (row0 + r < n) y[(long)t * ldy + row0 + r] += tot[r];
}

#ifdef GGUF_INSTANTIATE_ALL  // nvcc syntax check in CI: each kernel per type
#define XQ_TYPES const u8*, int, const float4*, int, int, int, float
#define P4 const u8*, const u8*, const u8*, const u8*
#define MOE(T, IO)                                                                                              \
    template __global__ void moe_mv<T, 2, 1, IO>(P4, int, int, const int*, int, const float*, int, const float*, \
                                                 float, XQ_TYPES, float*, int);                                 \
    template __global__ void moe_glu<T, 4, 1, 0, IO>(P4, P4, int, int, const int*, int, const float*, int,      \
                                                     const float*, float, XQ_TYPES, float*, int);               \
    template __global__ void moe_down<T, 2, 1, IO>(P4, int, int, const int*, const float*, int, const float*,   \
                                                   int, XQ_TYPES, float*, int);
MOE(TF32, 0) MOE(TF16, 0) MOE(TBF16, 0)
MOE(TQ4_0, 0) MOE(TQ4_1, 0) MOE(TQ5_0, 0) MOE(TQ5_1, 0) MOE(TQ8_0, 0)
MOE(TQ2_K, 0) MOE(TQ3_K, 0) MOE(TQ4_K, 0) MOE(TQ5_K, 0) MOE(TQ6_K, 0)
MOE(TQ4_0, 1) MOE(TQ4_1, 1) MOE(TQ5_0, 1) MOE(TQ5_1, 1) MOE(TQ8_0, 1)
MOE(TQ2_K, 1) MOE(TQ3_K, 1) MOE(TQ4_K, 1) MOE(TQ5_K, 1) MOE(TQ6_K, 1) MOE(TQ4_K, 9)
#endif
