// Dequantizing matrix-vector products for 1..8 tokens, embedding lookup, and dequantization
// to f16 (the prefill GEMM path). Weights are repacked planes (repack.py); x and y are f32.
//
// A block (4 warps) is 4 / WG row groups of WG warps; a row group owns R consecutive weight rows
// of one matrix. Its 32 WG lanes split the rows' units (quant_types.cuh) among them; a lane loads
// its slices of x once and applies them to all R rows, so x costs 4 / R bytes of L1 traffic per
// weight. WG follows the row length: one warp for short rows (no lane idles, no block sync), up to
// four for long ones. Per-row sums are reduced over the warp by shuffles, then (WG > 1) over the
// group's warps in shared memory.
//
// RMSNorm fused (nw != null): the product is W (x * nw) * rsqrt(mean(x^2) + eps). Each row group
// reads all of x anyway, so it sums x^2 in the same pass: no norm kernel, no staging of the
// normalized x, and the scale is applied to the finished dot products.
#include "quant_types.cuh"

#define PLANES(i) const u8* qs##i, const u8* qh##i, const u8* sc##i, const u8* d##i
#define MAT(i, T) Mat{qs##i, qh##i, sc##i, d##i, K / T::BLOCK}

// acc[r][b] (group-reduced, valid in the group leader) = sum_k W[row r][k] x'[b][k] for the R rows
// of m[r], x' = x * nw (nw null: x). nw non-null: the leader's acc is scaled by rsqrt(mean(x^2)+eps).
template <class T, int B, int R, int WG>
DEV void mmv_block(const Mat (&m)[R], const int (&row)[R], int K, const float* __restrict__ x, int ldx,
                   const float* __restrict__ nw, float eps, float (&acc)[R][B]) {
    const int tid = threadIdx.x % (32 * WG), units = K / T::UE;
    float ssq[B];
#pragma unroll
    for (int b = 0; b < B; ++b) ssq[b] = 0.f;
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int b = 0; b < B; ++b) acc[r][b] = 0.f;
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
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int b = 0; b < B; ++b) acc[r][b] = warp_sum(acc[r][b]);
    if (nw)
#pragma unroll
        for (int b = 0; b < B; ++b) ssq[b] = warp_sum(ssq[b]);
    if (WG > 1) {
        __shared__ float red[4][R * B + B];
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
    if (nw && tid == 0)
#pragma unroll
        for (int b = 0; b < B; ++b) {
            const float sc = rsqrtf(ssq[b] / (float)K + eps);
#pragma unroll
            for (int r = 0; r < R; ++r) acc[r][b] *= sc;
        }
}

// RoPE and the KV-cache write fused into the QKV product (pos null: off). Needs R == 2 (a rope pair
// (2i, 2i+1) in one thread: the non-NEOX layout), no per-head norm, head_dim_v == head_dim; Q rows
// are rotated in place, K rows rotated into the cache at pos[b], V rows copied into the cache.
// Same arithmetic as layers.cu's rope_kv (double sincos, f32 rotation).
struct RopeArgs {
    const int* pos; const int* seq; const int* table; int max_pages, page_size;
    const double* freq; int n_rot, hd, n_kv; float* kc; float* vc;
};

template <int R, int B>
DEV void rope_store(const RopeArgs& ra, int seg, int row0, float (&v)[R][B], float* y, int ldy) {
    const int head = row0 / ra.hd, i = row0 % ra.hd;
#pragma unroll
    for (int b = 0; b < B; ++b) {
        if (ra.seq[b] < 0) continue;
        const int p = ra.pos[b];
        float y0 = v[0][b], y1 = v[1][b];
        if (seg < 2 && i < ra.n_rot) {
            double sn, cs;
            sincos((double)p * ra.freq[i >> 1], &sn, &cs);
            const float cf = (float)cs, sf = (float)sn;
            const float a = y0 * cf - y1 * sf, c = y0 * sf + y1 * cf;
            y0 = a; y1 = c;
        }
        if (seg == 0) { y[(long)b * ldy + row0] = y0; y[(long)b * ldy + row0 + 1] = y1; continue; }
        const int pi = p / ra.page_size;
        const int page = pi < ra.max_pages ? ra.table[(long)ra.seq[b] * ra.max_pages + pi] : -1;
        if (page < 0) continue;  // past the sequence's pages: write nothing (as rope_kv)
        float* dst = (seg == 1 ? ra.kc : ra.vc) + (((long)page * ra.n_kv + head) * ra.page_size + p % ra.page_size) * ra.hd + i;
        dst[0] = y0; dst[1] = y1;
    }
}

// The first row of this thread's row group, and whether the thread writes its results.
template <int R, int WG>
DEV int group_row0() { return (blockIdx.x * (4 / WG) + threadIdx.x / (32 * WG)) * R; }

template <int WG>
DEV bool group_leader() { return threadIdx.x % (32 * WG) == 0; }

// MODE 0: y = W x (+ bias)   MODE 1: y += W x (the residual add)
template <class T, int B, int R, int WG, int MODE>
DEV void mmv_segment(const Mat& mat, int n, int row0, const float* x, int ldx, int K, float* y, int ldy,
                     const float* bias, const float* nw, float eps, const RopeArgs& ra, int seg) {
    Mat m[R]; int row[R];
#pragma unroll
    for (int r = 0; r < R; ++r) { m[r] = mat; row[r] = min(row0 + r, n - 1); }
    float acc[R][B];
    mmv_block<T, B, R, WG>(m, row, K, x, ldx, nw, eps, acc);
    if (!group_leader<WG>()) return;
    if constexpr (R == 2 && MODE == 0) {
        if (ra.pos) {  // the launcher guarantees whole row groups (n % 8 == 0)
#pragma unroll
            for (int r = 0; r < R; ++r) {
                const float bv = bias ? bias[row0 + r] : 0.f;
#pragma unroll
                for (int b = 0; b < B; ++b) acc[r][b] += bv;
            }
            rope_store<R, B>(ra, seg, row0, acc, y, ldy);
            return;
        }
    }
#pragma unroll
    for (int r = 0; r < R; ++r) {
        if (row0 + r >= n) break;
        const float bv = bias ? bias[row0 + r] : 0.f;
#pragma unroll
        for (int b = 0; b < B; ++b) {
            float* out = y + (long)b * ldy + row0 + r;
            if (MODE == 1) *out += acc[r][b];
            else *out = acc[r][b] + bv;
        }
    }
}

// Up to three matrices that multiply the same x (Q, K and V), each of its own type; row groups take
// R rows of segment 0, then 1, then 2 (each segment's row count is a multiple of R * 4 / WG, so a
// block never straddles two segments).
template <class T0, class T1, class T2, int B, int R, int WG, int MODE>
__global__ void __launch_bounds__(128) mmv_group(
        PLANES(0), int n0, float* y0, int ldy0, const float* bias0,
        PLANES(1), int n1, float* y1, int ldy1, const float* bias1,
        PLANES(2), int n2, float* y2, int ldy2, const float* bias2,
        const float* __restrict__ x, int ldx, int K, const float* __restrict__ nw, float eps,
        const int* rpos, const int* rseq, const int* rtable, int rmax_pages, int rpage_size,
        const double* rfreq, int rn_rot, int rhd, int rn_kv, float* rkc, float* rvc) {
    const RopeArgs ra{rpos, rseq, rtable, rmax_pages, rpage_size, rfreq, rn_rot, rhd, rn_kv, rkc, rvc};
    int row0 = group_row0<R, WG>();
    if (row0 < n0) { mmv_segment<T0, B, R, WG, MODE>(MAT(0, T0), n0, row0, x, ldx, K, y0, ldy0, bias0, nw, eps, ra, 0); return; }
    row0 -= n0;
    if (row0 < n1) { mmv_segment<T1, B, R, WG, MODE>(MAT(1, T1), n1, row0, x, ldx, K, y1, ldy1, bias1, nw, eps, ra, 1); return; }
    row0 -= n1;
    if (row0 < n2) mmv_segment<T2, B, R, WG, MODE>(MAT(2, T2), n2, row0, x, ldx, K, y2, ldy2, bias2, nw, eps, ra, 2);
}

// Gate and up projections in one pass, y = act(gate x) * (up x); ACT 0 = SiLU, 1 = GELU (tanh).
// A row group takes R/2 rows of each.
template <class T, int B, int R, int WG, int ACT>
__global__ void __launch_bounds__(128) mmv_glu(PLANES(0), PLANES(1), int n, const float* __restrict__ x,
                                               int ldx, int K, float* y, int ldy, const float* __restrict__ nw,
                                               float eps) {
    constexpr int H = R / 2;
    const int row0 = group_row0<H, WG>();
    Mat m[R]; int row[R];
#pragma unroll
    for (int r = 0; r < H; ++r) {
        m[r] = MAT(0, T); m[H + r] = MAT(1, T);
        row[r] = row[H + r] = min(row0 + r, n - 1);
    }
    float acc[R][B];
    mmv_block<T, B, R, WG>(m, row, K, x, ldx, nw, eps, acc);
    if (!group_leader<WG>()) return;
#pragma unroll
    for (int r = 0; r < H; ++r) {
        if (row0 + r >= n) break;
#pragma unroll
        for (int b = 0; b < B; ++b) {
            const float g = acc[r][b];
            y[(long)b * ldy + row0 + r] = (ACT == 0 ? silu_f(g) : gelu_tanh_f(g)) * acc[H + r][b];
        }
    }
}

// x[t] = scale * row tokens[t] of the embedding matrix (one block per token).
template <class T>
__global__ void embed_rows(PLANES(0), int K, const int* __restrict__ tokens, int n_vocab, float* x, int ldx,
                           float scale) {
    const Mat m = MAT(0, T);
    pdl_enter();
    int tok = tokens[blockIdx.x];
    tok = tok < 0 ? 0 : (tok >= n_vocab ? n_vocab - 1 : tok);
    float* out = x + (long)blockIdx.x * ldx;
    for (int u = threadIdx.x; u < K / T::UE; u += blockDim.x) {
        typename T::Raw raw;
        T::load(m, tok, u, raw);
#pragma unroll
        for (int p = 0; p < T::NP; ++p) {
            float w[16];
            piece<T>(raw, p, w);
            float4* o = reinterpret_cast<float4*>(out + T::xoff(u, p));
#pragma unroll
            for (int i = 0; i < 4; ++i)
                o[i] = make_float4(w[4 * i] * scale, w[4 * i + 1] * scale, w[4 * i + 2] * scale, w[4 * i + 3] * scale);
        }
    }
}

// out[rows, K] (f16) = the dequantized matrix, for cuBLAS during prefill.
template <class T>
__global__ void dequant_f16(PLANES(0), int rows, int K, u16* __restrict__ out) {
    const Mat m = MAT(0, T);
    const int units = K / T::UE;
    pdl_enter();
    const long idx = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long)rows * units) return;
    const int row = (int)(idx / units), u = (int)(idx % units);
    typename T::Raw raw;
    T::load(m, row, u, raw);
#pragma unroll
    for (int p = 0; p < T::NP; ++p) {
        float w[16];
        piece<T>(raw, p, w);
        store16_f16(out + (long)row * K + T::xoff(u, p), w);
    }
}

#ifdef GGUF_INSTANTIATE_ALL  // nvcc syntax check in CI: one instantiation of each kernel per type
#define ROPE_ARGS const int*, const int*, const int*, int, int, const double*, int, int, int, float*, float*
#define INST(T)                                                                              \
    template __global__ void mmv_group<T, T, T, 1, 8, 4, 0>(PLANES(0), int, float*, int, const float*, \
        PLANES(1), int, float*, int, const float*, PLANES(2), int, float*, int, const float*,       \
        const float*, int, int, const float*, float, ROPE_ARGS);                             \
    template __global__ void mmv_group<T, T, T, 8, 1, 1, 1>(PLANES(0), int, float*, int, const float*, \
        PLANES(1), int, float*, int, const float*, PLANES(2), int, float*, int, const float*,       \
        const float*, int, int, const float*, float, ROPE_ARGS);                             \
    template __global__ void mmv_group<T, T, T, 2, 2, 1, 0>(PLANES(0), int, float*, int, const float*, \
        PLANES(1), int, float*, int, const float*, PLANES(2), int, float*, int, const float*,       \
        const float*, int, int, const float*, float, ROPE_ARGS);                             \
    template __global__ void mmv_glu<T, 4, 2, 2, 1>(PLANES(0), PLANES(1), int, const float*, int, int, float*, int, \
        const float*, float);                                                                \
    template __global__ void embed_rows<T>(PLANES(0), int, const int*, int, float*, int, float); \
    template __global__ void dequant_f16<T>(PLANES(0), int, int, u16*);
INST(TF32) INST(TF16) INST(TBF16) INST(TQ4_0) INST(TQ4_1) INST(TQ5_0) INST(TQ5_1) INST(TQ8_0)
INST(TQ2_K) INST(TQ3_K) INST(TQ4_K) INST(TQ5_K) INST(TQ6_K)
#endif
