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

// ids[j], w[j] (j < k, by rank) = the k most probable experts of one token (ties: the lower id) and
// their probabilities, softmax over logits[:E] (+ bias[:E], gpt-oss's router bias, where non-null) in
// f32, renormalized over the k where norm: one warp (lane), the logits read through L2 (another block
// of the launch may have written them). An id is always within [0, E), whatever the logits hold.
DEV void topk_warp(const float* logits, const float* __restrict__ bias, int E, int k, int norm,
                   int* __restrict__ ids, float* __restrict__ w, int lane) {
    constexpr int PER = MOE_MAX_EXPERTS / 32;
    float p[PER], mx = -INFINITY;
#pragma unroll
    for (int i = 0; i < PER; ++i) {
        const int e = lane + 32 * i;
        p[i] = e < E ? __ldcg(logits + e) + (bias ? bias[e] : 0.f) : -INFINITY;
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
        // the warp's best: the largest probability (p >= 0 orders as its bits; -1, taken or none, as 0),
        // then the lowest id holding it (two reductions in place of five shuffle steps)
        const u32 key = bv < 0.f ? 0u : __float_as_uint(bv) + 1u;
        const u32 top = __reduce_max_sync(0xffffffffu, key);
        bi = (int)__reduce_min_sync(0xffffffffu, key == top ? (u32)bi : 0xffffffffu);
        bv = top == 0u ? -1.f : __uint_as_float(top - 1u);
        bi = min(max(bi, 0), E - 1);
#pragma unroll
        for (int i = 0; i < PER; ++i)
            if (lane + 32 * i == bi) p[i] = -1.f;
        if (lane == j) { my_id = bi; my_w = bv; }
        chosen += fmaxf(bv, 0.f);
    }
    if (lane < k) {
        ids[lane] = my_id;
        w[lane] = norm ? my_w / chosen : my_w;
    }
}

// ids[t, :k], w[t, :k] = topk_warp of logits[t, :E] (+ bias, or null): one warp a token.
extern "C" __global__ void moe_topk(const float* __restrict__ logits, int ld, const float* __restrict__ bias,
                         int E, int k, int norm, int rows, int* __restrict__ ids, float* __restrict__ w) {
    const int t = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    pdl_enter();
    if (t >= rows) return;
    topk_warp(logits + (long)t * ld, bias, E, k, norm, ids + (long)t * k, w + (long)t * k, lane);
}

// y[s, :n] = W_e x'[s / k] for every slot s < gridDim.y: e = ids[s], or with ids null W itself (the
// router: k = 1, one slot a token). x' = x (RMS-normalized with nw non-null) or the int8 rows
// (XIO bit 0; bit 3 with their rests).
template <class T, int R, int WG, int XIO>
__global__ void __launch_bounds__(32 * MOE_WARPS) moe_mv(PLANES(0), int n, int K, const int* __restrict__ ids,
        int k, const float* __restrict__ x, int ldx, const float* __restrict__ nw, float eps, XQ_ARGS,
        float* __restrict__ y, int ldy) {
    const int s = blockIdx.y, row0 = group_row0<R, WG, MOE_WARPS>();
    // before the ids (the router's kernel writes them); the router itself (ids null) loads its first
    // weights before mmv_any's pdl_enter, as the other matvecs do
    if (ids) pdl_enter();
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

// The router over rows > 8 tokens: y[t, :n] = W x'[t] (W f32, x' = x RMS-normalized with nw
// non-null), MT tokens a block (each weight row read once a tile, not once a token); the last tile
// starts at rows - MT (rows >= MT), so every read is a real row and overlapping rows are written
// twice with the same values.
template <int R, int WG, int MT>
__global__ void __launch_bounds__(32 * MOE_WARPS) moe_router(PLANES(0), int n, int K, int rows,
        const float* __restrict__ x, int ldx, const float* __restrict__ nw, float eps, float* __restrict__ y,
        int ldy) {
    const int t0 = min((int)blockIdx.y * MT, rows - MT), row0 = group_row0<R, WG, MOE_WARPS>();
    Mat m[R]; int row[R];
#pragma unroll
    for (int r = 0; r < R; ++r) { m[r] = MAT(0, TF32); row[r] = min(row0 + r, n - 1); }
    pdl_enter();
    float acc[R][MT];
    mmv_any<TF32, MT, R, WG, 0>(m, row, K, XIn{x + (long)t0 * ldx, ldx, nw, eps, XQ{}}, acc);
    if (!group_leader<WG>()) return;
#pragma unroll
    for (int b = 0; b < MT; ++b)
#pragma unroll
        for (int r = 0; r < R; ++r)
            if (row0 + r < n) y[(long)(t0 + b) * ldy + row0 + r] = acc[r][b];
}

// The router of up to 8 tokens with its top-k in the same launch: y[t, :n] = W x'[t] (W f32, x' as
// moe_router's; blockIdx.y = t), and the block that finishes token t's logits last (counters[t]:
// its blocks done, back to zero after) runs topk_warp over them into ids[t, :k], w[t, :k].
template <int R, int WG>
__global__ void __launch_bounds__(32 * MOE_WARPS) moe_router_topk(PLANES(0), int n, int K,
        const float* __restrict__ x, int ldx, const float* __restrict__ nw, float eps, float* y, int ldy, int k,
        int norm, int* __restrict__ ids, float* __restrict__ w, unsigned* counters) {
    __shared__ bool s_last;
    const int t = blockIdx.y, row0 = group_row0<R, WG, MOE_WARPS>();
    Mat m[R]; int row[R];
#pragma unroll
    for (int r = 0; r < R; ++r) { m[r] = MAT(0, TF32); row[r] = min(row0 + r, n - 1); }
    pdl_enter();
    float acc[R][1];
    mmv_any<TF32, 1, R, WG, 0>(m, row, K, XIn{x + (long)t * ldx, ldx, nw, eps, XQ{}}, acc);
    if (group_leader<WG>()) {
#pragma unroll
        for (int r = 0; r < R; ++r)
            if (row0 + r < n) y[(long)t * ldy + row0 + r] = acc[r][0];
        __threadfence();  // these logits visible to every block before this one counts itself done
    }
    __syncthreads();
    if (threadIdx.x == 0) s_last = atomicAdd(counters + t, 1u) == gridDim.x - 1;
    __syncthreads();
    if (!s_last || threadIdx.x >= 32) return;
    __threadfence();
    topk_warp(y + (long)t * ldy, nullptr, n, k, norm, ids + (long)t * k, w + (long)t * k, threadIdx.x);
    if (threadIdx.x == 0) counters[t] = 0;
}

// y[s, :n] = act(G_e x'[s / k]) * (U_e x'[s / k]), e = ids[s]: the chosen experts' gate and up rows
// in one pass (R / 2 of each a row group); ACT 0 = SiLU, 1 = GELU (tanh), 2 = gpt-oss's clamped
// SwiGLU; bg, bu (or null): the experts' gate and up biases ([experts, n], added before it). x' as
// moe_mv's. XIO bit 1 (R = 8: a block's 16 rows): a q8 epilogue also writes y's int8 copy (down's
// input; bit 4: with the rests) into row s of oq / os. MB: blocks an SM the registers must allow
// (launch bounds; 1: the compiler's choice). Top-k in the block (logits non-null; in place of a
// moe_topk launch before it): warp 0 runs topk_warp over token s / k's logits[:E] (+ rbias, or null;
// renormalized where norm) and the block takes its rank's expert; the blocks of blockIdx.x 0 and
// rank 0 write the token's ids and w for the down.
template <class T, int R, int WG, int ACT, int XIO, int MB = 1>
__global__ void __launch_bounds__(32 * MOE_WARPS, MB) moe_glu(PLANES(0), PLANES(1), int n, int K,
        int* ids, int k, const float* __restrict__ x, int ldx, const float* __restrict__ nw,
        float eps, XQ_ARGS, float* __restrict__ y, int ldy, u8* oq, int ldoq, float4* os, int ldos, int ores,
        const float* __restrict__ bg, const float* __restrict__ bu, const float* logits, int ldl, int E,
        const float* __restrict__ rbias, int norm, float* w) {
    constexpr int H = R / 2;
    constexpr bool QO = (XIO & 2) != 0;
    static_assert(!QO || H * MOE_WARPS / WG == 16, "a q8 epilogue takes 16 rows a block");
    const int s = blockIdx.y, row0 = group_row0<H, WG, MOE_WARPS>();
    pdl_enter();
    int e;
    if (logits) {
        __shared__ int s_ids[32];
        __shared__ float s_w[32];
        const int t = s / k, j = s - t * k;
        if (threadIdx.x < 32) topk_warp(logits + (long)t * ldl, rbias, E, k, norm, s_ids, s_w, threadIdx.x);
        __syncthreads();
        e = s_ids[j];
        if (blockIdx.x == 0 && j == 0 && threadIdx.x < k) {
            ids[s + threadIdx.x] = s_ids[threadIdx.x];
            w[s + threadIdx.x] = s_w[threadIdx.x];
        }
    } else {
        e = ids[s];
    }
    Mat m[R]; int row[R];
#pragma unroll
    for (int r = 0; r < H; ++r) {
        m[r] = MAT(0, T); m[H + r] = MAT(1, T);
        row[r] = row[H + r] = e * n + min(row0 + r, n - 1);
    }
    float acc[R][1];
    mmv_any<T, 1, R, WG, XIO & 9>(m, row, K, XIN(s / k, nw, eps), acc);
    __shared__ float tile[1][16];
    if (group_leader<WG>())
#pragma unroll
        for (int r = 0; r < H; ++r) {
            if (row0 + r >= n) break;
            float g = acc[r][0], u = acc[H + r][0];
            if (bg) { g += bg[(long)e * n + row0 + r]; u += bu[(long)e * n + row0 + r]; }
            const float v = ACT == 2 ? swiglu_oai_f(g, u) : (ACT == 0 ? silu_f(g) : gelu_tanh_f(g)) * u;
            y[(long)s * ldy + row0 + r] = v;
            if constexpr (QO) tile[0][row0 % 16 + r] = v;
        }
    if constexpr (QO)
        store_q8_piece<1, (XIO & 16) != 0>(tile, blockIdx.x * 16,
                                           QOut{oq + (long)s * ldoq, ldoq, os + (long)s * ldos, ldos, ores, nullptr}, 1.f);
}

// y[t, :n] += sum over j < k of w[t k + j] * (W_e x'[t k + j] + b_e), e = ids[t k + j]: the chosen
// experts' down products (b: their biases, [experts, n], or null), weighted and summed, added to the
// residual. A block owns R rows of one token (blockIdx.y); its KW warps take the ranks j = warp,
// warp + KW, ... at once (one rank's products after another in one warp left the loads of the k
// experts in series), then the warps' sums are added in warp order (the same result on every run).
// MB as moe_glu's. SUB < 32 (int8 inputs, rows of at most SUB units): each warp's lanes are 32 / SUB
// sets of SUB lanes, set h on rows h R to h R + R - 1 of the block's 32 / SUB x R (mmv_block_q8's
// sub-warp sets): fewer idle lanes and blocks.
// RG > 1: RG such row groups a block, each of KW warps (group g on the block's rows from g R 32 /
// SUB), so that a block owns more rows at the same registers a warp (more rows a warp spilled over
// into 254 registers and lost: bench/RESULTS.md 271). XIO bit 1 (a block's RG R 32 / SUB rows
// are 16): a q8 epilogue also writes the int8 copy of y's new rows times qw (the next RMSNorm's
// weight, with their squares: the next layer's matvecs normalize, as after a dense model's residual
// matvec; bit 4: with the rests) into row t of oq / os.
template <class T, int R, int KW, int XIO, int MB = 1, int SUB = 32, int RG = 1>
__global__ void __launch_bounds__(32 * KW * RG, MB) moe_down(PLANES(0), int n, int K, const int* __restrict__ ids,
        const float* __restrict__ w, int k, const float* __restrict__ x, int ldx, XQ_ARGS, float* __restrict__ y,
        int ldy, const float* __restrict__ b, u8* oq, int ldoq, float4* os, int ldos, int ores,
        const float* __restrict__ qw) {
    constexpr int HS = 32 / SUB;  // row sets a warp
    constexpr bool QO = (XIO & 2) != 0;
    static_assert(SUB == 32 || (XIO & 1) != 0, "sub-warp row sets: int8 inputs");
    constexpr int BR = RG * R * HS;  // a block's rows
    static_assert(!QO || BR == 16, "a q8 epilogue takes 16 rows a block");
    const int t = blockIdx.y, warp = (threadIdx.x >> 5) % KW, grp = (threadIdx.x >> 5) / KW;
    const int set = (threadIdx.x & 31) / SUB;
    const int base = blockIdx.x * BR, row0 = base + (grp * HS + set) * R;
    const QOut qo{oq + (long)t * ldoq, ldoq, os + (long)t * ldos, ldos, ores, qw};
    float wq = 1.f;
    if (QO && threadIdx.x < 16) wq = q8_out_weight(qo, base);  // weights only: before pdl_enter
    pdl_enter();
    float tot[R];
#pragma unroll
    for (int r = 0; r < R; ++r) tot[r] = 0.f;
    for (int j = warp; j < k; j += KW) {
        const int s = t * k + j, e = ids[s];
        const float we = w[s];
        Mat m[R]; int row[R];
#pragma unroll
        for (int r = 0; r < R; ++r) { m[r] = MAT(0, T); row[r] = e * n + min(row0 + r, n - 1); }
        float acc[R][1];
        if constexpr (SUB < 32)
            mmv_block_q8<T, 1, R, 1, (XIO & 8) != 0, NoStage, SUB>(m, row, K, XIN(s, nullptr, 0.f).q, acc);
        else
            mmv_any<T, 1, R, 1, XIO>(m, row, K, XIN(s, nullptr, 0.f), acc);
#pragma unroll
        for (int r = 0; r < R; ++r)
            tot[r] = fmaf(we, b ? acc[r][0] + b[(long)e * n + min(row0 + r, n - 1)] : acc[r][0], tot[r]);
    }
    __shared__ float part[KW][BR];
    if ((threadIdx.x & (SUB - 1)) == 0)  // each set's first lane
#pragma unroll
        for (int r = 0; r < R; ++r) part[warp][(grp * HS + set) * R + r] = tot[r];
    __syncthreads();
    __shared__ float tile[1][16];
    if (threadIdx.x < BR && base + (int)threadIdx.x < n) {
        float v = 0.f;
#pragma unroll
        for (int i = 0; i < KW; ++i) v += part[i][threadIdx.x];
        const float nx = y[(long)t * ldy + base + threadIdx.x] + v;
        y[(long)t * ldy + base + threadIdx.x] = nx;
        if constexpr (QO) tile[0][threadIdx.x] = nx;
    }
    if constexpr (QO) store_q8_piece<1, (XIO & 16) != 0>(tile, base, qo, wq);
}

// ---- grouped by expert (batches and prompts: moe_mma.cu's products) ----
// moe_sort (one block) lists the slots by expert: order[off[e] + i] = the i-th slot naming e (the
// position within an expert is an atomic's, so it varies between runs; each slot's result does
// not depend on it) and tiles[] = {expert, first index into order, slots (<= mt)}, the unused
// tail of the max_tiles entries {0, 0, 0}. pos: scratch of one int a slot.
extern "C" __global__ void __launch_bounds__(1024) moe_sort(const int* __restrict__ ids, int slots, int E, int mt,
        int max_tiles, int* __restrict__ pos, int* __restrict__ order, int4* __restrict__ tiles) {
    __shared__ int cnt[MOE_MAX_EXPERTS], off[MOE_MAX_EXPERTS], toff[MOE_MAX_EXPERTS + 1];
    pdl_enter();
    for (int e = threadIdx.x; e < E; e += blockDim.x) cnt[e] = 0;
    __syncthreads();
    for (int s = threadIdx.x; s < slots; s += blockDim.x) pos[s] = atomicAdd(&cnt[ids[s]], 1);
    __syncthreads();
    if (threadIdx.x == 0) {
        int o = 0, to = 0;
        for (int e = 0; e < E; ++e) {
            off[e] = o; toff[e] = to;
            o += cnt[e]; to += (cnt[e] + mt - 1) / mt;
        }
        toff[E] = to;
    }
    __syncthreads();
    for (int s = threadIdx.x; s < slots; s += blockDim.x) order[off[ids[s]] + pos[s]] = s;
    for (int e = threadIdx.x; e < E; e += blockDim.x)
        for (int i = 0; i * mt < cnt[e]; ++i) tiles[toff[e] + i] = make_int4(e, off[e] + i * mt, min(mt, cnt[e] - i * mt), 0);
    for (int i = toff[E] + threadIdx.x; i < max_tiles; i += blockDim.x) tiles[i] = make_int4(0, 0, 0, 0);
}

// x[t, :n] += sum over j < k (in rank order) of w[t k + j] ys[t k + j, :n] (a block a token's
// blockDim.x columns).
extern "C" __global__ void moe_combine(const float* __restrict__ ys, int ldys, const float* __restrict__ w, int k,
                                       float* __restrict__ x, int ldx, int n, int rows) {
    pdl_enter();
    const int t = blockIdx.y, c = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= rows || c >= n) return;
    float v = 0.f;
    for (int j = 0; j < k; ++j) v = fmaf(w[(long)t * k + j], ys[((long)t * k + j) * ldys + c], v);
    x[(long)t * ldx + c] += v;
}

// y[s, :n] += b[ids[s], :n]: each slot's product plus its expert's bias row (gpt-oss; b: [experts, n])
extern "C" __global__ void moe_add_bias(float* y, int ldy, const float* __restrict__ b, const int* __restrict__ ids,
                                        int n, int slots) {
    pdl_enter();
    const int s = blockIdx.y, c = blockIdx.x * blockDim.x + threadIdx.x;
    if (s >= slots || c >= n) return;
    y[(long)s * ldy + c] += b[(long)ids[s] * n + c];
}

#ifdef GGUF_INSTANTIATE_ALL  // nvcc syntax check in CI: each kernel per type
#define XQ_TYPES const u8*, int, const float4*, int, int, int, float
#define P4 const u8*, const u8*, const u8*, const u8*
#define QO_TYPES u8*, int, float4*, int, int
#define TOPK_TYPES const float*, int, int, const float*, int, float*
#define DOWN_ARGS P4, int, int, const int*, const float*, int, const float*, int, XQ_TYPES, float*, int, \
                  const float*, QO_TYPES, const float*
#define MOE(T, IO)                                                                                              \
    template __global__ void moe_mv<T, 1, 4, IO>(P4, int, int, const int*, int, const float*, int, const float*, \
                                                 float, XQ_TYPES, float*, int);                                 \
    template __global__ void moe_glu<T, 4, 1, 0, IO>(P4, P4, int, int, int*, int, const float*, int,            \
                                                     const float*, float, XQ_TYPES, float*, int, QO_TYPES,      \
                                                     const float*, const float*, TOPK_TYPES);                   \
    template __global__ void moe_down<T, 2, 8, IO>(DOWN_ARGS);
MOE(TF32, 0) MOE(TF16, 0) MOE(TBF16, 0)
MOE(TQ4_0, 0) MOE(TQ4_1, 0) MOE(TQ5_0, 0) MOE(TQ5_1, 0) MOE(TQ8_0, 0)
MOE(TQ2_K, 0) MOE(TQ3_K, 0) MOE(TQ4_K, 0) MOE(TQ5_K, 0) MOE(TQ6_K, 0)
MOE(TQ4_0, 1) MOE(TQ4_1, 1) MOE(TQ5_0, 1) MOE(TQ5_1, 1) MOE(TQ8_0, 1)
MOE(TQ2_K, 1) MOE(TQ3_K, 1) MOE(TQ4_K, 1) MOE(TQ5_K, 1) MOE(TQ6_K, 1) MOE(TQ4_K, 9)
MOE(TMXFP4, 0) MOE(TIQ4_NL, 0) MOE(TIQ4_XS, 0) MOE(TMXFP4, 1) MOE(TIQ4_NL, 1) MOE(TIQ4_XS, 1)
MOE(TIQ2_XXS, 0) MOE(TIQ2_XS, 0) MOE(TIQ2_S, 0) MOE(TIQ3_XXS, 0)
MOE(TIQ3_S, 0) MOE(TIQ1_S, 0) MOE(TIQ1_M, 0)
MOE(TIQ2_XXS, 1) MOE(TIQ2_XS, 1) MOE(TIQ2_S, 1) MOE(TIQ3_XXS, 1)
MOE(TIQ3_S, 1) MOE(TIQ1_S, 1) MOE(TIQ1_M, 1)
#define GLU_Q8(T, IO) \
    template __global__ void moe_glu<T, 8, 1, 0, IO>(P4, P4, int, int, int*, int, const float*, int,       \
                                                     const float*, float, XQ_TYPES, float*, int, QO_TYPES, \
                                                     const float*, const float*, TOPK_TYPES);              \
    template __global__ void moe_glu<T, 8, 1, 2, IO>(P4, P4, int, int, int*, int, const float*, int,       \
                                                     const float*, float, XQ_TYPES, float*, int, QO_TYPES, \
                                                     const float*, const float*, TOPK_TYPES);
GLU_Q8(TMXFP4, 3) GLU_Q8(TQ4_K, 3) GLU_Q8(TQ6_K, 3) GLU_Q8(TQ4_0, 3) GLU_Q8(TQ8_0, 3) GLU_Q8(TQ4_K, 27)
#define DOWN_SUB(T, IO) template __global__ void moe_down<T, 4, 8, IO, 2, 16>(DOWN_ARGS);
DOWN_SUB(TQ6_K, 1) DOWN_SUB(TQ6_K, 9) DOWN_SUB(TQ4_K, 1) DOWN_SUB(TMXFP4, 1)
#define DOWN_QO(T, IO) template __global__ void moe_down<T, 4, 8, IO, 1, 16, 2>(DOWN_ARGS);
DOWN_QO(TQ6_K, 3) DOWN_QO(TQ4_K, 3) DOWN_QO(TQ6_K, 19)
template __global__ void moe_router<1, 4, 8>(P4, int, int, int, const float*, int, const float*, float, float*, int);
template __global__ void moe_router_topk<1, 4>(P4, int, int, const float*, int, const float*, float, float*, int, int,
                                               int, int*, float*, unsigned*);
template __global__ void moe_router<2, 1, 8>(P4, int, int, int, const float*, int, const float*, float, float*, int);
#endif
