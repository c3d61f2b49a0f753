// Dequantizing matrix products on the tensor cores, for batches of 16..64 tokens:
// y[t, n] (=|+=) sum_k W[n, k] x[t, k] (mma_tiles.cuh says how a block computes its tile).
#include "mma_tiles.cuh"

// H stacked row tiles of 16 WR rows (H = 2: 32 WR rows per block, x read half as often).
template <class T, int WR, int NT, int MODE, int H, int RA, int ST>
DEV void mma_segment(const Mat& m, int n, int row0, const u16* x, int ldx, int n_tok, int K, float* y, int ldy,
                     const float* bias, u16* smem, float* part, unsigned* counter) {
    const int t0 = blockIdx.y * 8 * NT * (4 / WR);
    int kb, ke;
    k_range(K, kb, ke);
    float acc[H][NT][4];
    Mat ms[H];
#pragma unroll
    for (int j = 0; j < H; ++j) ms[j] = m;
    mma_tiles_any<T, WR, NT, H, RA, ST>(ms, n, row0, 16 * WR, x, ldx, n_tok, t0, kb, ke, K, smem, acc);
    if (gridDim.z > 1 && !merge_splits<H, NT>(acc, part, counter)) return;
#pragma unroll
    for (int j = 0; j < H; ++j)
        for_each_c<WR, NT>(acc[j], row0 + j * 16 * WR, t0, [&](int r, int t, float v) {
            if (r >= n || t >= n_tok) return;
            float* out = y + (long)t * ldy + r;
            if (MODE == 1) *out += v;
            else *out = v + (bias ? bias[r] : 0.f);
        });
}

// Up to three matrices sharing x (Q, K, V), each of its own type; row tiles (16 WR H rows) of
// segment 0, 1, 2.
// grid = (row tiles of all segments, token tiles, K splits). MODE 0: y = W x (+ bias); 1: y += W x.
// Splits need part (S x 128 x 4 NT floats per tile) and counter (a zero per tile).
// MB > 0: at least MB blocks an SM (registers capped to fit; KernelKnobs.mma_min_blocks, measuring).
template <class T0, class T1, class T2, int WR, int NT, int MODE, int H, int RA, int ST, int MB = 0>
__global__ void __launch_bounds__(NTHR, MB) mma_group(
        PLANES(0), int n0, float* y0, int ldy0, const float* bias0,
        PLANES(1), int n1, float* y1, int ldy1, const float* bias1,
        PLANES(2), int n2, float* y2, int ldy2, const float* bias2,
        const u16* __restrict__ x, int ldx, int n_tok, int K, float* part, unsigned* counter) {
    constexpr int TM = 16 * WR * H;
    extern __shared__ __align__(16) u16 smem[];
    int tile = blockIdx.x;
    const int t0n = (n0 + TM - 1) / TM, t1n = (n1 + TM - 1) / TM;
    if (tile < t0n) {
        mma_segment<T0, WR, NT, MODE, H, RA, ST>(MAT(0, T0), n0, tile * TM, x, ldx, n_tok, K, y0, ldy0, bias0, smem,
                                              part, counter);
        return;
    }
    tile -= t0n;
    if (tile < t1n) {
        mma_segment<T1, WR, NT, MODE, H, RA, ST>(MAT(1, T1), n1, tile * TM, x, ldx, n_tok, K, y1, ldy1, bias1, smem,
                                              part, counter);
        return;
    }
    tile -= t1n;
    mma_segment<T2, WR, NT, MODE, H, RA, ST>(MAT(2, T2), n2, tile * TM, x, ldx, n_tok, K, y2, ldy2, bias2, smem,
                                          part, counter);
}

// y16 = f16(act(G x) * (U x)); ACT 0 = SiLU, 1 = GELU (tanh). Gate and up tiles share each x tile.
// The output feeds the down projection. Splits: part holds S x 128 x 8 NT floats per tile.
template <class T, int WR, int NT, int ACT, int RA, int ST, int MB = 0>  // MB: as mma_group's
__global__ void __launch_bounds__(NTHR, MB) mma_glu(PLANES(0), PLANES(1), int n, const u16* __restrict__ x, int ldx,
                                                int n_tok, int K, u16* y, int ldy, float* part, unsigned* counter) {
    extern __shared__ __align__(16) u16 smem[];
    const int row0 = blockIdx.x * 16 * WR, t0 = blockIdx.y * 8 * NT * (4 / WR);
    int kb, ke;
    k_range(K, kb, ke);
    float acc[2][NT][4];
    const Mat ms[2] = {MAT(0, T), MAT(1, T)};
    mma_tiles_any<T, WR, NT, 2, RA, ST>(ms, n, row0, 0, x, ldx, n_tok, t0, kb, ke, K, smem, acc);
    if (gridDim.z > 1 && !merge_splits<2, NT>(acc, part, counter)) return;
    glu_combine<ACT>(acc);
    for_each_c<WR, NT>(acc[0], row0, t0, [&](int r, int t, float v) {
        if (r < n && t < n_tok) y[(long)t * ldy + r] = f2h(v);
    });
}

#ifdef GGUF_INSTANTIATE_ALL
#define GROUP_ARGS PLANES(0), int, float*, int, const float*, PLANES(1), int, float*, int, const float*, \
    PLANES(2), int, float*, int, const float*, const u16*, int, int, int, float*, unsigned*
#define GLU_ARGS PLANES(0), PLANES(1), int, const u16*, int, int, int, u16*, int, float*, unsigned*
template __global__ void mma_group<TQ5_0, TQ5_0, TQ8_0, 4, 8, 0, 1, 1, 2>(GROUP_ARGS);
template __global__ void mma_group<TQ4_K, TQ4_K, TQ6_K, 4, 8, 0, 1, 1, 4>(GROUP_ARGS);
#define INST(T)                                                                                  \
    template __global__ void mma_group<T, T, T, 4, 8, 0, 1, 1, 4>(GROUP_ARGS);                   \
    template __global__ void mma_group<T, T, T, 4, 8, 1, 1, 1, 2>(GROUP_ARGS);                   \
    template __global__ void mma_group<T, T, T, 4, 8, 1, 1, 1, 3>(GROUP_ARGS);                   \
    template __global__ void mma_group<T, T, T, 1, 2, 1, 1, 1, 4>(GROUP_ARGS);                   \
    template __global__ void mma_group<T, T, T, 2, 1, 1, 1, 1, 4>(GROUP_ARGS);                   \
    template __global__ void mma_group<T, T, T, 4, 8, 1, 2, 1, 3>(GROUP_ARGS);                   \
    template __global__ void mma_group<T, T, T, 4, 8, 1, 2, 0, 2>(GROUP_ARGS);                   \
    template __global__ void mma_glu<T, 2, 4, 0, 1, 3>(GLU_ARGS);                                \
    template __global__ void mma_glu<T, 4, 8, 0, 1, 3>(GLU_ARGS);                                \
    template __global__ void mma_glu<T, 4, 8, 0, 1, 2>(GLU_ARGS);                                \
    template __global__ void mma_glu<T, 4, 8, 0, 0, 2>(GLU_ARGS);
INST(TF32) INST(TF16) INST(TBF16) INST(TQ4_0) INST(TQ4_1) INST(TQ5_0) INST(TQ5_1) INST(TQ8_0)
INST(TQ2_K) INST(TQ3_K) INST(TQ4_K) INST(TQ5_K) INST(TQ6_K) INST(TMXFP4) INST(TIQ4_NL) INST(TIQ4_XS)
INST(TIQ2_XXS) INST(TIQ2_XS) INST(TIQ2_S) INST(TIQ3_XXS) INST(TIQ3_S) INST(TIQ1_S) INST(TIQ1_M)
#endif
