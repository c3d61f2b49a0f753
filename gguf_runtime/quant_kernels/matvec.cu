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
//
// Int8 activations (IO bit 0): int8 with a scale per 16 (matvec_block.cuh), the dot products dp4a
// on the weights' integer bytes; used where the f32 path is issue-bound (the 8B's matvecs). The
// norm is then applied by the matvec from the squares its producer stored: a residual matvec's q8
// epilogue (IO bit 1) writes the next norm's input, the GLU's the down projection's.
#include "matvec_block.cuh"

#define PLANES(i) const u8* qs##i, const u8* qh##i, const u8* sc##i, const u8* d##i
#define MAT(i, T) Mat{qs##i, qh##i, sc##i, d##i, K / T::BLOCK}

// RoPE and the KV-cache write fused into the QKV product (pos null: off). Needs R == 2 (a rope pair
// (2i, 2i+1) in one thread: the non-NEOX layout), no per-head norm, head_dim_v == head_dim; Q rows
// are rotated in place, K rows rotated into the cache at pos[b], V rows copied into the cache.
// Same arithmetic as layers.cu's rope_kv (double sincos, f32 rotation). kv16: 1 f16 caches, 0 float;
// 2 (quantized caches): K rows rotated in place as Q's and V rows stored, no cache write (the decode
// attention kernel quantizes the row into the cache: flash_decode.cu's own_kv).
struct RopeArgs {
    const int* pos; const int* seq; const int* table; int max_pages, page_size;
    const double* freq; int n_rot, hd, n_kv; void* kc; void* vc; int kv16;
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
        if (seg == 0 || ra.kv16 == 2) { y[(long)b * ldy + row0] = y0; y[(long)b * ldy + row0 + 1] = y1; continue; }
        const int pi = p / ra.page_size;
        const int page = pi < ra.max_pages ? ra.table[(long)ra.seq[b] * ra.max_pages + pi] : -1;
        if (page < 0) continue;  // past the sequence's pages: write nothing (as rope_kv)
        const long at = (((long)page * ra.n_kv + head) * ra.page_size + p % ra.page_size) * ra.hd + i;
        void* dst = seg == 1 ? ra.kc : ra.vc;
        if (ra.kv16) *reinterpret_cast<u32*>(static_cast<u16*>(dst) + at) = pack_h2(y0, y1);  // i even: aligned
        else { static_cast<float*>(dst)[at] = y0; static_cast<float*>(dst)[at + 1] = y1; }
    }
}

// A token grid (IO bit 5; launchers.token_groups): T tokens as T / B products of B tokens each (B = 1:
// one-token products; 2 or 4: token groups) in one launch of grid (T / B, row blocks), so token t's
// rows come out of the same code as a B-token launch's (a row's sums do not depend on the other
// tokens: a one-token step's bit for bit), and the blocks of the same rows run side by side (their
// weights shared in L2) instead of one thread carrying T tokens' chains. Other launches are
// one-dimensional (row blocks on x).
template <int IO>
DEV int grid_group() { return (IO & 32) ? (int)blockIdx.x : 0; }
template <int IO>
DEV int grid_block() { return (IO & 32) ? (int)blockIdx.y : (int)blockIdx.x; }
template <class P>
DEV P* at_token(P* p, int t, int ld) { return p ? p + (long)t * ld : p; }

// Warps per block: 4, or with a q8 epilogue (IO bit 1) as many as make 16 rows of R per group.
template <int R, int WG, int IO>
__host__ __device__ constexpr int block_warps() { return (IO & 2) ? 16 * WG / R : 4; }

// Blocks per SM the registers must allow with staged scales (IO bit 2): two of 16 warps (a Q6_K
// kernel took 74 registers unbounded: one block per SM), six of 4 warps with up to 2 rows per
// group: the 8B's QKV (768 blocks of 8 rows) then runs in one wave of 792. Its Q4_K/Q4_K/Q6_K
// form took 120 registers unbounded and 96 at five blocks (660: 1.16 waves); at six, 79 with no
// spill, and the single wave is faster. Else no bound (0: as if not given; the lm_head's 4 rows
// per group take 168 registers either way).
template <int R, int WG, int IO>
__host__ __device__ constexpr int min_blocks() {
    return (IO & 4) ? (block_warps<R, WG, IO>() >= 16 ? 2 : (R <= 2 ? 6 : 0)) : 0;
}

// MODE 0: y = W x (+ bias)   MODE 1: y += W x (+ bias) (the residual add; gpt-oss's O bias)
// IO bit 0: the activations are int8 (XQ), else f32 x (RMSNorm fused when nw is non-null);
// IO bit 1: a q8 epilogue also writes the int8 copy of the outputs (QOut; 16 rows per block);
// IO bit 3: the int8 activations come with their rests (q8_res: XQ's res, a second dp4a chain);
// IO bit 4: a q8 epilogue writes the outputs' rests too (QOut's res).
template <class T, int B, int R, int WG, int MODE, int IO, class S = NoStage>
DEV void mmv_segment(const Mat& mat, int n, int row0, const XIn& xi, int K, float* y, int ldy,
                     const float* bias, const RopeArgs& ra, int seg, const QOut& qo, S stage = S{}) {
    Mat m[R]; int row[R];
#pragma unroll
    for (int r = 0; r < R; ++r) { m[r] = mat; row[r] = min(row0 + r, n - 1); }
    float acc[R][B], qw = 1.f;
    if constexpr ((IO & 2) != 0)
        if (threadIdx.x < 16 * B) qw = q8_out_weight(qo, row0 - row0 % 16);  // weights only: before pdl_enter
    mmv_any<T, B, R, WG, IO & 9>(m, row, K, xi, acc, stage);
    if constexpr ((IO & 2) != 0) {  // residual add, then the int8 copy of the block's 16 new rows
        static_assert(MODE == 1, "q8 epilogue: residual mode");
        __shared__ float tile[B][16];
        if (group_leader<WG>())
#pragma unroll
            for (int r = 0; r < R; ++r)
#pragma unroll
                for (int b = 0; b < B; ++b) {
                    float* out = y + (long)b * ldy + row0 + r;
                    const float v = *out + (bias ? acc[r][b] + bias[row0 + r] : acc[r][b]);
                    *out = v;
                    tile[b][row0 % 16 + r] = v;
                }
        store_q8_piece<B, (IO & 16) != 0>(tile, row0 - row0 % 16, qo, qw);  // row0 % 16 == 0 in the threads that store
        return;
    }
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
            if (MODE == 1) *out += bias ? acc[r][b] + bv : acc[r][b];
            else *out = acc[r][b] + bv;
        }
    }
}

// IO bit 2 (Q4_K or Q6_K, int8 in): the block's P rows of one matrix (rows blk0 ..) have their
// scales staged in shared memory (quant_staged.cuh), decoded once, and run as the type's staged
// twin. Same values.
template <class T, int P, int B, int R, int WG, int MODE, int IO>
DEV void staged_segment(const Mat& mat, int n, int blk0, int row0, const XIn& xi, int K, float* y, int ldy,
                        const float* bias, const RopeArgs& ra, int seg, const QOut& qo) {
    static_assert((IO & 5) == 5, "staged scales: int8 in");
    using TS = typename Staged<T, P>::type;
    extern __shared__ float4 ks[];  // P rows x 4 nb float4s (the launcher's shared_mem)
    KStage<TS, P> st{mat.sc, mat.d, mat.sc, mat.d, blk0, n, mat.nb, 1, ks, {}};
    st.issue();
    mmv_segment<TS, B, R, WG, MODE, IO>(Mat{mat.qs, mat.qh, reinterpret_cast<const u8*>(ks), mat.d, mat.nb}, n,
                                        row0, xi, K, y, ldy, bias, ra, seg, qo, st);
}

// Up to three matrices that multiply the same x (Q, K and V), each of its own type; row groups take
// R rows of segment 0, then 1, then 2 (each segment's row count is a multiple of R * 4 / WG, so a
// block never straddles two segments).
// IO & 1: x and nw unused, XQ_ARGS is the input; IO & 2: QO_ARGS the int8 copy of the outputs;
// IO & 4: Q4_K or Q6_K matrices with int8 in, each block's scales staged (staged_segment);
// IO & 8: the int8 input has its rests (q8_res, at xq + xres); IO & 16: a q8 epilogue writes the
// outputs' rests (at oq + ores); IO & 32: a token grid (grid_group).
#define XQ_ARGS const u8* xq, int ldq, const float4* xs, int lds, int xres, int xnorm, float xeps
#define QO_ARGS u8* oq, int ldoq, float4* os, int ldos, int ores, const float* onw
template <class T0, class T1, class T2, int B, int R, int WG, int MODE, int IO>
__global__ void __launch_bounds__(32 * block_warps<R, WG, IO>(), min_blocks<R, WG, IO>()) mmv_group(
        PLANES(0), int n0, float* y0, int ldy0, const float* bias0,
        PLANES(1), int n1, float* y1, int ldy1, const float* bias1,
        PLANES(2), int n2, float* y2, int ldy2, const float* bias2,
        const float* __restrict__ x, int ldx, int K, const float* __restrict__ nw, float eps, XQ_ARGS, QO_ARGS,
        const int* rpos, const int* rseq, const int* rtable, int rmax_pages, int rpage_size,
        const double* rfreq, int rn_rot, int rhd, int rn_kv, void* rkc, void* rvc, int rkv16) {
    if constexpr ((IO & 32) != 0) {  // a token grid's group: its first token t's rows of x, y and the rest
        const int t = grid_group<IO>() * B;
        x = at_token(x, t, ldx); xq = at_token(xq, t, ldq); xs = at_token(xs, t, lds);
        y0 = at_token(y0, t, ldy0); y1 = at_token(y1, t, ldy1); y2 = at_token(y2, t, ldy2);
        oq = at_token(oq, t, ldoq); os = at_token(os, t, ldos); rpos = at_token(rpos, t, 1); rseq = at_token(rseq, t, 1);
    }
    const RopeArgs ra{rpos, rseq, rtable, rmax_pages, rpage_size, rfreq, rn_rot, rhd, rn_kv, rkc, rvc, rkv16};
    const XIn xi{x, ldx, nw, eps, XQ{xq, ldq, xs, lds, xres, xnorm, xeps}};
    const QOut qo{oq, ldoq, os, ldos, ores, onw};
    int row0 = group_row0<R, WG, block_warps<R, WG, IO>()>(grid_block<IO>());
    if constexpr ((IO & 4) != 0) {  // staged scales: the block's P rows (staged_segment)
        constexpr int P = R * block_warps<R, WG, IO>() / WG;
        int blk0 = grid_block<IO>() * P;
        if (blk0 < n0 || (IO & 2) != 0) {  // a q8 epilogue: one matrix
            staged_segment<T0, P, B, R, WG, MODE, IO>(MAT(0, T0), n0, blk0, row0, xi, K, y0, ldy0, bias0, ra, 0, qo);
            return;
        }
        blk0 -= n0; row0 -= n0;
        if (blk0 < n1) {
            staged_segment<T1, P, B, R, WG, MODE, IO>(MAT(1, T1), n1, blk0, row0, xi, K, y1, ldy1, bias1, ra, 1, qo);
            return;
        }
        blk0 -= n1; row0 -= n1;
        if (blk0 < n2)
            staged_segment<T2, P, B, R, WG, MODE, IO>(MAT(2, T2), n2, blk0, row0, xi, K, y2, ldy2, bias2, ra, 2, qo);
        return;
    }
    if (row0 < n0) { mmv_segment<T0, B, R, WG, MODE, IO>(MAT(0, T0), n0, row0, xi, K, y0, ldy0, bias0, ra, 0, qo); return; }
    row0 -= n0;
    if (row0 < n1) { mmv_segment<T1, B, R, WG, MODE, IO>(MAT(1, T1), n1, row0, xi, K, y1, ldy1, bias1, ra, 1, qo); return; }
    row0 -= n1;
    if (row0 < n2) mmv_segment<T2, B, R, WG, MODE, IO>(MAT(2, T2), n2, row0, xi, K, y2, ldy2, bias2, ra, 2, qo);
}

// Gate and up projections in one pass, y = act(gate x) * (up x); ACT 0 = SiLU, 1 = GELU (tanh).
// A row group takes R/2 rows of each. IO as mmv_group's.
template <class T, int B, int R, int WG, int ACT, int IO>
__global__ void __launch_bounds__(32 * block_warps<R / 2, WG, IO>(), min_blocks<R / 2, WG, IO>()) mmv_glu(PLANES(0), PLANES(1), int n, const float* __restrict__ x,
                                               int ldx, int K, float* y, int ldy, const float* __restrict__ nw,
                                               float eps, XQ_ARGS, QO_ARGS) {
    constexpr int H = R / 2;
    if constexpr ((IO & 32) != 0) {  // a token grid's group (mmv_group's note)
        const int t = grid_group<IO>() * B;
        x = at_token(x, t, ldx); xq = at_token(xq, t, ldq); xs = at_token(xs, t, lds);
        y = at_token(y, t, ldy); oq = at_token(oq, t, ldoq); os = at_token(os, t, ldos);
    }
    const int row0 = group_row0<H, WG, block_warps<H, WG, IO>()>(grid_block<IO>());
    Mat m[R]; int row[R];
#pragma unroll
    for (int r = 0; r < H; ++r) {
        m[r] = MAT(0, T); m[H + r] = MAT(1, T);
        row[r] = row[H + r] = min(row0 + r, n - 1);
    }
    float acc[R][B], qw = 1.f;
    constexpr bool QO = (IO & 2) != 0;
    if constexpr (QO)
        if (threadIdx.x < 16 * B) qw = q8_out_weight(QOut{oq, ldoq, os, ldos, ores, onw}, row0 - row0 % 16);
    if constexpr ((IO & 4) != 0) {  // staged scales (mmv_segment's note): 16 gate, then 16 up rows
        static_assert((IO & 7) == 7, "staged scales in the GLU: int8 in and out");
        using TS = typename Staged<T, 16>::type;
        extern __shared__ float4 ks[];  // 2 x 16 rows x 4 nb float4s (the launcher's shared_mem)
        const int nb = K / 256;
        KStage<TS, 16> st{sc0, d0, sc1, d1, grid_block<IO>() * 16, n, nb, 2, ks, {}};
        st.issue();
#pragma unroll
        for (int r = 0; r < H; ++r) {
            m[r].sc = reinterpret_cast<const u8*>(ks);
            m[H + r].sc = reinterpret_cast<const u8*>(ks + 64 * nb);
        }
        mmv_block_q8<TS, B, R, WG, (IO & 8) != 0>(m, row, K, XQ{xq, ldq, xs, lds, xres, xnorm, xeps}, acc, st);
    } else {
        mmv_any<T, B, R, WG, IO & 9>(m, row, K, XIn{x, ldx, nw, eps, XQ{xq, ldq, xs, lds, xres, xnorm, xeps}}, acc);
    }
    __shared__ float tile[QO ? B : 1][16];
    if (group_leader<WG>())
#pragma unroll
        for (int r = 0; r < H; ++r) {
            if (row0 + r >= n) break;
#pragma unroll
            for (int b = 0; b < B; ++b) {
                const float g = acc[r][b];
                const float v = (ACT == 0 ? silu_f(g) : gelu_tanh_f(g)) * acc[H + r][b];
                y[(long)b * ldy + row0 + r] = v;
                if constexpr (QO) tile[b][row0 % 16 + r] = v;
            }
        }
    if constexpr (QO) store_q8_piece<B, (IO & 16) != 0>(tile, row0 - row0 % 16, QOut{oq, ldoq, os, ldos, ores, onw}, qw);
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
#define ROPE_ARGS const int*, const int*, const int*, int, int, const double*, int, int, int, void*, void*, int
#define XQ_TYPES const u8*, int, const float4*, int, int, int, float
#define QO_TYPES u8*, int, float4*, int, int, const float*
#define GROUP(T, B, R, WG, MODE, IO)                                                           \
    template __global__ void mmv_group<T, T, T, B, R, WG, MODE, IO>(PLANES(0), int, float*, int, const float*, \
        PLANES(1), int, float*, int, const float*, PLANES(2), int, float*, int, const float*,  \
        const float*, int, int, const float*, float, XQ_TYPES, QO_TYPES, ROPE_ARGS);
#define GLU(T, B, R, WG, ACT, IO)                                                              \
    template __global__ void mmv_glu<T, B, R, WG, ACT, IO>(PLANES(0), PLANES(1), int, const float*, int, int, \
        float*, int, const float*, float, XQ_TYPES, QO_TYPES);
#define INST(T)                                                                                \
    GROUP(T, 1, 8, 4, 0, 0) GROUP(T, 8, 1, 1, 1, 0) GROUP(T, 2, 2, 1, 0, 0) GLU(T, 4, 2, 2, 1, 0) \
    template __global__ void embed_rows<T>(PLANES(0), int, const int*, int, float*, int, float); \
    template __global__ void dequant_f16<T>(PLANES(0), int, int, u16*);
#define INST_Q8(T) GROUP(T, 1, 4, 2, 0, 1) GROUP(T, 8, 1, 1, 1, 1) GROUP(T, 2, 2, 1, 0, 1) GLU(T, 3, 2, 1, 0, 1) \
    GROUP(T, 2, 4, 1, 1, 3) GROUP(T, 3, 2, 1, 1, 3) GROUP(T, 1, 1, 1, 1, 3) GLU(T, 1, 2, 1, 0, 3) GLU(T, 5, 4, 1, 1, 3)
INST(TF32) INST(TF16) INST(TBF16) INST(TQ4_0) INST(TQ4_1) INST(TQ5_0) INST(TQ5_1) INST(TQ8_0)
INST(TQ2_K) INST(TQ3_K) INST(TQ4_K) INST(TQ5_K) INST(TQ6_K) INST(TMXFP4) INST(TIQ4_NL) INST(TIQ4_XS)
INST_Q8(TMXFP4) INST_Q8(TIQ4_NL) INST_Q8(TIQ4_XS)
INST(TIQ2_XXS) INST(TIQ2_XS) INST(TIQ2_S) INST(TIQ3_XXS) INST(TIQ3_S) INST(TIQ1_S) INST(TIQ1_M)
INST_Q8(TIQ2_XXS) INST_Q8(TIQ2_XS) INST_Q8(TIQ2_S) INST_Q8(TIQ3_XXS) INST_Q8(TIQ3_S) INST_Q8(TIQ1_S) INST_Q8(TIQ1_M)
INST_Q8(TQ4_0) INST_Q8(TQ4_1) INST_Q8(TQ5_0) INST_Q8(TQ5_1) INST_Q8(TQ8_0)
INST_Q8(TQ2_K) INST_Q8(TQ3_K) INST_Q8(TQ4_K) INST_Q8(TQ5_K) INST_Q8(TQ6_K)
GROUP(TQ8_0, 1, 4, 2, 0, 9) GROUP(TQ5_0, 2, 4, 1, 1, 27) GLU(TQ4_K, 1, 4, 2, 0, 31) GROUP(TQ6_K, 8, 1, 1, 1, 9) \
    GROUP(TQ4_K, 1, 2, 1, 1, 19) GLU(TQ6_K, 2, 2, 1, 0, 11)
GLU(TQ4_K, 1, 4, 2, 0, 7) GROUP(TQ4_K, 1, 2, 2, 1, 7) GLU(TQ6_K, 2, 2, 1, 0, 7) GROUP(TQ6_K, 3, 2, 2, 1, 7)
GROUP(TQ4_K, 1, 2, 1, 0, 5) GROUP(TQ6_K, 2, 4, 1, 0, 5)
GROUP(TQ4_1, 1, 2, 1, 0, 33) GROUP(TQ4_1, 1, 1, 1, 1, 35) GLU(TQ4_1, 1, 2, 1, 0, 35) GROUP(TF32, 1, 2, 1, 0, 32)
GROUP(TQ4_K, 1, 2, 1, 0, 37) GROUP(TQ4_1, 4, 1, 2, 1, 35) GLU(TQ4_1, 4, 2, 1, 0, 35) GROUP(TQ4_1, 2, 2, 1, 0, 33)
#endif
