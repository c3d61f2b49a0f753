// Dequantizing matrix products on the tensor cores, for batches of 16..64 tokens:
// y[t, n] (=|+=) sum_k W[n, k] x[t, k], W repacked quant planes, x f16 (written in f16 by the
// kernel before: norm, attention, GLU), y f32.
//
// A block (4 warps, WR x WC) owns 16 WR weight rows and 8 NT WC tokens. Per 128-wide k step it
// dequantizes its W tile into shared memory as f16 (the per-type decoders of quant_types.cuh),
// copies the x tile with 16-byte loads, and runs mma.sync.m16n8k16 (f16 x f16 -> f32): warp
// (wr, wc) computes rows 16 wr .. +15 against tokens 8 NT wc .. +8 NT - 1. Raw kernels rather
// than cuBLAS, so the batch decode step can be captured in a CUDA graph.
#include "quant_types.cuh"

#define TK 128
#define LDS (TK + 8)  // padded row (halves): conflict-free fragment loads

DEV void mma16816(float (&c)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Dequantize rows [row0, row0 + TM) x columns [k0, k0 + TK) of m into Ws (f16, [TM][LDS]); columns
// past K (a partial last tile: K is whole units, not always whole tiles) are zero.
template <class T, int TM>
DEV void load_w_tile(const Mat& m, int n_rows, int row0, int k0, int K, u16* Ws) {
    const int width = min(TK, K - k0), upr = width / T::UE;  // units per tile row
    if (width < TK)
        for (int idx = threadIdx.x; idx < TM * (TK - width) / 2; idx += blockDim.x) {
            const int r = idx / ((TK - width) / 2), c = width + 2 * (idx % ((TK - width) / 2));
            *reinterpret_cast<u32*>(Ws + r * LDS + c) = 0u;
        }
    for (int idx = threadIdx.x; idx < TM * upr; idx += blockDim.x) {
        const int r = idx / upr, u = k0 / T::UE + idx % upr;
        const int row = min(row0 + r, n_rows - 1);
        typename T::Raw raw;
        T::load(m, row, u, raw);
#pragma unroll
        for (int p = 0; p < T::NP; ++p) {
            float w[16];
            piece<T>(raw, p, w);
            store16_f16(Ws + r * LDS + T::xoff(u, p) - k0, w);
        }
    }
}

// Tokens [t0, t0 + TB) x columns [k0, k0 + TK) of the f16 x into Xs ([TB][LDS]); 0 past n_tok and K.
template <int TB>
DEV void load_x_tile(const u16* __restrict__ x, int ldx, int n_tok, int t0, int k0, int K, u16* Xs) {
    for (int idx = threadIdx.x; idx < TB * (TK / 8); idx += blockDim.x) {
        const int b = idx / (TK / 8), c = (idx % (TK / 8)) * 8;
        uint4 v = make_uint4(0u, 0u, 0u, 0u);
        if (t0 + b < n_tok && k0 + c < K) v = *reinterpret_cast<const uint4*>(x + (long)(t0 + b) * ldx + k0 + c);
        *reinterpret_cast<uint4*>(Xs + b * LDS + c) = v;
    }
}

template <int WR, int NT>
DEV void mma_step(const u16* Ws, const u16* Xs, float (&acc)[NT][4]) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, tig = lane & 3, wr = warp % WR, wc = warp / WR;
    const u16* a = Ws + (16 * wr + g) * LDS + 2 * tig;
#pragma unroll
    for (int kk = 0; kk < TK; kk += 16) {
        const u32 a0 = *reinterpret_cast<const u32*>(a + kk);
        const u32 a1 = *reinterpret_cast<const u32*>(a + 8 * LDS + kk);
        const u32 a2 = *reinterpret_cast<const u32*>(a + kk + 8);
        const u32 a3 = *reinterpret_cast<const u32*>(a + 8 * LDS + kk + 8);
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            const u16* bp = Xs + (wc * 8 * NT + nt * 8 + g) * LDS + 2 * tig + kk;
            mma16816(acc[nt], a0, a1, a2, a3, *reinterpret_cast<const u32*>(bp),
                     *reinterpret_cast<const u32*>(bp + 8));
        }
    }
}

// One (16 WR rows) x (8 NT (4 / WR) tokens) tile over all of K, left in acc (mma16816's C layout).
template <class T, int WR, int NT>
DEV void mma_tile(const Mat& m, int n_rows, int row0, const u16* x, int ldx, int n_tok, int t0, int K,
                  u16* Ws, u16* Xs, float (&acc)[NT][4]) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;
    for (int k0 = 0; k0 < K; k0 += TK) {
        __syncthreads();
        load_w_tile<T, 16 * WR>(m, n_rows, row0, k0, K, Ws);
        load_x_tile<8 * NT * (4 / WR)>(x, ldx, n_tok, t0, k0, K, Xs);
        __syncthreads();
        mma_step<WR, NT>(Ws, Xs, acc);
    }
}

// Visit the C elements a thread owns: f(row, token, value).
template <int WR, int NT, class F>
DEV void for_each_c(const float (&acc)[NT][4], int row0, int t0, F f) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, tig = lane & 3, wr = warp % WR, wc = warp / WR;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
        const int t = t0 + wc * 8 * NT + nt * 8 + 2 * tig;
        const int r = row0 + 16 * wr + g;
        f(r, t, acc[nt][0]); f(r, t + 1, acc[nt][1]); f(r + 8, t, acc[nt][2]); f(r + 8, t + 1, acc[nt][3]);
    }
}

#define PLANES(i) const u8* qs##i, const u8* qh##i, const u8* sc##i, const u8* d##i
#define MAT(i, T) Mat{qs##i, qh##i, sc##i, d##i, K / T::BLOCK}

template <class T, int WR, int NT, int MODE>
DEV void mma_segment(const Mat& m, int n, int row0, const u16* x, int ldx, int n_tok, int K, float* y, int ldy,
                     const float* bias, u16* Ws, u16* Xs) {
    const int t0 = blockIdx.y * 8 * NT * (4 / WR);
    float acc[NT][4];
    mma_tile<T, WR, NT>(m, n, row0, x, ldx, n_tok, t0, K, Ws, Xs, acc);
    for_each_c<WR, NT>(acc, row0, t0, [&](int r, int t, float v) {
        if (r >= n || t >= n_tok) return;
        float* out = y + (long)t * ldy + r;
        if (MODE == 1) *out += v;
        else *out = v + (bias ? bias[r] : 0.f);
    });
}

// Up to three matrices sharing x (Q, K, V), each of its own type; row tiles of segment 0, 1, 2.
// grid = (row tiles of all segments, token tiles). MODE 0: y = W x (+ bias); 1: y += W x.
template <class T0, class T1, class T2, int WR, int NT, int MODE>
__global__ void __launch_bounds__(128) mma_group(
        PLANES(0), int n0, float* y0, int ldy0, const float* bias0,
        PLANES(1), int n1, float* y1, int ldy1, const float* bias1,
        PLANES(2), int n2, float* y2, int ldy2, const float* bias2,
        const u16* __restrict__ x, int ldx, int n_tok, int K) {
    constexpr int TM = 16 * WR;
    __shared__ __align__(16) u16 Ws[TM * LDS];  // here, not in mma_segment: one copy for all three types
    __shared__ __align__(16) u16 Xs[8 * NT * (4 / WR) * LDS];
    int tile = blockIdx.x;
    const int t0n = (n0 + TM - 1) / TM, t1n = (n1 + TM - 1) / TM;
    if (tile < t0n) {
        mma_segment<T0, WR, NT, MODE>(MAT(0, T0), n0, tile * TM, x, ldx, n_tok, K, y0, ldy0, bias0, Ws, Xs);
        return;
    }
    tile -= t0n;
    if (tile < t1n) {
        mma_segment<T1, WR, NT, MODE>(MAT(1, T1), n1, tile * TM, x, ldx, n_tok, K, y1, ldy1, bias1, Ws, Xs);
        return;
    }
    tile -= t1n;
    mma_segment<T2, WR, NT, MODE>(MAT(2, T2), n2, tile * TM, x, ldx, n_tok, K, y2, ldy2, bias2, Ws, Xs);
}

// y16 = f16(act(G x) * (U x)); ACT 0 = SiLU, 1 = GELU (tanh). The output feeds the down projection.
template <class T, int WR, int NT, int ACT>
__global__ void __launch_bounds__(128) mma_glu(PLANES(0), PLANES(1), int n, const u16* __restrict__ x, int ldx,
                                               int n_tok, int K, u16* y, int ldy) {
    __shared__ __align__(16) u16 Ws[16 * WR * LDS];
    __shared__ __align__(16) u16 Xs[8 * NT * (4 / WR) * LDS];
    const int row0 = blockIdx.x * 16 * WR, t0 = blockIdx.y * 8 * NT * (4 / WR);
    float g[NT][4], u[NT][4];
    mma_tile<T, WR, NT>(MAT(0, T), n, row0, x, ldx, n_tok, t0, K, Ws, Xs, g);
    mma_tile<T, WR, NT>(MAT(1, T), n, row0, x, ldx, n_tok, t0, K, Ws, Xs, u);
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) g[nt][i] = (ACT == 0 ? silu_f(g[nt][i]) : gelu_tanh_f(g[nt][i])) * u[nt][i];
    for_each_c<WR, NT>(g, row0, t0, [&](int r, int t, float v) {
        if (r < n && t < n_tok) y[(long)t * ldy + r] = f2h(v);
    });
}

#ifdef GGUF_INSTANTIATE_ALL
#define GROUP_ARGS PLANES(0), int, float*, int, const float*, PLANES(1), int, float*, int, const float*, \
    PLANES(2), int, float*, int, const float*, const u16*, int, int, int
template __global__ void mma_group<TQ5_0, TQ5_0, TQ8_0, 4, 8, 0>(GROUP_ARGS);
#define INST(T)                                                                                  \
    template __global__ void mma_group<T, T, T, 4, 8, 0>(GROUP_ARGS);                            \
    template __global__ void mma_group<T, T, T, 1, 2, 1>(GROUP_ARGS);                            \
    template __global__ void mma_group<T, T, T, 2, 1, 1>(GROUP_ARGS);                            \
    template __global__ void mma_glu<T, 2, 4, 0>(PLANES(0), PLANES(1), int, const u16*, int, int, int, u16*, int);
INST(TF32) INST(TF16) INST(TBF16) INST(TQ4_0) INST(TQ4_1) INST(TQ5_0) INST(TQ5_1) INST(TQ8_0)
INST(TQ2_K) INST(TQ3_K) INST(TQ4_K) INST(TQ5_K) INST(TQ6_K)
#endif
