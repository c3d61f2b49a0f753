// The inner loop of the matvec kernels (matvec.cu): one row group's dot products over K, for
// f32 activations (mmv_block, RMSNorm optionally fused) or int8 ones (mmv_block_q8, dp4a).
#pragma once
#include "quant_staged.cuh"

// Sum each acc[r][b] (and ssq[b] when has_ssq) over the group's 32 WG lanes: valid in the group leader.
template <int B, int R, int WG>
DEV void group_reduce(float (&acc)[R][B], float (&ssq)[B], bool has_ssq) {
    const int tid = threadIdx.x % (32 * WG);
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int b = 0; b < B; ++b) acc[r][b] = warp_sum(acc[r][b]);
    if (has_ssq)
#pragma unroll
        for (int b = 0; b < B; ++b) ssq[b] = warp_sum(ssq[b]);
    if (WG > 1) {
        __shared__ float red[32][R * B + B];  // per warp of the block (up to 1,024 threads)
        const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
        if (lane == 0) {
#pragma unroll
            for (int i = 0; i < R * B; ++i) red[warp][i] = acc[i / B][i % B];
#pragma unroll
            for (int b = 0; b < B; ++b) red[warp][R * B + b] = ssq[b];
        }
        __syncthreads();
        if (tid == 0) {
#pragma unroll
            for (int i = 0; i < R * B + B; ++i) {
                float v = red[warp][i];
#pragma unroll
                for (int w = 1; w < WG; ++w) v += red[warp + w][i];
                if (i < R * B) acc[i / B][i % B] = v;
                else ssq[i - R * B] = v;
            }
        }
    }
}

// Sum each acc[r][b] (and ssq[b] when has_ssq) over the thread's SUB-lane set of its warp (SUB < 32:
// sub-warp row groups, mmv_block_q8's): valid in the set's first lane.
template <int B, int R, int SUB>
DEV void sub_reduce(float (&acc)[R][B], float (&ssq)[B], bool has_ssq) {
#pragma unroll
    for (int o = SUB / 2; o > 0; o >>= 1) {
#pragma unroll
        for (int r = 0; r < R; ++r)
#pragma unroll
            for (int b = 0; b < B; ++b) acc[r][b] += __shfl_xor_sync(0xffffffffu, acc[r][b], o);
        if (has_ssq)
#pragma unroll
            for (int b = 0; b < B; ++b) ssq[b] += __shfl_xor_sync(0xffffffffu, ssq[b], o);
    }
}

template <int B, int R>
DEV void zero_sums(float (&acc)[R][B], float (&ssq)[B]) {
#pragma unroll
    for (int b = 0; b < B; ++b) ssq[b] = 0.f;
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int b = 0; b < B; ++b) acc[r][b] = 0.f;
}

// acc[r][b] (group-reduced, valid in the group leader) = sum_k W[row r][k] x'[b][k] for the R rows
// of m[r], x' = x * nw (nw null: x). nw non-null: the leader's acc is scaled by rsqrt(mean(x^2)+eps).
template <class T, int B, int R, int WG>
DEV void mmv_block(const Mat (&m)[R], const int (&row)[R], int K, const float* __restrict__ x, int ldx,
                   const float* __restrict__ nw, float eps, float (&acc)[R][B]) {
    const int tid = threadIdx.x % (32 * WG), units = K / T::UE;
    float ssq[B];
    zero_sums<B, R>(acc, ssq);
    // The first units' weights are loaded before pdl_enter (they overlap the previous kernel's end);
    // each later iteration's loads go out at the end of the one before.
    typename T::Raw raw[R];
    if (tid < units)
#pragma unroll
        for (int r = 0; r < R; ++r) T::load(m[r], row[r], tid, raw[r]);  // R independent loads in flight
    pdl_enter();
    for (int u = tid; u < units; u += 32 * WG) {
#pragma unroll
        for (int p = 0; p < T::NP; ++p) {
            const int off = T::xoff(u, p);
            float xv[B][16], sx[B], gv[16];
            if (nw) {
                const float4* gp = reinterpret_cast<const float4*>(nw + off);
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const float4 t = __ldg(gp + i);
                    gv[4 * i] = t.x; gv[4 * i + 1] = t.y; gv[4 * i + 2] = t.z; gv[4 * i + 3] = t.w;
                }
            }
#pragma unroll
            for (int b = 0; b < B; ++b) {
                const float4* xp = reinterpret_cast<const float4*>(x + (long)b * ldx + off);
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const float4 t = xp[i];
                    xv[b][4 * i] = t.x; xv[b][4 * i + 1] = t.y; xv[b][4 * i + 2] = t.z; xv[b][4 * i + 3] = t.w;
                }
                if (nw) {
#pragma unroll
                    for (int i = 0; i < 16; ++i) { ssq[b] = fmaf(xv[b][i], xv[b][i], ssq[b]); xv[b][i] *= gv[i]; }
                }
                sx[b] = 0.f;
#pragma unroll
                for (int i = 0; i < 16; i += 4) sx[b] += (xv[b][i] + xv[b][i + 1]) + (xv[b][i + 2] + xv[b][i + 3]);
            }
#pragma unroll
            for (int r = 0; r < R; ++r) {  // sum(w x) = d sum(q x) + m sum(x)
                float q[16], d, mo;
                T::qpiece(raw[r], p, q, d, mo);
#pragma unroll
                for (int b = 0; b < B; ++b) {
                    float s = 0.f;
#pragma unroll
                    for (int i = 0; i < 16; ++i) s = fmaf(q[i], xv[b][i], s);
                    acc[r][b] = fmaf(d, s, fmaf(mo, sx[b], acc[r][b]));
                }
            }
        }
        if (u + 32 * WG < units)
#pragma unroll
            for (int r = 0; r < R; ++r) T::load(m[r], row[r], u + 32 * WG, raw[r]);
    }
    group_reduce<B, R, WG>(acc, ssq, nw != nullptr);
    if (nw && tid == 0)
#pragma unroll
        for (int b = 0; b < B; ++b) {
            const float sc = rsqrtf(ssq[b] / (float)K + eps);
#pragma unroll
            for (int r = 0; r < R; ++r) acc[r][b] *= sc;
        }
}

// int8 activations (quant_int8.cuh): per token b, q[b * ldq + k] are the quantized x and s[b * lds +
// k / 16] = (d, the piece's s, sum of the piece's squares before quantization, d2) for the sixteen
// columns from 16 (k / 16); the row group reads 16 + 16 bytes per piece, not 64. RES (q8_res): q[b *
// ldq + res + k] are the rests' int8 (quant16_rest), a second dp4a chain with step d2. norm:
// the pieces are of x * w and the product is RMS-normalized (its scale from the summed squares of x,
// as mmv_block's fused norm): what a residual matvec's q8 epilogue writes for the next norm.
struct XQ { const u8* q; int ldq; const float4* s; int lds; int res; int norm; float eps; };

struct NoStage { DEV void finish() {} };  // no staged scales (else KStage, quant_staged.cuh)

// SUB < 32 (WG 1): the warp's lanes are 32 / SUB sets of SUB lanes, each with its own rows (the
// caller's row[] differs by set): for rows of at most SUB units, which would leave lanes idle.
template <class T, int B, int R, int WG, bool RES, class S = NoStage, int SUB = 32>
DEV void mmv_block_q8(const Mat (&m)[R], const int (&row)[R], int K, const XQ& xq, float (&acc)[R][B],
                      S stage = S{}) {
    static_assert(SUB == 32 || (WG == 1 && (SUB == 8 || SUB == 16)), "sub-warp sets: one warp, 8 or 16 lanes");
    constexpr int STEP = SUB < 32 ? SUB : 32 * WG;  // lanes of a row group
    const int tid = SUB < 32 ? (int)(threadIdx.x % SUB) : (int)(threadIdx.x % (32 * WG)), units = K / T::UE;
    float ssq[B];
    zero_sums<B, R>(acc, ssq);
    typename T::Raw raw[R];  // loaded before pdl_enter, as in mmv_block (loading more units ahead
    if (tid < units)         // was much slower on the 8B)
#pragma unroll
        for (int r = 0; r < R; ++r) T::load(m[r], row[r], tid, raw[r]);
    stage.finish();  // staged scales (KStage): decoded and synced before the first products
    pdl_enter();
    for (int u = tid; u < units; u += STEP) {
#pragma unroll
        for (int p = 0; p < T::NP; ++p) {
            const int off = T::xoff(u, p);
            uint4 xv[B], xr[RES ? B : 1]; float4 xs[B];
#pragma unroll
            for (int b = 0; b < B; ++b) {
                xv[b] = *reinterpret_cast<const uint4*>(xq.q + (long)b * xq.ldq + off);
                xs[b] = xq.s[(long)b * xq.lds + (off >> 4)];
                ssq[b] += xs[b].z;
                if constexpr (RES) xr[b] = *reinterpret_cast<const uint4*>(xq.q + (long)b * xq.ldq + xq.res + off);
            }
#pragma unroll
            for (int r = 0; r < R; ++r) {
                u32 q[4]; float d, mo;
                I8<T>::words(raw[r], p, q, d, mo);
#pragma unroll
                for (int b = 0; b < B; ++b) {
                    const int s = dp4a(q[3], xv[b].w, dp4a(q[2], xv[b].z, dp4a(q[1], xv[b].y, dp4a(q[0], xv[b].x, 0))));
                    acc[r][b] = fmaf(d * xs[b].x, i2f_small(s), fmaf(mo, xs[b].y, acc[r][b]));
                    if constexpr (RES) {
                        const int s2 = dp4a(q[3], xr[b].w, dp4a(q[2], xr[b].z, dp4a(q[1], xr[b].y, dp4a(q[0], xr[b].x, 0))));
                        acc[r][b] = fmaf(d * xs[b].w, i2f_small(s2), acc[r][b]);
                    }
                }
            }
        }
        if (u + STEP < units)
#pragma unroll
            for (int r = 0; r < R; ++r) T::load(m[r], row[r], u + STEP, raw[r]);
    }
    if constexpr (SUB < 32) sub_reduce<B, R, SUB>(acc, ssq, xq.norm != 0);
    else group_reduce<B, R, WG>(acc, ssq, xq.norm != 0);
    if (xq.norm && tid == 0)
#pragma unroll
        for (int b = 0; b < B; ++b) {
            const float sc = rsqrtf(ssq[b] / (float)K + xq.eps);
#pragma unroll
            for (int r = 0; r < R; ++r) acc[r][b] *= sc;
        }
}

// The int8 copy of a block's 16 consecutive output rows (the next matvec's input), written by a q8
// epilogue: v[b][i] (row base + i of token b) staged in shared memory by the row groups' leaders,
// then sixteen threads per token quantize it together (one value each, shuffles for the max and
// the sums: a single thread's serial pass was the block's tail), v times w when w is non-null (the
// next RMSNorm's weight, loaded before pdl_enter by q8_out_weight), and store the piece with the
// squares of v (the next norm's scale). Same values as quant16.
struct QOut { u8* q; int ldq; float4* s; int lds; int res; const float* w; };

DEV float q8_out_weight(const QOut& qo, int base) {  // this thread's weight (threads < 16 B)
    return qo.w ? __ldg(qo.w + base + (threadIdx.x & 15)) : 1.f;
}

template <int B, bool RES>
DEV void store_q8_piece(float (&tile)[B][16], int base, const QOut& qo, float w) {
    __syncthreads();
    if ((int)(threadIdx.x & ~31u) >= 16 * B) return;  // whole warps only: the shuffles take all 32 lanes
    const int b = threadIdx.x >> 4, e = threadIdx.x & 15;  // a token's 16 threads: half a warp
    const bool live_b = b < B;  // false in the upper half of the last warp when B is odd
    const float y = live_b ? tile[live_b ? b : 0][e] : 0.f;
    const float v = qo.w ? y * w : y;
    float amax = fabsf(v), ssq = y * y;
#pragma unroll
    for (int o = 8; o > 0; o >>= 1) {
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
        ssq += __shfl_xor_sync(0xffffffffu, ssq, o);
    }
    float inv, d;
    q8_step(amax, inv, d);
    const u32 bits = q8_bits(v, inv);
    int sum = q8_int(bits);
    u32 word = (bits & 0xFFu) << (8 * (e & 3));
#pragma unroll
    for (int o = 8; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
#pragma unroll
    for (int o = 2; o > 0; o >>= 1) word |= __shfl_xor_sync(0xffffffffu, word, o);
    float s = d * (float)sum, d2 = 0.f;
    u32 word2 = 0;
    if constexpr (RES) {  // the rest (quant16_rest), the same way
        const float r = q8_rest(v, d, bits);
        float amax2 = fabsf(r), inv2;
#pragma unroll
        for (int o = 8; o > 0; o >>= 1) amax2 = fmaxf(amax2, __shfl_xor_sync(0xffffffffu, amax2, o));
        q8_step(amax2, inv2, d2);
        const u32 bits2 = q8_bits(r, inv2);
        int sum2 = q8_int(bits2);
        word2 = (bits2 & 0xFFu) << (8 * (e & 3));
#pragma unroll
        for (int o = 8; o > 0; o >>= 1) sum2 += __shfl_xor_sync(0xffffffffu, sum2, o);
#pragma unroll
        for (int o = 2; o > 0; o >>= 1) word2 |= __shfl_xor_sync(0xffffffffu, word2, o);
        s = add_rn(s, mul_rn(d2, (float)sum2));
    }
    if (!live_b) return;
    u8* dst = qo.q + (long)b * qo.ldq + base;
    if ((e & 3) == 0) *reinterpret_cast<u32*>(dst + e) = word;
    if (RES && (e & 3) == 0) *reinterpret_cast<u32*>(dst + qo.res + e) = word2;
    if (e == 0) qo.s[(long)b * qo.lds + (base >> 4)] = make_float4(d, s, ssq, d2);
}

// The first row of this thread's row group, and whether the thread writes its results.
template <int R, int WG, int NW>
DEV int group_row0(int blk) { return (blk * (NW / WG) + threadIdx.x / (32 * WG)) * R; }
template <int R, int WG, int NW>
DEV int group_row0() { return group_row0<R, WG, NW>(blockIdx.x); }

template <int WG>
DEV bool group_leader() { return threadIdx.x % (32 * WG) == 0; }

// A row group's products over f32 x (XIn's x, RMSNorm fused when nw is non-null) or its int8
// activations (XIO bit 0; bit 3: with their rests): matvec.cu's and moe.cu's kernels.
struct XIn { const float* x; int ldx; const float* nw; float eps; XQ q; };

template <class T, int B, int R, int WG, int XIO, class S = NoStage>  // XIO: IO's bits 0 and 3
DEV void mmv_any(const Mat (&m)[R], const int (&row)[R], int K, const XIn& xi, float (&acc)[R][B], S stage = S{}) {
    if constexpr ((XIO & 1) != 0) mmv_block_q8<T, B, R, WG, (XIO & 8) != 0>(m, row, K, xi.q, acc, stage);
    else mmv_block<T, B, R, WG>(m, row, K, xi.x, xi.ldx, xi.nw, xi.eps, acc);
}

