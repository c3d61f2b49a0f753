// The experts' products on the tensor cores, grouped by expert (prompts and large batches of a
// mixture of experts, as llama.cpp's mul_mat_id): moe.cu's moe_sort lists the slots (token, rank)
// by expert in tiles of up to TB = 8 NT (4 / WR) slots of one expert, {expert, start, count}; the
// slots' rows are gathered in that order in f16, and each block runs mma_tiles.cuh's tile of one
// expert's rows (row e * n + r of the stacked matrix) against one tile's rows. The grid's y is
// every tile entry moe_sort may write (the unused ones have count 0 and return at once), so one
// captured graph serves every routing.
#include "mma_tiles.cuh"

// xs[i, :n] = f16(h[order[i] / k, :n]): each slot's token row in the sorted order (one block a slot).
extern "C" __global__ void moe_gather_f16(const float* __restrict__ h, int ldh, const int* __restrict__ order, int k,
                                          int n, u16* __restrict__ xs, int ldxs, int slots) {
    pdl_enter();
    const int i = blockIdx.x;
    if (i >= slots) return;
    const float4* src = reinterpret_cast<const float4*>(h + (long)(order[i] / k) * ldh);
    uint2* dst = reinterpret_cast<uint2*>(xs + (long)i * ldxs);
    for (int c = threadIdx.x; c < n / 4; c += blockDim.x) {
        const float4 v = src[c];
        dst[c] = make_uint2(pack_h2(v.x, v.y), pack_h2(v.z, v.w));
    }
}

// y[start + b, :n] = f16(act(G_e x_b) * (U_e x_b)), b < count, x_b = x[start + b] (sorted order);
// ACT 0 = SiLU, 1 = GELU (tanh). grid = (row tiles of n, tile entries).
template <class T, int WR, int NT, int ACT, int RA, int ST>
__global__ void __launch_bounds__(NTHR) moe_mma_glu(PLANES(0), PLANES(1), int n, const int4* __restrict__ tiles,
                                                    const u16* __restrict__ x, int ldx, int K, u16* __restrict__ y,
                                                    int ldy) {
    extern __shared__ __align__(16) u16 smem[];
    pdl_enter();  // before the tile: moe_sort writes it (the weights' rows depend on it)
    const int4 tile = tiles[blockIdx.y];
    if (tile.z == 0) return;  // the whole block: an unused entry
    const int base = tile.x * n, row0 = blockIdx.x * 16 * WR;
    float acc[2][NT][4];
    const Mat ms[2] = {MAT(0, T), MAT(1, T)};
    mma_tiles_any<T, WR, NT, 2, RA, ST>(ms, base + n, base + row0, 0, x + (long)tile.y * ldx, ldx, tile.z, 0, 0, K,
                                        K, smem, acc);
    glu_combine<ACT>(acc);
    for_each_c<WR, NT>(acc[0], row0, 0, [&](int r, int t, float v) {
        if (r < n && t < tile.z) y[(long)(tile.y + t) * ldy + r] = f2h(v);
    });
}

// ys[order[start + b], :n] = W_e x_b, b < count: the products back in slot order (moe_combine sums
// them into the residual).
template <class T, int WR, int NT, int RA, int ST>
__global__ void __launch_bounds__(NTHR) moe_mma_down(PLANES(0), int n, const int4* __restrict__ tiles,
                                                     const int* __restrict__ order, const u16* __restrict__ x,
                                                     int ldx, int K, float* __restrict__ ys, int ldys) {
    extern __shared__ __align__(16) u16 smem[];
    pdl_enter();
    const int4 tile = tiles[blockIdx.y];
    if (tile.z == 0) return;
    const int base = tile.x * n, row0 = blockIdx.x * 16 * WR;
    float acc[1][NT][4];
    const Mat ms[1] = {MAT(0, T)};
    mma_tiles_any<T, WR, NT, 1, RA, ST>(ms, base + n, base + row0, 0, x + (long)tile.y * ldx, ldx, tile.z, 0, 0, K,
                                        K, smem, acc);
    for_each_c<WR, NT>(acc[0], row0, 0, [&](int r, int t, float v) {
        if (r < n && t < tile.z) ys[(long)order[tile.y + t] * ldys + r] = v;
    });
}

#ifdef GGUF_INSTANTIATE_ALL
#define P4 const u8*, const u8*, const u8*, const u8*
#define MOE_MMA(T)                                                                                          \
    template __global__ void moe_mma_glu<T, 4, 1, 0, 1, 2>(P4, P4, int, const int4*, const u16*, int, int, u16*, \
                                                           int);                                           \
    template __global__ void moe_mma_glu<T, 4, 8, 0, 0, 2>(P4, P4, int, const int4*, const u16*, int, int, u16*, \
                                                           int);                                           \
    template __global__ void moe_mma_down<T, 4, 4, 1, 2>(P4, int, const int4*, const int*, const u16*, int, int, \
                                                         float*, int);
MOE_MMA(TF32) MOE_MMA(TF16) MOE_MMA(TBF16) MOE_MMA(TQ4_0) MOE_MMA(TQ4_1) MOE_MMA(TQ5_0) MOE_MMA(TQ5_1)
MOE_MMA(TQ8_0) MOE_MMA(TQ2_K) MOE_MMA(TQ3_K) MOE_MMA(TQ4_K) MOE_MMA(TQ5_K) MOE_MMA(TQ6_K)
MOE_MMA(TMXFP4) MOE_MMA(TIQ4_NL) MOE_MMA(TIQ4_XS)
MOE_MMA(TIQ2_XXS) MOE_MMA(TIQ2_XS) MOE_MMA(TIQ2_S) MOE_MMA(TIQ3_XXS) MOE_MMA(TIQ3_S) MOE_MMA(TIQ1_S) MOE_MMA(TIQ1_M)
#endif
