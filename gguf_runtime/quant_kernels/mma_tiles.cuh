// Dequantizing matrix products on the tensor cores, the tile machinery of matmul_mma.cu (dense
// products) and moe_mma.cu (grouped by expert): y[t, n] (=|+=) sum_k W[n, k] x[t, k], W repacked
// quant planes, x f16 (written in f16 by the kernel before: norm, attention, GLU), y f32.
//
// A block (128 threads = 4 warps, WR x WC) owns TM = 16 WR weight rows (H such tiles in tall
// blocks) and TB = 8 NT WC tokens.
// Per 128-wide k step it dequantizes its W tile (the per-type decoders of quant_types.cuh) into
// shared memory as f16 beside the x tile, then runs mma.sync.m16n8k16 (f16 x f16 -> f32): warp
// (wr, wc) computes rows 16 wr .. +15 against tokens 8 NT wc .. +8 NT - 1. The next step's global
// loads (all of a thread's units and 16-byte x pieces, issued together at clamped, always valid
// addresses: straight-line code) go out before this step's MMAs, so their latency overlaps the
// arithmetic. grid.z > 1 splits K: each block a contiguous run of k steps; every thread stores its
// partial C fragments, and the last block of the tile to finish (a counter, reset by that block)
// adds the S fragments in split order (the same result on every run) and runs the epilogue. They
// read the quantized weights (cuBLAS would need f16 copies: 4x the bytes). Shared memory is
// dynamic: (TB + NM TM) (TK + 8) halves.
// RA = 1 and a type of mma_regs.cuh (Q4_K, Q6_K): the warps build their A fragments in registers
// from the raw quants instead; x and each step's raw weights go through shared memory in ST
// stages (ST TB LDX halves + ST NM TM WROW bytes).
#pragma once
#include "quant_types.cuh"

#define NTHR 128
#define TK 128
#define LDS (TK + 8)  // padded row (halves): conflict-free fragment loads

DEV void mma16816(float (&c)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// A block's k steps over [kb, ke) start at step blockIdx.x % n of its n and wrap around (k_next):
// blocks start together, and in k order every block read the same x columns at the same time,
// which made the x tiles cost more than the weights (RESULTS 237-238). Each block's order is
// fixed: reruns give the same bits.
DEV int k_first(int kb, int ke) {
    const int n = (ke - kb + TK - 1) / TK;
    return kb + (n > 1 ? (int)(blockIdx.x % n) : 0) * TK;
}
DEV int k_next(int k, int kb, int ke) { return k + TK < ke ? k + TK : kb; }

#include "mma_regs.cuh"  // Q4_K / Q6_K: A fragments built in registers (RA = 1 below)

// This thread's units of the W tile rows [row0, row0 + TM) x columns [k0, k0 + TK), in registers.
template <class T, int TM>
struct WRegs {
    static constexpr int UPR = TK / T::UE, N = (TM * UPR + NTHR - 1) / NTHR;
    typename T::Raw raw[N];

    // Loads only (unit and row clamped: every address valid, no branches); store() skips the extras.
    DEV void load(const Mat& m, int n_rows, int row0, int k0, int K) {
        const int upr = min(TK, K - k0) / T::UE;
#pragma unroll
        for (int i = 0; i < N; ++i) {
            const int idx = threadIdx.x + i * NTHR;
            T::load(m, min(row0 + idx / upr, n_rows - 1), k0 / T::UE + idx % upr, raw[i]);
        }
    }
    // Dequantize into Ws (f16, [TM][LDS]); columns past K (a partial last tile) are zero.
    DEV void store(int k0, int K, u16* Ws) const {
        const int width = min(TK, K - k0), upr = width / T::UE;
        if (width < TK)
            for (int idx = threadIdx.x; idx < TM * (TK - width) / 2; idx += NTHR) {
                const int r = idx / ((TK - width) / 2), c = width + 2 * (idx % ((TK - width) / 2));
                *reinterpret_cast<u32*>(Ws + r * LDS + c) = 0u;
            }
#pragma unroll
        for (int i = 0; i < N; ++i) {
            const int idx = threadIdx.x + i * NTHR;
            if (idx >= TM * upr) continue;
            const int r = idx / upr, u = k0 / T::UE + idx % upr;
#pragma unroll
            for (int p = 0; p < T::NP; ++p) {
                float w[16];
                piece<T>(raw[i], p, w);
                store16_f16(Ws + r * LDS + T::xoff(u, p) - k0, w);
            }
        }
    }
};

// This thread's 16-byte pieces of the x tile, tokens [t0, t0 + TB) x columns [k0, k0 + TK); 0 past
// n_tok and K (loaded from a clamped address, then replaced).
template <int TB>
struct XRegs {
    static constexpr int CPR = TK / 8, N = (TB * CPR + NTHR - 1) / NTHR;
    uint4 v[N];

    DEV void load(const u16* __restrict__ x, int ldx, int n_tok, int t0, int k0, int K) {
#pragma unroll
        for (int i = 0; i < N; ++i) {
            const int idx = threadIdx.x + i * NTHR, b = idx / CPR, c = k0 + (idx % CPR) * 8;
            const uint4 l = *reinterpret_cast<const uint4*>(x + (long)min(t0 + b, n_tok - 1) * ldx + min(c, K - 8));
            v[i] = (t0 + b < n_tok && c < K) ? l : make_uint4(0u, 0u, 0u, 0u);
        }
    }
    DEV void store(u16* Xs) const {
#pragma unroll
        for (int i = 0; i < N; ++i) {
            const int idx = threadIdx.x + i * NTHR;
            if (idx < TB * CPR) *reinterpret_cast<uint4*>(Xs + (idx / CPR) * LDS + (idx % CPR) * 8) = v[i];
        }
    }
};

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

// NM W tiles of one type against the same x tile: tile j is rows [row0 + j jstride, + 16 WR) of
// ms[j] (GLU: gate and up over the same rows, jstride 0; a tall tile: the same matrix, jstride
// 16 WR) x (8 NT (4 / WR) tokens), over columns [kb, ke), left in acc (mma16816's C layout).
// smem: the x tile, then the NM W tiles.
template <class T, int WR, int NT, int NM>
DEV void mma_tiles(const Mat (&ms)[NM], int n_rows, int row0, int jstride, const u16* x, int ldx, int n_tok, int t0,
                   int kb, int ke, int K, u16* smem, float (&acc)[NM][NT][4]) {
    constexpr int TM = 16 * WR, TB = 8 * NT * (4 / WR);
    u16* Xs = smem;
#pragma unroll
    for (int j = 0; j < NM; ++j)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) acc[j][nt][0] = acc[j][nt][1] = acc[j][nt][2] = acc[j][nt][3] = 0.f;
    WRegs<T, TM> w[NM];
    XRegs<TB> xr;
    const int n = (ke - kb + TK - 1) / TK;
    int k0 = k_first(kb, ke);
#pragma unroll
    for (int j = 0; j < NM; ++j) w[j].load(ms[j], n_rows, row0 + j * jstride, k0, K);
    pdl_enter();  // the first W tile loads before it (common.cuh)
    xr.load(x, ldx, n_tok, t0, k0, K);
    for (int i = 0; i < n; ++i) {
        __syncthreads();  // the previous step's MMAs are done with the tiles
#pragma unroll
        for (int j = 0; j < NM; ++j) w[j].store(k0, K, smem + (TB + j * TM) * LDS);
        xr.store(Xs);
        __syncthreads();
        const int kn = i + 1 < n ? k_next(k0, kb, ke) : k0;  // the next step (the last one reloads its own tile)
#pragma unroll
        for (int j = 0; j < NM; ++j) w[j].load(ms[j], n_rows, row0 + j * jstride, kn, K);
        xr.load(x, ldx, n_tok, t0, kn, K);
#pragma unroll
        for (int j = 0; j < NM; ++j) mma_step<WR, NT>(smem + (TB + j * TM) * LDS, Xs, acc[j]);
        k0 = kn;
    }
}

// mma_tiles, or mma_tiles_reg where RA and the type has register fragments (mma_regs.cuh).
template <class T, int WR, int NT, int NM, int RA, int ST>
DEV void mma_tiles_any(const Mat (&ms)[NM], int n_rows, int row0, int jstride, const u16* x, int ldx, int n_tok,
                       int t0, int kb, int ke, int K, u16* smem, float (&acc)[NM][NT][4]) {
    if constexpr (RA && RegA<T>::OK)
        mma_tiles_reg<T, WR, NT, NM, ST>(ms, n_rows, row0, jstride, x, ldx, n_tok, t0, kb, ke, K, smem, acc);
    else
        mma_tiles<T, WR, NT, NM>(ms, n_rows, row0, jstride, x, ldx, n_tok, t0, kb, ke, K, smem, acc);
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

// A GLU tile's outputs: acc[0] = act(acc[0]) * acc[1] (gate and up fragments; ACT 0 = SiLU, 1 = GELU (tanh)).
template <int ACT, int NT>
DEV void glu_combine(float (&acc)[2][NT][4]) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const float g = acc[0][nt][i];
            acc[0][nt][i] = (ACT == 0 ? silu_f(g) : gelu_tanh_f(g)) * acc[1][nt][i];
        }
}

// This block's k range: split blockIdx.z of gridDim.z, whole k steps each.
DEV void k_range(int K, int& kb, int& ke) {
    const int steps = (K + TK - 1) / TK, z = blockIdx.z, S = gridDim.z;
    kb = (z * steps / S) * TK;
    ke = min(K, ((z + 1) * steps / S) * TK);
}

#define PLANES(i) const u8* qs##i, const u8* qh##i, const u8* sc##i, const u8* d##i
#define MAT(i, T) Mat{qs##i, qh##i, sc##i, d##i, K / T::BLOCK}

// Split K: store this block's fragments; false unless this block is the tile's last, which then
// holds the sum of all splits' fragments (in split order) in acc.
template <int NM, int NT>
DEV bool merge_splits(float (&acc)[NM][NT][4], float* part, unsigned* counter) {
    __shared__ unsigned last;
    const int S = gridDim.z, tile = blockIdx.y * gridDim.x + blockIdx.x;
    float4* mine = reinterpret_cast<float4*>(part) + (((long)tile * S + blockIdx.z) * NTHR + threadIdx.x) * NM * NT;
#pragma unroll
    for (int j = 0; j < NM; ++j)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
            mine[j * NT + nt] = make_float4(acc[j][nt][0], acc[j][nt][1], acc[j][nt][2], acc[j][nt][3]);
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        last = atomicAdd(counter + tile, 1u) == (unsigned)S - 1;
        if (last) counter[tile] = 0u;  // ready for the next launch
    }
    __syncthreads();
    if (!last) return false;
    __threadfence();
#pragma unroll
    for (int j = 0; j < NM; ++j)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) acc[j][nt][0] = acc[j][nt][1] = acc[j][nt][2] = acc[j][nt][3] = 0.f;
    for (int z = 0; z < S; ++z) {
        const float4* p = reinterpret_cast<const float4*>(part) + (((long)tile * S + z) * NTHR + threadIdx.x) * NM * NT;
#pragma unroll
        for (int j = 0; j < NM; ++j)
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                const float4 v = __ldcg(p + j * NT + nt);  // from L2: other blocks wrote it
                acc[j][nt][0] += v.x; acc[j][nt][1] += v.y; acc[j][nt][2] += v.z; acc[j][nt][3] += v.w;
            }
    }
    return true;
}
